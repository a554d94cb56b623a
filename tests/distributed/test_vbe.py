"""Variable batch size per feature (VBE) on every sharding type TorchRec runs it on.

KJTs with ``stride_per_key_per_rank`` (each feature its own batch size on each rank, expanded
by ``inverse_indices``) through the lossy sharder on gloo ranks, against TorchRec's
``EmbeddingBagCollectionSharder``, on table-wise, column-wise, row-wise and table-row-wise
tables (2 ranks as 2 hosts, so the TWRW table's cross-host hop is the lossy one): outputs and
trained weights bit-equal at bound 0 with the exact backward, within the bound when lossy
(RW: the other rank's part, ``(world - 1) * bound``), the KJT input dist packed, and plain
batches of the same model in between; grid tables (no VBE path in TorchRec) are refused by
name. 4 ranks with uneven per-rank batches on TW/CW (slow).

TorchRec's RW VBE backward all-gathers uneven pieces, which gloo cannot; the reference runs it
with an exact stand-in (one broadcast per rank: the same bits), see :func:`_uneven_all_gather`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from harness import (
    EXACT_BACKWARD,
    LR,
    TrainRun,
    make_batch,
    make_tables,
    run_workers,
    same_local_pieces,
    sgd_fused_params,
    vbe_batch,
)

pytestmark = pytest.mark.dist

VBE_TABLES = [
    ("t0", 40, 8, ["f0"]),
    ("t1", 30, 8, ["f1", "f1b"]),
    ("c0", 50, 16, ["g0"]),
    ("rw0", 64, 8, ["h0", "h0b"]),
    ("tr", 48, 8, ["r0"]),
]
TW_CW_TABLES = VBE_TABLES[:3]


def _fused(generator: Any) -> Any:
    """A sharding_plan generator whose tables use the fused kernel (TorchRec's dense CPU kernel
    does not pool VBE batches; ``table_row_wise`` takes no kernel argument)."""

    def gen(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(generator(*args, **kwargs), compute_kernel="fused")

    return gen


def _plan(world_size: int = 2) -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import (
        column_wise,
        row_wise,
        table_row_wise,
        table_wise,
    )

    plan = {
        "t0": table_wise(rank=0),
        "t1": table_wise(rank=world_size - 1),
        "c0": column_wise(ranks=[0, world_size - 1]),
        "rw0": row_wise(),
        "tr": table_row_wise(host_index=world_size - 1),  # one rank per host: a cross-host hop
    }
    return {t: _fused(g) for t, g in plan.items()}


def _sharders(bound: float | None) -> Any:
    """TorchRec's sharder (bound None) or the lossy one, both with fused exact SGD."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_lossy.config import ErrorBound, LossyCommsConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    fused = sgd_fused_params(LR)
    if bound is None:
        return EmbeddingBagCollectionSharder(fused_params=fused)
    config = LossyCommsConfig(
        default_bound=ErrorBound("absolute", bound), local_world_size=1, **EXACT_BACKWARD
    )
    return LossyEmbeddingBagCollectionSharder(fused_params=fused, comms_config=config)


class _Done:
    """A finished collective's work handle."""

    def wait(self) -> bool:
        return True


def _uneven_all_gather(original: Any) -> Any:
    """``dist.all_gather`` that also takes pieces of different sizes (gloo's does not): each
    rank broadcasts its piece, so every rank gets the same bits an all-gather delivers."""
    import torch.distributed as dist

    def all_gather(tensor_list: list, tensor: Any, group: Any = None, async_op: bool = False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return original(tensor_list, tensor, group=group, async_op=async_op)
        me = dist.get_rank(group)
        for src, out in enumerate(tensor_list):
            buf = tensor.contiguous().clone() if src == me else out
            dist.broadcast(
                buf, src=dist.get_global_rank(group or dist.group.WORLD, src), group=group
            )
            if src == me:
                out.copy_(buf)
        return _Done() if async_op else None

    return all_gather


def _one_rank_per_host() -> None:
    """Each rank its own host (TorchRec's TWRW groups read ``LOCAL_WORLD_SIZE``), and TorchRec's
    uneven VBE all-gather runnable on gloo."""
    import torch.distributed as dist

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    dist.all_gather = _uneven_all_gather(dist.all_gather)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist

    from torchrec_lossy.distributed.output_dist import LossyVariableBatchAllToAll
    from torchrec_lossy.distributed.rw_sharding import LossyRwPooledEmbeddingDist

    _one_rank_per_host()
    tables = make_tables(VBE_TABLES)
    bound = 0.01
    runs = {
        name: TrainRun(tables, _sharders(b), _plan(), world_size, local_size=1)
        for name, b in (("torchrec", None), ("exact", 0.0), ("lossy", bound))
    }
    # VBE batches only: TorchRec's RW dist creates its reduce-scatter for the first batch's
    # kind and fails on a batch of the other kind (the 4-rank TW/CW test mixes them).
    batches = [
        vbe_batch(tables, 6, seed=10 + rank),
        vbe_batch(tables, 4, seed=20 + rank),
        vbe_batch(tables, 5 + rank, seed=30 + rank),
    ]
    fwd = {}
    for s, batch in enumerate(batches):
        for name, run in runs.items():
            run.step(batch, 1000 * s + rank)
            if s == 0 and name == "lossy":  # the first VBE batch's telemetry alone
                stats = run.model.module.lossy_stats.tables("fwd")
                fwd = {t: (v.raw_bytes, v.wire_bytes, v.max_error) for t, v in stats.items()}
    tr, exact, lossy = runs["torchrec"], runs["exact"], runs["lossy"]
    dists = lossy.model.module._output_dists
    cross = [d._variable_cross_dist for d in dists if isinstance(d, TwRwPooledEmbeddingDist)]
    return {
        "rw_lossy": any(isinstance(d, LossyRwPooledEmbeddingDist) for d in dists),
        "twrw_vbe_lossy": len(cross) == 1 and isinstance(cross[0], LossyVariableBatchAllToAll),
        # The features the packed input dist carried (TW/CW and RW; TWRW's is TorchRec's).
        "input_keys": sorted(exact.model.module.lossy_stats.tables("input")),
        "grid_refusal": _grid_refusal(world_size),
        "shapes": [tuple(o.shape) for o in exact.outputs],
        "exact_out_equal": [
            torch.equal(a, b) for a, b in zip(exact.outputs, tr.outputs, strict=True)
        ],
        "exact_w_equal": same_local_pieces(exact.weights(), tr.weights()),
        # Step 0 only: the lossy step 1 changes the weights step 2 reads.
        "lossy_vbe_err": (lossy.outputs[0] - tr.outputs[0]).abs().max().item(),
        "fwd": fwd,
        "bound": bound,
    }


def _grid_refusal(world_size: int) -> str:
    """The error a VBE batch on a grid-sharded table raises (TorchRec has no VBE path there)."""
    from torchrec.distributed.sharding_plan import grid_shard

    tables = make_tables([("tg", 48, 16, ["q0"])])
    run = TrainRun(
        tables, _sharders(0.0), {"tg": _fused(grid_shard(host_indexes=[0]))}, world_size, 1
    )
    try:
        run.step(vbe_batch(tables, 4, seed=7), 0)
    except NotImplementedError as e:
        return str(e)
    return ""


@pytest.mark.timeout(1200)
def test_vbe_on_every_sharding_type_bit_equal_to_torchrec() -> None:
    results = run_workers(_worker, 2, timeout_s=900)
    # Every feature but the TWRW table's (TorchRec's input dist there) travelled packed.
    features = [f for t, _, _, fs in VBE_TABLES for f in fs if t != "tr"]
    for rank, r in enumerate(results):
        assert r["rw_lossy"] and r["twrw_vbe_lossy"], rank
        assert set(features) <= set(r["input_keys"]), r["input_keys"]
        assert "tg" in r["grid_refusal"] and "VBE" in r["grid_refusal"], r["grid_refusal"]
        assert r["shapes"][0][0] == 6 and r["shapes"][2][0] == 5 + rank, r["shapes"]
        assert all(r["exact_out_equal"]), (rank, r["exact_out_equal"])
        assert r["exact_w_equal"], rank
        # With 2 ranks the RW sum has one coded part: within (world - 1) * bound = bound.
        assert 0 < r["lossy_vbe_err"] <= r["bound"] + 1e-6, (rank, r["lossy_vbe_err"])
        # Every table this rank sends went through the coded all-to-all (blocks this small
        # cost about their raw size: no ratio asserted here).
        owned = ("t0", "c0", "rw0") if rank == 0 else ("t1", "c0", "rw0", "tr")
        for table in owned:
            raw, wire, err = r["fwd"][table]
            assert raw > 0 and wire > 0 and err <= r["bound"], (rank, table, r["fwd"])


def _worker_four(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import column_wise, table_wise

    tables = make_tables(TW_CW_TABLES)
    plan = {
        "t0": table_wise(rank=0, compute_kernel="fused"),
        "t1": table_wise(rank=1, compute_kernel="fused"),
        "c0": column_wise(ranks=[2, 3], compute_kernel="fused"),
    }
    bound = 0.01
    runs = {
        name: TrainRun(tables, _sharders(b), plan, world_size)
        for name, b in (("torchrec", None), ("exact", 0.0), ("lossy", bound))
    }
    # Every rank its own batch: VBE, a plain batch (the fixed-batch path), VBE again.
    batches = [
        vbe_batch(tables, 3 + 2 * rank, seed=50 + rank),
        make_batch(tables, 4 + rank, seed=60 + rank),
        vbe_batch(tables, 6 - rank, seed=70 + rank),
    ]
    for s, batch in enumerate(batches):
        for run in runs.values():
            run.step(batch, 1000 * s + rank)
    tr, exact, lossy = runs["torchrec"], runs["exact"], runs["lossy"]
    fwd = lossy.model.module.lossy_stats.tables("fwd")
    return {
        "rows": [o.shape[0] for o in exact.outputs],
        "exact_out_equal": all(
            torch.equal(a, b) for a, b in zip(exact.outputs, tr.outputs, strict=True)
        ),
        "exact_w_equal": same_local_pieces(exact.weights(), tr.weights()),
        "lossy_vbe_err": (lossy.outputs[0] - tr.outputs[0]).abs().max().item(),
        "coded": {t: (v.raw_bytes, v.wire_bytes, v.max_error) for t, v in fwd.items()},
        "bound": bound,
    }


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_vbe_on_four_ranks_with_uneven_batches() -> None:
    results = run_workers(_worker_four, 4, timeout_s=1500)
    for rank, r in enumerate(results):
        assert r["rows"] == [3 + 2 * rank, 4 + rank, 6 - rank], (rank, r["rows"])
        assert r["exact_out_equal"] and r["exact_w_equal"], rank
        assert r["lossy_vbe_err"] <= r["bound"] + 1e-6, (rank, r["lossy_vbe_err"])
    # A rank whose batches are all small can receive only raw blocks (error 0, see the last
    # test); the ranks with larger batches receive quantized ones.
    assert max(r["lossy_vbe_err"] for r in results) > 0, [r["lossy_vbe_err"] for r in results]
    owners = {"t0": [0], "t1": [1], "c0": [2, 3]}
    for table, ranks in owners.items():
        for rank in ranks:
            raw, wire, err = results[rank]["coded"][table]
            assert raw > 0 and wire > 0 and err <= results[rank]["bound"], (table, rank)


def _worker_one_owner(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import table_wise

    tables = make_tables(TW_CW_TABLES)
    plan = {t.name: table_wise(rank=0, compute_kernel="fused") for t in tables}
    tr = TrainRun(tables, _sharders(None), plan, world_size)
    exact = TrainRun(tables, _sharders(0.0), plan, world_size)
    for s in range(2):
        batch = vbe_batch(tables, 4 + rank, seed=40 + 10 * s + rank)
        tr.step(batch, s)
        exact.step(batch, s)
    return {
        "out_equal": all(torch.equal(a, b) for a, b in zip(exact.outputs, tr.outputs, strict=True)),
        "w_equal": same_local_pieces(exact.weights(), tr.weights()),
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vbe_with_a_rank_without_local_features() -> None:
    # Rank 1 owns no table: it only receives, with no per-feature batches of its own to send.
    for rank, r in enumerate(run_workers(_worker_one_owner, 2, timeout_s=600)):
        assert r["out_equal"] and r["w_equal"], (rank, r)


def test_pad_and_unpad_follow_torchrec_flat_layout() -> None:
    from torchrec_lossy.distributed.vbe import pad_vbe_input, unpad_vbe_output

    dims = [2, 3]  # two local features
    batches = [[1, 3], [2, 0]]  # per destination, per feature
    flat = torch.arange(1.0, 16.0).requires_grad_()  # 1*2 + 3*3 to rank 0, 2*2 to rank 1
    padded = pad_vbe_input(flat, batches, dims, rows_per_rank=[3, 2])
    assert padded.shape == (5, 5)
    # Destination 0: feature 0's one bag, then zeros; feature 1's three bags.
    assert padded[0, :2].tolist() == [1.0, 2.0] and padded[1:3, :2].abs().sum() == 0
    assert padded[:3, 2:].reshape(-1).tolist() == list(range(3, 12))
    # Destination 1 receives it all (a single source): its flat VBE output is the input's part.
    got = unpad_vbe_output(padded[3:], batch_size_per_feature_pre_a2a=batches[1], dims=dims)
    assert torch.equal(got, flat[11:].detach())
    # The backward is the adjoint: gradients land on the values they came from, exactly.
    got.sum().backward()
    assert flat.grad is not None and flat.grad[11:].eq(1).all() and flat.grad[:11].eq(0).all()


def test_a_block_of_a_few_vectors_travels_exact_with_zero_error() -> None:
    # Why a coded table can report max_error 0: the codec sends a block raw (lossless) when
    # quantizing it would not be smaller, as for a 3-bag, 8-column block; 5 rows quantize.
    from torchrec_lossy.codec.pipeline import compress_with_stats

    g = torch.Generator().manual_seed(0)
    few, more = (torch.randn(n, 8, generator=g) for n in (3, 64))
    _, (few_stats, more_stats) = compress_with_stats([few, more], [0.01, 0.01])
    assert few_stats.mode == "raw" and few_stats.max_error == 0.0, few_stats
    assert more_stats.mode.startswith("quant") and 0 < more_stats.max_error <= 0.01, more_stats
