"""Per-call state of the compressed all-to-alls: each call's record, and the module's counters.

An exchange fixes what it needs of the module's running state once, when it starts, in an
immutable :class:`CallRecord` (its number, the training step, whether it is exact) that travels
with the call: the encode seeds its stochastic rounding and schedules its error samples from
it, the decode names it in an error. The :class:`CallLedger` is the module's explicit counter
those records are drawn from, and the list of calls whose device decode status is still
unread, which :func:`read_checked` reads with the next host read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from torchrec_lossy.codec import host_sync
from torchrec_lossy.distributed.stats import Direction


@dataclass(frozen=True)
class CallRecord:
    """What one all-to-all call needs of the module's running state, fixed when it starts.

    Attributes:
        direction: ``"fwd"`` or ``"bwd"``.
        call: The call's number among the module's encode calls of ``direction`` (0-based):
            seeds its stochastic rounding, schedules its error samples, named by its errors.
        step: The training step (``CallLedger.steps``), or None if steps are not counted.
        exact: Every block travels lossless (bound 0, the bound provider neither asked nor
            shown the blocks): an exact evaluation's forward.
    """

    direction: Direction
    call: int
    step: int | None
    exact: bool = False

    def step_text(self) -> str:
        """The step as an error message names it.

        Returns:
            ``"training step N (0-based)"``, or how to get the step counted.
        """
        if self.step is None:
            return "training step unknown (call step_lossy_bounds(model) once per iteration)"
        return f"training step {self.step} (0-based)"


class UnreadStatus(Protocol):
    """A call whose device decode status has not been read yet (the awaitable of the call),
    or another device value owed to the next host read (a device-path error sample,
    ``error_sample.DeviceSample``: its sums as int64 bits, recorded by ``raise_if_failed``).

    Attributes:
        flags: int32 per decoded source on the device, nonzero where its payload failed (or
            the int64 words of an error sample).
    """

    flags: torch.Tensor

    def raise_if_failed(self, flags: Sequence[int]) -> None:
        """Raises the call's decode error if any of its flags (read back) is nonzero.

        Args:
            flags: ``flags`` on the host.
        """
        ...


class CallLedger:
    """One sharded module's explicit call counters and its calls with unread decode status.

    Attributes:
        steps: Training iterations finished (:meth:`end_step`, called by
            ``step_lossy_bounds``); None until the first.
        exact_forward: Whether the next forward travels lossless (set by the sharded module
            from its mode before each output dist: TorchRec's dist modules do not follow
            ``model.eval()``).
    """

    def __init__(self) -> None:
        self.steps: int | None = None
        self.exact_forward = False
        self._calls: dict[str, int] = {}
        self._unread: list[UnreadStatus] = []
        self._tags = 0  # overflow tags handed out (overflow_tag)

    def start(self, direction: Direction, exact: bool = False) -> CallRecord:
        """Draws the record of a new encode call of ``direction``.

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            exact: Whether the call travels lossless.

        Returns:
            The call's record (its number counts the earlier calls of that direction).
        """
        n = self._calls.get(direction, 0)
        self._calls[direction] = n + 1
        return CallRecord(direction, n, self.steps, exact)

    def overflow_tag(self) -> int:
        """A fresh point-to-point tag for one call's overflow sends (``exchange_slots``).

        An id allocator, not call state: a tag must differ among the module's overflow sends
        still in flight (its dists' calls may be waited on in another order than launched), and
        every dist of the module draws from this ledger. It travels in the slot's header, so no
        rank derives another's. Two modules on one group may draw the same tag; a send matched
        to the other module's receive is the codec part of a payload (a slot holds its raw
        blocks whole), so its checksum or size fails loudly, never silently.

        Returns:
            A tag in ``[1, 2**31 - 1]`` (gloo's point-to-point tags are 32-bit).
        """
        self._tags = self._tags % ((1 << 31) - 1) + 1
        return self._tags

    def end_step(self) -> None:
        """Counts one finished training iteration."""
        self.steps = (self.steps or 0) + 1

    def owe_status(self, call: UnreadStatus) -> None:
        """Lists a call whose device decode status the next host read must check.

        Args:
            call: The call (its awaitable owns the status and raises its error).
        """
        self._unread.append(call)

    def take_unread(self) -> list[UnreadStatus]:
        """The calls with unread status, handed over (the list is emptied).

        Returns:
            The calls, oldest first.
        """
        taken, self._unread = self._unread, []
        return taken


def read_checked(ledger: CallLedger, t: torch.Tensor | None = None) -> np.ndarray:
    """Reads ``t`` to the host in one copy with the decode status of every unread call.

    The one place the status of a device decode is read: folded into the next host read the
    dists make anyway (the size exchange), or a read of its own when called with no ``t``
    (none is made if nothing is pending).

    Args:
        ledger: The module's ledger (its calls with unread status are taken; each raises
            its own error).
        t: An int64 tensor to read back as well, or None.

    Returns:
        ``t`` on the host (empty if None).

    Raises:
        LossyAllToAllError: A deferred decode failed (the oldest failure is named).
    """
    checks = ledger.take_unread()
    parts = ([] if t is None else [t]) + [c.flags.to(torch.int64) for c in checks]
    if not parts:
        return np.zeros(0, np.int64)
    host = host_sync.to_host(parts[0] if len(parts) == 1 else torch.cat(parts))
    at = 0 if t is None else t.numel()
    for c in checks:
        n = c.flags.numel()
        c.raise_if_failed(host[at : at + n].tolist())
        at += n
    return host[: 0 if t is None else t.numel()]
