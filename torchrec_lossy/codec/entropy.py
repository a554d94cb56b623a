"""The order-0 entropy bound the codec's ratios are reported against (DESIGN.md section 4)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["entropy_bound_bytes"]


def _entropy_bits(counts: torch.Tensor) -> float:
    """Order-0 entropy, in bits per symbol, of a histogram.

    Args:
        counts: Symbol counts (all > 0).

    Returns:
        Bits per symbol.
    """
    p = counts.to(torch.float64) / counts.sum()
    return float(-(p * torch.log2(p)).sum()) + 0.0  # + 0.0: one symbol gives 0.0, not -0.0


def entropy_bound_bytes(
    blocks: Sequence[torch.Tensor], error_bounds: Sequence[float]
) -> list[float]:
    """Order-0 entropy bound of error-bounded, vector-deduplicated traffic, per block.

    Per block: quantize with ``q = floor(x / (2 eb) + 0.5)``; the bound is
    (distinct quantized vectors x dim x order-0 entropy of their codes) + (rows x order-0 entropy
    of the row -> distinct-vector references), in bytes. A block with bound 0 is coded losslessly,
    its float bit patterns standing in for the codes. Codebooks and headers are not counted.

    Args:
        blocks: 2-D float tensors, one per table.
        error_bounds: Absolute bound per block.

    Returns:
        Bytes per block.
    """
    out = []
    for x, eb in zip(blocks, error_bounds, strict=True):
        if x.numel() == 0:
            out.append(0.0)
            continue
        if eb > 0:
            q = torch.floor(x.to(torch.float64) / (2.0 * eb) + 0.5).to(torch.int64)
        else:
            q = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
        vectors, refs = torch.unique(q, dim=0, return_counts=True)
        code_counts = torch.unique(vectors, return_counts=True)[1]
        bits = vectors.numel() * _entropy_bits(code_counts) + x.shape[0] * _entropy_bits(refs)
        out.append(bits / 8.0)
    return out
