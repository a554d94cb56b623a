"""A compression-aware shard perf estimator on top of TorchRec's ``EmbeddingPerfEstimator``.

TorchRec prices each shard's forward and backward communication for fp32 traffic (for TW:
``batch_outputs * world_size * emb_dim * 4 / bw``). This estimator lets TorchRec do that, then
divides each pooled shard's forward and backward communication by its table's wire-format ratio
and adds the format's encode + decode time of the shard's raw output bytes::

    fwd_comms' = fwd_comms / R_fwd + B / enc + B / dec        B = batch_outputs * W * cols * 4
    bwd_comms' = bwd_comms / R_bwd + B / enc_b + B / dec_b

Data-parallel shards have no embedding all-to-all and are left alone. With a ratio of 2 and no
codec time this is exactly TorchRec's own pricing of an FP16 qcomm codec.
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

from torchrec_lossy.planner.cost import CommsModel, WireFormat

__all__ = [
    "A2A_SHARDING_TYPES",
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
        fwd_format: Forward wire format name (``"replicated"`` for DP).
        bwd_format: Backward wire format name.
    """

    fwd_raw_bytes: float
    fwd_wire_bytes: float
    fwd_comms_ms: float
    bwd_comms_ms: float
    codec_ms: float
    fwd_format: str
    bwd_format: str


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
        dp = option.sharding_type == ShardingType.DATA_PARALLEL.value
        formats: tuple[WireFormat | None, WireFormat | None]
        if dp:
            formats = (None, None)
        else:
            comms = self.comms_model.for_table(option.name)
            # Sequence tables travel by all-to-all for every type TorchRec offers them (RW too).
            rw_a2a = option.sharding_type == ShardingType.ROW_WISE.value and (
                comms.row_wise_all_to_all or not option.is_pooled
            )
            if option.sharding_type in A2A_SHARDING_TYPES or rw_a2a:
                formats = (comms.fwd, comms.bwd)
            else:
                formats = (comms.fwd_rs, comms.bwd_rs)
        elem = (
            DATA_TYPE_NUM_BITS[option.output_dtype] / 8
            if option.output_dtype
            else option.tensor.element_size()
        )
        outputs = 0.0 if dp else self.batch_outputs(option) * self._topology.world_size
        costs = []
        for shard in option.shards:
            perf = shard.perf
            if perf is None:
                continue
            raw_bytes = outputs * shard.size[1] * elem
            fwd, bwd = formats
            fwd_ratio = fwd.ratio if fwd is not None else 1.0
            bwd_ratio = bwd.ratio if bwd is not None else 1.0
            fwd_ms = perf.fwd_comms / fwd_ratio
            bwd_ms = perf.bwd_comms / bwd_ratio
            fwd_codec = fwd.codec_ms(raw_bytes) if fwd is not None else 0.0
            bwd_codec = bwd.codec_ms(raw_bytes) if bwd is not None else 0.0
            shard.perf = dataclasses.replace(
                perf, fwd_comms=fwd_ms + fwd_codec, bwd_comms=bwd_ms + bwd_codec
            )
            costs.append(
                ShardCost(
                    fwd_raw_bytes=raw_bytes,
                    fwd_wire_bytes=raw_bytes / fwd_ratio,
                    fwd_comms_ms=fwd_ms,
                    bwd_comms_ms=bwd_ms,
                    codec_ms=fwd_codec + bwd_codec,
                    fwd_format="replicated" if dp else (fwd.name if fwd else "raw"),
                    bwd_format="all-reduce" if dp else (bwd.name if bwd else "raw"),
                )
            )
        return costs
