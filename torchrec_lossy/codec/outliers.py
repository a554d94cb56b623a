"""Finite outliers of a relative-bound block: the range a relative bound is taken over.

One huge finite value must not set the bound of every other element of its block (issue 32:
one row at 3e38 among ``|x| < 3`` made 0.03 of the range 9e36). So a relative bound ``r``
resolves to ``r * (max - min)`` over the block's finite elements that are not outliers, and
the outliers are left to the quantizer, which escapes whatever its grid cannot carry within
that bound (they travel verbatim, as NaN and Inf do).

The rule (docs/format.md, "Finite outliers of a relative bound"), exact on every backend
because it counts float32 exponent fields only, with no sort:

- ``E(x)`` is the biased exponent field of float32 ``x`` (``floor(log2 |x|) + 127`` for a
  normal ``x``); the block's normal elements are its finite ones with ``E >= 1``.
- ``M`` is their lower median exponent: the least ``e`` with ``#{E <= e} >= ceil(n / 2)``.
- An outlier is a finite element with ``E >= M + OUTLIER_OCTAVES``, i.e. ``|x| >= 2**(M - 127 +
  16)``: at least ``2**15`` times the magnitude of the block's median-exponent element.

A block with no normal element or no outlier keeps its whole finite range (so the bytes of
every such block are what they were before the rule). At most half of the normal elements are
outliers, so some element always remains.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

__all__ = ["OUTLIER_OCTAVES", "inlier_ranges_kernel", "inlier_ranges_torch"]

OUTLIER_OCTAVES = 16
_EXP_BINS = 256


@numba.njit(cache=True, nogil=True)
def _exponent_field(v: float) -> int:
    return (np.int64(np.float32(v).view(np.int32)) >> 23) & 0xFF


@numba.njit(cache=True, nogil=True)
def inlier_ranges_kernel(
    x: np.ndarray, elem_off: np.ndarray, lo: np.ndarray, hi: np.ndarray, want: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Smallest and largest finite non-outlier of every block (the host path's rule).

    Args:
        x: 1-D float32 values of every block, back to back.
        elem_off: int64 [n_blocks + 1] block starts in ``x``, then the end.
        lo: float64 [n_blocks] smallest finite value (``quantize.finite_ranges_kernel``; NaN
            when none).
        hi: float64 [n_blocks] largest finite value.
        want: bool [n_blocks] the blocks to look at (the relative ones: the pass costs a read).

    Returns:
        float64 (lo, hi) per block over the finite elements that are not outliers; ``lo`` and
        ``hi`` themselves where the block has no outlier or is not wanted.
    """
    nb = elem_off.shape[0] - 1
    out_lo, out_hi = lo.copy(), hi.copy()
    bits = x.view(np.int32)
    big = np.int32(0x7FFFFFFF)
    for b in range(nb):
        if not (want[b] and lo[b] <= hi[b]):
            continue
        top = max(_exponent_field(abs(lo[b])), _exponent_field(abs(hi[b])))
        cut = top - OUTLIER_OCTAVES  # an outlier exists iff M <= cut
        if cut < 1:
            continue
        block = bits[elem_off[b] : elem_off[b + 1]]
        n = 0
        low = 0
        for i in range(block.shape[0]):  # one counting pass decides (it vectorises)
            e = (block[i] >> np.int32(23)) & np.int32(0xFF)
            normal = (e >= 1) & (e <= 254)
            n += np.int64(normal)
            low += np.int64(normal & (e <= cut))
        half = (n + 1) // 2
        if n == 0 or low < half:
            continue
        hist = np.zeros(_EXP_BINS, np.int64)
        for i in range(block.shape[0]):
            e = (block[i] >> np.int32(23)) & np.int32(0xFF)
            if e >= 1 and e <= 254:
                hist[e] += 1
        acc = 0
        m = 0
        for e in range(_EXP_BINS):
            acc += hist[e]
            if acc >= half:
                m = e
                break
        limit = np.int32(m + OUTLIER_OCTAVES)
        mn, mx = big, -big
        for i in range(block.shape[0]):  # keys that order as the floats (finite_ranges_kernel)
            v = block[i]
            key = v ^ ((v >> np.int32(31)) & big)
            inl = ((v >> np.int32(23)) & np.int32(0xFF)) < limit  # not Inf / NaN (255) either
            mn = min(mn, key if inl else big)
            mx = max(mx, key if inl else -big)
        out_lo[b] = np.int32(mn ^ ((mn >> np.int32(31)) & big)).view(np.float32)
        out_hi[b] = np.int32(mx ^ ((mx >> np.int32(31)) & big)).view(np.float32)
    return out_lo, out_hi


def inlier_ranges_torch(
    x: torch.Tensor, e_blk: torch.Tensor, numel: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest finite non-outlier of every block (the device path's rule, the
    same numbers as :func:`inlier_ranges_kernel`; no sync, no sort).

    Args:
        x: float32 [n_elems] values of every block, back to back.
        e_blk: int64 [n_elems] block of each element.
        numel: int64 [n_blocks] elements per block.

    Returns:
        float32 (lo, hi) per block over its finite non-outliers (+inf, -inf when none).
    """
    nb = numel.shape[0]
    e = (x.contiguous().view(torch.int32) >> 23) & 0xFF
    normal = (e >= 1) & (e <= 254)
    hist = torch.zeros(nb * _EXP_BINS, dtype=torch.int64, device=x.device)
    hist.index_add_(0, e_blk * _EXP_BINS + e, normal.to(torch.int64))  # integer: exact
    hist = hist.view(nb, _EXP_BINS)
    half = (hist.sum(1) + 1) // 2
    # The least e with cum[e] >= half; 0 without a normal element (every finite one then has
    # exponent 0, below the limit: no outlier, as in the host kernel).
    median = (torch.cumsum(hist, 1) < half[:, None]).sum(1)
    inlier = e < (median + OUTLIER_OCTAVES)[e_blk]  # Inf / NaN (255) are never below 255
    inlier = inlier & (e != 255)
    lo = torch.segment_reduce(
        torch.where(inlier, x, math.inf), "min", lengths=numel, unsafe=True, initial=math.inf
    )
    hi = torch.segment_reduce(
        torch.where(inlier, x, -math.inf), "max", lengths=numel, unsafe=True, initial=-math.inf
    )
    return lo, hi
