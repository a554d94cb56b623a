"""``comms.guard`` on 2 gloo ranks: an adversarial table (gradient rows spanning six decades
under a user-set absolute backward bound) trips it; the ranks tighten that table's backward
bound alike, one halving per check up to exact, while the other table keeps its bound; the
gradients then meet the tightened bound; the state restores into a new model; and a guard
that never trips sends today's bytes exactly. On the device path (the codec's ``"reference"``
backend) the same tightenings come a step later, the sample being read with the next
all-to-all."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import TrainRun, make_batch, make_tables, run_workers

pytestmark = pytest.mark.dist

TABLES = [("t_bad", 40, 8, ["f_bad"]), ("t_good", 40, 8, ["f_good"])]
BOUND = 1e-3  # the user's absolute backward bound
STEPS = 8


def _plan() -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import table_wise

    # t_bad lives on rank 1: only rank 0 encodes (and samples) its gradient, so rank 1 learns
    # of the alert through the guard's all-reduce alone.
    return {"t_bad": table_wise(rank=1), "t_good": table_wise(rank=0)}


def _config(guard: bool, backend: str = "auto") -> Any:
    from torchrec_lossy.config import CodecConfig, ErrorBound, GuardConfig, LossyCommsConfig

    return LossyCommsConfig(
        # Packed codes: a small coded block stays smaller than raw at every tightening (the
        # codec sends a block raw, exact, where that is smaller).
        codec=CodecConfig(format="packed", backend=backend),
        backward_bound=ErrorBound("absolute", BOUND),
        error_sample_every=1,
        guard=GuardConfig(enabled=guard, factor=0.5, max_tightenings=3, check_every=2),
    )


def _step(run: TrainRun, kjt: Any, seed: int, adversarial: bool) -> None:
    """One step whose output gradient is a fixed draw: each row of t_bad's columns at a scale
    from 0.03 down to 3e-8 when ``adversarial``, every other row at scale 0.03."""
    from torchrec_lossy.distributed import step_lossy_bounds

    per_key = run.model(kjt).wait().to_dict()
    g = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for key in kjt.keys():  # noqa: SIM118 (a KJT)
        v = per_key[key]
        w = 0.03 * torch.randn(v.shape, generator=g)
        if adversarial and key == "f_bad":
            w = w * 10 ** (-6 * torch.rand(v.shape[0], 1, generator=g))
        loss = loss + (v * w).sum()
    run.opt.zero_grad()
    loss.backward()
    run.opt.step()
    step_lossy_bounds(run.model)


def _events(run: TrainRun) -> list[tuple]:
    guard = run.model.module.lossy_comms.guard
    return [(e.step, e.direction, e.table, e.level, e.factor, e.ranks) for e in guard.events]


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torchrec_lossy.distributed import (
        LossyEmbeddingBagCollectionSharder,
        guard_state,
        load_guard_state,
    )

    tables = make_tables(TABLES)
    batches = [make_batch(tables, 64, seed=100 * s + rank) for s in range(STEPS + 1)]

    def new_run(guard: bool) -> TrainRun:
        sharder = LossyEmbeddingBagCollectionSharder(comms_config=_config(guard))
        return TrainRun(tables, sharder, _plan(), world_size)

    out: dict[str, Any] = {}
    # The adversarial run: per step, the largest error of the gradients this rank encodes
    # (rank 0: t_bad's, for its owner rank 1; rank 1: t_good's, for rank 0).
    run = new_run(guard=True)
    stats = run.model.module.lossy_stats
    bad, good, energy = [], [], []
    for s in range(STEPS):
        stats.reset()
        _step(run, batches[s], 1000 * s + rank, adversarial=True)
        bad.append(stats.table("t_bad", "bwd").max_error)
        good.append(stats.table("t_good", "bwd").max_error)
        energy.append(stats.table("t_bad", "bwd").row_relative_energy)
    out.update(bad=bad, good=good, energy=energy, events=_events(run))
    # Its state into a new model (a resumed run): the same tightenings, exact from the start.
    saved = guard_state(run.model)
    resumed = new_run(guard=True)
    load_guard_state(resumed.model, saved)
    rstats = resumed.model.module.lossy_stats
    _step(resumed, batches[STEPS], 7, adversarial=True)
    out.update(
        resumed_events=_events(resumed),
        resumed_steps=resumed.model.module.lossy_comms.guard.steps,
        resumed_bad=rstats.table("t_bad", "bwd").max_error,
        resumed_good=rstats.table("t_good", "bwd").max_error,
    )
    # A guard that never trips (homogeneous gradients) sends the bytes of a run without one.
    wire: dict[bool, dict[str, int]] = {}
    for guard in (False, True):
        r = new_run(guard)
        for s in range(4):
            _step(r, batches[s], 1000 * s + rank, adversarial=False)
        st = r.model.module.lossy_stats
        wire[guard] = {
            f"{d}/{t}": e.wire_bytes for d in ("fwd", "bwd") for t, e in st.tables(d).items()
        }
        if guard:
            out["quiet_events"] = _events(r)
    out["wire"] = wire
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_guard_tightens_the_adversarial_table_alike_on_both_ranks() -> None:
    r0, r1 = run_workers(_worker, 2, timeout_s=600)
    # Checks at steps 2, 4, 6, each applied at the step after it (its all-reduce runs behind
    # that step).
    expected = [
        (3, "bwd", "t_bad", 1, 0.5, 1),
        (5, "bwd", "t_bad", 2, 0.25, 1),
        (7, "bwd", "t_bad", 3, 0.0, 1),  # the 3rd tightening: exact
    ]
    # Decided together: rank 1 never sampled t_bad's gradient, yet tightened it alike.
    assert r0["events"] == r1["events"] == expected
    # Rank 0 encodes t_bad's gradient: within the bound in force at each step, and past the
    # next one before it (the tightening changed the encoding).
    limits = [BOUND, BOUND, BOUND, BOUND / 2, BOUND / 2, BOUND / 4, BOUND / 4, 0.0]
    for s, (err, limit) in enumerate(zip(r0["bad"], limits, strict=True)):
        assert err <= limit, (s, err, limit)
        if limit:
            assert err > limit / 2, (s, err, limit)
    assert r0["energy"][0] > 4e-3 and r0["energy"][-1] == 0.0  # past the level, then exact
    # t_good keeps the user's bound: never tightened, its error still spends it.
    assert all(BOUND / 2 < e <= BOUND for e in r1["good"]), r1["good"]
    for r in (r0, r1):
        assert r["resumed_events"] == expected and r["resumed_steps"] == STEPS + 1
    assert r0["resumed_bad"] == 0.0 and BOUND / 2 < r1["resumed_good"] <= BOUND
    # Never tripped: no tightening, and every table's bytes equal those without a guard.
    for r in (r0, r1):
        assert r["quiet_events"] == []
        assert r["wire"][True] == r["wire"][False], r["wire"]
        assert r["wire"][True]["bwd/t_bad"] > 0 or r["wire"][True]["bwd/t_good"] > 0


def _worker_device(rank: int, world_size: int) -> dict[str, Any]:
    """The adversarial run on the device path (the codec's ``"reference"`` backend: the device
    orchestration over torch twins), then its state into a new model."""
    from torchrec_lossy.distributed import (
        LossyEmbeddingBagCollectionSharder,
        check_lossy_decodes,
        guard_state,
        load_guard_state,
    )

    tables = make_tables(TABLES)
    batches = [make_batch(tables, 64, seed=100 * s + rank) for s in range(STEPS + 1)]

    def new_run() -> TrainRun:
        sharder = LossyEmbeddingBagCollectionSharder(comms_config=_config(True, "reference"))
        return TrainRun(tables, sharder, _plan(), world_size)

    run = new_run()
    stats = run.model.module.lossy_stats
    bad = []
    for s in range(STEPS):
        stats.reset()
        _step(run, batches[s], 1000 * s + rank, adversarial=True)
        bad.append(stats.table("t_bad", "bwd").max_error)
    check_lossy_decodes(run.model)  # as the example does before a checkpoint
    saved = guard_state(run.model)
    resumed = new_run()
    load_guard_state(resumed.model, saved)
    _step(resumed, batches[STEPS], 7, adversarial=True)
    # Saved after step 4 and resumed in a new model: the same decisions as the run above (the
    # gradients are fixed draws, whatever the weights).
    first = new_run()
    for s in range(4):
        _step(first, batches[s], 1000 * s + rank, adversarial=True)
    check_lossy_decodes(first.model)
    mid = new_run()
    load_guard_state(mid.model, guard_state(first.model))
    mid_bad = []
    for s in range(4, STEPS):
        mid.model.module.lossy_stats.reset()
        _step(mid, batches[s], 1000 * s + rank, adversarial=True)
        mid_bad.append(mid.model.module.lossy_stats.table("t_bad", "bwd").max_error)
    return {
        "bad": bad,
        "events": _events(run),
        "seen": saved[next(iter(saved))]["seen"],
        "resumed_events": _events(resumed),
        "resumed_bad": resumed.model.module.lossy_stats.table("t_bad", "bwd").max_error,
        "mid_events": _events(mid),
        "mid_bad": mid_bad,
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_guard_on_the_device_path_tightens_alike_a_step_later() -> None:
    """The device path's sample is read with the next all-to-all's size exchange: a step's
    backward alert is checked at the end of the next step, and the first sample at a new bound
    comes a step after the tightening (tests/distributed/test_device_error_sample.py)."""
    r0, r1 = run_workers(_worker_device, 2, timeout_s=600)
    expected = [(3, "bwd", "t_bad", 1, 0.5, 1), (7, "bwd", "t_bad", 2, 0.25, 1)]
    assert r0["events"] == r1["events"] == expected
    limits = [BOUND] * 3 + [BOUND / 2] * 4 + [BOUND / 4]
    for s, (err, limit) in enumerate(zip(r0["bad"], limits, strict=True)):
        assert limit / 2 < err <= limit, (s, err, limit)
    # Step 8's alert (at the bound in force) was read before the save and is in rank 0's
    # state; rank 1 never sampled t_bad.
    assert r0["seen"] == [["bwd", "t_bad"]] and r1["seen"] == []
    for r in (r0, r1):
        assert r["resumed_events"] == expected
        assert r["mid_events"] == expected  # resumed after step 4: the run's decisions
    assert BOUND / 8 < r0["resumed_bad"] <= BOUND / 4
    assert r0["mid_bad"] == r0["bad"][4:]
