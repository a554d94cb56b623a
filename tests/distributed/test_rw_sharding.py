"""Row-wise tables through the lossy sharder: an all-to-all of coded partial sums plus a local sum.

Against TorchRec's row-wise sharding (its reduce-scatter) on gloo ranks: bit-equal with bound 0
and the exact backward; within the stated bound of the sum (the ``world - 1`` remote parts'
bounds) when lossy; the bucketized input all-to-all packed losslessly.
"""

from __future__ import annotations

import inspect
import itertools
import math
import types
from typing import Any

import pytest
import torch
from harness import (
    EXACT_BACKWARD,
    TrainRun,
    column_slices,
    compare_weights,
    make_batch,
    make_tables,
    reference_training,
    run_workers,
    same_local_pieces,
)

pytestmark = pytest.mark.dist

RW_TABLES = [
    ("t0", 40, 8, ["f0"]),
    ("rw0", 64, 8, ["g0"]),
    ("rw1", 50, 16, ["g1", "g1b"]),
]


def _plan() -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    return {"t0": table_wise(rank=0), "rw0": row_wise(), "rw1": row_wise()}


def _lossy(**comms: Any) -> Any:
    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    return LossyEmbeddingBagCollectionSharder(comms_config=LossyCommsConfig(**comms))


def _worker(rank: int, world_size: int, batch_sizes: list[int]) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
    from torchrec.distributed.sharding.tw_sharding import KJTAllToAll

    from torchrec_lossy.config import ErrorBound
    from torchrec_lossy.distributed.input_dist import LossyKJTAllToAll
    from torchrec_lossy.distributed.rw_sharding import (
        LossyRwPooledEmbeddingDist,
        LossyRwSparseFeaturesDist,
    )

    torchrec_dist = RwSparseFeaturesDist(
        pg=dist.group.WORLD, num_features=2, feature_hash_sizes=[10, 10]
    )
    tables = make_tables(RW_TABLES)
    steps = 3
    batches = [
        [make_batch(tables, batch_sizes[r], seed=100 * s + r) for r in range(world_size)]
        for s in range(steps)
    ]
    bound = 0.01
    # TorchRec's RW cannot run uneven batches on gloo (its backward all-gather needs even ones).
    with_torchrec = len(set(batch_sizes)) == 1
    runs = {
        "exact": TrainRun(
            tables,
            _lossy(default_bound=ErrorBound("absolute", 0.0), **EXACT_BACKWARD),
            _plan(),
            world_size,
        ),
        "lossy": TrainRun(
            tables,
            _lossy(default_bound=ErrorBound("absolute", bound), **EXACT_BACKWARD),
            _plan(),
            world_size,
        ),
    }
    if with_torchrec:
        runs["torchrec"] = TrainRun(tables, EmbeddingBagCollectionSharder(), _plan(), world_size)
    for s in range(steps):
        for run in runs.values():
            run.step(batches[s][rank], 1000 * s + rank)
    ref_outs, ref_weights = reference_training(tables, batches, world_size, rank)

    exact, lossy = runs["exact"], runs["lossy"]
    tr = runs.get("torchrec")
    sharded = lossy.model.module
    rw_index = [type(s).__name__ for s in sharded._embedding_shardings].index(
        "LossyRwPooledEmbeddingSharding"
    )
    in_dist = sharded._input_dists[rw_index]
    out_dist = sharded._output_dists[rw_index]
    cols = column_slices(tables)
    rw_cols = torch.cat([torch.arange(c.start, c.stop) for t in ("rw0", "rw1") for c in cols[t]])
    fwd = sharded.lossy_stats.tables("fwd")
    # Bags of g0 (rw0: 64 rows) whose ids all live in this rank's row shard, or none at all:
    # the receiver adds only the parts of ranks holding their ids, so they arrive exact.
    block = (64 + world_size - 1) // world_size
    g0 = batches[0][rank]["g0"]
    owners = [
        set((g0.values()[a:b] // block).tolist())
        for a, b in itertools.pairwise(g0.offsets().tolist())
    ]
    own = torch.tensor([o <= {rank} for o in owners])
    g0_err = (lossy.outputs[0] - ref_outs[0])[:, cols["rw0"][0]].abs().amax(dim=1)
    return {
        "own_bags": int(own.sum()),
        "own_bags_err": g0_err[own].max().item() if own.any() else 0.0,
        "other_bags_err": g0_err[~own].max().item() if (~own).any() else 0.0,
        "exact_out_equal": tr is not None
        and all(torch.equal(a, b) for a, b in zip(exact.outputs, tr.outputs, strict=True)),
        "exact_w_equal": tr is not None and same_local_pieces(exact.weights(), tr.weights()),
        "exact_out_vs_torchrec": max(
            (a - b).abs().max().item() for a, b in zip(exact.outputs, tr.outputs, strict=True)
        )
        if tr
        else math.inf,
        "torchrec_vs_ref": max(compare_weights(tr.weights(), ref_weights).values()) if tr else 0,
        "exact_out_vs_ref": max(
            (a - b).abs().max().item() for a, b in zip(exact.outputs, ref_outs, strict=True)
        ),
        "exact_w_vs_ref": max(compare_weights(exact.weights(), ref_weights).values()),
        "lossy_err0": (lossy.outputs[0] - ref_outs[0])[:, rw_cols].abs().max().item(),
        "tw_err0": (lossy.outputs[0] - ref_outs[0])[:, cols["t0"][0]].abs().max().item(),
        "lossy_w_vs_ref": max(compare_weights(lossy.weights(), ref_weights).values()),
        "rw_fwd": {t: (fwd[t].raw_bytes, fwd[t].wire_bytes, fwd[t].max_error) for t in fwd},
        "input_wire": sharded.lossy_stats.total("input").wire_bytes,
        # The adapter relies on TorchRec building a KJTAllToAll as `_dist` and calling it.
        "adapter": (
            isinstance(in_dist, LossyRwSparseFeaturesDist)
            and isinstance(in_dist._dist, LossyKJTAllToAll)
            and type(torchrec_dist._dist) is KJTAllToAll
            and "self._dist(" in inspect.getsource(inspect.unwrap(RwSparseFeaturesDist.forward))
        ),
        "out_dist": isinstance(out_dist, LossyRwPooledEmbeddingDist),
        "bound": bound,
    }


@pytest.mark.timeout(900)
def test_row_wise_bit_equal_at_bound_zero_and_within_the_sum_bound() -> None:
    world = 2
    results = run_workers(_worker, world, [8, 8], timeout_s=600)
    for rank, r in enumerate(results):
        assert r["adapter"] and r["out_dist"], rank
        assert r["exact_out_equal"], rank
        assert r["exact_w_equal"], rank
        assert r["torchrec_vs_ref"] < 1e-5, rank
        # The sum of world parts: this rank's exact, each remote one within the bound.
        assert 0 < r["lossy_err0"] <= (world - 1) * r["bound"] + 1e-5, (rank, r["lossy_err0"])
        assert r["tw_err0"] <= r["bound"] + 1e-6
        for table in ("rw0", "rw1"):
            raw, wire, err = r["rw_fwd"][table]
            assert 0 < wire < raw and err <= r["bound"], (rank, table, r["rw_fwd"])
        assert r["input_wire"] > 0
        # Bags without ids on a remote rank get no remote part: exact.
        assert r["own_bags_err"] == 0.0, (rank, r["own_bags"], r["own_bags_err"])
    assert min(r["own_bags"] for r in results) > 0
    assert max(r["other_bags_err"] for r in results) > 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_row_wise_four_ranks_uneven_batches() -> None:
    # Uneven batches: TorchRec's RW cannot run them on gloo; exact against unsharded training.
    world = 4
    for rank, r in enumerate(run_workers(_worker, world, [8, 5, 8, 3], timeout_s=900)):
        assert r["adapter"] and r["out_dist"], rank
        assert r["exact_out_vs_ref"] <= 1e-5 and r["exact_w_vs_ref"] <= 1e-5, rank
        assert 0 < r["lossy_err0"] <= (world - 1) * r["bound"] + 1e-5, (rank, r["lossy_err0"])
        assert r["input_wire"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_row_wise_four_ranks_equal_to_torchrec_up_to_summation_order() -> None:
    # Bit-equal needs the same fp32 summation order as TorchRec's reduce-scatter: two parts
    # commute, four do not (gloo adds them in its own order), so outputs agree within a few ulp.
    world = 4
    for rank, r in enumerate(run_workers(_worker, world, [8] * world, timeout_s=900)):
        assert r["adapter"] and r["out_dist"], rank
        assert r["exact_out_vs_torchrec"] <= 1e-6, (rank, r["exact_out_vs_torchrec"])
        assert r["exact_w_vs_ref"] <= 1e-6 and r["torchrec_vs_ref"] <= 1e-6, rank
        assert r["lossy_err0"] <= (world - 1) * r["bound"] + 1e-5, (rank, r["lossy_err0"])
        assert r["own_bags_err"] == 0.0, (rank, r["own_bags"], r["own_bags_err"])


def test_the_source_mask_travels_with_the_batchs_features() -> None:
    """The RW source mask is computed from the bucketized KJT and handed on in the decoded
    features' state, which ``bind_input_state`` turns into the batch's sharding context: no
    dist or module keeps it between calls."""
    from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lossy.distributed.context import (
        DistributedKJT,
        KJTDistState,
        LossyShardingContext,
        bind_input_state,
    )
    from torchrec_lossy.distributed.rw_sharding import source_mask

    # 2 ranks x 2 features, batch 3: bucket r's features first; lengths per (rank, feature, bag).
    lengths = torch.tensor([1, 0, 2, 0, 0, 1, 0, 3, 0, 1, 1, 0])
    bucketized = KeyedJaggedTensor(
        keys=["f", "g", "f", "g"], values=torch.arange(int(lengths.sum())), lengths=lengths
    )
    features = KeyedJaggedTensor(keys=["f", "g"], values=torch.arange(4), lengths=lengths[:6])
    mask = source_mask(bucketized, features, world=2, num_features=2)
    assert mask.tolist() == [
        [[True, False, True], [False, False, True]],
        [[False, True, False], [True, True, False]],
    ]
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(2), lengths=torch.tensor([1, 1]))
    decoded = DistributedKJT.of(kjt, KJTDistState([1, 1], None, mask))

    ctx = types.SimpleNamespace(
        sharding_contexts=[EmbeddingShardingContext(batch_size_per_rank=[1, 1])]
    )
    bind_input_state(ctx, [decoded])  # type: ignore[arg-type]
    bound = ctx.sharding_contexts[0]
    assert isinstance(bound, LossyShardingContext) and bound.source_mask is mask
