"""The drop-in ``EmbeddingCollectionSharder`` with a compressed sequence-embedding all-to-all.

Example::

    ebc_sharder = LossyEmbeddingBagCollectionSharder(comms_config=comms_config)
    ec_sharder = LossyEmbeddingCollectionSharder(comms_config=comms_config)
    sharders = [ebc_sharder, ec_sharder]
    plan = EmbeddingShardingPlanner(topology=topology).collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, plan=plan, sharders=sharders, device=device)
    print(lossy_stats(model)["sparse.ec"].summary())
"""

from __future__ import annotations

import torch
from torchrec.distributed.embedding import (
    EmbeddingCollectionContext,
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import (
    LazyAwaitable,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor

from torchrec_lossy.config import LossyCommsConfig
from torchrec_lossy.distributed.comms import BoundProviderFactory, StaticBounds
from torchrec_lossy.distributed.context import DistributedKJT, bind_lookup_ids
from torchrec_lossy.distributed.sequence_sharding import (
    SequenceSharding,
    create_lossy_sequence_sharding,
)
from torchrec_lossy.distributed.sharder import (
    LossyCommsModule,
    LossySharderMixin,
    lossy_comms_of,
)


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

    def __init__(
        self,
        module: EmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, object] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
        comms_config: LossyCommsConfig | None = None,
        bounds_factory: BoundProviderFactory = StaticBounds,
    ) -> None:
        table_names = [c.name for c in module.embedding_configs()]
        # Set before the base __init__, which creates the shardings (they need it).
        self._lossy_comms = lossy_comms_of(table_names, comms_config, bounds_factory)
        super().__init__(
            module=module,
            table_name_to_parameter_sharding=table_name_to_parameter_sharding,
            env=env,
            fused_params=fused_params,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        self.lossy_bounds = self._lossy_comms.bounds  # a submodule: in state_dict

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
            The sharding: compressed for TW/CW, TorchRec's for the others.
        """
        return create_lossy_sequence_sharding(
            sharding_type, sharding_infos, env, self._lossy_comms, device, qcomm_codecs_registry
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

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> LossyShardedEmbeddingCollection:
        """Shards ``module`` like TorchRec's sharder, with compressed sequence all-to-alls.

        Args:
            module: The EmbeddingCollection.
            params: Its tables' plan.
            env: Sharding environment.
            device: Device of the shards.
            module_fqn: Its name in the model.

        Returns:
            The sharded module.
        """
        sharded = LossyShardedEmbeddingCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            comms_config=self._comms_config,
            bounds_factory=self._bounds_factory,
        )
        self._sharded[module_fqn or ""] = sharded
        return sharded

    @property
    def sharded_module_type(self) -> type[LossyShardedEmbeddingCollection]:
        """The sharded module class."""
        return LossyShardedEmbeddingCollection
