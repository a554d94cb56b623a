"""The drop-in ``EmbeddingCollectionSharder`` with a compressed sequence-embedding all-to-all.

A model with both module types takes both sharders (this one and the EBC's); usage:
docs/sharder.md, "EmbeddingCollection (sequence features)".
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torchrec.distributed.embedding import (
    EmbeddingCollectionContext,
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import (
    LazyAwaitable,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from torchrec.sparse.jagged_tensor import JaggedTensor

from torchrec_lossy.config import LossyCommsConfig
from torchrec_lossy.distributed.comms import BoundProviderFactory, StaticBounds
from torchrec_lossy.distributed.context import DistributedKJT, bind_lookup_ids
from torchrec_lossy.distributed.sequence_sharding import (
    LOSSY_SEQUENCE_SHARDING_TYPES,
    SequenceSharding,
)
from torchrec_lossy.distributed.sharder import (
    LossyCommsModule,
    LossySharderMixin,
)

logger: logging.Logger = logging.getLogger(__name__)


class LossyShardedEmbeddingCollection(LossyCommsModule, ShardedEmbeddingCollection):
    """``ShardedEmbeddingCollection`` whose TW/CW sequence all-to-alls are compressed.

    Args:
        module: The unsharded EmbeddingCollection.
        table_name_to_parameter_sharding: Plan of its tables.
        env: Sharding environment.
        fused_params: Fused optimizer and kernel parameters (as TorchRec).
        device: Device of the shards.
        qcomm_codecs_registry: TorchRec qcomm codecs (they apply where no lossy dist does).
        module_fqn: Fully qualified name of the module in the model.
        comms_config: Bounds, codec knobs and backward codec; None: ``LossyCommsConfig()``.
        bounds_factory: Builds the bound provider as ``bounds_factory(table_names, config)``.

    Attributes:
        lossy_bounds: The bound provider (a registered submodule, so in ``state_dict``).
    """

    @staticmethod
    def lossy_table_names(module: nn.Module) -> list[str]:
        """The EmbeddingCollection's table names (see the base's)."""
        return [c.name for c in module.embedding_configs()]  # type: ignore[operator]

    def compute_and_output_dist(
        self, ctx: EmbeddingCollectionContext, input: KJTList
    ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        """TorchRec's lookup and output dist, with this module's mode handed to its dists
        (an exact forward in evaluation unless ``LossyCommsConfig.evaluation`` is "lossy") and
        each sharding's lookup ids put in its context (for the row dedupe).

        The batch size of every rank, which TorchRec's own KJT all-to-all writes into each
        sharding context, comes with the features the packed input dist decoded: it is put
        into the context here (ranks with different batch sizes, and VBE batches, which
        TorchRec's EC pads to each rank's largest batch).

        Args:
            ctx: The module's context of this batch.
            input: Per sharding, the local features.

        Returns:
            As ``ShardedEmbeddingCollection.compute_and_output_dist``.
        """
        for kjt, sharding_ctx in zip(input, ctx.sharding_contexts, strict=False):
            if isinstance(kjt, DistributedKJT) and kjt.dist_state is not None:
                sharding_ctx.batch_size_per_rank = list(kjt.dist_state.batch_size_per_rank)
        self.hand_mode_to_dists()
        bind_lookup_ids(ctx.sharding_contexts, input)
        return super().compute_and_output_dist(ctx, input)

    def compute(self, ctx: EmbeddingCollectionContext, dist_input: KJTList) -> list[torch.Tensor]:
        """TorchRec's lookups, with each sharding's lookup ids put in its context (for the
        row dedupe of a later ``output_dist``).

        Args:
            ctx: The module's context of this batch.
            dist_input: Per sharding, the local features.

        Returns:
            As ``ShardedEmbeddingCollection.compute``.
        """
        self.hand_mode_to_dists()
        bind_lookup_ids(ctx.sharding_contexts, dist_input)
        return super().compute(ctx, dist_input)

    def create_embedding_sharding(  # type: ignore[override]
        self,
        sharding_type: str,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> SequenceSharding:
        """TorchRec's factory (a classmethod there), made per instance to pass the shared state.

        Args:
            sharding_type: The sharding type.
            sharding_infos: Its tables.
            env: Sharding environment.
            device: Device of the lookups.
            qcomm_codecs_registry: TorchRec qcomm codecs.

        Returns:
            The sharding: compressed for TW/CW/RW (``LOSSY_SEQUENCE_SHARDING_TYPES``),
            TorchRec's for the others (data-parallel sends no embeddings; any other type is
            logged as not compressed).
        """
        cls = LOSSY_SEQUENCE_SHARDING_TYPES.get(sharding_type)
        if cls is not None:
            return cls(
                sharding_infos, env, self._lossy_comms, self._lossy_ledger, device,
                qcomm_codecs_registry=qcomm_codecs_registry,
            )  # fmt: skip
        if sharding_type != ShardingType.DATA_PARALLEL.value:  # DP sends no embeddings at all
            for info in sharding_infos:
                logger.warning(
                    "EmbeddingCollection table %r is %s-sharded: the lossy sharder compresses "
                    "table-, column- and row-wise sequence shardings, so it is sharded by "
                    "TorchRec's own %s sharding, NOT lossy-compressed",
                    info.embedding_config.name,
                    sharding_type,
                    sharding_type,
                )
        return ShardedEmbeddingCollection.create_embedding_sharding(
            sharding_type, sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry
        )


class LossyEmbeddingCollectionSharder(LossySharderMixin, EmbeddingCollectionSharder):
    """Drop-in for ``EmbeddingCollectionSharder`` that compresses the sequence all-to-all.

    Pass it next to :class:`LossyEmbeddingBagCollectionSharder` wherever TorchRec's sharders go
    (one sharder per module type). TorchRec's ``use_index_dedup`` is not offered: the
    sequence all-to-all's exact row dedupe (``InputDistConfig.dedupe_outputs``, on by default)
    sends one row per distinct id per (destination, table) instead, with no index on the wire.

    Args:
        fused_params: As TorchRec.
        qcomm_codecs_registry: As TorchRec; used where no lossy path applies (RW sharding).
        comms_config: Bounds, codec knobs, backward codec; None: ``LossyCommsConfig()``.
        bounds_factory: Builds each sharded module's bound provider as
            ``bounds_factory(table_names, config)``; default :class:`StaticBounds`.
    """

    def __init__(
        self,
        fused_params: dict[str, object] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        comms_config: LossyCommsConfig | None = None,
        bounds_factory: BoundProviderFactory = StaticBounds,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._init_lossy(comms_config, bounds_factory)

    @property
    def sharded_module_type(self) -> type[LossyShardedEmbeddingCollection]:
        """The sharded module class."""
        return LossyShardedEmbeddingCollection
