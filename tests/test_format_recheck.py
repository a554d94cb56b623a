"""The periodic format re-check: hysteresis, patience, agreement over ranks, resume."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import run_workers
from torchrec_lossy.config import ConfigError
from torchrec_lossy.planner.recheck import FormatRecheck, RecheckConfig


def test_switches_only_past_the_hysteresis_on_consecutive_checks() -> None:
    rc = FormatRecheck("entropy", RecheckConfig(every_steps=10, hysteresis=0.2, patience=2))
    assert [rc.due(s) for s in (0, 5, 10, 20)] == [False, False, True, True]
    # 15% faster is inside the 20% hysteresis: never a switch.
    assert all(rc.check(s, 100.0, {"raw": 85.0, "entropy": 100.0}) is None for s in range(5))
    # Noise that alternates the best alternative never builds a streak: no flapping.
    for s in range(6):
        alt = {"raw": 70.0, "packed": 90.0} if s % 2 else {"raw": 90.0, "packed": 70.0}
        assert rc.check(s, 100.0, alt) is None
    # A check without a clear winner resets the streak; then the same alternative clearly
    # faster twice in a row: switch once, recorded.
    assert rc.check(9, 100.0, {"raw": 95.0}) is None
    assert rc.check(10, 100.0, {"raw": 70.0}) is None
    assert rc.check(20, 100.0, {"raw": 70.0}) == "raw"
    assert rc.current == "raw" and rc.switches == [(20, "entropy", "raw")]
    # The new current is not its own alternative.
    assert rc.check(30, 70.0, {"raw": 10.0, "entropy": 100.0}) is None


def test_resume_from_state_continues_the_same_decisions() -> None:
    config = RecheckConfig(every_steps=1, hysteresis=0.1, patience=3)
    inputs = [(100.0, {"raw": 80.0})] * 2 + [(100.0, {"raw": 80.0})] * 2
    straight = FormatRecheck("entropy", config)
    decisions = [straight.check(s, m, e) for s, (m, e) in enumerate(inputs)]
    first = FormatRecheck("entropy", config)
    got = [first.check(s, m, e) for s, (m, e) in enumerate(inputs[:2])]
    resumed = FormatRecheck("entropy", config)
    resumed.load_state_dict(first.state_dict())  # mid-streak checkpoint
    got += [resumed.check(s + 2, m, e) for s, (m, e) in enumerate(inputs[2:])]
    assert got == decisions == [None, None, "raw", None]
    assert resumed.state_dict() == straight.state_dict()


def test_bad_settings_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match=r"recheck.hysteresis=1.5 is invalid"):
        RecheckConfig(hysteresis=1.5)
    with pytest.raises(ConfigError, match=r"recheck.every_steps=0 is invalid"):
        RecheckConfig(every_steps=0)


def _worker(rank: int, world_size: int) -> Any:
    import torch.distributed as dist

    rc = FormatRecheck("entropy", RecheckConfig(every_steps=1, hysteresis=0.1, patience=1))
    # Rank 0 alone would switch (raw 30% faster than its step), rank 1 alone would not.
    measured = 100.0 if rank == 0 else 60.0
    return rc.check(1, measured, {"raw": 70.0}, dist.group.WORLD), rc.state_dict()


@pytest.mark.timeout(300)
def test_decided_collectively_so_every_rank_agrees() -> None:
    (d0, s0), (d1, s1) = run_workers(_worker, 2, timeout_s=240)
    assert d0 == d1 == "raw" and s0 == s1  # the slowest rank's step decides for both


def _worker_runtime(rank: int, world_size: int) -> dict[str, Any]:
    import dataclasses

    import torch.distributed as dist

    from tests.distributed.harness import (
        BOUNDED_TABLES,
        TrainRun,
        bounded_config,
        bounded_plan,
        make_batch,
        make_tables,
    )
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder
    from torchrec_lossy.planner.recheck import RuntimeRecheck

    config = dataclasses.replace(bounded_config(), error_sample_every=0)
    tables = make_tables(BOUNDED_TABLES)
    run = TrainRun(
        tables, LossyEmbeddingBagCollectionSharder(comms_config=config), bounded_plan(), world_size
    )
    stats = run.model.module.lossy_stats
    # Pinned estimates: raw sends 30 ms more wire a step than entropy, which codes for 10 ms.
    rt = RuntimeRecheck(
        run.model,
        {"raw": (40.0, 0.0), "entropy": (10.0, 10.0)},
        RecheckConfig(every_steps=1, hysteresis=0.15, patience=2),
        dist.group.WORLD,
    )
    decisions, ratios = [], []
    for step in range(1, 13):
        stats.reset()
        run.step(make_batch(tables, 32, seed=100 * step + rank), step)
        ratios.append(stats.total("fwd").ratio)  # raw bytes / wire bytes of the forward
        # Pinned step times (compute 90 ms + wire + codec, +-8% noise), the cost change: from
        # step 5 rank 1's codec takes 60 ms a step (the slowest rank's figures decide for both).
        codec = (60.0 if step >= 5 and rank == 1 else 10.0) if rt.current != "raw" else 0.0
        wire = 40.0 if rt.current == "raw" else 10.0
        noise = 1.0 + 0.08 * (-1) ** step
        decisions.append(rt.step(step, noise * (90.0 + wire + codec) / 1000, codec / 1000))
    return {"decisions": decisions, "ratios": ratios, "state": rt.state_dict()}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_runtime_recheck_switches_the_sharded_model_once_and_never_flaps() -> None:
    r0, r1 = run_workers(_worker_runtime, 2, timeout_s=500)
    assert r0["decisions"] == r1["decisions"]  # decided collectively: the same step everywhere
    switched = [(i + 1, d) for i, d in enumerate(r0["decisions"]) if d is not None]
    # Before step 5 raw's estimate (the step + 20 ms) never wins. From step 5 entropy's step is
    # ~160 ms and raw's estimate ~130: past the 15% hysteresis on the checks of steps 5 and 6
    # (patience 2): one switch at step 6. Then raw runs at ~130 ms and entropy's estimate keeps
    # the codec's measured 60 ms (~160): never back, whatever the noise.
    assert switched == [(6, "raw")], switched
    assert r0["state"]["switches"] == [[6, "entropy", "raw"]] and r0["state"] == r1["state"]
    for r in (r0, r1):
        assert all(x > 1.0 for x in r["ratios"][:6]), r["ratios"]  # coded until the switch...
        assert all(x <= 1.0 for x in r["ratios"][6:]), r["ratios"]  # ...then every block raw
