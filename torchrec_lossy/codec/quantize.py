"""Error-bounded quantization with an escape path for what cannot be bounded.

Code ``q = floor(x * inv_step + 0.5)`` (float32 arithmetic), reconstruction
``x' = dtype(float32(q) * step)``. The encoder computes ``x'`` exactly as the decoder will,
rounding to the block's dtype included, and escapes every element with ``|x - x'| > bound``
(checked in float64), every non-finite element and every code outside the alphabet. Escaped
elements travel verbatim, so the bound holds for every element by construction, whatever the
data.

No predictor: embedding rows are independent lookups with no order along the row or the
dimension for a predictor to exploit (measured in docs/codec.md, "Why no predictor": a
previous-row or previous-element predictor raised the code entropy on realistic traffic).
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
_FLT_MIN = float(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class QuantParams:
    """Per-block quantization parameters (also written to the segment header).

    Attributes:
        step: Quantization step, float32-representable, at most ``2 * bound``.
        inv_step: float32 reciprocal of ``step`` used by the encoder.
        center: Code of the block's midpoint; symbols are ``q - center + SYMBOL_OFFSET``.
    """

    step: float
    inv_step: float
    center: int


@numba.njit(cache=True, nogil=True)
def quant_params_kernel(bound: float, mid: float) -> tuple[float, float, int, bool]:
    """Quantization step, its float32 reciprocal and the center code for a bound and midpoint.

    Args:
        bound: Absolute error bound (> 0).
        mid: The block's midpoint (the center is its code).

    Returns:
        (step, inv_step, center, ok); ok is False when the step is below float32's normal
        range or the center's code is out of range (the block is then not quantized).
    """
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
    step, inv_step, center, ok = quant_params_kernel(bound, mid)
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
    symbols: np.ndarray,
    errors: np.ndarray,
) -> None:
    # Branch-free body (selects, no early exits) so that the compiler vectorises it.
    half = np.float32(0.5)
    for i in range(x.shape[0]):
        v = x[i]
        qf = np.floor(v * inv_step + half)
        rel = np.float64(qf) - center
        recon = _round_to_dtype(np.float32(qf) * step, dtype_code)
        err = abs(np.float64(recon) - np.float64(v))
        ok = (abs(rel) <= SYMBOL_OFFSET) & (err <= bound)  # False for NaN and Inf too
        symbols[i] = np.uint16(np.int64(rel) + SYMBOL_OFFSET) if ok else np.uint16(ESCAPE_SYMBOL)
        errors[i] = err if ok else 0.0


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

    Returns:
        (number of escaped elements, max |x - x'| over the elements that were not escaped).
    """
    errors = np.empty(x.shape[0], dtype=np.float64)
    # One loop per dtype so that the rounding is resolved at compile time.
    if dtype_code == 1:
        _quantize_loop(x, step, inv_step, center, bound, 1, symbols, errors)
    elif dtype_code == 2:
        _quantize_loop(x, step, inv_step, center, bound, 2, symbols, errors)
    else:
        _quantize_loop(x, step, inv_step, center, bound, 3, symbols, errors)
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
    x: torch.Tensor, params: QuantParams, bound: float
) -> tuple[torch.Tensor, float]:
    """Torch twin of :func:`quantize_kernel` (the test oracle).

    Args:
        x: Block of any accepted dtype, any shape.
        params: Quantization parameters.
        bound: Absolute bound.

    Returns:
        (int64 symbols, flat, ESCAPE_SYMBOL where escaped; max error over non-escaped elements).
    """
    xf = x.reshape(-1).float()
    step = torch.tensor(params.step, dtype=torch.float32)
    inv = torch.tensor(params.inv_step, dtype=torch.float32)
    qf = torch.floor(xf * inv + 0.5)
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
    "QuantParams",
    "dequantize_kernel",
    "dequantize_reference",
    "finite_range",
    "quant_params",
    "quantize_kernel",
    "quantize_reference",
]
