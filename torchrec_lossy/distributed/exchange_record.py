"""What one exchange did, for the telemetry: filled along the call, written once.

:func:`.exchange.exchange` starts an :class:`ExchangeRecord` for each all-to-all it sends and
keeps it on the call's request; the wire codec adds what it knows (the encoder its blocks' bytes,
errors, bounds and seconds, the links' bytes; the decoder its seconds), and
:func:`.exchange.receive` writes it to the module's ``LossyCommsStats`` in one place
(:meth:`ExchangeRecord.write`). No line of the encode or the decode writes the telemetry itself.
The encoder's error samples (``error_sample``, every ``error_sample_every``-th call) are a
decode of their own and record themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchrec_lossy.distributed.stats import Direction, LossyCommsStats


@dataclass
class BlockRecords:
    """The telemetry of every block one encode sent to a peer, in order.

    Attributes:
        tables: Table of each block.
        raw_bytes: Uncompressed bytes of each block.
        wire_bytes: Bytes sent for each block.
        errors: Largest error of each block.
        abs_bounds: Absolute bound of each block.
        container: Codec payload bytes that belong to no block (headers), or None if the call
            made no codec payload.
    """

    tables: list[str] = field(default_factory=list)
    raw_bytes: list[int] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)
    abs_bounds: list[float | None] = field(default_factory=list)
    container: int | None = None


@dataclass
class ExchangeRecord:
    """One all-to-all's telemetry, owned by the call (its request) until it is written.

    Attributes:
        direction: ``"fwd"`` or ``"bwd"``.
        rows: (table, rows TorchRec's all-to-all would send, rows sent) of each block sent to a
            peer.
        self_bytes: Raw bytes of the blocks the rank kept for itself, or None if not counted.
        blocks: The encoded blocks (:class:`BlockRecords`), or None before the encode.
        encode_s: Seconds the encode took.
        lazy_errors: (table, 0-d device tensor) of errors read later (a cast's).
        links: Wire bytes to (same-host, cross-host) peers, or None if not counted.
        decode_shares: Raw bytes per table the decode produced, or None before the decode.
        decode_s: Seconds the decode took.
    """

    direction: Direction
    rows: list[tuple[str, int, int]] = field(default_factory=list)
    self_bytes: int | None = None
    blocks: BlockRecords | None = None
    encode_s: float = 0.0
    lazy_errors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    links: tuple[int, int] | None = None
    decode_shares: dict[str, int] | None = None
    decode_s: float = 0.0

    def write(self, stats: LossyCommsStats) -> None:
        """Writes the record to ``stats`` (the one place an exchange's telemetry is written).

        Args:
            stats: The module's telemetry.
        """
        d = self.direction
        for table, full, sent in self.rows:
            stats.record_rows(d, table, full, sent)
        if self.self_bytes is not None:
            stats.record_self(d, self.self_bytes)
        if self.links is not None:
            stats.record_links(d, *self.links)
        b = self.blocks
        if b is not None:
            stats.record_encode(
                d, b.tables, b.raw_bytes, b.wire_bytes, b.errors, b.abs_bounds, b.container,
                self.encode_s,
            )  # fmt: skip
        for table, err in self.lazy_errors:
            stats.record_max_error_lazy(d, table, err)
        if self.decode_shares is not None:
            stats.record_time(d, "decode", self.decode_shares, self.decode_s)
