"""Triton quantize / dequantize, bit-exact with ``torchrec_lossy.codec.quantize``.

``quantize`` fuses, per element: the code ``q = floor(x * inv_step + 0.5)`` in float32, the
reconstruction ``x' = dtype(float32(q) * step)`` rounded to the block's dtype exactly as
``_round_to_dtype`` does, the float64 check ``|x - x'| <= bound``, the escape decision, the symbol,
the per-program max error and the symbol histogram. The CPU twin is
:func:`torchrec_lossy.codec.quantize.quantize_kernel`; the torch oracle is ``quantize_reference``.

Bit-exactness notes:

- ``x * inv_step + 0.5`` must round twice (mul, then add). The kernel is launched with
  ``enable_fp_fusion=False`` so the GPU compiler does not contract it into one FMA (the
  interpreter never fuses).
- The fp16 / bf16 rounding of the reconstruction is done with integer ops on the float32 bits
  (libdevice ``rint`` does not run in the interpreter, and bit ops are exact anyway).
- Non-finite values reach the float->int conversion only after a select, so no lane converts
  NaN or Inf (undefined on the GPU).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torchrec_lossy.kernels._common import block_for

from torchrec_lossy.codec.format import ALPHABET_SIZE, ESCAPE_SYMBOL, SYMBOL_OFFSET

_BLOCK = 4096
# Globals a kernel reads must be constexpr.
_ALPHABET: tl.constexpr = tl.constexpr(ALPHABET_SIZE)
_ESCAPE: tl.constexpr = tl.constexpr(ESCAPE_SYMBOL)
_OFFSET: tl.constexpr = tl.constexpr(SYMBOL_OFFSET)
_F16_INF_FROM: tl.constexpr = tl.constexpr(0x477FF000)  # bits of 65520.0: fp16 inf from here
_F16_NORMAL_FROM: tl.constexpr = tl.constexpr(0x38800000)  # bits of 2**-14: smallest normal fp16


@triton.jit
def round_to_dtype(v, DTYPE_CODE: tl.constexpr):
    """Rounds float32 values to fp16 (code 2) or bf16 (code 3), nearest-even; fp32 (1) as is.

    Integer twin of ``_round_to_dtype``: non-finite values pass through unchanged.
    """
    if DTYPE_CODE == 1:
        return v
    bits = v.to(tl.uint32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    if DTYPE_CODE == 3:
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


@triton.jit(do_not_specialize=["bound_bits"])
def _quantize_kernel(
    x_ptr,
    sym_ptr,
    hist_ptr,
    err_ptr,
    bound_bits,
    n,
    step,
    inv_step,
    center,
    DTYPE_CODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    v = tl.load(x_ptr + offs, mask=in_range, other=0.0)
    # The float64 bound travels as its bits: a float argument would be narrowed to float32.
    # (Small bit patterns arrive as 32-bit ints: widen first.)
    bound = bound_bits.to(tl.int64).to(tl.float64, bitcast=True)
    t = v * inv_step
    qf = tl.floor(t + 0.5)
    rel = qf.to(tl.float64) - center
    recon = round_to_dtype(qf * step, DTYPE_CODE)
    err = tl.abs(recon.to(tl.float64) - v.to(tl.float64))
    ok = (tl.abs(rel) <= _OFFSET) & (err <= bound)  # False for NaN and Inf too
    q = tl.where(ok, rel, 0.0).to(tl.int32)  # only finite, in-range values are converted
    sym = tl.where(ok, q + _OFFSET, _ESCAPE)
    tl.store(sym_ptr + offs, sym.to(tl.int16), mask=in_range)
    tl.store(err_ptr + pid, tl.max(tl.where(ok & in_range, err, 0.0), axis=0))
    hist = tl.histogram(sym, _ALPHABET, mask=in_range)
    # Integer counts: the atomics' order cannot change the result.
    bins = tl.arange(0, _ALPHABET)
    tl.atomic_add(hist_ptr + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _dequantize_kernel(sym_ptr, out_ptr, n, step, base, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(sym_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    # |s + base| < 2**24, so the int -> float32 conversion is exact.
    tl.store(out_ptr + offs, (s + base).to(tl.float32) * step, mask=mask)


def quantize(
    x: torch.Tensor,
    step: float,
    inv_step: float,
    center: int,
    bound: float,
    dtype_code: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes a flat float32 tensor into symbols on its device; escapes what it cannot cover.

    Args:
        x: 1-D float32 values (exact copies of the block's fp32 / fp16 / bf16 values).
        step: Quantization step (float32-representable).
        inv_step: float32 reciprocal of the step.
        center: Code of the block's midpoint.
        bound: Absolute bound, checked in float64.
        dtype_code: The block's dtype code (the reconstruction is rounded to it).

    Returns:
        (int16 symbols [n] (the uint16 symbols' bits), int32 histogram [ALPHABET_SIZE],
        float64 0-d max error over the elements that were not escaped). Nothing is synced.
    """
    x = x.contiguous()
    n = x.shape[0]
    dev = x.device
    symbols = torch.empty(n, dtype=torch.int16, device=dev)
    hist = torch.zeros(ALPHABET_SIZE, dtype=torch.int32, device=dev)
    if n == 0:
        return symbols, hist, torch.zeros((), dtype=torch.float64, device=dev)
    block = block_for(n, _BLOCK)
    grid = triton.cdiv(n, block)
    errors = torch.empty(grid, dtype=torch.float64, device=dev)
    _quantize_kernel[(grid,)](
        x,
        symbols,
        hist,
        errors,
        int(np.float64(bound).view(np.int64)),
        n,
        step,
        inv_step,
        center,
        DTYPE_CODE=dtype_code,
        BLOCK=block,
        num_warps=8,
        enable_fp_fusion=False,
    )
    return symbols, hist, errors.max()


def dequantize(symbols: torch.Tensor, step: float, center: int) -> torch.Tensor:
    """Reconstructs float32 values from symbols (escaped positions get garbage, overwritten later).

    Args:
        symbols: 1-D int16 tensor holding the uint16 symbols' bits.
        step: Quantization step.
        center: Code of the block's midpoint.

    Returns:
        1-D float32 tensor on the symbols' device.
    """
    symbols = symbols.contiguous()
    n = symbols.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=symbols.device)
    if n == 0:
        return out
    block = block_for(n, _BLOCK)
    _dequantize_kernel[(triton.cdiv(n, block),)](
        symbols,
        out,
        n,
        step,
        center - SYMBOL_OFFSET,
        BLOCK=block,
        num_warps=8,
        enable_fp_fusion=False,
    )
    return out
