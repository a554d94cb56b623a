"""Table-wise, column-wise and table-column-wise shardings whose output dist is compressed.

Each class is TorchRec's sharding with ``create_output_dist`` overridden and
``create_input_dist`` the packed KJT all-to-all (:mod:`.input_dist`); lookups are TorchRec's.
:func:`create_lossy_embedding_bag_sharding` picks the class per sharding type (RW:
:mod:`.rw_sharding`; TWRW, grid: :mod:`.twrw_sharding`; DP stays TorchRec's).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingSharding,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embeddingbag import (
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import (
    BaseTwEmbeddingSharding,
    TwPooledEmbeddingDist,
    TwPooledEmbeddingSharding,
    TwSparseFeaturesDist,
)
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.dedupe import OutputDedupeMode
from torchrec_lossy.distributed.input_dist import LossyTwSparseFeaturesDist
from torchrec_lossy.distributed.output_dist import LossyTwPooledEmbeddingDist, pooled_layout
from torchrec_lossy.distributed.rw_sharding import LossyRwPooledEmbeddingSharding
from torchrec_lossy.distributed.sharding_base import LossyShardingMixin
from torchrec_lossy.distributed.twrw_sharding import (
    LossyGridPooledEmbeddingSharding,
    LossyTwRwPooledEmbeddingSharding,
)

logger: logging.Logger = logging.getLogger(__name__)

PooledSharding = EmbeddingSharding[
    EmbeddingShardingContext, KeyedJaggedTensor, torch.Tensor, torch.Tensor
]


class _LossyOutputDistMixin(
    LossyShardingMixin,
    BaseTwEmbeddingSharding[
        EmbeddingShardingContext, KeyedJaggedTensor, torch.Tensor, torch.Tensor
    ],
):
    """Replaces a TW/CW/TWCW sharding's output dist by the compressed one.

    Mixed in before TorchRec's sharding class, whose ``create_output_dist`` still runs first, so
    that whatever it attaches (the column-wise permute callback) is reused, not re-derived.
    """

    def create_input_dist(
        self, device: torch.device | None = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        # The KJT all-to-all is packed losslessly (input_dist.py) unless switched off.
        base = super().create_input_dist(device)
        if not self._lossy_comms.config.input_dist.enabled or not isinstance(
            base, TwSparseFeaturesDist
        ):
            return base
        assert self._pg is not None
        return LossyTwSparseFeaturesDist(
            self._pg,
            self.features_per_rank(),
            self._lossy_comms,
            output_dedupe=self._output_dedupe_mode(),
        )

    def _output_dedupe_mode(self) -> OutputDedupeMode:
        """The cross-side dedupe mode from the config (lookup, exact or off), if it applies.

        It needs the KJT keys of each rank in its lookup-output column order (the output dist
        maps features to column groups by position).
        """
        config = self._lossy_comms.config.input_dist
        mode: OutputDedupeMode = (
            "lookup" if config.dedupe_lookups else "exact" if config.dedupe_outputs else None
        )
        if mode is None:
            return None
        lookup_order = [
            [f for g in groups for t in g.embedding_tables for f in t.feature_names]
            for groups in self._grouped_embedding_configs_per_rank
        ]
        if lookup_order != self.feature_names_per_rank():
            logger.warning("lookup feature order differs from the input dist's: no output dedupe")
            return None
        return mode

    def create_output_dist(
        self, device: torch.device | None = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        base = super().create_output_dist(device)
        if not isinstance(base, TwPooledEmbeddingDist):
            raise TypeError(
                f"{type(self).__name__}: expected TorchRec to build a TwPooledEmbeddingDist, got "
                f"{type(base).__name__}; this torchrec version is not supported"
            )
        assert self._pg is not None
        return LossyTwPooledEmbeddingDist(
            pg=self._pg,
            dim_sum_per_rank=self._dim_sum_per_rank(),
            emb_dim_per_rank_per_feature=self._emb_dim_per_rank_per_feature(),
            layout=pooled_layout(self._grouped_embedding_configs_per_rank),
            comms=self._lossy_comms,
            ledger=self._lossy_ledger,
            device=device if device is not None else self._device,
            callbacks=base._callbacks,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
        )


class LossyTwPooledEmbeddingSharding(_LossyOutputDistMixin, TwPooledEmbeddingSharding):
    """Table-wise sharding with a compressed output dist (constructor: ``LossyShardingMixin``)."""


class LossyCwPooledEmbeddingSharding(_LossyOutputDistMixin, CwPooledEmbeddingSharding):
    """Column-wise sharding with a compressed output dist (constructor: ``LossyShardingMixin``,
    with TorchRec's ``permute_embeddings``)."""


class LossyTwCwPooledEmbeddingSharding(LossyCwPooledEmbeddingSharding, TwCwPooledEmbeddingSharding):
    """Table-column-wise sharding with a compressed output dist.

    TorchRec's TWCW sharding is its CW sharding placed within a host group; the lossy one is
    the lossy CW sharding likewise (same constructor arguments).
    """


# Sharding types whose pooled output the lossy codec carries (row-wise: by all-to-all and sum;
# table-row-wise and grid: their cross-host all-to-all).
LOSSY_SHARDING_TYPES: dict[str, type] = {
    ShardingType.TABLE_WISE.value: LossyTwPooledEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: LossyCwPooledEmbeddingSharding,
    ShardingType.TABLE_COLUMN_WISE.value: LossyTwCwPooledEmbeddingSharding,
    ShardingType.ROW_WISE.value: LossyRwPooledEmbeddingSharding,
    ShardingType.TABLE_ROW_WISE.value: LossyTwRwPooledEmbeddingSharding,
    ShardingType.GRID_SHARD.value: LossyGridPooledEmbeddingSharding,
}


def create_lossy_embedding_bag_sharding(
    sharding_infos: list[EmbeddingShardingInfo],
    env: ShardingEnv,
    comms: LossyComms,
    ledger: CallLedger,
    device: torch.device | None = None,
    permute_embeddings: bool = False,
    qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
) -> PooledSharding:
    """The sharding for one sharding type: compressed for TW/CW/TWCW/RW/TWRW/grid, TorchRec's
    otherwise (data-parallel).

    Args:
        sharding_infos: Tables of one sharding type.
        env: Sharding environment.
        comms: Shared state of the sharded module.
        ledger: The sharded module's call ledger.
        device: Device of the lookups.
        permute_embeddings: Column-wise: reorder column shards after the all-to-all.
        qcomm_codecs_registry: TorchRec qcomm codecs.

    Returns:
        The sharding.
    """
    sharding_type = sharding_infos[0].param_sharding.sharding_type
    cls = LOSSY_SHARDING_TYPES.get(sharding_type)
    if cls is None:
        return ShardedEmbeddingBagCollection.create_embedding_bag_sharding(
            sharding_infos,
            env,
            device,
            permute_embeddings=permute_embeddings,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )
    if device is not None and device.type == "meta":
        replace_placement_with_meta_device(sharding_infos)
    kwargs: dict[str, Any] = {"qcomm_codecs_registry": qcomm_codecs_registry}
    if issubclass(cls, LossyCwPooledEmbeddingSharding):
        kwargs["permute_embeddings"] = permute_embeddings
    return cls(sharding_infos, env, comms, ledger, device, **kwargs)
