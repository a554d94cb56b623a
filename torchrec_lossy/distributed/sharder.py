"""The drop-in sharder: ``EmbeddingBagCollectionSharder`` with a compressed output all-to-all.

Same arguments as TorchRec's, plus ``comms_config`` and ``bounds_factory``; usage:
docs/sharder.md, "Before / after".
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import (
    CommOp,
    LazyAwaitable,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedTensor

from torchrec_lossy.config import LossyCommsConfig
from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.comms import (
    BoundProvider,
    BoundProviderFactory,
    LossyComms,
    StaticBounds,
)
from torchrec_lossy.distributed.config_check import check_same_config
from torchrec_lossy.distributed.context import bind_input_state
from torchrec_lossy.distributed.guard import BoundGuard
from torchrec_lossy.distributed.sharding import (
    LOSSY_SHARDING_TYPES,
    PooledSharding,
    create_lossy_embedding_bag_sharding,
)
from torchrec_lossy.distributed.stats import LossyCommsStats

logger: logging.Logger = logging.getLogger(__name__)


class LossyCommsModule:
    """What every lossy-sharded module adds to TorchRec's: its dists' shared state and telemetry.

    Mixed in before the TorchRec sharded module class: its constructor sets the shared
    configuration and telemetry (:func:`lossy_comms_of`) as ``_lossy_comms`` and the module's
    call ledger (its running per-call state, :class:`~.call_ledger.CallLedger`) as
    ``_lossy_ledger`` before TorchRec's ``__init__`` (that creates the shardings, which hand both
    to their dists) and registers the bound provider as ``lossy_bounds`` after.

    Args:
        module: The unsharded module.
        *args: TorchRec's sharded module's other positional arguments.
        comms_config: Bounds, codec knobs and backward codec; None: ``LossyCommsConfig()``.
        bounds_factory: Builds the bound provider as ``bounds_factory(table_names, config)``.
        **kwargs: TorchRec's sharded module's keyword arguments.
    """

    _lossy_comms: LossyComms
    _lossy_ledger: CallLedger
    lossy_bounds: nn.Module

    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        comms_config: LossyCommsConfig | None = None,
        bounds_factory: BoundProviderFactory = StaticBounds,
        **kwargs: Any,
    ) -> None:
        # A plain (non-Module) attribute may be set before Module.__init__.
        self._lossy_comms = lossy_comms_of(
            self.lossy_table_names(module), comms_config, bounds_factory
        )
        self._lossy_ledger = CallLedger()  # one per module, shared by its dists
        super().__init__(module, *args, **kwargs)  # type: ignore[call-arg]
        self.lossy_bounds = self._lossy_comms.bounds  # a submodule: in state_dict

    @staticmethod
    def lossy_table_names(module: nn.Module) -> list[str]:
        """The names of ``module``'s tables (their bounds' keys).

        Args:
            module: The unsharded module.

        Returns:
            Its tables' names, in config order.
        """
        raise NotImplementedError

    @property
    def lossy_stats(self) -> LossyCommsStats:
        """Telemetry of this module's compressed all-to-alls (this rank's view)."""
        return self._lossy_comms.stats

    @property
    def lossy_comms(self) -> LossyComms:
        """Config, bound provider, telemetry and hooks shared by this module's dists."""
        return self._lossy_comms

    @property
    def lossy_ledger(self) -> CallLedger:
        """The call counters, step count and unread decode statuses of this module's dists."""
        return self._lossy_ledger

    def hand_mode_to_dists(self) -> None:
        """Tells the dists whether this module is in ``eval()`` mode, before each output dist:
        TorchRec's dist modules do not follow ``model.eval()``, the sharded module does (in
        evaluation the forward travels lossless unless ``LossyCommsConfig.evaluation`` is
        ``"lossy"``)."""
        evaluating = not self.training  # type: ignore[attr-defined]
        exact = evaluating and self._lossy_comms.config.evaluation == "exact"
        self._lossy_ledger.exact_forward = exact

    def set_bound_provider(self, provider: nn.Module) -> None:
        """Replaces the bound provider (e.g. by an adaptive one) for all following batches.

        Args:
            provider: An ``nn.Module`` implementing :class:`BoundProvider`.
        """
        check_bound_provider(provider)
        self._lossy_comms.bounds = provider
        self.lossy_bounds = provider


def lossy_comms_of(
    table_names: list[str],
    comms_config: LossyCommsConfig | None,
    bounds_factory: BoundProviderFactory,
) -> LossyComms:
    """The shared state of a lossy-sharded module's dists.

    Args:
        table_names: The module's tables.
        comms_config: Its config; None: ``LossyCommsConfig()``.
        bounds_factory: Builds the bound provider as ``bounds_factory(table_names, config)``.

    Returns:
        The state, with a checked bound provider.
    """
    config = comms_config if comms_config is not None else LossyCommsConfig()
    bounds = bounds_factory(table_names, config)
    check_bound_provider(bounds)
    guard = BoundGuard(table_names, config.guard) if config.guard.enabled else None
    return LossyComms(config=config, bounds=bounds, guard=guard)


class LossyShardedEmbeddingBagCollection(LossyCommsModule, ShardedEmbeddingBagCollection):
    """``ShardedEmbeddingBagCollection`` whose TW/CW/TWCW output all-to-alls are compressed.

    Args:
        module: The unsharded EmbeddingBagCollection.
        table_name_to_parameter_sharding: Plan of its tables.
        env: Sharding environment.
        fused_params: Fused optimizer and kernel parameters (as TorchRec).
        device: Device of the shards.
        qcomm_codecs_registry: TorchRec qcomm codecs; they still apply to the input dist and to
            row-wise / table-row-wise reduce-scatters.
        module_fqn: Fully qualified name of the module in the model.
        sharded_module_order_overwrite: As TorchRec.
        comms_config: Bounds, codec knobs and backward codec; None: ``LossyCommsConfig()``.
        bounds_factory: Builds the bound provider as ``bounds_factory(table_names, config)``.

    Attributes:
        lossy_bounds: The bound provider (a registered submodule, so in ``state_dict``).
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, object] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
        sharded_module_order_overwrite: list[str] | None = None,
        comms_config: LossyCommsConfig | None = None,
        bounds_factory: BoundProviderFactory = StaticBounds,
    ) -> None:
        super().__init__(
            module=module,
            table_name_to_parameter_sharding=table_name_to_parameter_sharding,
            env=env,
            fused_params=fused_params,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=sharded_module_order_overwrite,
            comms_config=comms_config,
            bounds_factory=bounds_factory,
        )
        unused = [
            op.name
            for op, uses in (
                (CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, LOSSY_SHARDING_TYPES.keys() - {"row_wise"}),
                (CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER, {"row_wise"}),
            )
            if op.name in (qcomm_codecs_registry or {}) and uses & set(self._sharding_types)
        ]
        if unused:
            logger.warning(
                "%s: the qcomm codecs for %s are superseded where the lossy codec carries the "
                "pooled embeddings (the all-to-all of TW/CW/TWCW tables, the cross-host "
                "all-to-all of TWRW/grid tables, the reduce-scatter of RW tables; TWRW/grid keep "
                "it inside a host), with LossyCommsConfig.backward=%r for the gradient",
                module_fqn or "EmbeddingBagCollection",
                " and ".join(unused),
                self._lossy_comms.config.backward,
            )

    @staticmethod
    def lossy_table_names(module: nn.Module) -> list[str]:
        """The EmbeddingBagCollection's table names (see the base's)."""
        return [c.name for c in module.embedding_bag_configs()]  # type: ignore[operator]

    def create_embedding_bag_sharding(  # type: ignore[override]
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> PooledSharding:
        """TorchRec's factory (a classmethod there), made per instance to pass the shared state.

        Args:
            sharding_infos: Tables of one sharding type.
            env: Sharding environment.
            device: Device of the lookups.
            permute_embeddings: Column-wise: reorder column shards after the all-to-all.
            qcomm_codecs_registry: TorchRec qcomm codecs.

        Returns:
            The sharding: compressed for TW/CW/TWCW/RW, TorchRec's for the others.
        """
        return create_lossy_embedding_bag_sharding(
            sharding_infos,
            env,
            self._lossy_comms,
            self._lossy_ledger,
            device,
            permute_embeddings=permute_embeddings,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    def compute(
        self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList
    ) -> list[torch.Tensor]:
        """TorchRec's lookups, after binding each sharding's input state and the module's mode
        (see :meth:`compute_and_output_dist`; pipelines that split the lookup from the output
        dist call this, then ``output_dist``).

        Args:
            ctx: The module's context of this batch.
            dist_input: Per sharding, the local features.

        Returns:
            Per sharding, the pooled embeddings.
        """
        self._prepare_dists(ctx, dist_input)
        return super().compute(ctx, dist_input)

    def _prepare_dists(self, ctx: EmbeddingBagCollectionContext, features: KJTList) -> None:
        """Hands the output dists this batch's input state and the module's mode."""
        bind_input_state(ctx, features)
        self.hand_mode_to_dists()

    def compute_and_output_dist(
        self, ctx: EmbeddingBagCollectionContext, input: KJTList
    ) -> LazyAwaitable[KeyedTensor]:
        """TorchRec's lookup and output dist, with each sharding's input state from its data.

        The batch sizes per rank and the output dedupe state the packed input dist decoded each
        sharding's features with are put into its sharding context first
        (:func:`~torchrec_lossy.distributed.context.bind_input_state`): a train pipeline's
        re-attach can pair a batch's tensors with a fresh context. The module's mode is handed
        to its dists here, where ``model.eval()`` reaches: in evaluation the forward travels
        lossless unless ``LossyCommsConfig.evaluation`` is ``"lossy"``.

        Args:
            ctx: The module's context of this batch.
            input: Per sharding, the local features.

        Returns:
            As ``ShardedEmbeddingBagCollection.compute_and_output_dist``.
        """
        self._prepare_dists(ctx, input)
        return super().compute_and_output_dist(ctx, input)


def check_bound_provider(provider: object) -> None:
    """Raises ``TypeError`` unless ``provider`` is an ``nn.Module`` :class:`BoundProvider`.

    Args:
        provider: A bound provider.
    """
    if not isinstance(provider, nn.Module) or not isinstance(provider, BoundProvider):
        raise TypeError(
            f"bound provider {type(provider).__name__} must be an nn.Module with bound(), "
            "observe() and step() (see torchrec_lossy.distributed.BoundProvider)"
        )


class LossySharderMixin:
    """The lossy sharders' common part: the config every module gets, and a registry of the
    modules sharded in this process (for :meth:`stats`). Mixed in before TorchRec's sharder."""

    _comms_config: LossyCommsConfig
    _bounds_factory: BoundProviderFactory
    _sharded: weakref.WeakValueDictionary[str, LossyCommsModule]

    def _init_lossy(
        self, comms_config: LossyCommsConfig | None, bounds_factory: BoundProviderFactory
    ) -> None:
        self._comms_config = comms_config if comms_config is not None else LossyCommsConfig()
        self._bounds_factory = bounds_factory
        self._sharded = weakref.WeakValueDictionary()

    def __getstate__(self) -> dict[str, object]:
        """Pickled state: the config, without the registry of modules sharded in this process.

        TorchRec's multi-process test utilities and ``torch.multiprocessing.spawn`` hand sharders
        to ranks pickled; the registry only holds weak references to this process's modules.

        Returns:
            The instance's attributes, the registry left out.
        """
        state = self.__dict__.copy()
        del state["_sharded"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        """Restores a pickled sharder with an empty registry (:meth:`stats` starts empty).

        Args:
            state: From :meth:`__getstate__`.
        """
        self.__dict__.update(state)
        self._sharded = weakref.WeakValueDictionary()

    @property
    def comms_config(self) -> LossyCommsConfig:
        """The config every module sharded by this sharder uses."""
        return self._comms_config

    @property
    def bounds_factory(self) -> BoundProviderFactory:
        """Builds each sharded module's bound provider (pickled by reference: a top-level name)."""
        return self._bounds_factory

    def lossy_module_options(self) -> dict[str, Any]:
        """TorchRec sharder options the sharded module takes besides the common ones.

        Returns:
            Keyword arguments for the sharded module's constructor; none by default.
        """
        return {}

    def shard(
        self,
        module: nn.Module,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> LossyCommsModule:
        """Shards ``module`` like TorchRec's sharder, with compressed embedding all-to-alls.

        Args:
            module: The module (of this sharder's type).
            params: Its tables' plan.
            env: Sharding environment.
            device: Device of the shards.
            module_fqn: Its name in the model.

        Returns:
            The sharded module (``sharded_module_type``), registered for :meth:`stats`.

        Raises:
            ConfigMismatchError: On every rank, when the ranks' comms configs differ.
        """
        # Before anything is built: a rank with another config would fail later, and not
        # necessarily everywhere (docs/sharder.md, "Errors").
        check_same_config(
            self._comms_config,
            env.process_group,
            module_fqn or type(module).__name__,
            {"bounds_factory": getattr(self._bounds_factory, "__qualname__", "?")},
        )
        sharded = self.sharded_module_type(  # type: ignore[attr-defined]
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,  # type: ignore[attr-defined]
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,  # type: ignore[attr-defined]
            module_fqn=module_fqn,
            comms_config=self._comms_config,
            bounds_factory=self._bounds_factory,
            **self.lossy_module_options(),
        )
        self._sharded[module_fqn or ""] = sharded
        return sharded

    def stats(self) -> dict[str, LossyCommsStats]:
        """Telemetry of every live module this sharder sharded, by module name.

        Returns:
            Module FQN (``""`` if none was given) to its stats.
        """
        return {fqn: m.lossy_stats for fqn, m in self._sharded.items()}


class LossyEmbeddingBagCollectionSharder(LossySharderMixin, EmbeddingBagCollectionSharder):
    """Drop-in for ``EmbeddingBagCollectionSharder`` that compresses the pooled all-to-all.

    Pass it wherever the TorchRec sharder goes: ``EmbeddingShardingPlanner.collective_plan`` and
    ``DistributedModelParallel(sharders=...)``.

    Args:
        fused_params: As TorchRec.
        qcomm_codecs_registry: As TorchRec; used where no lossy path applies (input dist,
            row-wise reduce-scatter).
        sharded_module_order_overwrite: As TorchRec.
        comms_config: Bounds, codec knobs, backward codec; None: ``LossyCommsConfig()``.
        bounds_factory: Builds each sharded module's bound provider as
            ``bounds_factory(table_names, config)``; default :class:`StaticBounds`.
    """

    def __init__(
        self,
        fused_params: dict[str, object] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        sharded_module_order_overwrite: list[str] | None = None,
        comms_config: LossyCommsConfig | None = None,
        bounds_factory: BoundProviderFactory = StaticBounds,
    ) -> None:
        super().__init__(
            fused_params=fused_params,
            qcomm_codecs_registry=qcomm_codecs_registry,
            sharded_module_order_overwrite=sharded_module_order_overwrite,
        )
        self._init_lossy(comms_config, bounds_factory)

    def lossy_module_options(self) -> dict[str, Any]:
        """TorchRec's module order overwrite, which the EBC sharder passes on.

        Returns:
            ``sharded_module_order_overwrite`` for the sharded module.
        """
        return {"sharded_module_order_overwrite": self._sharded_module_order_overwrite}

    @property
    def sharded_module_type(self) -> type[LossyShardedEmbeddingBagCollection]:
        """The sharded module class."""
        return LossyShardedEmbeddingBagCollection
