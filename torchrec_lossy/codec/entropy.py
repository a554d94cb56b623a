"""The order-0 entropy bound the codec's ratios are reported against (DESIGN.md section 4)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchrec_lossy.codec.format import value_code
from torchrec_lossy.codec.quantize import value_mantissa_bits

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
    blocks: Sequence[torch.Tensor],
    error_bounds: Sequence[float],
    value: Sequence[bool] | None = None,
) -> list[float]:
    """Order-0 entropy bound of error-bounded, vector-deduplicated traffic, per block.

    Per block: quantize with ``q = floor(x / (2 eb) + 0.5)``; the bound is
    (distinct quantized vectors x dim x order-0 entropy of their codes) + (rows x order-0 entropy
    of the row -> distinct-vector references), in bytes. A block with bound 0 is coded losslessly,
    its float bit patterns standing in for the codes. Codebooks and headers are not counted.
    A per-value block (``value``) is coded on the per-value grid: sign and ``format.value_code``
    of each magnitude, with nothing escaped.

    Args:
        blocks: 2-D float tensors, one per table.
        error_bounds: Absolute bound per block (the per-value bound where ``value``).
        value: Per block, whether its bound is per-value; None: none is.

    Returns:
        Bytes per block.
    """
    out = []
    value = value if value is not None else [False] * len(blocks)
    for x, eb, per_value in zip(blocks, error_bounds, value, strict=True):
        if x.numel() == 0:
            out.append(0.0)
            continue
        if eb > 0 and per_value:
            bits = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
            q = 2 * value_code(bits & 0x7FFFFFFF, 23 - value_mantissa_bits(eb)) + (bits < 0)
        elif eb > 0:
            q = torch.floor(x.to(torch.float64) / (2.0 * eb) + 0.5).to(torch.int64)
        else:
            q = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
        vectors, refs = torch.unique(q, dim=0, return_counts=True)
        code_counts = torch.unique(vectors, return_counts=True)[1]
        bits = vectors.numel() * _entropy_bits(code_counts) + x.shape[0] * _entropy_bits(refs)
        out.append(bits / 8.0)
    return out
