"""The torch twins ``kernels/huffman_ref.py`` and ``kernels/codebook_ref.py`` against their Triton
launchers: every call the device path makes, replayed, gives the same results bit for bit and
leaves the buffers it is given (status rows, first-failure rows) the same.

The device path runs on CPU tensors in the Triton interpreter (switched on by conftest.py before
triton is imported), so the blocks are tiny. Corrupt payloads are valid ones with a codebook, a
chunk table or a bitstream edited (located through the recorded launcher arguments), checksum fixed.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the launchers cannot run")

from helpers import DEVICE, INTERPRETER_WARNINGS, as_tensor, corpus, repeated_rows, with_checksum
from kernel_calls import Call, assert_same, recorded_calls, replay

from torchrec_lossy.codec import CodecConfig, CodecError, compress, decompress
from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec.format import (
    DECODE_BAD_CHUNK_TABLE,
    DECODE_BAD_CODEBOOK,
    DECODE_BAD_ESCAPES,
    DECODE_INVALID_CODE,
    DECODE_OUT_OF_BITS,
)
from torchrec_lossy.kernels import codebook, codebook_ref, huffman, huffman_ref

pytestmark = INTERPRETER_WARNINGS

TRITON = CodecConfig(backend="triton", huffman_chunk_symbols=64)
ENCODE = {"histogram_tiles", "encode_chunks", "code_lengths", "canonical_codes"}
DECODE = {"decode_tables", "decode_blocks", "check_escapes", "block_status"}
TWINS = {
    **{n: (huffman, huffman_ref) for n in ("histogram_tiles", "encode_chunks", *sorted(DECODE))},
    **{n: (codebook, codebook_ref) for n in ("code_lengths", "canonical_codes", "decode_tables")},
}


@contextlib.contextmanager
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Call]]:
    """Records every call of the twinned launchers (``huffman``'s calls, then ``codebook``'s)."""

    def names(module: ModuleType) -> list[str]:
        return [name for name, (launchers, _) in TWINS.items() if launchers is module]

    with (
        recorded_calls(monkeypatch, huffman, names(huffman)) as h_calls,
        recorded_calls(monkeypatch, codebook, names(codebook)) as c_calls,
    ):
        calls: list[Call] = []
        yield calls
        calls += h_calls + c_calls


def assert_twins_agree(calls: list[Call], names: set[str]) -> None:
    """Replays every recorded call on its twin: same result, same arguments after the call."""
    assert names <= {c.name for c in calls}, f"missing calls: {names - {c.name for c in calls}}"
    for k, call in enumerate(calls):
        result, args, kwargs = replay(call, getattr(TWINS[call.name][1], call.name))
        where = f"call {k} {call.name}"
        assert_same(result, call.result, f"{where} result")
        assert_same(args, call.args_after, f"{where} args")
        assert_same(kwargs, call.kwargs_after, f"{where} kwargs")


def round_trip(
    monkeypatch: pytest.MonkeyPatch, blocks: list[torch.Tensor], bounds: list[float]
) -> tuple[torch.Tensor, list[Call]]:
    """Compresses and decompresses on the device path, recording both; checks the twins on
    every call (each launcher called at least once) and returns the payload and the calls."""
    blocks = [b.to(DEVICE) for b in blocks]
    with recording(monkeypatch) as calls:
        payload = compress(blocks, bounds, TRITON)
        out = decompress(payload, backend="triton")
    assert [o.shape for o in out] == [b.shape for b in blocks]
    assert_twins_agree(calls, ENCODE | DECODE)
    return payload, calls


def gauss(rows: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantized_and_lossless_blocks(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    few = gauss(4, 6, 1)
    blocks = [gauss(20, 6, 0), repeated_rows(few, 24, 2), repeated_rows(few, 12, 3), gauss(5, 3, 4)]
    _, calls = round_trip(monkeypatch, [b.to(dtype) for b in blocks], [0.1, 0.05, 0.0, 0.0])
    (enc,) = [c for c in calls if c.name == "encode_chunks"]
    assert bool((enc.args[2] <= enc.args[1]).any()), "no unused worst-case chunk slot"


def test_escapes_and_a_single_symbol_value(monkeypatch: pytest.MonkeyPatch) -> None:
    special = gauss(16, 5, 5)
    special[1, 2], special[3, 0], special[7, 4] = math.nan, math.inf, -math.inf
    special[9, 1] = 1e30  # beyond the symbol range: an escape
    blocks = [special, torch.full((9, 4), 0.25), torch.zeros(0, 4), torch.zeros(3, 0)]
    _, calls = round_trip(monkeypatch, blocks, [0.01, 0.1, 0.1, 0.1])
    (status,) = [c for c in calls if c.name == "block_status"]
    lengths = next(c for c in calls if c.name == "code_lengths").result
    assert (lengths > 0).sum(dim=1).eq(1).any(), "no histogram with a single symbol"
    assert int(status.args[0].column(dc.N_ESC).sum()) >= 4  # escapes listed


def test_empty_payload_and_zero_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    with recording(monkeypatch) as calls:
        payload = compress([torch.zeros(0, 3).to(DEVICE)], [0.1], TRITON)
        decompress(payload, backend="triton")
    assert_twins_agree(calls, {"code_lengths", "canonical_codes"})


@pytest.mark.parametrize("name", ["multi", "quant_escapes"])
def test_host_encoded_payloads_decode(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Payloads of the compiled host encoder (every dtype, escapes, several chunks)."""
    with recording(monkeypatch) as calls:
        decompress(as_tensor(dict(corpus())[name]).to(DEVICE), backend="triton")
    assert_twins_agree(calls, DECODE)


def corrupt_codes(
    monkeypatch: pytest.MonkeyPatch, payload: torch.Tensor, edit: Callable[[np.ndarray], None]
) -> int:
    """Decodes ``edit(words)`` of a payload (checksum fixed) on the device path, checks the twins
    on every call, and returns the first block's device status (0: it decoded)."""
    words = payload.cpu().numpy().copy().view("<u4")
    edit(words)
    bad = as_tensor(with_checksum(words.tobytes())).to(DEVICE)
    with recording(monkeypatch) as calls, contextlib.suppress(CodecError):
        decompress(bad, backend="triton")
    assert_twins_agree(calls, DECODE)
    return int(next(c for c in calls if c.name == "block_status").result[0])


def sections(monkeypatch: pytest.MonkeyPatch, payload: torch.Tensor) -> dict[str, int]:
    """Word offsets of block 0's codebook, chunk table and bitstream (from the launchers' calls
    of a valid decode)."""
    with recording(monkeypatch) as calls:
        decompress(payload, backend="triton")
    (tables,) = [c for c in calls if c.name == "decode_tables"]
    (dec,) = [c for c in calls if c.name == "decode_blocks"]
    return {
        "codebook": int(tables.args[1].column(dc.CB_OFF)[0]),
        "chunks": int(dec.args[1].column(dc.CT_OFF)[0]),
        "stream": int(dec.args[1].column(dc.BS_OFF)[0]),
        "n_chunks": int(dec.args[1].column(dc.CHUNK_BASE)[1]),
        "stream_words": int(dec.args[1].column(dc.BS_WORDS)[0]),
    }


@functools.cache
def corruptible() -> tuple[torch.Tensor, tuple[tuple[str, int], ...]]:
    """A payload whose block 0 is quantized with escapes over several chunks, and block 0's
    section offsets."""
    special = gauss(40, 6, 6)
    special[2, 3] = math.nan
    payload = compress([special.to(DEVICE), gauss(8, 4, 7).to(DEVICE)], [0.05, 0.05], TRITON)
    with pytest.MonkeyPatch.context() as monkeypatch:
        at = sections(monkeypatch, payload)
    assert at["n_chunks"] >= 3
    return payload, tuple(at.items())


def put(pos: int, value: int) -> Callable[[np.ndarray], None]:
    """An edit setting word ``pos`` to ``value`` (mod 2**32)."""

    def edit(words: np.ndarray) -> None:
        words[pos] = value % 2**32

    return edit


def test_corrupt_codebooks_and_chunk_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    payload, at = corruptible()
    at = dict(at)
    last_end = at["chunks"] + at["n_chunks"] - 1
    edits = {
        "codebook_too_long": put(at["codebook"], 0xFFFFFFFF),
        "codebook_kraft": put(at["codebook"], 0x11111111),
        "table_decreasing": put(at["chunks"] + 1, 0),
        "table_past_end": put(last_end, at["stream_words"] + 1),
    }
    codes = {name: corrupt_codes(monkeypatch, payload, edit) for name, edit in edits.items()}
    assert codes == {
        "codebook_too_long": DECODE_BAD_CODEBOOK,
        "codebook_kraft": DECODE_BAD_CODEBOOK,
        "table_decreasing": DECODE_BAD_CHUNK_TABLE,
        "table_past_end": DECODE_BAD_CHUNK_TABLE,
    }


def test_corrupt_bitstreams(monkeypatch: pytest.MonkeyPatch) -> None:
    payload, at = corruptible()
    at = dict(at)

    def chunk_short(words: np.ndarray) -> None:  # chunk 0 ends a word early
        words[at["chunks"]] -= 1

    def incomplete_code(words: np.ndarray) -> None:
        # One code length raised (Kraft sum < 1): the all-ones patterns start no code.
        w = int(words[at["codebook"]])
        k = next(k for k in range(8) if 0 < (w >> 4 * k) & 0xF < 12)
        words[at["codebook"]] = w + (1 << 4 * k)
        words[at["stream"]] = 0xFFFFFFFF

    def flip(words: np.ndarray) -> None:
        words[at["stream"] + 1] ^= np.uint32(1 << 10)

    edits = {"chunk_short": chunk_short, "invalid_code": incomplete_code, "flip": flip}
    codes = {name: corrupt_codes(monkeypatch, payload, edit) for name, edit in edits.items()}
    assert codes["invalid_code"] == DECODE_INVALID_CODE
    assert codes["chunk_short"] == DECODE_OUT_OF_BITS
    assert codes["flip"] == DECODE_BAD_ESCAPES
