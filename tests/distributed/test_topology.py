"""Topology-aware coding: same-host peers travel raw, cross-host peers coded, bytes per link."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import (
    EXACT_BACKWARD,
    TrainRun,
    local_weights,
    make_batch,
    make_tables,
    run_workers,
)

from torchrec_lossy.config import ConfigError, LossyCommsConfig
from torchrec_lossy.distributed.topology import (
    intra_host_raw,
    local_world_size,
    same_host_peers,
)

# One table-wise table per rank of 2 hosts x 2 ranks, plus a column-wise one over all four.
TABLES = [
    ("t0", 40, 16, ["f0"]),
    ("t1", 30, 16, ["f1"]),
    ("t2", 50, 16, ["f2"]),
    ("t3", 20, 16, ["f3"]),
    ("t4", 60, 32, ["f4"]),
]
OWNER = {"t0": 0, "t1": 1, "t2": 2, "t3": 3}
BATCH = 16


def test_same_host_peers_follow_consecutive_ranks() -> None:
    assert same_host_peers([0, 1, 2, 3], 0, 2) == {1}
    assert same_host_peers([0, 1, 2, 3], 3, 2) == {2}
    assert same_host_peers([0, 1, 2, 3], 1, 4) == {0, 2, 3}
    assert same_host_peers([0, 1, 2, 3], 2, 1) == set()
    # A subgroup: indices in the group, hosts by global rank.
    assert same_host_peers([1, 2, 5, 6], 0, 4) == {1}


def test_local_world_size_from_config_env_or_one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_world_size(LossyCommsConfig(), 8) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_world_size(LossyCommsConfig(), 8) == 4
    assert local_world_size(LossyCommsConfig(local_world_size=2), 8) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='four'"):
        local_world_size(LossyCommsConfig(), 8)
    with pytest.raises(ConfigError, match="local_world_size"):
        LossyCommsConfig(local_world_size=0)
    with pytest.raises(ConfigError, match="intra_host"):
        LossyCommsConfig(intra_host="nvlink")  # type: ignore[arg-type]


def test_auto_sends_same_host_peers_raw_on_nccl_only() -> None:
    auto, raw, coded = (LossyCommsConfig(intra_host=m) for m in ("auto", "raw", "coded"))
    assert intra_host_raw(auto, "nccl") and not intra_host_raw(auto, "gloo")
    assert intra_host_raw(raw, "gloo") and not intra_host_raw(coded, "nccl")


def _plan() -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import column_wise, table_wise

    return {**{t: table_wise(rank=r) for t, r in OWNER.items()}, "t4": column_wise(ranks=[0, 3])}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_lossy.config import ErrorBound, InputDistConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    tables = make_tables(TABLES)
    kjt = make_batch(tables, BATCH, seed=11 + rank)
    hosts = {"local_world_size": 2}

    def lossy(**kw: Any) -> Any:
        return LossyEmbeddingBagCollectionSharder(comms_config=LossyCommsConfig(**hosts, **kw))

    def run(sharder: Any) -> TrainRun:
        return TrainRun(tables, sharder, _plan(), world_size)

    models = {
        "torchrec": run(EmbeddingBagCollectionSharder()),
        "coded": run(lossy(intra_host="coded", input_dist=InputDistConfig(dedupe_outputs=False))),
        # Every row travels (no output dedupe), so the raw bytes are exact.
        "raw": run(lossy(intra_host="raw", input_dist=InputDistConfig(dedupe_outputs=False))),
        "exact": run(
            lossy(intra_host="raw", default_bound=ErrorBound("absolute", 0.0), **EXACT_BACKWARD)
        ),
    }
    outs = {name: m.step(kjt, rank).detach() for name, m in models.items()}
    ref = outs["torchrec"]
    # Per table-wise table: whether each run's columns equal TorchRec's (plain bools: tensors
    # do not survive the trip back to the test process).
    equal: dict[tuple[str, str], bool] = {}
    # Worst error over the default relative bound (0.03 of each (source, table) block's range).
    err_over_bound: dict[tuple[str, str], float] = {}
    col = 0
    for table, _, dim, _ in TABLES[:4]:
        block = ref[:, col : col + dim]
        bound = 0.03 * float(block.max() - block.min())
        for name in ("coded", "raw"):
            got = outs[name][:, col : col + dim]
            equal[name, table] = torch.equal(got, block)
            err_over_bound[name, table] = float((got - block).abs().max()) / bound
        col += dim
    links = {
        name: {
            (d, link): m.model.module.lossy_stats.link_bytes(d, link)
            for d in ("fwd", "bwd")
            for link in ("same_host", "cross_host")
        }
        for name, m in models.items()
        if name != "torchrec"
    }
    mine, exact = local_weights(models["torchrec"].weights()), models["exact"].weights()
    return {
        "equal": equal,
        "err_over_bound": err_over_bound,
        "links": links,
        "exact_out_equal": torch.equal(outs["exact"], ref),
        "exact_weights_equal": all(
            torch.equal(a, b)
            for key, pieces in mine.items()
            for (_, a), (_, b) in zip(pieces, local_weights(exact)[key], strict=True)
        ),
    }


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(1500)  # 4 ranks x 4 models on 2 cores
def test_two_hosts_same_host_raw_cross_host_coded() -> None:
    results = run_workers(_worker, 4, timeout_s=1400)
    for rank, r in enumerate(results):
        equal, links = r["equal"], r["links"]
        for table, owner in OWNER.items():
            # Same-host owners' rows arrive raw (bit-equal to TorchRec); others coded (lossy).
            assert equal["raw", table] == (owner // 2 == rank // 2), (rank, table)
            assert equal["coded", table] == (owner == rank), (rank, table)
        assert r["exact_out_equal"] and r["exact_weights_equal"], rank
        raw, coded = links["raw"], links["coded"]
        # The cross-host payloads are the same either way; same-host ones grow to raw size.
        assert raw["fwd", "cross_host"] == coded["fwd", "cross_host"] > 0, (rank, links)
        assert raw["fwd", "same_host"] > coded["fwd", "same_host"] > 0, (rank, links)
        assert raw["bwd", "same_host"] > coded["bwd", "same_host"] > 0, (rank, links)
        # This rank's own forward blocks for its one same-host peer, raw: the batch's rows of
        # its table-wise table plus its column shard of t4 (16 of 32 columns), fp32.
        own = 16 + (16 if rank in (0, 3) else 0)
        assert raw["fwd", "same_host"] == BATCH * own * 4, (rank, raw)
        # Its gradient blocks for the same-host peer, raw fp32 (no output dedupe, so no
        # gradient dedupe): this rank's batch rows of the peer's table and t4 columns.
        peer = rank ^ 1
        peer_cols = 16 + (16 if peer in (0, 3) else 0)
        assert raw["bwd", "same_host"] == BATCH * peer_cols * 4, (rank, raw)
        # Coded blocks (cross-host under raw; every peer's under coded) within the bound.
        for (name, table), ratio in r["err_over_bound"].items():
            assert ratio <= 1 + 1e-5, (rank, name, table, ratio)
