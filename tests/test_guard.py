"""The guard's rule, config and state on one process (its 2-rank run:
tests/distributed/test_guard_dist.py): a pair alerted past the level tightens by ``factor`` per
check up to exact, never loosens, NaN alone does not tighten, and the state survives a
checkpoint's ``torch.load(weights_only=True)``."""

from __future__ import annotations

import io

import pytest
import torch

from torchrec_lossy.config import (
    ConfigError,
    ErrorBound,
    GuardConfig,
    LossyCommsConfig,
    LossyPlanConfig,
    from_dict,
)
from torchrec_lossy.distributed.guard import BoundGuard, Tightening, guarded_bound
from torchrec_lossy.distributed.stats import ErrorAlert, LossyCommsStats

TABLES = ["t_bad", "t_good", "t_nan"]


def _alert(
    stats: LossyCommsStats, table: str, past: bool = True, nonfinite: int = 0, level: int = 0
) -> None:
    """An alert as the error sample records it (``level``: the guard's tightenings of the
    pair when the block was encoded)."""
    alert = ErrorAlert("bwd", table, 0, 1.0 if past else 0.0, nonfinite, past, level)
    stats.record_error_samples("bwd", [], [alert])


def test_rule_tightens_per_check_up_to_exact_and_never_loosens() -> None:
    guard = BoundGuard(
        TABLES, GuardConfig(enabled=True, factor=0.5, max_tightenings=3, check_every=2)
    )
    stats = LossyCommsStats()
    base = ErrorBound("absolute", 1e-3)
    seen = []
    for _ in range(10):
        _alert(stats, "t_bad", level=guard.level("bwd", "t_bad"))  # past the level every step
        _alert(stats, "t_nan", past=False, nonfinite=3)  # NaN only: reported, not acted on
        guard.step(stats, None)
        seen.append(guarded_bound(guard, "bwd", "t_bad", base).value)
    # One tightening per check (every 2nd step, applied at the step after it: its
    # all-reduce runs behind that step), exact at the 3rd, never loosened.
    assert seen == [1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4, 0.0, 0.0, 0.0, 0.0]
    assert [(e.step, e.direction, e.table, e.level, e.factor, e.ranks) for e in guard.events] == [
        (3, "bwd", "t_bad", 1, 0.5, 1),
        (5, "bwd", "t_bad", 2, 0.25, 1),
        (7, "bwd", "t_bad", 3, 0.0, 1),
    ]
    for table in ("t_good", "t_nan"):
        assert guarded_bound(guard, "bwd", table, base) is base
    assert guarded_bound(guard, "fwd", "t_bad", base) is base  # the other direction untouched
    assert guard.tightens("bwd") and not guard.tightens("fwd")  # the encoders' fast path
    # The same mode, the value scaled: a per-value bound keeps its mode, 0 stays 0.
    assert guard.bound("bwd", "t_bad", ErrorBound("value", 1 / 32)) == ErrorBound("value", 0.0)
    assert guarded_bound(None, "bwd", "t_bad", base) is base


def test_alerts_from_an_encode_before_a_tightening_are_no_evidence() -> None:
    """A device-path sample is read a call late: an alert that arrives after its pair was
    tightened, from an encode at the old bound, does not tighten it again."""
    guard = BoundGuard(TABLES, GuardConfig(enabled=True, factor=0.5, check_every=1))
    stats = LossyCommsStats()
    _alert(stats, "t_bad", level=0)
    guard.step(stats, None)  # the check
    guard.step(stats, None)  # applied: level 1
    assert guard.level("bwd", "t_bad") == 1
    _alert(stats, "t_bad", level=0)  # late: encoded before the tightening
    for _ in range(3):
        guard.step(stats, None)
    assert [e.level for e in guard.events] == [1]
    _alert(stats, "t_bad", level=1)  # at the current bound: acted on
    guard.step(stats, None)
    guard.step(stats, None)
    assert [(e.step, e.level) for e in guard.events] == [(2, 1), (7, 2)]


def test_alerts_survive_a_stats_reset_until_the_guard_takes_them() -> None:
    guard = BoundGuard(TABLES, GuardConfig(enabled=True, check_every=4))
    stats = LossyCommsStats()
    _alert(stats, "t_good")
    stats.reset()  # the example's meter resets the counters at every sample
    for _ in range(5):  # the check at step 4, applied at step 5
        guard.step(stats, None)
    assert [e.table for e in guard.events] == ["t_good"]
    assert stats.take_past_level() == set()


def test_alerts_seen_between_checks_are_saved_with_the_state() -> None:
    """An alert taken before a checkpoint but not checked yet is part of the state, so a
    resumed run checks what the run would have checked (``guard_state`` takes them first)."""
    config = GuardConfig(enabled=True, check_every=4)
    guard, stats = BoundGuard(TABLES, config), LossyCommsStats()
    guard.step(stats, None)
    _alert(stats, "t_good")
    guard.take_alerts(stats)  # what guard_state does before saving
    restored = BoundGuard(TABLES, config)
    restored.load_state_dict(guard.state_dict())
    for g in (guard, restored):
        for _ in range(4):  # the check at step 4, applied at step 5
            g.step(LossyCommsStats(), None)
    assert [(e.step, e.table) for e in restored.events] == [(5, "t_good")]
    assert restored.events == guard.events


def test_state_round_trips_through_a_weights_only_checkpoint() -> None:
    config = GuardConfig(enabled=True, check_every=1)
    guard = BoundGuard(TABLES, config)
    stats = LossyCommsStats()
    for table in ("t_bad", "t_good"):  # t_bad tightened at step 2; t_good's check in flight
        _alert(stats, table)
        guard.step(stats, None)
    buf = io.BytesIO()
    torch.save({"guard": guard.state_dict()}, buf)
    buf.seek(0)
    restored = BoundGuard(TABLES, config)
    restored.load_state_dict(torch.load(buf, weights_only=True)["guard"])
    assert restored.steps == guard.steps == 2
    assert restored.levels == guard.levels == {("bwd", "t_bad"): 1}
    base = ErrorBound("relative", 0.01)
    assert restored.bound("bwd", "t_bad", base) == ErrorBound("relative", 0.005)
    # The check in flight at the save is applied at the next step, resumed or not.
    for g in (guard, restored):
        g.step(LossyCommsStats(), None)
    assert restored.events == guard.events
    assert [(e.step, e.table) for e in restored.events] == [(2, "t_bad"), (3, "t_good")]
    assert all(isinstance(e, Tightening) for e in restored.events)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"factor": 1.0}, "guard.factor=1.0 is invalid: allowed a number in (0, 1)"),
        ({"factor": 0}, "guard.factor=0 is invalid"),
        ({"max_tightenings": 0}, "guard.max_tightenings=0 is invalid: allowed an integer in [1,"),
        ({"check_every": 2.5}, "guard.check_every=2.5 is invalid"),
        ({"enabled": "yes"}, "guard.enabled='yes' is invalid: allowed true or false"),
    ],
)
def test_config_errors_name_the_value_and_the_fix(kwargs: dict, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        GuardConfig(**kwargs)
    assert named in str(e.value)


def test_yaml_key_and_the_guard_needs_the_error_sample() -> None:
    plan = from_dict(LossyPlanConfig, {"comms": {"guard": {"enabled": True, "factor": 0.25}}})
    assert plan.comms.guard == GuardConfig(enabled=True, factor=0.25)
    assert LossyCommsConfig().guard.enabled is False  # opt-in
    with pytest.raises(ConfigError) as e:
        LossyCommsConfig(guard=GuardConfig(enabled=True), error_sample_every=0)
    msg = str(e.value)
    assert "error_sample_every=0 is invalid" in msg and "guard.enabled: false" in msg
    with pytest.raises(ConfigError, match=r"comms.guard: guard.factor=2"):
        from_dict(LossyPlanConfig, {"comms": {"guard": {"factor": 2}}})
