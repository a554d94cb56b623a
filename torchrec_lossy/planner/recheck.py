"""The periodic re-check of the run's format choice from measured step times, with hysteresis.

:class:`FormatRecheck` holds the run's choice (a format name: ``"raw"``, ``"entropy"``,
``"packed"``, ``"torchrec"``) and, every ``every_steps`` steps, compares the measured ms a step of
that choice with the planner's estimate for each alternative. It switches only when one
alternative is estimated faster by more than ``hysteresis`` on ``patience`` consecutive checks
(no flapping on noise). The inputs are agreed over ranks first (the MAX of each figure), so
every rank takes the same decision; :meth:`FormatRecheck.state_dict` records the choice, the
streak and the switches, so a resume from a checkpoint continues from the same state.
:class:`RuntimeRecheck` runs it in a training loop: it keeps the steps' measured times (and the
codec's share of them), at each check estimates the alternative from them and the planner's wire
and codec estimates (:meth:`~torchrec_lossy.planner.lossy_model.LossyCommsModel.step_ms`), and
applies a switch to every lossy-sharded module of the model between steps (a new
``LossyComms.wire`` record: every pooled block raw, or the run's codec format), on every rank at
the same step. It switches between the codec and raw inside the seam; a run that took TorchRec's
own all-to-all (``auto``'s TorchRec path: the model was sharded by TorchRec's sharder) has no
seam to switch back to, so that choice is made once, at start-up, from interleaved measurements
of both paths (:mod:`~torchrec_lossy.planner.seam_cost`).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchrec_lossy.config import ConfigError

if TYPE_CHECKING:
    from torchrec_lossy.planner.lossy_model import LossyCommsModel

__all__ = ["FormatRecheck", "RecheckConfig", "RuntimeRecheck", "codec_remeasure"]

logger: logging.Logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecheckConfig:
    """How often and how reluctantly the choice is re-checked.

    Attributes:
        every_steps: Steps between checks (> 0).
        hysteresis: An alternative must be estimated faster than the measured step by this
            fraction (in [0, 1)).
        patience: Consecutive checks that must agree on the same alternative (>= 1).
    """

    every_steps: int = 500
    hysteresis: float = 0.15
    patience: int = 2

    def __post_init__(self) -> None:
        if not (isinstance(self.every_steps, int) and self.every_steps > 0):
            raise ConfigError(f"recheck.every_steps={self.every_steps!r} is invalid: allowed > 0")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ConfigError(f"recheck.hysteresis={self.hysteresis!r} is invalid: allowed [0, 1)")
        if not (isinstance(self.patience, int) and self.patience >= 1):
            raise ConfigError(f"recheck.patience={self.patience!r} is invalid: allowed >= 1")


class FormatRecheck:
    """The run's format choice, re-checked from measured times (see the module docstring).

    Args:
        current: The format chosen at start-up.
        config: Period, hysteresis and patience.
    """

    def __init__(self, current: str, config: RecheckConfig | None = None) -> None:
        self.config = config or RecheckConfig()
        self.current = current
        self._candidate: str | None = None
        self._streak = 0
        self.switches: list[tuple[int, str, str]] = []  # (step, from, to)

    def due(self, step: int) -> bool:
        """Whether ``step`` is a check step.

        Args:
            step: Steps done.

        Returns:
            True every ``every_steps`` steps.
        """
        return step > 0 and step % self.config.every_steps == 0

    def check(
        self,
        step: int,
        measured_ms: float,
        estimates_ms: Mapping[str, float],
        group: dist.ProcessGroup | None = None,
    ) -> str | None:
        """One check: agree the figures over ranks, then switch if an alternative has been
        clearly faster on ``patience`` checks in a row.

        Args:
            step: Steps done (for the record).
            measured_ms: This rank's measured median step time under the current choice.
            estimates_ms: Estimated step time per alternative (the same names on every rank).
            group: The process group (None or one rank: no agreement needed).

        Returns:
            The new format if the choice switched, else None.
        """
        names = sorted(n for n in estimates_ms if n != self.current)
        values = [measured_ms] + [estimates_ms[n] for n in names]
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's view
            values = t.tolist()
        measured, alternatives = values[0], dict(zip(names, values[1:], strict=True))
        best = min(alternatives, key=lambda n: (alternatives[n], n), default=None)
        limit = (1.0 - self.config.hysteresis) * measured
        if best is None or not math.isfinite(measured) or not alternatives[best] < limit:
            self._candidate, self._streak = None, 0
            return None
        self._streak = self._streak + 1 if best == self._candidate else 1
        self._candidate = best
        if self._streak < self.config.patience:
            return None
        logger.warning(
            "torchrec-lossy: format re-check at step %d: %s -> %s (measured %.1f ms a step, "
            "estimated %.1f)",
            step,
            self.current,
            best,
            measured,
            alternatives[best],
        )
        self.switches.append((step, self.current, best))
        self.current, self._candidate, self._streak = best, None, 0
        return best

    def state_dict(self) -> dict[str, Any]:
        """The choice, the pending streak and the switches so far.

        Returns:
            A plain dict (checkpointable).
        """
        return {
            "current": self.current,
            "candidate": self._candidate,
            "streak": self._streak,
            "switches": [list(s) for s in self.switches],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output.

        Args:
            state: The saved state.
        """
        self.current = str(state["current"])
        self._candidate = state["candidate"]
        self._streak = int(state["streak"])
        self.switches = [(int(s[0]), str(s[1]), str(s[2])) for s in state["switches"]]


class RuntimeRecheck:
    """The format re-check of a running model: measured step times in, switches applied.

    The alternatives are the run's codec format and raw (every pooled block raw). The run may
    start either way: coded (some table resolved to the codec; back to coded is the config's
    flags) or raw (``auto`` sent every table raw through the seam; coded is then
    ``coded_tables`` through the codec). At each check the measured median step of the current
    choice gives the other's estimate: the measured step minus the current choice's wire
    estimate and measured codec time, plus the other's wire and codec estimates. The codec's
    estimate is never below what it measured when it last ran (a codec that got slow is not
    taken back on its stale start-up figure: no flapping); while the run is raw it is
    ``remeasure()`` where given (the codec timed again at the check: a start-up calibration
    under load priced it too slow, the reason a raw start may be wrong), else the start-up
    figure. A switch replaces every module's :class:`~torchrec_lossy.distributed.comms.WireChoice`
    (:meth:`~torchrec_lossy.distributed.comms.LossyComms.choose_wire`), on every rank at the
    same step (the figures are agreed over ranks first).

    Args:
        model: The model whose lossy-sharded modules switch (e.g. the DMP), or their
            :class:`~torchrec_lossy.distributed.comms.LossyComms` directly.
        step_ms: The planner's ``{format: (wire ms, codec ms)}`` a step for ``"raw"`` and the
            codec format (:meth:`~torchrec_lossy.planner.lossy_model.LossyCommsModel.step_ms`).
        config: Period, hysteresis and patience.
        group: The process group the decision is agreed over (None: this rank alone).
        start: The choice the run starts with: the codec format (None) or ``"raw"``.
        coded_tables: The tables the codec takes when the choice is coded; None: the config's
            (each table's ``compress``). Required for a raw start.
        remeasure: Returns the codec's estimated ms a step timed now (this rank's; agreed with
            the others at the check); None: the start-up estimate.
    """

    def __init__(
        self,
        model: Any,
        step_ms: Mapping[str, tuple[float, float]],
        config: RecheckConfig | None = None,
        group: dist.ProcessGroup | None = None,
        start: str | None = None,
        coded_tables: Collection[str] | None = None,
        remeasure: Callable[[], float] | None = None,
    ) -> None:
        from torchrec_lossy.distributed.comms import LossyComms, WireChoice
        from torchrec_lossy.distributed.model_utils import lossy_modules

        coded = [n for n in step_ms if n != "raw"]
        if "raw" not in step_ms or len(coded) != 1:
            raise ValueError(
                f"RuntimeRecheck: step_ms {dict(step_ms)!r} must hold 'raw' and one codec format"
            )
        if start not in (None, "raw", coded[0]):
            raise ValueError(f"RuntimeRecheck: start={start!r} is neither 'raw' nor {coded[0]!r}")
        if start == "raw" and not coded_tables:
            raise ValueError("RuntimeRecheck: a raw start needs the coded_tables to switch to")
        if isinstance(model, Sequence) and all(isinstance(c, LossyComms) for c in model):
            self._comms = list(model)
        else:
            self._comms = [m.lossy_comms for m in lossy_modules(model).values()]
        if not self._comms:
            raise ValueError("RuntimeRecheck: the model has no lossy-sharded module to switch")
        self.coded = coded[0]
        self.step_ms = dict(step_ms)
        self.group = group
        self.recheck = FormatRecheck(start or self.coded, config)
        self._remeasure = remeasure
        # Each choice's record: raw sends every block raw; coded is the config's flags, or
        # exactly the given tables through the codec.
        to_code = None if coded_tables is None else frozenset(coded_tables)
        self._choices = {
            "raw": WireChoice(frozenset(), "raw"),
            self.coded: WireChoice(to_code, self.coded),
        }
        self._steps: list[tuple[float, float]] = []  # (step ms, codec ms) since the last check
        # The codec's measured ms a step when it last ran: a coded alternative's estimate
        # never drops below it (the start-up estimate may be stale: the reason to switch).
        self._codec_ms: dict[str, float] = {}

    @property
    def current(self) -> str:
        """The choice the modules run now."""
        return self.recheck.current

    def step(self, step: int, step_s: float, codec_s: float = 0.0) -> str | None:
        """Records one step; on a check step, re-checks and applies a switch.

        Args:
            step: Steps done (after this one).
            step_s: This step's measured seconds.
            codec_s: The codec's measured seconds in it (encode + decode, every direction).

        Returns:
            The new choice if it switched, else None.
        """
        self._steps.append((1000.0 * step_s, 1000.0 * codec_s))
        if not self.recheck.due(step):
            return None
        measured = statistics.median(s for s, _ in self._steps)
        codec = statistics.median(c for _, c in self._steps)
        self._steps.clear()
        cur = self.recheck.current
        if cur != "raw":
            self._codec_ms[cur] = codec
        other = "raw" if cur != "raw" else self.coded
        base = measured - self.step_ms[cur][0] - codec  # the step without the exchanges' share
        wire, codec_est = self.step_ms[other]
        if other != "raw" and self._remeasure is not None:
            codec_est = self._remeasure()
        estimate = base + wire + max(codec_est, self._codec_ms.get(other, 0.0))
        new = self.recheck.check(step, measured, {other: estimate}, self.group)
        if new is not None:
            self._apply()
        return new

    def _apply(self) -> None:
        for comms in self._comms:
            comms.choose_wire(self._choices[self.recheck.current])

    def state_dict(self) -> dict[str, Any]:
        """The re-check's state (:meth:`FormatRecheck.state_dict`).

        Returns:
            A plain dict (checkpointable).
        """
        return self.recheck.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the state and applies its choice to the modules.

        Args:
            state: :meth:`state_dict`'s output.
        """
        self.recheck.load_state_dict(state)
        self._apply()


def codec_remeasure(
    model: LossyCommsModel, device: torch.device, reps: int = 3
) -> Callable[[], float] | None:
    """The codec's estimated ms a step, timed again when called: :class:`RuntimeRecheck`'s
    ``remeasure`` for a run that started raw.

    The codec's speeds are timed afresh on the same synthetic blocks as at start-up (this rank
    alone, no collective; the best of ``reps`` interleaved rounds) and the start-up estimate
    (:meth:`~torchrec_lossy.planner.lossy_model.LossyCommsModel.step_ms`) scaled by them: its
    codec ms is the step's bytes times ``1 / encode + 1 / decode`` of the run's codec format.

    Args:
        model: The planner's comms model (its speeds measured: ``speeds.rows`` set).
        device: Where the codec runs.
        reps: Interleaved rounds per timing.

    Returns:
        The function, or None where nothing can be re-timed (the batch not measured, or the
        codec's speeds pinned by ``planner.encode_gib_s`` / ``decode_gib_s``).
    """
    from torchrec_lossy.planner.speeds import measure_speeds

    p, fmt, sp = model.config.planner, model.codec_format, model.speeds
    estimate = model.step_ms().get(fmt)
    if estimate is None or not sp.rows or p.encode_gib_s is not None or p.decode_gib_s is not None:
        return None
    enc, dec = sp.formats[fmt]
    rows, tables, comms = sp.rows, model.config.embedding_tables, model.config.comms

    def remeasure() -> float:
        fresh = measure_speeds(tables, rows, comms, device, reps=reps)
        if fmt not in fresh.formats or fresh.source.startswith("defaults"):
            return estimate[1]  # the re-timing failed (said once there): the start-up figure
        e, d = fresh.formats[fmt]
        return estimate[1] * (1 / e + 1 / d) / (1 / enc + 1 / dec)

    return remeasure
