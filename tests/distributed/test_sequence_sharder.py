"""Multi-process (gloo) tests of the lossy EmbeddingCollection sharder against TorchRec's.

Each test spawns its ranks once and checks several things inside them, to keep the suite fast.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from harness import (
    load_full_weights,
    local_weights,
    make_batch,
    max_row_count,
    run_workers,
    same_local_pieces,
    sgd_fused_params,
    vbe_batch,
)

from torchrec_lossy.distributed.stats import CONTAINER

pytestmark = pytest.mark.dist

LR = 0.5
DIM = 8
CPU = torch.device("cpu")
EXACT = {"backward": "none", "backward_dedupe": False}
# (name, rows, features); every table of an EmbeddingCollection has the same dim.
TABLES = [("t0", 40, ["f0"]), ("t1", 30, ["f1", "f1b"]), ("t2", 50, ["f2"]), ("t3", 20, ["f3"])]
FWD_BOUND = 0.01
BWD_BOUND = 1e-4


def _ec_tables(specs: list[tuple[str, int, list[str]]] = TABLES) -> list:
    from torchrec import EmbeddingConfig

    return [
        EmbeddingConfig(name=n, num_embeddings=rows, embedding_dim=DIM, feature_names=list(fs))
        for n, rows, fs in specs
    ]


def _make_ec(tables: list) -> Any:
    from torchrec import EmbeddingCollection

    ec = EmbeddingCollection(tables=tables, device=CPU)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ec.parameters():
            p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
    return ec


def _plan(world_size: int = 2) -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    # The fused kernel: with TorchRec's CPU default ("dense"), its own EC sharder crashes in the
    # sequence all-to-all's permute.
    last = world_size - 1
    return {
        "t0": table_wise(rank=0, compute_kernel="fused"),
        "t1": table_wise(rank=last, compute_kernel="fused"),
        "t2": column_wise(ranks=[0, last], compute_kernel="fused"),
        "t3": row_wise(compute_kernel="fused"),
    }


def _lossy_sharder(**comms: Any) -> Any:
    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed import LossyEmbeddingCollectionSharder

    return LossyEmbeddingCollectionSharder(
        fused_params=sgd_fused_params(LR), comms_config=LossyCommsConfig(**comms)
    )


def _torchrec_sharder() -> Any:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    return EmbeddingCollectionSharder(fused_params=sgd_fused_params(LR))


def _shard(module: Any, sharder: Any, world_size: int, path: str = "") -> Any:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    plan = construct_module_sharding_plan(
        module, _plan(world_size), sharder=sharder, local_size=world_size, world_size=world_size,
        device_type="cpu",
    )  # fmt: skip
    model = DistributedModelParallel(
        module, device=CPU, plan=ShardingPlan({path: plan}), sharders=[sharder]
    )
    load_full_weights(model.state_dict(), _make_ec(_ec_tables()).state_dict())
    return model


def _values(per_key: dict[str, Any], keys: list[str]) -> torch.Tensor:
    return torch.cat([per_key[k].values() for k in keys])


def _copy(kjt: Any) -> Any:
    """A KJT with its own storage (TorchRec's EC may release its input's storage early)."""
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=kjt.values().clone(), lengths=kjt.lengths().clone()
    )


def _step(model: Any, kjt: Any, seed: int) -> torch.Tensor:
    """One fused-SGD step against a seeded target; returns the (detached) sequence embeddings."""
    values = _values(model(_copy(kjt)).wait(), kjt.keys())
    g = torch.Generator().manual_seed(seed)
    ((values - torch.rand(values.shape, generator=g)) ** 2).sum().backward()
    return values.detach().clone()


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    la, lb = local_weights(a), local_weights(b)
    return max(
        (ta - tb).abs().max().item() if ta.numel() else 0.0
        for key in la
        for (_, ta), (_, tb) in zip(la[key], lb[key], strict=True)
    )


def _worker_tw_cw(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec_lossy.config import ErrorBound
    from torchrec_lossy.distributed import LossyAllToAllError, lossy_stats

    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchrec_lossy").addHandler(handler)

    tables = _ec_tables()
    steps = 2
    batches = [
        [make_batch(tables, 6, seed=100 * s + r) for r in range(world_size)] for s in range(steps)
    ]
    exact = ErrorBound("absolute", 0.0)
    lossy = {
        "default_bound": ErrorBound("absolute", FWD_BOUND),
        "backward": "lossy",
        "backward_bound": ErrorBound("absolute", BWD_BOUND),
    }
    models = {
        "torchrec": _shard(_make_ec(tables), _torchrec_sharder(), world_size),
        "exact": _shard(_make_ec(tables), _lossy_sharder(default_bound=exact, **EXACT), world_size),
        "lossy": _shard(_make_ec(tables), _lossy_sharder(**lossy), world_size),
    }
    # Evaluation before any step (same weights): exact by default, so bit-equal to TorchRec.
    with torch.no_grad():
        evals = {}
        for name in ("torchrec", "lossy"):
            models[name].eval()
            kjt = batches[0][rank]
            evals[name] = _values(models[name](_copy(kjt)).wait(), kjt.keys())
            models[name].train()
    outs = {name: [] for name in models}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for s in range(steps):
            for name, model in models.items():
                outs[name].append(_step(model, batches[s][rank], 1000 * s + rank))
    tr = models["torchrec"].state_dict()
    found = lossy_stats(models["lossy"])
    stats = models["lossy"].module.lossy_stats
    result: dict[str, Any] = {
        "exact_out_equal": all(
            torch.equal(a, b) for a, b in zip(outs["exact"], outs["torchrec"], strict=True)
        ),
        "exact_w_equal": same_local_pieces(models["exact"].state_dict(), tr),
        "lossy_eval_equal": torch.equal(evals["lossy"], evals["torchrec"]),
        "lossy_out0_err": (outs["lossy"][0] - outs["torchrec"][0]).abs().max().item(),
        "lossy_w_err": _max_diff(models["lossy"].state_dict(), tr),
        "max_count": max(max_row_count(b) for b in batches),
        "fwd": stats.total("fwd"),
        "exact_fwd": models["exact"].module.lossy_stats.total("fwd"),
        "bwd": stats.total("bwd"),
        # Bytes of no block: codec headers, and the one-round slots' headers and slack.
        "fwd_container": stats.table(CONTAINER, "fwd").wire_bytes,
        "tables_fwd": {t: stats.table(t, "fwd") for t in ("t0", "t1", "t2", "t3")},
        "logs": logs,
        "ranges": {e.name for e in prof.events() if e.name.startswith("## lossy_")},
        "module_type": type(models["lossy"].module).__name__,
        "found_stats": list(found.values()) == [stats],
    }
    # A corrupt forward payload: the receiver raises naming the source rank (both ranks do).
    sharded = models["lossy"].module

    def corrupt(direction: str, source: int, payload: torch.Tensor) -> torch.Tensor:
        bad = payload.clone()
        if direction == "fwd" and bad.numel():
            bad[bad.numel() // 2 :] ^= 0x5A
        return bad

    sharded.lossy_comms.payload_hook = corrupt
    try:
        models["lossy"](_copy(batches[0][rank])).wait()
        result["corrupt"] = None
    except LossyAllToAllError as e:
        result["corrupt"] = str(e)
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ec_tw_cw_rw_lossless_bit_equal_and_lossy_within_bound() -> None:
    results = run_workers(_worker_tw_cw, 2, timeout_s=900)
    for t in ("t0", "t1", "t2", "t3"):  # every TW / CW / RW table's ids travelled compressed
        assert sum(r["tables_fwd"][t].rows_sent for r in results) > 0, t
    for rank, r in enumerate(results):
        assert r["module_type"] == "LossyShardedEmbeddingCollection"
        assert r["found_stats"]  # lossy_stats(model) finds the EC's telemetry
        # Lossless: outputs and trained weights (so gradients) bit-equal to TorchRec.
        assert r["exact_out_equal"], rank
        assert r["exact_w_equal"], rank
        assert r["lossy_eval_equal"], rank  # evaluation is exact by default
        # Lossy forward: every value within the bound of TorchRec's (same weights at step 0).
        assert r["lossy_out0_err"] <= FWD_BOUND * (1 + 1e-5), r["lossy_out0_err"]
        # After 2 steps: each weight moved by lr x (its gradient sum), each gradient row within
        # BWD_BOUND, and step 1 saw forward values within FWD_BOUND (d loss / d v = 2 (v - t)).
        count = r["max_count"] * 2  # up to `count` copies per step, 2 steps
        tol = LR * count * (BWD_BOUND + 2 * FWD_BOUND) + 1e-5
        assert r["lossy_w_err"] <= tol, (r["lossy_w_err"], tol)
        fwd, bwd = r["fwd"], r["bwd"]
        # Tiny blocks: the codec shrinks them; the headers (codec and slot) weigh.
        assert fwd.wire_bytes > 0 and fwd.raw_bytes > fwd.wire_bytes - r["fwd_container"], fwd
        # The row dedupe (on by default) sends fewer rows than ids, both ways; lossless too.
        assert 0 < fwd.rows_sent < fwd.rows and 0 < bwd.rows_sent < bwd.rows, (fwd, bwd)
        assert 0 < r["exact_fwd"].rows_sent < r["exact_fwd"].rows, r["exact_fwd"]
        # The gradient blocks are small here (the codec may keep them exact): within bound.
        assert bwd.wire_bytes > 0, bwd
        assert bwd.max_error_over_bound <= 1.0, bwd
        for t, ts in r["tables_fwd"].items():  # counted by the sender: the owner's tables
            assert ts.max_error_over_bound <= 1.0, (t, ts)
        # Every table compressed, the row-wise one too: no table is warned about.
        assert not [m for m in r["logs"] if any(f"'{t}'" in m for t in r["tables_fwd"])]
        for phase in ("encode", "sizes", "payload", "decode"):
            assert f"## lossy_a2a fwd {phase} ##" in r["ranges"], r["ranges"]
            assert f"## lossy_a2a bwd {phase} ##" in r["ranges"], r["ranges"]
        assert r["corrupt"] is not None and f"from rank {1 - rank}" in r["corrupt"], r["corrupt"]


# ---------------------------------------------------------------------------------------------
# The gradient dedupe (the adjoint of the row dedupe) against TorchRec, with integer gradients:
# every sum of them is exact in fp32, whatever its order, so trained weights are bit-equal.


def _step_integer_grads(model: Any, kjt: Any, seed: int) -> torch.Tensor:
    """One fused-SGD step whose gradient w.r.t. each sequence embedding is a small integer."""
    values = _values(model(_copy(kjt)).wait(), kjt.keys())
    g = torch.Generator().manual_seed(seed)
    (values * torch.randint(-3, 4, values.shape, generator=g).float()).sum().backward()
    return values.detach().clone()


def _worker_grad_dedupe(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec_lossy.config import ErrorBound, InputDistConfig

    tables = _ec_tables()
    batches = [[make_batch(tables, 6, seed=100 * s + r) for r in range(world_size)] for s in (0, 1)]
    exact = ErrorBound("absolute", 0.0)
    models = {
        "torchrec": _shard(_make_ec(tables), _torchrec_sharder(), world_size),
        # Defaults but exact: row dedupe both ways.
        "dedupe": _shard(_make_ec(tables), _lossy_sharder(default_bound=exact, backward="none"),
                         world_size),
        # The row dedupe off: every id's row and gradient travel.
        "no_dedupe": _shard(
            _make_ec(tables),
            _lossy_sharder(default_bound=exact, backward="none",
                           input_dist=InputDistConfig(dedupe_outputs=False)),
            world_size,
        ),
    }  # fmt: skip
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    for s in (0, 1):
        for name, model in models.items():
            outs[name].append(_step_integer_grads(model, batches[s][rank], 1000 * s + rank))
    tr = models["torchrec"].state_dict()
    result: dict[str, Any] = {}
    for name in ("dedupe", "no_dedupe"):
        stats = models[name].module.lossy_stats
        pairs = zip(outs[name], outs["torchrec"], strict=True)
        result[name] = {
            "out_equal": all(torch.equal(a, b) for a, b in pairs),
            "w_equal": same_local_pieces(models[name].state_dict(), tr),
            "fwd": stats.total("fwd"),
            "bwd": stats.total("bwd"),
        }
    return result


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ec_row_and_gradient_dedupe_bit_equal_to_torchrec(world_size: int) -> None:
    results = run_workers(_worker_grad_dedupe, world_size, timeout_s=1200)
    for rank, r in enumerate(results):
        for name in ("dedupe", "no_dedupe"):
            # Outputs and trained weights (so gradients: lr 0.5) bit-equal on TW, CW and RW; with
            # 4 ranks, two ranks hold row-wise shards only (no TW/CW table).
            assert r[name]["out_equal"], (rank, name)
            assert r[name]["w_equal"], (rank, name)
        dd, full = r["dedupe"], r["no_dedupe"]
        for d in ("fwd", "bwd"):  # at most one row per distinct id both ways, every row without
            assert dd[d].rows_sent <= dd[d].rows == full[d].rows == full[d].rows_sent, d
    # Over all ranks (a rank's few ids may not repeat): fewer rows and bytes with the dedupe.
    for d in ("fwd", "bwd"):
        dd_rows = sum(r["dedupe"][d].rows_sent for r in results)
        assert 0 < dd_rows < sum(r["dedupe"][d].rows for r in results), d
        dd_bytes = sum(r["dedupe"][d].wire_bytes for r in results)
        assert dd_bytes < sum(r["no_dedupe"][d].wire_bytes for r in results), d


# ---------------------------------------------------------------------------------------------
# A model with an EmbeddingBagCollection and an EmbeddingCollection takes both sharders.


class _TwoModules(torch.nn.Module):
    def __init__(self, ebc: Any, ec: Any) -> None:
        super().__init__()
        self.ebc = ebc
        self.ec = ec

    def forward(self, kjt: Any) -> tuple[Any, Any]:
        return self.ebc(kjt), self.ec(kjt)


def _copy_vbe(kjt: Any) -> Any:
    """A VBE KJT with its own storage (see :func:`_copy`)."""
    from torchrec import KeyedJaggedTensor

    keys, inverse = kjt.inverse_indices()
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values().clone(),
        lengths=kjt.lengths().clone(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
        inverse_indices=(keys, inverse.clone()),
    )


def _worker_vbe(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec_lossy.config import ErrorBound

    tables = _ec_tables()
    models = {
        "torchrec": _shard(_make_ec(tables), _torchrec_sharder(), world_size),
        "exact": _shard(
            _make_ec(tables),
            _lossy_sharder(default_bound=ErrorBound("absolute", 0.0), **EXACT),
            world_size,
        ),
        "lossy": _shard(
            _make_ec(tables),
            _lossy_sharder(default_bound=ErrorBound("absolute", FWD_BOUND), **EXACT),
            world_size,
        ),
    }
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    for s in range(2):
        kjt = vbe_batch(tables, 12 + rank, seed=100 * s + rank)
        for name, model in models.items():
            values = _values(model(_copy_vbe(kjt)).wait(), kjt.keys())
            g = torch.Generator().manual_seed(1000 * s + rank)
            ((values - torch.rand(values.shape, generator=g)) ** 2).sum().backward()
            outs[name].append(values.detach().clone())
    tr = models["torchrec"].state_dict()
    fwd = models["lossy"].module.lossy_stats.total("fwd")
    return {
        "exact_out_equal": all(
            torch.equal(a, b) for a, b in zip(outs["exact"], outs["torchrec"], strict=True)
        ),
        "exact_w_equal": same_local_pieces(models["exact"].state_dict(), tr),
        "lossy_out0_err": (outs["lossy"][0] - outs["torchrec"][0]).abs().max().item(),
        "coded": fwd.raw_bytes > 0 and fwd.wire_bytes > 0,
    }


@pytest.mark.timeout(900)
def test_ec_vbe_bit_equal_to_torchrec_and_lossy_within_bound() -> None:
    # TorchRec's EC runs VBE by padding the KJT to its largest batch before the input dist and
    # taking the padding out of the outputs; the lossy dists carry the padded batch, whose
    # size differs per rank (the batch sizes come with the packed input dist's KJT).
    results = run_workers(_worker_vbe, 2, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["exact_out_equal"] and r["exact_w_equal"], (rank, r)
        assert r["lossy_out0_err"] <= FWD_BOUND + 1e-6 and r["coded"], (rank, r)
    # Blocks of a few rows travel raw (error 0, test_vbe.py), larger ones quantized.
    assert max(r["lossy_out0_err"] for r in results) > 0, results


def _worker_both(rank: int, world_size: int) -> dict[str, Any]:
    from harness import make_ebc, make_tables
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed import (
        LossyEmbeddingBagCollectionSharder,
        LossyEmbeddingCollectionSharder,
        lossy_stats,
    )

    ec_tables = _ec_tables([("s0", 40, ["q0"]), ("s1", 30, ["q1"])])
    ebc_tables = make_tables([("b0", 40, 8, ["p0"]), ("b1", 30, 4, ["p1"])])
    model = _TwoModules(make_ebc(ebc_tables), _make_ec(ec_tables))
    config = LossyCommsConfig()
    sharders = [
        LossyEmbeddingBagCollectionSharder(comms_config=config),
        LossyEmbeddingCollectionSharder(comms_config=config),
    ]
    plans = {
        path: construct_module_sharding_plan(
            getattr(model, path),
            {
                t.name: table_wise(rank=i % world_size, compute_kernel="fused")
                for i, t in enumerate(tables)
            },
            sharder=sharder,
            local_size=world_size,
            world_size=world_size,
            device_type="cpu",
        )
        for path, tables, sharder in (
            ("ebc", ebc_tables, sharders[0]),
            ("ec", ec_tables, sharders[1]),
        )
    }
    dmp = DistributedModelParallel(model, device=CPU, plan=ShardingPlan(plans), sharders=sharders)
    kjt = make_batch([*ebc_tables, *ec_tables], 4, seed=rank)
    pooled, seq = dmp(kjt)
    pooled.wait(), seq.wait()
    return {
        "types": {path: type(getattr(dmp.module, path)).__name__ for path in ("ebc", "ec")},
        "stats": sorted(lossy_stats(dmp)),
        "fwd_bytes": {k: s.total("fwd").wire_bytes for k, s in lossy_stats(dmp).items()},
    }


@pytest.mark.slow
def test_model_with_ebc_and_ec_takes_both_sharders() -> None:
    for r in run_workers(_worker_both, 2, timeout_s=900):
        assert r["types"] == {
            "ebc": "LossyShardedEmbeddingBagCollection",
            "ec": "LossyShardedEmbeddingCollection",
        }
        assert r["stats"] == ["ebc", "ec"]
        assert all(n > 0 for n in r["fwd_bytes"].values()), r
