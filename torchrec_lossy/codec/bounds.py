"""Relative bounds turned absolute and per-block bound kinds read: one rule for the host and the
device paths. ``BoundKind`` is the config's (``ErrorBound.mode`` names it), re-exported here.

A relative bound ``r`` of a block is ``r * (max - min)`` over the block's finite elements that
are not outliers (``codec/outliers.py``), the range taken in float32 (as the block's values),
the product in float64. A block with no finite
element, or a range that is not finite or not positive, gets the absolute bound 0 (lossless).
A per-value bound ``v`` is not resolved: the codec quantizes such a block on its per-value grid
(``format.value_symbol``), ``|x' - x| <= v |x|`` for every element.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchrec_lossy.codec.elementwise import N, as_float64, isfinite, jitable, where
from torchrec_lossy.codec.outliers import inlier_ranges_torch
from torchrec_lossy.config import BoundKind

__all__ = ["BoundKind", "absolute_bounds", "block_kinds", "finite_span"]


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
    blocks: Sequence[torch.Tensor], values: Sequence[float], kinds: Sequence[int]
) -> list[float]:
    """Each block's absolute bound (the host-side twin of the device path's resolution).

    Args:
        blocks: 2-D float tensors.
        values: Per block: the absolute bound, the relative fraction or the per-value bound.
        kinds: Per block, its ``BoundKind``.

    Returns:
        Absolute bounds, per-value ones as they are (one host read for all relative blocks on
        a device).
    """
    rel = [k == BoundKind.RELATIVE for k in kinds]
    idx = [i for i, r in enumerate(rel) if r and values[i] > 0 and blocks[i].numel() > 0]
    out = [0.0 if r else float(v) for v, r in zip(values, rel, strict=True)]
    if not idx:
        return out
    lo, hi = [], []
    for i in idx:
        f = blocks[i].float().reshape(-1)
        ends = torch.tensor([f.shape[0]], device=f.device)
        # The range without finite outliers, as the compress paths take it.
        b_lo, b_hi = inlier_ranges_torch(f, torch.zeros_like(f, dtype=torch.int64), ends)
        lo.append(b_lo[0])
        hi.append(b_hi[0])
    spans = finite_span(torch.stack(lo), torch.stack(hi)).tolist()
    for i, s in zip(idx, spans, strict=True):
        out[i] = float(values[i]) * s
    return out


def block_kinds(kinds: BoundKind | bool | Sequence[Sequence[int | bool]], n: int) -> list[int]:
    """One ``BoundKind`` per block from a caller's kinds: one for all, or one per block per group.

    Args:
        kinds: A kind (``True`` / ``False``: relative / absolute) for every block, or per group
            one per block.
        n: Blocks in all.

    Returns:
        The kinds, flat.

    Raises:
        ValueError: Not one per block.
    """
    if isinstance(kinds, (bool, int)):
        return [int(kinds)] * n
    flat = [int(k) for g in kinds for k in g]
    if len(flat) != n or any(k not in tuple(BoundKind) for k in flat):
        raise ValueError(
            f"got {len(flat)} bound kinds for {n} blocks: pass one BoundKind per block, "
            "or one for all"
        )
    return flat
