"""The production Triton launchers (``kernels/quantize.py``, ``vector_lz.py``, ``huffman.py``,
``common.py``) on one block, with edge-case inputs: each call is compared with the launcher's
torch twin (``kernels/*_ref.py``, the same call) and with the compiled host (numba) kernels
(tests/host_kernels.py). Every launcher call a real device-path run makes, replayed on the twins:
tests/test_quantize_vector_lz_ref.py, tests/test_huffman_codebook_ref.py; whole payloads through
the device path: tests/test_device_compress.py, tests/test_device_decompress.py.

Without a CUDA device the kernels run on CPU tensors in the Triton interpreter, which
tests/conftest.py switches on (``TRITON_INTERPRET=1``) before triton is imported. The interpreter
is slow, so the sizes here are small; larger cases carry ``@pytest.mark.slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

import host_kernels
import numba
from helpers import DEVICE, DTYPES, INTERPRETER_WARNINGS, bound_for, make_block
from kernel_calls import assert_same, snapshot

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import format as wire
from torchrec_lossy.codec import huffman, launch_tables, pipeline
from torchrec_lossy.codec import quantize as cpu_quantize
from torchrec_lossy.codec.encode_columns import encode_columns
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    BITS_DTYPES,
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    NEAREST_KEY,
)
from torchrec_lossy.codec.launch_tables import NO_FAILURE, block_for, tile_table
from torchrec_lossy.codec.quant_params import QuantParams
from torchrec_lossy.config import CodecConfig
from torchrec_lossy.kernels import common, huffman_ref, quantize_ref, vector_lz_ref
from torchrec_lossy.kernels import huffman as k_huffman
from torchrec_lossy.kernels import quantize as k_quantize
from torchrec_lossy.kernels import vector_lz as k_vector_lz

pytestmark = INTERPRETER_WARNINGS

ROWS = [0, 1, 7, 33]
DIMS = [1, 3, 16]
BOUND_KINDS = ["zero", "tiny", "rel0.01", "rel0.05", "huge"]
_TILE = 4096  # the quantize and histogram launchers' largest element tile


def dev(a: np.ndarray) -> torch.Tensor:
    """A numpy array on the test device (uint16 / uint32 as their signed bits)."""
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint16:
        a = a.view(np.int16)
    elif a.dtype == np.uint32:
        a = a.view(np.int32)
    return torch.from_numpy(a).to(DEVICE)


def host(t: torch.Tensor, dtype: type | None = None) -> np.ndarray:
    """A device tensor back as numpy, optionally viewed as an unsigned dtype."""
    a = t.cpu().numpy()
    return a.view(dtype) if dtype is not None else a


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's raw bits (compares NaN payloads and signed zeros too)."""
    return t.contiguous().view(BITS_DTYPES[t.dtype])


def with_twin(launcher: Callable, twin: Callable, *args: Any) -> Any:
    """Calls a launcher and its torch twin on copies of the same arguments; asserts both give
    the same result and leave the arguments (buffers they write into) the same, bit for bit.

    Returns:
        The launcher's result.
    """
    twin_args = snapshot(args)
    want = twin(*twin_args)
    got = launcher(*args)
    assert_same(got, want, f"{launcher.__name__} result")
    assert_same(args, twin_args, f"{launcher.__name__} args")
    return got


def one_tile_table(n: int, cap: int) -> tuple[torch.Tensor, int]:
    """The tile table of one ``n``-element segment on the test device, and its tile size."""
    block = block_for(n, cap)
    return torch.from_numpy(tile_table(np.array([n]), block)).to(DEVICE), block


def cpu_quantize_block(
    x: np.ndarray, params: QuantParams, bound: float, dtype_code: int
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """The numba quantize of one block: float32 [n] -> (uint16 symbols [n], int64 histogram,
    number of escapes, max error)."""
    return host_kernels.quantize_block(
        x, np.float32(params.step), np.float32(params.inv_step), params.center, bound,
        dtype_code, NEAREST_KEY, params.value,
    )  # fmt: skip


@numba.njit(cache=False)
def _cpu_round(x: np.ndarray, dtype_code: int, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = cpu_quantize._round_to_dtype(x[i], dtype_code)


# ------------------------------------------------------------------------------------------------
# Shared scan
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 16, 17, 100])
def test_inclusive_scan(n: int, dtype: torch.dtype) -> None:
    x = torch.randint(-50, 50, (n,), dtype=dtype, generator=torch.Generator().manual_seed(n))
    for block in (16, 4096):  # several programs, and one
        got = common.inclusive_scan(x.to(DEVICE), common.SCAN_SUM, block).cpu()
        assert torch.equal(got, torch.cumsum(x, 0).to(dtype))
        got = common.inclusive_scan(x.to(DEVICE), common.SCAN_MAX, block).cpu()
        assert torch.equal(got, torch.cummax(x, 0).values if n else x)


# ------------------------------------------------------------------------------------------------
# Quantize
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_code", [1, 2, 3])
def test_round_to_dtype_matches_cpu(dtype_code: int) -> None:
    """The integer fp16 / bf16 rounding equals ``_round_to_dtype`` bit for bit: every exponent
    with random mantissas and the tie / carry patterns, both signs, and the fp16 subnormal range
    densely."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, o_ptr, n, D: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask)
        tl.store(o_ptr + offs, k_quantize.round_to_dtype(v, D), mask=mask)

    rng = np.random.default_rng(dtype_code)
    exps = np.arange(256, dtype=np.uint32)[:, None] << 23
    mant = rng.integers(0, 1 << 23, size=(256, 256), dtype=np.uint32)
    edge = np.array(
        [0, 1, 0xFFF, 0x1000, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x18000, 0x7FFFFF],
        dtype=np.uint32,
    )
    bits = (exps | np.concatenate([mant, np.broadcast_to(edge, (256, edge.size))], 1)).ravel()
    sub = np.arange(0x33000000, 0x38900000, 1999, dtype=np.uint32)  # fp16 subnormals and around
    bits = np.concatenate([bits, sub])
    bits = np.concatenate([bits, bits | 0x80000000])
    x = bits.view(np.float32)
    out = torch.empty(x.shape[0], dtype=torch.float32, device=DEVICE)
    block = 1 << 16
    kernel[(-(-x.shape[0] // block),)](dev(x), out, x.shape[0], D=dtype_code, BLOCK=block)
    want = np.empty_like(x)
    _cpu_round(x, dtype_code, want)
    np.testing.assert_array_equal(host(out).view(np.uint32), want.view(np.uint32))


def quantize_one(
    x: np.ndarray, params: QuantParams, bound: float, dtype_code: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_tiles`` on one block, checked against its twin."""
    tiles, block = one_tile_table(x.shape[0], _TILE)
    cols = encode_columns(
        1,
        DEVICE,
        step=torch.tensor([params.step], dtype=torch.float32),
        inv_step=torch.tensor([params.inv_step], dtype=torch.float32),
        center=torch.tensor([params.center]),
        bound=torch.tensor([bound], dtype=torch.float64),
        dtype=torch.tensor([dtype_code]),
        sr_key=torch.tensor([NEAREST_KEY]),
    )
    got = with_twin(
        k_quantize.quantize_tiles, quantize_ref.quantize_tiles, dev(x), tiles, cols, block
    )
    # Without histograms (the packed format's launch): the same symbols and errors, no counts.
    sym, hist, err = with_twin(
        k_quantize.quantize_tiles, quantize_ref.quantize_tiles, dev(x), tiles, cols, block, False
    )
    assert torch.equal(sym, got[0]) and torch.equal(err, got[2]) and hist.shape[0] == 0
    return got


@pytest.mark.parametrize("kind", ["adversarial", "repeat"])
@pytest.mark.parametrize("bound_kind", ["tiny", "rel0.01", "rel0.05", "huge"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_cpu(dtype: torch.dtype, bound_kind: str, kind: str) -> None:
    for rows in ROWS:
        for dim in DIMS:
            block = make_block(rows, dim, dtype, kind, seed=rows * 31 + dim)
            x = block.reshape(-1).float().numpy()
            bound = bound_for(block, bound_kind)
            params = cpu_quantize.quant_params(bound, x)
            if params is None:
                continue
            want_sym, want_hist, want_esc, want_err = cpu_quantize_block(
                x, params, bound, DTYPE_CODES[dtype]
            )
            sym, hist, errors = quantize_one(x, params, bound, DTYPE_CODES[dtype])
            what = f"rows={rows} dim={dim}"
            np.testing.assert_array_equal(host(sym, np.uint16), want_sym, err_msg=what)
            np.testing.assert_array_equal(host(hist[0]).astype(np.int64), want_hist, err_msg=what)
            assert int(host(hist[0])[ESCAPE_SYMBOL]) == want_esc, what
            err = float(errors.max()) if errors.numel() else 0.0
            assert err == want_err, what


# ------------------------------------------------------------------------------------------------
# Vector-LZ
# ------------------------------------------------------------------------------------------------


def _dedupe_inputs(
    rows: int, dim: int, dtype: torch.dtype, kind: str
) -> tuple[np.ndarray, np.ndarray]:
    block = make_block(rows, dim, dtype, kind, seed=7 * rows + dim)
    x = block.reshape(-1).float().numpy()
    bits = as_bits(block).numpy().astype(np.int32)
    params = cpu_quantize.quant_params(0.05, x)
    if params is None:
        return np.full((rows, dim), ESCAPE_SYMBOL, np.uint16), bits
    sym = cpu_quantize_block(x, params, 0.05, DTYPE_CODES[dtype])[0]
    return sym.reshape(rows, dim), bits


def dedupe_one(symbols: np.ndarray | None, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``representatives`` on one block, checked against its twin, as the host kernel's
    (ids numbered by first occurrence, first rows): the ranks ``device_compress`` takes."""
    rows, dim = bits.shape
    rep, is_first = with_twin(
        k_vector_lz.representatives,
        vector_lz_ref.representatives,
        None if symbols is None else dev(symbols.reshape(-1)),
        dev(bits.reshape(-1)),
        torch.zeros(rows, dtype=torch.int32, device=DEVICE),
        encode_columns(1, DEVICE, dim=torch.tensor([dim])),  # its rows from element 0
        dim,
    )
    rep, is_first = rep.cpu().long(), is_first.cpu()
    rank = torch.cumsum(is_first, 0)
    ids = (rank[rep] - 1).to(torch.int32) if rows else rep.to(torch.int32)
    return ids.numpy(), torch.nonzero(is_first).flatten().to(torch.int32).numpy()


@pytest.mark.parametrize("kind", ["adversarial", "repeat"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dedupe_matches_cpu(dtype: torch.dtype, kind: str) -> None:
    for rows in [*ROWS, 64]:
        for dim in DIMS:
            sym, bits = _dedupe_inputs(rows, dim, dtype, kind)
            for raw in (True, False):
                what = f"rows={rows} dim={dim} raw={raw}"
                if rows:
                    want_ids, want_first = host_kernels.dedupe(None if raw else sym, bits)
                else:
                    want_ids = want_first = np.zeros(0, np.int32)
                ids, first = dedupe_one(None if raw else sym, bits)
                np.testing.assert_array_equal(ids, want_ids, err_msg=what)
                np.testing.assert_array_equal(first, want_first, err_msg=what)


@pytest.mark.parametrize("kind", ["adversarial", "repeat"])
def test_dedupe_pair_is_both_dedupes(kind: str) -> None:
    """``representatives_pair`` (both dedupes in the same launches) gives row 0 the symbols'
    dedupe and row 1 the raw bits', each as ``representatives`` alone, rows of two blocks."""
    sym_a, bits_a = _dedupe_inputs(33, 3, torch.float16, kind)
    sym_b, bits_b = _dedupe_inputs(7, 16, torch.float32, kind)
    sym = dev(np.concatenate([sym_a.reshape(-1), sym_b.reshape(-1)]))
    bits = dev(np.concatenate([bits_a.reshape(-1), bits_b.reshape(-1)]))
    row_blk = torch.tensor([0] * 33 + [1] * 7, dtype=torch.int32, device=DEVICE)
    cols = encode_columns(
        2, DEVICE, dim=torch.tensor([3, 16]), row_off=torch.tensor([0, 33]),
        elem_off=torch.tensor([0, 99]),
    )  # fmt: skip
    rep, is_first = with_twin(
        k_vector_lz.representatives_pair, vector_lz_ref.representatives_pair, sym, bits,
        row_blk, cols, 16,
    )  # fmt: skip
    for d, symbols in enumerate((sym, None)):
        want = k_vector_lz.representatives(symbols, bits, row_blk, cols, 16)
        assert torch.equal(rep[d], want[0]) and torch.equal(is_first[d], want[1])
    assert kind != "repeat" or (is_first[1] == 0).any()  # repeats found


def test_dedupe_exact_under_hash_collisions(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every column multiplier 0 all rows hash alike: the key comparison alone must still
    give the CPU kernel's ids."""
    monkeypatch.setattr(launch_tables, "column_multipliers", lambda dim: np.zeros(dim, np.int64))
    for kind in ("adversarial", "repeat"):
        sym, bits = _dedupe_inputs(40, 3, torch.float16, kind)
        for raw in (True, False):
            want = host_kernels.dedupe(None if raw else sym, bits)
            ids, first = dedupe_one(None if raw else sym, bits)
            np.testing.assert_array_equal(ids, want[0])
            np.testing.assert_array_equal(first, want[1])


# ------------------------------------------------------------------------------------------------
# Huffman
# ------------------------------------------------------------------------------------------------


def _symbols(n_rows: int, dim: int, spread: float, seed: int) -> np.ndarray:
    """[rows, dim] symbols, Gaussian around the middle of the alphabet, some escapes."""
    rng = np.random.default_rng(seed)
    s = np.clip(np.rint(rng.normal(2047, spread, (n_rows, dim))), 0, ESCAPE_SYMBOL - 1)
    s[rng.random((n_rows, dim)) < 0.02] = ESCAPE_SYMBOL
    return s.astype(np.uint16)


def histogram_one(symbols: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``histogram_tiles`` over the selected rows (one segment), checked against its twin."""
    stream = dev(symbols[rows].reshape(-1))
    tiles, block = one_tile_table(stream.shape[0], _TILE)
    keep = torch.ones(stream.shape[0], dtype=torch.int32, device=DEVICE)
    hist = with_twin(
        k_huffman.histogram_tiles, huffman_ref.histogram_tiles, stream, keep, tiles, 1, block
    )
    return host(hist[0])


def encode_one(
    symbols: np.ndarray, rows: np.ndarray, lengths: np.ndarray, codes: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """``encode_chunks`` of the selected rows (one code table), checked against its twin:
    (uint32 chunk ends, uint32 words)."""
    stream = dev(symbols[rows].reshape(-1)).to(torch.int32)
    lo = torch.arange(0, stream.shape[0], chunk, dtype=torch.int64, device=DEVICE)
    hi = torch.clamp(lo + chunk, max=stream.shape[0])
    ends, words = with_twin(
        k_huffman.encode_chunks, huffman_ref.encode_chunks, stream, lo, hi, torch.zeros_like(lo),
        dev(lengths.astype(np.int32)), dev(codes.astype(np.int64)), chunk,
    )  # fmt: skip
    return host(ends).astype(np.uint32), host(words, np.uint32)


def decode_one(
    words: np.ndarray,
    ends: np.ndarray,
    n: int,
    chunk: int,
    lengths: np.ndarray,
    esc: np.ndarray,
) -> tuple[np.ndarray, int]:
    """One block's stream through the device decoder's launchers (``decode_blocks``,
    ``check_escapes``, ``block_status``), each checked against its twin.

    The block's sections sit in one word buffer like a payload's: chunk table, bitstream,
    escape positions. The decode table is ``decode_table_kernel``'s widened to 12 bits
    (``codebook.decode_tables``' layout; the codebook launcher has its own tests).

    Returns:
        (uint16 symbols [n], the block's status: 0 or the DECODE_* code).
    """
    payload = dev(np.concatenate([ends, words, esc]).astype(np.uint32))
    n_chunks, n_words = ends.shape[0], words.shape[0]
    table = huffman.decode_table_kernel(lengths)
    assert table.shape[0], "not a prefix code"  # DECODE_BAD_CODEBOOK: codebook tests' subject
    tables = dev(np.repeat(table, ALPHABET_SIZE // table.shape[0])[None, :])
    fields = {
        "sym_base": [0, n], "chunk_base": [0, n_chunks], "quant_blocks": [0],
        "ct_off": [0], "bs_off": [n_chunks], "bs_words": [n_words], "chunk_symbols": [chunk],
        "esc_pos_off": [n_chunks + n_words], "n_esc": [esc.shape[0]], "has_stream": [1],
        "fail": [NO_FAILURE], "esc_bad": [NO_FAILURE],
    }  # fmt: skip
    host_cols = dc.stack_columns(lambda name: np.array(fields.get(name, [0]), np.int64), 1)
    cols = dc.DecodeColumns(torch.from_numpy(host_cols).to(DEVICE), 1, 0, 0, 1)
    out, is_esc = with_twin(
        k_huffman.decode_blocks, huffman_ref.decode_blocks, payload, cols, tables, n_chunks, n
    )
    rank = with_twin(k_huffman.check_escapes, huffman_ref.check_escapes, is_esc, payload, cols)
    status = with_twin(k_huffman.block_status, huffman_ref.block_status, cols, rank)
    return host(out, np.uint16), int(status[0])


@pytest.mark.parametrize(
    ("n_rows", "dim", "spread", "chunk"),
    [
        (1, 1, 1.0, 64),  # one symbol
        (7, 3, 0.0, 64),  # one distinct symbol (+ escapes): length-1 codes
        (33, 16, 3.0, 64),
        (33, 16, 3.0, 100),  # chunk not a power of two
        (33, 16, 300.0, 64),  # wide alphabet: codes up to the 12-bit limit
        (160, 16, 5.0, 2048),  # chunks of several program blocks (carried words)
        (50, 3, 2.0, 32),
    ],
)
def test_huffman_encode_decode_match_cpu(n_rows: int, dim: int, spread: float, chunk: int) -> None:
    sym = _symbols(n_rows, dim, spread, seed=n_rows + dim)
    rng = np.random.default_rng(0)
    for rows in (np.arange(n_rows, dtype=np.int32), rng.permutation(n_rows)[: n_rows // 2 + 1]):
        rows = rows.astype(np.int32)
        hist = host_kernels.histogram_rows(sym, rows)
        np.testing.assert_array_equal(histogram_one(sym, rows).astype(np.int64), hist)
        lengths = huffman.code_lengths_kernel(hist)
        codes = huffman.canonical_codes_kernel(lengths)
        want_ends, want_words = host_kernels.encode(sym, rows, lengths, codes, chunk)
        ends, words = encode_one(sym, rows, lengths, codes, chunk)
        np.testing.assert_array_equal(ends, want_ends)
        np.testing.assert_array_equal(words, want_words)

        sent = sym[rows].reshape(-1)
        esc = np.flatnonzero(sent == ESCAPE_SYMBOL).astype(np.uint32)
        out, status = decode_one(want_words, want_ends, sent.shape[0], chunk, lengths, esc)
        assert status == 0
        np.testing.assert_array_equal(out, sent)


def test_huffman_decode_errors_match_cpu() -> None:
    """Corrupt streams, chunk tables and escape lists get the CPU kernel's status."""
    sym = _symbols(24, 8, 4.0, seed=3)
    rows = np.arange(24, dtype=np.int32)
    chunk = 32
    sent = sym.reshape(-1)
    n = sent.shape[0]
    lengths = huffman.code_lengths_kernel(host_kernels.histogram_rows(sym, rows))
    codes = huffman.canonical_codes_kernel(lengths)
    ends, words = host_kernels.encode(sym, rows, lengths, codes, chunk)
    esc = np.flatnonzero(sent == ESCAPE_SYMBOL).astype(np.uint32)
    assert esc.shape[0] >= 2
    rng = np.random.default_rng(1)
    incomplete = lengths.copy()
    incomplete[np.flatnonzero(incomplete)[0]] += 1  # Kraft sum < 1: unused bit patterns
    cases = [("clean", words, ends, lengths, esc)]
    for k in range(12):
        w = words.copy()
        w[rng.integers(0, w.shape[0])] ^= np.uint32(1 << int(rng.integers(0, 32)))
        cases.append((f"flip{k}", w, ends, lengths, esc))
    cases += [
        ("truncated chunk", words[:-1], np.minimum(ends, words.shape[0] - 1), lengths, esc),
        ("decreasing table", words, ends[::-1].copy(), lengths, esc),
        ("table past end", words, ends + np.uint32(1), lengths, esc),
        ("table short of end", words[:], ends - (ends == ends[-1]).astype(np.uint32), lengths, esc),
        ("escape missing", words, ends, lengths, esc[1:]),
        ("escape extra", words, ends, lengths, np.sort(np.append(esc, esc[-1] + 1))),
        ("escape moved", words, ends, lengths, esc + np.uint32(1)),
        ("no escapes listed", words, ends, lengths, esc[:0]),
        ("incomplete code", words, ends, incomplete, esc),
    ]
    seen = set()
    for what, w, e, lens, es in cases:
        want_out = np.zeros(n, np.uint16)
        want = host_kernels.decode_kernel(w, e, chunk, lens, es, want_out)
        out, status = decode_one(w, e, n, chunk, lens, es)
        assert status == want, f"{what}: status {status}, CPU {want}"
        if want == 0:
            np.testing.assert_array_equal(out, want_out, err_msg=what)
        seen.add(want)
    assert seen == {
        0,
        wire.DECODE_INVALID_CODE,
        wire.DECODE_OUT_OF_BITS,
        wire.DECODE_BAD_CHUNK_TABLE,
        wire.DECODE_BAD_ESCAPES,
    }


# ------------------------------------------------------------------------------------------------
# Compile
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kernels_compile_for_h100() -> None:
    """Every kernel variant compiles to an sm_90 cubin (no GPU needed: Triton's bundled ptxas),
    and the quantize PTX has no fused multiply-add."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-m", "torchrec_lossy.kernels._aot", "--arch", "90"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_aot_table_covers_every_launched_kernel() -> None:
    """The ahead-of-time compile table has a row for every kernel ``kernels/`` launches, and the
    check is not vacuous: without a row it names the kernel and fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torchrec_lossy.kernels._aot", "--check"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "0 kernels missing" in res.stdout, res.stdout + res.stderr
    res = subprocess.run(
        [*cmd, "--without", "join_words_kernel"], capture_output=True, text=True, env=env
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "huffman._join_words_kernel" in res.stdout, res.stdout


# ------------------------------------------------------------------------------------------------
# Wiring
# ------------------------------------------------------------------------------------------------


def test_histogram_alphabet() -> None:
    """Every histogram has the full alphabet (the Huffman planner indexes it by symbol)."""
    sym = np.array([[0, ESCAPE_SYMBOL, 5]], dtype=np.uint16)
    hist = histogram_one(sym, np.zeros(1, np.int32))
    assert hist.shape == (ALPHABET_SIZE,)
    assert hist[0] == hist[5] == hist[ESCAPE_SYMBOL] == 1


def test_backend_triton_is_registered() -> None:
    """``CodecConfig(backend="triton")`` and ``decompress(backend="triton")`` use the kernels and
    give the CPU path's bytes and blocks."""
    blocks = [make_block(33, 16, torch.float32, "repeat", seed=7)]
    bounds = [bound_for(blocks[0], "rel0.05")]
    config = CodecConfig(huffman_chunk_symbols=64)
    want = pipeline.compress(blocks, bounds, config)
    got = pipeline.compress(blocks, bounds, CodecConfig(huffman_chunk_symbols=64, backend="triton"))
    assert torch.equal(got, want)
    out = pipeline.decompress(got, backend="triton")[0]
    assert torch.equal(as_bits(out), as_bits(pipeline.decompress(want)[0]))
