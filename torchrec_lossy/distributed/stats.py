"""Telemetry of the compressed all-to-alls: bytes, errors and codec time per table and direction.

One :class:`LossyCommsStats` object is shared by every dist of a sharded module (reach it as
``sharded_ebc.lossy_stats``). All counts are local to the rank that records them: bytes and
errors are recorded by the sender of a block, decode time by its receiver.

Direction ``"input"`` is the lossless KJT input dist (torchrec_lossy.distributed.input_dist);
its entries are keyed by feature name, not table name, and also count ids and repeated ids.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Direction = Literal["fwd", "bwd", "input"]
DIRECTIONS: tuple[Direction, ...] = ("fwd", "bwd", "input")
# Where a payload went: the rank itself (never on the wire), a peer on the same host, or a peer
# on another host (the slow link).
Link = Literal["self", "same_host", "cross_host"]

# Pseudo-table that holds the bytes of a payload not attributable to one block (the codec's
# container header), so that the per-direction total equals the bytes handed to the collective.
CONTAINER = "<container>"


@dataclass(frozen=True)
class ErrorSample:
    """The error sample of one block: its sender decoded its own payload (every
    ``error_sample_every``-th call) and summed over the block's finite elements.

    Attributes:
        table: Table name.
        error_sum: Sum of the signed errors ``x' - x``.
        count: Number of elements summed.
        error_sq_sum: Sum of the squared errors.
        value_sq_sum: Sum of the squared values.
        snapped: How many were not 0 and decoded to 0.
        row_rel_sq_sum: Sum over rows with ``sum x**2 > 0`` of their relative error energy
            ``sum (x' - x)**2 / sum x**2`` (the error against each row's own scale).
        rows: Those rows.
        nonfinite: Elements that are NaN or Inf (they travel exactly).
    """

    table: str
    error_sum: float
    count: int
    error_sq_sum: float = 0.0
    value_sq_sum: float = 0.0
    snapped: int = 0
    row_rel_sq_sum: float = 0.0
    rows: int = 0
    nonfinite: int = 0


@dataclass(frozen=True)
class ErrorAlert:
    """A sampled gradient block whose error against its rows' own scale passed the reported
    level (``error_sample.ROW_ENERGY_LEVEL``), or a sampled block that held NaN / Inf.

    Attributes:
        direction: ``"fwd"`` or ``"bwd"``.
        table: Table name.
        call: The call's number in its direction (the training step for a module called once
            a step; -1 where unknown).
        row_energy: The block's mean row-relative error energy.
        nonfinite: Its NaN / Inf elements.
        past_level: Whether it was raised for its energy (what ``comms.guard`` acts on), not
            for NaN / Inf alone.
        level: The guard's tightenings of the pair when the block was encoded (0 without a
            guard): the guard acts only on alerts from its current bound (a device-path
            sample arrives a call late, possibly after a tightening).
    """

    direction: Direction
    table: str
    call: int
    row_energy: float
    nonfinite: int
    past_level: bool = False
    level: int = 0


@dataclass
class TableCommStats:
    """Counters of one table (or the container pseudo-table) in one direction.

    Attributes:
        blocks: Blocks encoded (one per destination rank, table shard and call).
        raw_bytes: Bytes the blocks would have taken uncompressed.
        wire_bytes: Bytes actually handed to the all-to-all for them.
        max_error: Largest ``|x - x'|`` over all finite decoded elements so far.
        max_error_over_bound: Largest ratio of a block's max error to its absolute bound; at most
            1 for an error-bounded codec, 0 for exact transport, NaN where no bound applies
            (fp16/bf16 casts).
        encode_s: Host seconds spent encoding, split over tables by raw-byte share.
        decode_s: Host seconds spent decoding (on the receiving rank), split the same way.
        ids: Ids sent (input direction, where deduplication is on).
        repeated_ids: Of those, ids equal to an earlier id of the same feature and destination.
        rows: Pooled rows (embedding vectors, or their gradients) TorchRec would send.
        rows_sent: Of those, the rows actually encoded and sent (fewer under output dedupe).
        error_sum: Sum of signed errors ``x' - x`` over the sampled elements (the sender
            decodes every ``error_sample_every``-th payload of its own, in both directions).
        error_count: Elements sampled for ``error_sum``.
        error_sq_sum: Sum of ``(x' - x)^2`` over the sampled elements.
        value_sq_sum: Sum of ``x^2`` over them (``relative_rms_error``'s denominator).
        snapped_to_zero: Sampled elements that were not 0 and decoded to exactly 0.
        row_rel_sq_sum: Sum of the sampled rows' relative error energies (``ErrorSample``).
        error_rows: Sampled rows with a nonzero value (``row_relative_energy``'s count).
        nonfinite: Sampled elements that were NaN or Inf.
    """

    blocks: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    max_error: float = 0.0
    max_error_over_bound: float = 0.0
    encode_s: float = 0.0
    decode_s: float = 0.0
    ids: int = 0
    repeated_ids: int = 0
    rows: int = 0
    rows_sent: int = 0
    error_sum: float = 0.0
    error_count: int = 0
    error_sq_sum: float = 0.0
    value_sq_sum: float = 0.0
    snapped_to_zero: int = 0
    row_rel_sq_sum: float = 0.0
    error_rows: int = 0
    nonfinite: int = 0

    @property
    def row_relative_energy(self) -> float:
        """Mean over the sampled rows of ``sum (x' - x)**2 / sum x**2`` (NaN if none): the error
        against each row's own scale, which a bound relative to a block's range leaves large for
        the block's small rows (issue 32)."""
        return self.row_rel_sq_sum / self.error_rows if self.error_rows else math.nan

    @property
    def mean_signed_error(self) -> float:
        """Mean of ``x' - x`` over the sampled elements (NaN if none): near 0 for an unbiased
        (stochastically rounded) codec, to be read against ``max_error``."""
        return self.error_sum / self.error_count if self.error_count else math.nan

    @property
    def relative_rms_error(self) -> float:
        """RMS error over RMS value of the sampled elements (NaN if none): the error's energy
        relative to the signal's, the statistic the forward's accuracy cost follows
        (docs/accuracy.md)."""
        return math.sqrt(self.error_sq_sum / self.value_sq_sum) if self.value_sq_sum else math.nan

    @property
    def snapped_share(self) -> float:
        """Share of the sampled elements that were not 0 and decoded to 0 (NaN if none)."""
        return self.snapped_to_zero / self.error_count if self.error_count else math.nan

    @property
    def repeated_share(self) -> float:
        """Share of ids that repeat an earlier id of their feature and destination (0 if none)."""
        return self.repeated_ids / self.ids if self.ids else 0.0

    @property
    def ratio(self) -> float:
        """Compression ratio raw / wire (1 when nothing was sent)."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0

    def merge(self, other: TableCommStats) -> None:
        """Adds ``other``'s counters into this one (maxima are maxed).

        Args:
            other: Counters to fold in.
        """
        for field in dataclasses.fields(self):
            fold = _MAXIMA.get(field.name, operator.add)
            setattr(self, field.name, fold(getattr(self, field.name), getattr(other, field.name)))


def _nanmax(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


# The counters :meth:`TableCommStats.merge` maxes (every other one is summed).
_MAXIMA: dict[str, Callable[[float, float], float]] = {
    "max_error": max,
    "max_error_over_bound": _nanmax,
}


class LossyCommsStats:
    """Per-table, per-direction telemetry of one sharded module's compressed all-to-alls.

    Example::

        stats = sharded_ebc.lossy_stats
        fwd = stats.total("fwd")
        print(fwd.raw_bytes / fwd.wire_bytes, stats.table("t0", "fwd").max_error_over_bound)
        print(stats.summary())
        stats.reset()
    """

    def __init__(self) -> None:
        # Backward hooks may record from autograd's threads; reentrant, so that one record can
        # take the lock and call another (record_encode's record_time).
        self._lock = threading.RLock()
        self._tables: dict[tuple[Direction, str], TableCommStats] = {}
        # Device-side running maxima (cast errors), folded in on read so that recording them
        # never forces a device-to-host sync.
        self._pending_max: dict[tuple[Direction, str], torch.Tensor] = {}
        # Bytes by link: each rank's self blocks (raw, never on the wire, kept out of the
        # tables) and the wire bytes sent to same-host and cross-host peers.
        self._link_bytes: dict[tuple[Direction, Link], int] = {}
        self._alerts: list[ErrorAlert] = []
        # (direction, table, guard level) of the alerts past the level since the guard last
        # took them; kept through reset() (a meter resets per interval, the guard takes them
        # at its own steps).
        self._past_level: set[tuple[Direction, str, int]] = set()

    def __getstate__(self) -> dict[str, object]:
        # Locks do not pickle or deepcopy; a copy gets its own.
        self._fold_pending()
        return {
            "_tables": {k: dataclasses.replace(e) for k, e in self._tables.items()},
            "_link_bytes": dict(self._link_bytes),
            "_alerts": list(self._alerts),
        }

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()
        self._tables.update(state["_tables"])  # type: ignore[arg-type]
        self._link_bytes.update(state.get("_link_bytes", {}))  # type: ignore[arg-type]
        self._alerts.extend(state.get("_alerts", []))  # type: ignore[arg-type]

    def _entry(self, direction: Direction, table: str) -> TableCommStats:
        key = (direction, table)
        entry = self._tables.get(key)
        if entry is None:
            entry = self._tables[key] = TableCommStats()
        return entry

    def record_block(
        self,
        direction: Direction,
        table: str,
        raw_bytes: int,
        wire_bytes: int,
        max_error: float,
        abs_bound: float | None,
    ) -> None:
        """Records one encoded block.

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.
            table: Table name.
            raw_bytes: Uncompressed size of the block.
            wire_bytes: Bytes sent for it.
            max_error: Its largest finite-element error.
            abs_bound: Its absolute bound, or None where no bound applies.
        """
        self.record_blocks(direction, [table], [raw_bytes], [wire_bytes], [max_error], [abs_bound])

    def record_blocks(
        self,
        direction: Direction,
        tables: Sequence[str],
        raw_bytes: Sequence[int],
        wire_bytes: Sequence[int],
        max_errors: Sequence[float] | None = None,
        abs_bounds: Sequence[float | None] | None = None,
    ) -> None:
        """Records several encoded blocks at once: :meth:`record_block` for each, one lock.

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.
            tables: Table name of each block.
            raw_bytes: Uncompressed size of each block.
            wire_bytes: Bytes sent for each block.
            max_errors: Largest finite-element error of each block; None: all 0 (exact).
            abs_bounds: Absolute bound of each block (None where no bound applies); None: all 0
                (exact transport).
        """
        with self._lock:
            self._add_blocks(direction, tables, raw_bytes, wire_bytes, max_errors, abs_bounds)

    def record_encode(
        self,
        direction: Direction,
        tables: Sequence[str],
        raw_bytes: Sequence[int],
        wire_bytes: Sequence[int],
        max_errors: Sequence[float],
        abs_bounds: Sequence[float | None],
        container_bytes: int | None,
        s: float,
    ) -> None:
        """One encode call's telemetry under one lock: :meth:`record_blocks` of its blocks,
        :meth:`record_container` of its container bytes, :meth:`record_time` of its seconds
        shared by the blocks' raw bytes per table.

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.
            tables: Table name of each block.
            raw_bytes: Uncompressed size of each block.
            wire_bytes: Bytes sent for each block.
            max_errors: Largest finite-element error of each block.
            abs_bounds: Absolute bound of each block (None where no bound applies).
            container_bytes: Payload bytes that belong to no block, or None if the call made
                no codec payload.
            s: Seconds the call took up to this record (the record's own time is added: the
                telemetry is part of the call, as in the other directions' encode seconds).
        """
        start = time.perf_counter()
        shares: dict[str, int] = {}
        for table, nbytes in zip(tables, raw_bytes, strict=True):
            shares[table] = shares.get(table, 0) + nbytes
        with self._lock:
            self._add_blocks(direction, tables, raw_bytes, wire_bytes, max_errors, abs_bounds)
            if container_bytes is not None:
                self._entry(direction, CONTAINER).wire_bytes += container_bytes
            self.record_time(direction, "encode", shares, s + time.perf_counter() - start)

    def _add_blocks(
        self,
        direction: Direction,
        tables: Sequence[str],
        raw_bytes: Sequence[int],
        wire_bytes: Sequence[int],
        max_errors: Sequence[float] | None,
        abs_bounds: Sequence[float | None] | None,
    ) -> None:
        """:meth:`record_blocks`, the lock held by the caller."""
        n = len(tables)
        errors = max_errors if max_errors is not None else [0.0] * n
        bounds = abs_bounds if abs_bounds is not None else [0.0] * n
        for table, raw, wire, err, bound in zip(
            tables, raw_bytes, wire_bytes, errors, bounds, strict=True
        ):
            e = self._entry(direction, table)
            if bound is None:
                ratio = math.nan
            elif bound > 0:
                ratio = err / bound
            else:
                ratio = 0.0 if err == 0 else math.inf
            e.blocks += 1
            e.raw_bytes += raw
            e.wire_bytes += wire
            e.max_error = max(e.max_error, err)
            e.max_error_over_bound = _nanmax(e.max_error_over_bound, ratio)

    def record_ids(self, direction: Direction, table: str, ids: int, repeated: int) -> None:
        """Counts ids sent and how many of them repeat an earlier one (deduplication telemetry).

        Args:
            direction: ``"input"`` in practice.
            table: Feature (input direction) or table name.
            ids: Ids sent for it in one call to one destination.
            repeated: Of those, ids that repeat an earlier id of the same call and destination.
        """
        self.record_id_counts(direction, [table], [ids], [repeated])

    def record_id_counts(
        self,
        direction: Direction,
        tables: Sequence[str],
        ids: Sequence[int],
        repeated: Sequence[int],
    ) -> None:
        """:meth:`record_ids` for several tables at once, under one lock.

        Args:
            direction: ``"input"`` in practice.
            tables: Feature (input direction) or table names.
            ids: Ids sent for each in one call to one destination.
            repeated: Of those, ids that repeat an earlier id of the same call and destination.
        """
        with self._lock:
            for table, n, r in zip(tables, ids, repeated, strict=True):
                e = self._entry(direction, table)
                e.ids += n
                e.repeated_ids += r

    def record_rows(self, direction: Direction, table: str, rows: int, rows_sent: int) -> None:
        """Counts pooled rows of one block: TorchRec's count and the count actually sent.

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            table: Table name.
            rows: Rows TorchRec would send (features x batch of the destination).
            rows_sent: Rows encoded (distinct bags of deduplicated features, all of the others).
        """
        with self._lock:
            e = self._entry(direction, table)
            e.rows += rows
            e.rows_sent += rows_sent

    def record_signed_error(
        self, direction: Direction, table: str, error_sum: float, count: int
    ) -> None:
        """Adds a sampled block's signed error sum ``sum(x' - x)`` over ``count`` elements.

        Args:
            direction: ``"bwd"`` in practice.
            table: Table name.
            error_sum: Sum of the signed errors of the block's finite elements.
            count: Number of those elements.
        """
        self.record_error_samples(direction, [ErrorSample(table, error_sum, count)])

    def record_error_samples(
        self,
        direction: Direction,
        samples: Sequence[ErrorSample],
        alerts: Sequence[ErrorAlert] = (),
    ) -> None:
        """Adds the error sample of several blocks at once, under one lock.

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            samples: One per sampled block.
            alerts: The sampled blocks past the reported level or holding NaN / Inf.
        """
        with self._lock:
            for b in samples:
                e = self._entry(direction, b.table)
                e.error_sum += b.error_sum
                e.error_count += b.count
                e.error_sq_sum += b.error_sq_sum
                e.value_sq_sum += b.value_sq_sum
                e.snapped_to_zero += b.snapped
                e.row_rel_sq_sum += b.row_rel_sq_sum
                e.error_rows += b.rows
                e.nonfinite += b.nonfinite
            self._alerts.extend(alerts)
            self._past_level.update((a.direction, a.table, a.level) for a in alerts if a.past_level)

    def take_past_level(self) -> set[tuple[Direction, str, int]]:
        """The (direction, table, guard level) of the alerts past the level since the last take
        (what ``comms.guard`` decides on; :meth:`reset` leaves them).

        Returns:
            The triples; the set is emptied.
        """
        with self._lock:
            taken, self._past_level = self._past_level, set()
            return taken

    def alerts(self) -> list[ErrorAlert]:
        """The error sample's alerts since the last :meth:`reset`, in the order recorded.

        Returns:
            A copy of the list.
        """
        with self._lock:
            return list(self._alerts)

    def record_max_error_lazy(self, direction: Direction, table: str, err: torch.Tensor) -> None:
        """Folds a 0-d device tensor into a table's max error without a host sync.

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.
            table: Table name.
            err: 0-d tensor, the error of a block just sent.
        """
        key = (direction, table)
        err = err.detach().float()
        with self._lock:
            prev = self._pending_max.get(key)
            self._pending_max[key] = err if prev is None else torch.maximum(prev, err)
            e = self._entry(direction, table)
            e.max_error_over_bound = math.nan

    def record_time(
        self,
        direction: Direction,
        phase: Literal["encode", "decode"],
        shares: dict[str, int],
        s: float,
    ) -> None:
        """Splits ``s`` seconds of one encode or decode call over tables by byte share.

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.
            phase: ``"encode"`` or ``"decode"``.
            shares: Raw bytes per table handled by the call.
            s: Seconds the call took.
        """
        total = sum(shares.values())
        if total == 0:
            return
        with self._lock:
            for table, nbytes in shares.items():
                e = self._entry(direction, table)
                if phase == "encode":
                    e.encode_s += s * nbytes / total
                else:
                    e.decode_s += s * nbytes / total

    def record_self(self, direction: Direction, nbytes: int) -> None:
        """Records the bytes of the blocks a rank keeps for itself (the self block).

        They skip the codec and the wire (exact, zero wire bytes), so they are counted here,
        apart from the tables and totals.

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            nbytes: Raw bytes of the rank's own blocks.
        """
        self._add_links(direction, {"self": nbytes})

    def record_links(self, direction: Direction, same_host: int, cross_host: int) -> None:
        """Records the wire bytes one all-to-all sent to same-host and to cross-host peers.

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            same_host: Bytes handed to the collective for peers on this rank's host.
            cross_host: Bytes for peers on other hosts.
        """
        self._add_links(direction, {"same_host": same_host, "cross_host": cross_host})

    def _add_links(self, direction: Direction, nbytes: dict[Link, int]) -> None:
        with self._lock:
            for link, n in nbytes.items():
                key = (direction, link)
                self._link_bytes[key] = self._link_bytes.get(key, 0) + n

    def link_bytes(self, direction: Direction, link: Link) -> int:
        """Bytes of one direction by link (see :data:`Link`; the self bytes are raw bytes).

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.
            link: ``"self"``, ``"same_host"`` or ``"cross_host"``.

        Returns:
            Bytes.
        """
        with self._lock:
            return self._link_bytes.get((direction, link), 0)

    def self_bytes(self, direction: Direction) -> int:
        """Raw bytes of the self blocks of one direction (not in :meth:`total`).

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.

        Returns:
            Bytes.
        """
        return self.link_bytes(direction, "self")

    def record_container(self, direction: Direction, wire_bytes: int) -> None:
        """Records payload bytes that belong to no single block (codec container header).

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.
            wire_bytes: Bytes.
        """
        with self._lock:
            self._entry(direction, CONTAINER).wire_bytes += wire_bytes

    def _fold_pending(self) -> None:
        with self._lock:
            pending, self._pending_max = self._pending_max, {}
            for key, err in pending.items():
                e = self._entry(*key)
                e.max_error = max(e.max_error, float(err.item()))

    def tables(self, direction: Direction) -> dict[str, TableCommStats]:
        """Counters of every table seen in one direction (container pseudo-table included).

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.

        Returns:
            A copy, keyed by table name.
        """
        self._fold_pending()
        with self._lock:
            return {
                t: dataclasses.replace(e)
                for (d, t), e in sorted(self._tables.items())
                if d == direction
            }

    def table(self, table: str, direction: Direction) -> TableCommStats:
        """Counters of one table in one direction (zeros if never seen).

        Args:
            table: Table name.
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.

        Returns:
            A copy of its counters.
        """
        return self.tables(direction).get(table, TableCommStats())

    def total(self, direction: Direction) -> TableCommStats:
        """All tables of one direction summed; ``wire_bytes`` equals the bytes sent.

        Args:
            direction: ``"fwd"``, ``"bwd"`` or ``"input"``.

        Returns:
            The summed counters.
        """
        out = TableCommStats()
        for e in self.tables(direction).values():
            out.merge(e)
        return out

    def reset(self) -> None:
        """Zeroes every counter."""
        with self._lock:
            self._tables.clear()
            self._pending_max.clear()
            self._link_bytes.clear()
            self._alerts.clear()

    def __iter__(self) -> Iterator[tuple[Direction, str, TableCommStats]]:
        for direction in DIRECTIONS:
            for table, e in self.tables(direction).items():
                yield direction, table, e

    def summary(self) -> str:
        """A plain-text table of every counter, one line per direction and table.

        Returns:
            The table.
        """
        lines = [
            f"{'dir':<4} {'table':<24} {'raw_B':>12} {'wire_B':>12} {'ratio':>7} "
            f"{'max_err':>10} {'err/bnd':>7} {'mean_err':>10} {'rel_rms':>8} {'snap%':>6} "
            f"{'enc_ms':>9} {'dec_ms':>9}"
        ]
        for direction in DIRECTIONS:
            rows = self.tables(direction)
            if not rows:
                continue
            for table, e in [*rows.items(), ("TOTAL", self.total(direction))]:
                lines.append(
                    f"{direction:<4} {table:<24} {e.raw_bytes:>12} {e.wire_bytes:>12} "
                    f"{e.ratio:>7.2f} {e.max_error:>10.3g} {e.max_error_over_bound:>7.3f} "
                    f"{e.mean_signed_error:>10.2g} {e.relative_rms_error:>8.4f} "
                    f"{100 * e.snapped_share:>6.1f} "
                    f"{1e3 * e.encode_s:>9.2f} {1e3 * e.decode_s:>9.2f}"
                )
            if self.self_bytes(direction):
                lines.append(
                    f"{direction:<4} {'(self, not sent)':<24} {self.self_bytes(direction):>12} "
                    f"{0:>12}"
                )
            for link in ("same_host", "cross_host"):
                if self.link_bytes(direction, link):
                    label = f"({link.replace('_', '-')} wire)"
                    lines.append(
                        f"{direction:<4} {label:<24} {'':>12} "
                        f"{self.link_bytes(direction, link):>12}"
                    )
        return "\n".join(lines)
