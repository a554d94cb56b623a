"""Triton quantize and the decoder's output stage, bit-exact with ``torchrec_lossy.codec.quantize``.

:func:`quantize_tiles` quantizes every block in one launch (a tile table; step, center, bound and
dtype from each block's ``encode_columns`` record): per element the code, the reconstruction
rounded to the dtype, the float64 bound check, escape and symbol; the max error and histograms.
:func:`decode_outputs` writes every block of a payload in one launch. CPU twins
``quantize_blocks_kernel`` / ``dequantize_kernel``; torch twin ``kernels/quantize_ref.py``.
Bit-exactness (no FMA, no libdevice, no NaN / Inf into float->int): docs/kernels.md,
'Bit-exactness points', and a comment at each spot.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import encode_columns as ec
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.encode_columns import GRID_STATS, EncodeColumns, GridRule
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    BFLOAT16_CODE,
    ESCAPE_SYMBOL,
    FLOAT16_CODE,
    FLOAT32_CODE,
    MAX_CENTER,
    SYMBOL_OFFSET,
)
from torchrec_lossy.codec.launch_tables import block_for
from torchrec_lossy.config import BoundKind
from torchrec_lossy.kernels.common import find_segment
from torchrec_lossy.kernels.packed import packed_code, packed_symbol

# Globals a kernel reads must be constexpr.
_ALPHABET: tl.constexpr = tl.constexpr(ALPHABET_SIZE)
_ESCAPE: tl.constexpr = tl.constexpr(ESCAPE_SYMBOL)
_OFFSET: tl.constexpr = tl.constexpr(SYMBOL_OFFSET)
_FLOAT32: tl.constexpr = tl.constexpr(FLOAT32_CODE)
_FLOAT16: tl.constexpr = tl.constexpr(FLOAT16_CODE)
_BFLOAT16: tl.constexpr = tl.constexpr(BFLOAT16_CODE)
_F16_INF_FROM: tl.constexpr = tl.constexpr(0x477FF000)  # bits of 65520.0: fp16 inf from here
_F16_NORMAL_FROM: tl.constexpr = tl.constexpr(0x38800000)  # bits of 2**-14: smallest normal fp16
# The grid rule's constants (codec/quantize.py) and the grid launch's output columns.
_RELATIVE: tl.constexpr = tl.constexpr(int(BoundKind.RELATIVE))
_VALUE: tl.constexpr = tl.constexpr(int(BoundKind.VALUE))
_INF: tl.constexpr = tl.constexpr(float("inf"))
_FLT_MAX: tl.constexpr = tl.constexpr(float(np.finfo(np.float32).max))
_FLT_MIN: tl.constexpr = tl.constexpr(float(np.finfo(np.float32).tiny))
_MAX_CENTER: tl.constexpr = tl.constexpr(MAX_CENTER)
_GRID_STATS: tl.constexpr = tl.constexpr(ec.GRID_STATS)
_GRID_OK: tl.constexpr = tl.constexpr(ec.GRID_OK)
_GRID_LO: tl.constexpr = tl.constexpr(ec.GRID_LO)
_GRID_HI: tl.constexpr = tl.constexpr(ec.GRID_HI)
_GRID_ILO: tl.constexpr = tl.constexpr(ec.GRID_ILO)
_GRID_IHI: tl.constexpr = tl.constexpr(ec.GRID_IHI)
_GRID_N_FIN: tl.constexpr = tl.constexpr(ec.GRID_N_FIN)
_GRID_MEDIAN: tl.constexpr = tl.constexpr(ec.GRID_MEDIAN)


@triton.jit
def round_to_dtype(v, DTYPE_CODE: tl.constexpr):
    """Rounds float32 values to fp16 or bf16 (by dtype code), nearest-even; fp32 as is.

    Integer twin of ``_round_to_dtype``: non-finite values pass through unchanged. Bit ops, not
    libdevice ``rint``: the interpreter cannot run libdevice, and integer ops are exact anyway.
    """
    if DTYPE_CODE == _FLOAT32:
        return v
    bits = v.to(tl.uint32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    if DTYPE_CODE == _BFLOAT16:
        # bf16 keeps the top 16 bits: add half an ulp (minus one when the kept lsb is 0).
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    else:
        sign = bits & 0x80000000  # copysign, as the CPU twin: -0.0 stays -0.0
        mag = bits & 0x7FFFFFFF
        # Normal fp16 range: the quantum is 2**(exponent - 10), i.e. drop 13 mantissa bits.
        normal = (mag + 0xFFF + ((mag >> 13) & 1)) & 0xFFFFE000
        # Subnormal fp16 range: multiples of 2**-24. With a = m * 2**(e - 23) (m the 24-bit
        # significand), a * 2**24 = m >> s for s = -e - 1 (>= 14 here), rounded to nearest even.
        exp_field = (mag >> 23).to(tl.int32)
        m = (mag & 0x7FFFFF) | tl.where(exp_field > 0, 0x800000, 0).to(tl.uint32)
        e = tl.where(exp_field > 0, exp_field - 127, -126)
        s = tl.minimum(tl.maximum(-e - 1, 14), 31).to(tl.uint32)  # clamped: no lane shifts >= 32
        k = m >> s
        rem = m & ((tl.full(m.shape, 1, tl.uint32) << s) - 1)
        half = tl.full(m.shape, 1, tl.uint32) << (s - 1)
        k = k + ((rem > half) | ((rem == half) & ((k & 1) == 1))).to(tl.uint32)
        sub = (k.to(tl.float32) * 5.9604644775390625e-08).to(tl.uint32, bitcast=True)  # * 2**-24
        r = tl.where(
            mag >= _F16_INF_FROM, 0x7F800000, tl.where(mag < _F16_NORMAL_FROM, sub, normal)
        )
        r = r | sign
    return tl.where(finite, r.to(tl.float32, bitcast=True), v)


@triton.jit
def round_to_code(v, dtype_code):
    """:func:`round_to_dtype` for a dtype code known at run time (a block's)."""
    return tl.where(
        dtype_code == _FLOAT16,
        round_to_dtype(v, _FLOAT16),
        tl.where(dtype_code == _BFLOAT16, round_to_dtype(v, _BFLOAT16), v),
    )


@triton.jit
def uniform_draw(i, key):
    """Stochastic rounding's ``u`` in [0, 1) for element indices ``i`` of a block with ``key``:
    ``mix32(i ^ key) >> 8`` times 2**-24 (twin of ``quantize_ref.uniform_reference``)."""
    h = (i & 0xFFFFFFFF).to(tl.uint32) ^ key.to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # * 2**-24


@triton.jit
def value_shift(step_bits):
    """``format.value_shift`` from the step's float32 bits: ``23 - m`` for step ``2**-m``
    (22 + the binary exponent of any normal step), clamped to 0..23 so no lane shifts wildly."""
    return tl.minimum(tl.maximum(((step_bits >> 23) & 0xFF) - 104, 0), 23)


@triton.jit
def value_symbol(bits, shift, qmax):
    """Twin of ``format.value_symbol`` on int64 lanes: (symbol or the escape, float32 bits
    of the reconstruction as a non-negative int64)."""
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    q = (mag + ((tl.full(mag.shape, 1, tl.int64) << shift) >> 1)) >> shift
    d = qmax - q
    fits = tl.where(mag == 0, sign == 0, (d >= 0) & (d < _OFFSET))
    sym = _OFFSET + tl.where(mag == 0, 0, tl.where(sign == 0, d + 1, -d - 1))
    return tl.where(fits, sym, _ESCAPE), ((q << shift) & 0x7FFFFFFF) | sign


@triton.jit
def value_decode_bits(symbols, shift, qmax):
    """Twin of ``format.value_decode_bits`` on int64 lanes."""
    s = symbols - _OFFSET
    q = qmax + 1 - tl.abs(s)
    mag = tl.where((s == 0) | (q < 0), 0, (q << shift) & 0x7FFFFFFF)
    return mag | tl.where(s < 0, 0x80000000, 0)


@triton.jit
def _quantize_kernel(
    x_ptr, sym_ptr, hist_ptr, err_ptr, tile_ptr, cols_ptr, BLOCK: tl.constexpr,
    HIST: tl.constexpr,
):  # fmt: skip
    # One program per tile; a tile is (first element, end element, block) and never straddles
    # blocks, so the block's parameters are scalars and its histogram (HIST) one row. Field F
    # of block b is at cols_ptr + b * N_FIELDS + F (``encode_columns``).
    pid = tl.program_id(0).to(tl.int64)
    start = tl.load(tile_ptr + 3 * pid)
    end = tl.load(tile_ptr + 3 * pid + 1)
    blk = tl.load(tile_ptr + 3 * pid + 2)
    col = cols_ptr + blk * ec.N_FIELDS
    step_bits = tl.load(col + ec.STEP_BITS)
    step = step_bits.to(tl.int32).to(tl.float32, bitcast=True)
    inv_step = tl.load(col + ec.INV_STEP_BITS).to(tl.int32).to(tl.float32, bitcast=True)
    center = tl.load(col + ec.CENTER)
    bound = tl.load(col + ec.BOUND_BITS).to(tl.float64, bitcast=True)
    dtype_code = tl.load(col + ec.DTYPE)
    offs = start + tl.arange(0, BLOCK)
    in_range = offs < end
    v = tl.load(x_ptr + offs, mask=in_range, other=0.0)
    sr_key = tl.load(col + ec.SR_KEY)  # -1: round to nearest
    t = v * inv_step  # rounded before the + 0.5 below: the launch forbids FMA contraction
    fl = tl.floor(t)
    u = uniform_draw(offs - tl.load(col + ec.ELEM_OFF), sr_key)
    qf = tl.where(sr_key < 0, tl.floor(t + 0.5), tl.where(u < t - fl, fl + 1.0, fl))
    rel = qf.to(tl.float64) - center
    r = qf * step
    recon = round_to_code(r, dtype_code)
    err = tl.abs(recon.to(tl.float64) - v.to(tl.float64))
    ok = (tl.abs(rel) <= _OFFSET) & (err <= bound)  # False for NaN and Inf too
    # Only finite, in-range values reach the conversion: NaN / Inf -> int is undefined on the GPU.
    q = tl.where(ok, rel, 0.0).to(tl.int32)
    sym = tl.where(ok, q + _OFFSET, _ESCAPE)
    # The per-value grid (format.value_symbol), checked against bound * |x|; its max error
    # is the relative one.
    vbits = v.to(tl.uint32, bitcast=True).to(tl.int64)
    vsym, rb = value_symbol(vbits, value_shift(step_bits), center)
    vr = rb.to(tl.uint32).to(tl.float32, bitcast=True)
    vrecon = round_to_code(vr, dtype_code)
    ax = tl.abs(v.to(tl.float64))
    verr = tl.abs(vrecon.to(tl.float64) - v.to(tl.float64))
    vok = (vsym != _ESCAPE) & (verr <= bound * ax)  # False for NaN and Inf too
    is_value = tl.load(col + ec.VALUE) != 0
    ok = tl.where(is_value, vok, ok)
    sym = tl.where(is_value, tl.where(vok, vsym, _ESCAPE).to(tl.int32), sym)
    err = tl.where(is_value, tl.where(ax > 0, verr / tl.where(ax > 0, ax, 1.0), 0.0), err)
    tl.store(sym_ptr + offs, sym.to(tl.int16), mask=in_range)
    tl.store(err_ptr + pid, tl.max(tl.where(ok & in_range, err, 0.0), axis=0))
    if HIST:
        hist = tl.histogram(sym, _ALPHABET, mask=in_range)
        # Integer counts: the atomics' order cannot change the result.
        bins = tl.arange(0, _ALPHABET)
        tl.atomic_add(hist_ptr + blk * _ALPHABET + bins, hist, mask=hist > 0, sem="relaxed")


def quantize_tiles(
    x: torch.Tensor, tiles: torch.Tensor, cols: EncodeColumns, block: int,
    histograms: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Quantizes many blocks laid out back to back in one launch; nothing is synced.

    Args:
        x: 1-D float32 values of every block (exact copies of their fp32 / fp16 / bf16 values).
        tiles: int64 [n_tiles, 3] from ``launch_tables.tile_table`` (``block``-element tiles), on
            ``x``'s device.
        cols: The blocks' compress record; read: ``STEP_BITS`` (the float32 step),
            ``INV_STEP_BITS`` (its float32 reciprocal), ``CENTER`` (code of the midpoint),
            ``BOUND_BITS`` (the float64 absolute bound), ``DTYPE`` (the reconstruction is rounded
            to it), ``SR_KEY`` (stochastic-rounding key, -1 for round to nearest; the draw's
            counter is the element's index within its block), ``ELEM_OFF`` (first element of the
            block: its first tile's start), ``VALUE`` (1 for blocks on the per-value grid:
            ``step`` 2**-m, ``center`` qmax, ``bound`` relative; their max error is relative).
        block: Elements per tile (a power of two).
        histograms: Whether to count the symbols (the entropy format's code plan; the packed
            format needs none: then no histogram is built and an empty one is returned).

    Returns:
        (int16 symbols like ``x`` (the uint16 symbols' bits), int32 [n_blocks, ALPHABET_SIZE]
        histograms ([0, ALPHABET_SIZE] without ``histograms``), float64 [n_tiles] max error of
        each tile over the elements not escaped).
    """
    dev = x.device
    x = x.contiguous()
    symbols = torch.zeros(x.shape[0], dtype=torch.int16, device=dev)  # 0 outside the tiles
    n_hist = cols.n_blocks if histograms else 0
    hist = torch.zeros(n_hist, ALPHABET_SIZE, dtype=torch.int32, device=dev)
    n_tiles = tiles.shape[0]
    errors = torch.empty(n_tiles, dtype=torch.float64, device=dev)
    if n_tiles:
        # enable_fp_fusion=False: x * inv_step + 0.5 must round twice (mul, then add), as on the
        # CPU; the GPU compiler would contract it into one FMA (the interpreter never fuses).
        _quantize_kernel[(n_tiles,)](
            x, symbols, hist, errors, tiles.contiguous(), cols.cols, BLOCK=block,
            HIST=histograms, num_warps=8, enable_fp_fusion=False,
        )  # fmt: skip
    return symbols, hist, errors


@triton.jit
def _order_key(v):
    """float32 -> uint32 keys in the values' order (negative values' bits inverted, positive
    ones' sign bit set; -0.0 sorts just before +0.0, which compare equal as floats)."""
    bits = v.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _select_key(x_ptr, start, end, rank, BLOCK: tl.constexpr):
    """The key (``_order_key``) of the ``rank``-th smallest finite value of ``x[start:end]``:
    a radix select, four passes of an 8-bit digit histogram over the values whose key agrees
    with the digits chosen so far (no sort)."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), tl.uint32)
    known = tl.zeros((), tl.uint32)  # mask of the digits chosen
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # a constant per unrolled pass
        hist = tl.zeros((256,), tl.int32)
        for t0 in range(start, end, BLOCK):
            offs = t0 + tl.arange(0, BLOCK)
            inside = offs < end
            v = tl.load(x_ptr + offs, mask=inside, other=0.0)
            key = _order_key(v)
            # A finite value's exponent field is not all ones.
            finite = (v.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000
            match = inside & finite & ((key & known) == prefix)
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=match)
        below = tl.cumsum(hist, 0)
        d = tl.sum((below <= rank).to(tl.int32), axis=0)  # the bin holding rank
        rank -= tl.sum(tl.where(bins < d, hist, 0), axis=0)
        prefix = prefix | (d.to(tl.uint32) << shift)
        known = known | (tl.full((), 0xFF, tl.uint32) << shift)
    return prefix


@triton.jit
def _key_value(key):
    """The float32 value (as float64) of an ``_order_key`` key."""
    bits = tl.where((key >> 31) != 0, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True).to(tl.float64)


@triton.jit
def _range_keys(x_ptr, start, end, keep_below, BLOCK: tl.constexpr):
    """Smallest and largest int32 order key (``v ^ ((v >> 31) & 0x7FFFFFFF)``, the host's
    ``finite_ranges_kernel`` keys) of ``x[start:end]`` over the values whose exponent field
    is below ``keep_below`` (256: every finite one; the sentinels 0x7FFFFFFF / -0x7FFFFFFF
    when none: NaN bits, never a finite key)."""
    mn = tl.full((), 0x7FFFFFFF, tl.int32)
    mx = tl.full((), -0x7FFFFFFF, tl.int32)
    for t0 in range(start, end, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        inside = offs < end
        v = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.int32, bitcast=True)
        e = (v >> 23) & 0xFF
        keep = inside & (e != 255) & (e < keep_below)
        key = v ^ ((v >> 31) & 0x7FFFFFFF)
        mn = tl.minimum(mn, tl.min(tl.where(keep, key, 0x7FFFFFFF), axis=0))
        mx = tl.maximum(mx, tl.max(tl.where(keep, key, -0x7FFFFFFF), axis=0))
    return mn, mx


@triton.jit
def _key_float(key):
    """The float32 value of an ``_range_keys`` key; the sentinels (no value) to +inf / -inf
    (``quantize_ref.key_values``)."""
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    none = (key == 0x7FFFFFFF) | (key == -0x7FFFFFFF)
    inf = tl.where(key > 0, 0x7F800000, -0x800000)  # +inf / -inf bits
    return tl.where(none, inf, bits).to(tl.float32, bitcast=True)


@triton.jit
def _f64_bits(v):
    """int64 bits of a float value as float64 (exact from float32)."""
    return v.to(tl.float64).to(tl.int64, bitcast=True)


@triton.jit
def _grid_kernel(
    x_ptr, cols_ptr, rows_ptr, kind_ptr, given_ptr, try_ptr, out_ptr, OCTAVES: tl.constexpr,
    STOCHASTIC: tl.constexpr, QUANTIZATION: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per block: its finite range, finite count and exponent-field histogram in
    # one pass; the lower median exponent M of its normal values; the range of its finite
    # values with exponent below M + OCTAVES (codec/outliers.py); then the grid rule of
    # codec/quantize.py (block_bound, uses_median, block_grid: each line below names its
    # step), the median by a radix select only where the rule centers on it; the grid written
    # into the block's encode record, the ranges and ok into its row of ``out``.
    b = tl.program_id(0).to(tl.int64)
    col = cols_ptr + b * ec.N_FIELDS
    start = tl.load(col + ec.ELEM_OFF)
    numel = tl.load(rows_ptr + b) * tl.load(col + ec.DIM)
    end = start + numel
    hist = tl.zeros((256,), tl.int32)
    n_fin = tl.zeros((), tl.int64)
    for t0 in range(start, end, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        inside = offs < end
        v = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.int32, bitcast=True)
        e = (v >> 23) & 0xFF
        n_fin += tl.sum((inside & (e != 255)).to(tl.int64), axis=0)
        hist += tl.histogram(e, 256, mask=inside & (e >= 1) & (e <= 254))
    half = (tl.sum(hist, axis=0) + 1) // 2
    m_exp = tl.sum((tl.cumsum(hist, 0) < half).to(tl.int32), axis=0)
    lo_k, hi_k = _range_keys(x_ptr, start, end, 256, BLOCK)
    ilo_k, ihi_k = _range_keys(x_ptr, start, end, m_exp + OCTAVES, BLOCK)
    lo, hi = _key_float(lo_k), _key_float(hi_k)
    ilo, ihi = _key_float(ilo_k), _key_float(ihi_k)
    kind = tl.load(kind_ptr + b)
    given = tl.load(given_ptr + b).to(tl.float64, bitcast=True)
    # block_bound: a relative bound over the inlier range (bounds.finite_span, float32 span).
    rel = kind == _RELATIVE
    span = (tl.where(rel, ihi, hi) - tl.where(rel, ilo, lo)).to(tl.float64)
    span = tl.where((span > 0) & (span < _INF), span, 0.0)
    bound = tl.where(rel, tl.where(given > 0, given * span, 0.0), given)
    may = (bound > 0) & (numel > 0) & QUANTIZATION
    grid = bound * 0.5 if STOCHASTIC else bound
    # uses_median: the range does not fit the alphabet around its midpoint (midpoint_fits).
    lo64, hi64 = lo.to(tl.float64), hi.to(tl.float64)
    some = lo <= hi
    two = 2.0 * grid
    two_c = tl.where(two > _FLT_MAX, _FLT_MAX, two)  # NaN stays
    fits = (hi64 - lo64) <= two_c * (2 * _OFFSET)
    need = may & (kind != _VALUE) & some & ~fits
    median = tl.zeros((), tl.float64)
    if need & (n_fin > 0):
        lower = _key_value(_select_key(x_ptr, start, end, ((n_fin - 1) // 2).to(tl.int32), BLOCK))
        upper = _key_value(_select_key(x_ptr, start, end, (n_fin // 2).to(tl.int32), BLOCK))
        median = (lower + upper) / 2 + 0.0  # + 0.0: a -0.0 / +0.0 tie gives +0.0
    mid = tl.where(need, median, tl.where(some, 0.5 * (lo64 + hi64), 0.0))  # grid_mid
    # grid_step: the float32 at most 2 * grid; its float32 reciprocal.
    step = two_c.to(tl.float32)
    down = (step.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    step = tl.where(step.to(tl.float64) > two, down, step)
    step_ok = step >= _FLT_MIN
    inv_step = (1.0 / tl.where(step_ok, step, 1.0).to(tl.float64)).to(tl.float32)
    step = tl.where(step_ok, step, 0.0)
    inv_step = tl.where(step_ok, inv_step, 0.0)
    # grid_center: no FMA (the launch forbids contraction).
    center = tl.floor((mid.to(tl.float32) * inv_step).to(tl.float64) + 0.5)
    abs_ok = step_ok & (tl.abs(center) <= _MAX_CENTER)  # False for inf and NaN
    # value_params: m from the bound's binary exponent (frexp), qmax the code of max |x|.
    bits = bound.to(tl.int64, bitcast=True)
    e64 = (bits >> 52) & 0x7FF
    mag = bits & 0x7FFFFFFFFFFFFFFF
    exponent = tl.where((e64 == 0x7FF) | (mag == 0), 0, tl.where(e64 == 0, -1022, e64 - 1022))
    m = tl.minimum(tl.maximum(-exponent, 0), 23)
    v_step = ((127 - m) << 23).to(tl.int32).to(tl.float32, bitcast=True)
    amax = tl.where(some, tl.maximum(tl.abs(lo64), tl.abs(hi64)), 0.0)
    amax_bits = amax.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0x7FFFFFFF
    shift = 23 - m
    qmax = (amax_bits + ((1 << shift) >> 1)) >> shift  # format.value_code
    # block_grid: 0 where not ok.
    value = kind == _VALUE
    ok = tl.where(value, may, may & abs_ok)
    step_out = tl.where(ok, tl.where(value, v_step, step), 0.0)
    inv_out = tl.where(ok & ~value, inv_step, 0.0)
    center_out = tl.where(ok, tl.where(value, qmax, tl.where(abs_ok, center, 0.0).to(tl.int64)), 0)
    tl.store(col + ec.STEP_BITS, step_out.to(tl.int32, bitcast=True).to(tl.int64))
    tl.store(col + ec.INV_STEP_BITS, inv_out.to(tl.int32, bitcast=True).to(tl.int64))
    tl.store(col + ec.CENTER, center_out)
    tl.store(col + ec.BOUND_BITS, bits)
    row = out_ptr + b * _GRID_STATS
    tl.store(row + _GRID_OK, (ok & (tl.load(try_ptr + b) == 1)).to(tl.int64))
    tl.store(row + _GRID_LO, _f64_bits(lo))
    tl.store(row + _GRID_HI, _f64_bits(hi))
    tl.store(row + _GRID_ILO, _f64_bits(ilo))
    tl.store(row + _GRID_IHI, _f64_bits(ihi))
    tl.store(row + _GRID_N_FIN, n_fin)
    tl.store(row + _GRID_MEDIAN, median.to(tl.int64, bitcast=True))


def block_grids(
    x: torch.Tensor, cols: EncodeColumns, rows: torch.Tensor, rule: GridRule
) -> torch.Tensor:
    """Every block's grid (``codec.quantize``'s rule from its finite and inlier ranges and,
    where the rule centers on it, its median: a radix select, no sort), in one launch (one
    program per block, no atomics, no sync).

    Args:
        x: 1-D float32 values of every block, back to back.
        cols: The blocks' encode record (read: ``ELEM_OFF``, ``DIM``); its grid fields
            (``STEP_BITS``, ``INV_STEP_BITS``, ``CENTER``, ``BOUND_BITS``: the bound
            resolved) are written.
        rows: int64 [n_blocks] rows of each block.
        rule: The bounds as given and the rule's switches (:class:`GridRule`).

    Returns:
        int64 [n_blocks, GRID_STATS] (``quantize_ref``'s ``GRID_*`` columns): whether the
        block is quantized (and its quantize tiles ran), its finite and inlier ranges and its
        median (float64 bits: +inf / -inf where none; the median 0.0 where not used), its
        finite count.
    """
    nb = cols.n_blocks
    out = torch.empty((nb, GRID_STATS), dtype=torch.int64, device=x.device)
    if nb:
        _grid_kernel[(nb,)](
            x, cols.cols, rows, rule.kind, rule.bound_bits, rule.quant_try, out,
            OCTAVES=rule.octaves, STOCHASTIC=rule.stochastic, QUANTIZATION=rule.quantization,
            BLOCK=1024, enable_fp_fusion=False,
        )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------
# Decode side, batched (device decompress): every block's output elements in one launch.


@triton.jit
def _decode_output_kernel(
    words_ptr,
    halves_ptr,
    cols_ptr,
    ids_ptr,
    sym_ptr,
    rank_ptr,
    out32_ptr,
    out16_ptr,
    stride,
    n_blocks,
    n_iter,
    esc_iter,
    BLOCK: tl.constexpr,
    PACKED: tl.constexpr,
):
    # PACKED: sym_ptr / rank_ptr are the packed groups' widths and their prefix sums, and each
    # quantized value is decoded from the payload's codes (kernels/packed.py's packed_code).
    # Element e of block b is row r = e // dim, column j; its vector is u = ids[r] (LZ modes) or
    # r, and its value element u * dim + j of the block's distinct vectors: raw bits from the
    # payload (raw, lz), or the dequantized symbol / escaped bits (quant, quant+lz). The output
    # and the raw / escaped values are addressed as 32-bit words or 16-bit halves by dtype.
    # Field F of block b is at cols_ptr + F * stride + b (``decode_columns``).
    g = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    out_base = cols_ptr + dc.OUT_BASE * stride
    mask = g < tl.load(out_base + n_blocks)
    b = find_segment(out_base, g, n_blocks, n_iter)
    e = g - tl.load(out_base + b)
    mode = tl.load(cols_ptr + dc.MODE * stride + b, mask=mask, other=0)
    dtype_code = tl.load(cols_ptr + dc.DTYPE * stride + b, mask=mask, other=_FLOAT32)
    dim = tl.load(cols_ptr + dc.DIM * stride + b, mask=mask, other=1)
    wide = dtype_code == _FLOAT32
    lz = mask & ((mode & 1) == 1)
    quant = mask & ((mode & 2) == 2)
    r = e // dim
    id_base = tl.load(cols_ptr + dc.ID_BASE * stride + b, mask=lz, other=0)
    u = tl.load(ids_ptr + id_base + r, mask=lz, other=0)
    u = tl.where(lz, u.to(tl.int64), r)
    # Clamped: ids are unchecked until the status is read, and must not steer a read elsewhere.
    n_unique = tl.load(cols_ptr + dc.N_UNIQUE * stride + b, mask=mask, other=1)
    u = tl.minimum(tl.maximum(u, 0), n_unique - 1)
    idx = u * dim + (e - r * dim)
    plain = mask & ~quant
    src = tl.load(cols_ptr + dc.SRC_OFF * stride + b, mask=plain, other=0)
    raw32 = tl.load(words_ptr + src + idx, mask=plain & wide, other=0)
    raw16 = tl.load(halves_ptr + 2 * src + idx, mask=plain & ~wide, other=0)
    if PACKED:
        code, n_before, esc = packed_code(
            words_ptr, cols_ptr, sym_ptr, rank_ptr, stride, b, idx, quant, esc_iter
        )
        s = packed_symbol(code, esc).to(tl.int32) & 0xFFFF
        k = (n_before - 1).to(tl.int64)
    else:
        sym0 = tl.load(cols_ptr + dc.SYM_BASE * stride + b, mask=quant, other=0)
        s = tl.load(sym_ptr + sym0 + idx, mask=quant, other=0).to(tl.int32) & 0xFFFF
        esc = quant & (s == _ESCAPE)
        # Escape k of the block (by rank in the stream) is its k-th escaped value.
        before = tl.load(rank_ptr + sym0 - 1, mask=esc & (sym0 > 0), other=0)
        k = (tl.load(rank_ptr + sym0 + idx, mask=esc, other=1) - 1 - before).to(tl.int64)
    n_esc = tl.load(cols_ptr + dc.N_ESC * stride + b, mask=esc, other=0)
    k = tl.minimum(tl.maximum(k, 0), n_esc - 1)
    has = esc & (n_esc > 0)
    val_off = tl.load(cols_ptr + dc.ESC_VAL_OFF * stride + b, mask=has, other=0)
    esc32 = tl.load(words_ptr + val_off + k, mask=has & wide, other=0)
    esc16 = tl.load(halves_ptr + 2 * val_off + k, mask=has & ~wide, other=0)
    # dequantize_kernel: float32(s - 2047 + center) * step (|s - 2047 + center| < 2**24: exact),
    # then the round-to-nearest-even cast of the block's dtype.
    step_bits = tl.load(cols_ptr + dc.STEP_BITS * stride + b, mask=quant, other=0)
    step = step_bits.to(tl.int32).to(tl.float32, bitcast=True)
    center = tl.load(cols_ptr + dc.CENTER * stride + b, mask=quant, other=0)
    v = (s.to(tl.int64) - _OFFSET + center).to(tl.float32) * step
    # The per-value grid (descriptor mode bit 2): format.value_decode_bits.
    vb = value_decode_bits(s.to(tl.int64), value_shift(step_bits), center)
    v = tl.where((mode & 4) == 4, vb.to(tl.uint32).to(tl.float32, bitcast=True), v)
    half = round_to_dtype(v, _FLOAT16).to(tl.float16).to(tl.int16, bitcast=True)
    bf16 = (round_to_dtype(v, _BFLOAT16).to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    q16 = tl.where(dtype_code == _FLOAT16, half, bf16)
    val32 = tl.where(quant, tl.where(esc, esc32, v.to(tl.int32, bitcast=True)), raw32)
    val16 = tl.where(quant, tl.where(esc, esc16, q16), raw16)
    out_off = tl.load(cols_ptr + dc.OUT_OFF * stride + b, mask=mask, other=0)
    tl.store(out32_ptr + out_off + e, val32, mask=mask & wide)
    tl.store(out16_ptr + 2 * out_off + e, val16, mask=mask & ~wide)


def decode_outputs(
    words: torch.Tensor,
    cols: DecodeColumns,
    ids: torch.Tensor,
    symbols: torch.Tensor,
    rank: torch.Tensor,
    n_out_words: int,
    n_elements: int,
) -> torch.Tensor:
    """Every block's elements in one launch: raw copies, LZ row expansion, dequantization with
    escapes; no sync.

    Args:
        words: int32 payload words (their int16 view addresses 16-bit values).
        cols: The blocks' decode record; read: ``OUT_BASE``, ``MODE``, ``DTYPE`` (1: 32-bit
            elements, 2 / 3: 16-bit), ``DIM`` (>= 1 where the block has elements), ``N_UNIQUE``,
            ``SRC_OFF``, ``ID_BASE``, ``SYM_BASE``, ``STEP_BITS``, ``CENTER``, ``ESC_VAL_OFF``,
            ``N_ESC``, ``OUT_OFF`` (word offset of each block's output, word-aligned).
        ids: int32 ids from ``vector_lz.unpack_refs_blocks`` (any 1-element tensor if none).
        symbols: int16 symbols from ``huffman.decode_blocks`` (any 1-element tensor if none).
        rank: int32 escape ranks from ``huffman.check_escapes`` (any 1-element tensor if none).
        n_out_words: Words of the output buffer.
        n_elements: Total elements (the last ``OUT_BASE`` entry).

    Returns:
        int32 [n_out_words]: block ``b``'s elements from word ``OUT_OFF[b]``, as 32-bit words or
        16-bit halves (view it as int16) by dtype.
    """
    return _decode(words, cols, ids, (symbols, rank), (n_out_words, n_elements), 0, False)


def decode_packed_outputs(
    words: torch.Tensor,
    cols: DecodeColumns,
    ids: torch.Tensor,
    widths: torch.Tensor,
    ends: torch.Tensor,
    sizes: tuple[int, int],
    esc_iter: int,
) -> torch.Tensor:
    """:func:`decode_outputs` of packed payloads: each quantized value decoded from its code in
    the payload (no symbol stream); one launch, no sync.

    Args:
        words: int32 payload words.
        cols: The blocks' decode record (the fields :func:`decode_outputs` reads, and
            ``CHUNK_BASE``, ``BS_OFF`` / ``BS_WORDS``, ``ESC_POS_OFF``).
        ids: int32 ids from ``vector_lz.unpack_refs_blocks`` (any 1-element tensor if none).
        widths: int16 group widths from ``packed.packed_widths``.
        ends: int32 inclusive prefix sum of ``widths``.
        sizes: (words of the output buffer, total elements).
        esc_iter: Binary-search steps: at least ``bit_length`` of the largest ``N_ESC``.

    Returns:
        As :func:`decode_outputs`.
    """
    return _decode(words, cols, ids, (widths, ends), sizes, esc_iter, True)


def _decode(
    words: torch.Tensor,
    cols: DecodeColumns,
    ids: torch.Tensor,
    values: tuple[torch.Tensor, torch.Tensor],
    sizes: tuple[int, int],
    esc_iter: int,
    packed: bool,
) -> torch.Tensor:
    """The output kernel's launch (``values``: symbols and ranks, or widths and their sums)."""
    n_out_words, n_elements = sizes
    out = torch.empty(n_out_words, dtype=torch.int32, device=words.device)
    if n_elements:
        n_blocks = cols.n_blocks
        block = block_for(n_elements, 1024)
        _decode_output_kernel[(triton.cdiv(n_elements, block),)](
            words, words.view(torch.int16), cols.cols, ids, *values, out, out.view(torch.int16),
            cols.stride, n_blocks, n_blocks.bit_length(), esc_iter, BLOCK=block, PACKED=packed,
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


# The @triton.jit kernels by name, for the ahead-of-time compile check (``kernels/_aot.py``);
# callers launch them through the functions above.
JIT_KERNELS = {
    "decode_output_kernel": _decode_output_kernel,
    "grid_kernel": _grid_kernel,
    "quantize_kernel": _quantize_kernel,
}
