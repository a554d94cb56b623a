"""Compressed pooled-embedding output dist for table-wise, column-wise and table-column-wise shards.

:class:`LossyPooledEmbeddingsAllToAll` is the drop-in for TorchRec's ``PooledEmbeddingsAllToAll``
(same call, same result shape), and :class:`LossyTwPooledEmbeddingDist` is a
``TwPooledEmbeddingDist`` that creates it instead of TorchRec's. Variable batch per feature
(VBE) batches are compressed too (:meth:`LossyPooledEmbeddingsAllToAll.forward_variable_batch`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import PooledEmbeddingsAwaitable
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable, QuantizedCommCodecs

from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.cast_blocks import cast_tables
from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy
from torchrec_lossy.distributed.comms import LossyComms, WireChoice
from torchrec_lossy.distributed.context import LossyShardingContext
from torchrec_lossy.distributed.dedupe import OutputDedupe
from torchrec_lossy.distributed.exchange_slots import SlotHistory
from torchrec_lossy.distributed.pooled_blocks import (
    BlockSpec,
    LayoutPlans,
    LossyAll2AllPooledInfo,
    layout_plans,
)
from torchrec_lossy.distributed.pooled_payload import warm_up_host
from torchrec_lossy.distributed.topology import peer_links
from torchrec_lossy.distributed.vbe import pad_vbe_input, unpad_vbe_output, vbe_rows_per_rank


def pooled_layout(
    grouped_configs_per_rank: Sequence[Sequence[GroupedEmbeddingConfig]],
) -> list[tuple[BlockSpec, ...]]:
    """Table shards of every rank in the column order of its lookup output.

    The order is the one TorchRec's lookups and ``_dim_sum_per_rank`` use: grouped configs in
    order, their tables in order, each table's features consecutively.

    Args:
        grouped_configs_per_rank: A sharding's ``_grouped_embedding_configs_per_rank``.

    Returns:
        Per rank, its block specs.
    """
    layout = []
    for grouped_configs in grouped_configs_per_rank:
        specs = []
        col = 0
        for table in itertools.chain.from_iterable(g.embedding_tables for g in grouped_configs):
            spec = BlockSpec(table.name, col, table.num_features(), table.local_cols)
            specs.append(spec)
            col += spec.width
        layout.append(tuple(specs))
    return layout


class LossyPooledEmbeddingsAllToAll(nn.Module):
    """Compressed counterpart of TorchRec's ``PooledEmbeddingsAllToAll``.

    Args:
        pg: Process group of the all-to-all.
        layout: Per rank of ``pg``, its table shards (see :func:`pooled_layout`).
        comms: Shared config, bound provider, telemetry and hooks of the sharded module.
        ledger: The sharded module's call ledger (each call's record is drawn from it, and the
            exact forward of an evaluation read from it).
        device: Device of the embeddings (unused: buffers follow the input).
        callbacks: Functions applied to the result on wait (e.g. column-wise permutes).

    Example::

        a2a = LossyPooledEmbeddingsAllToAll(pg, layout, comms, CallLedger())
        out = a2a(local_embs, batch_size_per_rank=[4, 4]).wait()  # [4, D_global_sum]
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        layout: Sequence[Sequence[BlockSpec]],
        comms: LossyComms,
        ledger: CallLedger,
        device: torch.device | None = None,
        callbacks: list[Callable[[torch.Tensor], torch.Tensor]] | None = None,
    ) -> None:
        super().__init__()
        if len(layout) != pg.size():
            raise ValueError(f"layout has {len(layout)} ranks, the process group {pg.size()}")
        self._pg = pg
        self._layout = [tuple(specs) for specs in layout]
        self._comms = comms
        self._ledger = ledger
        self._compress = comms.compress_flags([s.table for specs in layout for s in specs])
        self._same_host, intra_raw = peer_links(pg, comms.config)
        self._raw_peers = self._same_host if intra_raw else frozenset()
        self._casts = cast_tables(comms.config, self._compress)
        self._plans = layout_plans(
            self._layout, self._compress, pg.rank(), self._raw_peers, self._casts
        )
        # The flags, encode plans and cast tables of each format decision the run's re-check
        # has made (LossyComms.wire), planned once per decision: a pure function of it and the
        # layout. The config's decision casts its cast tables; a re-check's sends them raw.
        self._wired: dict[
            WireChoice, tuple[dict[str, bool], LayoutPlans, dict[str, torch.dtype]]
        ] = {WireChoice(): (self._compress, self._plans, self._casts)}
        # Each pair's last payload per kind of call: the one-round slots are sized by it.
        self._slots = SlotHistory(pg.size(), None if comms.config.overlap == "auto" else 0)
        self._callbacks: list[Callable[[torch.Tensor], torch.Tensor]] = list(callbacks or [])
        if dist.get_backend(pg) == "gloo":  # CPU tensors: the compiled host path, load it now
            warm_up_host()

    def forward(
        self,
        local_embs: torch.Tensor,
        batch_size_per_rank: list[int] | None = None,
        output_dedupe: OutputDedupe | None = None,
    ) -> PooledEmbeddingsAwaitable:
        """Sends each rank its rows of the local pooled embeddings, compressed.

        Args:
            local_embs: ``[B_global, D_local_sum]`` pooled embeddings of the local shards.
            batch_size_per_rank: Batch size of every rank; None or empty: equal split.
            output_dedupe: The batch's cross-side dedupe state (from the packed input dist,
                see :class:`~torchrec_lossy.distributed.context.LossyShardingContext`); None:
                every row travels.

        Returns:
            Awaitable of ``[B_local, D_global_sum]``.
        """
        world = self._pg.size()
        if not batch_size_per_rank:
            b_global = local_embs.size(0)
            if b_global % world != 0:
                raise ValueError(
                    f"global batch size {b_global} is not divisible by the {world} ranks; pass "
                    "batch_size_per_rank for uneven batches"
                )
            batch_size_per_rank = [b_global // world] * world
        info = self._info(batch_size_per_rank, local_embs.dtype, output_dedupe)
        awaitable = PooledEmbeddingsAwaitable(
            tensor_awaitable=alltoall_pooled_lossy(local_embs, info, self._pg)
        )
        awaitable.callbacks.extend(self._callbacks)
        return awaitable

    def forward_variable_batch(
        self,
        local_embs: torch.Tensor,
        batch_size_per_rank_per_feature: list[list[int]],
        batch_size_per_feature_pre_a2a: list[int],
    ) -> PooledEmbeddingsAwaitable:
        """The VBE all-to-all, compressed (TorchRec's: ``VariableBatchPooledEmbeddingsAllToAll``).

        Each (destination, table) block holds the destination's bags of the table's features
        (module :mod:`~torchrec_lossy.distributed.vbe`); no callbacks run (TorchRec permutes VBE
        outputs itself).

        Args:
            local_embs: Flat pooled embeddings: per destination, per local feature, its bags.
            batch_size_per_rank_per_feature: Per destination rank, per local feature, its batch.
            batch_size_per_feature_pre_a2a: This rank's batch of every feature (column order).

        Returns:
            Awaitable of TorchRec's flat VBE output: per feature in order, this rank's bags.
        """
        dims = [[s.dim for s in specs for _ in range(s.num_features)] for specs in self._layout]
        rows = vbe_rows_per_rank(self._pg, batch_size_per_feature_pre_a2a, local_embs.device)
        me = self._pg.rank()
        # TorchRec leaves the per-feature batches empty on a rank without local features.
        batches = batch_size_per_rank_per_feature or [[] for _ in rows]
        padded = pad_vbe_input(local_embs, batches, dims[me], rows)
        info = self._info(rows, local_embs.dtype, None)
        awaitable = PooledEmbeddingsAwaitable(
            tensor_awaitable=alltoall_pooled_lossy(padded, info, self._pg)
        )
        all_dims = [d for per_rank in dims for d in per_rank]
        awaitable.callbacks.append(
            functools.partial(
                unpad_vbe_output,
                batch_size_per_feature_pre_a2a=batch_size_per_feature_pre_a2a,
                dims=all_dims,
            )
        )
        return awaitable

    def _info(
        self,
        batch_size_per_rank: list[int],
        dtype: torch.dtype,
        output_dedupe: OutputDedupe | None,
    ) -> LossyAll2AllPooledInfo:
        """Per-call parameters of :func:`alltoall_pooled_lossy` for this all-to-all."""
        compress, plans, casts = self._wire_plans(self._comms.wire)
        return LossyAll2AllPooledInfo(
            batch_size_per_rank=list(batch_size_per_rank),
            layout=self._layout,
            comms=self._comms,
            ledger=self._ledger,
            compress=compress,
            dtype=dtype,
            output_dedupe=output_dedupe,
            exact_forward=self._ledger.exact_forward,
            same_host=self._same_host,
            raw_peers=self._raw_peers,
            plans=plans,
            slots=self._slots,
            casts=casts,
        )

    def _wire_plans(
        self, choice: WireChoice
    ) -> tuple[dict[str, bool], LayoutPlans, dict[str, torch.dtype]]:
        """The codec flags, encode plans and cast tables of the calls under ``choice``."""
        found = self._wired.get(choice)
        if found is None:
            flags = choice.flags(self._compress)
            plans = layout_plans(self._layout, flags, self._pg.rank(), self._raw_peers)
            found = self._wired[choice] = (flags, plans, {})
        return found

    @property
    def callbacks(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """Functions applied to the result on wait."""
        return self._callbacks


class LossyVariableBatchAllToAll(nn.Module):
    """TorchRec's ``VariableBatchPooledEmbeddingsAllToAll`` call, on the lossy all-to-all.

    Where a TorchRec dist holds a VBE all-to-all module of its own (the table-row-wise
    cross-host hop's ``_variable_cross_dist``), this takes its place and calls
    :meth:`LossyPooledEmbeddingsAllToAll.forward_variable_batch`.

    Args:
        a2a: The lossy all-to-all of the same process group and layout.
    """

    def __init__(self, a2a: LossyPooledEmbeddingsAllToAll) -> None:
        super().__init__()
        self._a2a = a2a

    def forward(
        self,
        local_embs: torch.Tensor,
        batch_size_per_rank_per_feature: list[list[int]],
        batch_size_per_feature_pre_a2a: list[int],
    ) -> PooledEmbeddingsAwaitable:
        """See :meth:`LossyPooledEmbeddingsAllToAll.forward_variable_batch`.

        Args:
            local_embs: Flat pooled embeddings: per destination, per local feature, its bags.
            batch_size_per_rank_per_feature: Per destination rank, per local feature, its batch.
            batch_size_per_feature_pre_a2a: This rank's batch of every feature (column order).

        Returns:
            Awaitable of TorchRec's flat VBE output.
        """
        return self._a2a.forward_variable_batch(
            local_embs, batch_size_per_rank_per_feature, batch_size_per_feature_pre_a2a
        )


class LossyTwPooledEmbeddingDist(TwPooledEmbeddingDist):
    """``TwPooledEmbeddingDist`` whose all-to-all is :class:`LossyPooledEmbeddingsAllToAll`.

    Args:
        pg: Process group of the all-to-all.
        dim_sum_per_rank: Output columns of every rank.
        emb_dim_per_rank_per_feature: Embedding dim per rank per feature.
        layout: Per rank, its table shards (see :func:`pooled_layout`).
        comms: Shared state of the sharded module.
        ledger: The sharded module's call ledger.
        device: Device of the embeddings.
        callbacks: Functions applied to the result on wait.
        qcomm_codecs_registry: Kept for TorchRec's bookkeeping; the lossy dist replaces its
            pooled all-to-all codec.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        dim_sum_per_rank: list[int],
        emb_dim_per_rank_per_feature: list[list[int]],
        layout: Sequence[Sequence[BlockSpec]],
        comms: LossyComms,
        ledger: CallLedger,
        device: torch.device | None = None,
        callbacks: list[Callable[[torch.Tensor], torch.Tensor]] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(
            pg=pg,
            dim_sum_per_rank=dim_sum_per_rank,
            emb_dim_per_rank_per_feature=emb_dim_per_rank_per_feature,
            device=device,
            callbacks=callbacks,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )
        got = [sum(s.width for s in specs) for specs in layout]
        if got != list(dim_sum_per_rank):
            raise ValueError(f"layout widths {got} differ from dim_sum_per_rank {dim_sum_per_rank}")
        self._layout = [tuple(specs) for specs in layout]
        self._comms = comms
        self._ledger = ledger
        # Ours, not TorchRec's ``_dist`` (which stays None: this forward replaces the one that
        # reads it); created on first use, as TorchRec's, so callbacks added until then apply.
        self._lossy_a2a: LossyPooledEmbeddingsAllToAll | None = None

    def forward(
        self,
        local_embs: torch.Tensor,
        sharding_ctx: EmbeddingShardingContext | None = None,
    ) -> Awaitable[torch.Tensor]:
        """Compressed all-to-all of the pooled embeddings (see TwPooledEmbeddingDist.forward).

        Args:
            local_embs: ``[B_global, D_local_sum]`` pooled embeddings.
            sharding_ctx: Context of the input dist: batch size per rank, and the output dedupe
                state where it is a ``context.LossyShardingContext``.

        Returns:
            Awaitable of ``[B_local, D_global_sum]``; for VBE batches, TorchRec's flat VBE output.
        """
        if self._lossy_a2a is None:
            self._lossy_a2a = LossyPooledEmbeddingsAllToAll(
                pg=self._pg,
                layout=self._layout,
                comms=self._comms,
                ledger=self._ledger,
                device=self._device,
                callbacks=self._callbacks,
            )
        a2a = self._lossy_a2a
        if sharding_ctx is not None and sharding_ctx.variable_batch_per_feature:
            return a2a.forward_variable_batch(
                local_embs,
                sharding_ctx.batch_size_per_rank_per_feature,
                sharding_ctx.batch_size_per_feature_pre_a2a,
            )
        if sharding_ctx is None:
            return a2a(local_embs)
        dedupe = (
            sharding_ctx.output_dedupe if isinstance(sharding_ctx, LossyShardingContext) else None
        )
        return a2a(
            local_embs,
            batch_size_per_rank=sharding_ctx.batch_size_per_rank,
            output_dedupe=dedupe,
        )
