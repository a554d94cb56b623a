"""The one exchange path of the compressed all-to-alls, and the wire codecs blocks travel in.

Every pooled, sequence, row-wise and gradient all-to-all sends its blocks with :func:`exchange`
and gets them back with :func:`receive`; the request carries the call's :class:`Geometry`
(which blocks go where, with how many rows) and wire codec from the one to the other. Wire
codecs: :class:`LossyWire` (the error-bounded codec: the sizes and skeletons are exchanged, then
the payloads; :mod:`.pooled_payload` encodes, :mod:`.pooled_decode` decodes) and
:class:`CastWire` (fp16 / bf16 casts, or exact: the blocks' elements back to back). A new wire
codec is a class here with ``send`` and ``receive``, picked in :func:`wire_for`. Device path:
ONE host sync per lossy all-to-all and direction, the size exchange's read, which also finishes
the encode and carries the earlier decodes' unread status (docs/kernels.md, "Syncs per
all-to-all").
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import Request

from torchrec_lossy.codec.pipeline import on_device
from torchrec_lossy.config import LossyCommsConfig
from torchrec_lossy.distributed.call_ledger import CallRecord, read_checked
from torchrec_lossy.distributed.exchange_chunks import (
    ChunkedCall,
    chunk_count,
    receive_chunked,
    send_chunked,
)
from torchrec_lossy.distributed.exchange_record import BlockRecords, ExchangeRecord
from torchrec_lossy.distributed.exchange_slots import (
    PairShape,
    SlotCall,
    SlotKey,
    count_slot_bytes,
    post_slots,
    receive_slots,
)
from torchrec_lossy.distributed.pooled_blocks import (
    BlockSpec,
    LossyAll2AllPooledInfo,
    size_entry_words,
)
from torchrec_lossy.distributed.pooled_decode import DeferredDecode, decode_call
from torchrec_lossy.distributed.pooled_payload import (
    PendingPayloads,
    padded_size,
    start_call_encoder,
    start_encode,
)
from torchrec_lossy.distributed.stats import Direction
from torchrec_lossy.profile_range import profile_range

_CAST_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


def wire_dtype_of(backward: str, dtype: torch.dtype) -> torch.dtype:
    """The gradient's wire dtype without codec: ``backward`` "fp16"/"bf16" casts, "none" keeps.

    Args:
        backward: ``LossyCommsConfig.backward`` (not "lossy").
        dtype: The gradient's dtype.

    Returns:
        The dtype the gradient travels in.
    """
    return _CAST_DTYPES.get(backward, dtype)


@dataclass(frozen=True)
class Geometry:
    """Which blocks one exchange moves (built by the caller's pure block-geometry functions).

    Attributes:
        send_specs: Per destination, the specs of the blocks this rank sends it.
        recv_specs: Per source, the specs of the blocks it sends this rank.
        recv_rows: Per source, the rows of each of those blocks.
        full_rows: Per destination, per block sent, the rows TorchRec's all-to-all would send
            (telemetry: against the rows sent, which dedupe makes fewer).
    """

    send_specs: Sequence[Sequence[BlockSpec]]
    recv_specs: Sequence[Sequence[BlockSpec]]
    recv_rows: Sequence[Sequence[int]]
    full_rows: Sequence[Sequence[int]]


class LossyRequest(Request[torch.Tensor]):
    """TorchRec's Request plus the state of the exchange in flight (the call's awaitable)."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(pg, device)
        self.wire: WireCodec | None = None  # the exchange in flight's wire codec
        self.geometry: Geometry | None = None  # and its blocks
        self.recv_sizes: list[int] | None = None  # bytes from each peer (lossy wire)
        # The blocks this rank sends itself: exact, never encoded, never on the wire.
        self.self_blocks: list[torch.Tensor] | None = None
        # Each peer's codec payload skeleton, received in the size exchange.
        self.recv_skeletons: dict[int, np.ndarray] | None = None
        # The record of the exchange in flight (drawn when it encodes).
        self.record: CallRecord | None = None
        # The latest device decode's status, unread (the module's ledger lists it too).
        self.decode_status: DeferredDecode | None = None
        # The telemetry of the exchange in flight, written once by receive().
        self.telemetry: ExchangeRecord | None = None
        # The exchange in flight in its dist's slot history, with its slots when it took the
        # one-round path (exchange_slots); None: no history kept.
        self.slot_call: SlotCall | None = None
        # Its overflow sends in flight: (work, the bytes it sends).
        self.overflow_sends: list[tuple[dist.Work, torch.Tensor]] = []
        # Its rounds in flight when it was sent in chunks (exchange_chunks).
        self.chunked: ChunkedCall | None = None

    def take_received(self) -> torch.Tensor:
        """Waits for the exchange in flight and releases what it received.

        Returns:
            The received tensor (payload bytes, or the cast blocks).
        """
        assert self.req is not None, "the lossy all-to-all was waited on before it was launched"
        self.req.wait()
        recv, self.req, self.tensor = self.tensor, None, None
        assert recv is not None
        return recv


class WireCodec(Protocol):
    """How blocks cross the wire: one sends every peer its blocks, the other gets them back."""

    def send(
        self,
        direction: Direction,
        blocks: list[list[torch.Tensor]],
        geometry: Geometry,
        info: LossyAll2AllPooledInfo,
        myreq: LossyRequest,
        device: torch.device,
        my_rank: int,
        telemetry: ExchangeRecord,
    ) -> tuple[torch.Tensor, dist.Work]:
        """Sends ``blocks`` (per destination, per its spec), asynchronously.

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            blocks: Per destination, the blocks this rank sends it.
            geometry: The exchange's blocks.
            info: Layout, compress flags and comms state.
            myreq: The request (keeps what the receive needs).
            device: Device of the blocks (and of the receive buffer).
            my_rank: This rank.
            telemetry: The call's record: the wire adds its bytes, errors and seconds (it
                writes no telemetry itself).

        Returns:
            (the receive buffer, the exchange's work).
        """
        ...

    def receive(
        self,
        direction: Direction,
        recv: torch.Tensor,
        geometry: Geometry,
        info: LossyAll2AllPooledInfo,
        myreq: LossyRequest,
        my_rank: int,
        telemetry: ExchangeRecord,
    ) -> list[list[torch.Tensor]]:
        """The blocks :meth:`send` delivered (arguments as its, with the received buffer; the
        decode's seconds go to ``telemetry``).

        Returns:
            Per source, per its spec, a ``[rows, dim]`` block.
        """
        ...


def exchange(
    direction: Direction,
    blocks: list[list[torch.Tensor]],
    geometry: Geometry,
    wire: WireCodec,
    info: LossyAll2AllPooledInfo,
    myreq: LossyRequest,
    device: torch.device,
    my_rank: int,
) -> tuple[torch.Tensor, dist.Work]:
    """Sends every peer its blocks through ``wire``: the one send of every all-to-all.

    Starts the call's telemetry (:class:`.exchange_record.ExchangeRecord`, kept on ``myreq``):
    the rows of every block to a peer here, the bytes, errors and seconds by the wire; it is
    written once, by :func:`receive`.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        blocks: Per destination, the blocks this rank sends it (one per spec).
        geometry: The exchange's blocks (kept on the request for :func:`receive`).
        wire: The wire codec (kept on the request).
        info: Layout, compress flags and comms state.
        myreq: The request of the call.
        device: Device of the blocks.
        my_rank: This rank.

    Returns:
        (the receive buffer, the exchange's work).
    """
    myreq.wire, myreq.geometry = wire, geometry
    myreq.telemetry = telemetry = ExchangeRecord(direction)
    for p, (bs, specs, full) in enumerate(
        zip(blocks, geometry.send_specs, geometry.full_rows, strict=True)
    ):
        if p != my_rank:
            telemetry.rows += [
                (s.table, n, b.shape[0]) for b, s, n in zip(bs, specs, full, strict=True)
            ]
    return wire.send(direction, blocks, geometry, info, myreq, device, my_rank, telemetry)


def receive(
    direction: Direction,
    recv: torch.Tensor,
    info: LossyAll2AllPooledInfo,
    myreq: LossyRequest,
    my_rank: int,
) -> list[list[torch.Tensor]]:
    """The blocks of the exchange :func:`exchange` started on ``myreq``; writes the call's
    telemetry to the module's stats, once.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        recv: The received buffer.
        info: Layout, compress flags and comms state.
        myreq: The request (its wire codec and geometry are taken).
        my_rank: This rank.

    Returns:
        Per source, per its spec, a ``[rows, dim]`` block.
    """
    wire, geometry, telemetry = myreq.wire, myreq.geometry, myreq.telemetry
    assert wire is not None and geometry is not None and telemetry is not None, (
        "receive of an exchange never started"
    )
    myreq.wire = myreq.geometry = myreq.telemetry = None
    blocks = wire.receive(direction, recv, geometry, info, myreq, my_rank, telemetry)
    telemetry.write(info.comms.stats)
    return blocks


def wire_for(
    direction: Direction, config: LossyCommsConfig, dtype: torch.dtype, tag: str
) -> WireCodec:
    """The wire codec of a direction: the codec forward; ``config.backward``'s backward.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        config: The comms config.
        dtype: The blocks' dtype.
        tag: The profiler label's prefix of a cast wire (``lossy_a2a`` or ``lossy_seq_a2a``).

    Returns:
        The wire codec.
    """
    if direction == "fwd" or config.backward == "lossy":
        return LOSSY_WIRE
    return CastWire(wire_dtype_of(config.backward, dtype), config.backward != "none", tag)


@dataclass(frozen=True)
class LossyWire:
    """The error-bounded codec: a size exchange (sizes and skeletons), then the payloads."""

    def send(
        self,
        direction: Direction,
        blocks: list[list[torch.Tensor]],
        geometry: Geometry,
        info: LossyAll2AllPooledInfo,
        myreq: LossyRequest,
        device: torch.device,
        my_rank: int,
        telemetry: ExchangeRecord,
    ) -> tuple[torch.Tensor, dist.Work]:
        """Encodes every peer's blocks (the self blocks stay in the request: exact, off the
        wire), exchanges the sizes and skeletons, then the payloads (see
        :meth:`WireCodec.send`)."""
        exact = direction == "fwd" and info.exact_forward
        myreq.record = record = info.ledger.start(direction, exact)
        myreq.self_blocks = blocks[my_rank]
        call = _launch_slots(direction, exact, blocks, geometry, info, device, my_rank)
        myreq.slot_call = call
        slotted = call is not None and call.send_caps is not None
        if slotted and (chunks := _chunks(info, len(blocks), my_rank)):
            assert call is not None
            encoder = start_call_encoder(
                direction, blocks, geometry.send_specs, info, device, my_rank, record, telemetry
            )
            chunked = send_chunked(direction, encoder, call, chunks, info, myreq.pg, telemetry)
            myreq.chunked, myreq.recv_sizes = chunked, call.recv_caps
            # The first round stands for the call: the receive waits on every round in turn.
            return chunked.rounds[0].recv, chunked.rounds[0].work
        pending = start_encode(
            direction, blocks, geometry.send_specs, info, device, my_rank, record, telemetry
        )
        if slotted:
            assert call is not None
            return _slot_payloads(direction, pending, call, myreq, info, telemetry)
        meta_splits = [
            size_entry_words(specs, info, p, my_rank) for p, specs in enumerate(geometry.recv_specs)
        ]
        return _size_then_payloads(direction, pending, meta_splits, myreq, info)

    def receive(
        self,
        direction: Direction,
        recv: torch.Tensor,
        geometry: Geometry,
        info: LossyAll2AllPooledInfo,
        myreq: LossyRequest,
        my_rank: int,
        telemetry: ExchangeRecord,
    ) -> list[list[torch.Tensor]]:
        """Decodes every peer's payload, the self blocks taken from the request, the
        skeletons from its size exchange; a device decode's unread status goes to the request
        and the module's ledger (see :meth:`WireCodec.receive`)."""
        assert myreq.recv_sizes is not None, "decode of a lossy exchange that sent no payloads"
        self_blocks, myreq.self_blocks = myreq.self_blocks, None
        assert self_blocks is not None, "the lossy exchange lost its self blocks"
        skeletons, myreq.recv_skeletons = myreq.recv_skeletons, None
        call, myreq.slot_call = myreq.slot_call, None
        chunked, myreq.chunked = myreq.chunked, None
        if chunked is not None:
            assert call is not None and info.slots is not None
            blocks, sizes = receive_chunked(
                direction, chunked, geometry.recv_specs, geometry.recv_rows, info, myreq.pg,
                my_rank, self_blocks, myreq.record, telemetry,
            )  # fmt: skip
            info.slots.received(call, sizes)
            return blocks
        recv_sizes = myreq.recv_sizes
        if call is not None and call.recv_caps is not None:
            recv, recv_sizes = _unslot(direction, recv, call.recv_caps, myreq, geometry, my_rank)
        if call is not None:
            assert info.slots is not None
            info.slots.received(call, recv_sizes)
        blocks, status = decode_call(
            direction, recv, recv_sizes, geometry.recv_specs, geometry.recv_rows, info,
            my_rank, self_blocks, skeletons, myreq.record, telemetry=telemetry,
        )  # fmt: skip
        if status is not None:  # owned by this call; the next host read of the module reads it
            myreq.decode_status = status
            info.ledger.owe_status(status)
        return blocks


LOSSY_WIRE = LossyWire()


def _size_then_payloads(
    direction: Direction,
    pending: PendingPayloads,
    recv_meta_splits: list[int],
    myreq: LossyRequest,
    info: LossyAll2AllPooledInfo,
) -> tuple[torch.Tensor, dist.Work]:
    """Phase 1 (sizes, blocking) and phase 2 (payloads, async) of the variable all-to-all.

    Each peer gets its payload size and its codec payload's skeleton, from the device tensor the
    encoder left; the received entries, the encoder's pending values and the status of the
    device decodes still unread (``info.ledger``) are then read in ONE device-to-host copy
    (the exchange's only host sync, ``read_checked``), after which the payloads exist and are
    sent. The received sizes and skeletons go to ``myreq`` (the decode then reads nothing back).

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        pending: From ``start_encode``.
        recv_meta_splits: Words expected from each peer (``size_entry_words``).
        myreq: The request (its group; receives the sizes and skeletons).
        info: The call's parameters (its ledger's unread decode statuses are read here).

    Returns:
        (received bytes, the payload exchange's work).
    """
    pg, device = myreq.pg, pending.meta.device
    recv_meta = torch.empty(sum(recv_meta_splits), dtype=torch.int64, device=device)
    with profile_range(f"## lossy_a2a {direction} sizes ##"):
        dist.all_to_all_single(
            recv_meta, pending.meta, recv_meta_splits, pending.meta_splits, group=pg,
            async_op=True,
        ).wait()  # fmt: skip
        k = pending.readback.numel()
        # The unread decode status of earlier all-to-alls rides this read too.
        host = read_checked(info.ledger, torch.cat([pending.readback, recv_meta]))
    payloads = pending.finish(host[:k].tolist())
    at = list(itertools.accumulate(recv_meta_splits, initial=0))
    myreq.recv_sizes = recv_sizes = [int(host[k + a]) for a in at[:-1]]
    myreq.recv_skeletons = {
        p: host[k + at[p] + 1 : k + at[p + 1]].astype(np.uint32)
        for p in range(len(recv_meta_splits))
        if recv_meta_splits[p] > 1
    }
    send_sizes = [int(p.numel()) for p in payloads]
    if myreq.slot_call is not None:
        assert info.slots is not None
        info.slots.sent(myreq.slot_call, send_sizes)
    send = torch.cat([p.to(device) for p in payloads])
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    with profile_range(f"## lossy_a2a {direction} payload ##"):
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg, async_op=True)
    return recv, work


def _chunks(info: LossyAll2AllPooledInfo, world: int, my_rank: int) -> int:
    """Rounds a slotted call of ``info`` is sent in (:func:`.exchange_chunks.chunk_count`),
    from what every rank knows alike: the dist's pin, the group and its hosts, every rank's
    batch and the layout's columns."""
    assert info.slots is not None
    nominal = sum(info.batch_size_per_rank) * sum(info.dim_sum_per_rank) * info.dtype.itemsize
    spans_hosts = any(p != my_rank and p not in info.same_host for p in range(world))
    return chunk_count(info.slots.chunks, world, nominal // world, spans_hosts)


def _launch_slots(
    direction: Direction,
    exact: bool,
    blocks: list[list[torch.Tensor]],
    geometry: Geometry,
    info: LossyAll2AllPooledInfo,
    device: torch.device,
    my_rank: int,
) -> SlotCall | None:
    """Counts the call in its dist's slot history, its slots sized if it may take the one-round
    path.

    The compiled host path only (CPU tensors, the host codec): a device-path exchange (CUDA,
    or the ``"triton"`` / ``"reference"`` backends on any device) keeps the size exchange, whose
    one host read also finishes the encode and brings the skeletons (a slot's header would cost
    the receiver reads of its own).

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        exact: The call travels lossless.
        blocks: Per destination, the blocks this rank sends it (their raw bytes are known).
        geometry: The exchange's blocks and the rows each source sends.
        info: The call's parameters (its dist's ``slots``, compress flags, raw peers).
        device: Device of the blocks.
        my_rank: This rank (its own blocks are not on the wire).

    Returns:
        The call (its slots None for the two-round path), or None where no history is kept.
    """
    slots = info.slots
    if slots is None or device.type != "cpu" or on_device(device, info.comms.config.codec.backend):
        return None
    itemsize = info.dtype.itemsize

    def shape(p: int, specs: Sequence[BlockSpec], nbytes: Sequence[int]) -> PairShape:
        if p == my_rank or not specs:
            return None
        # Blocks of cast tables vary in size (cast or exact) like the codec's payload.
        varies = [info.codes(p, s.table) or info.cast_dtype(p, s.table) is not None for s in specs]
        raw = sum(padded_size(n) for n, v in zip(nbytes, varies, strict=True) if not v)
        return raw, any(varies)

    send = [
        shape(p, specs, [b.numel() * b.element_size() for b in bs])
        for p, (specs, bs) in enumerate(zip(geometry.send_specs, blocks, strict=True))
    ]
    recv = [
        shape(p, specs, [r * s.dim * itemsize for r, s in zip(rows, specs, strict=True)])
        for p, (specs, rows) in enumerate(zip(geometry.recv_specs, geometry.recv_rows, strict=True))
    ]
    key = SlotKey(direction, exact, frozenset(t for t, c in info.compress.items() if c))
    return slots.launch(key, send, recv)


def _slot_payloads(
    direction: Direction,
    pending: PendingPayloads,
    call: SlotCall,
    myreq: LossyRequest,
    info: LossyAll2AllPooledInfo,
    telemetry: ExchangeRecord,
) -> tuple[torch.Tensor, dist.Work]:
    """The one-round exchange: every payload in its pair's slot, one all-to-all; a payload
    past its slot sends the rest point-to-point to that peer alone (its tag in the header).

    The wire bytes counted are the slots (header and slack included) plus the overflows: the
    bytes past the payloads go to the container pseudo-table, so the direction's total stays
    the bytes handed to the collectives.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        pending: From ``start_encode`` (host path: nothing to read back).
        call: The call, with its slots.
        myreq: The request (its group; keeps the overflow sends).
        info: The call's parameters (its ledger, its dist's slot history).
        telemetry: The call's record (links and container bytes).

    Returns:
        (the received slots, the all-to-all's work).
    """
    host = read_checked(info.ledger, pending.readback)  # host path: nothing pending, no read
    payloads = pending.finish(host.tolist())
    sizes = [int(p.numel()) for p in payloads]
    assert info.slots is not None
    info.slots.sent(call, sizes)
    send_caps, recv_caps = call.send_caps, call.recv_caps
    assert send_caps is not None and recv_caps is not None
    tag = info.ledger.overflow_tag()
    recv, work, myreq.overflow_sends = post_slots(
        direction, payloads, send_caps, recv_caps, tag, myreq.pg
    )
    count_slot_bytes(sizes, send_caps, info.same_host, telemetry)
    myreq.recv_sizes = recv_caps
    return recv, work


def _unslot(
    direction: Direction,
    recv: torch.Tensor,
    caps: Sequence[int],
    myreq: LossyRequest,
    geometry: Geometry,
    my_rank: int,
) -> tuple[torch.Tensor, list[int]]:
    """The payloads of received slots, back to back: each slot's header read, each overflow
    received from its source, the call's own overflow sends waited on.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        recv: The received slots.
        caps: Slot bytes from each source.
        myreq: The request (its group and overflow sends).
        geometry: The exchange's blocks (named in an error).
        my_rank: This rank.

    Returns:
        (the payloads in rank order, bytes from each source).

    Raises:
        LossyAllToAllError: A slot's header is not a payload's (corrupted in transit).
    """
    tables = [[s.table for s in specs] for specs in geometry.recv_specs]
    pieces = receive_slots(direction, recv, caps, myreq.pg, my_rank, tables)
    with profile_range(f"## lossy_a2a {direction} overflow ##"):
        sends, myreq.overflow_sends = myreq.overflow_sends, []
        for w, _ in sends:
            w.wait()
    sizes = [sum(t.numel() for t in pieces[p]) if p in pieces else 0 for p in range(len(caps))]
    flat = [t for p in sorted(pieces) for t in pieces[p]]
    payloads = flat[0] if len(flat) == 1 else torch.cat(flat) if flat else recv[:0]
    return payloads, sizes


@dataclass(frozen=True)
class CastWire:
    """The blocks' elements back to back in one dtype: a cast (fp16 / bf16) or exact.

    Attributes:
        dtype: The wire dtype.
        cast: Whether the config asks for a cast (its error is recorded, 0 where the blocks
            have the wire dtype already).
        tag: The profiler label's prefix (``lossy_a2a`` or ``lossy_seq_a2a``).
    """

    dtype: torch.dtype
    cast: bool
    tag: str

    def send(
        self,
        direction: Direction,
        blocks: list[list[torch.Tensor]],
        geometry: Geometry,
        info: LossyAll2AllPooledInfo,
        myreq: LossyRequest,
        device: torch.device,
        my_rank: int,
        telemetry: ExchangeRecord,
    ) -> tuple[torch.Tensor, dist.Work]:
        """Casts and sends every peer its blocks in one all-to-all (see
        :meth:`WireCodec.send`)."""
        start = time.perf_counter()
        with profile_range(f"## {self.tag} {direction} encode ##"):
            flat = [b.reshape(-1) for bs in blocks for b in bs]
            send = torch.cat(flat).to(self.dtype) if flat else torch.empty(0, dtype=self.dtype)
            send = send.to(device)
        wire_elem = send.element_size()
        rec = BlockRecords()
        for bs, specs in zip(blocks, geometry.send_specs, strict=True):
            for b, s in zip(bs, specs, strict=True):
                # Raw: the rows sent (under dedupe rows / rows_sent scale it to TorchRec's).
                rec.tables.append(s.table)
                rec.raw_bytes.append(b.numel() * b.element_size())
                rec.wire_bytes.append(b.numel() * wire_elem)
                rec.errors.append(0.0)  # a cast's error is read later, without a sync
                rec.abs_bounds.append(0.0)
                if self.cast and b.numel():
                    err = (b - b.to(self.dtype).to(b.dtype)).abs().amax()
                    telemetry.lazy_errors.append((s.table, err))
        telemetry.blocks, telemetry.encode_s = rec, time.perf_counter() - start
        send_sizes = [sum(b.numel() for b in bs) for bs in blocks]
        recv_sizes = [
            sum(r * s.dim for r, s in zip(rows, specs, strict=True))
            for rows, specs in zip(geometry.recv_rows, geometry.recv_specs, strict=True)
        ]
        recv = torch.empty(sum(recv_sizes), dtype=self.dtype, device=device)
        with profile_range(f"## {self.tag} {direction} payload ##"):
            work = dist.all_to_all_single(
                recv, send, recv_sizes, send_sizes, group=myreq.pg, async_op=True
            )
        return recv, work

    def receive(
        self,
        direction: Direction,
        recv: torch.Tensor,
        geometry: Geometry,
        info: LossyAll2AllPooledInfo,
        myreq: LossyRequest,
        my_rank: int,
        telemetry: ExchangeRecord,
    ) -> list[list[torch.Tensor]]:
        """Splits the received elements into blocks, cast back (see
        :meth:`WireCodec.receive`)."""
        start = time.perf_counter()
        pairs = [
            list(zip(rows, specs, strict=True))
            for rows, specs in zip(geometry.recv_rows, geometry.recv_specs, strict=True)
        ]
        with profile_range(f"## {self.tag} {direction} decode ##"):
            it = iter(recv.to(info.dtype).split([r * s.dim for ps in pairs for r, s in ps]))
            blocks = [[next(it).view(r, s.dim) for r, s in ps] for ps in pairs]
        shares: dict[str, int] = {}
        for ps in pairs:
            for r, s in ps:
                shares[s.table] = shares.get(s.table, 0) + r * s.dim * recv.element_size()
        telemetry.decode_shares, telemetry.decode_s = shares, time.perf_counter() - start
        return blocks
