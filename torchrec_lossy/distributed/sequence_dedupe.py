"""Exact row dedupe of the sequence-embedding all-to-all of an ``EmbeddingCollection``.

Each (destination, table shard) block carries one row per distinct id (ascending) and the
receiver expands them back to its positions with one gather. No index travels: both sides find
the same distinct ids in their own copy of the ids (:func:`~.dedupe.segment_sort`; row-wise the
owner's local ids are a per-(owner, table) shift, which keeps the order). The gradient is the
gather's adjoint (``LossyCommsConfig.backward_dedupe``). docs/sharder.md, "Row dedupe".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchrec_lossy.distributed.dedupe import segment_inverse, segment_sort
from torchrec_lossy.profile_range import profile_range


@dataclass
class SequenceDedupe:
    """The distinct ids of one sequence all-to-all call, on both of this rank's sides.

    Attributes:
        send_rows: Owner side: per destination, per local table shard, its distinct ids.
        send_first: Owner side: the lookup-output row (first position) of each of them, in
            (destination, table shard, ascending id) order.
        recv_rows: Receiver side: per owner, per table shard of its layout, its distinct ids.
        recv_inverse: Receiver side: per received position (owner order, TorchRec's layout),
            its row among all received distinct rows (owners, then tables, in order).
    """

    send_rows: list[list[int]]
    send_first: torch.Tensor
    recv_rows: list[list[int]]
    recv_inverse: torch.Tensor

    def owner_blocks(self, local_embs: torch.Tensor) -> list[list[torch.Tensor]]:
        """The owner's forward blocks: per destination, per table shard, its distinct rows.

        Args:
            local_embs: ``[num_ids, D]`` lookup output.

        Returns:
            Per destination, per local table shard, ``[distinct ids, D]``.
        """
        return _split_blocks(local_embs.index_select(0, self.send_first), self.send_rows)

    def expand(self, rows: torch.Tensor) -> torch.Tensor:
        """Receiver: every received position's row, from the distinct rows (a gather, exact).

        Args:
            rows: ``[sum(recv_rows), D]``, owners then table shards in order.

        Returns:
            ``[num_received_ids, D]``.
        """
        return rows.index_select(0, self.recv_inverse)

    def reduce_grad(self, grad: torch.Tensor) -> list[list[torch.Tensor]]:
        """Receiver, backward of :meth:`expand`: the gradient summed per distinct id.

        Args:
            grad: ``[num_received_ids, D]`` gradient of the expanded rows.

        Returns:
            Per owner, per table shard, ``[distinct ids, D]``.
        """
        total = sum(sum(r) for r in self.recv_rows)
        summed = grad.new_zeros((total, grad.shape[1])).index_add_(0, self.recv_inverse, grad)
        return _split_blocks(summed, self.recv_rows)

    def place_grad(
        self,
        blocks: Sequence[Sequence[torch.Tensor]],
        num_ids: int,
        dim: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Owner, backward of :meth:`owner_blocks`: each summed row at its id's first position.

        Args:
            blocks: Per destination, per local table shard, ``[distinct ids, D]`` gradients.
            num_ids: Rows of the lookup output.
            dim: ``D``, the lookup output's width (also when this rank holds no table shard).
            dtype: The lookup output's dtype.

        Returns:
            ``[num_ids, D]``, zero at every other position.
        """
        flat = [b for bs in blocks for b in bs]
        out = torch.zeros((num_ids, dim), dtype=dtype, device=self.send_first.device)
        if flat:
            out.index_copy_(0, self.send_first, torch.cat(flat).to(out.device, dtype))
        return out


def _split_blocks(rows: torch.Tensor, counts: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
    """``rows`` cut into consecutive blocks of ``counts`` rows, grouped as ``counts``."""
    it = iter(rows.split([n for per_peer in counts for n in per_peer]))
    return [[next(it) for _ in per_peer] for per_peer in counts]


def _segments(
    pieces: Sequence[int], seg_of_piece: Sequence[int], device: torch.device
) -> torch.Tensor:
    """The segment of every position: piece ``i`` (``pieces[i]`` positions) is in segment
    ``seg_of_piece[i]``."""
    lengths = torch.tensor(list(pieces), dtype=torch.int64, device=device)
    segs = torch.tensor(list(seg_of_piece), dtype=torch.int64, device=device)
    return torch.repeat_interleave(segs, lengths, output_size=int(sum(pieces)))


def _distinct(
    ids: torch.Tensor, seg: torch.Tensor, num_segments: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, first-occurrence mask, distinct ids per segment) of ``ids`` by (segment, id)."""
    order, new = segment_sort(ids.to(torch.int64), seg, None, num_segments)
    counts = torch.zeros(num_segments, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, seg[order], new.to(torch.int64))
    return order, new, counts


def plan_sequence_dedupe(
    lookup_ids: torch.Tensor,
    feature_rows: Sequence[Sequence[int]],
    my_spans: Sequence[tuple[int, int]],
    recv_ids: torch.Tensor,
    rows_per_owner: Sequence[Sequence[int]],
    owner_spans: Sequence[Sequence[tuple[int, int]]],
) -> SequenceDedupe:
    """Finds the distinct ids of every block on both sides (one host read for all counts).

    Args:
        lookup_ids: Owner side: the ids of the lookup output's rows (feature-major, each
            feature's ids by source rank), as the input dist delivered them.
        feature_rows: Per local feature, per destination rank, its ids.
        my_spans: Per local table shard, its features' range (``[f0, f1)``).
        recv_ids: Receiver side: this rank's ids in the order their rows arrive (per owner,
            per feature of its layout, in batch order).
        rows_per_owner: Per owner, per feature of its layout, this rank's ids it sends back.
        owner_spans: Per owner, per table shard, its features' range.

    Returns:
        The dedupe state of the call.
    """
    world = len(rows_per_owner)
    n_tables = len(my_spans)
    dev = lookup_ids.device
    with profile_range("## lossy_seq_a2a dedupe ##"):
        table_of = [t for t, (f0, f1) in enumerate(my_spans) for _ in range(f0, f1)]
        own_seg = _segments(
            [n for per_dest in feature_rows for n in per_dest],
            [d * n_tables + table_of[f] for f in range(len(feature_rows)) for d in range(world)],
            dev,
        )
        o_order, o_new, o_counts = _distinct(lookup_ids, own_seg, world * n_tables)
        base = list(itertools.accumulate((len(s) for s in owner_spans), initial=0))
        recv_seg = _segments(
            [n for rows in rows_per_owner for n in rows],
            [base[o] + t for o, spans in enumerate(owner_spans)
             for t, (f0, f1) in enumerate(spans) for _ in range(f0, f1)],
            recv_ids.device,
        )  # fmt: skip
        r_order, r_new, r_counts = _distinct(recv_ids, recv_seg, base[-1])
        host = torch.cat([o_counts, r_counts.to(dev)]).tolist()
        inverse = segment_inverse(r_order, r_new, recv_seg, r_counts)
        inverse = inverse + (torch.cumsum(r_counts, 0) - r_counts)[recv_seg]
    own, recv = host[: world * n_tables], host[world * n_tables :]
    return SequenceDedupe(
        send_rows=[own[d * n_tables : (d + 1) * n_tables] for d in range(world)],
        send_first=o_order[o_new],
        recv_rows=[recv[base[o] : base[o + 1]] for o in range(world)],
        recv_inverse=inverse,
    )
