"""The sharder pickles to an equivalent sharder, as TorchRec's multi-process test utilities need.

TorchRec's ``MultiProcessTestBase`` and any ``torch.multiprocessing.spawn`` user hand sharders to
their ranks pickled; these tests do the same.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from harness import (
    BOUNDED_TABLES,
    LR,
    TrainRun,
    abs_bound_upper,
    bounded_config,
    bounded_plan,
    column_slices,
    compare_weights,
    free_port,
    gloo_group,
    make_batch,
    make_tables,
    max_row_count,
    reference_training,
)

from torchrec_lossy.adaptive import AdaptiveBounds
from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder


def _sharder() -> LossyEmbeddingBagCollectionSharder:
    """A sharder whose every setting differs from the defaults."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )

    return LossyEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.25},
        qcomm_codecs_registry=get_qcomm_codecs_registry(QCommsConfig(CommType.FP16, CommType.BF16)),
        sharded_module_order_overwrite=["b", "a"],
        comms_config=bounded_config(),
        bounds_factory=AdaptiveBounds,
    )


def _same_settings(a: LossyEmbeddingBagCollectionSharder, b: Any) -> None:
    assert type(b) is LossyEmbeddingBagCollectionSharder
    assert b.comms_config == a.comms_config
    assert b.fused_params == a.fused_params
    assert b.bounds_factory is a.bounds_factory
    assert b.sharding_types("cpu") == a.sharding_types("cpu")
    assert (b.qcomm_codecs_registry is None) == (a.qcomm_codecs_registry is None)
    if a.qcomm_codecs_registry is not None:
        assert b.qcomm_codecs_registry.keys() == a.qcomm_codecs_registry.keys()
        for op, codecs in a.qcomm_codecs_registry.items():
            got = b.qcomm_codecs_registry[op]
            assert got.forward.quantized_dtype == codecs.forward.quantized_dtype
            assert got.backward.quantized_dtype == codecs.backward.quantized_dtype


def test_sharder_pickle_round_trip_keeps_its_config() -> None:
    sharder = _sharder()
    copy = pickle.loads(pickle.dumps(sharder))
    _same_settings(sharder, copy)
    assert copy.stats() == {}
    default = LossyEmbeddingBagCollectionSharder()
    _same_settings(default, pickle.loads(pickle.dumps(default)))


def test_sharder_with_an_unpicklable_factory_names_it() -> None:
    def factory(names: list[str], config: Any) -> torch.nn.Module:
        return AdaptiveBounds(names, config)

    sharder = LossyEmbeddingBagCollectionSharder(bounds_factory=factory)
    with pytest.raises((pickle.PicklingError, AttributeError), match="factory"):
        pickle.dumps(sharder)


# ---------------------------------------------------------------------------------------------
# Two ranks that get the sharder through torch.multiprocessing.spawn's arguments.


def _spawned(rank: int, world_size: int, port: int, sharder: Any, out_dir: str) -> None:
    """One rank: shards with the pickled sharder, trains one step, saves what the parent checks."""
    with gloo_group(rank, world_size, port):
        _same_settings(LossyEmbeddingBagCollectionSharder(comms_config=bounded_config()), sharder)
        tables = make_tables(BOUNDED_TABLES)
        batches = [[make_batch(tables, 16, seed=r) for r in range(world_size)]]
        run = TrainRun(tables, sharder, bounded_plan(), world_size)
        run.step(batches[0][rank], rank)  # forward, backward (through the lossy codec), SGD
        stats = run.model.module.lossy_stats
        ref_outs, ref_weights = reference_training(tables, batches, world_size, rank)
        excess = {}
        for table, cols in column_slices(tables).items():
            ref_cols = torch.cat([ref_outs[0][:, c] for c in cols], dim=1)
            got_cols = torch.cat([run.outputs[0][:, c] for c in cols], dim=1)
            upper = abs_bound_upper(sharder.comms_config, table, ref_cols)
            excess[table] = ((got_cols - ref_cols).abs().max() - upper).item()
        fwd_err = max(e.max_error for e in stats.tables("fwd").values())
        # The forward error perturbs dL/dout by 2 e / N (/world in the backward), count times.
        n = run.outputs[0].numel()
        tol = 2 * LR * max_row_count(batches[0]) * 2 * fwd_err / (n * world_size)
        worst = max(compare_weights(run.weights(), ref_weights).values())
        # The sharder in this rank knows its module, and still pickles.
        again = pickle.loads(pickle.dumps(sharder))
        torch.save(
            {
                "excess": excess,
                "fwd_err": fwd_err,
                "ratio": stats.total("fwd").ratio,
                "bwd_wire": stats.total("bwd").wire_bytes,
                "w_worst": worst,
                "tol": tol,
                "modules": list(sharder.stats()),
                "again_modules": list(again.stats()),
                "again_config": again.comms_config == sharder.comms_config,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )


@pytest.mark.slow
@pytest.mark.dist
def test_sharder_handed_to_ranks_through_spawn_args_shards_and_trains(tmp_path: Path) -> None:
    sharder = LossyEmbeddingBagCollectionSharder(comms_config=bounded_config())
    mp.spawn(
        _spawned,
        args=(2, free_port(), sharder, str(tmp_path)),
        nprocs=2,
        join=True,
    )
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        for table, excess in r["excess"].items():
            assert excess <= 1e-5, (rank, table, r["excess"])
        assert r["fwd_err"] > 0 and r["ratio"] > 1.0  # the forward really went through the codec
        assert r["bwd_wire"] > 0  # and the gradient through the lossy dist's backward
        assert r["w_worst"] <= r["tol"] + 1e-5, (rank, r["w_worst"], r["tol"])
        assert r["modules"] == [""] and r["again_modules"] == [] and r["again_config"]
