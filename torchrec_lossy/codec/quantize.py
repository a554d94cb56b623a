"""Error-bounded quantization with an escape path for what cannot be bounded.

The encoder computes each reconstruction exactly as the decoder will, rounding to the block's
dtype included, and escapes every element it would take past the bound (checked in float64),
every non-finite element and every code outside the alphabet; escaped elements travel verbatim,
so the bound holds for every element whatever the data. The rounding rules (nearest, stochastic,
the per-value grid): docs/format.md, "Quantization and symbols"; why no predictor: docs/codec.md.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from torchrec_lossy.codec.bounds import BoundKind, finite_span
from torchrec_lossy.codec.elementwise import (
    N,
    as_float32,
    as_float64,
    binary_exponent,
    clamp_min,
    float32_bits,
    float32_from_bits,
    floor,
    jitable,
    where,
)
from torchrec_lossy.codec.format import (
    BFLOAT16_CODE,
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    FLOAT16_CODE,
    FLOAT32_CODE,
    MAX_CENTER,
    NEAREST_KEY,
    SYMBOL_OFFSET,
    U_SCALE,
    value_code,
    value_decode_bits,
    value_shift,
    value_symbol,
)
from torchrec_lossy.codec.host_records import Grids
from torchrec_lossy.codec.quant_params import QuantParams

_FLT_MAX = float(np.finfo(np.float32).max)
_MASK32 = 0xFFFFFFFF
_FLT_MIN = float(np.finfo(np.float32).tiny)

# The per-value relative grid (``ErrorBound(mode="value")``): its symbol mapping is in
# codec/format.py (shared with the torch twins); here a block's step and qmax.


@jitable
def value_mantissa_bits(v: float) -> int:
    """Mantissa bits m of the grid for a relative bound ``v``: the least m in 0..23 with
    ``2**-(m + 1) <= v`` (exact: from ``v``'s binary exponent).

    Args:
        v: The relative bound (> 0).

    Returns:
        m.
    """
    # v = f * 2**e, f in [0.5, 1): 2**-(m + 1) <= v iff m >= -e; then m is clamped to 0..23.
    m = clamp_min(-binary_exponent(v), 0)
    return 23 - clamp_min(23 - m, 0)


@jitable
def value_qmax(amax: N, shift: N) -> N:
    """The largest code ``qmax`` of blocks on the per-value grid (the segment header's center).

    Args:
        amax: Largest finite ``|x|`` of each block (0 when none is finite).
        shift: ``23 - m``.

    Returns:
        The code of ``amax`` (its float32).
    """
    return value_code(float32_bits(amax) & 0x7FFFFFFF, shift)


@jitable
def value_params(v: float, amax: float) -> tuple[float, int]:
    """The per-value grid of a block: its step ``2**-m`` and largest code ``qmax``.

    Args:
        v: The relative bound (> 0).
        amax: Largest finite ``|x|`` of the block (0 when none is finite).

    Returns:
        (step, exact in float32; qmax, the code of ``amax``: the segment header's center).
    """
    m = value_mantissa_bits(v)
    return 2.0**-m, value_qmax(amax, 23 - m)


@jitable
def grid_bound(bound: N, stochastic: bool) -> N:
    """The bound the quantization grid is chosen for: ``bound`` (step ``2 * bound``) for round to
    nearest, ``bound / 2`` (step ``bound``) for stochastic rounding, whose error reaches a step.

    Args:
        bound: The block's absolute error bound.
        stochastic: Whether the block is rounded stochastically.

    Returns:
        The bound to pass to :func:`grid_step` (:func:`block_bound`'s ``grid``).
    """
    return 0.5 * bound if stochastic else bound


def mix32(h: int) -> int:
    """A 32-bit integer finalizer (lowbias32): the counter hash of stochastic rounding.

    The same arithmetic runs in numba (:func:`_mix32_nb`), torch
    (``kernels.quantize_ref.uniform_reference``) and Triton (``kernels.quantize``), so every
    backend draws the same ``u`` for an element.

    Args:
        h: Integer; only its low 32 bits are used.

    Returns:
        The mixed 32-bit value.
    """
    h &= _MASK32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _MASK32
    h ^= h >> 15
    h = (h * 0x846CA68B) & _MASK32
    return h ^ (h >> 16)


def stochastic_key(seed: int, block: int) -> int:
    """The 32-bit key of block ``block`` of a payload compressed with ``seed``.

    Args:
        seed: The call's seed (any integer; folded to 64 bits).
        block: Index of the block in the payload.

    Returns:
        A key in ``[0, 2**32)``; element ``i`` of the block draws ``u`` from ``mix32(i ^ key)``.
    """
    seed &= (1 << 64) - 1
    return mix32(mix32(block + 0x9E3779B9) ^ mix32(seed & _MASK32) ^ mix32((seed >> 32) + 1))


def block_keys(stochastic: bool, seed: int, local: np.ndarray) -> np.ndarray:
    """Rounding keys of blocks, each counted by its index within its own payload.

    Args:
        stochastic: Whether blocks are rounded stochastically.
        seed: ``CodecConfig.seed``.
        local: int64 index of each block within its payload.

    Returns:
        int64 keys: :func:`stochastic_key` of each, or ``NEAREST_KEY`` for every block.
    """
    if not stochastic:
        return np.full(local.shape[0], NEAREST_KEY, np.int64)
    return np.array([stochastic_key(seed, int(i)) for i in local], np.int64).reshape(-1)


@numba.njit(cache=True, nogil=True, inline="always")
def _mix32_nb(h: np.uint64) -> np.uint64:
    # numba widens integer arithmetic to 64 bits: mask back to 32 after each multiply.
    m = np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & m
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & m
    return h ^ (h >> np.uint64(16))


# The absolute grid's step and center (round to nearest and stochastic rounding), element-wise.


@jitable
def grid_step(bound: N) -> tuple[N, N, N]:
    """The quantization step of a grid's bound: the float32 at most ``2 * bound``.

    Args:
        bound: The grid's bound (:func:`grid_bound`), float64.

    Returns:
        (float32 step; its float32 reciprocal; ok: False where the step is below float32's
        normal range (or the bound NaN), the block is then not quantized and both are 0).
    """
    two = 2.0 * bound
    step = as_float32(where(two > _FLT_MAX, _FLT_MAX, two))  # NaN stays
    down = float32_from_bits(float32_bits(step) - 1)  # round down: step / 2 <= bound
    step = where(as_float64(step) > two, down, step)
    ok = step >= _FLT_MIN
    # float32's 1 / step: float64's quotient rounded to float32 is the correctly rounded one.
    inv_step = as_float32(1.0 / as_float64(where(ok, step, 1.0)))
    return as_float32(where(ok, step, 0.0)), as_float32(where(ok, inv_step, 0.0)), ok


@jitable
def grid_center(mid: N, inv_step: N) -> tuple[N, N]:
    """The center code of a block's midpoint on its grid.

    Args:
        mid: The value the grid centers on (:func:`grid_mid`), float64.
        inv_step: The grid's float32 ``1 / step`` (:func:`grid_step`).

    Returns:
        (the code, float64; ok: it is within ``MAX_CENTER``, False for inf and NaN).
    """
    center = floor(as_float64(as_float32(mid) * inv_step) + 0.5)
    return center, abs(center) <= MAX_CENTER


# ---- the per-block grid: one rule for every backend -------------------------------------------
# Element-wise: the host kernel calls it per block in numba, the device path over [n_blocks]
# tensors (no sync), its pre-pass over numpy arrays (grid_before_data). Each backend computes
# only the data-sized inputs: the finite min / max and, where uses_median, the median. A new
# mode: docs/codec.md, "Adding a quantization mode".

_ABSOLUTE = int(BoundKind.ABSOLUTE)
_RELATIVE = int(BoundKind.RELATIVE)
_VALUE = int(BoundKind.VALUE)


class BlockBound(NamedTuple):
    """Blocks' bounds as their grids take them (scalars, or [n] arrays / tensors).

    Attributes:
        kind: ``bounds.BoundKind``.
        bound: float64 bound: absolute (a relative one resolved), or per-value as given.
        grid: The bound the absolute grid is chosen for (:func:`grid_bound`).
        may: Whether the block may quantize (quantization on, a positive bound, elements).
    """

    kind: N
    bound: N
    grid: N
    may: N


class BlockGrid(NamedTuple):
    """Blocks' quantization grids (scalars, or [n] arrays / tensors; 0 where not ``ok``).

    Attributes:
        bound: float64 bound the descriptor carries (:attr:`BlockBound.bound`).
        step: float32 step (the per-value grid: ``2**-m``).
        inv_step: float32 ``1 / step`` (0 on the per-value grid).
        center: float64 code of the center (the per-value grid: ``qmax``).
        ok: Whether the block is quantized.
    """

    bound: N
    step: N
    inv_step: N
    center: N
    ok: N


@jitable
def block_bound(
    kind: N, bound: N, lo: N, hi: N, numel: N, stochastic: bool, quantization: bool
) -> BlockBound:
    """Blocks' bounds, relative ones resolved (``bounds.finite_span``), and their grids' bounds.

    Args:
        kind: ``bounds.BoundKind`` per block.
        bound: float64 bound as given (relative: the fraction of the range).
        lo: Smallest finite value, float32 or float64 (``lo > hi`` or NaN when none is finite).
        hi: Largest finite value.
        numel: Elements.
        stochastic: Stochastic rounding (:func:`grid_bound`).
        quantization: ``CodecConfig.enable_quantization``.

    Returns:
        The :class:`BlockBound`.
    """
    resolved = where(bound > 0, bound * finite_span(as_float32(lo), as_float32(hi)), 0.0)
    bound = where(kind == _RELATIVE, resolved, bound)
    may = (bound > 0) & (numel > 0) & quantization
    return BlockBound(kind, bound, grid_bound(bound, stochastic), may)


@jitable
def midpoint_fits(lo: N, hi: N, grid: N) -> N:
    """Whether a block's finite range fits the alphabet around its midpoint.

    Args:
        lo: Smallest finite value (float64).
        hi: Largest finite value.
        grid: The grid's bound (:func:`grid_bound` of the absolute bound).

    Returns:
        True where it fits (False for NaN).
    """
    two = 2.0 * grid
    return (hi - lo) <= 2 * SYMBOL_OFFSET * where(two > _FLT_MAX, _FLT_MAX, two)  # NaN stays


@jitable
def uses_median(b: BlockBound, lo: N, hi: N) -> N:
    """Where a block's grid centers on the median of its finite values, not their midpoint:
    where the range does not fit (:func:`midpoint_fits`; an outlier: it is escaped and the rest
    still quantizes). Each backend computes the median, only there.

    Args:
        b: :func:`block_bound`'s.
        lo: As :func:`block_bound`'s.
        hi: As :func:`block_bound`'s.

    Returns:
        Bools.
    """
    fits = midpoint_fits(as_float64(lo), as_float64(hi), b.grid)
    return b.may & (b.kind != _VALUE) & (lo <= hi) & (fits ^ True)  # ^ True: not, any kind


@jitable
def grid_mid(b: BlockBound, lo: N, hi: N, median: N) -> N:
    """The value a block's absolute grid centers on: the midpoint of its finite values, or
    their median (:func:`uses_median`); 0 when none is finite.

    Args:
        b: :func:`block_bound`'s.
        lo: As :func:`block_bound`'s.
        hi: As :func:`block_bound`'s.
        median: float64 median of the finite values where :func:`uses_median` (else anything).

    Returns:
        float64 values.
    """
    midpoint = where(lo <= hi, 0.5 * (as_float64(lo) + as_float64(hi)), 0.0)
    return where(uses_median(b, lo, hi), median, midpoint)


@jitable
def absolute_grid(grid: N, mid: N) -> tuple[N, N, N, N]:
    """The grid of round to nearest and stochastic rounding: :func:`grid_step`,
    :func:`grid_center` of the grid's bound and the value it centers on (float64).

    Returns:
        (float32 step, float32 inv_step, float64 center, ok), not zeroed where not ok.
    """
    step, inv_step, step_ok = grid_step(grid)
    center, center_ok = grid_center(mid, inv_step)
    return step, inv_step, center, step_ok & center_ok


@jitable
def block_grid(b: BlockBound, lo: N, hi: N, median: N) -> BlockGrid:
    """Blocks' grids: the absolute grid (:func:`absolute_grid`) centered on :func:`grid_mid`;
    the per-value grid from the bound and the largest finite ``|x|`` (:func:`value_params`).

    Args:
        b: :func:`block_bound`'s.
        lo: As :func:`block_bound`'s.
        hi: As :func:`block_bound`'s.
        median: As :func:`grid_mid`'s.

    Returns:
        The :class:`BlockGrid`.
    """
    lo64, hi64 = as_float64(lo), as_float64(hi)
    some = lo <= hi
    step, inv_step, center, ok = absolute_grid(b.grid, grid_mid(b, lo, hi, median))
    amax = where(some, where(abs(lo64) > abs(hi64), abs(lo64), abs(hi64)), 0.0)
    v_step, qmax = value_params(b.bound, amax)
    value = b.kind == _VALUE
    ok = where(value, b.may, b.may & ok)
    return BlockGrid(
        b.bound,
        as_float32(where(ok, where(value, v_step, step), 0.0)),
        as_float32(where(ok & (value ^ True), inv_step, 0.0)),
        where(ok, where(value, qmax, center), 0.0),
        ok,
    )


def grid_before_data(
    kind: np.ndarray, bound: np.ndarray, numel: np.ndarray, stochastic: bool, quantization: bool
) -> BlockGrid:
    """The rule before the data is read (the device path sizes its launches with it): each
    block at the widest finite range a block can have, ``[-FLT_MAX / 2, FLT_MAX / 2]`` (span
    ``FLT_MAX``, midpoint 0).

    Where the grid does not depend on the data (the absolute and per-value steps) it is the
    block's; ``ok`` holds wherever the data can make it hold: a relative bound resolves at most
    to its widest (the step only grows with the bound) and a center at 0 is in range.

    Args:
        kind: ``bounds.BoundKind`` per block.
        bound: float64 bounds as given.
        numel: Elements per block.
        stochastic: Stochastic rounding.
        quantization: ``CodecConfig.enable_quantization``.

    Returns:
        The :class:`BlockGrid` (numpy arrays).
    """
    half = _FLT_MAX / 2
    b = block_bound(kind, bound, -half, half, numel, stochastic, quantization)
    return block_grid(b, -half, half, 0.0)


@numba.njit(cache=True, nogil=True)
def finite_median(x: np.ndarray) -> float:
    """The float64 median (``np.median``'s) of the finite values of a 1-D float32 block."""
    return np.median(x[np.isfinite(x)].astype(np.float64))


def quant_params(bound: float, x: np.ndarray) -> QuantParams | None:
    """Chooses step and center for one block, or None when quantization cannot help (the rule of
    :func:`block_grid` on one absolute bound: tests and benchmarks quantize one block with it).

    The center is the code of the midpoint of the finite values; when they span more than the
    alphabet (an outlier), it is the code of their median instead, so the outlier is escaped and
    the rest still quantizes.

    Args:
        bound: Absolute error bound (> 0).
        x: The block's values as 1-D float32.

    Returns:
        The parameters, or None if the bound is too small for a normal float32 step or the
        block's center is too far from 0 in units of the step.
    """
    lo, hi = (float(v[0]) for v in finite_ranges_kernel(x, np.array([0, x.shape[0]])))
    b = block_bound(_ABSOLUTE, bound, lo, hi, x.shape[0], False, True)
    g = block_grid(b, lo, hi, finite_median(x) if uses_median(b, lo, hi) else 0.0)
    if not g.ok:
        return None
    return QuantParams(step=float(g.step), inv_step=float(g.inv_step), center=int(g.center))


@numba.njit(cache=True, nogil=True, inline="always")
def bf16_round_bits(bits: int) -> int:
    """float32 bits (a non-negative int) rounded to bfloat16, nearest-even, as torch's cast.

    Args:
        bits: The float32's bits (not NaN).

    Returns:
        float32 bits whose high half is the bfloat16's and low half 0.
    """
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000


@numba.njit(cache=True, nogil=True, inline="always")
def _round_to_dtype(v: np.float32, dtype_code: int) -> np.float32:
    """Rounds a float32 to fp16 or bf16 (by dtype code), nearest-even, as torch's cast does."""
    if dtype_code == FLOAT32_CODE or not np.isfinite(v):
        return v
    bits = np.int64(np.float32(v).view(np.uint32))
    if dtype_code == BFLOAT16_CODE:
        return np.uint32(bf16_round_bits(bits)).view(np.float32)
    a = abs(np.float64(v))
    if a >= 65520.0:  # rounds to fp16 infinity
        r = np.inf
    elif a < 6.103515625e-05:  # fp16 subnormal range: a fixed quantum of 2**-24
        r = np.rint(a * 16777216.0) / 16777216.0
    else:
        exponent = ((bits >> 23) & 0xFF) - 127
        quantum = 2.0 ** (exponent - 10)
        r = np.rint(a / quantum) * quantum
    return np.float32(np.copysign(r, np.float64(v)))


@numba.njit(cache=True, nogil=True, inline="always")
def half_bits(bits: int, dtype_code: int) -> int:
    """A finite float32 rounded to float16 or bfloat16 (by dtype code): the 16-bit pattern.

    The round-to-nearest-even cast the encoder checked the bound against (torch's).

    Args:
        bits: The float32's bits, as a non-negative int (not NaN).
        dtype_code: ``FLOAT16_CODE`` or ``BFLOAT16_CODE``.

    Returns:
        The 16-bit value's bits, as a non-negative int.
    """
    if dtype_code == BFLOAT16_CODE:
        return bf16_round_bits(bits) >> 16
    # exact in float16 (or inf)
    half = _round_to_dtype(np.uint32(bits).view(np.float32), FLOAT16_CODE)
    rb = np.int64(np.float32(half).view(np.uint32))  # (a fresh variable for numba's inliner)
    sign = (rb >> 16) & 0x8000
    exponent = ((rb >> 23) & 0xFF) - 127
    if exponent > 15:  # infinity
        return sign | 0x7C00
    if exponent < -14:  # subnormal or zero: a multiple of 2**-24
        return sign | np.int64(abs(np.float64(half)) * 16777216.0)
    return sign | ((exponent + 15) << 10) | ((rb >> 13) & 0x3FF)


class _Grid(NamedTuple):
    """One block's grid as the loops take it (``value``: step 2**-m, center qmax); ``key``:
    ``NEAREST_KEY`` or the stochastic-rounding key."""

    step: np.float32
    inv_step: np.float32
    center: int
    bound: float
    key: int


@numba.njit(cache=True, nogil=True, inline="always")
def _quantize_loop(
    x: np.ndarray, g: _Grid, dtype_code: int, stochastic: bool, symbols: np.ndarray, ranges: bool
) -> tuple[int, int, int]:
    # Branch-free body (selects, reductions, no early exits) so that the compiler vectorises it.
    # float32 arithmetic is exact here: q and the center are integers below 2**24 in magnitude
    # wherever |q - center| <= SYMBOL_OFFSET can hold, and anything farther stays farther.
    step, inv_step, bound = g.step, g.inv_step, g.bound
    key = np.uint64(g.key & 0xFFFFFFFF)
    half = np.float32(0.5)
    center_f = np.float32(g.center)
    offset_f = np.float32(SYMBOL_OFFSET)
    max_err_bits = np.int64(0)  # non-negative float64s order as their bit patterns
    lo = np.int32(ESCAPE_SYMBOL)
    hi = np.int32(-1)
    for i in range(x.shape[0]):
        v = x[i]
        if stochastic:  # resolved at compile time (the callers pass a constant)
            t = v * inv_step
            fl = np.floor(t)
            h = _mix32_nb((np.uint64(i) & np.uint64(0xFFFFFFFF)) ^ key)
            u = np.float32(h >> np.uint64(8)) * np.float32(U_SCALE)
            qf = fl + np.float32(1.0) if u < t - fl else fl
        else:
            qf = np.floor(v * inv_step + half)
        d = qf - center_f
        recon = _round_to_dtype(qf * step, dtype_code)
        err = abs(np.float64(recon) - np.float64(v))
        ok = (abs(d) <= offset_f) & (err <= bound)  # False for NaN and Inf too
        sym = np.int32(d if ok else offset_f) + np.int32(SYMBOL_OFFSET)
        symbols[i] = np.uint16(sym if ok else np.int32(ESCAPE_SYMBOL))
        max_err_bits = max(max_err_bits, np.float64(err if ok else 0.0).view(np.int64))
        if ranges:  # loop-invariant: the compiler makes a loop without these reductions
            lo = min(lo, sym if ok else np.int32(ESCAPE_SYMBOL))
            hi = max(hi, sym if ok else np.int32(-1))
    return max_err_bits, lo, hi


@numba.njit(cache=True, nogil=True, inline="always")
def _float32_at_most(bound: float) -> np.float32:
    """The largest float32 ``<= bound`` (float64; ``FLT_MAX`` above it, inf for inf): for a
    float32 ``e``, ``e <= bound`` exactly where ``e <= _float32_at_most(bound)``."""
    f = np.float32(bound)
    if np.float64(f) > bound:  # rounded up (or overflowed to inf): one float32 step down
        f = np.uint32(np.float32(f).view(np.uint32) - np.uint32(1)).view(np.float32)
    return f


@numba.njit(cache=True, nogil=True, inline="always")
def _nearest32_loop(x: np.ndarray, g: _Grid, symbols: np.ndarray) -> tuple[int, bool]:
    # _quantize_loop for float32 blocks rounded to nearest without the symbol ranges, in
    # float32 only: 1.6x faster (float64 lanes halve the vector width,
    # and their conversions cost as much again). -> (max error bits, as _quantize_loop's; exact).
    # The same q, d and reconstruction; the error |recon - v| in float32 is exact wherever
    # recon is 0 (the error is |v|) or v and recon are within a factor 2 of each other
    # (Sterbenz's lemma; they have the same sign, as q has v's). Then the error equals the
    # float64 one, it is within the bound exactly where it is within the largest float32 at
    # most the bound, and non-negative float32s order as their bits: every symbol and the max
    # error are _quantize_loop's. Whether every element whose decision reads the error (|d| in
    # the alphabet) is exact is counted alongside: where one is not, the caller runs
    # _quantize_loop instead (exact False). Branch-free, as _quantize_loop.
    step, inv_step = g.step, g.inv_step
    bound32 = _float32_at_most(g.bound)
    half, two, zero = np.float32(0.5), np.float32(2.0), np.float32(0.0)
    center_f = np.float32(g.center)
    offset_f = np.float32(SYMBOL_OFFSET)
    none = np.int32(-0x7FFFFFFF)
    max_err_bits = np.int32(0)
    inexact = none  # > 0 once an element's float32 error may be inexact
    for i in range(x.shape[0]):
        v = x[i]
        qf = np.floor(v * inv_step + half)
        d = qf - center_f
        recon = qf * step
        err = abs(recon - v)
        in_range = abs(d) <= offset_f  # False for NaN and Inf too
        ok = in_range & (err <= bound32)
        sym = np.int32(d if ok else offset_f) + np.int32(SYMBOL_OFFSET)
        symbols[i] = np.uint16(sym if ok else np.int32(ESCAPE_SYMBOL))
        max_err_bits = max(max_err_bits, np.float32(err if ok else zero).view(np.int32))
        # Sterbenz's condition b / 2 <= a <= 2 b, as the sign of max(a - 2b, b - 2a) (its
        # bits as an int32: a max reduction, which vectorises; 2x is exact or inf).
        a, b = abs(v), abs(recon)
        apart = np.float32(max(a - two * b, b - two * a)).view(np.int32)
        inexact = max(inexact, apart if in_range & (b != zero) else none)
    err64 = np.float64(np.int32(max_err_bits).view(np.float32))
    return np.float64(err64).view(np.int64), inexact <= 0


@numba.njit(cache=True, nogil=True, inline="always")
def _symbol_range(symbols: np.ndarray) -> tuple[int, int]:
    """Lowest and highest value symbol of a block's symbols (ESCAPE_SYMBOL, -1 when every one
    is the escape): _quantize_loop's ranges, from the symbols written (a value symbol is never
    the escape)."""
    lo = np.int32(ESCAPE_SYMBOL)
    hi = np.int32(-1)
    for i in range(symbols.shape[0]):
        v = np.int32(symbols[i])
        value = v != np.int32(ESCAPE_SYMBOL)
        lo = min(lo, v if value else np.int32(ESCAPE_SYMBOL))
        hi = max(hi, v if value else np.int32(-1))
    return lo, hi


@numba.njit(cache=True, nogil=True, inline="always")
def _quantize_value_loop(
    x: np.ndarray, g: _Grid, dtype_code: int, symbols: np.ndarray, ranges: bool
) -> tuple[int, int, int]:
    # The per-value grid (value_symbol): the error is checked against bound * |x| in float64,
    # and the max error reported is the relative one, |x' - x| / |x|.
    shift = value_shift(np.float64(g.step))
    qmax, bound = g.center, g.bound
    max_err_bits = np.int64(0)
    lo = np.int64(ESCAPE_SYMBOL)
    hi = np.int64(-1)
    for i in range(x.shape[0]):
        v = x[i]
        sym, rb = value_symbol(np.int64(np.float32(v).view(np.uint32)), shift, qmax)
        recon = _round_to_dtype(np.uint32(rb).view(np.float32), dtype_code)
        av = abs(np.float64(v))
        err = abs(np.float64(recon) - np.float64(v))
        ok = (sym != ESCAPE_SYMBOL) & (err <= bound * av)  # False for NaN and Inf too
        symbols[i] = np.uint16(sym if ok else ESCAPE_SYMBOL)
        rel = err / av if ok and av > 0 else 0.0
        max_err_bits = max(max_err_bits, np.float64(rel).view(np.int64))
        if ranges:
            lo = min(lo, sym if ok else np.int64(ESCAPE_SYMBOL))
            hi = max(hi, sym if ok else np.int64(-1))
    return max_err_bits, lo, hi


@numba.njit(cache=True, nogil=True, inline="always")
def _quantize_grid(
    x: np.ndarray, g: _Grid, dtype_code: int, value: bool, symbols: np.ndarray, ranges: bool
) -> tuple[int, int, int]:
    # The grid and the rounding, like the dtype (a constant here), resolved at compile time.
    if value:
        return _quantize_value_loop(x, g, dtype_code, symbols, ranges)
    if g.key >= 0:
        return _quantize_loop(x, g, dtype_code, True, symbols, ranges)
    return _quantize_loop(x, g, dtype_code, False, symbols, ranges)


@numba.njit(cache=True, nogil=True)
def _quantize_any(
    x: np.ndarray, g: _Grid, dtype_code: int, value: bool, symbols: np.ndarray, ranges: bool
) -> tuple[float, int, int]:
    """One block: symbols, (max error, lowest and highest value symbol; ESCAPE_SYMBOL, -1 when
    every element escapes, or ``ranges`` is False). ``value``: the per-value grid (round to
    nearest)."""
    if dtype_code == FLOAT32_CODE:  # one loop per dtype, so that it is resolved at compile time
        err_bits, lo, hi = _quantize_grid(x, g, FLOAT32_CODE, value, symbols, ranges)
    elif dtype_code == FLOAT16_CODE:
        err_bits, lo, hi = _quantize_grid(x, g, FLOAT16_CODE, value, symbols, ranges)
    else:
        err_bits, lo, hi = _quantize_grid(x, g, BFLOAT16_CODE, value, symbols, ranges)
    return np.int64(err_bits).view(np.float64), lo, hi


_BIG = np.int32(0x7FFFFFFF)


@numba.njit(cache=True, nogil=True, inline="always")
def _widen(v: np.int32, mn: np.int32, mx: np.int32) -> tuple[np.int32, np.int32]:
    """The range keys ``(mn, mx)`` widened by float32 bits ``v`` where finite: integer min /
    max (they vectorise) over keys that order as the floats do; non-finite values (exponent
    all ones) are left out."""
    key = v ^ ((v >> np.int32(31)) & _BIG)
    fin = (v & np.int32(0x7F800000)) != np.int32(0x7F800000)
    k_lo = key if fin else _BIG
    k_hi = key if fin else -_BIG
    return (k_lo if k_lo < mn else mn), (k_hi if k_hi > mx else mx)


@numba.njit(cache=True, nogil=True, inline="always")
def _put_range(mn: np.int32, mx: np.int32, b: int, lo: np.ndarray, hi: np.ndarray) -> None:
    """Block ``b``'s (lo, hi) from its range keys (left NaN when no value was finite)."""
    if mn <= mx:
        lo[b] = np.int32(mn ^ ((mn >> np.int32(31)) & _BIG)).view(np.float32)
        hi[b] = np.int32(mx ^ ((mx >> np.int32(31)) & _BIG)).view(np.float32)


@numba.njit(cache=True, nogil=True)
def finite_ranges_kernel(x: np.ndarray, elem_off: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Smallest and largest finite value of every block of a concatenation (one call for all).

    Args:
        x: 1-D float32 values of every block, back to back.
        elem_off: int64 [n_blocks + 1] start of each block in ``x``, then its end.

    Returns:
        float64 (lo, hi) per block; NaN, NaN for a block without a finite value.
    """
    nb = elem_off.shape[0] - 1
    lo = np.full(nb, np.nan)
    hi = np.full(nb, np.nan)
    bits = x.view(np.int32)
    for b in range(nb):
        mn, mx = _BIG, -_BIG
        block = bits[elem_off[b] : elem_off[b + 1]]
        for i in range(block.shape[0]):  # from 0: no negative-index wrap to stop vectorising
            mn, mx = _widen(block[i], mn, mx)
        _put_range(mn, mx, b, lo, hi)
    return lo, hi


@intrinsic
def _int32_at(typingctx: object, address: types.Integer) -> tuple:
    """An int32 pointer at an integer address (a tensor's ``data_ptr()``)."""
    ptr = types.CPointer(types.int32)

    def codegen(context: object, builder: object, signature: object, args: tuple) -> object:
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(types.int64), codegen


@numba.njit(cache=True, nogil=True)
def gather_ranges_kernel(
    x: np.ndarray, elem_off: np.ndarray, src: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`finite_ranges_kernel` over blocks read where they lie, copying each into its
    place in ``x`` on the way: one pass over the input where a copy then a range pass took
    two (the encoder's first stage).

    Args:
        x: 1-D float32 output: every block's values, back to back (overwritten).
        elem_off: int64 [n_blocks + 1] start of each block in ``x``, then its end.
        src: int64 [n_blocks]: the address of each block's first element (a contiguous
            float32 tensor's ``data_ptr()``; the caller keeps the tensors alive for the call).

    Returns:
        float64 (lo, hi) per block, as :func:`finite_ranges_kernel`.
    """
    nb = elem_off.shape[0] - 1
    lo = np.full(nb, np.nan)
    hi = np.full(nb, np.nan)
    bits = x.view(np.int32)
    for b in range(nb):
        dst = bits[elem_off[b] : elem_off[b + 1]]
        block = numba.carray(_int32_at(src[b]), dst.shape[0])
        mn, mx = _BIG, -_BIG
        for i in range(dst.shape[0]):
            v = block[i]
            dst[i] = v
            mn, mx = _widen(v, mn, mx)
        _put_range(mn, mx, b, lo, hi)
    return lo, hi


@numba.njit(cache=True, nogil=True)
def quantize_blocks_kernel(
    x: np.ndarray,
    elem_off: np.ndarray,
    grids: Grids,
    bounds: np.ndarray,
    dtype_codes: np.ndarray,
    sr_keys: np.ndarray,
    symbols: np.ndarray,
    ranges: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantizes every quantized block of a concatenation into symbols, in one call; escapes
    what the bound cannot cover.

    Args:
        x: 1-D float32 values of every block, back to back.
        elem_off: int64 [n_blocks + 1] block starts in ``x``, then the end.
        grids: Each block's grid (the blocks not ``ok`` are skipped: their symbols are left
            as they are).
        bounds: float64 [n_blocks] absolute bounds (relative on the per-value grid).
        dtype_codes: [n_blocks] dtype codes.
        sr_keys: int64 [n_blocks] ``NEAREST_KEY`` or each block's stochastic-rounding key.
        symbols: uint16 output, same length as ``x``.
        ranges: Find each block's lowest and highest value symbol (the Huffman codes' range;
            the packed format does not read it, and the two reductions cost about a quarter
            of the loop).

    Returns:
        Per block: max error (float64), lowest and highest value symbol (int64; ESCAPE_SYMBOL
        and -1 when there is none or ``ranges`` is False).
    """
    nb = elem_off.shape[0] - 1
    max_err = np.zeros(nb)
    lo = np.full(nb, ESCAPE_SYMBOL, np.int64)
    hi = np.full(nb, -1, np.int64)
    for b in range(nb):
        if grids.ok[b]:
            s, e = elem_off[b], elem_off[b + 1]
            g = _Grid(grids.step[b], grids.inv_step[b], grids.center[b], bounds[b], sr_keys[b])
            if dtype_codes[b] == FLOAT32_CODE and sr_keys[b] == NEAREST_KEY and not grids.value[b]:
                # The float32 loop has no range reductions (behind a run-time ranges flag, as
                # in _quantize_loop, it was not vectorised: 1.7x slower); the entropy format's
                # ranges are read from the symbols it wrote, in a pass of their own.
                err_bits, exact = _nearest32_loop(x[s:e], g, symbols[s:e])
                if exact:  # else every symbol is written again, by the float64 check
                    max_err[b] = np.int64(err_bits).view(np.float64)
                    if ranges:
                        lo[b], hi[b] = _symbol_range(symbols[s:e])
                    continue
            max_err[b], lo[b], hi[b] = _quantize_any(
                x[s:e], g, dtype_codes[b], grids.value[b], symbols[s:e], ranges
            )
    return max_err, lo, hi


@numba.njit(cache=True, nogil=True)
def dequantize_kernel(
    symbols: np.ndarray, step: np.float32, center: int, out: np.ndarray, value: bool = False
) -> None:
    """Reconstructs float32 values from symbols (escapes are filled in afterwards).

    Args:
        symbols: 1-D uint16 symbols.
        step: Quantization step.
        center: Code of the block's midpoint.
        out: 1-D float32 output, same length.
        value: The per-value grid (``step`` 2**-m, ``center`` qmax).
    """
    if value:
        shift = value_shift(np.float64(step))
        bits = out.view(np.uint32)
        for i in range(symbols.shape[0]):
            bits[i] = np.uint32(value_decode_bits(np.int64(symbols[i]), shift, center))
        return
    base = center - SYMBOL_OFFSET
    for i in range(symbols.shape[0]):
        out[i] = np.float32(np.int64(symbols[i]) + base) * step


__all__ = [
    "DTYPE_CODES",
    "NEAREST_KEY",
    "BlockBound",
    "BlockGrid",
    "QuantParams",
    "absolute_grid",
    "block_bound",
    "block_grid",
    "block_keys",
    "dequantize_kernel",
    "finite_median",
    "finite_ranges_kernel",
    "gather_ranges_kernel",
    "grid_before_data",
    "grid_bound",
    "grid_center",
    "grid_mid",
    "grid_step",
    "midpoint_fits",
    "mix32",
    "quant_params",
    "quantize_blocks_kernel",
    "stochastic_key",
    "uses_median",
    "value_code",
    "value_decode_bits",
    "value_mantissa_bits",
    "value_params",
    "value_qmax",
    "value_shift",
    "value_symbol",
]
