"""``LossyShardingPlanner``: TorchRec's sharding planner with a compression-aware cost model.

An ``EmbeddingShardingPlanner`` (same ``plan`` / ``collective_plan``) whose enumerator prices
every option with :class:`~torchrec_lossy.planner.estimator.LossyPerfEstimator`; data-parallel
stays an option unless ``planner.data_parallel`` is off. After planning,
:meth:`LossyShardingPlanner.explain` gives each table's choice and reason, and
:meth:`LossyShardingPlanner.sharder` builds the lossy sharder of the same config.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import (
    CollectiveType,
    HardwareConfig,
    KernelConfig,
    ParameterConstraints,
    Partitioner,
    PerfModel,
    PlannerError,
    PlannerErrorType,
    Proposer,
    ShardingOption,
    Stats,
    StorageReservation,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_lossy.config import (
    EmbeddingTableConfig,
    LossyCommsConfig,
    LossyPlanConfig,
    TopologyConfig,
)
from torchrec_lossy.planner.cost import CommsModel, Links, gib_s_to_bytes_per_ms
from torchrec_lossy.planner.estimator import (
    LossyPerfEstimator,
    option_key,
)
from torchrec_lossy.planner.lossy_model import LossyCommsModel

if TYPE_CHECKING:
    from torchrec_lossy.planner.calibrate import Calibration
    from torchrec_lossy.planner.speeds import Speeds

__all__ = [
    "LossyEnumerator",
    "LossyShardingPlanner",
    "PlannedTable",
    "StepCost",
    "build_module",
    "build_topology",
    "format_plan",
    "per_rank_batch_size",
]

logger: logging.Logger = logging.getLogger(__name__)

_GIB = float(1 << 30)
SHORT_NAMES: dict[str, str] = {
    ShardingType.DATA_PARALLEL.value: "DP",
    ShardingType.TABLE_WISE.value: "TW",
    ShardingType.COLUMN_WISE.value: "CW",
    ShardingType.TABLE_COLUMN_WISE.value: "TWCW",
    ShardingType.ROW_WISE.value: "RW",
    ShardingType.TABLE_ROW_WISE.value: "TWRW",
    ShardingType.GRID_SHARD.value: "GRID",
}


def _natural_key(name: str) -> list[Any]:
    """Sort key that orders t_2 before t_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _short(sharding_type: str) -> str:
    return SHORT_NAMES.get(sharding_type, sharding_type)


def build_topology(config: TopologyConfig) -> Topology:
    """A TorchRec ``Topology`` from the config (null fields keep TorchRec's defaults).

    No process group and no device of ``compute_device`` kind are needed.

    Args:
        config: Topology section of the plan config.

    Returns:
        The topology.
    """

    def gib(v: float | None) -> int | None:
        return None if v is None else int(v * _GIB)

    def bw(v: float | None) -> float | None:
        return None if v is None else gib_s_to_bytes_per_ms(v)

    return TopologyFactory.create_topology(
        TrainerConfig(
            world_size=config.world_size,
            local_world_size=config.local_world_size or config.world_size,
            hbm_cap_bytes=gib(config.hbm_cap_gib),
            ddr_cap_bytes=gib(config.ddr_cap_gib),
        ),
        HardwareConfig(
            intra_host_bw=bw(config.intra_host_bandwidth_gib_s),
            inter_host_bw=bw(config.inter_host_bandwidth_gib_s),
        ),
        # TorchRec reads HardwareConfig's bandwidths only on its "hardware-based" path; every
        # field left None there still falls back to TorchRec's default.
        KernelConfig(
            compute_device=config.compute_device,
            use_hardware_based_bandwidth=config.intra_host_bandwidth_gib_s is not None
            or config.inter_host_bandwidth_gib_s is not None,
        ),
    )


def build_module(
    tables: Sequence[EmbeddingTableConfig], device: torch.device | str = "meta"
) -> EmbeddingBagCollection:
    """An ``EmbeddingBagCollection`` of the config's tables (on the meta device: no memory).

    Args:
        tables: The tables.
        device: Where to allocate the weights; ``"meta"`` for planning.

    Returns:
        The module.
    """
    if not tables:
        raise ValueError("the config lists no embedding_tables to plan")
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names) or [t.name],
            )
            for t in tables
        ],
        device=torch.device(device),
    )


def per_rank_batch_size(config: LossyPlanConfig, world_size: int | None = None) -> int:
    """The planner's batch size: samples per rank per step.

    Args:
        config: The plan config (``planner.global_batch_size``).
        world_size: Ranks; default ``topology.world_size`` of the config.

    Returns:
        ``global_batch_size // world_size``, or TorchRec's default of 512 when unset.
    """
    g = config.planner.global_batch_size
    if g is None:
        return BATCH_SIZE
    w = world_size or config.topology.world_size
    if g % w:
        raise ValueError(
            f"planner.global_batch_size={g} is not divisible by topology.world_size={w}: "
            f"use a multiple of {w}"
        )
    return g // w


def default_constraints(tables: Sequence[EmbeddingTableConfig]) -> dict[str, ParameterConstraints]:
    """Pooling factors of the config's tables as TorchRec constraints (only where not 1).

    Args:
        tables: The tables.

    Returns:
        ``{table: ParameterConstraints(pooling_factors=...)}``.
    """
    return {
        t.name: ParameterConstraints(
            pooling_factors=[t.pooling_factor] * max(1, len(t.feature_names))
        )
        for t in tables
        if t.pooling_factor != 1.0
    }


class LossyEnumerator(EmbeddingEnumerator):
    """TorchRec's enumerator minus the options a table's traffic cannot use.

    Args:
        topology: Device topology.
        batch_size: Samples per rank per step.
        comms_model: Per-table wire formats (decides which tables cannot go row-wise).
        constraints: Per-table planner constraints.
        estimator: Shard estimators.
        data_parallel: Keep data-parallel options.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        comms_model: CommsModel,
        constraints: dict[str, ParameterConstraints] | None = None,
        estimator: list[Any] | None = None,
        data_parallel: bool = True,
    ) -> None:
        super().__init__(
            topology=topology, batch_size=batch_size, constraints=constraints, estimator=estimator
        )
        self.comms_model = comms_model
        self.data_parallel = data_parallel
        # Table -> sharding types dropped for it, with the reason.
        self.excluded: dict[str, dict[str, str]] = {}

    def _exclusion(self, option: ShardingOption) -> str | None:
        if option.sharding_type == ShardingType.DATA_PARALLEL.value:
            return None if self.data_parallel else "planner.data_parallel is off"
        return None

    def enumerate(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
    ) -> list[ShardingOption]:
        """Enumerates and estimates like TorchRec, then drops unusable options.

        Args:
            module: Module to shard.
            sharders: Sharders offering sharding types and kernels.

        Returns:
            The usable options.

        Raises:
            PlannerError: If a table has no usable option left (names the table and the fix).
        """
        options = super().enumerate(module, sharders)
        kept = []
        excluded: dict[str, dict[str, str]] = {}
        for option in options:
            why = self._exclusion(option)
            if why is None:
                kept.append(option)
            else:
                excluded.setdefault(option.name, {})[option.sharding_type] = why
        left = {o.name for o in kept}
        lost = sorted({o.name for o in options} - left)
        if lost:
            detail = "; ".join(f"{n}: {excluded[n]}" for n in lost)
            raise PlannerError(
                f"no usable sharding option for table(s) {lost} ({detail}). Allow another "
                f"sharding type for them (ParameterConstraints.sharding_types, sharder sharding "
                f"types) or turn planner.data_parallel back on",
                PlannerErrorType.STRICT_CONSTRAINTS,
            )
        self.excluded = excluded
        return kept


@dataclass(frozen=True)
class PlannedTable:
    """One table of a plan, as printed.

    Attributes:
        name: Table name.
        rows: Rows.
        dim: Columns.
        sharding_type: TorchRec sharding type.
        compute_kernel: TorchRec compute kernel.
        ranks: Ranks holding its shards.
        fwd_raw_bytes: Forward pooled-output bytes per step before encoding (0 for DP).
        fwd_wire_bytes: Expected forward bytes on the wire per step.
        fwd_format: Forward wire format (``"replicated"`` for DP).
        bwd_format: Backward wire format (``"all-reduce"`` for DP).
        fwd_comms_ms: Forward communication time, summed over shards, without codec.
        bwd_comms_ms: Backward communication time, summed over shards, without codec.
        codec_ms: Encode + decode time, summed over shards.
        reason: Why this sharding and codec.
        collective: What carries its outputs (``a2a``, ``rs``, ``rs+a2a``, ``all-reduce``).
        fwd_same_host_bytes: Forward all-to-all wire bytes to same-host peers (own blocks
            included), summed over shards.
        fwd_cross_host_bytes: Forward all-to-all wire bytes to other hosts.
        same_host_ms: All-to-all time on the intra-host link, forward and backward.
        cross_host_ms: All-to-all time on the inter-host link, forward and backward.
    """

    name: str
    rows: int
    dim: int
    sharding_type: str
    compute_kernel: str
    ranks: tuple[int, ...]
    fwd_raw_bytes: float
    fwd_wire_bytes: float
    fwd_format: str
    bwd_format: str
    fwd_comms_ms: float
    bwd_comms_ms: float
    codec_ms: float
    reason: str
    collective: str = "a2a"
    fwd_same_host_bytes: float = 0.0
    fwd_cross_host_bytes: float = 0.0
    same_host_ms: float = 0.0
    cross_host_ms: float = 0.0


@dataclass(frozen=True)
class StepCost:
    """Estimated embedding costs of one training step under a plan (max over ranks).

    Attributes:
        fwd_comms_ms: Forward communication (all-to-all or reduce-scatter), without codec.
        bwd_comms_ms: Backward communication (all-to-all, all-gather, DP all-reduce).
        codec_ms: Encode + decode time.
        comms_ms: The slowest rank's communication + codec time.
        planner_ms: TorchRec's perf rating: the slowest rank's total (compute, comms, codec).
        fwd_raw_bytes: Forward pooled-output bytes per step, all ranks, before encoding.
        fwd_wire_bytes: Expected forward bytes on the wire per step, all ranks.
        same_host_ms: The slowest rank's all-to-all time on the intra-host link (fwd + bwd).
        cross_host_ms: The slowest rank's all-to-all time on the inter-host link (fwd + bwd).
        fwd_cross_host_bytes: Forward all-to-all wire bytes to other hosts, all ranks.
    """

    fwd_comms_ms: float
    bwd_comms_ms: float
    codec_ms: float
    comms_ms: float
    planner_ms: float
    fwd_raw_bytes: float
    fwd_wire_bytes: float
    same_host_ms: float = 0.0
    cross_host_ms: float = 0.0
    fwd_cross_host_bytes: float = 0.0


class LossyShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's ``EmbeddingShardingPlanner`` with per-table compression in its cost model.

    Everything is configured in one :class:`~torchrec_lossy.config.LossyPlanConfig`; the
    TorchRec arguments can still override parts of it.

    Args:
        config: The plan config (comms, planner pricing, topology, tables).
        topology: Overrides the topology built from ``config.topology``.
        batch_size: Samples per rank per step; default from ``planner.global_batch_size``.
        comms_model: Overrides the lossy comms model (e.g. a qcomm or raw baseline).
        constraints: TorchRec per-table constraints; pooling factors of the config's tables are
            added where the caller gives none.
        storage_reservation: TorchRec storage reservation.
        proposer: TorchRec proposer(s).
        partitioner: TorchRec partitioner.
        performance_model: TorchRec perf model.
        stats: TorchRec stats loggers (``[]`` to print nothing).
        debug: TorchRec debug flag.
        callbacks: TorchRec plan callbacks.
        timeout_seconds: TorchRec planning timeout.
        base_cache: Shared cache of TorchRec's uncompressed estimates (see
            :class:`~torchrec_lossy.planner.estimator.LossyPerfEstimator`), for planning one
            model under several comms models.
        speeds: Measured format speeds (:func:`~torchrec_lossy.planner.speeds.measure_speeds`,
            agreed over ranks by :func:`~torchrec_lossy.planner.speeds.agree_speeds`); None:
            the device defaults. ``planner.encode_gib_s`` / ``decode_gib_s`` pin the codec's.
    """

    def __init__(
        self,
        config: LossyPlanConfig | None = None,
        topology: Topology | None = None,
        batch_size: int | None = None,
        *,
        comms_model: CommsModel | None = None,
        constraints: dict[str, ParameterConstraints] | None = None,
        storage_reservation: StorageReservation | None = None,
        proposer: Proposer | list[Proposer] | None = None,
        partitioner: Partitioner | None = None,
        performance_model: PerfModel | None = None,
        stats: Stats | list[Stats] | None = None,
        debug: bool = True,
        callbacks: list[Callable[[list[ShardingOption]], list[ShardingOption]]] | None = None,
        timeout_seconds: int | None = None,
        base_cache: dict[Any, Any] | None = None,
        speeds: Speeds | None = None,
    ) -> None:
        self.config = config or LossyPlanConfig()
        topology = topology or build_topology(self.config.topology)
        batch_size = batch_size or per_rank_batch_size(self.config, topology.world_size)
        merged = {**default_constraints(self.config.embedding_tables), **(constraints or {})}
        constraints = merged or None
        a2a_bw = topology.comms_bandwidths.get_bw(
            local_world_size=topology.local_world_size,
            world_size=topology.world_size,
            collective_type=CollectiveType.ALL_TO_ALL,
        )
        bws = topology.comms_bandwidths
        self.comms_model: CommsModel = comms_model or LossyCommsModel(
            self.config,
            a2a_bw,
            links=Links(intra_bw=bws.intra_host_bw, inter_bw=bws.inter_host_bw),
            speeds=speeds,
        )
        self.estimator = LossyPerfEstimator(
            topology, self.comms_model, constraints, base_cache=base_cache
        )
        enumerator = LossyEnumerator(
            topology=topology,
            batch_size=batch_size,
            comms_model=self.comms_model,
            constraints=constraints,
            estimator=[self.estimator, EmbeddingStorageEstimator(topology, constraints)],
            data_parallel=self.config.planner.data_parallel,
        )
        super().__init__(
            topology=topology,
            batch_size=batch_size,
            enumerator=enumerator,
            storage_reservation=storage_reservation,
            proposer=proposer,
            partitioner=partitioner,
            performance_model=performance_model,
            stats=stats,
            constraints=constraints,
            debug=debug,
            callbacks=callbacks,
            timeout_seconds=timeout_seconds,
        )
        self._lossy_enumerator = enumerator
        self._planned: list[PlannedTable] = []
        self._planned_ranks: list[tuple[int, list[Any], list[Any]]] = []

    # ------------------------------------------------------------------------------------------
    # TorchRec's interface
    # ------------------------------------------------------------------------------------------

    def plan(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]] | None = None
    ) -> ShardingPlan:
        """Plans like TorchRec, pricing compression; logs the explained plan at INFO.

        Args:
            module: Module to shard (build it on the meta device for planning only).
            sharders: Sharders; default ``[self.sharder()]``.

        Returns:
            The sharding plan.
        """
        plan = super().plan(module, sharders if sharders is not None else [self.sharder()])
        # Print tables in the module's order (the collections' config order).
        order = [
            cfg.name
            for m in module.modules()
            if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
            for cfg in (
                m.embedding_bag_configs()
                if isinstance(m, EmbeddingBagCollection)
                else m.embedding_configs()
            )
        ]
        self._record(self._best_plan or [], {name: i for i, name in enumerate(order)})
        logger.info("torchrec-lossy plan:\n%s", self.explain())
        return plan

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        """Plans on rank 0 and broadcasts the plan (TorchRec's ``collective_plan``).

        Args:
            module: Module to shard.
            sharders: Sharders; default ``[self.sharder()]``.
            pg: Process group; default the world.

        Returns:
            The sharding plan.
        """
        return super().collective_plan(
            module, sharders if sharders is not None else [self.sharder()], pg
        )

    # ------------------------------------------------------------------------------------------
    # Codec settings for the sharder
    # ------------------------------------------------------------------------------------------

    @property
    def comms_config(self) -> LossyCommsConfig:
        """The comms config the sharder should run with.

        The user's ``comms`` section with ``format: auto`` resolved per table and link class
        (:meth:`~torchrec_lossy.planner.lossy_model.LossyCommsModel.resolved_comms`) for the
        config's tables, calibrated tables and every table planned so far; as written under
        another comms model.

        Returns:
            The config.
        """
        model = self.comms_model
        if not isinstance(model, LossyCommsModel):
            return self.config.comms
        return model.resolved_comms(
            [t.name for t in self.config.embedding_tables]
            + list(model.ratios)
            + [p.name for p in self._planned]
        )

    @property
    def torchrec_path(self) -> bool:
        """Whether ``format: auto`` resolved to TorchRec's own all-to-all (the seam's estimated
        step, its measured fixed cost included, slower than TorchRec's on the link)."""
        model = self.comms_model
        return isinstance(model, LossyCommsModel) and model.torchrec_path

    def sharder(
        self,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> ModuleSharder[nn.Module]:
        """The lossy EmbeddingBagCollection sharder, built with :attr:`comms_config`.

        Its modules take their bounds from :class:`~torchrec_lossy.adaptive.AdaptiveBounds`
        (table classes and decay as configured; with both off it returns the configured bounds).
        Pass the same sharder to ``plan`` / ``collective_plan`` and to
        ``DistributedModelParallel(sharders=...)``.

        Args:
            fused_params: TorchRec fused params (optimizer etc.).
            qcomm_codecs_registry: TorchRec qcomm codecs for the traffic the lossy codec does not
                carry.

        Returns:
            ``LossyEmbeddingBagCollectionSharder``; TorchRec's ``EmbeddingBagCollectionSharder``
            (``CheckedEmbeddingBagCollectionSharder``: the ranks' configs checked at sharding)
            where ``format: auto`` estimates TorchRec's path faster than the seam's
            (:attr:`torchrec_path`).
        """
        from torchrec_lossy.adaptive import AdaptiveBounds
        from torchrec_lossy.distributed.sharder import LossyEmbeddingBagCollectionSharder

        if self.torchrec_path:  # TorchRec's own, its ranks' configs checked all the same
            from torchrec_lossy.distributed.torchrec_path import (
                CheckedEmbeddingBagCollectionSharder,
            )

            return CheckedEmbeddingBagCollectionSharder(
                self.comms_config,
                fused_params=fused_params,
                qcomm_codecs_registry=qcomm_codecs_registry,
            )
        return LossyEmbeddingBagCollectionSharder(
            comms_config=self.comms_config,
            fused_params=fused_params,
            qcomm_codecs_registry=qcomm_codecs_registry,
            bounds_factory=AdaptiveBounds,
        )

    def calibrate(self, blocks: Mapping[str, torch.Tensor]) -> dict[str, Calibration]:
        """Measures each table's ratio with the real codec; later plans use these ratios.

        Args:
            blocks: Sample pooled-embedding blocks by table name (see
                :func:`torchrec_lossy.planner.calibrate.pooled_blocks`).

        Returns:
            Per-table calibration results.
        """
        from torchrec_lossy.distributed.torchrec_adapter import forget_search_space
        from torchrec_lossy.planner.calibrate import calibrate

        if not isinstance(self.comms_model, LossyCommsModel):
            raise TypeError("calibrate() prices the lossy codec; this planner uses another model")
        results = calibrate(blocks, self.config.comms)
        self.comms_model.ratios.update({n: c.ratio for n, c in results.items()})
        # TorchRec caches the estimated search space per module: re-estimate with the new ratios.
        forget_search_space(self._lossy_enumerator)
        return results

    # ------------------------------------------------------------------------------------------
    # Explaining the plan
    # ------------------------------------------------------------------------------------------

    @property
    def planned_tables(self) -> list[PlannedTable]:
        """The last plan, per table (empty before :meth:`plan`)."""
        return list(self._planned)

    def explain(self) -> str:
        """The last plan as a text table, with the model's description.

        Returns:
            The text.
        """
        pays = self.comms_model.pays_note
        header = self.comms_model.description + (f"\n{pays}" if pays else "")
        return f"{header}\n{format_plan(self._planned)}"

    def step_cost(self) -> StepCost:
        """Estimated per-step embedding costs of the last plan (max over ranks).

        Returns:
            The costs.
        """
        n = self._topology.world_size
        fwd, bwd, codec, comms, total, same, cross = ([0.0] * n for _ in range(7))
        raw = wire = cross_bytes = 0.0
        for rank, costs, perfs in self._planned_ranks:
            for c, p in zip(costs, perfs, strict=True):
                fwd[rank] += c.fwd_comms_ms
                bwd[rank] += c.bwd_comms_ms
                codec[rank] += c.codec_ms
                comms[rank] += c.fwd_comms_ms + c.bwd_comms_ms + c.codec_ms
                total[rank] += p.total
                same[rank] += c.fwd_links.same_host_ms + c.bwd_links.same_host_ms
                cross[rank] += c.fwd_links.cross_host_ms + c.bwd_links.cross_host_ms
                raw += c.fwd_raw_bytes
                wire += c.fwd_wire_bytes
                cross_bytes += c.fwd_links.cross_host_bytes
        return StepCost(
            *(max(v) for v in (fwd, bwd, codec, comms, total)),
            fwd_raw_bytes=raw,
            fwd_wire_bytes=wire,
            same_host_ms=max(same),
            cross_host_ms=max(cross),
            fwd_cross_host_bytes=cross_bytes,
        )

    def _record(self, best_plan: list[ShardingOption], order: Mapping[str, int]) -> None:
        """Builds the per-table explanation and the per-rank breakdown of ``best_plan``."""
        planned = []
        per_rank: dict[int, tuple[list[Any], list[Any]]] = {}
        for option in best_plan:
            costs = self.estimator.shard_costs[option_key(option)]
            shards = [s for s in option.shards if s.perf is not None]
            for shard, cost in zip(shards, costs, strict=True):
                slot = per_rank.setdefault(int(shard.rank or 0), ([], []))
                slot[0].append(cost)
                slot[1].append(shard.perf)
            planned.append(
                PlannedTable(
                    name=option.name,
                    rows=int(option.tensor.shape[0]),
                    dim=int(option.tensor.shape[1]),
                    sharding_type=option.sharding_type,
                    compute_kernel=option.compute_kernel,
                    ranks=tuple(sorted({int(s.rank or 0) for s in option.shards})),
                    fwd_raw_bytes=sum(c.fwd_raw_bytes for c in costs),
                    fwd_wire_bytes=sum(c.fwd_wire_bytes for c in costs),
                    fwd_format=costs[0].fwd_format if costs else "raw",
                    bwd_format=costs[0].bwd_format if costs else "raw",
                    fwd_comms_ms=sum(c.fwd_comms_ms for c in costs),
                    bwd_comms_ms=sum(c.bwd_comms_ms for c in costs),
                    codec_ms=sum(c.codec_ms for c in costs),
                    reason=self._reason(option),
                    collective=self.estimator.collective(option),
                    fwd_same_host_bytes=sum(c.fwd_links.same_host_bytes for c in costs),
                    fwd_cross_host_bytes=sum(c.fwd_links.cross_host_bytes for c in costs),
                    same_host_ms=sum(
                        c.fwd_links.same_host_ms + c.bwd_links.same_host_ms for c in costs
                    ),
                    cross_host_ms=sum(
                        c.fwd_links.cross_host_ms + c.bwd_links.cross_host_ms for c in costs
                    ),
                )
            )
        self._planned = sorted(
            planned, key=lambda p: (order.get(p.name, len(order)), _natural_key(p.name))
        )
        self._planned_ranks = [(r, c, p) for r, (c, p) in sorted(per_rank.items())]

    def _reason(self, option: ShardingOption) -> str:
        chosen = option.sharding_type
        cost = sum(s.perf.total for s in option.shards if s.perf is not None)
        excluded = self._lossy_enumerator.excluded.get(option.name, {})
        alternatives = {
            t: c
            for t, c in self.estimator.type_costs.get(option.name, {}).items()
            if t != chosen and t not in excluded
        }
        parts = []
        if chosen == ShardingType.DATA_PARALLEL.value:
            parts.append("replicated: gradient all-reduce instead of all-to-all")
        else:
            note = self.comms_model.for_table(option.name).note
            if note:
                parts.append(note)
        if alternatives:
            alt = min(alternatives, key=alternatives.__getitem__)
            if cost <= alternatives[alt]:
                verdict = f"cheapest (next {_short(alt)} {alternatives[alt]:.3g})"
            else:
                verdict = f"for balance/memory (cheapest {_short(alt)} {alternatives[alt]:.3g})"
            parts.append(f"{_short(chosen)} {cost:.3g} ms {verdict}")
        if excluded:
            types = "/".join(sorted(_short(t) for t in excluded))
            parts.append(f"no {types}: {'; '.join(sorted(set(excluded.values())))}")
        return "; ".join(parts)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f}"


def _links_mib(same: float, cross: float) -> str:
    return f"{_mib(same)}/{_mib(cross)}" if same or cross else "-"


def format_plan(tables: Sequence[PlannedTable]) -> str:
    """A plan as a fixed-width text table, one line per table.

    Args:
        tables: Planned tables.

    Returns:
        The text (header, rows, totals).
    """
    header = (
        "table",
        "rows",
        "dim",
        "sharding",
        "collective",
        "ranks",
        "fwd raw MiB",
        "fwd wire MiB",
        "same/cross-host MiB",
        "ratio",
        "codec fwd/bwd",
        "why",
    )
    rows = []
    for t in tables:
        ranks = ",".join(map(str, t.ranks)) if len(t.ranks) <= 4 else f"{len(t.ranks)} ranks"
        ratio = f"{t.fwd_raw_bytes / t.fwd_wire_bytes:.1f}x" if t.fwd_wire_bytes else "-"
        rows.append(
            (
                t.name,
                f"{t.rows:,}",
                str(t.dim),
                _short(t.sharding_type),
                t.collective,
                ranks,
                _mib(t.fwd_raw_bytes) if t.fwd_raw_bytes else "-",
                _mib(t.fwd_wire_bytes) if t.fwd_raw_bytes else "-",
                _links_mib(t.fwd_same_host_bytes, t.fwd_cross_host_bytes),
                ratio,
                f"{t.fwd_format}/{t.bwd_format}",
                t.reason,
            )
        )
    raw = sum(t.fwd_raw_bytes for t in tables)
    wire = sum(t.fwd_wire_bytes for t in tables)
    rows.append(
        (
            "total",
            "",
            "",
            "",
            "",
            "",
            _mib(raw),
            _mib(wire),
            _links_mib(
                sum(t.fwd_same_host_bytes for t in tables),
                sum(t.fwd_cross_host_bytes for t in tables),
            ),
            f"{raw / wire:.1f}x" if wire else "-",
            "",
            "",
        )
    )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header[:-1])]

    def line(cells: Sequence[str]) -> str:
        body = "  ".join(c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True))
        return f"{body}  {cells[-1]}".rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])
