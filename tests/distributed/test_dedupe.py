"""Cross-side deduplication of the output dist: exact (the default) and the lookup variant.

Exact (``InputDistConfig.dedupe_outputs``): the owner gets the whole KJT, looks up every bag,
and the output dist sends each distinct bag's pooled row once per destination; bit-identical
training. Lookup (``dedupe_lookups``): the owner looks up each distinct id once per source and
the gradient is summed per distinct id before it goes back; forward exact, training equal
within float rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import (
    EXACT_BACKWARD,
    SHARDER_TABLES,
    compare_weights,
    holey_batch,
    load_full_weights,
    local_weights,
    make_batch,
    make_ebc,
    make_tables,
    manual_plan,
    mixed_batch,
    run_workers,
    sharder_plan,
    skewed_batch,
    train_step,
)

from torchrec_lossy.config import ErrorBound, InputDistConfig, LossyCommsConfig
from torchrec_lossy.distributed import LossyComms, StaticBounds
from torchrec_lossy.distributed.input_dist import encode_with_telemetry
from torchrec_lossy.distributed.stats import CONTAINER


def _comms(**input_dist: Any) -> LossyComms:
    config = LossyCommsConfig(input_dist=InputDistConfig(**input_dist))
    return LossyComms(config=config, bounds=StaticBounds([], config))


def test_encode_marks_only_unweighted_single_hot_features_with_repeats() -> None:
    from torchrec import KeyedJaggedTensor

    # a: single-hot with repeats; b: multi-hot; c: single-hot, all distinct.
    lengths = torch.tensor([1, 1, 1, 1, 2, 0, 1, 1, 1, 1, 1, 1])
    values = torch.tensor([5, 5, 7, 5, 1, 1, 2, 3, 9, 8, 7, 6])
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths)
    enc = encode_with_telemetry(kjt, [2, 1], _comms(dedupe_lookups=True), output_dedupe="lookup")
    (u, inv), b = enc.expand[0]
    assert b is None and enc.expand[1] == [None]
    assert u == 2 and inv.tolist() == [0, 0, 1, 0]  # distinct ids sorted: 5, 7
    assert enc.num_ids_per_dest == [2 + 4, 4]
    # Weighted KJTs keep the normal path (a bag's pooled vector is then weight * row).
    wkjt = KeyedJaggedTensor(
        keys=["a", "b", "c"], values=values, lengths=lengths, weights=torch.rand(12)
    )
    enc = encode_with_telemetry(wkjt, [2, 1], _comms(dedupe_lookups=True), output_dedupe="lookup")
    assert all(x is None for row in enc.expand for x in row)


def test_encode_marks_exact_output_dedupe_with_empty_bags() -> None:
    from torchrec import KeyedJaggedTensor

    # a: ids/empty bags with repeats; b: multi-hot; c: single-hot, all distinct; d: all empty;
    # e: single-hot with repeats.
    lengths = torch.tensor([1, 0, 1, 0, 1, 2, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    values = torch.tensor([5, 7, 5, 1, 1, 2, 3, 9, 8, 7, 3, 1, 3, 3])
    kjt = KeyedJaggedTensor(keys=["a", "b", "c", "d", "e"], values=values, lengths=lengths)
    enc = encode_with_telemetry(kjt, [2, 3], _comms(), output_dedupe="exact")
    (rows, inv), b = enc.expand[0]
    # Distinct bag keys in ascending order: empty (-1), 5, 7.
    assert b is None and rows == 3 and inv.tolist() == [1, 0, 2, 0]
    c, (rows_d, inv_d), (rows_e, inv_e) = enc.expand[1]
    assert c is None and rows_d == 1 and inv_d.tolist() == [0, 0, 0, 0]
    assert rows_e == 2 and inv_e.tolist() == [1, 0, 1, 1]  # distinct ids 1, 3
    # The KJT itself still travels whole: the same ids as without output dedupe.
    assert (
        enc.num_ids_per_dest
        == encode_with_telemetry(kjt, [2, 3], _comms()).num_ids_per_dest
        == [6, 8]
    )


def _batches(tables: list, rank: int) -> list[Any]:
    """One rank's batches: skewed, multi-hot, mixed, empty feature, single-hot with empty bags."""
    return [
        skewed_batch(tables, 32 + 8 * rank, seed=50 + rank),
        make_batch(tables, 6 + rank, seed=rank),  # multi-hot: normal path
        mixed_batch(tables, 24, seed=70 + rank),
        make_batch(tables, 5, seed=90 + rank, empty_features=["f3"]),
        holey_batch(tables, 20 + rank, seed=110 + rank),
    ]


def _expected_rows(
    tables: list, world_size: int, rank: int, step: int
) -> dict[str, tuple[int, int]]:
    """Per table the owner ``rank`` holds: (TorchRec's pooled rows, rows sent under exact
    output dedupe: per source and feature, the distinct bags (ids, and one empty bag) where
    bags hold <= 1 id and repeat, else the source's batch size), over the other ranks (the
    owner's own block skips the wire and is counted apart)."""
    owners = {"t0": [0], "t1": [1], "t2": [0, 1], "t3": [1]}  # sharder_plan()
    out: dict[str, tuple[int, int]] = {}
    for t in tables:
        if rank not in owners[t.name]:
            continue
        full = sent = 0
        for src in range(world_size):
            if src == rank:
                continue
            jts = _batches(tables, src)[step].to_dict()
            for f in t.feature_names:
                lens, ids = jts[f].lengths(), jts[f].values()
                distinct = len(set(ids.tolist())) + int(bool((lens == 0).any()))
                single = bool((lens <= 1).all())
                full += lens.numel()
                sent += distinct if single and distinct < lens.numel() else lens.numel()
        out[t.name] = (full, sent)
    return out


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    tables = make_tables(SHARDER_TABLES)
    exact, lossy = ErrorBound("absolute", 0.0), ErrorBound("relative", 0.03)

    def lossy_sharder(bound: ErrorBound, mode: str, **kw: Any) -> Any:
        input_dist = InputDistConfig(
            dedupe_outputs=mode == "exact", dedupe_lookups=mode == "lookup"
        )
        config = LossyCommsConfig(default_bound=bound, input_dist=input_dist, **kw)
        return LossyEmbeddingBagCollectionSharder(comms_config=config)

    variants: dict[str, Any] = {
        "torchrec": EmbeddingBagCollectionSharder(),
        "default": LossyEmbeddingBagCollectionSharder(
            comms_config=LossyCommsConfig(default_bound=exact, **EXACT_BACKWARD)
        ),
        "none": lossy_sharder(exact, "none", **EXACT_BACKWARD),
        "exact": lossy_sharder(exact, "exact", **EXACT_BACKWARD),
        # The gradient dedupe (the default backward's, here with an exact fp32 wire).
        "exact_gdd": lossy_sharder(exact, "exact", backward="none"),
        "lookup": lossy_sharder(exact, "lookup", backward="none"),
        "lookup_bwd_lossy": lossy_sharder(exact, "lookup", backward="lossy", backward_bound=exact),
        "lookup_bwd_fp16": lossy_sharder(exact, "lookup", backward="fp16"),
        "exact_bwd_fp16": lossy_sharder(exact, "exact", backward="fp16", backward_dedupe=False),
        "exact_gdd_fp16": lossy_sharder(exact, "exact", backward="fp16"),
        "none_bwd_fp16": lossy_sharder(exact, "none", backward="fp16"),
        "lossy_none": lossy_sharder(lossy, "none"),
        "lossy_exact": lossy_sharder(lossy, "exact"),
        "lossy_lookup": lossy_sharder(lossy, "lookup"),
    }
    batches = _batches(tables, rank)
    outs: dict[str, list[torch.Tensor]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    fwd_bytes: dict[str, list[tuple[int, int]]] = {}
    repeated: dict[str, list[int]] = {}
    rows: dict[str, list[dict[str, tuple[int, int]]]] = {}
    bwd_rows: dict[str, tuple[int, int]] = {}
    for name, sharder in variants.items():
        ebc = make_ebc(tables, seed=0)
        plan = manual_plan(ebc, sharder, sharder_plan(), world_size)
        model = DistributedModelParallel(
            ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder]
        )
        load_full_weights(model.state_dict(), ebc.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        outs[name], fwd_bytes[name], repeated[name], rows[name] = [], [], [], []
        for step, kjt in enumerate(batches):
            stats = getattr(model.module, "lossy_stats", None)
            if stats is not None:
                stats.reset()
            outs[name].append(train_step(model, opt, kjt, step, rank))
            if stats is not None:
                # The blocks' bytes: the container (codec headers, and the one-round slots'
                # headers and slack, sized by the previous step) is left out.
                blocks = [e for n, e in stats.tables("fwd").items() if n != CONTAINER]
                fwd_bytes[name].append(
                    (sum(e.raw_bytes for e in blocks), sum(e.wire_bytes for e in blocks))
                )
                repeated[name].append(stats.total("input").repeated_ids)
                rows[name].append(
                    {
                        n: (e.rows, e.rows_sent)
                        for n, e in stats.tables("fwd").items()
                        if n != CONTAINER and e.rows  # decode times name received tables too
                    }
                )
                if name == "exact_gdd":
                    for n, e in stats.tables("bwd").items():
                        r0, s0 = bwd_rows.get(n, (0, 0))
                        bwd_rows[n] = (r0 + e.rows, s0 + e.rows_sent)
        weights[name] = {
            f"{k}@{o}": t.clone()
            for k, pieces in local_weights(model.state_dict()).items()
            for o, t in pieces
        }

    def out_eq(a: str, b: str) -> bool:
        return all(torch.equal(x, y) for x, y in zip(outs[a], outs[b], strict=True))

    def out_close(a: str, b: str, atol: float) -> bool:
        return all(torch.allclose(x, y, atol=atol) for x, y in zip(outs[a], outs[b], strict=True))

    def w_eq(a: str, b: str) -> bool:
        wa, wb = weights[a], weights[b]
        return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    def w_close(a: str, b: str, atol: float = 1e-6) -> bool:
        wa, wb = weights[a], weights[b]
        return wa.keys() == wb.keys() and all(
            torch.allclose(wa[k], wb[k], rtol=1e-5, atol=atol) for k in wa
        )

    # Every block this rank receives is a subset of its step-0 outputs, so its relative bound is
    # at most 0.03 x the range of those outputs.
    exact0 = outs["torchrec"][0]
    eb0 = 0.03 * float(exact0.max() - exact0.min())
    return {
        # Exact output dedupe (the default): bit-identical outputs and trained weights.
        "bit_identical": {
            n: out_eq(n, "torchrec") and w_eq(n, "torchrec") for n in ("default", "exact", "none")
        },
        # Its backward is TorchRec's dense one: with a gradient cast, identical to no dedupe.
        "exact_fp16_eq": out_eq("exact_bwd_fp16", "none_bwd_fp16")
        and w_eq("exact_bwd_fp16", "none_bwd_fp16"),
        # Lookup dedupe: the forward is a gather, exact while the weights are the same (step
        # 0); later steps see weights trained with a different gradient summation order.
        "lookup_out_exact": {
            n: torch.equal(outs[n][0], exact0) and out_close(n, "torchrec", 1e-5)
            for n in ("lookup", "lookup_bwd_lossy", "exact_gdd")
        },
        "lookup_w_close": {
            n: w_close(n, "torchrec") for n in ("lookup", "lookup_bwd_lossy", "exact_gdd")
        },
        # Gradient dedupe with a cast: the per-bag sum is cast once (as the lookup dedupe's).
        "gdd_fp16_close": w_close("exact_gdd_fp16", "none_bwd_fp16", atol=2e-3),
        "gdd_fp16_differs": not w_eq("exact_gdd_fp16", "exact_bwd_fp16"),
        "bwd_rows": bwd_rows,
        "fp16_step0_exact": torch.equal(outs["lookup_bwd_fp16"][0], exact0),
        # fp16 gradients: the per-id sum is cast once instead of each term (fp16 rounding).
        "fp16_close": w_close("lookup_bwd_fp16", "none_bwd_fp16", atol=2e-3),
        # Bound > 0: the first step (same weights) is within the bound of the exact output.
        "lossy_step0_close": {
            n: bool((outs[n][0].double() - exact0.double()).abs().max() <= eb0 * (1 + 1e-6))
            for n in ("lossy_exact", "lossy_lookup", "lossy_none")
        },
        "lossy_close": {
            n: out_close(n, "lossy_none", 0.2) and w_close(n, "lossy_none", 0.2)
            for n in ("lossy_exact", "lossy_lookup")
        },
        "fwd_bytes": {n: fwd_bytes[n] for n in fwd_bytes if n != "torchrec"},
        "rows": rows["exact"],
        "expected_rows": [
            _expected_rows(tables, world_size, rank, step) for step in range(len(batches))
        ],
        "repeated": repeated["exact"],
    }


@pytest.mark.dist
@pytest.mark.slow  # both world sizes: many other tests cover the dedupe on 2 ranks
@pytest.mark.parametrize("world_size", [2, 3])
def test_output_dedupe_exact_by_default_lookup_variant_close(world_size: int) -> None:
    results = run_workers(_worker, world_size)
    for rank, r in enumerate(results):
        assert all(r["bit_identical"].values()), (rank, r["bit_identical"])
        assert r["exact_fp16_eq"], rank
        assert all(r["lookup_out_exact"].values()), (rank, r["lookup_out_exact"])
        assert all(r["lookup_w_close"].values()), (rank, r["lookup_w_close"])
        assert r["fp16_step0_exact"], rank
        assert r["fp16_close"], rank
        assert r["gdd_fp16_close"], rank
        assert all(r["lossy_step0_close"].values()), (rank, r["lossy_step0_close"])
        assert all(r["lossy_close"].values()), (rank, r["lossy_close"])
        b = r["fwd_bytes"]
        # Multi-hot features take the normal path (step 1); in step 3 the all-empty f3 is
        # deduplicated to one (empty) bag per source by the exact mode only.
        for n in ("exact", "lookup"):
            assert b[n][1] == b["none"][1], (rank, n, b)
        assert b["lookup"][3] == b["none"][3], (rank, b)
        if rank == 1:  # the owner of f3's table t3
            assert b["exact"][3][0] < b["none"][3][0], (rank, b)
        for dd, nodd in (
            ("exact", "none"),
            ("lookup", "none"),
            ("lossy_exact", "lossy_none"),
            ("lossy_lookup", "lossy_none"),
        ):
            # Skewed single-hot steps: fewer raw rows and fewer wire bytes.
            for step in (0, 2, 4):
                if b[nodd][step][0] == 0:
                    continue  # this rank owns no table (rank 2 of 3): it sends nothing
                if dd.endswith("lookup") and step == 4:
                    continue  # lookup dedupe needs every bag to hold one id
                assert b[dd][step][0] < b[nodd][step][0], (rank, dd, step, b)
                assert b[dd][step][1] < b[nodd][step][1], (rank, dd, step, b)
        # Rows actually sent per table == distinct bags per (source, feature).
        for step, (got, want) in enumerate(zip(r["rows"], r["expected_rows"], strict=True)):
            assert got == want, (rank, step, got, want)
        if r["expected_rows"][0]:  # rank 2 of 3 owns no table
            assert any(sent < full for got in r["rows"] for full, sent in got.values()), rank
        assert r["repeated"][0] > 0, rank
    assert any(r["gdd_fp16_differs"] for r in results)  # the owners' weights: summed, then cast
    # The gradient dedupe sends, per (source, owner, feature), one row per distinct bag: the
    # same rows as the forward over all ranks (the forward's counted by owners, the backward's
    # by sources).
    fwd_rows: dict[str, list[int]] = {}
    for r in results:
        for got in r["rows"]:
            for table, (full, sent) in got.items():
                acc = fwd_rows.setdefault(table, [0, 0])
                acc[0] += full
                acc[1] += sent
    bwd_rows: dict[str, list[int]] = {}
    for r in results:
        for table, (full, sent) in r["bwd_rows"].items():
            acc = bwd_rows.setdefault(table, [0, 0])
            acc[0] += full
            acc[1] += sent
    assert fwd_rows == bwd_rows, (fwd_rows, bwd_rows)
    assert any(sent < full for full, sent in bwd_rows.values()), bwd_rows


# ---------------------------------------------------------------------------------------------
# The gradient dedupe against TorchRec with fused optimizers, TW/CW/DP.

GDD_STEPS = 4
GDD_LR = 0.1


def _gdd_plan(world_size: int) -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, table_wise

    fused = "fused"  # the fused optimizers run inside fbgemm's lookup backward
    return {
        "t0": table_wise(rank=0, compute_kernel=fused),
        "t1": table_wise(rank=world_size - 1, compute_kernel=fused),
        "t2": column_wise(ranks=[0, 1], compute_kernel=fused),
        "t3": data_parallel(),
    }


def _gdd_worker(rank: int, world_size: int, optimizer: str) -> dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    opt_type = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
    fused = {"optimizer": opt_type[optimizer], "learning_rate": GDD_LR}
    tables = make_tables(SHARDER_TABLES)
    exact = ErrorBound("absolute", 0.0)
    variants = {
        "torchrec": EmbeddingBagCollectionSharder(fused_params=fused),
        # Exact forward and wire: only the gradient dedupe differs from TorchRec.
        "gdd": LossyEmbeddingBagCollectionSharder(
            fused_params=fused, comms_config=LossyCommsConfig(default_bound=exact, backward="none")
        ),
    }
    batches = [skewed_batch(tables, 24 + 4 * rank, seed=300 + 10 * s + rank) for s in range(4)]
    weights: dict[str, dict[str, torch.Tensor]] = {}
    outs: dict[str, list[torch.Tensor]] = {}
    sent = (0, 0)
    states: dict[str, Any] = {}
    for name, sharder in variants.items():
        ebc = make_ebc(tables, seed=0)
        plan = manual_plan(ebc, sharder, _gdd_plan(world_size), world_size)
        model = DistributedModelParallel(
            ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder]
        )
        load_full_weights(model.state_dict(), ebc.state_dict())
        dense = [p for n, p in model.named_parameters() if "t3" in n]  # DP: not fused
        opt = torch.optim.SGD(dense or [torch.zeros(1, requires_grad=True)], lr=GDD_LR)
        outs[name] = [train_step(model, opt, kjt, s, rank) for s, kjt in enumerate(batches)]
        states[name] = model.state_dict()
        weights[name] = {
            f"{k}@{o}": t.clone()
            for k, pieces in local_weights(model.state_dict()).items()
            for o, t in pieces
        }
        if name == "gdd":
            t = model.module.lossy_stats.total("bwd")
            sent = (t.rows, t.rows_sent)
    # Tolerance from fp32 summation order. dL/dout = 2 (out - y) / N; a row's gradient sums at
    # most `count` of them in another order: off by <= count * eps * count * gmax. SGD moves the
    # row by lr times that; rowwise Adagrad by lr * g / sqrt(G) (<= lr * sqrt(dim) per element),
    # relatively off by <= 2 count eps. Each step also rounds the weight (2 ulp), and later steps
    # see the slightly different weights (factor 2).
    eps = 2.0**-24
    gen_targets = []
    for s in range(len(batches)):
        g = torch.Generator().manual_seed(100 * s + rank)
        gen_targets.append(torch.rand(outs["torchrec"][s].shape, generator=g))
    gmax = max(
        float((2 * (o - y) / o.numel()).abs().max())
        for o, y in zip(outs["torchrec"], gen_targets, strict=True)
    )
    count = 32 * world_size  # every bag of every rank in one row, at most
    wmax = max(float(t.abs().max()) for t in weights["torchrec"].values() if t.numel())
    if optimizer == "sgd":
        per_step = GDD_LR * count * count * eps * gmax
    else:
        per_step = GDD_LR * 2 * count * eps * 4.0  # sqrt(dim) <= 4 for dim <= 16
    tol = 2 * len(batches) * (per_step + 2 * eps * wmax)
    diff = {
        k: float((weights["gdd"][k] - weights["torchrec"][k]).abs().max())
        for k in weights["torchrec"]
        if weights["torchrec"][k].numel()
    }
    init = compare_weights(states["torchrec"], make_ebc(tables, seed=0).state_dict())
    local = {k.split("@")[0] for k in diff}
    moved = min(v for k, v in init.items() if k in local and "t3" not in k)
    return {
        "keys_equal": weights["gdd"].keys() == weights["torchrec"].keys(),
        "diff": diff,
        "tol": tol,
        "out0_equal": torch.equal(outs["gdd"][0], outs["torchrec"][0]),
        "sent": sent,
        "moved": moved,
    }


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adagrad", marks=pytest.mark.slow)])
def test_gradient_dedupe_trains_like_torchrec(world_size: int, optimizer: str) -> None:
    results = run_workers(_gdd_worker, world_size, optimizer)
    for rank, r in enumerate(results):
        assert r["keys_equal"] and r["out0_equal"], rank
        assert max(r["diff"].values()) <= r["tol"], (rank, r["diff"], r["tol"])
        assert r["moved"] > 100 * r["tol"], (rank, r["moved"], r["tol"], r["diff"])  # meaningful
    # The gradient dedupe really sent fewer rows than TorchRec's dense gradient.
    assert sum(r["sent"][1] for r in results) < sum(r["sent"][0] for r in results), results
