"""The per-value bound through the sharder: a 2-rank gloo EBC with ``default_bound: value 0.03``
sends every pooled element within 0.03 of its own magnitude and trains within the tolerance
that error implies."""

from __future__ import annotations

from typing import Any

import pytest
from harness import (
    BOUNDED_TABLES,
    EXACT_BACKWARD,
    LR,
    TrainRun,
    bounded_plan,
    compare_weights,
    make_batch,
    make_tables,
    max_row_count,
    reference_training,
    run_workers,
)

pytestmark = pytest.mark.dist

V = 0.03


def _worker_value(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec_lossy.config import ErrorBound, LossyCommsConfig, TableCodecConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    config = LossyCommsConfig(
        default_bound=ErrorBound("value", V),
        tables={"t3": TableCodecConfig(compress=False)},
        **EXACT_BACKWARD,  # the forward's error alone
    )
    tables = make_tables(BOUNDED_TABLES)
    batch, steps = 16, 3
    batches = [
        [make_batch(tables, batch, seed=100 * s + r) for r in range(world_size)]
        for s in range(steps)
    ]
    run = TrainRun(
        tables, LossyEmbeddingBagCollectionSharder(comms_config=config), bounded_plan(), world_size
    )
    stats = run.model.module.lossy_stats
    over, rel_err = [], []
    for s in range(steps):
        stats.reset()
        run.step(batches[s][rank], 1000 * s + rank)
        fwd = stats.tables("fwd")
        over.append(max(e.max_error_over_bound for e in fwd.values()))
        rel_err.append(max(e.max_error for e in fwd.values()))  # relative, for value bounds
    ref_outs, ref_weights = reference_training(tables, batches, world_size, rank)
    # Step 0 (same weights): every element within V of its own magnitude (1e-5: the sharded
    # and the unsharded pooling sum in other orders).
    got, ref = run.outputs[0].double(), ref_outs[0].double()
    excess = ((got - ref).abs() - V * ref.abs()).max().item()
    # Training: as test_dist_sharder's bounded run, with each step's absolute error at most
    # V * max |output| of that step.
    n = run.outputs[0].numel()
    errs = [V * o.abs().max().item() for o in run.outputs]
    counts = [max_row_count(b) for b in batches]
    tol = 2 * sum(LR * c * 2 * e / (n * world_size) for c, e in zip(counts, errs, strict=True))
    return {
        "excess": excess,
        "over": over,
        "rel_err": rel_err,
        "w_vs_ref": compare_weights(run.weights(), ref_weights),
        "tol": tol,
        "changed": (got - ref).abs().max().item(),
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_value_bound_trains_within_the_bound() -> None:
    for rank, r in enumerate(run_workers(_worker_value, 2, timeout_s=600)):
        assert r["excess"] <= 1e-5, (rank, r["excess"])
        assert max(r["over"]) <= 1.0, (rank, r["over"])
        assert 0 < max(r["rel_err"]) <= 2.0**-6, (rank, r["rel_err"])  # lossy, on the grid
        assert r["changed"] > 0  # the forward really was lossy
        for key, diff in r["w_vs_ref"].items():
            assert diff <= r["tol"] + 1e-5, (rank, key, diff, r["tol"])
