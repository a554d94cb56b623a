"""Table-row-wise and grid shardings whose cross-host all-to-all is compressed.

The intra-host reduce-scatter (fast link, sums on the wire) stays TorchRec's; the cross-host
all-to-all is the lossy pooled one, one block per (destination host, table), so each value
crosses hosts once and is within its table's bound. VBE on TWRW takes the same path; TorchRec's
grid has no VBE path, so a VBE batch on grid tables is refused. The input dist stays TorchRec's.
docs/sharder.md, "Table-row-wise and grid".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, EmbeddingShardingContext
from torchrec.distributed.sharding.grid_sharding import (
    GridPooledEmbeddingDist,
    GridPooledEmbeddingSharding,
)
from torchrec.distributed.sharding.twrw_sharding import (
    TwRwPooledEmbeddingDist,
    TwRwPooledEmbeddingSharding,
)
from torchrec.distributed.types import Awaitable

from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.output_dist import (
    LossyPooledEmbeddingsAllToAll,
    LossyVariableBatchAllToAll,
    pooled_layout,
)
from torchrec_lossy.distributed.pooled_blocks import BlockSpec
from torchrec_lossy.distributed.sharding_base import LossyShardingMixin
from torchrec_lossy.distributed.torchrec_adapter import (
    TwoHopDist,
    cross_host_callbacks,
    cross_host_group,
    install_cross_host_dists,
)


class LossyCrossHostDistMixin:
    """Puts the lossy pooled all-to-all where TorchRec's two-hop dist keeps its cross-host one.

    TorchRec's ``TwRwPooledEmbeddingDist`` and ``GridPooledEmbeddingDist`` create their
    collectives lazily in their first ``forward`` and call the cross-host one as a
    ``PooledEmbeddingsAllToAll``; no public hook replaces it, so :meth:`forward` has
    :mod:`.torchrec_adapter` (the one module that touches TorchRec's private attributes) create
    them and swap the cross-host one before TorchRec's ``forward`` runs
    (``tests/distributed/test_torchrec_adapter.py`` fails when TorchRec changes that).

    Args:
        layout: Per host (rank of the cross-host group), its table shards in column order.
        comms: Shared state of the sharded module.
        ledger: The sharded module's call ledger.
        **kwargs: The TorchRec dist's arguments.
    """

    def __init__(
        self,
        layout: Sequence[Sequence[BlockSpec]],
        comms: LossyComms,
        ledger: CallLedger,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[call-arg]
        self._lossy_layout = [tuple(specs) for specs in layout]
        self._lossy_comms = comms
        self._lossy_ledger = ledger
        got = [sum(s.width for s in specs) for specs in self._lossy_layout]
        if got != list(kwargs["dim_sum_per_node"]):
            raise ValueError(
                f"layout widths {got} differ from dim_sum_per_node {kwargs['dim_sum_per_node']}"
            )

    def _lossy_cross_dist(self) -> LossyPooledEmbeddingsAllToAll:
        """The compressed cross-host all-to-all, built from the dist's own group and device."""
        two_hop = cast(TwoHopDist, self)
        cross_pg, device = cross_host_group(two_hop)
        return LossyPooledEmbeddingsAllToAll(
            cross_pg,
            self._lossy_layout,
            self._lossy_comms,
            self._lossy_ledger,
            device,
            callbacks=cross_host_callbacks(two_hop),
        )

    def forward(
        self,
        local_embs: torch.Tensor,
        sharding_ctx: EmbeddingShardingContext | None = None,
    ) -> Awaitable[torch.Tensor]:
        """TorchRec's two hops, the cross-host one compressed.

        Args:
            local_embs: Pooled embeddings of the local shards.
            sharding_ctx: Context of the input dist.

        Returns:
            Awaitable of the pooled embeddings.
        """
        install_cross_host_dists(
            cast(TwoHopDist, self), sharding_ctx, self._lossy_cross_dist, LossyVariableBatchAllToAll
        )
        return super().forward(local_embs, sharding_ctx)  # type: ignore[misc]


class LossyTwRwPooledEmbeddingDist(LossyCrossHostDistMixin, TwRwPooledEmbeddingDist):
    """``TwRwPooledEmbeddingDist`` with the cross-host all-to-all compressed."""


class LossyGridPooledEmbeddingDist(LossyCrossHostDistMixin, GridPooledEmbeddingDist):
    """``GridPooledEmbeddingDist`` with the cross-host all-to-all compressed."""

    def forward(
        self,
        local_embs: torch.Tensor,
        sharding_ctx: EmbeddingShardingContext | None = None,
    ) -> Awaitable[torch.Tensor]:
        """TorchRec's two hops, the cross-host one compressed; VBE batches are refused.

        Args:
            local_embs: Pooled embeddings of the local shards.
            sharding_ctx: Context of the input dist.

        Returns:
            Awaitable of the pooled embeddings.

        Raises:
            NotImplementedError: For a variable-batch-per-feature (VBE) batch.
        """
        if sharding_ctx is not None and sharding_ctx.variable_batch_per_feature:
            tables = sorted({s.table for specs in self._lossy_layout for s in specs})
            raise NotImplementedError(
                f"grid-sharded tables {', '.join(tables)}: TorchRec's grid sharding has no "
                "variable-batch-per-feature (VBE) path (its GridPooledEmbeddingDist sends a "
                "VBE batch as a fixed batch); shard these tables table-row-wise or row-wise, "
                "or feed them fixed-batch KJTs"
            )
        return super().forward(local_embs, sharding_ctx)


class LossyTwRwPooledEmbeddingSharding(LossyShardingMixin, TwRwPooledEmbeddingSharding):
    """Table-row-wise sharding with the cross-host all-to-all compressed (constructor:
    ``LossyShardingMixin``)."""

    def create_output_dist(
        self, device: torch.device | None = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        return LossyTwRwPooledEmbeddingDist(**_cross_host_kwargs(self, device))


class LossyGridPooledEmbeddingSharding(LossyShardingMixin, GridPooledEmbeddingSharding):
    """Grid sharding (column shards, each table-row-wise) with the cross-host all-to-all
    compressed (constructor: ``LossyShardingMixin``)."""

    def create_output_dist(
        self, device: torch.device | None = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        base = super().create_output_dist(device)  # for the column permute it attaches
        assert isinstance(base, GridPooledEmbeddingDist)
        kwargs = _cross_host_kwargs(self, device)
        return LossyGridPooledEmbeddingDist(callbacks=cross_host_callbacks(base), **kwargs)


def _cross_host_kwargs(
    sharding: LossyTwRwPooledEmbeddingSharding | LossyGridPooledEmbeddingSharding,
    device: torch.device | None,
) -> dict[str, Any]:
    """The arguments TorchRec passes its two-hop dist, plus the lossy layout and state."""
    return {
        "layout": pooled_layout(sharding._grouped_embedding_configs_per_node),
        "comms": sharding._lossy_comms,
        "ledger": sharding._lossy_ledger,
        "rank": sharding._rank,
        "cross_pg": sharding._cross_pg,
        "intra_pg": sharding._intra_pg,
        "dim_sum_per_node": sharding._dim_sum_per_node(),
        "emb_dim_per_node_per_feature": sharding._emb_dim_per_node_per_feature(),
        "device": device if device is not None else sharding._device,
        "qcomm_codecs_registry": sharding.qcomm_codecs_registry,
    }
