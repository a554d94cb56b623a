"""Multi-process (gloo) tests of the lossy sharder against TorchRec's sharder and unsharded models.

Each test spawns its ranks once and checks several things inside them, to keep the suite fast.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from harness import (
    BOUNDED_TABLES,
    EXACT_BACKWARD,
    LR,
    DLRMish,
    TrainRun,
    abs_bound_upper,
    bounded_config,
    bounded_plan,
    column_slices,
    compare_weights,
    make_batch,
    make_ebc,
    make_tables,
    max_row_count,
    reference_training,
    run_workers,
    same_local_pieces,
    sgd_fused_params,
)

pytestmark = pytest.mark.dist

CPU = torch.device("cpu")


def _lossy_sharder(qcomm_fp16: bool = False, **comms: Any) -> Any:
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )

    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    registry = (
        get_qcomm_codecs_registry(QCommsConfig(CommType.FP16, CommType.FP16))
        if qcomm_fp16
        else None
    )
    return LossyEmbeddingBagCollectionSharder(
        qcomm_codecs_registry=registry, comms_config=LossyCommsConfig(**comms)
    )


def _torchrec_sharder() -> Any:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder()


# ---------------------------------------------------------------------------------------------
# Bound 0: bit-identical to TorchRec; backward codecs within their tolerance.

MIXED_TABLES = [
    ("t0", 40, 8, ["f0"]),
    ("t1", 30, 16, ["f1", "f1b"]),
    ("t2", 50, 8, ["f2"]),
    ("t3", 20, 8, ["f3"]),
    ("t4", 25, 4, ["f4"]),
]


def _mixed_plan() -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import (
        column_wise,
        data_parallel,
        row_wise,
        table_wise,
    )

    return {
        "t0": table_wise(rank=0),
        "t1": table_wise(rank=1),
        "t2": column_wise(ranks=[0, 1]),
        "t3": row_wise(),
        "t4": data_parallel(),
    }


def _worker_exact(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec_lossy.config import ErrorBound

    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchrec_lossy").addHandler(handler)

    tables = make_tables(MIXED_TABLES)
    steps = 3
    batches = [
        [
            make_batch(tables, 8, seed=100 * s + r, empty_features=["f3"] if s == 1 else ())
            for r in range(world_size)
        ]
        for s in range(steps)
    ]
    exact = ErrorBound("absolute", 0.0)
    runs = {
        "torchrec": TrainRun(tables, _torchrec_sharder(), _mixed_plan(), world_size),
        "none": TrainRun(
            tables, _lossy_sharder(default_bound=exact, **EXACT_BACKWARD), _mixed_plan(), world_size
        ),
        # The default backward: the codec at a relative bound, stochastically rounded.
        "default": TrainRun(tables, _lossy_sharder(default_bound=exact), _mixed_plan(), world_size),
        "fp16": TrainRun(
            tables, _lossy_sharder(default_bound=exact, backward="fp16"), _mixed_plan(), world_size
        ),
        "bf16": TrainRun(
            tables, _lossy_sharder(default_bound=exact, backward="bf16"), _mixed_plan(), world_size
        ),
        "lossy": TrainRun(
            tables,
            _lossy_sharder(
                default_bound=exact,
                backward="lossy",
                backward_bound=ErrorBound("absolute", 1e-4),
            ),
            _mixed_plan(),
            world_size,
        ),
    }
    # TorchRec's qcomm codecs are not used: the row-wise table is lossy-coded too (here exactly).
    qcomm = TrainRun(
        tables, _lossy_sharder(default_bound=exact, qcomm_fp16=True), _mixed_plan(), world_size
    )
    for s in range(steps):
        for run in runs.values():
            run.step(batches[s][rank], 1000 * s + rank)
    qcomm.step(batches[0][rank], rank)
    ref_outs, ref_weights = reference_training(tables, batches, world_size, rank)

    tr = runs["torchrec"]
    w0 = make_ebc(tables, seed=0).state_dict()
    result: dict[str, Any] = {"logs": logs, "max_count": sum(max_row_count(b) for b in batches)}
    rw_cols = column_slices(tables)["t3"][0]
    result["qcomm_rw_err"] = (qcomm.outputs[0] - tr.outputs[0])[:, rw_cols].abs().max().item()
    other = torch.ones(qcomm.outputs[0].shape[1], dtype=torch.bool)
    other[rw_cols] = False
    result["qcomm_other_equal"] = torch.equal(qcomm.outputs[0][:, other], tr.outputs[0][:, other])
    for name, run in runs.items():
        result[name] = {
            "out_equal_torchrec": all(
                torch.equal(a, b) for a, b in zip(run.outputs, tr.outputs, strict=True)
            ),
            "out0_equal_torchrec": torch.equal(run.outputs[0], tr.outputs[0]),
            "out_vs_ref": [
                (a - b).abs().max().item() for a, b in zip(run.outputs, ref_outs, strict=True)
            ],
            "w_vs_ref": compare_weights(run.weights(), ref_weights),
            "update_max": max(compare_weights(run.weights(), w0).values()),
        }
        if name != "torchrec":
            stats = run.model.module.lossy_stats
            result[name]["bwd_total"] = stats.total("bwd")
            result[name]["fwd_total"] = stats.total("fwd")
            # Bytes of no block: codec headers, and the one-round slots' headers and slack.
            result[name]["bwd_container"] = stats.table("<container>", "bwd").wire_bytes
    # Bit-equality with TorchRec's weights: compare this rank's pieces pairwise.
    tr_state = tr.weights()
    for name, run in runs.items():
        result[name]["w_equal_torchrec"] = same_local_pieces(run.weights(), tr_state)
    return result


def test_bound0_matches_torchrec_and_backward_codecs() -> None:
    results = run_workers(_worker_exact, 2)
    for rank, r in enumerate(results):
        # Exact forward and backward: bit-identical to TorchRec's uncompressed sharding.
        assert r["none"]["out_equal_torchrec"], rank
        assert r["none"]["w_equal_torchrec"], rank
        for name in ("none", "fp16", "bf16", "lossy", "default"):
            # Forward bound 0: the first step (before backward codecs act) is exact.
            assert r[name]["out0_equal_torchrec"], (rank, name)
            tol = _bwd_tol(name, r, max(x["default"]["bwd_total"].max_error for x in results))
            assert max(r[name]["w_vs_ref"].values()) < 1e-5 + tol, (rank, name, r)
        assert r["torchrec"]["out_vs_ref"][-1] < 1e-5
        assert max(r["torchrec"]["w_vs_ref"].values()) < 1e-5
        # The row-wise table is compressed: nothing is logged as not compressed; the qcomm
        # codecs the user passed are reported unused, once (one model got them).
        assert not [m for m in r["logs"] if "NOT lossy-compressed" in m], r["logs"]
        unused = [m for m in r["logs"] if "qcomm codecs for" in m]
        assert len(unused) == 1 and "POOLED_EMBEDDINGS_REDUCE_SCATTER" in unused[0], unused
        assert r["qcomm_rw_err"] == 0.0 and r["qcomm_other_equal"]
        # Backward telemetry: wire bytes are the casts' sizes.
        assert r["none"]["bwd_total"].wire_bytes == r["none"]["bwd_total"].raw_bytes
        # The casts: 2 bytes per gradient element of the rows sent (one per distinct bag where
        # the exact output dedupe is active; raw_bytes counts those rows, as in the forward).
        for cast in ("fp16", "bf16"):
            t = r[cast]["bwd_total"]
            assert t.wire_bytes * 2 == t.raw_bytes and t.rows_sent <= t.rows, (cast, t)
        assert r["lossy"]["bwd_total"].max_error_over_bound <= 1.0
        default = r["default"]["bwd_total"]
        assert 0 < default.max_error_over_bound <= 1.0  # lossy, within its bound
        # 8-row blocks: the codec shrinks them, the headers (codec and slot) weigh.
        assert default.wire_bytes - r["default"]["bwd_container"] < default.raw_bytes, default
        assert default.error_count > 0  # the signed error was sampled (first call)


def _bwd_tol(name: str, r: dict[str, Any], default_err: float) -> float:
    # A cast changes each pooled gradient by at most eps of itself; a row's update is a sum of
    # a few of them, so its error is a small multiple of eps times the largest update.
    eps = {"none": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8, "lossy": 0.0, "default": 0.0}[name]
    tol = 8 * eps * r[name]["update_max"]
    if name == "lossy":
        # Each pooled gradient within 1e-4 (before the 1/world division); a row's step adds at
        # most max_count of them.
        tol = LR * r["max_count"] * 1e-4
    if name == "default":
        # The same with the largest error any rank's gradient blocks had.
        tol = LR * r["max_count"] * default_err
    return tol


# ---------------------------------------------------------------------------------------------
# Bounds > 0: outputs within the bound, training within the derived tolerance, exact byte counts.

# Local table shards per rank: (table, columns) -> raw bytes per global row.
BOUNDED_LOCAL_WIDTH = {0: {"t0": 16, "t2": 8, "t3": 8}, 1: {"t1": 16, "t2": 8}}


def _worker_bounded(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    sent: list[int] = []
    a2a = dist.all_to_all_single

    isend = dist.isend

    def counting_a2a(output: torch.Tensor, input: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if input.dtype == torch.uint8:  # only the lossy payloads travel as bytes
            sent.append(input.numel())
        return a2a(output, input, *args, **kw)

    def counting_isend(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        sent.append(tensor.numel())  # a payload past its slot (one-round path's overflow)
        return isend(tensor, *args, **kw)

    dist.all_to_all_single = counting_a2a  # type: ignore[assignment]
    dist.isend = counting_isend  # type: ignore[assignment]

    config = bounded_config()
    tables = make_tables(BOUNDED_TABLES)
    batch, steps = 16, 4
    batches = [
        [make_batch(tables, batch, seed=100 * s + r) for r in range(world_size)]
        for s in range(steps)
    ]
    sharder = LossyEmbeddingBagCollectionSharder(comms_config=config)
    run = TrainRun(tables, sharder, bounded_plan(), world_size)
    stats = run.model.module.lossy_stats
    per_step_err, per_step_count = [], []
    for s in range(steps):
        stats.reset()
        sent.clear()
        run.step(batches[s][rank], 1000 * s + rank)
        # Bytes handed to the payload all-to-all == wire bytes reported.
        fwd = stats.total("fwd")
        assert sum(sent) == fwd.wire_bytes, (sum(sent), fwd.wire_bytes)
        per_step_err.append(max(e.max_error for e in stats.tables("fwd").values()))
        per_step_count.append(max_row_count(batches[s]))
        tables_fwd = stats.tables("fwd")
        for table, width in BOUNDED_LOCAL_WIDTH[rank].items():
            # The self block (this rank's own rows) skips the codec and the wire.
            assert tables_fwd[table].raw_bytes == (world_size - 1) * batch * width * 4, table
            assert tables_fwd[table].max_error_over_bound <= 1.0, (table, tables_fwd[table])
        assert stats.self_bytes("fwd") == batch * sum(BOUNDED_LOCAL_WIDTH[rank].values()) * 4
        if "t3" in tables_fwd:  # not compressed: raw on the wire, exactly
            assert tables_fwd["t3"].wire_bytes == tables_fwd["t3"].raw_bytes
            assert tables_fwd["t3"].max_error == 0.0
        assert "t4" not in tables_fwd  # data parallel: no all-to-all
    ratio_t0 = stats.table("t0", "fwd").ratio if rank == 0 else None
    summary = stats.summary()

    ref_outs, ref_weights = reference_training(tables, batches, world_size, rank)
    # Step 0 (same weights): every output element within its table's bound.
    excess = {}
    for table, cols in column_slices(tables).items():
        ref_cols = torch.cat([ref_outs[0][:, c] for c in cols], dim=1)
        got_cols = torch.cat([run.outputs[0][:, c] for c in cols], dim=1)
        upper = abs_bound_upper(config, table, ref_cols)
        excess[table] = ((got_cols - ref_cols).abs().max() - upper).item()
    # Training: the forward error perturbs dL/dout = 2 (out - y) / N by 2 e / N (then /world in
    # the backward); a row's step sums at most count such terms. Factor 2 for second-order terms.
    n = run.outputs[0].numel()
    tol = 2 * sum(
        LR * c * 2 * e / (n * world_size) for c, e in zip(per_step_count, per_step_err, strict=True)
    )
    return {
        "excess": excess,
        "w_vs_ref": compare_weights(run.weights(), ref_weights),
        "tol": tol,
        "ratio_t0": ratio_t0,
        "summary": summary,
        "fwd_err": per_step_err,
    }


def test_bounded_forward_training_and_byte_counts() -> None:
    results = run_workers(_worker_bounded, 2)
    for rank, r in enumerate(results):
        for table, excess in r["excess"].items():
            assert excess <= 1e-5, (rank, table, r["excess"])
        assert max(r["fwd_err"]) > 0  # the forward really was lossy
        for key, diff in r["w_vs_ref"].items():
            assert diff <= r["tol"] + 1e-5, (rank, key, diff, r["tol"])
        assert "TOTAL" in r["summary"]
    assert results[0]["ratio_t0"] > 2.0, results[0]["summary"]


# ---------------------------------------------------------------------------------------------
# Evaluation: exact by default (bit-equal to TorchRec), lossy on request, lossy again in training.


def _eval_outputs(run: TrainRun, kjt: Any, training: bool) -> torch.Tensor:
    run.model.train(training)
    with torch.no_grad():
        per_key = run.model(kjt).wait().to_dict()
    keys: list[str] = kjt.keys()  # a KJT, not a dict
    return torch.cat([per_key[k] for k in keys], dim=1)


def _worker_eval(rank: int, world_size: int) -> dict[str, Any]:
    import dataclasses

    config = bounded_config()
    tables = make_tables(BOUNDED_TABLES)
    kjt = make_batch(tables, 16, seed=7 + rank)
    runs = {
        "torchrec": TrainRun(tables, _torchrec_sharder(), bounded_plan(), world_size),
        "exact": TrainRun(tables, _lossy_sharder(**vars(config)), bounded_plan(), world_size),
        "lossy": TrainRun(
            tables,
            _lossy_sharder(**vars(dataclasses.replace(config, evaluation="lossy"))),
            bounded_plan(),
            world_size,
        ),
    }
    out = {
        (name, mode): _eval_outputs(run, kjt, mode == "train")
        for name, run in runs.items()
        for mode in ("eval", "train", "eval again")
    }
    ref = out["torchrec", "eval"]
    excess = {}
    for table, cols in column_slices(tables).items():
        ref_cols = torch.cat([ref[:, c] for c in cols], dim=1)
        upper = abs_bound_upper(config, table, ref_cols)
        for key, got in out.items():
            got_cols = torch.cat([got[:, c] for c in cols], dim=1)
            excess[key, table] = ((got_cols - ref_cols).abs().max() - upper).item()
    return {
        "equal": {key: torch.equal(got, ref) for key, got in out.items()},
        "excess": excess,
        "fwd_err": runs["exact"].model.module.lossy_stats.total("fwd").max_error,
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_evaluation_is_exact_by_default_and_lossy_on_request() -> None:
    for rank, r in enumerate(run_workers(_worker_eval, 2, timeout_s=600)):
        eq = r["equal"]
        # Exact evaluation: bit-equal to TorchRec's sharder, before and after a training forward.
        assert eq["exact", "eval"] and eq["exact", "eval again"], (rank, eq)
        # Training stays lossy, and so does evaluation with evaluation="lossy".
        assert not eq["exact", "train"] and not eq["lossy", "train"], (rank, eq)
        assert not eq["lossy", "eval"] and not eq["lossy", "eval again"], (rank, eq)
        assert r["fwd_err"] > 0
        for key, excess in r["excess"].items():
            assert excess <= 1e-5, (rank, key, excess)


# ---------------------------------------------------------------------------------------------
# Three ranks, uneven batches, uneven splits, empty features, a rank without table-wise tables.

UNEVEN_TABLES = [
    ("t0", 30, 8, ["f0"]),
    ("t1", 40, 12, ["f1", "f1b"]),
    ("t2", 50, 12, ["f2"]),
    ("t3", 20, 8, ["f3"]),
    ("t4", 20, 4, ["f4"]),
]
UNEVEN_BATCH = [5, 8, 3]


def _uneven_plan() -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, table_wise

    return {
        "t0": table_wise(rank=0),
        "t1": table_wise(rank=2),  # rank 1 holds no table-wise table
        "t2": column_wise(ranks=[0, 1, 2]),
        "t3": column_wise(ranks=[1, 1]),  # two column shards of one table on one rank
        "t4": data_parallel(),
    }


def _worker_uneven(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec_lossy.config import ErrorBound

    tables = make_tables(UNEVEN_TABLES)
    steps = 2
    empty = {(0, 2): ["f1b"], (1, 0): ["f0"], (1, 1): ["f0"], (1, 2): ["f0"]}
    batches = [
        [
            make_batch(
                tables, UNEVEN_BATCH[r], seed=100 * s + r, empty_features=empty.get((s, r), ())
            )
            for r in range(world_size)
        ]
        for s in range(steps)
    ]
    runs = {
        "torchrec": TrainRun(tables, _torchrec_sharder(), _uneven_plan(), world_size),
        "exact": TrainRun(
            tables,
            _lossy_sharder(default_bound=ErrorBound("absolute", 0.0), **EXACT_BACKWARD),
            _uneven_plan(),
            world_size,
        ),
        "lossy": TrainRun(
            tables,
            _lossy_sharder(default_bound=ErrorBound("relative", 0.05), backward="lossy"),
            _uneven_plan(),
            world_size,
        ),
    }
    for s in range(steps):
        for run in runs.values():
            run.step(batches[s][rank], 1000 * s + rank)
    tr = runs["torchrec"]
    ref_outs, _ = reference_training(tables, batches, world_size, rank)
    config = runs["lossy"].model.module.lossy_comms.config
    excess = {}
    for table, cols in column_slices(tables).items():
        ref_cols = torch.cat([ref_outs[0][:, c] for c in cols], dim=1)
        got_cols = torch.cat([runs["lossy"].outputs[0][:, c] for c in cols], dim=1)
        upper = abs_bound_upper(config, table, ref_cols)
        excess[table] = ((got_cols - ref_cols).abs().max() - upper).item()
    lossy_stats = runs["lossy"].model.module.lossy_stats
    return {
        "out_equal": all(
            torch.equal(a, b) for a, b in zip(runs["exact"].outputs, tr.outputs, strict=True)
        ),
        "w_equal": same_local_pieces(runs["exact"].weights(), tr.weights()),
        "shape": tuple(runs["exact"].outputs[0].shape),
        "excess": excess,
        "fwd_err_over_bound": lossy_stats.total("fwd").max_error_over_bound,
        "bwd_err_over_bound": lossy_stats.total("bwd").max_error_over_bound,
    }


@pytest.mark.slow  # ~20-35 s of gloo ranks; CI runs it in the slow step
def test_three_ranks_uneven_batches_and_splits() -> None:
    results = run_workers(_worker_uneven, 3)
    for rank, r in enumerate(results):
        assert r["shape"][0] == UNEVEN_BATCH[rank]
        assert r["out_equal"], rank
        assert r["w_equal"], rank
        for table, excess in r["excess"].items():
            assert excess <= 1e-5, (rank, table, r["excess"])
        assert r["fwd_err_over_bound"] <= 1.0
        assert r["bwd_err_over_bound"] <= 1.0


# ---------------------------------------------------------------------------------------------
# Faults: a corrupt payload fails loudly on its receiver only (VBE inputs: test_vbe.py).


def _worker_faults(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import table_wise

    from torchrec_lossy.distributed import LossyAllToAllError

    tables = make_tables([("t0", 30, 8, ["f0"]), ("t1", 30, 8, ["f1"])])
    run = TrainRun(
        tables, _lossy_sharder(), {"t0": table_wise(rank=0), "t1": table_wise(rank=1)}, world_size
    )
    comms = run.model.module.lossy_comms
    batch = make_batch(tables, 8, seed=rank)
    out: dict[str, Any] = {}

    def corrupt(how: str, where: str = "fwd") -> Any:
        def hook(direction: str, source: int, payload: torch.Tensor) -> torch.Tensor:
            if rank != 1 or source != 0 or direction != where:  # the input dist: test_input_dist
                return payload
            if how == "truncate":
                return payload[:-8]
            payload = payload.clone()
            payload[-5] ^= 0xFF  # a byte of the last block's segment
            return payload

        return hook

    for how in ("flip", "truncate"):
        comms.payload_hook = corrupt(how)
        try:
            run.model(batch).wait()
            out[how] = "ok"
        except LossyAllToAllError as e:
            out[how] = str(e)
    # The gradient payload rank 0 sends rank 1 (the owner of t1) fails in rank 1's backward.
    comms.payload_hook = corrupt("flip", "bwd")
    try:
        run.step(batch, rank)
        out["bwd_flip"] = "ok"
    except LossyAllToAllError as e:
        out["bwd_flip"] = str(e)
    comms.payload_hook = None
    run.step(batch, rank)  # both ranks recover: forward and backward still work
    with torch.no_grad():  # and inference
        out["recovered"] = run.model(batch).wait().values().shape == run.outputs[-1].shape

    return out


@pytest.mark.slow
def test_corrupt_payload_fails_on_receiver_only() -> None:
    r0, r1 = run_workers(_worker_faults, 2)
    assert r0["flip"] == "ok" and r0["truncate"] == "ok"  # the sender side is unaffected
    for how in ("flip", "truncate"):
        msg = r1[how]
        assert "payload from rank 0" in msg and "t0" in msg and "on rank 1" in msg, msg
    assert r0["bwd_flip"] == "ok"
    msg = r1["bwd_flip"]
    assert "(bwd) on rank 1" in msg and "payload from rank 0" in msg and "t1" in msg, msg
    assert r0["recovered"] and r1["recovered"]


# ---------------------------------------------------------------------------------------------
# The planner, TrainPipelineSparseDist, profiler ranges and the bound-provider seam.

PIPELINE_TABLES = [
    ("t0", 40, 8, ["f0"]),
    ("t1", 40, 16, ["f1"]),
    ("t2", 40, 16, ["f2"]),
    ("t3", 20, 8, ["f3"]),
    ("t4", 40, 8, ["f4"]),
]


def _rw_on_cpu_sharder(**kwargs: Any) -> Any:
    """The lossy sharder, also offering row-wise on CPU (TorchRec's CPU planner does not)."""
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    class RwOnCpuSharder(LossyEmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [*super().sharding_types(compute_device_type), "row_wise"]

    return RwOnCpuSharder(**kwargs)


class _CountingBounds(torch.nn.Module):
    """A provider with state: the seam the adaptive bounds plug into."""

    def __init__(self, table_names: list[str], config: Any) -> None:
        super().__init__()
        self._config = config
        self.register_buffer("observed", torch.zeros((), dtype=torch.int64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def bound(self, table: str) -> Any:
        return self._config.table(table).bound

    def observe(self, table: str, block: torch.Tensor, abs_bound: float) -> None:
        self.observed += 1

    def step(self) -> None:
        self.steps += 1


def _worker_pipeline(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed import (
        bounds_state,
        load_bounds_state,
        lossy_modules,
        lossy_stats,
        step_lossy_bounds,
    )

    tables = make_tables(PIPELINE_TABLES)
    model = DLRMish(make_ebc(tables, device="meta"), sum(t.embedding_dim for t in tables))
    sharder = _rw_on_cpu_sharder(
        fused_params=sgd_fused_params(0.1),
        comms_config=LossyCommsConfig(),
        bounds_factory=_CountingBounds,
    )
    constraints = {
        "t0": ParameterConstraints(sharding_types=["table_wise"]),
        "t1": ParameterConstraints(sharding_types=["column_wise"]),
        "t2": ParameterConstraints(sharding_types=["table_column_wise"]),
        "t3": ParameterConstraints(sharding_types=["data_parallel"]),
        "t4": ParameterConstraints(sharding_types=["row_wise"]),
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder], device=CPU)
    sharded = dmp.module.ebc
    opt = torch.optim.SGD(dmp.parameters(), lr=0.1)

    def batches(n: int, seed: int) -> Any:
        for i in range(n):
            kjt = make_batch(tables, 8, seed=seed + 10 * i + rank)
            labels = (torch.rand(8, generator=torch.Generator().manual_seed(i)) > 0.5).float()
            yield Batch(dense_features=torch.zeros(8, 1), sparse_features=kjt, labels=labels)

    pipeline = TrainPipelineSparseDist(dmp, opt, CPU)
    it = batches(6, 0)
    losses = []  # max |logit| per step (the pipeline returns the model's output)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        while True:
            try:
                logits = pipeline.progress(it)
            except StopIteration:
                break
            losses.append(float(logits.abs().max()))
            step_lossy_bounds(dmp)
    ranges = sorted({e.name for e in prof.events() if e.name.startswith("## lossy")})

    state = dmp.state_dict()
    fwd = sharded.lossy_stats.total("fwd")
    # A per-rank checkpoint of the providers: saved, stepped on, restored.
    saved = bounds_state(dmp)
    step_lossy_bounds(dmp)
    stepped = int(sharded.lossy_comms.bounds.steps)
    ledger = sharded.lossy_ledger
    ledger_steps, fwd_calls = ledger.steps, ledger.start("fwd").call
    load_bounds_state(dmp, saved)
    try:
        load_bounds_state(dmp, {"no.such.module": {}})
        bad_key = ""
    except KeyError as e:
        bad_key = str(e)
    return {
        "sharding_types": sorted(type(s).__name__ for s in sharded._embedding_shardings),
        "losses": losses,
        "ranges": ranges,
        "fwd_ratio": fwd.ratio,
        "fwd_err_over_bound": fwd.max_error_over_bound,
        "stats_via_sharder": list(sharder.stats()),
        "stats_via_model": list(lossy_stats(dmp)),
        "bounds_state": {k: int(v) for k, v in state.items() if k.startswith("ebc.lossy_bounds")},
        "lossy_modules": list(lossy_modules(dmp)),
        "saved_steps": {name: int(v["steps"]) for name, v in saved.items()},
        "stepped": stepped,
        "restored_steps": int(sharded.lossy_comms.bounds.steps),
        "ledger_steps": ledger_steps,
        "fwd_calls": fwd_calls,
        "ledger_on_comms": hasattr(sharded.lossy_comms, "ledger"),
        "bad_key": bad_key,
    }


@pytest.mark.slow  # ~20-35 s of gloo ranks; CI runs it in the slow step
def test_planner_pipeline_profiler_and_bound_provider_state() -> None:
    for r in run_workers(_worker_pipeline, 2):
        assert r["sharding_types"] == [
            "DpPooledEmbeddingSharding",
            "LossyCwPooledEmbeddingSharding",
            "LossyRwPooledEmbeddingSharding",
            "LossyTwCwPooledEmbeddingSharding",
            "LossyTwPooledEmbeddingSharding",
        ], r["sharding_types"]
        assert len(r["losses"]) == 6 and all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["fwd_ratio"] > 1.0 and r["fwd_err_over_bound"] <= 1.0
        for phase in ("encode", "sizes", "payload", "decode"):
            assert f"## lossy_a2a fwd {phase} ##" in r["ranges"], r["ranges"]
        assert "## lossy_a2a bwd payload ##" in r["ranges"], r["ranges"]
        assert r["stats_via_sharder"] == ["ebc"]
        assert r["stats_via_model"] == ["ebc"]
        # The provider is a registered submodule: its state is in the model's state_dict.
        assert r["bounds_state"]["ebc.lossy_bounds.steps"] == 6
        assert r["bounds_state"]["ebc.lossy_bounds.observed"] > 0
        # Keyed by the path in dmp.named_modules() (DMP wraps the model once more).
        assert r["lossy_modules"] == ["_dmp_wrapped_module.module.ebc"]
        assert r["saved_steps"] == {"_dmp_wrapped_module.module.ebc": 6}
        assert (r["stepped"], r["restored_steps"]) == (7, 6)
        # One ledger per module, stepped by step_lossy_bounds, drawn from by all its dists:
        # 6 forwards x 4 lossy output dists (TW, CW, TWCW, RW) numbered 0..23 together.
        assert (r["ledger_steps"], r["fwd_calls"]) == (7, 24)
        assert not r["ledger_on_comms"]  # LossyComms: configuration and statistics only
        assert "no.such.module" in r["bad_key"] and "module.ebc" in r["bad_key"]
