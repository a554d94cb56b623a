"""Table-row-wise and grid tables through the lossy sharder: the cross-host all-to-all coded.

Gloo ranks laid out as hosts by ``LOCAL_WORLD_SIZE`` (as torchrun sets it). Against TorchRec's
sharder: bit-equal at bound 0 with the exact backward; every value within its table's bound when
lossy (the intra-host reduce-scatter is exact and each value crosses hosts once); bytes on the
cross-host link coded.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch
from harness import (
    EXACT_BACKWARD,
    TrainRun,
    column_slices,
    make_batch,
    make_tables,
    reference_training,
    run_workers,
    same_local_pieces,
)

pytestmark = pytest.mark.dist

TABLES = [
    ("t0", 40, 8, ["f0"]),
    ("tr", 64, 8, ["g0", "g0b"]),
    ("tg", 48, 16, ["h0"]),
]


def _plan(hosts: int) -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import grid_shard, table_row_wise, table_wise

    return {
        "t0": table_wise(rank=0),
        "tr": table_row_wise(host_index=hosts - 1),
        "tg": grid_shard(host_indexes=[0]),  # one column shard: the generator makes one
    }


def _sharder(local_size: int, **comms: Any) -> Any:
    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    return LossyEmbeddingBagCollectionSharder(
        comms_config=LossyCommsConfig(local_world_size=local_size, **comms)
    )


def _worker(rank: int, world_size: int, local_size: int) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(local_size)  # TorchRec's host groups, as torchrun's
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist

    from torchrec_lossy.config import ErrorBound
    from torchrec_lossy.distributed.output_dist import LossyPooledEmbeddingsAllToAll

    hosts = world_size // local_size
    tables = make_tables(TABLES)
    steps, bound = 2, 0.01
    batches = [
        [make_batch(tables, 8, seed=100 * s + r) for r in range(world_size)] for s in range(steps)
    ]
    plan = _plan(hosts)
    runs = {
        "torchrec": TrainRun(tables, EmbeddingBagCollectionSharder(), plan, world_size, local_size),
        "exact": TrainRun(
            tables,
            _sharder(local_size, default_bound=ErrorBound("absolute", 0.0), **EXACT_BACKWARD),
            plan,
            world_size,
            local_size,
        ),
        "lossy": TrainRun(
            tables,
            _sharder(local_size, default_bound=ErrorBound("absolute", bound), **EXACT_BACKWARD),
            plan,
            world_size,
            local_size,
        ),
    }
    for s in range(steps):
        for run in runs.values():
            run.step(batches[s][rank], 1000 * s + rank)
    ref_outs, _ = reference_training(tables, batches, world_size, rank)
    tr, exact, lossy = runs["torchrec"], runs["exact"], runs["lossy"]
    sharded = lossy.model.module
    cross = [d._cross_dist for d in sharded._output_dists if isinstance(d, TwRwPooledEmbeddingDist)]
    cols = column_slices(tables)
    err = {
        t: max((lossy.outputs[0][:, c] - ref_outs[0][:, c]).abs().max().item() for c in cols[t])
        for t in cols
    }
    fwd = sharded.lossy_stats.tables("fwd")
    return {
        "types": sorted(type(s).__name__ for s in sharded._embedding_shardings),
        "exact_out_equal": all(
            torch.equal(a, b) for a, b in zip(exact.outputs, tr.outputs, strict=True)
        ),
        "exact_w_equal": same_local_pieces(exact.weights(), tr.weights()),
        "cross_lossy": bool(cross)
        and all(isinstance(c, LossyPooledEmbeddingsAllToAll) for c in cross),
        # The adapter relies on TorchRec creating `_cross_dist` lazily in this method.
        "adapter": "self._cross_dist = PooledEmbeddingsAllToAll("
        in inspect.getsource(TwRwPooledEmbeddingDist._create_output_dist_modules),
        "err": err,
        "fwd": {t: (fwd[t].raw_bytes, fwd[t].wire_bytes, fwd[t].max_error) for t in fwd},
        "cross_host_bytes": sharded.lossy_stats.link_bytes("fwd", "cross_host"),
        "bound": bound,
    }


def _check(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["types"] == [
            "LossyGridPooledEmbeddingSharding",
            "LossyTwPooledEmbeddingSharding",
            "LossyTwRwPooledEmbeddingSharding",
        ], r["types"]
        assert r["adapter"] and r["cross_lossy"], rank
        assert r["exact_out_equal"] and r["exact_w_equal"], rank
        for table, e in r["err"].items():
            assert e <= r["bound"] + 1e-6, (rank, table, r["err"])
        assert r["cross_host_bytes"] > 0
    # Whatever crossed hosts was coded: fewer bytes than raw, within the bound.
    for table in ("tr", "tg"):
        sent = [r["fwd"][table] for r in results if r["fwd"].get(table, (0,))[0] > 0]
        assert sent and all(0 < wire < raw and e <= results[0]["bound"] for raw, wire, e in sent)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_hosts_of_one_rank() -> None:
    _check(run_workers(_worker, 2, 1, timeout_s=600))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_hosts_of_two_ranks() -> None:
    _check(run_workers(_worker, 4, 2, timeout_s=900))


def test_cross_host_adapter_matches_torchrec() -> None:
    """``torchrec_adapter.install_cross_host_dists`` replaces the cross-host collectives
    TorchRec's two-hop dists create in ``_create_output_dist_modules`` and call in ``forward``
    (TWRW's VBE hop too): this fails, without starting a process, when TorchRec changes where it
    creates them."""
    from torchrec.distributed.sharding.grid_sharding import GridPooledEmbeddingDist
    from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist

    for cls in (TwRwPooledEmbeddingDist, GridPooledEmbeddingDist):
        create = inspect.getsource(cls._create_output_dist_modules)
        assert "self._cross_dist = PooledEmbeddingsAllToAll(" in create, cls
        assert "self._cross_dist)(" in inspect.getsource(cls.forward), cls
    create = inspect.getsource(TwRwPooledEmbeddingDist._create_output_dist_modules)
    assert "self._variable_cross_dist = VariableBatchPooledEmbeddingsAllToAll(" in create
    assert "self._variable_cross_dist" in inspect.getsource(TwRwPooledEmbeddingDist.forward)
