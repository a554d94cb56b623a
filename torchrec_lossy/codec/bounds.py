"""Relative error bounds turned absolute: one rule for the host and the device paths.

A relative bound ``r`` of a block is ``r * (max - min)`` over the block's finite elements, the
range taken in float32 (as the block's values), the product in float64. A block with no finite
element, or a range that is not finite or not positive, gets the absolute bound 0 (lossless).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from torchrec_lossy.codec.elementwise import N, as_float64, isfinite, jitable, where


@jitable
def finite_span(lo: N, hi: N) -> N:
    """``hi - lo`` of the blocks' finite elements, 0 where that is not a positive finite range.

    Element-wise on torch tensors, numpy arrays or scalars, and in numba-compiled code (the
    host codec's kernel resolves relative bounds with it).

    Args:
        lo: float32 [n] smallest finite element per block (+inf if none).
        hi: float32 [n] largest finite element per block (-inf if none).

    Returns:
        float64 [n] ranges.
    """
    span = as_float64(hi - lo)  # float32 subtraction, as the blocks' values
    return where(isfinite(span) & (span > 0), span, 0.0)


def absolute_bounds(
    blocks: Sequence[torch.Tensor], values: Sequence[float], relative: Sequence[bool]
) -> list[float]:
    """Each block's absolute bound (the host-side twin of the device path's resolution).

    Args:
        blocks: 2-D float tensors.
        values: Per block: the absolute bound, or the relative fraction.
        relative: Per block, whether ``values[i]`` is relative.

    Returns:
        Absolute bounds (one host read for all relative blocks on a device).
    """
    idx = [i for i, r in enumerate(relative) if r and values[i] > 0 and blocks[i].numel() > 0]
    out = [0.0 if r else float(v) for v, r in zip(values, relative, strict=True)]
    if not idx:
        return out
    lo, hi = [], []
    for i in idx:
        f = blocks[i].float()
        finite = torch.isfinite(f)
        lo.append(torch.where(finite, f, math.inf).amin())
        hi.append(torch.where(finite, f, -math.inf).amax())
    spans = finite_span(torch.stack(lo), torch.stack(hi)).tolist()
    for i, s in zip(idx, spans, strict=True):
        out[i] = float(values[i]) * s
    return out
