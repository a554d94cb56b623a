"""Single-process tests of the compression-aware planner (exact costs, steering, explanation)."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import (
    CommType,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError, ShardingOption
from torchrec.distributed.types import ShardingType

from torchrec_lossy import plan as plan_cli
from torchrec_lossy.config import (
    ConfigError,
    EmbeddingTableConfig,
    LossyCommsConfig,
    LossyPlanConfig,
    PlannerConfig,
    TableCodecConfig,
    TopologyConfig,
    from_dict,
)
from torchrec_lossy.planner import (
    CommsModel,
    LossyCommsModel,
    LossyShardingPlanner,
    build_module,
    build_topology,
    calibrate,
    qcomm_model,
    raw_model,
    synthetic_blocks,
)
from torchrec_lossy.planner.cost import MX4_RATIO, FixedCommsModel, TableComms, WireFormat
from torchrec_lossy.planner.estimator import LossyPerfEstimator

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GIB = float(1 << 30)
TW = ShardingType.TABLE_WISE.value
RW = ShardingType.ROW_WISE.value
DP = ShardingType.DATA_PARALLEL.value


def tables(*sizes: int, dim: int = 64) -> tuple[EmbeddingTableConfig, ...]:
    return tuple(EmbeddingTableConfig(f"t{i}", n, dim) for i, n in enumerate(sizes))


def estimate(
    estimator: object, config: LossyPlanConfig, sharder: object | None = None
) -> dict[tuple[str, str, str], ShardingOption]:
    """Every estimated option of the config's model, by (table, sharding type, kernel)."""
    topology = build_topology(config.topology)
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=512,
        estimator=[estimator, EmbeddingStorageEstimator(topology)],
    )
    options = enumerator.enumerate(
        build_module(config.embedding_tables), [sharder or EmbeddingBagCollectionSharder()]
    )
    return {(o.name, o.sharding_type, o.compute_kernel): o for o in options}


def fused(
    options: dict[tuple[str, str, str], ShardingOption], table: str, sharding: str
) -> ShardingOption:
    """The option with TorchRec's fused kernel (dense for data-parallel)."""
    return options[(table, sharding, "dense" if sharding == DP else "fused")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------------
# Exact costs
# ------------------------------------------------------------------------------------------------


def test_exact_tw_costs_with_compression() -> None:
    config = LossyPlanConfig(topology=TopologyConfig(world_size=2), embedding_tables=tables(1000))
    topology = build_topology(config.topology)
    torchrec = estimate(EmbeddingPerfEstimator(topology), config)
    fmt = WireFormat("lossy", ratio=8.0, encode_gib_s=100.0, decode_gib_s=50.0)
    model = FixedCommsModel("test", "test", TableComms(fwd=fmt))
    ours = estimate(LossyPerfEstimator(topology, model), config)

    # TorchRec: batch 512 x world 2 x dim 64 x fp32 over the intra-host bandwidth (one host).
    raw_bytes = 512 * 2 * 64 * 4
    base = fused(torchrec, "t0", TW).shards[0].perf
    assert base.fwd_comms == pytest.approx(raw_bytes / INTRA_NODE_BANDWIDTH, rel=1e-12)
    perf = fused(ours, "t0", TW).shards[0].perf
    codec_ms = raw_bytes / (100 * GIB / 1000) + raw_bytes / (50 * GIB / 1000)
    assert perf.fwd_comms == pytest.approx(
        raw_bytes / INTRA_NODE_BANDWIDTH / 8 + codec_ms, rel=1e-12
    )
    # The backward stays raw; compute terms are TorchRec's.
    assert perf.bwd_comms == base.bwd_comms
    assert (perf.fwd_compute, perf.bwd_compute) == (base.fwd_compute, base.bwd_compute)
    # Data-parallel has no embedding all-to-all to compress.
    assert fused(ours, "t0", DP).shards[0].perf == fused(torchrec, "t0", DP).shards[0].perf


def two_hosts(intra_host: str = "auto", device: str = "cuda") -> LossyPlanConfig:
    """2 hosts x 2 ranks, one 32-column table; forward ratio 20, backward 4, codec 200/50."""
    return LossyPlanConfig(
        comms=LossyCommsConfig(backward="lossy", intra_host=intra_host, format="entropy"),  # type: ignore[arg-type]
        planner=PlannerConfig(
            expected_ratio=20.0, backward_ratio=4.0, encode_gib_s=200.0, decode_gib_s=50.0
        ),
        topology=TopologyConfig(world_size=4, local_world_size=2, compute_device=device),
        embedding_tables=tables(5000, dim=32),
    )


def codec_ms(raw: float) -> float:
    """The 200/50 GiB/s codec's encode + decode time of ``raw`` bytes."""
    return raw / (200 * GIB / 1000) + raw / (50 * GIB / 1000)


def test_exact_per_destination_costs_on_two_hosts() -> None:
    """A TW shard's 4 blocks (512 rows x 32 fp32 columns each): the own block and the one
    same-host peer's at the intra-host bandwidth, the 2 cross-host ones at the inter-host
    bandwidth; intra_host=auto on CUDA (NCCL) sends the same-host block raw, without codec."""
    config = two_hosts()
    topology = build_topology(config.topology)
    model = LossyCommsModel(config, CROSS_NODE_BANDWIDTH)
    assert model.same_host_raw
    shard = fused(estimate(LossyPerfEstimator(topology, model), config), "t0", TW).shards[0]
    block = 512 * 32 * 4
    perf = shard.perf
    # Forward: own + same-host block raw, 2 cross-host blocks at 20x, codec on those 2 only.
    assert perf.fwd_comms == pytest.approx(
        2 * block / INTRA_NODE_BANDWIDTH
        + 2 * block / 20 / CROSS_NODE_BANDWIDTH
        + codec_ms(2 * block),
        rel=1e-12,
    )
    # Backward (lossy at 4x): the same split.
    assert perf.bwd_comms == pytest.approx(
        2 * block / INTRA_NODE_BANDWIDTH
        + 2 * block / 4 / CROSS_NODE_BANDWIDTH
        + codec_ms(2 * block),
        rel=1e-12,
    )


def per_class_costs(intra_host: str, device: str = "cuda") -> tuple[Any, Any]:
    """(ShardCost, perf) of the two-host TW shard of t0 under ``intra_host``."""
    config = two_hosts(intra_host, device)
    estimator = LossyPerfEstimator(
        build_topology(config.topology), LossyCommsModel(config, CROSS_NODE_BANDWIDTH)
    )
    option = fused(estimate(estimator, config), "t0", TW)
    from torchrec_lossy.planner.estimator import option_key

    return estimator.shard_costs[option_key(option)][0], option.shards[0].perf


def test_intra_host_coded_or_raw_moves_the_price_the_right_way() -> None:
    block = 512 * 32 * 4
    raw, raw_perf = per_class_costs("raw")
    coded, coded_perf = per_class_costs("coded")
    # Cross-host blocks are coded either way: same bytes, same time.
    assert raw.fwd_links.cross_host_bytes == coded.fwd_links.cross_host_bytes == 2 * block / 20
    assert raw.bwd_links.cross_host_bytes == coded.bwd_links.cross_host_bytes == 2 * block / 4
    # Same host: raw sends the peer's block as it is, coded at the ratio; the own block is
    # never coded.
    assert raw.fwd_links.same_host_bytes == 2 * block
    assert coded.fwd_links.same_host_bytes == pytest.approx(block + block / 20, rel=1e-12)
    assert coded.bwd_links.same_host_bytes == pytest.approx(block + block / 4, rel=1e-12)
    # Codec time: 2 coded blocks per direction (raw) vs 3 (coded).
    assert raw.codec_ms == pytest.approx(2 * codec_ms(2 * block), rel=1e-12)
    assert coded.codec_ms == pytest.approx(2 * codec_ms(3 * block), rel=1e-12)
    assert coded_perf.fwd_comms == pytest.approx(
        (block + block / 20) / INTRA_NODE_BANDWIDTH
        + 2 * block / 20 / CROSS_NODE_BANDWIDTH
        + codec_ms(3 * block),
        rel=1e-12,
    )
    # Behind a 600 GiB/s intra-host link the codec costs more than it saves: raw is cheaper.
    assert raw_perf.fwd_comms < coded_perf.fwd_comms
    assert raw_perf.bwd_comms < coded_perf.bwd_comms
    # auto resolves by the compute device's backend: raw on CUDA (NCCL), coded on CPU (gloo).
    assert per_class_costs("auto")[0] == raw
    auto_cpu = per_class_costs("auto", "cpu")[0]
    assert auto_cpu.fwd_links.same_host_bytes == coded.fwd_links.same_host_bytes


def test_one_host_with_intra_host_raw_prices_no_codec_time() -> None:
    one_host = dataclasses.replace(small_config(), topology=TopologyConfig(world_size=2))
    tw_only = {n: ParameterConstraints(sharding_types=[TW]) for n in ("big", "mid")}
    planner = plan_small(one_host, constraints=tw_only)
    assert planner.step_cost().codec_ms == 0.0
    big = next(t for t in planner.planned_tables if t.name == "big")
    assert big.collective == "a2a" and big.codec_ms == 0.0
    assert big.fwd_wire_bytes == big.fwd_raw_bytes == big.fwd_same_host_bytes
    assert big.fwd_cross_host_bytes == 0.0
    assert "no block is coded, no codec time" in planner.explain().splitlines()[1]
    # Forced coded, the same plan pays the codec on every peer but the own block (1 of 2).
    coded = dataclasses.replace(
        one_host, comms=dataclasses.replace(one_host.comms, intra_host="coded")
    )
    big = next(t for t in plan_small(coded, constraints=tw_only).planned_tables if t.name == "big")
    half = big.fwd_raw_bytes / 2
    assert big.fwd_wire_bytes == pytest.approx(half + half / 10, rel=1e-12)
    assert big.codec_ms > 0


def test_twrw_cross_host_hop_is_credited() -> None:
    """TWRW: TorchRec's intra-host reduce-scatter stays, its cross-host all-to-all (one block
    per host: batch x 2 hosts x cols) is priced per destination in the lossy formats."""
    config = two_hosts()
    topology = build_topology(config.topology)
    torchrec = estimate(EmbeddingPerfEstimator(topology), config)
    model = LossyCommsModel(config, CROSS_NODE_BANDWIDTH)
    ours = estimate(LossyPerfEstimator(topology, model), config)
    twrw = ShardingType.TABLE_ROW_WISE.value
    hop = 512 * 2 * 32 * 4  # per shard: the whole table's columns
    for base, shard in zip(
        fused(torchrec, "t0", twrw).shards, fused(ours, "t0", twrw).shards, strict=True
    ):
        # Own host's block raw at the intra-host bandwidth, the other host's coded (forward
        # 20x, backward 4x).
        own, other = hop / 2, hop / 2
        for ours_ms, torchrec_ms, ratio in (
            (shard.perf.fwd_comms, base.perf.fwd_comms, 20),
            (shard.perf.bwd_comms, base.perf.bwd_comms, 4),
        ):
            reduce_scatter = torchrec_ms - hop / CROSS_NODE_BANDWIDTH
            assert reduce_scatter > 0
            assert ours_ms == pytest.approx(
                reduce_scatter
                + own / INTRA_NODE_BANDWIDTH
                + other / ratio / CROSS_NODE_BANDWIDTH
                + codec_ms(other),
                rel=1e-12,
            )
        assert shard.perf.fwd_comms < base.perf.fwd_comms


def test_backward_priced_per_table_like_the_forward() -> None:
    """The default (lossy) backward: a calibrated ratio per table, else planner.backward_ratio,
    the codec's time; with format auto, raw where the codec does not pay."""
    planner = PlannerConfig(backward_ratio=12.0, encode_gib_s=200.0, decode_gib_s=50.0)
    config = LossyPlanConfig(planner=planner, embedding_tables=tables(5000, dim=32))
    assert config.comms.backward == "lossy"  # the default
    model = LossyCommsModel(config, CROSS_NODE_BANDWIDTH, backward_ratios={"t0": 30.0})
    assert model.for_table("t0").bwd == WireFormat("lossy", 30.0, 200.0, 50.0)
    assert model.for_table("t1").bwd == WireFormat("lossy", 12.0, 200.0, 50.0)
    assert model.for_table("t1").row_wise_all_to_all  # RW gradients ride the coded all-to-all
    # A codec far slower than the link: the backward goes raw (or cast, the casts being
    # candidates) when the planner may drop it.
    slow = PlannerConfig(encode_gib_s=1e-3, decode_gib_s=1e-3)
    dropped = LossyCommsModel(LossyPlanConfig(planner=slow), CROSS_NODE_BANDWIDTH)
    assert dropped.for_table("t0").bwd.name in ("raw", "fp16", "bf16")  # not the codec
    none = LossyPlanConfig(comms=LossyCommsConfig(backward="none"))
    assert LossyCommsModel(none, CROSS_NODE_BANDWIDTH).for_table("t0").bwd.name == "raw"


@pytest.mark.parametrize("sharding", [TW, RW])
def test_fp16_model_equals_torchrec_qcomm_pricing(sharding: str) -> None:
    """Ratio 2 without codec time is exactly TorchRec's pricing of an FP16 qcomm registry: on
    one host for the all-to-all (across hosts ours prices each link at its own bandwidth), on
    two hosts for TorchRec's row-wise reduce-scatter."""
    config = LossyPlanConfig(
        topology=TopologyConfig(world_size=4, local_world_size=4 if sharding == TW else 2),
        embedding_tables=tables(100_000, dim=128),
    )
    topology = build_topology(config.topology)
    registry = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.FP16)
    )
    torchrec = estimate(
        EmbeddingPerfEstimator(topology),
        config,
        EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry),
    )
    fp16 = WireFormat("fp16", 2.0)
    free_fp16 = FixedCommsModel("fp16", "fp16", TableComms(fp16, fp16, fp16, fp16))
    ours = estimate(LossyPerfEstimator(topology, free_fp16), config)
    for a, b in zip(
        fused(torchrec, "t0", sharding).shards, fused(ours, "t0", sharding).shards, strict=True
    ):
        assert b.perf.fwd_comms == pytest.approx(a.perf.fwd_comms, rel=1e-12)
        assert b.perf.bwd_comms == pytest.approx(a.perf.bwd_comms, rel=1e-12)


def test_qcomm_and_raw_models() -> None:
    assert pytest.approx(128 / 17) == MX4_RATIO
    mx4 = qcomm_model("mx4", "fp16", "cuda").for_table("x")
    assert (mx4.fwd.name, mx4.fwd.ratio, mx4.fwd_rs.name, mx4.bwd.name) == (
        "mx4",
        MX4_RATIO,
        "fp16",
        "fp16",
    )
    # MX4 both ways (TorchRec users' production setting): the reduce-scatter's backward has no
    # MX4 in TorchRec and falls back to BF16.
    both = qcomm_model("mx4", "mx4", "cpu").for_table("x")
    assert (both.bwd.name, both.bwd.ratio, both.bwd_rs.name, both.bwd_rs.ratio) == (
        "mx4",
        MX4_RATIO,
        "bf16",
        2.0,
    )
    assert raw_model().for_table("x") == TableComms()
    for model in (raw_model(), qcomm_model("fp16", "none", "cpu")):
        assert isinstance(model, CommsModel)
    config = LossyPlanConfig()
    assert isinstance(LossyCommsModel(config, 1.0), CommsModel)
    assert WireFormat("x", 2.0, 1.0, 2.0).codec_ms(GIB) == pytest.approx(1000 + 500)
    with pytest.raises(ValueError, match="ratio"):
        WireFormat("x", 0.0)


# ------------------------------------------------------------------------------------------------
# Steering and plans
# ------------------------------------------------------------------------------------------------


def small_config(**planner: object) -> LossyPlanConfig:
    return LossyPlanConfig(
        comms=LossyCommsConfig(
            tables={"raw_*": TableCodecConfig(compress=False)}, format="entropy"
        ),
        planner=PlannerConfig(global_batch_size=8192, **planner),
        topology=TopologyConfig(world_size=4, local_world_size=2),
        embedding_tables=(
            EmbeddingTableConfig("big", 2_000_000, 64),
            EmbeddingTableConfig("mid", 50_000, 64),
            EmbeddingTableConfig("tiny", 4, 64),
            EmbeddingTableConfig("raw_big", 2_000_000, 64),
        ),
    )


def plan_small(config: LossyPlanConfig, **kwargs: object) -> LossyShardingPlanner:
    planner = LossyShardingPlanner(config, stats=[], debug=False, **kwargs)
    planner.plan(build_module(config.embedding_tables), [EmbeddingBagCollectionSharder()])
    return planner


def test_row_wise_is_offered_and_priced_with_the_codec() -> None:
    planner = plan_small(small_config())
    assert planner._lossy_enumerator.excluded == {}  # nothing steered off RW/TWRW any more
    plan = {t.name: t for t in planner.planned_tables}
    assert plan["big"].fwd_format == "lossy"
    # The chosen TWRW's cross-host hop: half its blocks (the other host's) coded at 10x.
    big = plan["big"]
    assert big.sharding_type == ShardingType.TABLE_ROW_WISE.value
    hop = big.fwd_raw_bytes / 3  # the reduce-scatter's B plus the hop's B x 2 hosts / 4 ranks
    assert big.fwd_cross_host_bytes == pytest.approx(hop / 2 / 10, rel=1e-12)
    assert big.fwd_wire_bytes == pytest.approx(2 * hop + hop / 2 + hop / 20, rel=1e-12)
    # Replicating a 4-row table beats any all-to-all.
    assert plan["tiny"].sharding_type == DP
    assert plan["tiny"].ranks == (0, 1, 2, 3)
    assert plan["raw_big"].fwd_format == "raw"
    assert "compress: false" in plan["raw_big"].reason
    assert "no RW" not in plan["big"].reason
    # Forced row-wise: the partial sums at the table's ratio, the same bytes as TW.
    row_wise = plan_small(
        small_config(), constraints={"big": ParameterConstraints(sharding_types=[RW])}
    )
    rw = next(t for t in row_wise.planned_tables if t.name == "big")
    assert rw.sharding_type == RW and rw.fwd_format == "lossy"
    # Each of the 4 row shards sends partial sums of the whole global batch (2048 x 4 ranks).
    assert rw.fwd_raw_bytes == 4 * (2048 * 4 * 64 * 4)
    # Per shard: own and same-host blocks raw (CUDA: intra_host auto is raw), 2 of 4 coded.
    assert rw.fwd_cross_host_bytes == pytest.approx(rw.fwd_raw_bytes / 2 / 10, rel=1e-12)
    assert rw.fwd_wire_bytes == pytest.approx(rw.fwd_raw_bytes * (0.5 + 0.05), rel=1e-12)


def test_embedding_collection_tables_are_priced_with_the_codec() -> None:
    """Sequence tables: one output row per id, coded at the table's ratio (RW too: TorchRec's
    row-wise sequence sharding travels by all-to-all)."""
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    config = small_config()
    ec = EmbeddingCollection(
        tables=[
            EmbeddingConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=[f"f_{t.name}"],
            )
            for t in config.embedding_tables
        ],
        device=torch.device("meta"),
    )
    lengths = {f"f_{t.name}": [50.0] for t in config.embedding_tables}
    constraints = {
        t.name: ParameterConstraints(pooling_factors=lengths[f"f_{t.name}"])
        for t in config.embedding_tables
    }
    constraints["big"] = ParameterConstraints(sharding_types=[RW], pooling_factors=[50.0])
    planner = LossyShardingPlanner(config, stats=[], debug=False, constraints=constraints)
    planner.plan(ec, [EmbeddingCollectionSharder()])
    plan = {t.name: t for t in planner.planned_tables}
    assert [t.name for t in planner.planned_tables] == ["big", "mid", "tiny", "raw_big"]
    big = plan["big"]
    assert big.sharding_type == RW and big.fwd_format == "lossy"
    # 50 ids per sample, 2,048 samples per rank (8,192 / 4 ranks), 64 fp32 columns, per shard.
    assert big.fwd_raw_bytes == len(big.ranks) * 50 * 8192 * 64 * 4
    # Blocks for the other host coded at 10x, the own and same-host ones raw.
    assert big.fwd_wire_bytes == pytest.approx(big.fwd_raw_bytes * (0.5 + 0.05), rel=1e-12)
    assert plan["raw_big"].fwd_format == "raw"


def test_explained_plan_and_step_cost() -> None:
    config = small_config()
    planner = plan_small(
        dataclasses.replace(config, comms=dataclasses.replace(config.comms, format="auto"))
    )
    text = planner.explain()
    lines = text.splitlines()
    assert lines[0].startswith("torchrec-lossy: forward format auto")
    assert "speeds: entropy 200/60" in lines[0]  # what the choice used (cuda defaults here)
    assert lines[1].startswith("format auto chose on the cross-host link: entropy for 3 tables")
    assert lines[2].split()[:5] == ["table", "rows", "dim", "sharding", "collective"]
    assert [line.split()[0] for line in lines[3:]] == ["big", "mid", "tiny", "raw_big", "total"]
    cost = planner.step_cost()
    plan = planner.planned_tables
    assert cost.fwd_raw_bytes == sum(t.fwd_raw_bytes for t in plan)
    assert cost.comms_ms <= sum(t.fwd_comms_ms + t.bwd_comms_ms + t.codec_ms for t in plan)
    assert cost.planner_ms >= cost.comms_ms > 0


def test_no_usable_option_names_table_and_fix() -> None:
    config = small_config(data_parallel=False)
    with pytest.raises(PlannerError, match=r"table\(s\) \['big'\].*data_parallel"):
        plan_small(config, constraints={"big": ParameterConstraints(sharding_types=[DP])})


def test_data_parallel_can_be_switched_off() -> None:
    planner = plan_small(small_config(data_parallel=False))
    assert DP not in {t.sharding_type for t in planner.planned_tables}


def small_one_host(**comms: Any) -> LossyPlanConfig:
    """small_config's tables on one host of 2 ranks, with ``comms`` changes."""
    base = small_config()
    return dataclasses.replace(
        base,
        comms=dataclasses.replace(base.comms, **comms),
        topology=TopologyConfig(world_size=2),
    )


def test_entropy_format_codes_even_where_the_codec_does_not_pay() -> None:
    # One host: 600 GiB/s links, a 200/60 GiB/s codec cannot pay for itself (every peer coded).
    one_host = small_one_host(intra_host="coded")
    planner = plan_small(one_host)
    big = next(t for t in planner.planned_tables if t.name == "big")
    # The cheapest path on one host is TWRW's intra-host reduce-scatter, raw.
    assert big.sharding_type == "table_row_wise" and big.fwd_format == "raw"
    assert planner.comms_config is one_host.comms  # format entropy: nothing to resolve
    assert "format auto" not in planner.explain()
    tw_only = {"big": ParameterConstraints(sharding_types=[TW])}
    big = next(
        t for t in plan_small(one_host, constraints=tw_only).planned_tables if t.name == "big"
    )
    assert big.fwd_format == "lossy" and "13.10 of raw time" in big.reason


def test_auto_sends_raw_where_the_codec_does_not_pay_and_says_so_once() -> None:
    one_host = small_one_host(format="auto")
    tw_only = {n: ParameterConstraints(sharding_types=[TW]) for n in ("big", "mid", "raw_big")}
    planner = plan_small(one_host, constraints=tw_only)
    big = next(t for t in planner.planned_tables if t.name == "big")
    assert big.fwd_format == "raw" and "format auto: raw is faster" in big.reason
    lines = planner.explain().splitlines()
    # One line says what auto chose and why; none says the codec does not pay while coding.
    assert sum("format auto chose" in x for x in lines) == 1, lines[:3]
    assert "raw for 3 tables" in lines[1] and "entropy" in lines[1], lines[1]
    assert "does not pay" not in planner.explain()
    effective = planner.comms_config
    assert [effective.table(n).format for n in ("big", "mid", "tiny", "raw_big")] == ["raw"] * 4
    assert [effective.table(n).compress for n in ("big", "mid", "tiny", "raw_big")] == [False] * 4
    assert effective.format == "entropy" and effective.intra_host == "coded"
    # On a slow link the codec pays: auto codes every compressible table.
    slow = dataclasses.replace(
        one_host, topology=TopologyConfig(world_size=2, intra_host_bandwidth_gib_s=0.116)
    )
    effective = plan_small(slow, constraints=tw_only).comms_config
    assert [effective.table(n).format for n in ("big", "mid", "raw_big")] == [
        "entropy",
        "entropy",
        "raw",
    ]


def test_drop_unprofitable_is_refused_naming_its_replacement() -> None:
    with pytest.raises(
        ConfigError, match=r"planner.drop_unprofitable was replaced: .*comms.format"
    ):
        from_dict(LossyPlanConfig, {"planner": {"drop_unprofitable": True}})


def test_calibration_measures_the_codec_and_feeds_the_plan() -> None:
    config = small_config()
    blocks = synthetic_blocks(config.embedding_tables, 256)
    results = calibrate(blocks, config.comms)
    from torchrec_lossy.codec import compress

    for name, block in blocks.items():
        r = results[name]
        assert r.raw_bytes == block.numel() * 4
        if name == "raw_big":
            assert r.wire_bytes == r.raw_bytes
            continue
        span = float(block.max() - block.min())
        assert r.abs_bound == pytest.approx(config.comms.default_bound.value * span)
        assert r.wire_bytes == compress([block], [r.abs_bound]).numel()
        assert r.ratio > 1.5
    planner = LossyShardingPlanner(config, stats=[], debug=False)
    module = build_module(config.embedding_tables)
    planner.plan(module, [EmbeddingBagCollectionSharder()])
    planner.calibrate(blocks)
    planner.plan(module, [EmbeddingBagCollectionSharder()])
    big = next(t for t in planner.planned_tables if t.name == "big")
    assert f"ratio {results['big'].ratio:.1f}x (calibrated)" in big.reason
    # Its cross-host blocks travel at the calibrated ratio.
    cross_raw = {"a2a": big.fwd_raw_bytes / 2, "rs+a2a": big.fwd_raw_bytes / 6}[big.collective]
    assert cross_raw / big.fwd_cross_host_bytes == pytest.approx(results["big"].ratio)
    assert "(calibrated)" in big.reason


def test_sharder_carries_the_comms_config() -> None:
    sharder_mod = pytest.importorskip("torchrec_lossy.distributed.sharder")
    from torchrec_lossy.adaptive import AdaptiveBounds

    config = small_config()
    sharder = LossyShardingPlanner(config, stats=[]).sharder(fused_params={"learning_rate": 0.1})
    assert isinstance(sharder, sharder_mod.LossyEmbeddingBagCollectionSharder)
    assert sharder.comms_config is config.comms
    assert sharder.fused_params == {"learning_rate": 0.1}
    assert sharder.bounds_factory is AdaptiveBounds


def test_pooled_blocks_stacks_a_tables_features() -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lossy.planner import pooled_blocks

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name="t", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"]
            )
        ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4, 5, 6]),
        lengths=torch.tensor([1, 1, 1, 2, 1, 0]),
    )
    blocks = pooled_blocks(ebc, kjt)
    weight = ebc.embedding_bags["t"].weight.detach()
    assert blocks["t"].shape == (6, 4)
    assert torch.allclose(blocks["t"][0], weight[1])
    assert torch.allclose(blocks["t"][3], weight[4] + weight[5])


# ------------------------------------------------------------------------------------------------
# The preview command
# ------------------------------------------------------------------------------------------------


def run_preview(*argv: str) -> str:
    out = io.StringIO()
    config = plan_cli._apply_overrides(
        plan_cli.load_yaml(LossyPlanConfig, argv[1]), plan_cli._parse(list(argv))
    )
    plan_cli.preview(config, out=out)
    return out.getvalue()


@pytest.mark.parametrize(
    ("config", "args", "ranks", "batch"),
    [
        (
            "criteo_1tb.yaml",
            ["--world-size", "16", "--local-world-size", "8", "--batch-size", "65536"],
            16,
            4096,
        ),
        ("criteo_kaggle.yaml", [], 8, 2048),
    ],
)
def test_preview_on_shipped_configs(config: str, args: list[str], ranks: int, batch: int) -> None:
    text = run_preview("--config", str(CONFIGS / config), *args)
    lines = text.splitlines()
    assert lines[0].startswith("26 tables, ") and f"{ranks} ranks" in lines[0]
    assert f"batch {batch:,} per rank" in lines[0]
    table_rows = [line for line in lines if line.startswith("t_cat_")]
    assert [line.split()[0] for line in table_rows] == [f"t_cat_{i}" for i in range(26)]
    for line in table_rows:
        assert line.split()[3] in {"TW", "CW", "TWCW", "DP"}
    summary = lines[lines.index(next(x for x in lines if x.startswith("scenario"))) :]
    names = [row.split("  ")[0] for row in summary[1:5]]
    assert names == ["no compression", "TorchRec FP16", "TorchRec MX4", "torchrec-lossy"]
    wire = {row.split("  ")[0]: row.split() for row in summary[1:5]}
    assert float(wire["torchrec-lossy"][-2]) < float(wire["TorchRec MX4"][-2])


def test_preview_main_reports_config_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("planner: {expected_ratio: 0}\n")
    assert plan_cli.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "planner.expected_ratio=0.0 is invalid: allowed [0.5, 10000]" in err
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: "), err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "embedding_tables is empty: list the tables to plan"),
        ("comms: [\n", "not valid YAML at line 2, column 1: expected the node content"),
        ("comms:\n  backward: x\n   bad: 1\n", "not valid YAML at line 3, column 7"),
    ],
)
def test_preview_main_empty_or_malformed_yaml_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert plan_cli.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    # One line naming the file, where and the fix; no traceback.
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: {message}"), err
    assert "Traceback" not in err
    missing = tmp_path / "none.yaml"
    assert plan_cli.main(["--config", str(missing)]) == 2
    assert "cannot read it (No such file or directory)" in capsys.readouterr().err


def test_collective_plan_matches_plan() -> None:
    """collective_plan plans on rank 0 and broadcasts (a one-rank gloo group here)."""
    import torch.distributed as dist

    config = small_config()
    module = build_module(config.embedding_tables)
    expected = plan_small(config).plan(module, [EmbeddingBagCollectionSharder()])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        planner = LossyShardingPlanner(config, stats=[], debug=False)
        got = planner.collective_plan(module, [EmbeddingBagCollectionSharder()])
    finally:
        dist.destroy_process_group()
    assert str(got) == str(expected)
    assert [t.name for t in planner.planned_tables] == ["big", "mid", "tiny", "raw_big"]


def test_configured_bandwidths_reach_the_topology() -> None:
    """A bandwidth in the config overrides TorchRec's default; the others keep the default."""
    from torchrec_lossy.config import TopologyConfig
    from torchrec_lossy.planner.planner import build_topology

    default = build_topology(TopologyConfig(world_size=4, local_world_size=2))
    slow = build_topology(
        TopologyConfig(world_size=4, local_world_size=2, inter_host_bandwidth_gib_s=0.125)
    )
    assert slow.inter_host_bw == pytest.approx(0.125 * 1024**3 / 1000)
    assert slow.inter_host_bw < default.inter_host_bw
    assert slow.intra_host_bw == default.intra_host_bw
    assert slow.hbm_mem_bw == default.hbm_mem_bw


def test_preview_measures_speeds_and_says_what_auto_chose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "topology: {world_size: 2, compute_device: cpu, intra_host_bandwidth_gib_s: 0.116}\n"
        "planner: {global_batch_size: 256}\n"
        "embedding_tables:\n"
        "  - {name: a, num_embeddings: 5000, embedding_dim: 16}\n"
        "  - {name: b, num_embeddings: 50000, embedding_dim: 16}\n"
    )
    assert plan_cli.main(["--config", str(path), "--measure-speeds"]) == 0
    out = capsys.readouterr().out
    assert "measured on cpu, 2 blocks x 128 rows" in out, out[:2000]
    # Once, with the estimate that decided (which way depends on this machine's measured speed).
    chose = [x for x in out.splitlines() if x.startswith("format auto chose")]
    assert len(chose) == 1 and "at 0.116 GiB/s, time vs raw: entropy" in chose[0], chose
