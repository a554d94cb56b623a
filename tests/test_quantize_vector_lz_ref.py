"""The torch twins ``kernels/quantize_ref.py`` and ``kernels/vector_lz_ref.py`` against the
Triton launchers they stand for, call for call.

Each test runs the real device path (``backend="triton"``; on CPU tensors the Triton
interpreter, switched on by conftest.py before triton is imported), records every call the
orchestration makes to ``quantize_tiles`` / ``representatives`` (compress) or ``decode_outputs`` /
``unpack_refs_blocks`` (decompress), replays it on the twin and asserts the result and the
arguments after the call are the launcher's, bit for bit. What a launcher leaves unspecified
(``torch.empty`` it does not write) is masked out, and only that.
"""

from __future__ import annotations

import contextlib
import math
from types import ModuleType

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton launchers cannot run")

from helpers import DEVICE, INTERPRETER_WARNINGS, as_tensor, parse, repeated_rows, with_checksum
from kernel_calls import Call, assert_same, recorded_calls, replay

from torchrec_lossy.codec import CodecConfig, CodecError, compress_with_stats, decompress
from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import encode_columns as ec
from torchrec_lossy.codec.bounds import BoundKind
from torchrec_lossy.codec.format import ESCAPE_SYMBOL, REFS_FIXED, REFS_FLAGGED, SEGMENT_HEADER
from torchrec_lossy.kernels import quantize, quantize_ref, vector_lz, vector_lz_ref

pytestmark = INTERPRETER_WARNINGS

TRITON = CodecConfig(backend="triton", huffman_chunk_symbols=64)


def _written_halves(call: Call) -> torch.Tensor:
    """decode_outputs: which int16 halves of its output the launcher writes (the rest of its
    ``torch.empty`` buffer, a 16-bit block's padding, is unspecified)."""
    cols = call.args[1]
    out_base, dtype_code, out_off = (
        cols.column(f).cpu() for f in (dc.OUT_BASE, dc.DTYPE, dc.OUT_OFF)
    )
    mask = torch.zeros(2 * call.args[5], dtype=torch.bool)
    for b, (code, start) in enumerate(zip(dtype_code.tolist(), out_off.tolist(), strict=True)):
        n = int(out_base[b + 1] - out_base[b]) * (2 if code == 1 else 1)
        mask[2 * start : 2 * start + n] = True
    return mask


def _specified_ids(call: Call) -> torch.Tensor:
    """unpack_refs_blocks: the ids the launcher specifies (not those of a ``bad`` block)."""
    bad = call.args_after[1].column(dc.REFS_BAD).cpu()
    id_base, rows = (call.args[1].column(f).cpu() for f in (dc.ID_BASE, dc.ROWS))
    mask = torch.ones(call.args[2], dtype=torch.bool)
    for b in torch.nonzero(bad).flatten().tolist():
        mask[int(id_base[b]) : int(id_base[b] + rows[b])] = False
    return mask


def _compared(name: str, call: Call, result: torch.Tensor) -> torch.Tensor:
    """The part of a result the launcher specifies (other elements zeroed)."""
    if name == "decode_outputs":
        return torch.where(_written_halves(call), result.cpu().view(torch.int16), 0)
    if name == "unpack_refs_blocks":
        return torch.where(_specified_ids(call), result.cpu(), 0)
    return result


def assert_twin_matches(calls: list[Call], twin: ModuleType) -> None:
    """Replays every recorded call on ``twin``'s function of the same name; asserts its result
    and the arguments after it (buffers it writes into) equal the launcher's."""
    assert calls, "the device path made no call to record"
    for i, call in enumerate(calls):
        result, args, kwargs = replay(call, getattr(twin, call.name))
        where = f"{call.name} call {i}"
        expected = call.result
        if isinstance(result, torch.Tensor):
            result, expected = (_compared(call.name, call, r) for r in (result, expected))
        assert_same(result, expected, f"{where} result")
        assert_same(args, call.args_after, f"{where} args")
        assert_same(kwargs, call.kwargs_after, f"{where} kwargs")


def compress_recorded(
    monkeypatch: pytest.MonkeyPatch,
    blocks: list[torch.Tensor],
    bounds: list[float],
    config: CodecConfig = TRITON,
    kinds: list[int] | None = None,
) -> tuple[torch.Tensor, list[Call], list[Call]]:
    """Compresses on the device path; returns (payload, quantize_tiles calls,
    representatives_pair calls), each already checked against its twin."""
    with (
        recorded_calls(monkeypatch, quantize, ["quantize_tiles"]) as q_calls,
        recorded_calls(monkeypatch, vector_lz, ["representatives_pair"]) as lz_calls,
    ):
        payload, _ = compress_with_stats([b.to(DEVICE) for b in blocks], bounds, config, kinds)
    assert_twin_matches(q_calls, quantize_ref)
    assert_twin_matches(lz_calls, vector_lz_ref)
    return payload, q_calls, lz_calls


def decompress_recorded(
    monkeypatch: pytest.MonkeyPatch, payload: torch.Tensor
) -> tuple[list[Call], list[Call]]:
    """Decodes on the device path (a CodecError is swallowed: the launchers ran before it); returns
    (decode_outputs calls, unpack_refs_blocks calls), each already checked against its twin."""
    with (
        recorded_calls(monkeypatch, quantize, ["decode_outputs"]) as out_calls,
        recorded_calls(monkeypatch, vector_lz, ["unpack_refs_blocks"]) as ref_calls,
        contextlib.suppress(CodecError),
    ):
        decompress(payload.to(DEVICE), backend="triton")
    assert_twin_matches(out_calls, quantize_ref)
    if ref_calls:
        assert_twin_matches(ref_calls, vector_lz_ref)
    return out_calls, ref_calls


def mixed_blocks() -> tuple[list[torch.Tensor], list[float]]:
    """Every dtype, lossless and lossy, escapes, repeats, empty and odd-sized blocks."""
    g = torch.Generator().manual_seed(5)
    gauss = torch.randn(9, 5, generator=g)
    outliers = gauss.clone()
    outliers[1, 2], outliers[4, 0], outliers[6, 3], outliers[7, 4] = math.nan, math.inf, -1e30, 0.5
    few = torch.randn(3, 6, generator=g)
    many = torch.randn(40, 8, generator=g)
    far = torch.full((4, 3), 1e6) + torch.randn(4, 3, generator=g)  # center out of range
    blocks = [
        outliers,  # quant with escapes
        torch.randn(15, 3, generator=g).half(),  # 45 halves: an odd count pads its last word
        repeated_rows(few.bfloat16(), 40, 1),  # quant + lz, fixed refs
        torch.cat([many, many[:8]]),  # mostly distinct rows: quant + lz, flagged refs
        repeated_rows(few.half(), 11, 2),  # lossless lz
        torch.zeros(0, 4),  # no rows
        torch.zeros(3, 0),  # rows without elements
        far,
        gauss.bfloat16()[:3],  # lossless raw
    ]
    bounds = [0.05, 0.1, 0.05, 0.05, 0.0, 0.1, 0.1, 1e-3, 0.0]
    return blocks, bounds


def _all_symbols(calls: list[Call]) -> torch.Tensor:
    return torch.cat([c.result[0].cpu() for c in calls])


# ------------------------------------------------------------------------------------------------
# Compress: quantize_tiles and representatives_pair


def test_mixed_blocks_compress_and_decode_match(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, bounds = mixed_blocks()
    payload, q_calls, lz_calls = compress_recorded(monkeypatch, blocks, bounds)
    # The calls cover what they should: escapes and every dtype; raw and symbol dedupe; repeats.
    assert (_all_symbols(q_calls) == ESCAPE_SYMBOL).any()
    assert {int(c) for call in q_calls for c in call.args[2].column(ec.DTYPE).tolist()} == {1, 2, 3}
    assert [c.result[0].shape[0] for c in lz_calls] == [2]  # symbol and raw dedupe, one call
    assert all((c.result[1][d] == 0).any() for c in lz_calls for d in (0, 1))  # repeats
    out_calls, ref_calls = decompress_recorded(monkeypatch, payload)
    modes = {int(m) for c in out_calls for m in c.args[1].column(dc.MODE).tolist()}
    assert {0, 1, 2, 3} <= modes, modes
    assert any(c.args[1].n_fixed and c.args[1].n_flagged for c in ref_calls)  # fixed and flagged


def test_value_bounds_match(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(24, 8, generator=g) * torch.logspace(-2, 2, 8)
    x[2, 1], x[5, 5], x[7, 0], x[8, 1] = 0.0, -0.0, math.nan, 1e-42  # zeros, NaN, a denormal
    blocks = [x, x.half(), repeated_rows(x[:3].bfloat16(), 30, 3)]
    kinds = [BoundKind.VALUE] * 3
    payload, q_calls, _ = compress_recorded(monkeypatch, blocks, [0.1, 0.1, 0.1], kinds=kinds)
    assert all(call.args[2].column(ec.VALUE).tolist() == [1, 1, 1] for call in q_calls)
    out_calls, _ = decompress_recorded(monkeypatch, payload)
    modes = [m for c in out_calls for m in c.args[1].column(dc.MODE).tolist()]
    assert any(m & 4 for m in modes)  # decoded on the value grid


def test_stochastic_rounding_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(9)
    blocks = [torch.randn(10, 7, generator=g), torch.randn(6, 5, generator=g).bfloat16()]
    cfg = CodecConfig(backend="triton", rounding="stochastic", seed=123)
    payload, q_calls, _ = compress_recorded(monkeypatch, blocks, [0.05, 0.1], cfg)
    assert all((call.args[2].column(ec.SR_KEY) >= 0).all() for call in q_calls)  # not -1
    decompress_recorded(monkeypatch, payload)


def test_several_tiles_per_block_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small block beside a large one: the small one's tiles are the large one's size, the
    large one spans several (stochastic, so the draw's counter restarts per block, not tile)."""
    g = torch.Generator().manual_seed(4)
    blocks = [torch.randn(3, 2, generator=g), torch.randn(40, 110, generator=g)]
    cfg = CodecConfig(backend="triton", rounding="stochastic", seed=5)
    _, q_calls, _ = compress_recorded(monkeypatch, blocks, [0.1, 0.1], cfg)
    assert any(call.args[1].shape[0] > 2 for call in q_calls)


def test_lossless_and_empty_payloads_match(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(6)
    few = torch.randn(4, 3, generator=g)
    blocks = [repeated_rows(few, 12, 1), torch.zeros(0, 3), repeated_rows(few.bfloat16(), 7, 2)]
    payload, q_calls, lz_calls = compress_recorded(monkeypatch, blocks, [0.0, 0.0, 0.0])
    assert all(c.args[1].numel() == 0 for c in q_calls)  # nothing quantized: no tiles
    assert any((c.result[1][1] == 0).any() for c in lz_calls)  # repeats of the raw bits
    decompress_recorded(monkeypatch, payload)


# ------------------------------------------------------------------------------------------------
# Decompress: corrupt references (the launcher's status rows)


def _lossless_lz_payload(rows: int, distinct: int, seed: int) -> tuple[bytes, int, int]:
    """A one-block lossless-LZ payload, its references' byte offset and reference mode."""
    g = torch.Generator().manual_seed(seed)
    vectors = torch.randn(distinct, 5, generator=g)
    block = torch.cat(
        [vectors, vectors[torch.randint(0, distinct, (rows - distinct,), generator=g)]]
    )
    payload, (stats,) = compress_with_stats([block], [0.0])
    assert stats.mode == "lz"
    buf = payload.numpy().tobytes()
    seg_start = parse(buf)[2][0][0]
    header = np.frombuffer(buf[seg_start : seg_start + 32], SEGMENT_HEADER)[0]
    return buf, seg_start + 32, int(header["ref_mode"])  # no codebook before lz references


def _set_bits(buf: bytearray, at: int, pos: int, width: int, value: int) -> None:
    """Sets ``width`` bits MSB-first at bit ``pos`` of the two little-endian uint32 words at
    ``at`` (the references' first 64 bits)."""
    window = int.from_bytes(buf[at : at + 4], "little") << 32
    window |= int.from_bytes(buf[at + 4 : at + 8], "little")
    shift = 64 - pos - width
    window = (window & ~(((1 << width) - 1) << shift)) | (value << shift)
    buf[at : at + 8] = (window >> 32).to_bytes(4, "little") + (window & 0xFFFFFFFF).to_bytes(
        4, "little"
    )


# (reference mode, rows, distinct vectors, the edit: (bit, width, value) in the first 64 bits).
# Flagged references of 24 rows, 20 vectors: 20 flags 1, then 4 x (flag 0, 5-bit id): 40 bits.
CORRUPTIONS = {
    "fixed_id_out_of_range": (REFS_FIXED, 24, 3, (0, 32, 2**32 - 1)),  # 2-bit ids of 3 vectors
    "flagged_too_many_vectors": (REFS_FLAGGED, 24, 20, (0, 32, 2**32 - 1)),  # every row new
    "flagged_id_is_n_unique": (REFS_FLAGGED, 24, 20, (21, 5, 20)),  # row 20's id
    "flagged_too_few_vectors": (REFS_FLAGGED, 24, 20, (0, 49, ((1 << 19) - 1) << 30)),  # 19 new
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_references_match(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """References the decoder must reject: the twin raises the same ``bad`` rows."""
    want_mode, rows, distinct, (pos, width, value) = CORRUPTIONS[name]
    buf, at, mode = _lossless_lz_payload(rows, distinct, seed=want_mode)
    assert mode == want_mode
    corrupt = bytearray(buf)
    _set_bits(corrupt, at, pos, width, value)
    _, ref_calls = decompress_recorded(monkeypatch, as_tensor(with_checksum(bytes(corrupt))))
    assert [c.args_after[1].column(dc.REFS_BAD).tolist() for c in ref_calls] == [[1]]


def test_bit_flips_in_references_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Single bit flips across both packings' references: decoded or rejected, the twin agrees."""
    rng = np.random.default_rng(2)
    flagged = 0
    for want_mode, (rows, distinct) in ((REFS_FIXED, (20, 5)), (REFS_FLAGGED, (20, 17))):
        buf, at, _ = _lossless_lz_payload(rows, distinct, seed=10 + want_mode)
        for _ in range(3):
            corrupt = bytearray(buf)
            corrupt[at + int(rng.integers(4))] ^= 1 << int(rng.integers(8))
            _, ref_calls = decompress_recorded(monkeypatch, as_tensor(with_checksum(corrupt)))
            flagged += sum(int(c.args_after[1].column(dc.REFS_BAD).sum()) for c in ref_calls)
    assert flagged >= 1  # some flip was caught by the checks
