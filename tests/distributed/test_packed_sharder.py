"""The packed format through the sharder: a 2-rank gloo EBC with ``comms.codec.format: packed``
sends every pooled element within its bound (the sender's error sample decodes its own packed
payloads) and trains as the unsharded reference does within the bounded tolerance."""

from __future__ import annotations

from typing import Any

import pytest
from harness import (
    BOUNDED_TABLES,
    TrainRun,
    bounded_config,
    bounded_plan,
    compare_weights,
    make_batch,
    make_tables,
    reference_training,
)

pytestmark = pytest.mark.dist


def _worker_packed(rank: int, world_size: int) -> dict[str, Any]:
    import dataclasses

    from torchrec_lossy.config import CodecConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    config = dataclasses.replace(
        bounded_config(), codec=CodecConfig(format="packed"), error_sample_every=1
    )
    tables = make_tables(BOUNDED_TABLES)
    batches = [[make_batch(tables, 16, seed=100 * s + r) for r in range(world_size)]
               for s in range(2)]  # fmt: skip
    run = TrainRun(
        tables, LossyEmbeddingBagCollectionSharder(comms_config=config), bounded_plan(), world_size
    )
    stats = run.model.module.lossy_stats
    over, ratios = [], []
    for s in range(2):
        stats.reset()
        run.step(batches[s][rank], 1000 * s + rank)
        fwd = stats.tables("fwd")
        over.append(max(e.max_error_over_bound for e in fwd.values()))
        ratios.append(max(e.ratio for e in fwd.values()))
    _, ref_weights = reference_training(tables, batches, world_size, rank)
    w_vs_ref = max(compare_weights(run.weights(), ref_weights).values())
    return {"over": over, "ratios": ratios, "w_vs_ref": w_vs_ref}


@pytest.mark.timeout(900)
def test_packed_format_through_the_sharder() -> None:
    from harness import run_workers

    for rank, r in enumerate(run_workers(_worker_packed, 2, timeout_s=600)):
        assert 0.0 < max(r["over"]) <= 1.0, (rank, r["over"])
        assert max(r["ratios"]) > 1.0, (rank, r["ratios"])  # something was compressed
        assert r["w_vs_ref"] < 0.05, (rank, r["w_vs_ref"])
