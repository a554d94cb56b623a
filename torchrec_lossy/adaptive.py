"""Dual-level adaptive error bounds: table-wise classes and iteration-wise decay.

:class:`AdaptiveBounds` sorts tables into classes tight / base / loose by a homogenization index
``h = max(0, min(rho, 2 kappa - 1))`` measured online on the blocks the sender is about to
compress, and multiplies the bound by a factor falling from ``C`` to 1 over the first ``E``
training iterations (:func:`decay_factor`). All its state is buffers, so a checkpoint restores it
exactly. Imports torch but not torchrec. ``docs/adaptive.md`` has the derivation and calibration.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchrec_lossy.config import (
    BoundKind,
    ErrorBound,
    ErrorBoundSchedule,
    HomogenizationConfig,
    LossyCommsConfig,
)

__all__ = [
    "CLASS_NAMES",
    "UNASSIGNED",
    "AdaptiveBounds",
    "IndexStats",
    "classify",
    "decay_factor",
    "homogenization_stats",
    "reclassify",
]

# Class ids index HomogenizationConfig.class_bounds.
CLASS_NAMES: tuple[str, str, str] = ("tight", "base", "loose")
UNASSIGNED = -1

_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}


@dataclass(frozen=True)
class IndexStats:
    """Counts of one index window and the index they give.

    Attributes:
        rows: Rows in the window (``n``).
        distinct_raw: Distinct raw vectors (bitwise), ``U_raw``.
        distinct_quantized: Distinct vectors after quantization at the reference bound, ``U_q``.
    """

    rows: int
    distinct_raw: int
    distinct_quantized: int

    @property
    def repetition(self) -> float:
        """``rho = 1 - U_raw / n``: share of rows that repeat an earlier row."""
        return 1.0 - self.distinct_raw / self.rows

    @property
    def kept(self) -> float:
        """``kappa = U_q / U_raw``: share of distinct vectors the quantizer keeps apart."""
        return self.distinct_quantized / self.distinct_raw

    @property
    def index(self) -> float:
        """The homogenization index ``h = min(rho, 2 kappa - 1)``, at least 0."""
        return max(0.0, min(self.repetition, 2.0 * self.kept - 1.0))


def _count_distinct_rows(rows: torch.Tensor) -> int:
    """Distinct rows of an integer matrix, via a 64-bit multiplicative hash of each row.

    ``torch.unique(dim=0)`` sorts whole rows and is ~20x slower; a collision between two of
    ``n`` distinct rows has probability about ``n**2 / 2**64`` (1e-13 at n = 4096).
    """
    dim = rows.shape[1]
    key = (str(rows.device), dim)
    mult = _HASH_MULTIPLIERS.get(key)
    if mult is None:
        gen = torch.Generator().manual_seed(0x5EED + dim)
        # Odd multipliers spread every column over all 64 bits; int64 products wrap mod 2**64.
        mult = torch.randint(-(1 << 62), 1 << 62, (dim,), generator=gen, dtype=torch.int64) | 1
        mult = _HASH_MULTIPLIERS.setdefault(key, mult.to(rows.device))
    h = (rows.to(torch.int64) * mult).sum(dim=1)
    h = h ^ (h >> 31)  # fold high bits down so that equal low bits alone do not collide
    return int(torch.unique(h).shape[0])


_HASH_MULTIPLIERS: dict[tuple[str, int], torch.Tensor] = {}


def homogenization_stats(block: torch.Tensor, reference_bound: float) -> IndexStats:
    """Measures the homogenization index of one window of pooled embeddings.

    Quantization follows the codec: ``eb = reference_bound * (max - min)`` over the finite values
    and ``q = round(x / (2 eb))``. Non-finite elements keep their bit pattern, so they never merge
    with finite ones.

    Args:
        block: 2-D float tensor, one embedding vector per row, at least one row.
        reference_bound: Relative bound of the quantization that ``kappa`` is measured at.

    Returns:
        The window's counts (their ``index`` property is ``h``).

    Raises:
        ValueError: If the block is not a non-empty 2-D float tensor.
    """
    if block.dim() != 2 or block.shape[0] == 0 or block.dtype not in _INT_VIEW:
        raise ValueError(
            f"homogenization_stats needs a non-empty 2-D float tensor, got shape "
            f"{tuple(block.shape)} dtype {block.dtype}"
        )
    x = block.detach().contiguous()
    bits = x.view(_INT_VIEW[x.dtype])
    distinct_raw = _count_distinct_rows(bits)
    if bool(torch.isfinite(x).all()):
        lo, hi = (float(v) for v in torch.aminmax(x))
        eb = reference_bound * (hi - lo)
        scale = 0.5 / eb if eb > 0 else 0.0
        # float32 holds the codes exactly while they stay below 2**22; float64 beyond (values
        # far from 0 relative to the window's range).
        wide = max(abs(lo), abs(hi)) * scale >= 2.0**22
        xf = x.to(torch.float64 if wide else torch.float32)
        distinct_q = _count_distinct_rows(torch.round(xf * scale).to(torch.int64))
    else:
        xf = x.to(torch.float64)
        finite = torch.isfinite(xf)
        lo = float(xf[finite].min()) if bool(finite.any()) else 0.0
        hi = float(xf[finite].max()) if bool(finite.any()) else 0.0
        eb = reference_bound * (hi - lo)
        scale = 0.5 / eb if eb > 0 else 0.0
        codes = torch.round(torch.where(finite, xf, 0.0) * scale).to(torch.int64)
        # Non-finite elements: a code outside the quantizer's range, unique per bit pattern.
        codes = torch.where(finite, codes, bits.to(torch.int64) - (1 << 62))
        distinct_q = _count_distinct_rows(codes)
    return IndexStats(rows=x.shape[0], distinct_raw=distinct_raw, distinct_quantized=distinct_q)


def classify(index: float, thresholds: Sequence[float]) -> int:
    """Class of an index without hysteresis: 0 tight, 1 base, 2 loose.

    Args:
        index: Homogenization index.
        thresholds: ``(low, high)``: ``index < low`` is tight, ``index >= high`` is loose.

    Returns:
        The class id (an index into :data:`CLASS_NAMES`).
    """
    low, high = thresholds
    if index < low:
        return 0
    return 2 if index >= high else 1


def reclassify(current: int, index: float, thresholds: Sequence[float], hysteresis: float) -> int:
    """Next class of a table, with hysteresis (a Schmitt trigger on each threshold).

    A table leaves its class only once the index is past a threshold by ``hysteresis``; it then
    moves as far as the index, taken ``hysteresis`` back towards the old class, warrants.

    Args:
        current: Current class id, or :data:`UNASSIGNED` (then no hysteresis applies).
        index: Homogenization index.
        thresholds: ``(low, high)`` as in :func:`classify`.
        hysteresis: Margin in index units.

    Returns:
        The new class id.
    """
    target = classify(index, thresholds)
    if current == UNASSIGNED or target == current:
        return target
    if target > current:
        return max(current, classify(index - hysteresis, thresholds))
    return min(current, classify(index + hysteresis, thresholds))


def decay_factor(schedule: ErrorBoundSchedule, iteration: int) -> float:
    """The iteration-wise factor on the error bound: ``C`` at iteration 0, 1 from ``E`` on.

    With ``C = start_factor``, ``E = decay_iterations``, ``S = steps`` and ``t = iteration``
    (training iterations completed), for ``t < E``:

    * ``step``: ``C - (C - 1) * floor(t * S / E) / S`` (``S`` equal plateaus),
    * ``linear``: ``C - (C - 1) * t / E``,
    * ``log``: ``C - (C - 1) * ln(1 + t) / ln(1 + E)`` (falls fast early, slowly later),
    * ``constant``: 1.

    Args:
        schedule: The schedule.
        iteration: Training iterations completed (>= 0).

    Returns:
        The factor, in ``[1, C]``.
    """
    if iteration < 0:
        raise ValueError(f"iteration={iteration} is invalid: allowed an integer >= 0")
    c, e = schedule.start_factor, schedule.decay_iterations
    if schedule.kind == "constant" or iteration >= e:
        return 1.0
    if schedule.kind == "step":
        k = (iteration * schedule.steps) // e
        return c - (c - 1.0) * k / schedule.steps
    if schedule.kind == "linear":
        return c - (c - 1.0) * iteration / e
    return c - (c - 1.0) * math.log1p(iteration) / math.log1p(e)


def _name_hash(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def _pinned(config: LossyCommsConfig, name: str) -> bool:
    """Whether the table's first matching override sets its bound explicitly."""
    for pattern, override in config.tables.items():
        if fnmatch.fnmatchcase(name, pattern):
            return override.bound is not None
    return False


class AdaptiveBounds(nn.Module):
    """Per-table error bounds that adapt to the traffic (table level) and to training progress.

    The effective bound of a table is its class bound (when ``homogenization.enabled``, the
    table's bound is relative and no per-table override pins it) or else its configured bound,
    times the decay factor of the current training iteration (1 in eval mode). Before a table's
    first index window completes it uses its configured bound.

    All state lives in buffers (part of ``state_dict``); a Python mirror of it serves
    :meth:`bound` and :meth:`telemetry` without reading device memory.

    Args:
        table_names: Tables this sender compresses, in a fixed order.
        config: The lossy comms config (bounds, overrides, schedule, homogenization).
    """

    iteration: torch.Tensor
    index: torch.Tensor
    windows: torch.Tensor
    table_class: torch.Tensor
    window_stats: torch.Tensor
    table_hash: torch.Tensor

    def __init__(self, table_names: list[str], config: LossyCommsConfig) -> None:
        super().__init__()
        if len(set(table_names)) != len(table_names):
            raise ValueError(f"table_names has duplicates: {table_names}")
        self.table_names: list[str] = list(table_names)
        self.config = config
        self._slot: dict[str, int] = {n: i for i, n in enumerate(self.table_names)}
        self._configured: list[ErrorBound] = [
            config.table(n).bound or config.default_bound for n in self.table_names
        ]
        self._pinned: list[bool] = [_pinned(config, n) for n in self.table_names]
        n = len(self.table_names)
        self.register_buffer("iteration", torch.zeros((), dtype=torch.int64))
        self.register_buffer("index", torch.full((n,), float("nan"), dtype=torch.float64))
        self.register_buffer("windows", torch.zeros(n, dtype=torch.int64))
        self.register_buffer("table_class", torch.full((n,), UNASSIGNED, dtype=torch.int8))
        # Counts of each table's last window: rows, distinct raw, distinct quantized.
        self.register_buffer("window_stats", torch.zeros(n, 3, dtype=torch.int64))
        self.register_buffer(
            "table_hash",
            torch.tensor([_name_hash(t) for t in self.table_names], dtype=torch.int64),
        )
        # Transient: rows gathered for a window still being filled, and the last iteration each
        # table was observed in (a table observed twice in one iteration, e.g. per column-wise
        # shard, contributes once). Neither is checkpointed: a resumed run restarts the window.
        self._pending: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self._last_seen: list[int] = [-1] * n
        self._last_abs_bound: list[float | None] = [None] * n
        self._sync_mirror()

    # ------------------------------------------------------------------------------------------
    # The contract the sharder calls
    # ------------------------------------------------------------------------------------------

    def bound(self, table: str) -> ErrorBound:
        """The table's effective bound now.

        Args:
            table: Table name.

        Returns:
            The bound to compress this iteration's block with (absolute bounds are scaled by the
            decay factor too; a relative bound is capped at 1, a per-value one at 0.5; only
            relative bounds are homogenized).
        """
        t = self._slot_of(table)
        base = self._configured[t]
        cls = self._classes[t]
        hc = self.config.homogenization
        if (
            hc.enabled
            and cls != UNASSIGNED
            and not self._pinned[t]
            and base.mode == "relative"
            and base.value > 0
        ):
            base = ErrorBound("relative", hc.class_bounds[cls])
        factor = self.factor()
        if factor == 1.0:
            return base
        value = base.value * factor
        return ErrorBound(base.mode, min(value, BoundKind.of(base.mode).max_value))

    def observe(self, table: str, block: torch.Tensor, abs_bound: float) -> None:
        """Feeds the block a sender is about to compress into the table's index.

        Cheap except on update iterations (every ``homogenization.update_period`` training
        iterations) and on the iterations that follow while a window of ``sample_rows`` rows is
        still being gathered from small blocks. A no-op in eval mode or with homogenization off.

        Args:
            table: Table name.
            block: The raw 2-D block (rows = pooled embeddings) about to be sent.
            abs_bound: The absolute bound it is compressed with (kept for telemetry).
        """
        t = self._slot_of(table)
        self._last_abs_bound[t] = float(abs_bound)
        hc = self.config.homogenization
        if not (self.training and hc.enabled) or block.dim() != 2 or block.shape[0] == 0:
            return
        it = self._iteration
        if self._last_seen[t] == it:
            return
        pending = self._pending[t]
        if not pending and it % hc.update_period != 0:
            return
        self._last_seen[t] = it
        if pending and pending[0].shape[1] != block.shape[1]:
            pending.clear()
        have = sum(p.shape[0] for p in pending)
        need = hc.sample_rows - have
        rows = block.detach()
        if rows.shape[0] >= need:
            # Stride over the block: its rows are the batches of all destinations, concatenated.
            stride = rows.shape[0] // need
            rows = rows[: stride * need : stride]
        if rows.shape[0] < need:
            pending.append(rows.clone())
            return
        window = torch.cat([*pending, rows]) if pending else rows
        pending.clear()
        self._update(t, homogenization_stats(window, hc.class_bounds[1]))

    def update_index(self, table: str, window: torch.Tensor) -> IndexStats:
        """Folds one whole window into the table's index now (no period, no row gathering).

        For calibration and tests; :meth:`observe` is the per-iteration path.

        Args:
            table: Table name.
            window: 2-D block of pooled embeddings (all its rows form the window).

        Returns:
            The window's counts.
        """
        t = self._slot_of(table)
        stats = homogenization_stats(window, self.config.homogenization.class_bounds[1])
        self._update(t, stats)
        return stats

    def step(self) -> None:
        """Marks one training iteration done (no-op in eval mode)."""
        if not self.training:
            return
        self._iteration += 1
        self.iteration.fill_(self._iteration)
        self._factor = decay_factor(self.config.schedule, self._iteration)

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------

    def factor(self) -> float:
        """The decay factor of the current iteration (1 in eval mode).

        Returns:
            The factor.
        """
        return self._factor if self.training else 1.0

    def table_class_name(self, table: str) -> str:
        """The table's class: ``"tight"``, ``"base"``, ``"loose"`` or ``"unassigned"``.

        Args:
            table: Table name.

        Returns:
            The class name.
        """
        cls = self._classes[self._slot_of(table)]
        return "unassigned" if cls == UNASSIGNED else CLASS_NAMES[cls]

    def telemetry(self) -> dict[str, dict[str, Any]]:
        """Per-table adaptive state as plain values (no device reads).

        Returns:
            ``{table: {"index", "repetition", "kept", "windows", "class", "bound_mode",
            "bound", "factor", "iteration", "last_abs_bound"}}``: ``index`` is the running
            index, ``repetition`` and ``kept`` (rho, kappa) are of the last window, all None
            before the first window; ``bound`` is the effective bound now.
        """
        out: dict[str, dict[str, Any]] = {}
        for t, name in enumerate(self.table_names):
            stats = self._stats[t]
            eff = self.bound(name)
            out[name] = {
                "index": None if math.isnan(self._index[t]) else self._index[t],
                "repetition": stats.repetition if stats else None,
                "kept": stats.kept if stats else None,
                "windows": self._windows[t],
                "class": self.table_class_name(name),
                "bound_mode": eff.mode,
                "bound": eff.value,
                "factor": self.factor(),
                "iteration": self._iteration,
                "last_abs_bound": self._last_abs_bound[t],
            }
        return out

    # ------------------------------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------------------------------

    def _slot_of(self, table: str) -> int:
        try:
            return self._slot[table]
        except KeyError:
            raise KeyError(
                f"unknown table {table!r}: AdaptiveBounds was built for {self.table_names}"
            ) from None

    def _update(self, t: int, stats: IndexStats) -> None:
        """Folds one window into the table's running index and updates its class."""
        hc: HomogenizationConfig = self.config.homogenization
        n = self._windows[t] + 1
        # Equal weights over the warm-up windows (a plain mean: the first window does not
        # dominate), then an exponential average that follows drift in the traffic.
        warm = n > hc.warmup_windows
        w = hc.smoothing if warm else 1.0 / n
        value = stats.index if n == 1 else (1.0 - w) * self._index[t] + w * stats.index
        # Provisional classes (no hysteresis) during the warm-up: a noisy early estimate must
        # not lock a table whose index sits near a threshold into the wrong class.
        cls = (
            reclassify(self._classes[t], value, hc.thresholds, hc.hysteresis)
            if warm
            else classify(value, hc.thresholds)
        )
        self._windows[t], self._index[t], self._classes[t], self._stats[t] = n, value, cls, stats
        self.windows[t] = n
        self.index[t] = value
        self.table_class[t] = cls
        self.window_stats[t] = torch.tensor(
            [stats.rows, stats.distinct_raw, stats.distinct_quantized], dtype=torch.int64
        )

    def _sync_mirror(self) -> None:
        """Reloads the Python mirror of the buffers (after construction or a state_dict load)."""
        self._iteration = int(self.iteration.item())
        self._index = [float(v) for v in self.index.tolist()]
        self._windows = [int(v) for v in self.windows.tolist()]
        self._classes = [int(v) for v in self.table_class.tolist()]
        self._stats: list[IndexStats | None] = [
            IndexStats(*(int(x) for x in row)) if row[0] > 0 else None
            for row in self.window_stats.tolist()
        ]
        self._factor = decay_factor(self.config.schedule, self._iteration)
        for p in self._pending:
            p.clear()
        self._last_seen = [-1] * len(self.table_names)

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        saved = state_dict.get(prefix + "table_hash")
        if saved is not None and (
            saved.shape != self.table_hash.shape
            or not torch.equal(saved.cpu(), self.table_hash.cpu())
        ):
            error_msgs.append(
                f"{prefix}table_hash: the checkpoint's AdaptiveBounds was built for other tables "
                f"(or another order) than {self.table_names}; build it with the same table_names"
            )
            return
        super()._load_from_state_dict(
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )
        self._sync_mirror()

    def extra_repr(self) -> str:
        hc = self.config.homogenization
        return (
            f"tables={len(self.table_names)}, homogenization={'on' if hc.enabled else 'off'}, "
            f"schedule={dataclasses.asdict(self.config.schedule)}"
        )
