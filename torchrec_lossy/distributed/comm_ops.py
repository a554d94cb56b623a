"""Variable-size two-phase all-to-all of pooled embeddings, compressed per (rank, table) block.

The collective side of the lossy output dist (cf. ``torchrec/distributed/comm_ops.py``); blocks
are cut and encoded by :mod:`.pooled_payload`, decoded by :mod:`.pooled_decode`; the self-send
skips the codec (exact). Device path: ONE host sync per all-to-all and direction, the size
exchange's read, which also finishes the encode and carries the previous decode's deferred
status (docs/kernels.md, "Syncs per all-to-all"). Like ``All2All_Pooled_Req``/``_Wait`` it is an
autograd Req/Wait pair, shared with :mod:`.sequence_output_dist` (:class:`ExchangeSteps`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Function
from torchrec.distributed.comm_ops import Request, get_gradient_division
from torchrec.distributed.types import Awaitable, NoWait

from torchrec_lossy.distributed.call_ledger import CallRecord
from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.pooled_decode import DeferredDecode, decode_call, read_checked
from torchrec_lossy.distributed.pooled_payload import (
    BlockSpec,
    LossyAll2AllPooledInfo,
    PendingPayloads,
    cut_block,
    expand_block,
    join_blocks,
    meta_words,
    peer_blocks,
    place_grad_block,
    reduce_grad_block,
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


class LossyRequest(Request[torch.Tensor]):
    """TorchRec's Request plus the state of a variable-size exchange."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(pg, device)
        self.recv_sizes: list[int] | None = None  # None: a fixed-size (dense) exchange
        # The blocks this rank sends itself: exact, never encoded, never on the wire.
        self.self_blocks: list[torch.Tensor] | None = None
        # Each peer's codec payload skeleton, received in the size exchange.
        self.recv_skeletons: dict[int, np.ndarray] | None = None
        # The record of the exchange in flight (drawn when it encodes).
        self.record: CallRecord | None = None
        # The latest device decode's status, unread (the module's ledger lists it too).
        self.decode_status: DeferredDecode | None = None

    def take_received(self) -> torch.Tensor:
        """Waits for the exchange in flight and releases what it received.

        Returns:
            The received tensor (payload bytes, or the dense gradient).
        """
        assert self.req is not None, "the lossy all-to-all was waited on before it was launched"
        self.req.wait()
        recv, self.req, self.tensor = self.tensor, None, None
        assert recv is not None
        return recv


def _exchange(
    direction: Direction,
    pending: PendingPayloads,
    recv_meta_splits: list[int],
    myreq: LossyRequest,
    comms: LossyComms,
) -> tuple[torch.Tensor, list[int], dist.Work]:
    """Phase 1 (sizes, blocking) and phase 2 (payloads, async) of the variable all-to-all.

    Each peer gets its payload size and its codec payload's skeleton, from the device tensor the
    encoder left; the received entries, the encoder's pending values and the status of the
    device decodes still unread (``comms.ledger``) are then read in ONE device-to-host copy
    (the exchange's only host sync, ``read_checked``), after which the payloads exist and are
    sent. The received skeletons go to ``myreq.recv_skeletons`` (the decode then reads nothing
    back).

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        pending: From ``start_encode``.
        recv_meta_splits: Words expected from each peer (``meta_words``).
        myreq: The request (its group and device; receives the skeletons).
        comms: The module's dists' state (its ledger's unread decode statuses are read here).

    Returns:
        (received bytes, bytes from each peer, the payload exchange's work).
    """
    pg, device = myreq.pg, pending.meta.device
    recv_meta = torch.empty(sum(recv_meta_splits), dtype=torch.int64, device=device)
    with profile_range(f"## lossy_a2a {direction} sizes ##"):
        dist.all_to_all_single(
            recv_meta, pending.meta, recv_meta_splits, pending.meta_splits, group=pg,
            async_op=True,
        ).wait()  # fmt: skip
        k = pending.readback.numel()
        # The deferred decode status of earlier all-to-alls rides this read too.
        host = read_checked(comms.ledger, torch.cat([pending.readback, recv_meta]))
    payloads = pending.finish(host[:k].tolist())
    at = list(itertools.accumulate(recv_meta_splits, initial=0))
    recv_sizes = [int(host[k + a]) for a in at[:-1]]
    myreq.recv_skeletons = {
        p: host[k + at[p] + 1 : k + at[p + 1]].astype(np.uint32)
        for p in range(len(recv_meta_splits))
        if recv_meta_splits[p] > 1
    }
    send_sizes = [int(p.numel()) for p in payloads]
    send = torch.cat([p.to(device) for p in payloads])
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    with profile_range(f"## lossy_a2a {direction} payload ##"):
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg, async_op=True)
    return recv, recv_sizes, work


def encode_and_exchange(
    direction: Direction,
    blocks: list[list[torch.Tensor]],
    send_specs: Sequence[Sequence[BlockSpec]],
    recv_specs: Sequence[Sequence[BlockSpec]],
    info: LossyAll2AllPooledInfo,
    myreq: LossyRequest,
    device: torch.device,
    my_rank: int,
) -> tuple[torch.Tensor, dist.Work]:
    """Encodes this rank's blocks for every peer and runs the variable all-to-all.

    The one encode-then-exchange sequence of the pooled forward, the lossy backward, the
    deduplicated gradient and the sequence all-to-all (both directions): the self blocks stay
    in the request (exact, off the wire), the sizes and skeletons are exchanged
    (:func:`_exchange`), then the payloads, asynchronously.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        blocks: Per peer, the blocks this rank sends it.
        send_specs: Per peer, the specs of those blocks.
        recv_specs: Per peer, the specs of the blocks it sends this rank.
        info: Layout, compress flags and comms state.
        myreq: The request; receives the self blocks, the skeletons and the bytes per peer.
        device: Device of the blocks (the encoder's device path runs there).
        my_rank: This rank.

    Returns:
        (received bytes, the payload exchange's work).
    """
    exact = direction == "fwd" and info.exact_forward
    myreq.record = info.comms.ledger.start(direction, exact)
    pending = start_encode(direction, blocks, send_specs, info, device, my_rank, myreq.record)
    myreq.self_blocks = blocks[my_rank]
    recv_meta_splits = [meta_words(specs, info, p, my_rank) for p, specs in enumerate(recv_specs)]
    recv, recv_sizes, work = _exchange(direction, pending, recv_meta_splits, myreq, info.comms)
    myreq.recv_sizes = recv_sizes
    return recv, work


def decode_exchanged(
    direction: Direction,
    recv: torch.Tensor,
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    rows_per_peer: Sequence[Sequence[int]],
    info: LossyAll2AllPooledInfo,
    myreq: LossyRequest,
    my_rank: int,
) -> list[list[torch.Tensor]]:
    """Decodes what :func:`encode_and_exchange` received: every peer's blocks, the self blocks
    taken from the request (exact), the skeletons from its size exchange.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        recv: The received payload bytes.
        specs_per_peer: Per peer, the specs of the blocks it sent.
        rows_per_peer: Per peer, the rows of each of those blocks.
        info: Layout, compress flags and comms state.
        myreq: The request of the exchange (its byte counts, self blocks and skeletons).
        my_rank: This rank.

    Returns:
        Per peer, its decoded blocks.
    """
    assert myreq.recv_sizes is not None, "decode of a lossy exchange that sent no payloads"
    self_blocks, myreq.self_blocks = myreq.self_blocks, None
    assert self_blocks is not None, "the lossy exchange lost its self blocks"
    skeletons, myreq.recv_skeletons = myreq.recv_skeletons, None
    blocks, status = decode_call(
        direction, recv, myreq.recv_sizes, specs_per_peer, rows_per_peer, info, my_rank,
        self_blocks, skeletons, myreq.record,
    )  # fmt: skip
    if status is not None:  # owned by this call; the next host read of the module checks it
        myreq.decode_status = status
        info.comms.ledger.owe_status(status)
    return blocks


def dense_block_send(
    pg: dist.ProcessGroup,
    blocks: list[list[torch.Tensor]],
    layout: Sequence[Sequence[BlockSpec]],
    recv_sizes: list[int],
    wire_dtype: torch.dtype,
    device: torch.device,
    comms: LossyComms,
    tag: str,
) -> tuple[torch.Tensor, dist.Work]:
    """Sends gradient blocks without codec (a cast or exact), asynchronously.

    Args:
        pg: Process group.
        blocks: Per peer, the gradient blocks this rank sends it.
        layout: Per peer, the specs of those blocks (their tables, for the telemetry).
        recv_sizes: Elements expected from each peer.
        wire_dtype: The dtype on the wire.
        device: Device of the gradient (and of the receive buffer).
        comms: The module's dists' state (telemetry).
        tag: The profiler label's prefix (``lossy_a2a`` or ``lossy_seq_a2a``).

    Returns:
        (the receive buffer, the exchange's work).
    """
    stats = comms.stats
    cast = comms.config.backward != "none"  # its error is recorded, 0 where nothing changes
    start = time.perf_counter()
    with profile_range(f"## {tag} bwd encode ##"):
        flat = [b.reshape(-1) for bs in blocks for b in bs]
        send = torch.cat(flat).to(wire_dtype) if flat else torch.empty(0, dtype=wire_dtype)
        send = send.to(device)
    wire_elem = send.element_size()
    shares: dict[str, int] = {}
    for bs, specs in zip(blocks, layout, strict=True):
        for b, s in zip(bs, specs, strict=True):
            # Raw: the rows sent (under dedupe rows / rows_sent scale it to TorchRec's).
            raw = b.numel() * b.element_size()
            shares[s.table] = shares.get(s.table, 0) + raw
            stats.record_block("bwd", s.table, raw, b.numel() * wire_elem, 0.0, 0.0)
            if cast and b.numel():
                err = (b - b.to(wire_dtype).to(b.dtype)).abs().amax()
                stats.record_max_error_lazy("bwd", s.table, err)
    stats.record_time("bwd", "encode", shares, time.perf_counter() - start)
    send_sizes = [sum(b.numel() for b in bs) for bs in blocks]
    recv = torch.empty(sum(recv_sizes), dtype=wire_dtype, device=device)
    with profile_range(f"## {tag} bwd payload ##"):
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg, async_op=True)
    return recv, work


def send_grad_blocks(
    blocks: list[list[torch.Tensor]],
    recv_rows: Sequence[Sequence[int]],
    info: LossyAll2AllPooledInfo,
    myreq: LossyRequest,
    device: torch.device,
    my_rank: int,
    tag: str,
) -> tuple[torch.Tensor, dist.Work]:
    """Sends gradient blocks back to their owners: encoded (``backward`` "lossy"), or cast or
    exact (:func:`dense_block_send`, ``myreq.recv_sizes`` then None).

    Args:
        blocks: Per peer (owner), the gradient blocks of its table shards.
        recv_rows: Per peer, per local table shard, the rows it sends back here.
        info: Layout, compress flags and comms state.
        myreq: The request.
        device: Device of the gradient.
        my_rank: This rank.
        tag: The profiler label's prefix of the dense path.

    Returns:
        (the receive buffer, the exchange's work).
    """
    codec = info.comms.config.backward
    specs = info.layout[my_rank]
    if codec == "lossy":
        return encode_and_exchange(
            "bwd", blocks, info.layout, [specs] * len(blocks), info, myreq, device, my_rank
        )
    myreq.recv_sizes = None
    recv_sizes = [sum(r * s.dim for r, s in zip(rs, specs, strict=True)) for rs in recv_rows]
    wire = wire_dtype_of(codec, info.dtype)
    return dense_block_send(
        myreq.pg, blocks, info.layout, recv_sizes, wire, device, info.comms, tag
    )


def receive_grad_blocks(
    recv: torch.Tensor,
    rows_per_peer: Sequence[Sequence[int]],
    info: LossyAll2AllPooledInfo,
    myreq: LossyRequest,
    my_rank: int,
    tag: str,
) -> list[list[torch.Tensor]]:
    """The owner's side of :func:`send_grad_blocks`: the received gradient blocks, decoded
    (``backward`` "lossy") or cast back.

    Args:
        recv: The received buffer.
        rows_per_peer: Per source rank, per local table shard, the rows it sent.
        info: Layout, compress flags and comms state.
        myreq: The request (``recv_sizes`` None: a dense send).
        my_rank: This rank.
        tag: The profiler label's prefix of the dense path.

    Returns:
        Per source rank, per local table shard, a ``[rows, dim]`` block.
    """
    specs = info.layout[my_rank]
    if myreq.recv_sizes is None:
        return dense_grad_blocks(recv, rows_per_peer, specs, info.dtype, info.comms, tag)
    n = len(rows_per_peer)
    return decode_exchanged("bwd", recv, [specs] * n, rows_per_peer, info, myreq, my_rank)


def dense_grad_blocks(
    recv: torch.Tensor,
    rows_per_peer: Sequence[Sequence[int]],
    specs: Sequence[BlockSpec],
    dtype: torch.dtype,
    comms: LossyComms,
    tag: str,
) -> list[list[torch.Tensor]]:
    """The owner's gradient received by :func:`dense_block_send`, as blocks.

    Args:
        recv: The received elements (wire dtype), every peer's blocks in order.
        rows_per_peer: Per peer, per local table shard, its rows.
        specs: The local table shards.
        dtype: The gradient's dtype.
        comms: The module's dists' state (telemetry).
        tag: The profiler label's prefix.

    Returns:
        Per peer, per local table shard, a ``[rows, dim]`` block.
    """
    start = time.perf_counter()
    with profile_range(f"## {tag} bwd decode ##"):
        sizes = [r * s.dim for rs in rows_per_peer for r, s in zip(rs, specs, strict=True)]
        it = iter(recv.to(dtype).split(sizes))
        blocks = [
            [next(it).view(r, s.dim) for r, s in zip(rs, specs, strict=True)]
            for rs in rows_per_peer
        ]
    shares: dict[str, int] = {}
    for rs in rows_per_peer:
        for r, s in zip(rs, specs, strict=True):
            shares[s.table] = shares.get(s.table, 0) + r * s.dim * recv.element_size()
    comms.stats.record_time("bwd", "decode", shares, time.perf_counter() - start)
    return blocks


class ExchangeSteps(Protocol):
    """What one variable all-to-all does at each step of :class:`LossyAll2AllReq`/``Wait``.

    The pooled all-to-all's are :class:`PooledSteps`, the sequence all-to-all's
    ``sequence_output_dist.SequenceSteps``; the request carries the exchange's byte counts,
    self blocks and skeletons from a send step to the matching receive step.

    Attributes:
        comms: The module's dists' state (config, telemetry, the call ledger).
    """

    comms: LossyComms

    def send_forward(
        self, x: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> tuple[torch.Tensor, dist.Work]:
        """Cuts the forward's blocks from the input and sends them.

        Args:
            x: The input (what the Req function was applied to).
            myreq: The request of the exchange.
            my_rank: This rank.
            world: The group's size.

        Returns:
            (the receive buffer, the exchange's work).
        """
        ...

    def receive_forward(
        self, recv: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> torch.Tensor:
        """Decodes the forward's received bytes into the output (arguments as
        :meth:`send_forward`'s, with the received buffer)."""
        ...

    def send_grad(
        self, grad: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> tuple[torch.Tensor, dist.Work]:
        """Cuts the output's gradient (contiguous) and sends it the other way; returns as
        :meth:`send_forward`."""
        ...

    def receive_grad(
        self, recv: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> torch.Tensor:
        """The input's gradient from the received buffer, before TorchRec's gradient
        division (arguments as :meth:`receive_forward`'s)."""
        ...


class LossyAll2AllReq(Function):
    """Encodes and launches the forward exchange; its backward finishes the gradient exchange."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        pg: dist.ProcessGroup,
        myreq: LossyRequest,
        steps: ExchangeSteps,
        x: torch.Tensor,
    ) -> torch.Tensor:
        my_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        myreq.tensor, myreq.req = steps.send_forward(x, myreq, my_rank, world)
        myreq.a2ai = steps
        myreq.wait_function = LossyAll2AllWait
        ctx.myreq, ctx.pg = myreq, pg
        return myreq.dummy_tensor

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *unused: torch.Tensor) -> tuple:
        pg, myreq = ctx.pg, ctx.myreq
        my_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        recv = myreq.take_received()
        grad = myreq.a2ai.receive_grad(recv, myreq, my_rank, world)
        if get_gradient_division():
            grad = grad / world
        myreq.dummy_tensor = None
        return (None, None, None, grad)


class LossyAll2AllWait(Function):
    """Waits for the forward exchange and decodes; its backward launches the gradient exchange."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        pg: dist.ProcessGroup,
        myreq: LossyRequest,
        *dummy_tensor: torch.Tensor,
    ) -> torch.Tensor:
        my_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        assert myreq.recv_sizes is not None, "the forward exchange sent no payloads"
        recv = myreq.take_received()
        ctx.pg, ctx.myreq = pg, myreq
        return myreq.a2ai.receive_forward(recv, myreq, my_rank, world)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
        pg, myreq = ctx.pg, ctx.myreq
        steps: ExchangeSteps = myreq.a2ai
        my_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        if steps.comms.config.backward != "lossy":
            # No size exchange to ride: the forward's deferred decode status is read here,
            # before any gradient of this step leaves (no read if nothing is pending).
            read_checked(steps.comms.ledger)
        grad = grad_output.contiguous()
        myreq.tensor, myreq.req = steps.send_grad(grad, myreq, my_rank, world)
        return (None, None, myreq.dummy_tensor)


@dataclasses.dataclass
class PooledSteps:
    """The pooled all-to-all's steps (:class:`ExchangeSteps`): blocks of ``[rows, width]``
    per (peer, table shard), cut from and joined into ``[B, D]`` tensors.

    Args:
        info: The call's layout, batch sizes, dedupe state and comms state.
    """

    info: LossyAll2AllPooledInfo

    @property
    def comms(self) -> LossyComms:
        """The module's dists' state."""
        return self.info.comms

    def send_forward(
        self, x: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> tuple[torch.Tensor, dist.Work]:
        """Cuts ``[B_global, D_local]`` into per-destination blocks and sends them encoded."""
        info = self.info
        _check_pooled_input(x, info, my_rank)
        blocks = _forward_blocks(x.detach(), info, my_rank, world)
        for d, blocks_d in enumerate(blocks):
            if d == my_rank:  # the self block is counted apart (LossyCommsStats.self_bytes)
                continue
            for b, s in zip(blocks_d, info.layout[my_rank], strict=True):
                rows = s.num_features * info.batch_size_per_rank[d]
                info.comms.stats.record_rows("fwd", s.table, rows, b.shape[0])
        specs = info.layout[my_rank]
        return encode_and_exchange(
            "fwd", blocks, [specs] * world, info.layout, info, myreq, x.device, my_rank
        )

    def receive_forward(
        self, recv: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> torch.Tensor:
        """Decodes every source's blocks into ``[B_local, D_global]``."""
        info = self.info
        b_local = info.batch_size_per_rank[my_rank]
        if info.output_dedupe is None:
            block_rows = [[s.num_features * b_local for s in specs] for specs in info.layout]
        else:
            sender = [info.sender_rows(my_rank, p) for p in range(world)]
            block_rows = [[sum(r for r, _ in f) for f in feats] for feats in sender]
        blocks = decode_exchanged("fwd", recv, info.layout, block_rows, info, myreq, my_rank)
        if info.output_dedupe is None:
            pieces = [
                piece
                for bs, specs in zip(blocks, info.layout, strict=True)
                for piece in join_blocks(bs, specs, b_local)
            ]
        else:
            with profile_range("## lossy_a2a fwd dedupe expand ##"):
                pieces = [
                    expand_block(b, s, b_local, f)
                    for bs, specs, feats in zip(blocks, info.layout, sender, strict=True)
                    for b, s, f in zip(bs, specs, feats, strict=True)
                ]
        if not pieces:
            return recv.new_empty((b_local, 0), dtype=info.dtype)
        return torch.cat(pieces, dim=1)

    def send_grad(
        self, grad: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> tuple[torch.Tensor, dist.Work]:
        """Sends each source rank the gradient of its columns (:func:`_grad_blocks`) through
        :func:`send_grad_blocks`: encoded, cast or exact."""
        info = self.info
        assert grad.shape[1] == sum(info.dim_sum_per_rank)
        blocks = _grad_blocks(grad, info, my_rank, world)
        rows = _grad_rows(info, my_rank, world)
        return send_grad_blocks(blocks, rows, info, myreq, grad.device, my_rank, "lossy_a2a")

    def receive_grad(
        self, recv: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> torch.Tensor:
        """The owner's ``[B_global, D_local]`` gradient from what the sources sent back
        (:func:`receive_grad_blocks`), each block put back where :func:`_grad_blocks` cut it."""
        info = self.info
        rows = _grad_rows(info, my_rank, world)
        blocks = receive_grad_blocks(recv, rows, info, myreq, my_rank, "lossy_a2a")
        specs = info.layout[my_rank]
        pieces = []
        for p, bs in enumerate(blocks):
            n = info.batch_size_per_rank[p]
            if info.dedupe_grads:
                feats = info.owner_feats(my_rank, p)
                parts = [
                    place_grad_block(b, s, n, f) for b, s, f in zip(bs, specs, feats, strict=True)
                ]
            else:
                parts = join_blocks(bs, specs, n)
            pieces.append(
                torch.cat(parts, dim=1) if parts else recv.new_empty((n, 0), dtype=info.dtype)
            )
        return torch.cat(pieces, dim=0)


def _check_pooled_input(x: torch.Tensor, info: LossyAll2AllPooledInfo, my_rank: int) -> None:
    """Raises ``ValueError`` unless ``x`` has the call's shape and dtype."""
    b_global, d_local = x.shape
    if b_global != sum(info.batch_size_per_rank) or d_local != info.dim_sum_per_rank[my_rank]:
        raise ValueError(
            f"pooled embeddings of shape {tuple(x.shape)} on rank {my_rank} do "
            f"not match batch sizes {info.batch_size_per_rank} and local dim sum "
            f"{info.dim_sum_per_rank[my_rank]}"
        )
    if x.dtype != info.dtype:
        raise ValueError(f"pooled embeddings of dtype {x.dtype}, the call's info says {info.dtype}")


def _forward_blocks(
    x: torch.Tensor, info: LossyAll2AllPooledInfo, my_rank: int, world: int
) -> list[list[torch.Tensor]]:
    """Per destination, per local table shard: the rows of its batch (under output dedupe,
    only its distinct bags: the first U rows of each feature)."""
    r0s = list(itertools.accumulate(info.batch_size_per_rank, initial=0))
    if info.output_dedupe is None:
        return peer_blocks(
            x, r0s[:-1], info.batch_size_per_rank, [0] * world, [info.layout[my_rank]] * world
        )
    with profile_range("## lossy_a2a fwd dedupe cut ##"):
        return [
            [
                cut_block(x, r0s[d], info.batch_size_per_rank[d], 0, s, fr)
                for s, fr in zip(info.layout[my_rank], info.owner_feats(my_rank, d), strict=True)
            ]
            for d in range(world)
        ]


def _grad_blocks(
    grad: torch.Tensor, info: LossyAll2AllPooledInfo, my_rank: int, world: int
) -> list[list[torch.Tensor]]:
    """Per source rank, per its table shard: the gradient of the rows it sent this rank.

    Every row of its columns (the forward's blocks, adjoint); under ``dedupe_grads`` the rows
    summed per distinct bag, so that the owner's lookup backward sees, per distinct bag, the
    total gradient it would have accumulated over the repeated bags (up to summation order).
    """
    col_bases = list(itertools.accumulate(info.dim_sum_per_rank, initial=0))[:-1]
    b_local = grad.shape[0]
    if info.dedupe_grads:
        with profile_range("## lossy_a2a bwd dedupe reduce ##"):
            blocks = [
                [
                    reduce_grad_block(grad, col_bases[p], s, f)
                    for s, f in zip(info.layout[p], info.sender_rows(my_rank, p), strict=True)
                ]
                for p in range(world)
            ]
    else:
        blocks = peer_blocks(grad, [0] * world, [b_local] * world, col_bases, info.layout)
    for p, (bs, specs) in enumerate(zip(blocks, info.layout, strict=True)):
        if p == my_rank:  # rows over the wire-crossing peers, as the forward counts them
            continue
        for b, s in zip(bs, specs, strict=True):
            info.comms.stats.record_rows("bwd", s.table, s.num_features * b_local, b.shape[0])
    return blocks


def _grad_rows(info: LossyAll2AllPooledInfo, my_rank: int, world: int) -> list[list[int]]:
    """Per source rank, per local table shard: the gradient rows it sends this rank (the
    owner): its batch per feature, or its distinct bags under ``dedupe_grads``."""
    if info.dedupe_grads:
        return [[sum(fr) for fr in info.owner_rows(my_rank, p)] for p in range(world)]
    specs = info.layout[my_rank]
    return [[s.num_features * b for s in specs] for b in info.batch_size_per_rank]


def alltoall_pooled_lossy(
    a2a_pooled_embs_tensor: torch.Tensor,
    info: LossyAll2AllPooledInfo,
    group: dist.ProcessGroup | None = None,
) -> Awaitable[torch.Tensor]:
    """Compressed all-to-all of one pooled embedding tensor (cf. TorchRec's alltoall_pooled).

    Args:
        a2a_pooled_embs_tensor: Local pooled embeddings, ``[B_global, D_local_sum]``; rows are
            grouped by destination rank in rank order, columns follow ``info.layout[rank]``.
        info: Batch sizes, layout, comms state.
        group: Process group; None: the default group.

    Returns:
        Awaitable of ``[B_local, D_global_sum]``, the columns of every source rank in rank order.
    """
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if group.size() <= 1:
        return NoWait(a2a_pooled_embs_tensor)
    if info.dtype != a2a_pooled_embs_tensor.dtype:  # the call's dtype is its input's
        info = dataclasses.replace(info, dtype=a2a_pooled_embs_tensor.dtype)
    myreq = LossyRequest(group, device=a2a_pooled_embs_tensor.device)
    LossyAll2AllReq.apply(group, myreq, PooledSteps(info), a2a_pooled_embs_tensor)
    return myreq
