"""The guard (issue 32, opt-in ``comms.guard``): it tightens a table's bound in one direction
when the error sample finds that table's error past the level, decided by all ranks together.

At every training step (:meth:`BoundGuard.step`, from ``step_lossy_bounds``) the guard takes
the (direction, table) pairs the error sample alerted past the level
(``LossyCommsStats.take_past_level``), keeping those encoded at the pair's current bound (an
alert's ``level``: a device-path sample is read a call late, and one from an encode before a
tightening is no evidence against the new bound). Every ``check_every`` steps the ranks start
an all-reduce of which pairs any of them saw since the last check; it completes behind the
next step, and at the end of that step every rank applies its counts: each counted pair takes
one tightening, the same on every rank at the same step boundary, so ranks never encode with
different bounds. Its ``k``-th tightening multiplies the
bound's value by ``factor ** k`` (same mode: never looser than the bound the user or the bound
provider set); the ``max_tightenings``-th makes it exact. The state (steps, tightenings, the
events, the pairs seen since the last check) is plain data, saved and restored with a
checkpoint (``guard_state``).

:func:`guarded_bound` is the one place the encoders ask for a bound through the guard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchrec_lossy.config import ErrorBound, GuardConfig
from torchrec_lossy.distributed.stats import Direction, LossyCommsStats
from torchrec_lossy.profile_range import profile_range

logger: logging.Logger = logging.getLogger(__name__)

# The directions the guard can tighten, in the order of the all-reduced flags.
GUARDED: tuple[Direction, ...] = ("fwd", "bwd")


@dataclass(frozen=True)
class Tightening:
    """One tightening the guard applied (identical on every rank).

    Attributes:
        step: The guard's step count at the decision (training steps since the run began).
        direction: ``"fwd"`` or ``"bwd"``.
        table: Table name.
        level: Tightenings of the pair so far, this one included.
        factor: What the pair's bound value is multiplied by from now on (0: exact).
        ranks: How many ranks saw the pair past the level since the last check.
    """

    step: int
    direction: Direction
    table: str
    level: int
    factor: float
    ranks: int


class BoundGuard:
    """The guard's state for one sharded module: the tightening of each (direction, table).

    Args:
        table_names: The module's tables (the same on every rank; the flags' order).
        config: The guard's config.
    """

    def __init__(self, table_names: Sequence[str], config: GuardConfig) -> None:
        self.config = config
        self.tables = sorted(set(table_names))
        self.steps = 0
        self.levels: dict[tuple[Direction, str], int] = {}
        self.events: list[Tightening] = []
        # The pairs this rank saw past the level at their current bound since the last check.
        self.seen: set[tuple[Direction, str]] = set()
        self.seconds = 0.0  # host time in step() (its all-reduces): the overhead
        # The check's all-reduce in flight (its work, None once waited, and its tensor),
        # applied at the next step.
        self._pending: tuple[dist.Work | None, torch.Tensor] | None = None

    def tightens(self, direction: Direction) -> bool:
        """Whether any table of ``direction`` is tightened (the encoders' fast path: no).

        Args:
            direction: ``"fwd"`` or ``"bwd"``.

        Returns:
            True once the guard tightened a table of that direction.
        """
        return any(d == direction for d, _ in self.levels)

    def factor(self, direction: Direction, table: str) -> float:
        """What a pair's bound value is multiplied by now: 1 untightened, 0 exact.

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            table: Table name.

        Returns:
            The factor.
        """
        k = self.level(direction, table)
        return 0.0 if k >= self.config.max_tightenings else self.config.factor**k

    def bound(self, direction: Direction, table: str, base: ErrorBound) -> ErrorBound:
        """The bound a pair is encoded with: ``base`` scaled by its factor (same mode).

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            table: Table name.
            base: The bound set for it now (config or bound provider).

        Returns:
            ``base`` itself when untightened, else the tighter bound.
        """
        if (direction, table) not in self.levels:
            return base
        return ErrorBound(base.mode, base.value * self.factor(direction, table))

    def step(self, stats: LossyCommsStats, group: dist.ProcessGroup | None) -> list[Tightening]:
        """Counts one training step: takes the step's alerts, applies the previous step's
        check, if any, and every ``check_every``-th step starts a check (collective: every
        rank of ``group`` calls it at the same step).

        Args:
            stats: The module's telemetry (its past-level alerts are taken).
            group: The module's process group; None: the default group, or none initialised
                (a single process decides alone).

        Returns:
            The tightenings applied now (at the step after a check; else empty).
        """
        start = time.perf_counter()
        self.steps += 1
        self.take_alerts(stats)
        decided: list[Tightening] = []
        if self._pending is not None:
            decided = self._apply(self._counts())
            # Their alerts so far came from encodes at the old bound: not evidence against
            # the new one.
            self.seen -= {(e.direction, e.table) for e in decided}
        if self.steps % self.config.check_every == 0:
            flags = [int((d, t) in self.seen) for d in GUARDED for t in self.tables]
            self.seen = set()
            self._pending = _start_all_reduce(flags, group)
        self.seconds += time.perf_counter() - start
        return decided

    def take_alerts(self, stats: LossyCommsStats) -> None:
        """Takes the past-level alerts recorded so far into :attr:`seen`, those encoded at
        their pair's current bound (:meth:`step` does at every step; ``guard_state`` before a
        checkpoint, so that they are saved).

        Args:
            stats: The module's telemetry.
        """
        self.seen.update(
            (d, t) for d, t, level in stats.take_past_level() if level >= self.level(d, t)
        )

    def level(self, direction: Direction, table: str) -> int:
        """A pair's tightenings so far (an alert's ``level`` to act on).

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            table: Table name.

        Returns:
            0 untightened.
        """
        return self.levels.get((direction, table), 0)

    def _counts(self) -> list[int]:
        """The pending check's counts (waits for its all-reduce; the check is then done)."""
        assert self._pending is not None
        work, t = self._pending
        if work is not None:
            with profile_range("## lossy guard all_reduce wait ##"):
                work.wait()
        self._pending = None
        return t.tolist()

    def _apply(self, counts: Sequence[int]) -> list[Tightening]:
        """Tightens once each pair that a rank saw past the level (the same on every rank)."""
        decided = []
        for i, n in enumerate(counts):
            direction, table = GUARDED[i // len(self.tables)], self.tables[i % len(self.tables)]
            k = self.level(direction, table)
            if n == 0 or k >= self.config.max_tightenings:
                continue
            self.levels[(direction, table)] = k + 1
            event = Tightening(
                self.steps, direction, table, k + 1, self.factor(direction, table), n
            )
            decided.append(event)
            logger.warning(
                "comms.guard: step %d: %s bound of table %s x%g (%s; %d rank(s) saw its "
                "sampled error past the level)",
                event.step,
                direction,
                table,
                event.factor,
                "exact from now" if event.factor == 0 else f"tightening {event.level}",
                n,
            )
        self.events += decided
        return decided

    def state_dict(self) -> dict[str, Any]:
        """The guard's state as plain data (``torch.load(weights_only=True)`` reads it back).

        Returns:
            Steps, each tightened pair's count, the events, the counts of a check not yet
            applied (the next step applies them; None if none) and the pairs this rank saw
            since the last check (the one part that differs between ranks).
        """
        pending = None
        if self._pending is not None:  # a check in flight: saved to be applied on resume
            pending = self._counts()
            self._pending = (None, torch.tensor(pending, dtype=torch.int32))
        return {
            "steps": self.steps,
            "levels": [[d, t, k] for (d, t), k in sorted(self.levels.items())],
            "events": [asdict(e) for e in self.events],
            "pending": pending,
            "seen": [[d, t] for d, t in sorted(self.seen)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved (a resumed run encodes with its tightenings).

        Args:
            state: The saved state.
        """
        self.steps = int(state["steps"])
        self.levels = {(d, t): int(k) for d, t, k in state["levels"]}
        self.events = [Tightening(**e) for e in state["events"]]
        pending = state.get("pending")
        self._pending = None if pending is None else (None, torch.tensor(pending))
        self.seen = {(d, t) for d, t in state.get("seen", [])}


def guarded_bound(
    guard: BoundGuard | None, direction: Direction, table: str, base: ErrorBound
) -> ErrorBound:
    """The bound a table's blocks of one direction are encoded with: ``base`` unless the
    guard tightened the pair (the hook the encoders call where they read a bound).

    Args:
        guard: The module's guard; None when ``comms.guard`` is off.
        direction: ``"fwd"`` or ``"bwd"``.
        table: Table name.
        base: The bound set for it now.

    Returns:
        The effective bound.
    """
    return base if guard is None else guard.bound(direction, table, base)


def _start_all_reduce(
    flags: list[int], group: dist.ProcessGroup | None
) -> tuple[dist.Work | None, torch.Tensor]:
    """Starts summing the ranks' flags (one small asynchronous all-reduce, waited for at the
    next step so that no rank waits for the slower one here); alone without a process group.

    Returns:
        The collective's work (None alone) and the tensor that will hold the sums.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None, torch.tensor(flags, dtype=torch.int32)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(flags, dtype=torch.int32, device=device)
    with profile_range("## lossy guard all_reduce ##"):
        work = dist.all_reduce(t, group=group, async_op=True)
    return work, t
