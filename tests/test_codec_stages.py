"""Each codec stage alone, against its reference twin and against first principles."""

from __future__ import annotations

import heapq
import itertools
import math

import host_kernels
import numba
import numpy as np
import pytest
import torch

from torchrec_lossy.codec import format as wire
from torchrec_lossy.codec import huffman, packed, quantize, vector_lz
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    MAX_CENTER,
    MAX_CODE_LENGTH,
    NEAREST_KEY,
    REFS_FIXED,
    REFS_FLAGGED,
    SYMBOL_OFFSET,
    ref_width,
    refs_bits,
    refs_packing,
    words_for_bits,
)
from torchrec_lossy.codec.host_records import Grids
from torchrec_lossy.codec.quant_params import QuantParams
from torchrec_lossy.kernels import quantize_ref, vector_lz_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------------------------
# Rounding to float16 / bfloat16


@numba.njit
def _round_all(x, dtype_code):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = quantize._round_to_dtype(x[i], dtype_code)
    return out


def _rounding_inputs(dtype: torch.dtype) -> np.ndarray:
    """float32 values: random bit patterns, every value of the dtype, every tie between two
    neighbours and the float32 neighbours of every tie, the overflow boundary and subnormals."""
    r = rng(1)
    random_bits = r.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    int_dtype = torch.int16
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(int_dtype).view(dtype).float()
    every = every[torch.isfinite(every)].sort().values.unique().numpy()
    pos = every[every >= 0]
    ties = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    assert np.all(ties.astype(np.float64) == (pos[:-1].astype(np.float64) + pos[1:]) / 2)
    fmax = float(torch.finfo(dtype).max)
    ulp_top = fmax - float(np.nextafter(np.float32(fmax), np.float32(0)))
    edges = np.array([fmax, fmax + ulp_top / 2, fmax * 1.0001, 65519.996, 65520.0, 65536.0, 1e30,
                      F32_MAX, F32_TINY, 1e-45, 6.1e-5, 5.96e-8, 2.98e-8, 2.9802322e-08],
                     dtype=np.float32)  # fmt: skip
    parts = [
        random_bits,
        every,
        ties,
        np.nextafter(ties, np.float32(np.inf)),
        np.nextafter(ties, np.float32(0)),
        edges,
    ]
    x = np.concatenate(parts).astype(np.float32)
    return np.concatenate([x, -x])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_round_to_dtype_matches_torch_cast(dtype):
    x = _rounding_inputs(dtype)
    x = x[x.view(np.uint32) != 0x80000000]  # -0.0: see test_round_to_dtype_keeps_negative_zero
    got = _round_all(x, DTYPE_CODES[dtype])
    want = torch.from_numpy(x).to(dtype).float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    diff = np.flatnonzero(got[~nan].view(np.uint32) != want[~nan].view(np.uint32))
    if diff.size:
        i = diff[0]
        pytest.fail(
            f"{diff.size} mismatches; first x={x[~nan][i]!r} got {got[~nan][i]!r} "
            f"torch {want[~nan][i]!r}"
        )


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
    ],
    ids=["fp16", "bf16"],
)
def test_round_to_dtype_keeps_negative_zero(dtype):
    """The fp16 branch returns ``-r if v < 0 else r``, and -0.0 < 0 is False.

    Harmless today (the function only feeds the encoder's error check, and a reconstruction
    ``float32(q) * step`` is never -0.0), but it breaks the documented "as torch's cast does".
    """
    got = _round_all(np.array([-0.0, -1e-30], np.float32), DTYPE_CODES[dtype])
    want = torch.tensor([-0.0, -1e-30]).to(dtype).float().numpy()
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


@numba.njit
def _half_bits_all(bits, dtype_code):
    out = np.empty(bits.shape[0], np.int64)
    for i in range(bits.shape[0]):
        out[i] = quantize.half_bits(np.int64(bits[i]), dtype_code)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_bits_match_torch_cast(dtype):
    """The compiled decoder's 16-bit patterns are torch's cast, bit for bit (NaN aside)."""
    x = _rounding_inputs(dtype)
    x = np.concatenate([x[~np.isnan(x)], np.float32([0.0, -0.0])])
    got = _half_bits_all(x.view(np.uint32), DTYPE_CODES[dtype])
    want = torch.from_numpy(x).to(dtype).view(torch.int16).numpy().view(np.uint16)
    diff = np.flatnonzero(got != want)
    assert diff.size == 0, f"{diff.size} mismatches; first x={x[diff[0]]!r}"


def test_round_to_dtype_is_identity_for_float32():
    x = _rounding_inputs(torch.float16)
    got = _round_all(x, DTYPE_CODES[torch.float32])
    assert np.array_equal(got.view(np.uint32), x.view(np.uint32))


def test_round_to_dtype_ties_go_to_even():
    f16 = _round_all(np.array([2049.0, 2051.0, 1 + 2**-11, 1 + 3 * 2**-11], np.float32), 2)
    assert f16.tolist() == [2048.0, 2052.0, 1.0, 1 + 2**-9]
    bf = _round_all(np.array([1 + 2**-8, 1 + 3 * 2**-8, 65520.0], np.float32), 3)
    assert bf.tolist() == [1.0, 1 + 2**-6, 65536.0]
    assert _round_all(np.array([65520.0, 65519.0], np.float32), 2).tolist() == [math.inf, 65504.0]


# ---------------------------------------------------------------------------------------------
# Quantization


def _pair(lo: float, hi: float) -> np.ndarray:
    """A block whose finite range is [lo, hi]."""
    return np.array([lo, hi], dtype=np.float32)


def test_quant_params():
    for bound in (1e-30, 1e-7, 0.01, 0.5, 1.0, 3.3, 1e30, 1e38, 2e38, F32_MAX, 1e300):
        p = quantize.quant_params(bound, _pair(-1.0, 1.0))
        assert p is not None, bound
        assert p.step == float(np.float32(p.step)), "step must be float32-representable"
        assert F32_TINY <= p.step <= 2 * bound
        assert p.inv_step == float(np.float32(1) / np.float32(p.step))
        assert abs(p.center) <= MAX_CENTER
    # the step is the largest float32 <= 2 * bound
    p = quantize.quant_params(0.1, _pair(0.0, 0.0))
    assert p.step <= 0.2 < float(np.nextafter(np.float32(p.step), np.float32(1)))
    assert quantize.quant_params(1e-39, _pair(-1.0, 1.0)) is None  # step would be subnormal
    assert quantize.quant_params(1e-3, _pair(1e6, 1e6 + 1)) is None  # center beyond MAX_CENTER
    assert quantize.quant_params(1e-7, _pair(1e38, 1e38)) is None  # float32 center overflows
    p = quantize.quant_params(0.5, _pair(math.nan, math.nan))  # no finite element
    assert p is not None and p.center == 0
    p = quantize.quant_params(0.5, _pair(99.0, 101.0))
    assert p.center == 100


def _quant_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(DTYPE_CODES[dtype])
    gauss = torch.randn(4000, generator=g)
    wide = torch.randn(4000, generator=g) * 30
    specials = torch.tensor(
        [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e30, F32_MAX, 1e-40, 1e-45, 65504.0]
    )
    mixed = torch.cat([gauss, specials, wide[:100]])
    subnormal = torch.randn(2000, generator=g) * 1e-39
    big = 1e4 + torch.randn(3000, generator=g)
    return [x.to(dtype) for x in (gauss, wide, mixed, subnormal, big)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_quantize_kernel_matches_reference(dtype):
    n_cases = 0
    for x in _quant_inputs(dtype):
        xf = x.float().numpy()
        for bound in (1e-42, 1e-6, 1e-3, 0.01, 0.05, 0.3, 7.0, 1e30):
            p = quantize.quant_params(bound, xf)
            if p is None:
                continue
            n_cases += 1
            symbols, _, _, max_err = host_kernels.quantize_block(
                xf, np.float32(p.step), np.float32(p.inv_step), p.center, bound, DTYPE_CODES[dtype]
            )
            ref_symbols, ref_max_err = quantize_ref.quantize_reference(x, p, bound)
            assert np.array_equal(symbols.astype(np.int64), ref_symbols.numpy())
            assert max_err == ref_max_err
            # First principles: every non-escaped element is within the bound once dequantized
            # and cast to the dtype; every non-finite element is escaped.
            deq = np.empty(xf.shape[0], np.float32)
            quantize.dequantize_kernel(symbols, np.float32(p.step), p.center, deq)
            ref_deq = quantize_ref.dequantize_reference(
                torch.from_numpy(symbols.astype(np.int64)), p
            )
            assert np.array_equal(deq.view(np.uint32), ref_deq.numpy().view(np.uint32))
            recon = torch.from_numpy(deq).to(dtype).double()
            kept = torch.from_numpy(symbols != ESCAPE_SYMBOL)
            err = (recon - x.double()).abs()[kept]
            assert bool((err <= bound).all())
            assert max_err == (float(err.max()) if bool(kept.any()) else 0.0)
            assert not bool((kept & ~torch.isfinite(x)).any())
    assert n_cases >= 25


def test_quantize_symbols_are_centered_codes():
    x = np.array([0.0, 0.1, -0.1, 0.29, 0.31, 1000.0], np.float32)
    p = quantize.quant_params(0.1, _pair(-0.1, 0.31))
    symbols, *_ = host_kernels.quantize_block(
        x, np.float32(p.step), np.float32(p.inv_step), p.center, 0.1, 1
    )
    q = np.floor(x * np.float32(p.inv_step) + np.float32(0.5))
    want = (q - p.center + SYMBOL_OFFSET).astype(np.int64)
    want[np.abs(q - p.center) > SYMBOL_OFFSET] = ESCAPE_SYMBOL
    assert symbols.tolist() == want.tolist()
    assert symbols[-1] == ESCAPE_SYMBOL  # 1000 is 5000 steps from the center: out of range


def _neighbours(v: np.ndarray, k: int) -> np.ndarray:
    """float32 values ``v`` and their ``k`` nearest float32 neighbours on each side."""
    out = [v]
    lo, hi = v, v
    for _ in range(k):
        lo, hi = np.nextafter(lo, np.float32(-np.inf)), np.nextafter(hi, np.float32(np.inf))
        out += [lo, hi]
    return np.concatenate(out).astype(np.float32)


def _adversarial_block(step: np.float32, center: int, near_zero: bool) -> np.ndarray:
    """float32 values where the float32 error of the fast quantize path is inexact or at the
    bound: the grid's points and midpoints at the center and at the alphabet's edges, with 3
    float32 neighbours each, and non-finite values; ``near_zero``: also the codes around 0 and
    values below half a step and subnormals (where the error may be inexact in float32)."""
    codes = [center + d for d in range(-3, 4)]
    codes += [center + e + d for e in (-SYMBOL_OFFSET, SYMBOL_OFFSET) for d in (-1, 0, 1)]
    codes = [k for k in codes if abs(k) >= 2 or near_zero] + (
        list(range(-3, 4)) if near_zero else []
    )
    k = np.array(codes, np.float64)
    s = np.float64(step)
    at = np.concatenate([k * s, (k + 0.5) * s, (k - 0.5) * s]).astype(np.float32)
    small = np.array([s / 4, s / 3, s / 2, 0.75 * s, 1e-45, F32_TINY, 0.0], np.float32)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, F32_MAX], np.float32)
    parts = [_neighbours(at, 3), special]
    if near_zero:
        parts += [_neighbours(small, 3), -_neighbours(small, 3)]
    return np.concatenate(parts)


def _quantize_float32(
    x: np.ndarray, p: QuantParams, bound: float, ranges: bool
) -> tuple[np.ndarray, float, int, int]:
    """``quantize_blocks_kernel`` on one float32 block rounded to nearest (the float32 loop),
    with or without the symbol ranges -> (symbols, max error, lowest and highest symbol)."""
    grids = Grids(
        np.array([p.step], np.float32),
        np.array([p.inv_step], np.float32),
        np.array([p.center], np.int64),
        np.ones(1, np.bool_),
        np.zeros(1, np.bool_),
    )
    symbols = np.empty(x.shape[0], np.uint16)
    max_err, lo, hi = quantize.quantize_blocks_kernel(
        x, np.array([0, x.shape[0]], np.int64), grids, np.array([bound]),
        np.array([DTYPE_CODES[torch.float32]], np.int64), np.array([NEAREST_KEY], np.int64),
        symbols, ranges,
    )  # fmt: skip
    return symbols, float(max_err[0]), int(lo[0]), int(hi[0])


def test_float32_quantize_path_matches_the_float64_check() -> None:
    """The float32 loop (float32 blocks, round to nearest) gives the float64 check's symbols
    and max error wherever it proves its errors exact, and says so where it cannot (the block
    then takes the float64 loop): adversarial values, bounds equal to an element's error and
    their float64 neighbours, bounds no float32 holds."""
    proved = fell_back = 0
    steps = np.array([0.1, 3.0, 1e-3, 2.0**-20, 1e-37, 1e30], np.float32)
    for step32, center, near_zero in itertools.product(
        steps, (0, 5, -1000, MAX_CENTER - 1), (False, True)
    ):
        inv = np.float32(1.0 / np.float64(step32))
        x = _adversarial_block(step32, center, near_zero)
        p = QuantParams(step=float(step32), inv_step=float(inv), center=center)
        half = float(step32) / 2
        with np.errstate(over="ignore", invalid="ignore"):
            q = np.floor(x * inv + np.float32(0.5)) * step32
            errs = np.abs(q - x.astype(np.float64))
        errs = errs[np.isfinite(errs) & (errs > 0)]
        picked = [float(e) for e in np.unique(errs)[:: max(1, errs.size // 6)]]
        for bound in [half, half * (1 + 1e-9), 0.3 * float(step32), *picked,
                      *(float(np.nextafter(e, 0.0)) for e in picked),
                      *(float(np.nextafter(e, np.inf)) for e in picked)]:  # fmt: skip
            ref_sym, ref_err = quantize_ref.quantize_reference(torch.from_numpy(x), p, bound)
            values = ref_sym[ref_sym != ESCAPE_SYMBOL]
            ref_lo, ref_hi = (int(values.min()), int(values.max())) if values.numel() else (
                ESCAPE_SYMBOL, -1)  # fmt: skip
            for ranges in (False, True):  # the packed format's call, the entropy format's
                symbols, max_err, lo, hi = _quantize_float32(x, p, bound, ranges)
                assert np.array_equal(symbols.astype(np.int64), ref_sym.numpy())
                assert max_err == ref_err
                assert (lo, hi) == ((ref_lo, ref_hi) if ranges else (ESCAPE_SYMBOL, -1))
            grid = quantize._Grid(step32, inv, center, bound, NEAREST_KEY)
            fast = np.empty(x.shape[0], np.uint16)
            err_bits, exact = quantize._nearest32_loop(x, grid, fast)
            if exact:
                proved += 1
                assert np.array_equal(fast, symbols)
                assert np.int64(err_bits).view(np.float64) == ref_err
            else:
                fell_back += 1
    assert proved and fell_back  # both ways taken


def _packed_stream(groups: list[tuple[int, list[int]]]) -> np.ndarray:
    """A packed stream's words (width bytes, then each group's codes LSB-first in exactly
    ``width`` words) from (width, codes) per group."""
    head = np.zeros(-(-len(groups) // 4) * 4, np.uint8)
    head[: len(groups)] = [w for w, _ in groups]
    words = [head.view(np.uint32)]
    for w, codes in groups:
        bits = sum(c << (k * w) for k, c in enumerate(codes))
        words.append(np.array([(bits >> (32 * j)) & 0xFFFFFFFF for j in range(w)], np.uint32))
    return np.concatenate(words).astype(np.uint32)


@pytest.mark.parametrize("at", [0, 5, 31, 40])
def test_packed_decode_rejects_a_code_past_the_alphabet(at: int) -> None:
    """A code above ``2 * SYMBOL_OFFSET`` (4095 at width 12) anywhere in any group is
    ``DECODE_BAD_PACKED_CODE`` (the largest code is checked once per block); the largest value
    code decodes."""
    for top, want in ((4095, wire.DECODE_BAD_PACKED_CODE), (2 * SYMBOL_OFFSET, 0)):
        codes = [0] * 64
        codes[at] = top
        seg = _packed_stream([(12, codes[:32]), (12, codes[32:])])
        sym = np.zeros(64, np.uint16)
        status = packed.decode_stream(
            seg, packed.segment_checksum(seg), np.zeros(0, np.uint32), 0, 1, sym
        )
        assert status == want
        if not want:
            assert int(sym[at]) == wire.unzigzag(top)
            assert int(sym.sum()) == int(sym[at]) + 63 * SYMBOL_OFFSET


def _finite_range(x: np.ndarray) -> tuple[float, float]:
    lo, hi = quantize.finite_ranges_kernel(x, np.array([0, x.shape[0]]))
    return float(lo[0]), float(hi[0])


def test_finite_ranges_kernel():
    lo, hi = _finite_range(np.array([], np.float32))
    assert math.isnan(lo) and math.isnan(hi)
    assert _finite_range(np.array([3, -2, 5], np.float32)) == (-2.0, 5.0)
    x = np.array([np.nan, np.inf, -1, 4, -np.inf], np.float32)
    assert _finite_range(x) == (-1.0, 4.0)
    lo, hi = _finite_range(np.array([np.nan, np.inf], np.float32))
    assert math.isnan(lo) and math.isnan(hi)


# ---------------------------------------------------------------------------------------------
# Vector-LZ: dedupe


def _symbol_matrix(rows: int, dim: int, distinct: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    r = rng(seed)
    base_sym = r.integers(2040, 2056, (distinct, dim)).astype(np.uint16)
    base_sym[r.random((distinct, dim)) < 0.1] = ESCAPE_SYMBOL
    base_bits = r.integers(-(2**31), 2**31, (distinct, dim)).astype(np.int32)
    pick = r.integers(0, distinct, rows)
    sym, bits = base_sym[pick].copy(), base_bits[pick].copy()
    # Same symbols, different raw bits: equal for quantized dedupe unless escaped.
    flip = r.random((rows, dim)) < 0.05
    bits[flip] ^= 1
    return sym, bits


@pytest.mark.parametrize(
    ("rows", "dim", "distinct"),
    [(0, 4, 1), (1, 4, 1), (2, 1, 1), (50, 3, 2), (300, 8, 17), (1000, 2, 300), (64, 33, 64)],
)
@pytest.mark.parametrize("raw", [False, True], ids=["symbols", "raw"])
def test_dedupe_kernel_matches_reference(rows, dim, distinct, raw):
    sym, bits = _symbol_matrix(rows, dim, distinct, seed=rows + dim)
    ids, first = host_kernels.dedupe(None if raw else sym, bits)
    keys = vector_lz_ref.element_keys(None if raw else torch.from_numpy(sym.astype(np.int64)),
                                      torch.from_numpy(bits))  # fmt: skip
    ref_ids, ref_first = vector_lz_ref.dedupe_reference(keys)
    assert ids.tolist() == ref_ids.tolist()
    assert first.tolist() == ref_first.tolist()
    # First principles: same id <=> same key row; ids numbered by first occurrence.
    k = keys.numpy()
    for i in range(rows):
        assert np.array_equal(k[i], k[first[ids[i]]])
        assert first[ids[i]] <= i
    assert len({tuple(row) for row in k.tolist()}) == first.shape[0]
    if rows:
        assert ids[0] == 0 and np.all(np.diff(first) > 0)


@pytest.mark.parametrize("dim", [2, 4], ids=["packed-hash", "word-rows"])
def test_dedupe_escaped_elements_compare_raw_bits(dim: int) -> None:
    sym = np.full((3, dim), 2047, np.uint16)
    sym[:, 1] = ESCAPE_SYMBOL
    bits = np.zeros((3, dim), np.int32)
    bits[:, :2] = [[5, 7], [6, 7], [5, 8]]
    ids, first = host_kernels.dedupe(sym, bits)
    assert first.tolist() == [0, 2]
    assert ids.tolist() == [0, 0, 1]  # col 0 quantized alike; escaped col 1 compares raw bits
    ids, _ = host_kernels.dedupe(None, bits)
    assert ids.tolist() == [0, 1, 2]


@pytest.mark.parametrize("col", range(8))
def test_dedupe_word_rows_find_an_escape_in_every_lane(col: int) -> None:
    """Rows of 64-bit words (dim % 4 == 0) spot an escape in any of a word's 4 symbols: equal
    symbols with the escaped element's raw bits different are different vectors."""
    sym = np.full((3, 8), 2047, np.uint16)
    sym[:, col] = ESCAPE_SYMBOL
    sym[:, (col + 1) % 8] = ESCAPE_SYMBOL - 1  # a near miss: a value symbol, compared as one
    bits = np.zeros((3, 8), np.int32)
    bits[:, (col + 1) % 8] = [1, 2, 3]  # raw bits that differ where not escaped: ignored
    bits[:, col] = [9, 9, 4]
    ids, first = host_kernels.dedupe(sym, bits)
    assert ids.tolist() == [0, 0, 1]
    assert first.tolist() == [0, 2]


def test_dedupe_many_hash_probes():
    """Rows that differ in one position only (dense probing of the hash table)."""
    rows = 4096
    bits = np.zeros((rows, 3), np.int32)
    bits[:, 1] = np.arange(rows) // 2  # each value twice
    ids, first = host_kernels.dedupe(None, bits)
    assert first.shape[0] == rows // 2
    assert ids.tolist() == (np.arange(rows) // 2).tolist()


# ---------------------------------------------------------------------------------------------
# Vector-LZ: references


def _ids(rows: int, n_unique: int, seed: int) -> np.ndarray:
    """ids in [0, n_unique) numbered by first occurrence, every id used."""
    r = rng(seed)
    raw = np.concatenate([np.arange(n_unique), r.integers(0, n_unique, rows - n_unique)])
    r.shuffle(raw)
    _, first_idx, inverse = np.unique(raw, return_index=True, return_inverse=True)
    rank = np.empty(n_unique, np.int64)
    rank[np.argsort(first_idx)] = np.arange(n_unique)
    return rank[inverse].astype(np.int32)


@pytest.mark.parametrize("mode", [REFS_FIXED, REFS_FLAGGED], ids=["fixed", "flagged"])
@pytest.mark.parametrize(
    ("rows", "n_unique"),
    [(1, 1), (7, 1), (2, 2), (40, 2), (33, 3), (100, 64), (300, 65), (1000, 999), (5000, 257)],
)
def test_pack_refs_kernel_matches_reference_and_round_trips(mode, rows, n_unique):
    ids = _ids(rows, n_unique, seed=rows)
    words = host_kernels.pack_refs(ids, n_unique, mode)
    ref = host_kernels.pack_refs_reference(torch.from_numpy(ids), n_unique, mode)
    assert words.dtype == np.uint32
    assert words.astype(np.int64).tolist() == ref.tolist()
    assert words.shape[0] == words_for_bits(refs_bits(rows, n_unique, mode))
    width = ref_width(n_unique)
    assert width == (n_unique - 1).bit_length()
    out = np.full(rows, -1, np.int32)
    assert vector_lz.unpack_refs_kernel(words, rows, n_unique, mode, width, out) == 0
    assert out.tolist() == ids.tolist()


def test_unpack_refs_rejects_bad_streams():
    out = np.empty(4, np.int32)
    # fixed, width 2, n_unique 3: id 3 is out of range
    words = host_kernels.pack_refs(np.array([0, 1, 2, 3], np.int32), 4, REFS_FIXED)
    assert vector_lz.unpack_refs_kernel(words, 4, 3, REFS_FIXED, 2, out) == -1
    # bits run out
    words = host_kernels.pack_refs(np.array([0, 1, 2] * 11, np.int32), 3, REFS_FIXED)
    assert words.shape[0] == 3
    out = np.empty(33, np.int32)
    assert vector_lz.unpack_refs_kernel(words[:2], 33, 3, REFS_FIXED, 2, out) == -1
    # flagged: introduces fewer vectors than n_unique
    words = host_kernels.pack_refs(np.array([0, 1, 0, 1], np.int32), 3, REFS_FLAGGED)
    out = np.empty(4, np.int32)
    assert vector_lz.unpack_refs_kernel(words, 4, 3, REFS_FLAGGED, 2, out) == -1
    words = host_kernels.pack_refs(np.array([0, 1, 0, 1], np.int32), 2, REFS_FLAGGED)
    assert vector_lz.unpack_refs_kernel(words, 4, 2, REFS_FLAGGED, 1, out) == 0
    assert out.tolist() == [0, 1, 0, 1]


def test_refs_sizes_and_choice():
    assert refs_bits(100, 1, REFS_FIXED) == 0
    assert refs_bits(100, 1, REFS_FLAGGED) == 100
    assert refs_bits(100, 5, REFS_FIXED) == 300
    assert refs_bits(100, 5, REFS_FLAGGED) == 100 + 95 * 3
    assert refs_bits(100, 90, REFS_FLAGGED) == 100 + 10 * 7
    for rows, n in itertools.product([1, 2, 10, 100, 1000], [1, 2, 3, 9, 100, 1000]):
        if n <= rows:
            best = int(refs_packing(rows, n)[0])
            sizes = [refs_bits(rows, n, m) for m in (REFS_FIXED, REFS_FLAGGED)]
            assert sizes[best] == min(sizes)


# ---------------------------------------------------------------------------------------------
# Huffman: code lengths


def heapq_huffman_lengths(hist: np.ndarray) -> dict[int, int]:
    """Textbook (unlimited) Huffman code lengths."""
    used = [int(s) for s in np.flatnonzero(hist)]
    if len(used) == 1:
        return {used[0]: 1}
    heap = [(int(hist[s]), k, [s]) for k, s in enumerate(used)]
    heapq.heapify(heap)
    depth = dict.fromkeys(used, 0)
    tiebreak = len(heap)
    while len(heap) > 1:
        w1, _, s1 = heapq.heappop(heap)
        w2, _, s2 = heapq.heappop(heap)
        for s in s1 + s2:
            depth[s] += 1
        heapq.heappush(heap, (w1 + w2, tiebreak, s1 + s2))
        tiebreak += 1
    return depth


def check_code(hist: np.ndarray, lengths: np.ndarray) -> None:
    assert lengths.dtype == np.uint8 and lengths.shape == (ALPHABET_SIZE,)
    assert np.array_equal(lengths > 0, hist > 0), "exactly the used symbols get codes"
    assert int(lengths.max(initial=0)) <= MAX_CODE_LENGTH
    used = np.flatnonzero(hist)
    if used.size >= 2:
        kraft = sum(1 << (MAX_CODE_LENGTH - int(lengths[s])) for s in used)
        assert kraft == 1 << MAX_CODE_LENGTH, "the code must be complete"
    # more frequent symbols never get longer codes: sorted by (-count, length), the lengths
    # never decrease
    order = sorted(used, key=lambda sym: (-hist[sym], lengths[sym]))
    assert np.all(np.diff(lengths[order].astype(int)) >= 0)


def _hist(counts: dict[int, int]) -> np.ndarray:
    h = np.zeros(ALPHABET_SIZE, np.int64)
    for s, c in counts.items():
        h[s] = c
    return h


@pytest.mark.parametrize("m", [2, 3, 5, 17, 100, 1000, 4096])
def test_code_lengths_unskewed_are_optimal(m):
    r = rng(m)
    for trial in range(5):
        symbols = r.choice(ALPHABET_SIZE, m, replace=False)
        hist = _hist({int(s): int(c) for s, c in zip(symbols, r.integers(50, 100, m), strict=True)})
        lengths = huffman.code_lengths_kernel(hist)
        check_code(hist, lengths)
        textbook = heapq_huffman_lengths(hist)
        assert max(textbook.values()) <= MAX_CODE_LENGTH  # unskewed: no limiting needed
        cost = int((hist * lengths).sum())
        assert cost == sum(int(hist[s]) * d for s, d in textbook.items()), trial


def test_code_lengths_gaussian_symbols_are_near_optimal():
    r = rng(5)
    sym = np.clip(np.rint(r.normal(2047, 6, 100_000)), 0, 4094).astype(np.int64)
    hist = np.bincount(sym, minlength=ALPHABET_SIZE)
    hist[ESCAPE_SYMBOL] = 3
    lengths = huffman.code_lengths_kernel(hist)
    check_code(hist, lengths)
    textbook = heapq_huffman_lengths(hist)
    assert max(textbook.values()) > MAX_CODE_LENGTH  # the rare tail symbols need limiting
    textbook_cost = sum(int(hist[s]) * d for s, d in textbook.items())
    assert textbook_cost <= int((hist * lengths).sum()) <= 1.002 * textbook_cost


@pytest.mark.parametrize("n_symbols", [14, 20, 30, 45])
def test_code_lengths_fibonacci_forces_the_limit(n_symbols):
    fib = [1, 1]
    while len(fib) < n_symbols:
        fib.append(fib[-1] + fib[-2])
    hist = _hist({4000 - 7 * k: c for k, c in enumerate(fib)})
    textbook = heapq_huffman_lengths(hist)
    assert max(textbook.values()) == n_symbols - 1 > MAX_CODE_LENGTH
    lengths = huffman.code_lengths_kernel(hist)
    check_code(hist, lengths)
    assert int(lengths.max()) == MAX_CODE_LENGTH
    textbook_cost = sum(int(hist[s]) * d for s, d in textbook.items())
    cost = int((hist * lengths).sum())
    assert textbook_cost <= cost <= 1.05 * textbook_cost


def test_code_lengths_degenerate():
    assert not huffman.code_lengths_kernel(np.zeros(ALPHABET_SIZE, np.int64)).any()
    lengths = huffman.code_lengths_kernel(_hist({ESCAPE_SYMBOL: 10}))
    assert lengths[ESCAPE_SYMBOL] == 1 and lengths.sum() == 1
    lengths = huffman.code_lengths_kernel(_hist({5: 1, 9: 10**12}))
    assert lengths[5] == lengths[9] == 1
    lengths = huffman.code_lengths_kernel(np.ones(ALPHABET_SIZE, np.int64))
    assert np.all(lengths == MAX_CODE_LENGTH)
    # deterministic: ties broken by symbol
    h = _hist({1: 5, 2: 5, 3: 5, 4: 5, 5: 5})
    assert np.array_equal(huffman.code_lengths_kernel(h), huffman.code_lengths_kernel(h.copy()))


def test_canonical_codes_are_prefix_free_and_ordered():
    r = rng(8)
    hist = np.zeros(ALPHABET_SIZE, np.int64)
    hist[r.choice(ALPHABET_SIZE, 300, replace=False)] = r.integers(1, 10_000, 300)
    lengths = huffman.code_lengths_kernel(hist)
    codes = huffman.canonical_codes_kernel(lengths)
    used = sorted(np.flatnonzero(lengths), key=lambda s: (lengths[s], s))
    prev_code, prev_len = -1, 0
    for s in used:
        length, code = int(lengths[s]), int(codes[s])
        assert code < 1 << length
        expected = 0 if prev_code < 0 else (prev_code + 1) << (length - prev_len)
        assert code == expected
        prev_code, prev_len = code, length
    strings = [format(int(codes[s]), f"0{int(lengths[s])}b") for s in used]
    for a, b in itertools.combinations(strings, 2):
        assert not a.startswith(b) and not b.startswith(a)


# ---------------------------------------------------------------------------------------------
# Huffman: encode / decode


def _stream(n: int, seed: int, escapes: int = 0, spread: float = 3.0) -> np.ndarray:
    r = rng(seed)
    sym = np.clip(np.rint(r.normal(2047, spread, n)), 0, 4094).astype(np.uint16)
    if escapes:
        sym[r.choice(n, escapes, replace=False)] = ESCAPE_SYMBOL
    return sym


def _code_for(sym: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hist = np.bincount(sym, minlength=ALPHABET_SIZE).astype(np.int64)
    lengths = huffman.code_lengths_kernel(hist)
    return lengths, huffman.canonical_codes_kernel(lengths)


@pytest.mark.parametrize(
    ("n", "chunk"),
    [(1, 64), (63, 64), (64, 64), (65, 64), (1000, 64), (1000, 96), (1000, 333), (1000, 1000),
     (1000, 1001), (5000, 2048), (3, 1), (50, 7)],
)  # fmt: skip
def test_encode_kernel_matches_reference_and_decodes(n, chunk):
    sym = _stream(n, seed=n + chunk, escapes=min(5, n // 10))
    lengths, codes = _code_for(sym)
    dim = 1
    rows = np.arange(n, dtype=np.int32)
    ends, words = host_kernels.encode(sym.reshape(n, dim), rows, lengths, codes, chunk)
    ref_ends, ref_words = host_kernels.encode_reference(
        torch.from_numpy(sym.astype(np.int64)),
        torch.from_numpy(lengths.astype(np.int64)),
        torch.from_numpy(codes.astype(np.int64)),
        chunk,
    )
    assert ends.tolist() == ref_ends
    assert words.tolist() == ref_words
    assert ends.shape[0] == math.ceil(n / chunk)
    esc = np.flatnonzero(sym == ESCAPE_SYMBOL).astype(np.uint32)
    out = np.empty(n, np.uint16)
    assert host_kernels.decode_kernel(words, ends, chunk, lengths, esc, out) == 0
    assert np.array_equal(out, sym)
    ref = host_kernels.decode_reference(
        words.tolist(), ends.tolist(), n, chunk, torch.from_numpy(lengths.astype(np.int64))
    )
    assert ref == sym.tolist()


def test_encode_selected_rows_in_the_given_order():
    sym = _stream(40 * 9, seed=2).reshape(40, 9)
    rows = np.array([39, 0, 17, 17, 5], np.int32)
    lengths, codes = _code_for(sym.reshape(-1))
    ends, words = host_kernels.encode(sym, rows, lengths, codes, 64)
    ref_ends, ref_words = host_kernels.encode_reference(
        torch.from_numpy(sym[rows].reshape(-1).astype(np.int64)),
        torch.from_numpy(lengths.astype(np.int64)),
        torch.from_numpy(codes.astype(np.int64)),
        64,
    )
    assert (ends.tolist(), words.tolist()) == (ref_ends, ref_words)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 4097])
def test_single_symbol_stream(n):
    sym = np.full(n, 1234, np.uint16)
    lengths, codes = _code_for(sym)
    assert lengths[1234] == 1 and lengths.sum() == 1
    for chunk in (64, 100, 2048):
        ends, words = host_kernels.encode(sym.reshape(n, 1), np.arange(n, dtype=np.int32),
                                            lengths, codes, chunk)  # fmt: skip
        sizes = [min(chunk, n - c) for c in range(0, n, chunk)]
        assert ends.tolist() == list(itertools.accumulate(math.ceil(s / 32) for s in sizes))
        assert not words.any()  # the one code is "0"
        out = np.empty(n, np.uint16)
        assert (
            host_kernels.decode_kernel(words, ends, chunk, lengths, np.zeros(0, np.uint32), out)
            == 0
        )
        assert np.all(out == 1234)


def test_empty_stream():
    lengths, codes = _code_for(np.array([7], np.uint16))
    ends, words = host_kernels.encode(np.zeros((0, 3), np.uint16), np.zeros(0, np.int32),
                                        lengths, codes, 64)  # fmt: skip
    assert ends.shape == (0,) and words.shape == (0,)
    out = np.empty(0, np.uint16)
    assert host_kernels.decode_kernel(words, ends, 64, lengths, np.zeros(0, np.uint32), out) == 0


def test_decode_kernel_reports_corruption():
    n, chunk = 500, 128
    sym = _stream(n, seed=11, escapes=4, spread=20)
    lengths, codes = _code_for(sym)
    ends, words = host_kernels.encode(sym.reshape(n, 1), np.arange(n, dtype=np.int32),
                                        lengths, codes, chunk)  # fmt: skip
    esc = np.flatnonzero(sym == ESCAPE_SYMBOL).astype(np.uint32)
    out = np.empty(n, np.uint16)

    def status(w=words, e=ends, ln=lengths, p=esc):
        return host_kernels.decode_kernel(w, e, chunk, ln, p, out)

    assert status() == 0
    # chunk table decreasing / not ending at the end of the stream
    bad = ends.copy()
    bad[1], bad[2] = bad[2], bad[1]
    assert status(e=bad) == wire.DECODE_BAD_CHUNK_TABLE
    assert status(w=np.concatenate([words, [0]]).astype(np.uint32)) == (wire.DECODE_BAD_CHUNK_TABLE)
    # a chunk that runs out of bits: drop the last word of chunk 0 and shift the table
    short = np.delete(words, ends[0] - 1)
    shifted = ends.astype(np.int64) - 1
    assert status(w=short, e=shifted.astype(np.uint32)) in (
        wire.DECODE_OUT_OF_BITS,
        wire.DECODE_INVALID_CODE,
    )
    # escape positions that disagree with the stream
    assert status(p=esc[:-1]) == wire.DECODE_BAD_ESCAPES
    assert status(p=(esc + 1).astype(np.uint32)) == wire.DECODE_BAD_ESCAPES
    # codebooks that are not prefix codes
    over = lengths.copy()
    over[np.flatnonzero(over)[0]] = 13
    assert status(ln=over) == wire.DECODE_BAD_CODEBOOK
    kraft = lengths.copy()
    kraft[np.flatnonzero(kraft == 0)[0]] = 1
    assert status(ln=kraft) == wire.DECODE_BAD_CODEBOOK
    # an incomplete code: a bit pattern no code starts with
    two = _hist({10: 1, 20: 1})
    ln = huffman.code_lengths_kernel(two)
    ln[20] = 2  # codes "0" and "10"; "11" is unused
    assert host_kernels.decode_kernel(np.array([0xFFFFFFFF], np.uint32), np.array([1], np.uint32),
                                 64, ln, np.zeros(0, np.uint32), np.empty(3, np.uint16)) == (
        wire.DECODE_INVALID_CODE
    )  # fmt: skip


def test_decode_table():
    lengths = np.zeros(ALPHABET_SIZE, np.uint8)
    lengths[[3, 4, 5]] = [1, 2, 2]
    table = huffman.decode_table_kernel(lengths)
    assert table.shape[0] == 4  # sized to the longest code
    assert [(int(e) & 0xFFFF, int(e) >> 16) for e in table] == [(3, 1), (3, 1), (4, 2), (5, 2)]
    lengths[6] = 1  # Kraft sum 1.5
    assert huffman.decode_table_kernel(lengths).shape[0] == 0


def test_expand_codebook_follows_the_spec():
    """format.md: 4-bit lengths of sym_lo .. sym_lo + sym_count - 1, low nibble first."""
    r = rng(4)
    for lo, count in [(0, 0), (0, 1), (2040, 15), (100, 2), (0, 4095), (4094, 1)]:
        lengths = np.zeros(ALPHABET_SIZE, np.uint8)
        lengths[lo : lo + count] = r.integers(0, 13, count)
        nib = np.zeros(count + count % 2, np.uint8)
        nib[:count] = lengths[lo : lo + count]
        packed = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
        lengths[ESCAPE_SYMBOL] = 9
        got = host_kernels.expand_codebook_kernel(packed, lo, count, 9)
        assert np.array_equal(got, lengths)


def test_symbol_range_and_plan():
    lengths = np.zeros(ALPHABET_SIZE, np.uint8)
    assert host_kernels.symbol_range_kernel(lengths) == (0, 0)
    lengths[[7, 100, ESCAPE_SYMBOL]] = [1, 2, 2]
    assert host_kernels.symbol_range_kernel(lengths) == (7, 94)
    hist = _hist({7: 10, 100: 3, ESCAPE_SYMBOL: 2})
    lengths, bits, n, lo, count = host_kernels.plan_kernel(hist)
    assert n == 15 and bits == int((hist * lengths).sum()) and (lo, count) == (7, 94)
