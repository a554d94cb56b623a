"""Forced fp16 / bf16 tables through the sharder (distributed/cast_blocks.py): a 2-rank gloo EBC
whose cast tables send each pooled element within the cast's error of its own value, in half the
bytes; a table whose bound no cast can meet travels exactly; the gradients of cast tables travel
cast where ``backward_bound`` admits it (bf16), exactly where not (fp16's flush below 6.1e-5);
training stays within the tolerance those errors imply."""

from __future__ import annotations

from typing import Any

import pytest
from harness import (
    BOUNDED_TABLES,
    LR,
    TrainRun,
    bounded_plan,
    column_slices,
    compare_weights,
    make_batch,
    make_tables,
    max_row_count,
    reference_training,
    run_workers,
)

pytestmark = pytest.mark.dist

# Per table: its cast's relative error per value (2**-11 fp16, 2**-8 bf16); 0: exact.
CAST_ERROR = {"t0": 2.0**-11, "t1": 0.0, "t2": 2.0**-8, "t3": 0.0, "t4": 0.0}


def _worker_cast(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec_lossy.config import ErrorBound, LossyCommsConfig, TableCodecConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    config = LossyCommsConfig(
        format="entropy",
        tables={
            "t0": TableCodecConfig(bound=ErrorBound("relative", 0.01), format="fp16"),
            # No cast meets 1e-7 on these values: every forward block travels exactly.
            "t1": TableCodecConfig(bound=ErrorBound("absolute", 1e-7), format="fp16"),
            "t2": TableCodecConfig(bound=ErrorBound("relative", 0.01), format="bf16"),
            "t3": TableCodecConfig(compress=False),
        },
        backward_dedupe=False,
    )
    tables = make_tables(BOUNDED_TABLES)
    steps = 3
    batches = [
        [make_batch(tables, 16, seed=100 * s + r) for r in range(world_size)] for s in range(steps)
    ]
    run = TrainRun(
        tables, LossyEmbeddingBagCollectionSharder(comms_config=config), bounded_plan(), world_size
    )
    stats = run.model.module.lossy_stats
    run.step(batches[0][rank], rank)
    fwd, bwd = stats.tables("fwd"), stats.tables("bwd")
    nbytes = {d: {t: (e.raw_bytes, e.wire_bytes) for t, e in s.items() if t.startswith("t")}
              for d, s in (("fwd", fwd), ("bwd", bwd))}  # fmt: skip
    for s in range(1, steps):
        run.step(batches[s][rank], 1000 * s + rank)
    ref_outs, ref_weights = reference_training(tables, batches, world_size, rank)
    got, ref = run.outputs[0].double(), ref_outs[0].double()
    # Step 0 (same weights): each element within its table's cast error of its own value (1e-5:
    # the sharded and the unsharded pooling sum in other orders).
    excess = {
        t: max(((got[:, c] - ref[:, c]).abs() - CAST_ERROR[t] * ref[:, c].abs()).max().item()
               for c in cols)
        for t, cols in column_slices(tables).items()
    }  # fmt: skip
    # Training: each step's forward errs by at most 2**-8 of max |output|, its gradient by
    # 2**-8 of max |gradient| (MSE against targets in [-1, 1): 2 (|out| + 1) / n).
    n = run.outputs[0].numel()
    counts = [max_row_count(b) for b in batches]
    tol = 0.0
    for c, o in zip(counts, run.outputs, strict=True):
        m = o.abs().max().item()
        tol += 2 * LR * c * 2 * 2.0**-8 * m / (n * world_size)
        tol += LR * c * 2.0**-8 * 2 * (m + 1) / (n * world_size)
    return {
        "excess": excess,
        "bytes": nbytes,
        "changed": (got - ref).abs().max().item(),
        "w_vs_ref": compare_weights(run.weights(), ref_weights),
        "tol": tol,
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cast_tables_through_the_sharder() -> None:
    results = run_workers(_worker_cast, 2, timeout_s=600)
    for rank, r in enumerate(results):
        for t, e in r["excess"].items():
            assert e <= 1e-5, (rank, t, e)
        assert r["changed"] > 1e-5  # the forward really was cast
        for key, diff in r["w_vs_ref"].items():
            assert diff <= r["tol"] + 1e-5, (rank, key, diff, r["tol"])

    def total(direction: str, table: str) -> tuple[int, int]:
        sent = [r["bytes"][direction].get(table, (0, 0)) for r in results]  # by its senders
        return sum(raw for raw, _ in sent), sum(wire for _, wire in sent)

    # Half the bytes for cast blocks (dims 8 and 16: no padding), exact for t1's forward.
    for t in ("t0", "t2"):
        raw, wire = total("fwd", t)
        assert raw > 0 and 2 * wire == raw, (t, raw, wire)
    raw, wire = total("fwd", "t1")
    assert raw > 0 and wire == raw, (raw, wire)
    # The gradient of the bf16 table cast (backward_bound: per value 1/32); the fp16 tables'
    # gradients hold elements below fp16's normal range (6.1e-5: MSE gradients over a batch),
    # which its per-value bound refuses: those blocks travel exactly.
    raw, wire = total("bwd", "t2")
    assert raw > 0 and 2 * wire == raw, (raw, wire)
    for t in ("t0", "t1"):
        raw, wire = total("bwd", t)
        assert raw > 0 and wire == raw, (t, raw, wire)
