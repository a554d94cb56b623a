"""Deduplication state and helpers of the KJT input dist, shared with the output dist.

Pure tensor functions, no collectives: the wire dedupe of ids (:func:`segment_sort`,
:func:`segment_inverse`) and the cross-side output dedupe (:class:`OutputDedupe`; :func:`bag_keys`
and :func:`bag_inverse` on the sender, :func:`distinct_bags` / :func:`first_bags` on the owner).
Sender and owner order the distinct bags alike by construction: the empty bag first (if any),
then the distinct ids ascending. docs/input_dist.md, "Deduplication".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

OutputDedupeMode = Literal["exact", "lookup"] | None
"""Cross-side deduplication mode of an input dist (see :class:`OutputDedupe`); None: off."""


@dataclass
class OutputDedupe:
    """Cross-side deduplication state of one input-dist call, for the output dist.

    Two modes share it. **Exact** (``InputDistConfig.dedupe_outputs``, the default): for features
    whose bags hold at most one id and no weights, the owner gets the whole KJT and looks up every
    bag as TorchRec does, but the output dist sends back only the first bag of each distinct bag
    (distinct id, or empty) per (feature, destination); every bag of a distinct id pools to the
    same vector, so the receiver's expansion by its inverse index is exact, and the backward is
    TorchRec's dense one. **Lookup** (``InputDistConfig.dedupe_lookups``): only the distinct ids
    travel, the owner looks up ``U`` bags of one id (then ``B - U`` empty bags) and the gradient
    is summed per distinct id before it goes back (``sum_grads``).

    Attributes:
        recv_rows: Per source rank, per local feature (this rank's lookup order): rows sent back
            to that source, None where the feature is not deduplicated.
        send: Per owner rank, per feature sent to it: ``(rows, inverse)`` (the inverse index maps
            this rank's bags to the owner's rows), None where not deduplicated.
        sum_grads: Lookup mode: the owner's pooled rows past ``recv_rows`` are empty bags and
            gradients travel summed per distinct id.
        select: Exact mode, set when the owner decodes the KJT: per source, per local feature,
            the bags whose pooled rows are sent (first bag of each distinct bag, in the order of
            the sender's inverse index), None where not deduplicated.
    """

    recv_rows: list[list[int | None]]
    send: list[list[tuple[int, torch.Tensor] | None]]
    sum_grads: bool
    select: list[list[torch.Tensor | None]] | None = None

    def record_stream(self, stream: torch.Stream) -> None:
        """Marks the state's tensors as used on ``stream`` (the output dist's).

        Args:
            stream: The stream the output dist runs on.
        """
        tensors = [inv for row in self.send for x in row if x is not None for inv in x[1:]]
        tensors += [t for row in self.select or [] for t in row if t is not None]
        for t in tensors:
            if t.device.type != "cpu":
                t.record_stream(stream)  # type: ignore[arg-type]


def segment_sort(
    keys: torch.Tensor, seg: torch.Tensor, bound: int | None = None, num_segments: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lexicographic (segment, key) order by stable sorts (no hashing).

    Args:
        keys: int64 keys.
        seg: Segment of each key.
        bound: If known, every key is in ``[0, bound)``: when ``num_segments * bound`` fits in
            62 bits, one stable sort of ``seg * bound + key`` gives the same order as the two
            stable sorts (by key, then by segment) used otherwise.
        num_segments: Segments (with ``bound``).

    Returns:
        The order, and the mask of the first occurrence of each (segment, key) in that order
        (stable: it is the key's earliest position in its segment).
    """
    if bound is not None and max(num_segments, 1) * max(bound, 1) < 1 << 62:
        combined = seg * bound + keys
        order = torch.sort(combined, stable=True).indices
        sc = combined[order]
        new = torch.ones_like(sc, dtype=torch.bool)
        new[1:] = sc[1:] != sc[:-1]
        return order, new
    order = torch.sort(keys, stable=True).indices
    order = order[torch.sort(seg[order], stable=True).indices]
    sk, ss = keys[order], seg[order]
    new = torch.ones_like(sk, dtype=torch.bool)
    new[1:] = (sk[1:] != sk[:-1]) | (ss[1:] != ss[:-1])
    return order, new


def segment_inverse(
    order: torch.Tensor, new: torch.Tensor, seg: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Per key, the index of its distinct value within its segment (ascending key order).

    Args:
        order: From :func:`segment_sort`.
        new: From :func:`segment_sort`.
        seg: Segment of each key.
        counts: Distinct keys per segment.

    Returns:
        int64 inverse index.
    """
    rank_sorted = torch.cumsum(new.to(torch.int64), 0) - 1
    inverse = torch.empty_like(rank_sorted)
    inverse[order] = rank_sorted
    return inverse - (torch.cumsum(counts, 0) - counts)[seg]


def bag_keys(lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A key per bag that is equal exactly for bags that pool to the same vector.

    Args:
        lengths: int64 bag lengths.
        values: int64 ids, ``sum(lengths)`` of them.

    Returns:
        The id of a one-id bag, -1 for an empty bag, a distinct value below -1 for longer bags
        (never equal to another: they are not deduplicated).
    """
    n = lengths.numel()
    first = torch.cumsum(lengths, 0) - lengths
    # An empty feature has no ids to gather (every bag is then empty).
    ids = values[first.clamp(max=values.numel() - 1)] if values.numel() else lengths.new_zeros(n)
    keys = torch.where(lengths == 1, ids, torch.full_like(ids, -1))
    return torch.where(lengths > 1, -2 - torch.arange(n, device=lengths.device), keys)


def distinct_bags(
    lengths: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    id_bound: int | None = None,
    with_inverse: bool = True,
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Per segment (one feature of one batch), its distinct bags (:func:`bag_keys`).

    Used by the owner of the exact output dedupe (first bags) for the segments whose ids did not
    arrive wire-deduplicated (the others take :func:`first_bags`). It orders the distinct bags
    as the sender's :func:`bag_inverse` does: ascending key (the empty bag first).

    Args:
        lengths: Bag lengths of each segment.
        values: Ids of each segment.
        id_bound: If known, every id is in ``[0, id_bound)`` (one sort instead of two).
        with_inverse: Also compute the inverse index (else an empty list).

    Returns:
        Per segment: the number of distinct bags (read on the host, once for all), the inverse
        index of every bag, and the first bag of each distinct one.
    """
    counts = [int(t.numel()) for t in lengths]
    lens = torch.cat(list(lengths)).to(torch.int64)
    dev = lens.device
    sizes = torch.tensor(counts, dtype=torch.int64, device=dev)
    seg = torch.repeat_interleave(
        torch.arange(len(counts), device=dev), sizes, output_size=lens.numel()
    )
    keys = bag_keys(lens, torch.cat(list(values)).to(torch.int64))
    bound = None
    if id_bound is not None:  # shift the keys (>= -1 - lens.numel()) to be >= 0
        keys = keys + (lens.numel() + 1)
        bound = id_bound + lens.numel() + 1
    order, new = segment_sort(keys, seg, bound, len(counts))
    num = torch.zeros(len(counts), dtype=torch.int64, device=dev)
    num.scatter_add_(0, seg[order], new.to(torch.int64))
    inverse = segment_inverse(order, new, seg, num).split(counts) if with_inverse else []
    first = order[new]
    first = first - (torch.cumsum(sizes, 0) - sizes)[seg[first]]
    num_host = num.tolist()
    return num_host, list(inverse), list(first.split(num_host))


def first_bags(
    lengths: Sequence[torch.Tensor], inverses: Sequence[torch.Tensor], num_unique: Sequence[int]
) -> list[torch.Tensor]:
    """The owner's :func:`distinct_bags` first bags, from the sender's inverse index.

    For segments (one feature of one source) whose bags hold at most one id and whose ids
    arrived as distinct ids plus an inverse index: the sender orders the distinct bags the empty
    one first (if any), then the distinct ids in the order of that same inverse index (its
    ascending (feature, id) sort, see :func:`bag_inverse`), so the first bag of each distinct
    bag is a segmented minimum over the inverse index, no sort.

    Args:
        lengths: Bag lengths (0 or 1) of each segment.
        inverses: Per segment, the inverse index of its ids over its distinct ids (empty for a
            segment without ids).
        num_unique: Distinct ids of each segment.

    Returns:
        Per segment, the first bag of each distinct bag (``[empty + num_unique]``).
    """
    dev = lengths[0].device
    sizes = [int(t.numel()) for t in lengths]
    n_ids = [int(t.numel()) for t in inverses]
    empty = [int(n < b) for n, b in zip(n_ids, sizes, strict=True)]
    rows = [e + u for e, u in zip(empty, num_unique, strict=True)]
    row_off = list(itertools.accumulate(rows, initial=0))
    bag_off = list(itertools.accumulate(sizes, initial=0))
    total = bag_off[-1]
    # Per segment: its first bag, its first row (the empty bag's) and the row of distinct id 0.
    per_seg = torch.tensor(
        [bag_off[:-1], row_off[:-1], [r + e for r, e in zip(row_off, empty, strict=False)]],
        dtype=torch.int64,
        device=dev,
    )
    bag0, row0 = torch.repeat_interleave(
        per_seg[:2], torch.tensor(sizes, device=dev), dim=1, output_size=total
    )
    local = torch.arange(total, device=dev) - bag0
    target = row0.clone()  # every empty bag is its segment's first row
    id_row = torch.cat(list(inverses)).to(torch.int64) + torch.repeat_interleave(
        per_seg[2], torch.tensor(n_ids, device=dev), output_size=sum(n_ids)
    )
    lens = torch.cat(list(lengths)).to(torch.int64)
    target[torch.repeat_interleave(local + bag0, lens, output_size=sum(n_ids))] = id_row
    first = torch.full((row_off[-1],), total, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, target, local, "amin")
    return list(first.split(rows))


def bag_inverse(
    f: int,
    st: Sequence[int],
    batch: int,
    lens: torch.Tensor,
    ids_inv: torch.Tensor,
) -> torch.Tensor:
    """Inverse index of feature ``f``'s bags over its distinct bags (exact output dedupe).

    The distinct bags are the empty bag (if any) then the feature's distinct ids, in the order
    of ``inverse`` (ascending id), as :func:`first_bags` and :func:`distinct_bags` order them.

    Args:
        f: Feature.
        st: Its statistics row (length sum, max, min, ...).
        batch: Bags of the feature.
        lens: Bag lengths of every feature (int64).
        ids_inv: Inverse index of the feature's ids over its distinct ids.

    Returns:
        int64 ``[batch]``.
    """
    if st[2] == 1:  # one id per bag: bags are ids, in the same ascending order
        return ids_inv
    out = ids_inv.new_zeros(batch)  # every bag empty: one distinct bag
    if st[1] == 1:  # empty (row 0) and one-id bags
        bag_lens = lens[f * batch : (f + 1) * batch]
        bags = torch.repeat_interleave(
            torch.arange(batch, device=lens.device), bag_lens, output_size=ids_inv.numel()
        )
        out[bags] = ids_inv + 1
    return out
