"""What one sharded module's compressed dists share: config, bound provider, telemetry, hooks.

The error bound of every table comes from one small *bound provider* object. The default,
:class:`StaticBounds`, returns the configured bound; an adaptive provider (``AdaptiveBounds`` in
``torchrec_lossy.adaptive``) implements the same :class:`BoundProvider` protocol. The provider is
registered as the ``lossy_bounds`` submodule of the sharded module, so its state is saved and
loaded with the model's ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from torchrec_lossy.config import ErrorBound, LossyCommsConfig
from torchrec_lossy.distributed.guard import BoundGuard
from torchrec_lossy.distributed.stats import Direction, LossyCommsStats


@runtime_checkable
class BoundProvider(Protocol):
    """Where the dists get each table's forward error bound from.

    Implementations are ``nn.Module`` subclasses constructed as ``cls(table_names, config)``.
    """

    def bound(self, table: str) -> ErrorBound:
        """The bound to apply to ``table``'s next block.

        Args:
            table: Table name.

        Returns:
            The effective bound now.
        """
        ...

    def observe(self, table: str, block: torch.Tensor, abs_bound: float) -> None:
        """Sender-side look at a block about to be encoded (for statistics).

        Args:
            table: Table name.
            block: The block (rows = pooled embedding vectors); do not modify it.
            abs_bound: The absolute bound it is encoded with.
        """
        ...

    def step(self) -> None:
        """Marks the end of one training iteration."""
        ...


BoundProviderFactory = Callable[[list[str], LossyCommsConfig], nn.Module]


class StaticBounds(nn.Module):
    """The default provider: each table's configured bound, unchanged over training.

    Args:
        table_names: Tables of the sharded module.
        config: The comms config; ``config.table(name).bound`` is returned.
    """

    def __init__(self, table_names: list[str], config: LossyCommsConfig) -> None:
        super().__init__()
        self._config = config
        self._bounds: dict[str, ErrorBound] = {}
        for name in table_names:
            self.bound(name)

    def bound(self, table: str) -> ErrorBound:
        """The configured bound of ``table``.

        Args:
            table: Table name.

        Returns:
            Its bound.
        """
        found = self._bounds.get(table)
        if found is None:
            found = self._config.table(table).bound
            assert found is not None  # LossyCommsConfig.table() always sets it
            self._bounds[table] = found
        return found

    def observe(self, table: str, block: torch.Tensor, abs_bound: float) -> None:
        """Does nothing: static bounds need no statistics.

        Args:
            table: Table name.
            block: The block about to be encoded.
            abs_bound: Its absolute bound.
        """

    def step(self) -> None:
        """Does nothing: static bounds do not decay."""


PayloadHook = Callable[[Direction, int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class WireChoice:
    """Which tables' pooled blocks go through the codec: the run's format decision, an
    immutable record that the run's format re-check replaces between steps
    (:meth:`LossyComms.choose_wire`), never changes in place.

    Attributes:
        coded: The tables coded now, every other one raw; None: as the config says (each
            table's ``compress``).
        name: What the decision is, for logs: ``"config"``, ``"raw"`` or a codec format.
    """

    coded: frozenset[str] | None = None
    name: str = "config"

    def flags(self, configured: Mapping[str, bool]) -> dict[str, bool]:
        """Whether each table goes through the codec under this choice.

        Args:
            configured: Table name to its configured flag (:meth:`LossyComms.compress_flags`).

        Returns:
            Table name to flag, the same keys.
        """
        if self.coded is None:
            return dict(configured)
        return {t: t in self.coded for t in configured}


@dataclass
class LossyComms:
    """Configuration and statistics one sharded module's compressed dists share (a plain object).

    Attributes:
        config: The comms config.
        bounds: The bound provider (also registered as the module's ``lossy_bounds``).
        stats: Telemetry.
        payload_hook: Called on every received payload before it is decoded, as
            ``hook(direction, source_rank, payload) -> payload``; for fault injection in tests
            and for debugging. None in normal use.
        warned_exact: (direction, table) pairs already logged for travelling exactly.
        guard: Tightens bounds on the error sample's alerts (``comms.guard``); None when off.
            Like ``bounds``, the run's bound policy: it changes only between steps, on every
            rank alike, never within a call.
        wire: The run's format decision (:class:`WireChoice`): the config's until the run's
            format re-check (:class:`~torchrec_lossy.planner.recheck.RuntimeRecheck`) replaces
            it between steps, on every rank alike (:meth:`choose_wire`); each call reads it
            once, when it starts, and carries its flags.

    Per-call state is not here: each call's record and decode status travel with the call, drawn
    from and listed in the module's own :class:`~.call_ledger.CallLedger` (the sharded module's
    ``lossy_ledger``, handed to its dists' constructors).
    """

    config: LossyCommsConfig
    bounds: BoundProvider
    stats: LossyCommsStats = field(default_factory=LossyCommsStats)
    payload_hook: PayloadHook | None = None
    warned_exact: set[tuple[str, str]] = field(default_factory=set)
    guard: BoundGuard | None = None
    wire: WireChoice = field(default_factory=WireChoice)

    def choose_wire(self, choice: WireChoice) -> None:
        """Replaces the run's format decision for the calls that start from now on.

        Args:
            choice: The new decision (between steps, the same on every rank).
        """
        self.wire = choice

    def compress_flags(self, tables: Sequence[str]) -> dict[str, bool]:
        """Whether each table's blocks go through the codec (else raw), in both directions.

        Args:
            tables: Table names.

        Returns:
            Table name to flag.
        """
        return {t: self.config.table(t).compress for t in tables}
