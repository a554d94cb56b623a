"""Variable batch per feature (VBE) layouts: KJT lengths and pooled embeddings made rectangular.

KJT lengths: :func:`pad_vbe_lengths` pads each feature with zero lengths to the KJT's largest
batch, :func:`vbe_lengths_mask` selects the real ones back on the receiver. Pooled embeddings:
:func:`pad_vbe_input` lays TorchRec's flat VBE lookup output out as the ``[sum_r M_r,
D_local_sum]`` input of the pooled all-to-all (``M_r``: destination ``r``'s largest batch, zero
rows below each feature's bags), :func:`unpad_vbe_output` takes the receiver's bags back out.
All copies, so values and gradients are exact and autograd carries the backward.
docs/sharder.md ("How the all-to-all works"), docs/input_dist.md ("VBE").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchrec_lossy.profile_range import profile_range


def pad_vbe_lengths(lengths: torch.Tensor, strides: Sequence[int]) -> tuple[torch.Tensor, int]:
    """A VBE KJT's lengths as ``[F * B]``, each feature's padded with zeros to ``B = max(strides)``.

    Args:
        lengths: The KJT's lengths, feature after feature (feature ``f`` has ``strides[f]``).
        strides: Every feature's batch (``stride_per_key()``).

    Returns:
        The padded lengths (same dtype and device) and ``B``.
    """
    batch = max(strides, default=0)
    mask = vbe_lengths_mask([strides], [batch], lengths.device)
    out = lengths.new_zeros(len(strides) * batch)
    out[mask] = lengths
    return out, batch


def vbe_lengths_mask(
    strides_per_src: Sequence[Sequence[int]], batch_per_src: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Which padded lengths are real: per source, per feature, the first ``strides`` of ``B``.

    Args:
        strides_per_src: Per source (payload), per feature, its batch.
        batch_per_src: Per source, the batch its lengths are padded to.
        device: Where the mask goes.

    Returns:
        Bool ``[sum_s F_s * B_s]``, laid out as the padded lengths (source, feature, bag).
    """
    pieces = [
        np.arange(batch)[None, :] < np.asarray(strides, np.int64).reshape(-1, 1)
        for strides, batch in zip(strides_per_src, batch_per_src, strict=True)
    ]
    flat = np.concatenate([p.reshape(-1) for p in pieces]) if pieces else np.zeros(0, bool)
    return torch.from_numpy(flat).to(device)


def vbe_rows_per_rank(
    pg: dist.ProcessGroup, batch_size_per_feature_pre_a2a: Sequence[int], device: torch.device
) -> list[int]:
    """Rows each rank receives in the dense layout: its largest batch of any feature.

    A sender knows only its own features' batches per destination, so every rank's largest
    batch is all-gathered (one small collective and host read per VBE call).

    Args:
        pg: Process group of the all-to-all.
        batch_size_per_feature_pre_a2a: This rank's batch size of every feature (all ranks'
            features, in source-rank order).
        device: Device of the embeddings (the collective's backend needs its tensors there).

    Returns:
        Per rank of ``pg``, its row count.
    """
    with profile_range("## lossy_vbe_rows_all_gather ##"):
        mine = torch.tensor([max(batch_size_per_feature_pre_a2a, default=0)], device=device)
        gathered = [torch.empty_like(mine) for _ in range(pg.size())]
        dist.all_gather(gathered, mine, group=pg)
        return [int(x) for x in torch.cat(gathered).tolist()]


def pad_vbe_input(
    local_embs: torch.Tensor,
    batch_size_per_rank_per_feature: Sequence[Sequence[int]],
    dims: Sequence[int],
    rows_per_rank: Sequence[int],
) -> torch.Tensor:
    """The sender's flat VBE lookup output as ``[sum_r M_r, D_local_sum]``.

    Args:
        local_embs: Flat pooled embeddings, destination-major, then feature, then bag.
        batch_size_per_rank_per_feature: Per destination rank, per local feature, its batch.
        dims: Per local feature, its columns (in lookup order).
        rows_per_rank: Per destination rank, its rows ``M_r`` (:func:`vbe_rows_per_rank`).

    Returns:
        The dense tensor: destination ``r``'s rows ``[off_r, off_r + M_r)``, its bags of
        feature ``f`` first in ``f``'s columns, zero below them.
    """
    sizes = [
        b * d for per_f in batch_size_per_rank_per_feature for b, d in zip(per_f, dims, strict=True)
    ]
    pieces = iter(local_embs.view(-1).split(sizes))
    empty = local_embs.view(-1)[:0].view(1, 0)
    blocks = []
    for batches, rows in zip(batch_size_per_rank_per_feature, rows_per_rank, strict=True):
        cols = [
            F.pad(next(pieces).view(b, d), (0, 0, 0, rows - b))
            for b, d in zip(batches, dims, strict=True)
        ]
        # No local features: an empty view of the input, so the autograd graph stays connected.
        blocks.append(torch.cat(cols, dim=1) if cols else empty.expand(rows, 0))
    return torch.cat(blocks)


def unpad_vbe_output(
    out: torch.Tensor,
    batch_size_per_feature_pre_a2a: Sequence[int],
    dims: Sequence[int],
) -> torch.Tensor:
    """The receiver's ``[M_me, D_global_sum]`` as TorchRec's flat VBE all-to-all output.

    Args:
        out: What the dense all-to-all delivered (columns of every source in rank order).
        batch_size_per_feature_pre_a2a: This rank's batch of every feature, in column order.
        dims: Every feature's columns, in column order.

    Returns:
        Flat: per feature in order, its first ``b_f`` rows, row-major.
    """
    pieces = []
    col = 0
    for b, d in zip(batch_size_per_feature_pre_a2a, dims, strict=True):
        pieces.append(out[:b, col : col + d].reshape(-1))
        col += d
    return torch.cat(pieces) if pieces else out.new_empty((0,))
