"""The one-round slot exchange in chunks: coding overlapped with the wire (host path).

An unchunked slotted call (:mod:`.exchange_slots`) encodes every destination, then sends every
slot in one all-to-all, then, once the whole all-to-all has arrived, decodes every source: the
encode, the wire and the decode follow each other. Chunked, the peers are taken in a ring of
rounds: in round ``j`` rank ``r`` sends to ``r + k`` and receives from ``r - k`` for the offsets
``k`` of the round (one offset per round by default, every peer's own all-to-all; the farthest
offsets first, which cross hosts most). A round's
destinations are encoded, their slots posted as an asynchronous all-to-all at once, and the
next round's encode runs while that one travels; the receive waits on the rounds in order and
decodes each round's sources while the later rounds are still on the wire. Each destination's
payload is the one the unchunked call sends it (``pooled_payload.CallEncoder``: the call's
bounds asked once, its blocks shown to the bound provider in the unchunked order), each slot
is sized and filled the same, an overflow goes point-to-point the same: what is decoded is bit
for bit the unchunked call's.

With ``LossyCommsConfig.overlap`` ``"auto"`` (default ``"never"``), when it pays
(:func:`chunk_count`, the same on every rank, since a chunked and an unchunked
rank would make different collectives): the group spans hosts (on one host there is no wire to
hide under, only the CPU the ranks share: chunks measured slower there), at least two peers, and
the exchange's nominal bytes per rank (every rank's batch times the layout's columns, raw) at
least :data:`OVERLAP_MIN_BYTES`. ``SlotHistory.chunks`` pins it per dist (even one round takes this
path then: the tests' control at two ranks). The device path keeps the size round (no slots,
so no chunks); a CUDA version would post each round on its own stream, the next round's encode
queued behind it on the compute stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchrec_lossy.distributed.call_ledger import CallRecord
from torchrec_lossy.distributed.exchange_record import ExchangeRecord
from torchrec_lossy.distributed.exchange_slots import (
    SlotCall,
    count_slot_bytes,
    post_slots,
    receive_slots,
)
from torchrec_lossy.distributed.pooled_blocks import BlockSpec, LossyAll2AllPooledInfo
from torchrec_lossy.distributed.pooled_decode import decode_call
from torchrec_lossy.distributed.pooled_payload import CallEncoder
from torchrec_lossy.distributed.stats import Direction
from torchrec_lossy.profile_range import profile_range

# Below this many nominal bytes per rank the rounds' fixed cost outweighs the coding they hide
# (benchmarks/overlap_bench.py; docs/benchmarks.md, issue 34).
OVERLAP_MIN_BYTES = 1 << 18


def chunk_count(pinned: int | None, world: int, nominal_bytes: int, spans_hosts: bool) -> int:
    """How many rounds a slotted call is sent in (0: unchunked, one all-to-all).

    Args:
        pinned: ``SlotHistory.chunks``: None decides by the rule, 0 never chunks, ``k`` sends
            in ``min(k, world - 1)`` rounds.
        world: Ranks of the group.
        nominal_bytes: The exchange's raw bytes per rank, from what every rank knows alike.
        spans_hosts: The group has ranks on more than one host (every rank then has a peer on
            another host: the same answer everywhere).

    Returns:
        Rounds, or 0.
    """
    peers = world - 1
    if pinned is not None:
        return min(pinned, peers)
    pays = spans_hosts and peers >= 2 and nominal_bytes >= OVERLAP_MIN_BYTES
    return peers if pays else 0


def ring_rounds(world: int, my_rank: int, chunks: int) -> list[tuple[list[int], list[int]]]:
    """Each round's destinations and sources: the offsets ``1 .. world - 1``, farthest first
    (nearest ``world / 2``: with a host's ranks consecutive, the offsets whose pairs cross hosts
    most, the slowest wire, start first), in ``chunks`` groups; offset ``k`` sends to
    ``my_rank + k`` and receives from ``my_rank - k`` (so a round's sends and receives pair up
    on every rank).

    Args:
        world: Ranks of the group.
        my_rank: This rank.
        chunks: Rounds.

    Returns:
        Per round, (destinations, sources), each in rank order.
    """
    offsets = sorted(range(1, world), key=lambda k: (abs(2 * k - world), k))
    cuts = [len(offsets) * j // chunks for j in range(chunks + 1)]
    return [
        (
            sorted((my_rank + k) % world for k in offsets[a:b]),
            sorted((my_rank - k) % world for k in offsets[a:b]),
        )
        for a, b in itertools.pairwise(cuts)
    ]


@dataclass
class ChunkRound:
    """One round in flight.

    Attributes:
        work: Its all-to-all.
        recv: The slots of its sources, in rank order.
        caps: Slot bytes from each rank (0 but for the round's sources).
        sources: The round's sources.
    """

    work: dist.Work
    recv: torch.Tensor
    caps: list[int]
    sources: list[int]


@dataclass
class ChunkedCall:
    """A chunked call's state between its send and its receive (kept on its request).

    Attributes:
        rounds: Its rounds, in order.
        overflow_sends: (work, bytes) of its overflow sends.
    """

    rounds: list[ChunkRound]
    overflow_sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)


def send_chunked(
    direction: Direction,
    encoder: CallEncoder,
    call: SlotCall,
    chunks: int,
    info: LossyAll2AllPooledInfo,
    pg: dist.ProcessGroup,
    telemetry: ExchangeRecord,
) -> ChunkedCall:
    """Encodes and posts the call's slots round by round (each round's all-to-all posted before
    the next round is encoded).

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        encoder: The call's encoder (nothing encoded yet).
        call: The call, with its slots.
        chunks: Rounds (:func:`chunk_count`).
        info: The call's parameters (its ledger's overflow tags, its dist's slot history).
        pg: The group.
        telemetry: The call's record (links and container bytes).

    Returns:
        The call in flight.
    """
    send_caps, recv_caps = call.send_caps, call.recv_caps
    assert send_caps is not None and recv_caps is not None and info.slots is not None
    world, my_rank = len(send_caps), encoder.my_rank
    tag = info.ledger.overflow_tag()
    sizes = [0] * world
    out = ChunkedCall([])
    for dests, sources in ring_rounds(world, my_rank, chunks):
        payloads = encoder.encode(dests)
        caps = [send_caps[p] if p in dests else 0 for p in range(world)]
        caps_in = [recv_caps[p] if p in sources else 0 for p in range(world)]
        recv, work, sends = post_slots(direction, payloads, caps, caps_in, tag, pg)
        out.overflow_sends += sends
        out.rounds.append(ChunkRound(work, recv, caps_in, sources))
        for p in dests:
            sizes[p] = payloads[p].numel()
    encoder.observe()
    info.slots.sent(call, sizes)
    count_slot_bytes(sizes, send_caps, info.same_host, telemetry)
    return out


def receive_chunked(
    direction: Direction,
    chunked: ChunkedCall,
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    rows_per_peer: Sequence[Sequence[int]],
    info: LossyAll2AllPooledInfo,
    pg: dist.ProcessGroup,
    my_rank: int,
    self_blocks: list[torch.Tensor],
    record: CallRecord | None,
    telemetry: ExchangeRecord,
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Waits on the rounds in order and decodes each round's sources as it arrives.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        chunked: The call in flight.
        specs_per_peer: Per source, the specs of its blocks.
        rows_per_peer: Per source, the rows of each block.
        info: The call's parameters.
        pg: The group.
        my_rank: This rank.
        self_blocks: The blocks this rank kept.
        record: The call's record (named by an error).
        telemetry: The call's record (each round's decode seconds and bytes added).

    Returns:
        Per source, its blocks; bytes of each source's payload.

    Raises:
        LossyAllToAllError: A slot's header is not a payload's, or a payload does not decode
            (naming its source rank).
    """
    world = len(specs_per_peer)
    blocks: list[list[torch.Tensor]] = [[] for _ in range(world)]
    blocks[my_rank] = self_blocks
    sizes = [0] * world
    shares: dict[str, int] = {}
    tables = [[s.table for s in specs] for specs in specs_per_peer]
    for rnd in chunked.rounds:
        with profile_range(f"## lossy_a2a {direction} wait ##"):
            rnd.work.wait()
        # rnd.caps is 0 but for the round's sources: their slots alone are opened.
        opened = receive_slots(direction, rnd.recv, rnd.caps, pg, my_rank, tables)
        payloads = [torch.empty(0, dtype=torch.uint8)] * world
        for p, pieces in opened.items():
            payloads[p] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        mine = set(opened)
        part = ExchangeRecord(direction)
        got, status = decode_call(
            direction, torch.cat(payloads) if len(mine) > 1 else payloads[min(mine, default=0)],
            [t.numel() for t in payloads],
            [specs if p in mine else () for p, specs in enumerate(specs_per_peer)],
            [rows if p in mine else () for p, rows in enumerate(rows_per_peer)],
            info, my_rank, record=record, telemetry=part,
        )  # fmt: skip
        assert status is None, "a chunked exchange on the device path"
        for p in mine:
            blocks[p], sizes[p] = got[p], payloads[p].numel()
        telemetry.decode_s += part.decode_s
        for t, n in (part.decode_shares or {}).items():
            shares[t] = shares.get(t, 0) + n
    telemetry.decode_shares = shares
    with profile_range(f"## lossy_a2a {direction} overflow ##"):
        for w, _ in chunked.overflow_sends:
            w.wait()
    return blocks, sizes


__all__ = [
    "OVERLAP_MIN_BYTES",
    "ChunkRound",
    "ChunkedCall",
    "chunk_count",
    "receive_chunked",
    "ring_rounds",
    "send_chunked",
]
