"""A compression-aware shard perf estimator on top of TorchRec's ``EmbeddingPerfEstimator``.

TorchRec prices each shard's communication as fp32 bytes at one bandwidth; this estimator keeps
that estimate and re-prices each pooled shard by the collective carrying it (:data:`COLLECTIVES`):
an all-to-all per destination class (own block and same-host peers at the intra-host bandwidth,
cross-host peers at the inter-host one, each in its wire format plus codec time), TorchRec's
reduce-scatter over its format's ratio plus codec time, TWRW/grid as both hops. Data-parallel
shards are left alone. Formulas: ``docs/config.md``, ``planner`` section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, get_num_poolings
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    SharderDataMap,
    ShardingOption,
    Topology,
)
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import DATA_TYPE_NUM_BITS

from torchrec_lossy.planner.cost import CommsModel, LinkCost, Links, TableComms

__all__ = [
    "A2A_SHARDING_TYPES",
    "COLLECTIVES",
    "LossyPerfEstimator",
    "ShardCost",
    "option_key",
]

# Pooled outputs travel by all-to-all: the lossy codec can carry them.
A2A_SHARDING_TYPES: frozenset[str] = frozenset(
    {
        ShardingType.TABLE_WISE.value,
        ShardingType.COLUMN_WISE.value,
        ShardingType.TABLE_COLUMN_WISE.value,
    }
)
OptionKey = tuple[str, str, str, tuple[tuple[int, ...], ...]]

# What carries a sharding option's pooled outputs (the plan shows it per table).
DP_ALL_REDUCE = "all-reduce"
ALL_TO_ALL = "a2a"
REDUCE_SCATTER = "rs"
TWO_HOP = "rs+a2a"
NO_LINKS = LinkCost()
COLLECTIVES: dict[str, str] = {
    DP_ALL_REDUCE: "replicated: no output dist, the gradient all-reduce",
    ALL_TO_ALL: "one all-to-all over every rank",
    REDUCE_SCATTER: "TorchRec's reduce-scatter (and all-gather backward)",
    TWO_HOP: "reduce-scatter inside the host, then an all-to-all across hosts",
}


def option_key(option: ShardingOption) -> OptionKey:
    """Identifies a sharding option across TorchRec's deep copies of the search space.

    Args:
        option: A sharding option.

    Returns:
        (table, sharding type, compute kernel, shard offsets).
    """
    return (
        option.name,
        option.sharding_type,
        option.compute_kernel,
        tuple(tuple(s.offset) for s in option.shards),
    )


@dataclass(frozen=True)
class ShardCost:
    """What the estimator priced for one shard, for the printed plan.

    Attributes:
        fwd_raw_bytes: Forward output bytes of the shard per step, before encoding (0 for DP).
        fwd_wire_bytes: Expected forward bytes on the wire.
        fwd_comms_ms: Forward communication time without codec time.
        bwd_comms_ms: Backward communication time without codec time (DP: the all-reduce).
        codec_ms: Encode + decode time, forward and backward.
        fwd_format: Forward wire format name (``"replicated"`` for DP; the cross-host hop's
            for TWRW/grid).
        bwd_format: Backward wire format name.
        collective: What carries the outputs (:data:`COLLECTIVES`).
        fwd_links: The forward all-to-all (TWRW/grid: its cross-host hop) per destination class.
        bwd_links: The gradient all-to-all per destination class.
        fwd_codec_ms: The forward's share of ``codec_ms``.
    """

    fwd_raw_bytes: float
    fwd_wire_bytes: float
    fwd_comms_ms: float
    bwd_comms_ms: float
    codec_ms: float
    fwd_format: str
    bwd_format: str
    collective: str = DP_ALL_REDUCE
    fwd_links: LinkCost = NO_LINKS
    bwd_links: LinkCost = NO_LINKS
    fwd_codec_ms: float = 0.0


class LossyPerfEstimator(EmbeddingPerfEstimator):
    """TorchRec's perf estimator with per-table compression of the embedding traffic.

    Args:
        topology: Device topology.
        comms_model: Per-table wire formats.
        constraints: Per-table planner constraints.
        is_inference: Whether planning for inference.
        base_cache: TorchRec's (uncompressed) estimates by option, shared between estimators
            that differ only in ``comms_model`` (same topology, constraints and sharders), so
            that pricing several comms models re-runs only the cheap compression step.
    """

    def __init__(
        self,
        topology: Topology,
        comms_model: CommsModel,
        constraints: dict[str, ParameterConstraints] | None = None,
        is_inference: bool = False,
        base_cache: dict[OptionKey, tuple[list[Perf | None], bool | None]] | None = None,
    ) -> None:
        super().__init__(topology=topology, constraints=constraints, is_inference=is_inference)
        self.comms_model = comms_model
        self.base_cache = base_cache
        # Breakdown per estimated option, and the cheapest total per (table, sharding type).
        self.shard_costs: dict[OptionKey, list[ShardCost]] = {}
        self.type_costs: dict[str, dict[str, float]] = {}

    def estimate(
        self,
        sharding_options: list[ShardingOption],
        sharder_data_map: SharderDataMap | None = None,
    ) -> None:
        """Estimates every option with TorchRec, then applies the tables' wire formats.

        Args:
            sharding_options: Options to estimate (their shards' ``perf`` is set).
            sharder_data_map: TorchRec's sharder data map.
        """
        cache = self.base_cache
        if cache is None:
            super().estimate(sharding_options, sharder_data_map)
        else:
            todo = [o for o in sharding_options if option_key(o) not in cache]
            if todo:
                super().estimate(todo, sharder_data_map)
                for o in todo:
                    cache[option_key(o)] = ([s.perf for s in o.shards], o.is_weighted)
            for o in sharding_options:
                perfs, weighted = cache[option_key(o)]
                o.is_weighted = weighted
                for shard, perf in zip(o.shards, perfs, strict=True):
                    shard.perf = perf
        # Cheapest option per (table, sharding type) among these options; replaces what an
        # earlier call (e.g. before a calibration changed the ratios) recorded for them.
        cheapest: dict[str, dict[str, float]] = {}
        for option in sharding_options:
            costs = self._apply(option)
            self.shard_costs[option_key(option)] = costs
            total = sum(s.perf.total for s in option.shards if s.perf is not None)
            per_type = cheapest.setdefault(option.name, {})
            per_type[option.sharding_type] = min(
                total, per_type.get(option.sharding_type, float("inf"))
            )
        for table, per_type in cheapest.items():
            self.type_costs.setdefault(table, {}).update(per_type)

    def batch_outputs(self, option: ShardingOption) -> float:
        """Output rows per rank and step (TorchRec's ``batch_outputs``): pooled rows, or for a
        sequence (``EmbeddingCollection``) table one row per id.

        Args:
            option: A sharding option.

        Returns:
            ``sum(min(1, pooling) * num_poolings * batch_size)`` over the table's features
            (``pooling`` itself for a sequence table).
        """
        constraints = self._constraints or {}
        c = constraints.get(option.name)
        num_poolings = get_num_poolings(self._constraints, option)
        batch_sizes = (
            list(c.batch_sizes)
            if c is not None and c.batch_sizes
            else [option.batch_size] * option.num_inputs
        )
        return sum(
            (min(1.0, il) if option.is_pooled else il) * n * b
            for il, n, b in zip(option.input_lengths, num_poolings, batch_sizes, strict=True)
        )

    def _apply(self, option: ShardingOption) -> list[ShardCost]:
        """Rewrites the option's shard perfs for its table's formats; returns the breakdown."""
        collective = self.collective(option)
        comms = None if collective == DP_ALL_REDUCE else self.comms_model.for_table(option.name)
        elem = (
            DATA_TYPE_NUM_BITS[option.output_dtype] / 8
            if option.output_dtype
            else option.tensor.element_size()
        )
        # TorchRec's B: batch_outputs * world_size rows of the shard's columns at the output dtype.
        outputs = 0.0 if comms is None else self.batch_outputs(option) * self._topology.world_size
        costs = []
        for shard in option.shards:
            perf = shard.perf
            if perf is None:
                continue
            if comms is None:
                costs.append(
                    ShardCost(0.0, 0.0, 0.0, perf.bwd_comms, 0.0, "replicated", "all-reduce")
                )
                continue
            cost = self._shard_cost(perf, comms, collective, outputs * shard.size[1] * elem)
            shard.perf = dataclasses.replace(
                perf,
                fwd_comms=cost.fwd_comms_ms + cost.fwd_codec_ms,
                bwd_comms=cost.bwd_comms_ms + (cost.codec_ms - cost.fwd_codec_ms),
            )
            costs.append(cost)
        return costs

    def collective(self, option: ShardingOption) -> str:
        """Which collective carries the option's pooled outputs.

        Args:
            option: A sharding option.

        Returns:
            One of :data:`COLLECTIVES`' keys.
        """
        kind = option.sharding_type
        if kind == ShardingType.DATA_PARALLEL.value:
            return DP_ALL_REDUCE
        if kind in A2A_SHARDING_TYPES:
            return ALL_TO_ALL
        if kind == ShardingType.ROW_WISE.value:
            comms = self.comms_model.for_table(option.name)
            # Sequence tables travel by all-to-all for every type TorchRec offers them (RW too).
            a2a = comms.row_wise_all_to_all or not option.is_pooled
            return ALL_TO_ALL if a2a else REDUCE_SCATTER
        return TWO_HOP  # TWRW, grid

    def _links(self) -> Links:
        bw = self._topology.comms_bandwidths
        return Links(intra_bw=bw.intra_host_bw, inter_bw=bw.inter_host_bw)

    def _shard_cost(
        self, perf: Perf, comms: TableComms, collective: str, raw_bytes: float
    ) -> ShardCost:
        """Prices one shard's forward and backward traffic in the table's formats.

        All-to-all: ``raw_bytes`` over the world's ranks per destination class (own block,
        same-host peers, cross-host peers; :meth:`Links.all_to_all`). Reduce-scatter (TorchRec's
        RW): TorchRec's time over the format's ratio plus its codec time. Two-hop (TWRW, grid):
        TorchRec's intra-host part so, and its cross-host all-to-all (one block per host,
        ``raw_bytes / world x hosts``) per destination class in the all-to-all formats.

        Args:
            perf: TorchRec's (uncompressed) estimate of the shard.
            comms: The table's formats.
            collective: :meth:`collective` of the option.
            raw_bytes: The shard's pooled output bytes before encoding.

        Returns:
            The breakdown.
        """
        topo = self._topology
        world = topo.world_size
        links = self._links()
        if collective == ALL_TO_ALL:
            same_host = min(topo.local_world_size, world) - 1
            fwd = links.all_to_all(raw_bytes, world, same_host, comms.a2a_formats(False))
            bwd = links.all_to_all(raw_bytes, world, same_host, comms.a2a_formats(True))
            return ShardCost(
                fwd_raw_bytes=raw_bytes,
                fwd_wire_bytes=fwd.same_host_bytes + fwd.cross_host_bytes,
                fwd_comms_ms=fwd.comms_ms,
                bwd_comms_ms=bwd.comms_ms,
                codec_ms=fwd.codec_ms + bwd.codec_ms,
                fwd_format=comms.fwd.name,
                bwd_format=comms.bwd.name,
                collective=collective,
                fwd_links=fwd,
                bwd_links=bwd,
                fwd_codec_ms=fwd.codec_ms,
            )
        hosts = world // max(1, topo.intra_group_size)
        hop_bytes = raw_bytes / world * hosts if collective == TWO_HOP and hosts > 1 else 0.0
        fwd, bwd = NO_LINKS, NO_LINKS
        if hop_bytes:
            fwd = links.all_to_all(hop_bytes, hosts, 0, comms.a2a_formats(False))
            bwd = links.all_to_all(hop_bytes, hosts, 0, comms.a2a_formats(True))
        # TorchRec priced the cross-host hop raw at the inter-host bandwidth: take it out.
        hop_ms = hop_bytes / links.inter_bw
        fwd_rs_codec = comms.fwd_rs.codec_ms(raw_bytes)
        return ShardCost(
            fwd_raw_bytes=raw_bytes + hop_bytes,
            fwd_wire_bytes=raw_bytes / comms.fwd_rs.ratio
            + fwd.same_host_bytes
            + fwd.cross_host_bytes,
            fwd_comms_ms=(perf.fwd_comms - hop_ms) / comms.fwd_rs.ratio + fwd.comms_ms,
            bwd_comms_ms=(perf.bwd_comms - hop_ms) / comms.bwd_rs.ratio + bwd.comms_ms,
            codec_ms=fwd_rs_codec + comms.bwd_rs.codec_ms(raw_bytes) + fwd.codec_ms + bwd.codec_ms,
            fwd_format=(comms.fwd if hop_bytes else comms.fwd_rs).name,
            bwd_format=(comms.bwd if hop_bytes else comms.bwd_rs).name,
            collective=collective,
            fwd_links=fwd,
            bwd_links=bwd,
            fwd_codec_ms=fwd_rs_codec + fwd.codec_ms,
        )
