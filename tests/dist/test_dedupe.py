"""Cross-side (lookup) deduplication of single-hot features: ``InputDistConfig.dedupe_lookups``.

The owner looks up each distinct id once per source, the output dist sends each distinct pooled
vector once and the receiver expands it; the gradient is summed per distinct id before it goes
back. Forward exact, training equal within float rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _harness import (
    load_full_weights,
    local_weights,
    make_batch,
    make_ebc,
    make_tables,
    manual_plan,
    run_workers,
    train_step,
)
from test_input_dist import SHARDER_TABLES, _sharder_plan, _skewed_batch

from torchrec_lossy.config import ErrorBound, InputDistConfig, LossyCommsConfig
from torchrec_lossy.dist import LossyComms, StaticBounds
from torchrec_lossy.dist.input_dist import _encode


def _comms(**input_dist: Any) -> LossyComms:
    config = LossyCommsConfig(input_dist=InputDistConfig(**input_dist))
    return LossyComms(config=config, bounds=StaticBounds([], config))


def test_encode_marks_only_unweighted_single_hot_features_with_repeats() -> None:
    from torchrec import KeyedJaggedTensor

    # a: single-hot with repeats; b: multi-hot; c: single-hot, all distinct.
    lengths = torch.tensor([1, 1, 1, 1, 2, 0, 1, 1, 1, 1, 1, 1])
    values = torch.tensor([5, 5, 7, 5, 1, 1, 2, 3, 9, 8, 7, 6])
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths)
    enc = _encode(kjt, [2, 1], _comms(dedupe_lookups=True), dedupe_lookups=True)
    (u, inv), b = enc.lookup[0]
    assert b is None and enc.lookup[1] == [None]
    assert u == 2 and inv.tolist() == [0, 0, 1, 0]  # distinct ids sorted: 5, 7
    assert enc.num_ids_per_dest == [2 + 4, 4]
    # Weighted KJTs keep the normal path (a bag's pooled vector is then weight * row).
    wkjt = KeyedJaggedTensor(
        keys=["a", "b", "c"], values=values, lengths=lengths, weights=torch.rand(12)
    )
    enc = _encode(wkjt, [2, 1], _comms(dedupe_lookups=True), dedupe_lookups=True)
    assert all(x is None for row in enc.lookup for x in row)


def _mixed_batch(tables: list, batch: int, seed: int) -> Any:
    """Skewed single-hot features, except f1b and f3 multi-hot (from make_batch)."""
    from torchrec import KeyedJaggedTensor

    single = _skewed_batch(tables, batch, seed).to_dict()
    multi = make_batch(tables, batch, seed=seed + 1).to_dict()
    keys = [f for t in tables for f in t.feature_names]
    jts = [(multi if k in ("f1b", "f3") else single)[k] for k in keys]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat([j.values() for j in jts]),
        lengths=torch.cat([j.lengths() for j in jts]),
    )


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_lossy.dist import LossyEmbeddingBagCollectionSharder

    tables = make_tables(SHARDER_TABLES)
    exact, lossy = ErrorBound("absolute", 0.0), ErrorBound("relative", 0.03)

    def lossy_sharder(bound: ErrorBound, dd: bool, **kw: Any) -> Any:
        config = LossyCommsConfig(
            default_bound=bound, input_dist=InputDistConfig(dedupe_lookups=dd), **kw
        )
        return LossyEmbeddingBagCollectionSharder(comms_config=config)

    variants: dict[str, Any] = {
        "torchrec": EmbeddingBagCollectionSharder(),
        "nodd": lossy_sharder(exact, False),
        "dd": lossy_sharder(exact, True),
        "dd_bwd_lossy": lossy_sharder(exact, True, backward="lossy", backward_bound=exact),
        "dd_bwd_fp16": lossy_sharder(exact, True, backward="fp16"),
        "nodd_bwd_fp16": lossy_sharder(exact, False, backward="fp16"),
        "lossy_nodd": lossy_sharder(lossy, False),
        "lossy_dd": lossy_sharder(lossy, True),
    }
    batches = [
        _skewed_batch(tables, 32 + 8 * rank, seed=50 + rank),
        make_batch(tables, 6 + rank, seed=rank),  # multi-hot: normal path
        _mixed_batch(tables, 24, seed=70 + rank),
        make_batch(tables, 5, seed=90 + rank, empty_features=["f3"]),
    ]
    outs: dict[str, list[torch.Tensor]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    fwd_bytes: dict[str, list[tuple[int, int]]] = {}
    repeated: dict[str, list[int]] = {}
    for name, sharder in variants.items():
        ebc = make_ebc(tables, seed=0)
        plan = manual_plan(ebc, sharder, _sharder_plan(), world_size)
        model = DistributedModelParallel(
            ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder]
        )
        load_full_weights(model.state_dict(), ebc.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        outs[name], fwd_bytes[name], repeated[name] = [], [], []
        for step, kjt in enumerate(batches):
            stats = getattr(model.module, "lossy_stats", None)
            if stats is not None:
                stats.reset()
            outs[name].append(train_step(model, opt, kjt, step, rank))
            if stats is not None:
                t = stats.total("fwd")
                fwd_bytes[name].append((t.raw_bytes, t.wire_bytes))
                repeated[name].append(stats.total("input").repeated_ids)
        weights[name] = {
            f"{k}@{o}": t.clone()
            for k, pieces in local_weights(model.state_dict()).items()
            for o, t in pieces
        }

    def out_eq(a: str, b: str) -> bool:
        return all(torch.equal(x, y) for x, y in zip(outs[a], outs[b], strict=True))

    def out_close(a: str, b: str, atol: float) -> bool:
        return all(torch.allclose(x, y, atol=atol) for x, y in zip(outs[a], outs[b], strict=True))

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
        # The forward is a gather: exact while the weights are the same (step 0); later steps
        # see weights trained with a different gradient summation order.
        "out_exact": {
            n: torch.equal(outs[n][0], outs["torchrec"][0]) and out_close(n, "torchrec", 1e-5)
            for n in ("nodd", "dd", "dd_bwd_lossy")
        },
        "nodd_exact": out_eq("nodd", "torchrec"),
        "w_close": {n: w_close(n, "torchrec") for n in ("nodd", "dd", "dd_bwd_lossy")},
        "fp16_step0_exact": torch.equal(outs["dd_bwd_fp16"][0], outs["torchrec"][0]),
        # fp16 gradients: the per-id sum is cast once instead of each term (fp16 rounding).
        "fp16_close": w_close("dd_bwd_fp16", "nodd_bwd_fp16", atol=2e-3),
        # Bound > 0: the first step (same weights) is within the bound of the exact output.
        "lossy_step0_close": bool(
            (outs["lossy_dd"][0].double() - exact0.double()).abs().max() <= eb0 * (1 + 1e-6)
        ),
        "lossy_close": out_close("lossy_dd", "lossy_nodd", 0.2)
        and w_close("lossy_dd", "lossy_nodd", 0.2),
        "multi_hot_bytes_equal": fwd_bytes["dd"][1] == fwd_bytes["nodd"][1]
        and fwd_bytes["dd"][3] == fwd_bytes["nodd"][3],
        "fwd_bytes": {n: fwd_bytes[n] for n in ("dd", "nodd", "lossy_dd", "lossy_nodd")},
        "repeated": repeated["dd"],
    }


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_lookup_dedupe_matches_normal_path_and_cuts_output_bytes(world_size: int) -> None:
    results = run_workers(_worker, world_size)
    for rank, r in enumerate(results):
        assert all(r["out_exact"].values()) and r["nodd_exact"], (rank, r["out_exact"])
        assert all(r["w_close"].values()), (rank, r["w_close"])
        assert r["fp16_step0_exact"], rank
        assert r["fp16_close"], rank
        assert r["lossy_step0_close"], rank
        assert r["lossy_close"], rank
        assert r["multi_hot_bytes_equal"], (rank, r["fwd_bytes"])
        b = r["fwd_bytes"]
        for dd, nodd in (("dd", "nodd"), ("lossy_dd", "lossy_nodd")):
            # Skewed single-hot step and mixed step: fewer raw rows and fewer wire bytes.
            for step in (0, 2):
                if b[nodd][step][0] == 0:
                    continue  # this rank owns no table (rank 2 of 3): it sends nothing
                assert b[dd][step][0] < b[nodd][step][0], (rank, dd, b)
                assert b[dd][step][1] < b[nodd][step][1], (rank, dd, b)
        assert r["repeated"][0] > 0, rank
