"""Fixed-capacity slots: the lossy wire's one-round exchange, and the history it sizes them by.

A lossy all-to-all with the size exchange costs two collective rounds (the sizes, then the
payloads). On the host path the sizes need not travel first: each (source, destination) pair
sends a slot whose capacity both sides derive from what they already know: the payload's raw
blocks exactly (their rows are the call's), its codec part from the pair's previous call on
this dist and kind, with headroom; the payload's true size is in the slot's header. A payload
longer than its slot sends the rest point-to-point, between that pair only.

What both sides must agree on is decided from the dist's :class:`SlotHistory`, which every rank
updates at the same points of the same program order (SPMD): a call takes the slot path only
when the dist's previous call of that kind was received before it launched (no call of it in
flight), so the sender's "what I sent you last" and the receiver's "what you sent me last" are
the same numbers. The first call of a kind, and any call launched while another is in flight,
take the two-round path, which records its sizes too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from torchrec_lossy.distributed.errors import LossyAllToAllError
from torchrec_lossy.distributed.exchange_record import ExchangeRecord
from torchrec_lossy.distributed.stats import Direction
from torchrec_lossy.profile_range import profile_range

HEADER = 16  # slot header bytes: int64 payload size, int64 overflow tag (keeps payloads aligned)
MIN_SLACK = 32  # headroom floor per slot, bytes
START_SHIFT = 3  # first headroom: size / 2**3 (12.5 %)
# Each overflow of a pair halves its shift (doubles the headroom), down to 0 (100 %); after
# CALM_CALLS slotted calls of the pair in a row without one, the shift goes back up by one.
CALM_CALLS = 8
MAX_TAG = (1 << 31) - 1  # gloo's point-to-point tags are 32-bit; kept non-negative
# Overflow tags come from the module's ledger (call_ledger.CallLedger.overflow_tag).


@dataclass(frozen=True)
class SlotKey:
    """The kind of call a history is kept for: sizes differ by direction, exactness and format.

    Attributes:
        direction: ``"fwd"`` or ``"bwd"``.
        exact: The call travels lossless (an exact evaluation's forward).
        coded: The tables that go through the codec (the re-check's raw switch changes it).
    """

    direction: Direction
    exact: bool
    coded: frozenset[str]


@dataclass
class _PairSizes:
    """One kind's history: per peer, the last coded bytes each way and the headroom shift."""

    sent: list[int]
    received: list[int]
    send_shift: list[int]
    recv_shift: list[int]
    send_calm: list[int]  # slotted calls of the pair since its last overflow (or recovery)
    recv_calm: list[int]
    done: int = 0  # calls received
    in_flight: int = 0  # calls launched, not yet received


def capacity(size: int, shift: int) -> int:
    """Slot bytes for the coded part of a pair's payload whose previous one had ``size`` bytes.

    Args:
        size: The pair's previous coded bytes.
        shift: Its headroom shift (headroom ``size >> shift``, at least :data:`MIN_SLACK`).

    Returns:
        Bytes, a multiple of 16 (the slot adds its header and the payload's raw blocks, whose
        bytes both sides know exactly).
    """
    body = size + max(size >> shift, MIN_SLACK)
    return -(-body // 16) * 16


@dataclass(frozen=True)
class SlotCall:
    """One call's place in its dist's history, and its slots if it takes the one-round path.

    Attributes:
        key: The call's kind.
        send_fixed: Bytes of the raw blocks to each destination (both sides know them from the
            call's rows: no history, no slack).
        recv_fixed: Bytes of the raw blocks from each source.
        send_caps: Slot bytes to each destination, header included (0: nothing on the wire,
            the rank itself or a peer with no blocks); None: the two-round path.
        recv_caps: Slot bytes from each source; None: the two-round path.
    """

    key: SlotKey
    send_fixed: list[int]
    recv_fixed: list[int]
    send_caps: list[int] | None = None
    recv_caps: list[int] | None = None


# One side of a pair in a call: None (no slot: the rank itself, or a peer without blocks), else
# (the raw blocks' bytes, whether a codec part follows them).
PairShape = tuple[int, bool] | None


@dataclass
class SlotHistory:
    """What a dist's ranks know of each pair's last payload, per kind of call (built with the
    dist, one per dist: the slots of one dist's calls depend only on that dist's history).

    Args:
        world: Ranks of the dist's group.
        chunks: Rounds a slotted call is sent in (``exchange_chunks.chunk_count``): None
            decides by the exchange's size, 0 never chunks, ``k`` pins ``k`` rounds (at most
            one per peer).
    """

    world: int
    chunks: int | None = None
    _kinds: dict[SlotKey, _PairSizes] = field(default_factory=dict)

    def _of(self, key: SlotKey) -> _PairSizes:
        k = self._kinds.get(key)
        if k is None:
            n = self.world
            k = self._kinds[key] = _PairSizes(
                [0] * n, [0] * n, [START_SHIFT] * n, [START_SHIFT] * n, [0] * n, [0] * n
            )
        return k

    def launch(
        self, key: SlotKey, send: Sequence[PairShape], recv: Sequence[PairShape]
    ) -> SlotCall:
        """Counts a call launched and sizes its slots, if it may take the one-round path.

        Args:
            key: The call's kind.
            send: Per destination, its pair's shape (:data:`PairShape`).
            recv: Per source, its pair's shape.

        Returns:
            The call: with slots when the kind has a received call and none in flight.
        """
        k = self._of(key)
        ready = k.done > 0 and k.in_flight == 0
        k.in_flight += 1
        fixed = [[0 if sh is None else sh[0] for sh in side] for side in (send, recv)]
        if not ready:
            return SlotCall(key, fixed[0], fixed[1])
        sides = ((send, k.sent, k.send_shift), (recv, k.received, k.recv_shift))
        caps = [
            [
                0 if sh is None else HEADER + sh[0] + (capacity(last[p], shift[p]) if sh[1] else 0)
                for p, sh in enumerate(side)
            ]
            for side, last, shift in sides
        ]
        return SlotCall(key, fixed[0], fixed[1], caps[0], caps[1])

    def sent(self, call: SlotCall, sizes: Sequence[int]) -> None:
        """Records the payload sizes a call sent (at its launch).

        Args:
            call: The call.
            sizes: Payload bytes to each destination.
        """
        k = self._of(call.key)
        _record(k.sent, k.send_shift, k.send_calm, sizes, call.send_fixed, call.send_caps)

    def received(self, call: SlotCall, sizes: Sequence[int]) -> None:
        """Records the payload sizes a call received, and that it was received.

        Args:
            call: The call.
            sizes: Payload bytes from each source.
        """
        k = self._of(call.key)
        _record(k.received, k.recv_shift, k.recv_calm, sizes, call.recv_fixed, call.recv_caps)
        k.in_flight -= 1
        k.done += 1


def _record(
    last: list[int],
    shift: list[int],
    calm: list[int],
    sizes: Sequence[int],
    fixed: Sequence[int],
    caps: Sequence[int] | None,
) -> None:
    """Stores each pair's coded bytes; a pair whose payload overflowed its slot gets more
    headroom, one that stayed in its slots :data:`CALM_CALLS` calls in a row gets less back
    (the same on both sides: both know the sizes and the slots)."""
    for p, n in enumerate(sizes):
        if caps is not None and caps[p]:
            if n > caps[p] - HEADER:
                shift[p], calm[p] = max(shift[p] - 1, 0), 0
            elif shift[p] < START_SHIFT:
                calm[p] += 1
                if calm[p] >= CALM_CALLS:
                    shift[p], calm[p] = shift[p] + 1, 0
        last[p] = max(int(n) - fixed[p], 0)


@dataclass(frozen=True)
class Slotted:
    """A call's send buffer in slots.

    Attributes:
        send: uint8, the slots back to back.
        overflow: (destination, the payload's bytes past its slot) of each overflowing pair.
    """

    send: torch.Tensor
    overflow: list[tuple[int, torch.Tensor]]


def fill_slots(payloads: Sequence[torch.Tensor], caps: Sequence[int], tag: int) -> Slotted:
    """Writes each payload into its slot: header (size, ``tag``), bytes, zeroed slack.

    Args:
        payloads: uint8 payload per destination (host tensors).
        caps: Slot bytes per destination (0: the payload must be empty).
        tag: The point-to-point tag an overflow travels with (the receiver reads it here).

    Returns:
        The slots, and the overflowing payloads' remainders.
    """
    send = torch.empty(sum(caps), dtype=torch.uint8)
    overflow: list[tuple[int, torch.Tensor]] = []
    at = 0
    for p, (payload, cap) in enumerate(zip(payloads, caps, strict=True)):
        n = payload.numel()
        if not cap:
            assert not n, f"a {n}-byte payload to rank {p}, which has no slot"
            continue
        room = cap - HEADER
        send[at : at + HEADER].view(torch.int64).copy_(torch.tensor([n, tag]))
        head = min(n, room)
        send[at + HEADER : at + HEADER + head] = payload[:head]
        send[at + HEADER + head : at + cap] = 0  # slack only: the bytes are deterministic
        if n > room:
            overflow.append((p, payload[room:]))
        at += cap
    return Slotted(send, overflow)


def open_slot(
    slot: torch.Tensor,
    source: int,
    pg: dist.ProcessGroup,
    direction: Direction,
    my_rank: int,
    tables: Sequence[str],
) -> tuple[list[torch.Tensor], dist.Work | None]:
    """One received slot's payload: its header read and checked, the part in the slot, and the
    receive of its overflow posted (the tag from the header) if the payload did not fit.

    Args:
        slot: The slot's bytes (host, uint8).
        source: The rank that sent it.
        pg: The group (the overflow's receive).
        direction: ``"fwd"`` or ``"bwd"`` (named in an error).
        my_rank: This rank (named in an error).
        tables: The tables of the source's blocks (named in an error).

    Returns:
        The payload's pieces (the slot's part, then the overflow's buffer), and the overflow's
        receive to wait on before reading the last piece (None: no overflow).

    Raises:
        LossyAllToAllError: The header is not a payload's (corrupted in transit).
    """
    n, tag = (int(v) for v in slot[:HEADER].numpy().view(np.int64))
    if n < 0 or n > 1 << 40 or not 0 <= tag <= MAX_TAG:
        names = ", ".join(sorted(set(tables))) or "none"
        raise LossyAllToAllError(
            f"lossy all-to-all ({direction}) on rank {my_rank}: the slot from rank {source} "
            f"(tables: {names}) has header (size {n}, tag {tag}): not a payload's. The "
            "bytes were corrupted in transit or the ranks run different torchrec_lossy "
            "versions."
        )
    head = min(n, slot.numel() - HEADER)
    pieces = [slot[HEADER : HEADER + head]]
    if n <= head:
        return pieces, None
    rest = torch.empty(n - head, dtype=torch.uint8)
    pieces.append(rest)
    return pieces, dist.irecv(rest, group=pg, tag=tag, group_src=source)


def post_slots(
    direction: Direction,
    payloads: Sequence[torch.Tensor],
    send_caps: Sequence[int],
    recv_caps: Sequence[int],
    tag: int,
    pg: dist.ProcessGroup,
) -> tuple[torch.Tensor, dist.Work, list[tuple[dist.Work, torch.Tensor]]]:
    """Posts one all-to-all of slots (:func:`fill_slots`) and the overflows' sends.

    Args:
        direction: ``"fwd"`` or ``"bwd"`` (the profiler range's name).
        payloads: uint8 payload per destination (host tensors).
        send_caps: Slot bytes to each destination.
        recv_caps: Slot bytes from each source.
        tag: The overflows' point-to-point tag.
        pg: The group.

    Returns:
        The receive buffer, the all-to-all's work, and (work, bytes) of each overflow send.
    """
    slotted = fill_slots(payloads, send_caps, tag)
    recv = torch.empty(sum(recv_caps), dtype=torch.uint8)
    with profile_range(f"## lossy_a2a {direction} slots ##"):
        work = dist.all_to_all_single(
            recv, slotted.send, list(recv_caps), list(send_caps), group=pg, async_op=True
        )
        sends = [
            (dist.isend(rest, group=pg, tag=tag, group_dst=p), rest) for p, rest in slotted.overflow
        ]
    return recv, work, sends


def receive_slots(
    direction: Direction,
    recv: torch.Tensor,
    caps: Sequence[int],
    pg: dist.ProcessGroup,
    my_rank: int,
    tables_per_source: Sequence[Sequence[str]],
) -> dict[int, list[torch.Tensor]]:
    """Opens every slot of a received buffer (:func:`open_slot`) and waits for the overflows.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        recv: The received slots, back to back.
        caps: Slot bytes from each source (0: none).
        pg: The group.
        my_rank: This rank.
        tables_per_source: Per source, its blocks' tables (named in an error).

    Returns:
        Per source with a slot, its payload's pieces.

    Raises:
        LossyAllToAllError: A slot's header is not a payload's.
    """
    at = list(itertools.accumulate(caps, initial=0))
    opened = {
        p: open_slot(recv[at[p] : at[p + 1]], p, pg, direction, my_rank, tables_per_source[p])
        for p, cap in enumerate(caps)
        if cap
    }
    with profile_range(f"## lossy_a2a {direction} overflow ##"):
        for _, rest in opened.values():
            if rest is not None:
                rest.wait()
    return {p: pieces for p, (pieces, _) in opened.items()}


def count_slot_bytes(
    sizes: Sequence[int],
    caps: Sequence[int],
    same_host: frozenset[int],
    telemetry: ExchangeRecord,
) -> None:
    """Counts a slotted call's wire bytes: each slot (header and slack included), or its
    header and the whole payload where it overflowed; the bytes past the payloads go to the
    container pseudo-table, so that the direction's total stays the bytes handed to the
    collectives.

    Args:
        sizes: Payload bytes to each destination.
        caps: Slot bytes to each destination.
        same_host: The destinations on this rank's host.
        telemetry: The call's record (its blocks already recorded by the encode).
    """
    wire = [max(cap, n + HEADER) if cap else 0 for n, cap in zip(sizes, caps, strict=True)]
    same = sum(wire[p] for p in same_host if p < len(wire))
    telemetry.links = (same, sum(wire) - same)
    assert telemetry.blocks is not None
    telemetry.blocks.container = (telemetry.blocks.container or 0) + sum(wire) - sum(sizes)


__all__ = [
    "HEADER",
    "PairShape",
    "SlotCall",
    "SlotHistory",
    "SlotKey",
    "Slotted",
    "capacity",
    "count_slot_bytes",
    "fill_slots",
    "open_slot",
    "post_slots",
    "receive_slots",
]
