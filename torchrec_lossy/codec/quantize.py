"""Error-bounded quantization with an escape path for what cannot be bounded.

Code ``q = floor(x * inv_step + 0.5)`` (float32 arithmetic; round to nearest, step ``2 * bound``)
or, with stochastic rounding, ``q = floor(t) + (u < t - floor(t))`` for ``t = x * inv_step`` and
``u`` uniform in [0, 1) from a counter-based hash of (block key, element index) (step ``bound``,
so ``|x - x'| < step <= bound``; ``E[q] = t``: unbiased), reconstruction
``x' = dtype(float32(q) * step)``. The encoder computes ``x'`` exactly as the decoder will,
rounding to the block's dtype included, and escapes every element with ``|x - x'| > bound``
(checked in float64), every non-finite element and every code outside the alphabet. Escaped
elements travel verbatim, so the bound holds for every element by construction, whatever the
data.

No predictor: embedding rows are independent lookups with no order along the row or the
dimension for a predictor to exploit (measured in docs/design.md: a previous-row or
previous-element predictor raised the code entropy on realistic traffic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from torchrec_lossy.codec.format import (
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    MAX_CENTER,
    SYMBOL_OFFSET,
)

_FLT_MAX = float(np.finfo(np.float32).max)
_MASK32 = 0xFFFFFFFF
# Stochastic rounding draws u = (hash >> 8) * 2**-24: 24 bits, exact in float32.
_U_SCALE = 2.0**-24
NEAREST_KEY = -1  # the ``sr_key`` of round-to-nearest; stochastic keys are in [0, 2**32)
_FLT_MIN = float(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class QuantParams:
    """Per-block quantization parameters (also written to the segment header).

    Attributes:
        step: Quantization step, float32-representable, at most ``2 * bound``.
        inv_step: float32 reciprocal of ``step`` used by the encoder.
        center: Code of the block's midpoint; symbols are ``q - center + SYMBOL_OFFSET``.
        sr_key: ``NEAREST_KEY``: round to nearest; else the block's stochastic-rounding key
            (encoder only: the decoder reconstructs ``q * step`` either way).
    """

    step: float
    inv_step: float
    center: int
    sr_key: int = NEAREST_KEY


def grid_bound(bound: float, stochastic: bool) -> float:
    """The bound the quantization grid is chosen for: ``bound`` (step ``2 * bound``) for round to
    nearest, ``bound / 2`` (step ``bound``) for stochastic rounding, whose error reaches a step.

    Args:
        bound: The block's absolute error bound.
        stochastic: Whether the block is rounded stochastically.

    Returns:
        The bound to pass to :func:`quant_params` / ``_quant_params_kernel``.
    """
    return 0.5 * bound if stochastic else bound


def mix32(h: int) -> int:
    """A 32-bit integer finalizer (lowbias32): the counter hash of stochastic rounding.

    The same arithmetic runs in numba (:func:`_mix32_nb`), torch (:func:`uniform_reference`) and
    Triton (``kernels.quantize``), so every backend draws the same ``u`` for an element.

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


def uniform_reference(n: int, key: int) -> torch.Tensor:
    """Torch twin of the per-element draw: float32 ``u`` in [0, 1) for elements ``0 .. n-1``.

    Args:
        n: Elements of the block.
        key: The block's key from :func:`stochastic_key`.

    Returns:
        float32 [n].
    """
    m = _MASK32
    h = (torch.arange(n, dtype=torch.int64) & m) ^ key
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & m  # int64 wrap-around keeps the low 32 bits right
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & m
    h = h ^ (h >> 16)
    return (h >> 8).float() * _U_SCALE


@numba.njit(cache=True, nogil=True, inline="always")
def _mix32_nb(h: np.uint64) -> np.uint64:
    # numba widens integer arithmetic to 64 bits: mask back to 32 after each multiply.
    m = np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & m
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & m
    return h ^ (h >> np.uint64(16))


@numba.njit(cache=True, nogil=True)
def _quant_params_kernel(bound: float, mid: float) -> tuple[float, float, int, bool]:
    step = np.float32(min(2.0 * bound, _FLT_MAX))
    if np.float64(step) > 2.0 * bound:  # round down so that step / 2 never exceeds the bound
        step = np.uint32(step.view(np.uint32) - np.uint32(1)).view(np.float32)
    if step < _FLT_MIN:
        return 0.0, 0.0, 0, False
    inv_step = np.float32(1.0) / step
    center = np.floor(np.float64(np.float32(mid) * inv_step) + 0.5)
    if not abs(center) <= MAX_CENTER:  # also rejects inf and nan
        return 0.0, 0.0, 0, False
    return np.float64(step), np.float64(inv_step), np.int64(center), True


def quant_params(bound: float, x: np.ndarray) -> QuantParams | None:
    """Chooses step and center for a block, or None when quantization cannot help.

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
    lo, hi = finite_range(x)
    if not math.isfinite(lo):
        mid = 0.0
    elif hi - lo <= 2 * SYMBOL_OFFSET * min(2.0 * bound, _FLT_MAX):
        mid = 0.5 * (lo + hi)
    else:
        mid = float(np.median(x[np.isfinite(x)].astype(np.float64)))
    step, inv_step, center, ok = _quant_params_kernel(bound, mid)
    return QuantParams(step=step, inv_step=inv_step, center=center) if ok else None


@numba.njit(cache=True, nogil=True, inline="always")
def _round_to_dtype(v: np.float32, dtype_code: int) -> np.float32:
    """Rounds a float32 to fp16 (code 2) or bf16 (code 3), nearest-even, as torch's cast does."""
    if dtype_code == 1 or not np.isfinite(v):
        return v
    bits = np.int64(np.float32(v).view(np.uint32))
    if dtype_code == 3:
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return np.uint32(bits).view(np.float32)
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
def _quantize_loop(
    x: np.ndarray,
    step: np.float32,
    inv_step: np.float32,
    center: int,
    bound: float,
    dtype_code: int,
    stochastic: bool,
    key: np.uint64,
    symbols: np.ndarray,
    errors: np.ndarray,
) -> None:
    # Branch-free body (selects, no early exits) so that the compiler vectorises it.
    half = np.float32(0.5)
    for i in range(x.shape[0]):
        v = x[i]
        if stochastic:  # resolved at compile time (the callers pass a constant)
            t = v * inv_step
            fl = np.floor(t)
            h = _mix32_nb((np.uint64(i) & np.uint64(0xFFFFFFFF)) ^ key)
            u = np.float32(h >> np.uint64(8)) * np.float32(_U_SCALE)
            qf = fl + np.float32(1.0) if u < t - fl else fl
        else:
            qf = np.floor(v * inv_step + half)
        rel = np.float64(qf) - center
        recon = _round_to_dtype(np.float32(qf) * step, dtype_code)
        err = abs(np.float64(recon) - np.float64(v))
        ok = (abs(rel) <= SYMBOL_OFFSET) & (err <= bound)  # False for NaN and Inf too
        symbols[i] = np.uint16(np.int64(rel) + SYMBOL_OFFSET) if ok else np.uint16(ESCAPE_SYMBOL)
        errors[i] = err if ok else 0.0


@numba.njit(cache=True, nogil=True, inline="always")
def _quantize_dtypes(
    x: np.ndarray,
    step: np.float32,
    inv_step: np.float32,
    center: int,
    bound: float,
    dtype_code: int,
    stochastic: bool,
    key: np.uint64,
    symbols: np.ndarray,
    errors: np.ndarray,
) -> None:
    if dtype_code == 1:
        _quantize_loop(x, step, inv_step, center, bound, 1, stochastic, key, symbols, errors)
    elif dtype_code == 2:
        _quantize_loop(x, step, inv_step, center, bound, 2, stochastic, key, symbols, errors)
    else:
        _quantize_loop(x, step, inv_step, center, bound, 3, stochastic, key, symbols, errors)


@numba.njit(cache=True, nogil=True)
def quantize_kernel(
    x: np.ndarray,
    step: np.float32,
    inv_step: np.float32,
    center: int,
    bound: float,
    dtype_code: int,
    symbols: np.ndarray,
    hist: np.ndarray,
    sr_key: int = NEAREST_KEY,
) -> tuple[int, float]:
    """Quantizes a flat float32 array into symbols; escapes what the bound cannot cover.

    Args:
        x: 1-D float32 values (exact copies of the block's fp32/fp16/bf16 values).
        step: Quantization step (float32).
        inv_step: float32 reciprocal of the step.
        center: Code of the block's midpoint.
        bound: Absolute bound, checked in float64.
        dtype_code: The block's dtype code (the reconstruction is rounded to it).
        symbols: 1-D uint16 output, same length as ``x``.
        hist: int64 [ALPHABET_SIZE] zeroed output: the symbol histogram (fused here to save the
            Huffman stage a separate call).
        sr_key: ``NEAREST_KEY`` (-1): round to nearest; else the block's stochastic-rounding key
            (:func:`stochastic_key`).

    Returns:
        (number of escaped elements, max |x - x'| over the elements that were not escaped).
    """
    errors = np.empty(x.shape[0], dtype=np.float64)
    # One loop per dtype and rounding so that both are resolved at compile time.
    key = np.uint64(sr_key & 0xFFFFFFFF)
    if sr_key < 0:
        _quantize_dtypes(x, step, inv_step, center, bound, dtype_code, False, key, symbols, errors)
    else:
        _quantize_dtypes(x, step, inv_step, center, bound, dtype_code, True, key, symbols, errors)
    max_error = 0.0
    for e in errors:
        max_error = max(max_error, e)
    for s in symbols:
        hist[s] += 1
    return hist[ESCAPE_SYMBOL], max_error


@numba.njit(cache=True, nogil=True)
def dequantize_kernel(symbols: np.ndarray, step: np.float32, center: int, out: np.ndarray) -> None:
    """Reconstructs float32 values from symbols (escapes are filled in afterwards).

    Args:
        symbols: 1-D uint16 symbols.
        step: Quantization step.
        center: Code of the block's midpoint.
        out: 1-D float32 output, same length.
    """
    base = center - SYMBOL_OFFSET
    for i in range(symbols.shape[0]):
        out[i] = np.float32(np.int64(symbols[i]) + base) * step


def finite_range(x: np.ndarray) -> tuple[float, float]:
    """Smallest and largest finite value of a float32 array (nan, nan when there is none).

    Args:
        x: 1-D float32 values.

    Returns:
        (min, max) as Python floats.
    """
    if x.shape[0] == 0:
        return math.nan, math.nan
    lo, hi = float(x.min()), float(x.max())
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    finite = x[np.isfinite(x)]
    if finite.shape[0] == 0:
        return math.nan, math.nan
    return float(finite.min()), float(finite.max())


def quantize_reference(
    x: torch.Tensor, params: QuantParams, bound: float, sr_key: int = NEAREST_KEY
) -> tuple[torch.Tensor, float]:
    """Torch twin of :func:`quantize_kernel` (the test oracle).

    Args:
        x: Block of any accepted dtype, any shape.
        params: Quantization parameters.
        bound: Absolute bound.
        sr_key: ``NEAREST_KEY`` or the block's stochastic-rounding key.

    Returns:
        (int64 symbols, flat, ESCAPE_SYMBOL where escaped; max error over non-escaped elements).
    """
    xf = x.reshape(-1).float()
    step = torch.tensor(params.step, dtype=torch.float32)
    inv = torch.tensor(params.inv_step, dtype=torch.float32)
    if sr_key == NEAREST_KEY:
        qf = torch.floor(xf * inv + 0.5)
    else:
        t = xf * inv
        fl = torch.floor(t)
        qf = torch.where(uniform_reference(xf.shape[0], sr_key) < t - fl, fl + 1.0, fl)
    rel = qf.double() - params.center
    recon = (qf * step).to(x.dtype)
    err = (recon.double() - xf.double()).abs()
    ok = torch.isfinite(xf) & (rel.abs() <= SYMBOL_OFFSET) & torch.isfinite(recon) & (err <= bound)
    symbols = torch.where(ok, rel.nan_to_num(0).long() + SYMBOL_OFFSET, ESCAPE_SYMBOL)
    max_error = float(err[ok].max()) if bool(ok.any()) else 0.0
    return symbols, max_error


def dequantize_reference(symbols: torch.Tensor, params: QuantParams) -> torch.Tensor:
    """Torch twin of :func:`dequantize_kernel`.

    Args:
        symbols: Integer symbols.
        params: Quantization parameters.

    Returns:
        float32 reconstructions (escaped positions hold garbage, to be overwritten).
    """
    q = (symbols.long() - SYMBOL_OFFSET + params.center).float()
    return q * torch.tensor(params.step, dtype=torch.float32)


__all__ = [
    "DTYPE_CODES",
    "NEAREST_KEY",
    "QuantParams",
    "dequantize_kernel",
    "dequantize_reference",
    "finite_range",
    "grid_bound",
    "mix32",
    "quant_params",
    "quantize_kernel",
    "quantize_reference",
    "stochastic_key",
    "uniform_reference",
]
