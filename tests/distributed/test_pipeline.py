"""The packed input dist and the output dedupe under TorchRec's train pipelines.

The pipeline replaces every input dist's ``_dist.forward`` with its fused-splits
``KJTAllToAllForward``; the lossy input dist must stay packed (and feed the output dedupe) anyway,
with training bit-identical to TorchRec's sharder under the same pipeline at bound 0.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import (
    EXACT_BACKWARD,
    SHARDER_TABLES,
    DLRMish,
    holey_batch,
    load_full_weights,
    local_weights,
    make_ebc,
    make_tables,
    mixed_batch,
    run_workers,
    sgd_fused_params,
    sharder_plan,
    skewed_batch,
)

from torchrec_lossy.config import ErrorBound, InputDistConfig, LossyCommsConfig
from torchrec_lossy.distributed.stats import CONTAINER

CPU = torch.device("cpu")
STEPS = 6


def _batches(tables: list, rank: int) -> list[Any]:
    from torchrec.datasets.utils import Batch

    makers = (skewed_batch, mixed_batch, holey_batch)
    out = []
    for i in range(STEPS):
        b = 16 + 4 * rank
        kjt = makers[i % len(makers)](tables, b, seed=200 + 10 * i + rank)
        labels = (torch.rand(b, generator=torch.Generator().manual_seed(i + rank)) > 0.5).float()
        out.append(Batch(dense_features=torch.zeros(b, 1), sparse_features=kjt, labels=labels))
    return out


def _worker(rank: int, world_size: int, pipeline_name: str) -> dict[str, Any]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.train_pipeline import train_pipelines
    from torchrec.distributed.train_pipeline.runtime_forwards import KJTAllToAllForward
    from torchrec.distributed.types import ShardingPlan

    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    tables = make_tables(SHARDER_TABLES)
    fused = sgd_fused_params(0.1)
    exact = ErrorBound("absolute", 0.0)

    def lossy(**input_dist: Any) -> Any:
        config = LossyCommsConfig(
            default_bound=exact, input_dist=InputDistConfig(**input_dist), **EXACT_BACKWARD
        )
        return LossyEmbeddingBagCollectionSharder(fused_params=fused, comms_config=config)

    variants = {
        "torchrec": EmbeddingBagCollectionSharder(fused_params=fused),
        "default": lossy(),
        # detach() + attach() after every step, as around an evaluation: the re-attach re-runs
        # the in-flight batch's input dist into a fresh context, paired with the first run's
        # tensors; the dedupe state must follow the tensors.
        "reattach": lossy(),
        "no_output_dedupe": lossy(dedupe_outputs=False),
        "lookup": lossy(dedupe_lookups=True),
    }
    logits: dict[str, list[torch.Tensor]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    telemetry: dict[str, dict[str, Any]] = {}
    for name, sharder in variants.items():
        ebc = make_ebc(tables, seed=0)
        full_state = ebc.state_dict()
        torch.manual_seed(1)
        model = DLRMish(ebc, sum(t.embedding_dim * len(t.feature_names) for t in tables))
        module_plan = construct_module_sharding_plan(
            ebc,
            sharder_plan(),
            sharder=sharder,
            local_size=world_size,
            world_size=world_size,
            device_type="cpu",
        )
        dmp = DistributedModelParallel(
            model, plan=ShardingPlan({"ebc": module_plan}), sharders=[sharder], device=CPU
        )
        load_full_weights(
            {k.removeprefix("ebc."): v for k, v in dmp.module.ebc.state_dict().items()},
            full_state,
        )
        opt = torch.optim.SGD(dmp.module.head.parameters(), lr=0.1)
        pipeline = getattr(train_pipelines, pipeline_name)(dmp, opt, CPU)
        it = iter(_batches(tables, rank))
        sharded = dmp.module.ebc
        stats = getattr(sharded, "lossy_stats", None)
        logits[name] = []
        while True:
            try:
                logits[name].append(pipeline.progress(it).clone())
            except StopIteration:
                break
            if name == "reattach":
                pipeline.detach()
                pipeline.attach(dmp)
            if stats is not None and len(logits[name]) == 1:
                # The first call ran batch 0's input dist before the pipeline overrode the
                # input dists' forwards: count only what ran under the override.
                stats.reset()
        overridden = [
            isinstance(d._dist.forward, KJTAllToAllForward)
            for d in sharded._input_dists
            if hasattr(d, "_dist")
        ]
        weights[name] = {
            f"{k}@{o}": t.clone()
            for k, pieces in local_weights(dmp.state_dict()).items()
            for o, t in pieces
        }
        if stats is not None:
            inp = stats.total("input")
            rows = [e for n, e in stats.tables("fwd").items() if n != CONTAINER]
            telemetry[name] = {
                "overridden": overridden,
                "input": (inp.raw_bytes, inp.wire_bytes),
                "rows": (sum(e.rows for e in rows), sum(e.rows_sent for e in rows)),
            }
    ref = "torchrec"
    return {
        "steps": len(logits[ref]),
        "logits_eq": {
            n: all(torch.equal(a, b) for a, b in zip(logits[n], logits[ref], strict=True))
            for n in ("default", "reattach", "no_output_dedupe")
        },
        "weights_eq": {
            n: weights[n].keys() == weights[ref].keys()
            and all(torch.equal(weights[n][k], weights[ref][k]) for k in weights[ref])
            for n in ("default", "reattach", "no_output_dedupe")
        },
        "lookup_close": all(
            torch.allclose(a, b, atol=1e-5)
            for a, b in zip(logits["lookup"], logits[ref], strict=True)
        ),
        "telemetry": telemetry,
    }


@pytest.mark.dist
# TrainPipelineSemiSync and TrainPipelineFusedSparseDist share the mechanism but need CUDA
# streams (on CPU TorchRec's own record_stream fails, with TorchRec's sharder too).
@pytest.mark.parametrize(
    "pipeline",
    [
        "TrainPipelineSparseDist",
        pytest.param("TrainPipelineSparseDistLite", marks=pytest.mark.slow),
    ],
)
def test_packed_input_dist_and_output_dedupe_under_train_pipeline(pipeline: str) -> None:
    for rank, r in enumerate(run_workers(_worker, 2, pipeline)):
        assert r["steps"] == STEPS, (rank, r["steps"])
        assert all(r["logits_eq"].values()), (rank, r["logits_eq"])
        assert all(r["weights_eq"].values()), (rank, r["weights_eq"])
        assert r["lookup_close"], rank
        for name, t in r["telemetry"].items():
            # The pipeline did override the KJTAllToAll forwards (the re-attached run ends
            # detached), and the packed codec ran.
            assert name == "reattach" or all(t["overridden"]), (rank, name, t)
            raw, wire = t["input"]
            assert 0 < wire < raw / 2, (rank, name, t)
            full, sent = t["rows"]
            if name == "no_output_dedupe":
                assert sent == full > 0, (rank, name, t)
            else:
                assert 0 < sent < full, (rank, name, t)
        # Every step of the re-attached run was deduplicated like the plain run's.
        assert r["telemetry"]["reattach"]["rows"] == r["telemetry"]["default"]["rows"], rank
