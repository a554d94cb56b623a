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
