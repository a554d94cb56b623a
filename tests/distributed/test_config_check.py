"""Ranks given different comms configs fail at sharding, all with one error naming the keys."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import (
    SHARDER_TABLES,
    make_ebc,
    make_tables,
    manual_plan,
    run_workers,
    sharder_plan,
)
from torchrec_lossy.config import ErrorBound, LossyCommsConfig
from torchrec_lossy.distributed.config_check import config_items, mismatch_message

pytestmark = pytest.mark.dist

# Per rank: the config's keyword arguments; what differs is what the error must name.
CASES: dict[str, list[dict[str, Any]]] = {
    "forward bound": [
        {"default_bound": ErrorBound("relative", 0.01)},
        {"default_bound": ErrorBound("relative", 0.03)},
    ],
    "backward": [{"backward": "lossy"}, {"backward": "none"}],
    "rank-local keys only": [
        {"error_sample_every": 4, "codec": {"backend": "cpu"}},
        {"error_sample_every": 0},
    ],
    "dedupe_outputs": [
        {"input_dist": {"dedupe_outputs": True}},
        {"input_dist": {"dedupe_outputs": False}},
    ],
    "same": [{}, {}],
}

# Per rank: the path its planner's auto resolved ("seam": this project's sharder, "torchrec":
# TorchRec's own all-to-all, checked).
PATHS: dict[str, tuple[str, str]] = {
    "seam": ("seam", "seam"),
    "torchrec": ("torchrec", "torchrec"),
    "mixed": ("torchrec", "seam"),
}


def _worker(rank: int, world_size: int, case: str, paths: str = "seam") -> dict[str, Any]:
    import dataclasses

    import torch
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_lossy.config import CodecConfig, InputDistConfig
    from torchrec_lossy.distributed import ConfigMismatchError, LossyEmbeddingBagCollectionSharder
    from torchrec_lossy.distributed.torchrec_path import CheckedEmbeddingBagCollectionSharder

    kwargs = dict(CASES[case][rank])
    if "codec" in kwargs:
        kwargs["codec"] = CodecConfig(**kwargs["codec"])
    if "input_dist" in kwargs:
        kwargs["input_dist"] = InputDistConfig(**kwargs["input_dist"])
    config = dataclasses.replace(LossyCommsConfig(), **kwargs)
    sharder: Any = (
        LossyEmbeddingBagCollectionSharder(comms_config=config)
        if PATHS[paths][rank] == "seam"
        else CheckedEmbeddingBagCollectionSharder(config)
    )
    tables = make_tables(SHARDER_TABLES)
    ebc = make_ebc(tables)
    plan = manual_plan(ebc, sharder, sharder_plan(), world_size)
    try:
        DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    except ConfigMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "key", "values"),
    [
        ("forward bound", "default_bound.value", ("0.01 on rank 0", "0.03 on rank 1")),
        pytest.param(
            "backward",
            "backward",
            ("'lossy' on rank 0", "'none' on rank 1"),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_different_configs_fail_on_every_rank_naming_the_key(
    case: str, key: str, values: tuple[str, str]
) -> None:
    errors = [r["error"] for r in run_workers(_worker, 2, case, timeout_s=240)]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert f"{key}: {values[0]}; {values[1]}" in errors[0], errors[0]
    # Only the differing key is named.
    assert errors[0].count(" on rank 0") == 1, errors[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "paths", "key", "values"),
    [
        ("forward bound", "torchrec", "default_bound.value", ("0.01 on rank 0", "0.03 on rank 1")),
        ("dedupe_outputs", "torchrec", "input_dist.dedupe_outputs", ("True", "False")),
        ("same", "mixed", "path", ('"TorchRec\'s own all-to-all" on rank 0', "<unset> on rank 1")),
    ],
)
def test_torchrecs_path_checks_the_configs_too(
    case: str, paths: str, key: str, values: tuple[str, str]
) -> None:
    # auto's TorchRec path (TorchRec's sharder) fails like the seam on a differing key, and a
    # rank on TorchRec's path against one on the seam fails too, naming the path.
    errors = [r["error"] for r in run_workers(_worker, 2, case, paths, timeout_s=240)]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert f"{key}: {values[0]}; {values[1]}" in errors[0] or (
        f"{key}: {values[0]} on rank 0; {values[1]} on rank 1" in errors[0]
    ), errors[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrecs_path_with_the_same_config_shards() -> None:
    assert [r["error"] for r in run_workers(_worker, 2, "same", "torchrec")] == [None, None]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_local_keys_may_differ() -> None:
    assert [r["error"] for r in run_workers(_worker, 2, "rank-local keys only")] == [None, None]


def test_config_items_cover_shared_keys_and_pattern_order() -> None:
    from torchrec_lossy.config import TableCodecConfig

    a = LossyCommsConfig(tables={"t*": TableCodecConfig(compress=False), "t1": TableCodecConfig()})
    b = LossyCommsConfig(tables={"t1": TableCodecConfig(), "t*": TableCodecConfig(compress=False)})
    ia, ib = config_items(a), config_items(b)
    assert ia["tables"] != ib["tables"]  # the first matching pattern wins: order matters
    assert ia["tables.t*.compress"] == "False"
    assert "input_dist.dedupe_outputs" in ia and "evaluation" in ia
    assert "error_sample_every" not in ia and "codec.backend" not in ia
    message = mismatch_message([ia, ib, ia], "ebc")
    assert "tables: ['t*', 't1'] on ranks 0, 2; ['t1', 't*'] on rank 1" in message, message


def _worker_agree(rank: int, world_size: int) -> dict[str, Any]:
    import dataclasses

    import torch

    from torchrec_lossy.config import EmbeddingTableConfig, LossyPlanConfig, TopologyConfig
    from torchrec_lossy.planner import LossyShardingPlanner, Speeds, agree_speeds

    # Rank 0's codec is fast enough to pay on the link, rank 1's is not: each alone would
    # resolve another config; agreed, both take the slowest figures.
    mine = Speeds({"entropy": (5.0, 5.0) if rank == 0 else (0.05, 0.05)}, "test", round_ms=0.1)
    agreed = agree_speeds(mine, torch.distributed.group.WORLD, torch.device("cpu"))
    config = LossyPlanConfig(
        topology=TopologyConfig(world_size=2, intra_host_bandwidth_gib_s=1.0),
        embedding_tables=(EmbeddingTableConfig("t", 1000, 16),),
    )
    alone = LossyShardingPlanner(config, speeds=mine, stats=[]).comms_config.table("t").format
    together = LossyShardingPlanner(config, speeds=agreed, stats=[]).comms_config
    return {
        "agreed": agreed.formats["entropy"],
        "alone": alone,
        "together": dataclasses.asdict(together.table("t")),
        "round_ms": agreed.round_ms,
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_speeds_are_agreed_so_every_rank_resolves_the_same_format() -> None:
    r0, r1 = run_workers(_worker_agree, 2, timeout_s=240)
    # What each would pick alone: rank 1's slow codec loses to raw or a cast (fp16 / bf16 are
    # candidates too, at their default speeds here).
    assert r0["alone"] == "entropy" and r1["alone"] in ("raw", "fp16", "bf16")
    assert r0["agreed"] == r1["agreed"] == pytest.approx((0.05, 0.05))
    assert r0["together"] == r1["together"] and r0["together"]["format"] == r1["alone"]
    assert r0["round_ms"] == r1["round_ms"] == pytest.approx(0.1)
