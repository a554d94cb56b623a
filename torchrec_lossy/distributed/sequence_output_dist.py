"""Compressed sequence-embedding all-to-all of a table- or column-wise ``EmbeddingCollection``.

:class:`LossySequenceEmbeddingsAllToAll` gives exactly the tensor of TorchRec's
``SequenceEmbeddingsAllToAll`` (the owner's feature-major rows permuted rank-major), but cuts
each destination's rows into one block per local table shard and sends them through the one
exchange path (:func:`.exchange.exchange`, :func:`.exchange.receive`); with
:mod:`.sequence_dedupe` one row per distinct id.
docs/sharder.md, "EmbeddingCollection (sequence features)".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import SequenceEmbeddingsAwaitable
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.types import Awaitable, NoWait
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.cast_blocks import cast_tables
from torchrec_lossy.distributed.comm_ops import LossyAll2AllReq
from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.context import lookup_ids_of
from torchrec_lossy.distributed.exchange import (
    LOSSY_WIRE,
    Geometry,
    LossyRequest,
    exchange,
    receive,
    wire_for,
)
from torchrec_lossy.distributed.exchange_slots import SlotHistory
from torchrec_lossy.distributed.pooled_blocks import BlockSpec, LossyAll2AllPooledInfo, layout_plans
from torchrec_lossy.distributed.pooled_payload import warm_up_host
from torchrec_lossy.distributed.sequence_dedupe import SequenceDedupe, plan_sequence_dedupe
from torchrec_lossy.distributed.topology import peer_links
from torchrec_lossy.profile_range import profile_range


@dataclasses.dataclass
class LossyAll2AllSeqInfo:
    """Per-call parameters of :func:`alltoall_sequence_lossy`.

    Attributes:
        pooled: Layout (per rank, one :class:`BlockSpec` per table shard: its features and
            dim), compress flags, comms state and dtype, as the pooled all-to-all's.
        feature_rows: Owner side: per local feature, per destination rank, the ids of that
            rank's batch (the lookup output's rows, feature-major).
        recv_rows: Receiver side: per owner rank, per table shard of its layout, the rows it
            sends this rank.
        dim: Embedding dim (every table shard of a sequence sharding has the same).
        dedupe: The call's distinct ids (one row per distinct id per block); None: every id.
    """

    pooled: LossyAll2AllPooledInfo
    feature_rows: list[list[int]]
    recv_rows: list[list[int]]
    dim: int
    dedupe: SequenceDedupe | None = None

    @property
    def dedupe_grads(self) -> bool:
        """Whether the gradient travels one summed row per distinct id."""
        return self.dedupe is not None and self.pooled.comms.config.backward_dedupe

    def grad_rows(self, my_rank: int) -> list[list[int]]:
        """Owner side: per source, per local table shard, the gradient rows it sends here."""
        if self.dedupe_grads:
            assert self.dedupe is not None
            return self.dedupe.send_rows
        return self.send_rows(my_rank)

    def send_rows(self, my_rank: int) -> list[list[int]]:
        """Per destination, per local table shard: the rows sent to it."""
        world = len(self.recv_rows)
        return [
            [sum(self.feature_rows[f][d] for f in range(f0, f1)) for f0, f1 in self.spans(my_rank)]
            for d in range(world)
        ]

    def spans(self, rank: int) -> list[tuple[int, int]]:
        """Per table shard of ``rank``: its features' range in the rank's feature order."""
        return _spans(self.pooled.layout[rank])


def _spans(specs: Sequence[BlockSpec]) -> list[tuple[int, int]]:
    """Per table shard: its features' range in the rank's feature order."""
    return list(
        itertools.pairwise(itertools.accumulate((s.num_features for s in specs), initial=0))
    )


def cut_sequence_blocks(
    x: torch.Tensor, info: LossyAll2AllSeqInfo, my_rank: int
) -> list[list[torch.Tensor]]:
    """The owner's blocks: per destination, per local table shard, its features' rows.

    Args:
        x: ``[num_ids, D]`` lookup output, feature-major, each feature's rows by source rank.
        info: Row counts and layout.
        my_rank: This rank.

    Returns:
        Per destination, per local table shard, a contiguous ``[rows, D]`` block.
    """
    world = len(info.recv_rows)
    segs = x.split([n for per_dest in info.feature_rows for n in per_dest])
    return [
        [
            torch.cat([segs[f * world + d] for f in range(f0, f1)])
            if f1 - f0 > 1
            else segs[f0 * world + d].contiguous()
            for f0, f1 in info.spans(my_rank)
        ]
        for d in range(world)
    ]


def join_sequence_blocks(
    blocks: Sequence[Sequence[torch.Tensor]], info: LossyAll2AllSeqInfo, my_rank: int
) -> torch.Tensor:
    """Inverse of :func:`cut_sequence_blocks`: the owner's ``[num_ids, D]``, feature-major.

    Args:
        blocks: Per source (destination of the forward), per local table shard, its rows.
        info: Row counts and layout.
        my_rank: This rank.

    Returns:
        The gradient of the lookup output.
    """
    world = len(info.recv_rows)
    seg: dict[tuple[int, int], torch.Tensor] = {}
    for d in range(world):
        for (f0, f1), b in zip(info.spans(my_rank), blocks[d], strict=True):
            parts = b.split([info.feature_rows[f][d] for f in range(f0, f1)])
            seg.update({(f, d): p for f, p in zip(range(f0, f1), parts, strict=True)})
    if not seg:
        return torch.empty(0, info.dim, dtype=info.pooled.dtype)
    return torch.cat([seg[(f, d)] for f in range(len(info.feature_rows)) for d in range(world)])


@dataclasses.dataclass
class SequenceSteps:
    """The sequence all-to-all's steps (:class:`.comm_ops.ExchangeSteps`): blocks of
    ``[rows, D]`` per (peer, table shard), cut from and joined into ``[num_ids, D]`` tensors.

    Args:
        info: The call's row counts, layout, dedupe and comms state.
    """

    info: LossyAll2AllSeqInfo

    @property
    def comms(self) -> LossyComms:
        """The module's dists' state."""
        return self.info.pooled.comms

    @property
    def ledger(self) -> CallLedger:
        """The module's call ledger."""
        return self.info.pooled.ledger

    def send_forward(
        self, x: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> tuple[torch.Tensor, dist.Work]:
        """Cuts the owner's rows per (destination, table shard) and sends them encoded."""
        info, pooled = self.info, self.info.pooled
        specs = pooled.layout[my_rank]
        with profile_range("## lossy_seq_a2a fwd cut ##"):
            if info.dedupe is None:
                blocks = cut_sequence_blocks(x.detach(), info, my_rank)
            else:
                blocks = info.dedupe.owner_blocks(x.detach())
        rows = info.recv_rows if info.dedupe is None else info.dedupe.recv_rows
        geometry = Geometry([specs] * world, pooled.layout, rows, info.send_rows(my_rank))
        return exchange("fwd", blocks, geometry, LOSSY_WIRE, pooled, myreq, x.device, my_rank)

    def receive_forward(
        self, recv: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> torch.Tensor:
        """Decodes every owner's rows into this rank's ``[num_ids_local, D]``."""
        info, dd = self.info, self.info.dedupe
        blocks = receive("fwd", recv, info.pooled, myreq, my_rank)
        pieces = [b for bs in blocks for b in bs]
        if not pieces:
            return recv.new_empty((0, info.dim), dtype=info.pooled.dtype)
        if dd is None:
            return torch.cat(pieces)
        with profile_range("## lossy_seq_a2a fwd dedupe expand ##"):
            return dd.expand(torch.cat(pieces))

    def send_grad(
        self, grad: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> tuple[torch.Tensor, dist.Work]:
        """Sends each owner the gradient of its rows: encoded, cast or exact; one summed row
        per distinct id under ``dedupe_grads``.
        """
        info, pooled = self.info, self.info.pooled
        if info.dedupe_grads:
            assert info.dedupe is not None
            with profile_range("## lossy_seq_a2a bwd dedupe reduce ##"):
                blocks = info.dedupe.reduce_grad(grad)
        else:
            sizes = [r for rows in info.recv_rows for r in rows]
            it = iter(grad.split(sizes))
            blocks = [[next(it) for _ in rows] for rows in info.recv_rows]
        specs = pooled.layout[my_rank]
        geometry = Geometry(pooled.layout, [specs] * world, info.grad_rows(my_rank), info.recv_rows)
        wire = wire_for("bwd", pooled.comms.config, pooled.dtype, "lossy_seq_a2a")
        return exchange("bwd", blocks, geometry, wire, pooled, myreq, grad.device, my_rank)

    def receive_grad(
        self, recv: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> torch.Tensor:
        """The owner's ``[num_ids, D]`` gradient, feature-major, from what the sources sent."""
        info = self.info
        blocks = receive("bwd", recv, info.pooled, myreq, my_rank)
        if info.dedupe_grads:
            assert info.dedupe is not None
            num_ids = sum(sum(per_dest) for per_dest in info.feature_rows)
            return info.dedupe.place_grad(blocks, num_ids, info.dim, info.pooled.dtype)
        return join_sequence_blocks(blocks, info, my_rank).to(recv.device)


def alltoall_sequence_lossy(
    local_embs: torch.Tensor, info: LossyAll2AllSeqInfo, group: dist.ProcessGroup
) -> Awaitable[torch.Tensor]:
    """Compressed all-to-all of sequence embeddings (cf. TorchRec's ``alltoall_sequence``).

    Args:
        local_embs: ``[num_ids, D]`` lookup output of the local shards, feature-major.
        info: Row counts, layout and comms state.
        group: Process group.

    Returns:
        Awaitable of ``[num_ids_local, D]``: every owner's rows for this rank's batch, owners in
        rank order, each owner's features in order (TorchRec's layout).
    """
    if group.size() <= 1:
        return NoWait(local_embs)
    if info.pooled.dtype != local_embs.dtype:  # the call's dtype is its input's
        info = dataclasses.replace(
            info, pooled=dataclasses.replace(info.pooled, dtype=local_embs.dtype)
        )
    myreq = LossyRequest(group, device=local_embs.device)
    LossyAll2AllReq.apply(group, myreq, SequenceSteps(info), local_embs)
    return myreq


class LossySequenceEmbeddingsAllToAll(nn.Module):
    """Compressed counterpart of TorchRec's ``SequenceEmbeddingsAllToAll`` (TW and CW).

    Args:
        pg: Process group of the all-to-all.
        layout: Per rank of ``pg``, its table shards in feature order (``pooled_layout``).
        comms: Shared config, bound provider, telemetry and hooks of the sharded module.
        ledger: The sharded module's call ledger.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        layout: Sequence[Sequence[BlockSpec]],
        comms: LossyComms,
        ledger: CallLedger,
    ) -> None:
        super().__init__()
        dims = {s.dim for specs in layout for s in specs}
        if len(dims) > 1:
            raise ValueError(
                f"sequence embeddings of one sharding have one dim, got {sorted(dims)}"
            )
        self._pg = pg
        self._layout = [tuple(specs) for specs in layout]
        self._dim = dims.pop() if dims else 0
        self._comms = comms
        self._ledger = ledger
        self._compress = comms.compress_flags([s.table for specs in layout for s in specs])
        self._same_host, intra_raw = peer_links(pg, comms.config)
        self._raw_peers = self._same_host if intra_raw else frozenset()
        self._casts = cast_tables(comms.config, self._compress)
        self._plans = layout_plans(
            self._layout, self._compress, pg.rank(), self._raw_peers, self._casts
        )
        # Each pair's last payload per kind of call: the one-round slots are sized by it.
        self._slots = SlotHistory(pg.size(), None if comms.config.overlap == "auto" else 0)
        if dist.get_backend(pg) == "gloo":  # CPU tensors: load the compiled host path now
            warm_up_host()

    def forward(
        self,
        local_embs: torch.Tensor,
        lengths: torch.Tensor,
        features_before_input_dist: KeyedJaggedTensor,
        batch_size_per_rank: list[int] | None = None,
        rows_per_owner: list[list[int]] | None = None,
        unbucketize_permute_tensor: torch.Tensor | None = None,
        lookup_ids: torch.Tensor | None = None,
    ) -> SequenceEmbeddingsAwaitable:
        """Sends every id's row to the rank whose batch holds it, compressed.

        Args:
            local_embs: ``[num_ids, D]`` lookup output.
            lengths: ``[local_features, B_global]`` lengths after the input dist.
            features_before_input_dist: This rank's KJT of the sharding's features, in the
                input dist's order (the rows each owner sends back follow from its lengths).
            batch_size_per_rank: Batch size of every rank; None or empty: equal split.
            rows_per_owner: Row-wise: per owner, per feature of its layout, how many of this
                rank's ids it holds (and sends back); None: each owner holds all of this rank's
                ids of its features (table- and column-wise).
            unbucketize_permute_tensor: Row-wise: TorchRec's permute from owner order back to
                this rank's id order (applied on wait); None otherwise.
            lookup_ids: The ids of ``local_embs``' rows (the looked-up KJT's values): with
                ``InputDistConfig.dedupe_outputs``, one row per distinct id travels per
                (destination, table shard); None: every row.

        Returns:
            Awaitable of ``[num_ids_local, D]``.
        """
        world = self._pg.size()
        if not batch_size_per_rank:
            batch_size_per_rank = [lengths.shape[1] // world] * world
        with profile_range("## lossy_seq_a2a rows ##"):
            per_src = [c.sum(dim=1) for c in lengths.split(list(batch_size_per_rank), dim=1)]
            feature_rows = torch.stack(per_src, dim=1).tolist() if per_src else []
            if rows_per_owner is None:
                rows_per_owner = self._rows_per_owner(features_before_input_dist.length_per_key())
        recv_rows = [
            [sum(rows[a:b]) for a, b in _spans(specs)]
            for specs, rows in zip(self._layout, rows_per_owner, strict=True)
        ]
        pooled = LossyAll2AllPooledInfo(
            batch_size_per_rank=list(batch_size_per_rank),
            layout=self._layout,
            comms=self._comms,
            ledger=self._ledger,
            compress=self._compress,
            exact_forward=self._ledger.exact_forward,
            same_host=self._same_host,
            raw_peers=self._raw_peers,
            plans=self._plans,
            casts=self._casts,
            dtype=local_embs.dtype,
            slots=self._slots,
        )
        dedupe = None
        if lookup_ids is not None and self._comms.config.input_dist.dedupe_outputs:
            dedupe = self._dedupe(
                lookup_ids, feature_rows, features_before_input_dist.values(), rows_per_owner,
                unbucketize_permute_tensor,
            )  # fmt: skip
        info = LossyAll2AllSeqInfo(pooled, feature_rows, recv_rows, self._dim, dedupe)
        return SequenceEmbeddingsAwaitable(
            tensor_awaitable=alltoall_sequence_lossy(local_embs, info, self._pg),
            unbucketize_permute_tensor=unbucketize_permute_tensor,
            embedding_dim=self._dim,
        )

    def _dedupe(
        self,
        lookup_ids: torch.Tensor,
        feature_rows: list[list[int]],
        my_ids: torch.Tensor,
        rows_per_owner: list[list[int]],
        unbucketize_permute: torch.Tensor | None,
    ) -> SequenceDedupe:
        """The call's distinct ids (:func:`.sequence_dedupe.plan_sequence_dedupe`)."""
        if unbucketize_permute is not None:  # row-wise: this rank's ids in arrival order
            recv_ids = torch.empty_like(my_ids)
            recv_ids[unbucketize_permute.to(torch.int64)] = my_ids
            my_ids = recv_ids
        spans = [_spans(specs) for specs in self._layout]
        return plan_sequence_dedupe(
            lookup_ids, feature_rows, spans[self._pg.rank()], my_ids, rows_per_owner, spans
        )

    def _rows_per_owner(self, key_rows: list[int]) -> list[list[int]]:
        """Table- and column-wise: each owner's features are the next ones of this rank's KJT
        (layout order), and it sends back all of this rank's ids of them."""
        it = iter(key_rows)
        return [[next(it) for s in specs for _ in range(s.num_features)] for specs in self._layout]


class LossyRwSequenceEmbeddingDist(
    BaseEmbeddingDist[SequenceShardingContext, torch.Tensor, torch.Tensor]
):
    """``RwSequenceEmbeddingDist`` over :class:`LossySequenceEmbeddingsAllToAll`.

    Every rank holds a row shard of every table: an owner sends each rank the rows of that
    rank's ids in its shard (TorchRec's bucketization: id ``i`` of feature ``f`` lives on rank
    ``i // block_sizes[f]``), one block per (destination, table); the receiver puts them back in
    its id order with TorchRec's unbucketize permute.

    Args:
        pg: Process group.
        specs: The table shards in feature order (the same on every rank).
        block_sizes: Rows of each feature's table per rank (TorchRec's bucket size).
        comms: Shared state of the sharded module.
        ledger: The sharded module's call ledger.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        specs: Sequence[BlockSpec],
        block_sizes: Sequence[int],
        comms: LossyComms,
        ledger: CallLedger,
    ) -> None:
        super().__init__()
        self._world = pg.size()
        self._block_sizes = list(block_sizes)
        self._dist = LossySequenceEmbeddingsAllToAll(
            pg, [tuple(specs)] * self._world, comms, ledger
        )

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: SequenceShardingContext | None = None
    ) -> Awaitable[torch.Tensor]:
        """Compressed all-to-all of the row-wise sequence embeddings.

        Args:
            local_embs: ``[num_ids, D]`` lookup output (this rank's rows of every source's ids).
            sharding_ctx: Context of the input dist (lengths, this rank's features, permute).

        Returns:
            Awaitable of the sequence embeddings of this rank's batch, in its id order.
        """
        assert sharding_ctx is not None and not sharding_ctx.variable_batch_per_feature
        features = sharding_ctx.features_before_input_dist
        assert sharding_ctx.lengths_after_input_dist is not None and features is not None
        with profile_range("## lossy_seq_a2a rows ##"):
            owners = [
                torch.bincount(features[key].values() // block, minlength=self._world)
                for key, block in zip(features.keys(), self._block_sizes, strict=True)
            ]
            rows_per_owner = torch.stack(owners, dim=1).tolist() if owners else []
        return self._dist(
            local_embs,
            sharding_ctx.lengths_after_input_dist,
            features,
            sharding_ctx.batch_size_per_rank,
            rows_per_owner=rows_per_owner or [[] for _ in range(self._world)],
            unbucketize_permute_tensor=sharding_ctx.unbucketize_permute_tensor,
            lookup_ids=lookup_ids_of(sharding_ctx),
        )


class LossyTwSequenceEmbeddingDist(
    BaseEmbeddingDist[SequenceShardingContext, torch.Tensor, torch.Tensor]
):
    """``TwSequenceEmbeddingDist`` (also CW's) over :class:`LossySequenceEmbeddingsAllToAll`.

    Args:
        pg: Process group.
        layout: Per rank, its table shards in feature order.
        comms: Shared state of the sharded module.
        ledger: The sharded module's call ledger.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        layout: Sequence[Sequence[BlockSpec]],
        comms: LossyComms,
        ledger: CallLedger,
    ) -> None:
        super().__init__()
        self._dist = LossySequenceEmbeddingsAllToAll(pg, layout, comms, ledger)

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: SequenceShardingContext | None = None
    ) -> Awaitable[torch.Tensor]:
        """Compressed all-to-all of the sequence embeddings (see TwSequenceEmbeddingDist).

        Args:
            local_embs: ``[num_ids, D]`` lookup output.
            sharding_ctx: Context of the input dist.

        Returns:
            Awaitable of the sequence embeddings of this rank's batch.

        Raises:
            NotImplementedError: For variable batch size per feature (VBE) inputs.
        """
        assert sharding_ctx is not None
        if sharding_ctx.variable_batch_per_feature:
            raise NotImplementedError(
                "the lossy EmbeddingCollection sharder does not support variable batch size per "
                "feature (VBE): shard this module with TorchRec's EmbeddingCollectionSharder"
            )
        assert sharding_ctx.lengths_after_input_dist is not None
        assert sharding_ctx.features_before_input_dist is not None
        return self._dist(
            local_embs,
            sharding_ctx.lengths_after_input_dist,
            sharding_ctx.features_before_input_dist,
            sharding_ctx.batch_size_per_rank,
            lookup_ids=lookup_ids_of(sharding_ctx),
        )
