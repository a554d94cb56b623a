"""Variable-size two-phase all-to-all of pooled embeddings, compressed per (rank, table) block.

The collective side of the lossy output dist (cf. ``torchrec/distributed/comm_ops.py``); what
the payloads hold and how blocks are cut and encoded is :mod:`.pooled_payload`, how they are
decoded :mod:`.pooled_decode`.

1. The sender encodes its blocks for every destination in one codec call
   (:func:`.pooled_payload.start_encode`); the block it sends itself skips the codec and the
   wire (kept in the request, exact).
2. The payload byte counts are exchanged (one ``all_to_all_single`` of the int64 sizes the
   encoder left on the device), then read on the host together with the encoder's pending
   values in one copy: the exchange's one host sync, which also finishes the encode.
3. The payloads are exchanged with uneven splits (``all_to_all_single`` on uint8), asynchronously.
4. On wait, every payload is decoded in one codec call and the blocks are put back where
   TorchRec's ``PooledEmbeddingsAllToAll`` would have put them. On the host path a corrupt
   payload raises ``LossyAllToAllError`` naming the source rank before any block is used. On
   the device path the decode status is not read there: a failed source's blocks are zeroed
   on the device and its status rides the next size exchange's read (the backward's for a
   forward decode: the job stops before that step's gradients are applied; the next forward's
   for a gradient decode: the failed rows got a zero gradient), so each all-to-all costs ONE
   host sync per direction. A backward without size exchange (cast or exact) reads the
   forward's status at its start; ``check_lossy_decodes(model)`` reads whatever is pending
   (e.g. after the last step).

The backward sends the gradient the other way with its own codec (``LossyCommsConfig.backward``).
As in TorchRec (``All2All_Pooled_Req``/``All2All_Pooled_Wait``), the exchange is an autograd
Req/Wait pair around a :class:`~torchrec.distributed.comm_ops.Request`, so pipelines can overlap it
with compute.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Function
from torch.autograd.profiler import record_function
from torchrec.distributed.comm_ops import Request, get_gradient_division
from torchrec.distributed.types import Awaitable, NoWait

from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.pooled_decode import decode_payloads, read_checked
from torchrec_lossy.distributed.pooled_payload import (
    BlockSpec,
    LossyAll2AllPooledInfo,
    PendingPayloads,
    backward_dense_send,
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

_CAST_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


class LossyRequest(Request[torch.Tensor]):
    """TorchRec's Request plus the state of a variable-size exchange."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(pg, device)
        self.recv_sizes: list[int] | None = None  # None: a fixed-size (dense) exchange
        # Dense gradient exchange in block form (lookup dedupe): elements from each peer.
        self.dense_blocks: list[int] | None = None
        # The blocks this rank sends itself: exact, never encoded, never on the wire.
        self.self_blocks: list[torch.Tensor] | None = None
        # Each peer's codec payload skeleton, received in the size exchange.
        self.recv_skeletons: dict[int, np.ndarray] | None = None


def _take_self_blocks(myreq: LossyRequest) -> list[torch.Tensor]:
    """The self blocks stored with the exchange (released from the request)."""
    blocks, myreq.self_blocks = myreq.self_blocks, None
    assert blocks is not None, "the lossy exchange lost its self blocks"
    return blocks


def _take_skeletons(myreq: LossyRequest) -> dict[int, np.ndarray] | None:
    """The skeletons received in the size exchange (released from the request)."""
    skeletons, myreq.recv_skeletons = myreq.recv_skeletons, None
    return skeletons


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
    device decodes still unchecked (``comms.deferred``) are then read in ONE device-to-host copy
    (the exchange's only host sync, ``read_checked``), after which the payloads exist and are
    sent. The received skeletons go to ``myreq.recv_skeletons`` (the decode then reads nothing
    back).

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        pending: From ``start_encode``.
        recv_meta_splits: Words expected from each peer (``meta_words``).
        myreq: The request (its group and device; receives the skeletons).
        comms: The module's dists' state (its deferred decode checks are read here).

    Returns:
        (received bytes, bytes from each peer, the payload exchange's work).
    """
    pg, device = myreq.pg, pending.meta.device
    recv_meta = torch.empty(sum(recv_meta_splits), dtype=torch.int64, device=device)
    with record_function(f"## lossy_a2a {direction} sizes ##"):
        dist.all_to_all_single(
            recv_meta, pending.meta, recv_meta_splits, pending.meta_splits, group=pg,
            async_op=True,
        ).wait()  # fmt: skip
        k = pending.readback.numel()
        # The deferred decode status of earlier all-to-alls rides this read too.
        host = read_checked(comms, torch.cat([pending.readback, recv_meta]))
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
    with record_function(f"## lossy_a2a {direction} payload ##"):
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg, async_op=True)
    return recv, recv_sizes, work


def _recv_meta_splits(
    specs_per_peer: Sequence[Sequence[BlockSpec]], info: LossyAll2AllPooledInfo, my_rank: int
) -> list[int]:
    """Words of the size exchange expected from each peer."""
    return [meta_words(specs, info, p, my_rank) for p, specs in enumerate(specs_per_peer)]


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
    pending = start_encode(direction, blocks, send_specs, info, device, my_rank)
    myreq.self_blocks = blocks[my_rank]
    recv_meta_splits = _recv_meta_splits(recv_specs, info, my_rank)
    recv, recv_sizes, work = _exchange(direction, pending, recv_meta_splits, myreq, info.comms)
    myreq.recv_sizes = recv_sizes
    return recv, work


class LossyAll2AllPooledReq(Function):
    """Encodes and launches the forward exchange; its backward finishes the gradient exchange."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        pg: dist.ProcessGroup,
        myreq: LossyRequest,
        info: LossyAll2AllPooledInfo,
        input_embeddings: torch.Tensor,
    ) -> torch.Tensor:
        my_rank = dist.get_rank(pg)
        world = dist.get_world_size(pg)
        b_global, d_local = input_embeddings.shape
        if b_global != sum(info.batch_size_per_rank) or d_local != info.dim_sum_per_rank[my_rank]:
            raise ValueError(
                f"pooled embeddings of shape {tuple(input_embeddings.shape)} on rank {my_rank} do "
                f"not match batch sizes {info.batch_size_per_rank} and local dim sum "
                f"{info.dim_sum_per_rank[my_rank]}"
            )
        if input_embeddings.dtype != info.dtype:
            raise ValueError(
                f"pooled embeddings of dtype {input_embeddings.dtype}, the call's info says "
                f"{info.dtype}"
            )
        if info.output_dedupe is None:
            blocks = peer_blocks(
                input_embeddings.detach(),
                list(itertools.accumulate(info.batch_size_per_rank, initial=0))[:-1],
                info.batch_size_per_rank,
                [0] * world,
                [info.layout[my_rank]] * world,
            )
        else:
            # Deduplicated features: only their distinct rows (first U bags) travel.
            x = input_embeddings.detach()
            r0s = list(itertools.accumulate(info.batch_size_per_rank, initial=0))
            with record_function("## lossy_a2a fwd dedupe cut ##"):
                blocks = [
                    [
                        cut_block(x, r0s[d], info.batch_size_per_rank[d], 0, s, fr)
                        for s, fr in zip(
                            info.layout[my_rank], info.owner_feats(my_rank, d), strict=True
                        )
                    ]
                    for d in range(world)
                ]
        for d, blocks_d in enumerate(blocks):
            if d == my_rank:  # the self block is counted apart (LossyCommsStats.self_bytes)
                continue
            for b, s in zip(blocks_d, info.layout[my_rank], strict=True):
                rows = s.num_features * info.batch_size_per_rank[d]
                info.comms.stats.record_rows("fwd", s.table, rows, b.shape[0])
        recv, work = encode_and_exchange(
            "fwd",
            blocks,
            [info.layout[my_rank]] * world,
            info.layout,
            info,
            myreq,
            input_embeddings.device,
            my_rank,
        )
        myreq.req = work
        myreq.tensor = recv
        myreq.a2ai = info
        myreq.wait_function = LossyAll2AllPooledWait
        ctx.myreq = myreq
        ctx.pg = pg
        return myreq.dummy_tensor

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *unused: torch.Tensor) -> tuple:
        pg = ctx.pg
        myreq: LossyRequest = ctx.myreq
        info: LossyAll2AllPooledInfo = myreq.a2ai
        my_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        assert myreq.req is not None, "backward of the lossy all-to-all ran before its wait"
        myreq.req.wait()
        myreq.req = None
        recv = myreq.tensor
        b_global = sum(info.batch_size_per_rank)
        d_local = info.dim_sum_per_rank[my_rank]
        if info.dedupe_grads:
            grad_input = _owner_grad_dedupe(recv, myreq, info, my_rank, world)
        elif myreq.recv_sizes is None:
            start = time.perf_counter()
            with record_function("## lossy_a2a bwd decode ##"):
                grad_input = recv.view(b_global, d_local).to(info.dtype)
            shares = {s.table: b_global * s.width for s in info.layout[my_rank]}
            info.comms.stats.record_time("bwd", "decode", shares, time.perf_counter() - start)
        else:
            blocks = decode_payloads(
                "bwd",
                recv,
                myreq.recv_sizes,
                [info.layout[my_rank]] * world,
                [
                    [s.num_features * b for s in info.layout[my_rank]]
                    for b in info.batch_size_per_rank
                ],
                info,
                my_rank,
                _take_self_blocks(myreq),
                _take_skeletons(myreq),
            )
            pieces = [
                torch.cat(join_blocks(bs, info.layout[my_rank], rows), dim=1)
                if bs
                else recv.new_empty((rows, 0), dtype=info.dtype)
                for bs, rows in zip(blocks, info.batch_size_per_rank, strict=True)
            ]
            grad_input = torch.cat(pieces, dim=0)
        if get_gradient_division():
            grad_input = grad_input / world
        myreq.tensor = None
        myreq.dummy_tensor = None
        return (None, None, None, grad_input)


class LossyAll2AllPooledWait(Function):
    """Waits for the forward exchange and decodes; its backward launches the gradient exchange."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        pg: dist.ProcessGroup,
        myreq: LossyRequest,
        *dummy_tensor: torch.Tensor,
    ) -> torch.Tensor:
        my_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        info: LossyAll2AllPooledInfo = myreq.a2ai
        assert myreq.req is not None and myreq.recv_sizes is not None
        myreq.req.wait()
        recv, recv_sizes = myreq.tensor, myreq.recv_sizes
        myreq.req = None
        myreq.tensor = None
        ctx.pg = pg
        ctx.myreq = myreq
        b_local = info.batch_size_per_rank[my_rank]
        if info.output_dedupe is None:
            block_rows = [[s.num_features * b_local for s in specs] for specs in info.layout]
        else:
            sender = [info.sender_rows(my_rank, p) for p in range(world)]
            block_rows = [[sum(r for r, _ in f) for f in feats] for feats in sender]
        blocks = decode_payloads(
            "fwd",
            recv,
            recv_sizes,
            info.layout,
            block_rows,
            info,
            my_rank,
            _take_self_blocks(myreq),
            _take_skeletons(myreq),
        )
        if info.output_dedupe is None:
            pieces = [
                piece
                for bs, specs in zip(blocks, info.layout, strict=True)
                for piece in join_blocks(bs, specs, b_local)
            ]
        else:
            with record_function("## lossy_a2a fwd dedupe expand ##"):
                pieces = [
                    expand_block(b, s, b_local, f)
                    for bs, specs, feats in zip(blocks, info.layout, sender, strict=True)
                    for b, s, f in zip(bs, specs, feats, strict=True)
                ]
        if not pieces:
            return recv.new_empty((b_local, 0), dtype=info.dtype)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
        pg = ctx.pg
        myreq: LossyRequest = ctx.myreq
        info: LossyAll2AllPooledInfo = myreq.a2ai
        my_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        b_local, d_global = grad_output.shape
        assert d_global == sum(info.dim_sum_per_rank)
        codec = info.comms.config.backward
        if codec != "lossy":
            # No size exchange to ride: the forward's deferred decode status is read here,
            # before any gradient of this step leaves (no read if nothing is pending).
            read_checked(info.comms)
        grad_output = grad_output.contiguous()
        if not info.dedupe_grads:  # every row travels (the dedupe path counts its own)
            for p, specs in enumerate(info.layout):
                if p == my_rank:  # rows over the wire-crossing peers, as the forward counts
                    continue
                for s in specs:
                    rows = s.num_features * b_local
                    info.comms.stats.record_rows("bwd", s.table, rows, rows)
        if info.dedupe_grads:
            recv, work = _receiver_grad_dedupe(pg, grad_output, myreq, info, my_rank, world)
        elif codec == "lossy":
            # Every source rank gets all local rows of its own columns.
            col_bases = list(itertools.accumulate(info.dim_sum_per_rank, initial=0))[:-1]
            blocks = peer_blocks(
                grad_output, [0] * world, [b_local] * world, col_bases, info.layout
            )
            recv, work = encode_and_exchange(
                "bwd",
                blocks,
                info.layout,
                [info.layout[my_rank]] * world,
                info,
                myreq,
                grad_output.device,
                my_rank,
            )
        else:
            wire_dtype = _CAST_DTYPES.get(codec, grad_output.dtype)
            send = backward_dense_send(grad_output, info, wire_dtype)
            d_local = info.dim_sum_per_rank[my_rank]
            recv = torch.empty(
                d_local * sum(info.batch_size_per_rank),
                dtype=wire_dtype,
                device=grad_output.device,
            )
            with record_function("## lossy_a2a bwd payload ##"):
                work = dist.all_to_all_single(
                    recv,
                    send,
                    [d_local * b for b in info.batch_size_per_rank],
                    [b_local * d for d in info.dim_sum_per_rank],
                    group=pg,
                    async_op=True,
                )
            myreq.recv_sizes = None
        myreq.req = work
        myreq.tensor = recv
        return (None, None, myreq.dummy_tensor)


def _receiver_grad_dedupe(
    pg: dist.ProcessGroup,
    grad_output: torch.Tensor,
    myreq: LossyRequest,
    info: LossyAll2AllPooledInfo,
    my_rank: int,
    world: int,
) -> tuple[torch.Tensor, dist.Work]:
    """Gradient send under output dedupe: rows summed per distinct bag, then sent as blocks.

    The owner's lookup backward then sees, per distinct bag, the same total gradient it would
    have accumulated over the repeated bags (up to float summation order).
    """
    codec = info.comms.config.backward
    stats = info.comms.stats
    col_bases = list(itertools.accumulate(info.dim_sum_per_rank, initial=0))[:-1]
    b_local = grad_output.shape[0]
    with record_function("## lossy_a2a bwd dedupe reduce ##"):
        blocks = [
            [
                reduce_grad_block(grad_output, col_bases[p], s, f)
                for s, f in zip(info.layout[p], info.sender_rows(my_rank, p), strict=True)
            ]
            for p in range(world)
        ]
    for p, (bs, specs) in enumerate(zip(blocks, info.layout, strict=True)):
        if p == my_rank:  # rows over the wire-crossing peers, as the forward counts them
            continue
        for b, s in zip(bs, specs, strict=True):
            stats.record_rows("bwd", s.table, s.num_features * b_local, b.shape[0])
    myreq.dense_blocks = None
    myreq.recv_sizes = None
    if codec == "lossy":
        return encode_and_exchange(
            "bwd",
            blocks,
            info.layout,
            [info.layout[my_rank]] * world,
            info,
            myreq,
            grad_output.device,
            my_rank,
        )
    wire_dtype = _CAST_DTYPES.get(codec, grad_output.dtype)
    in_elem = grad_output.element_size()
    wire_elem = torch.empty(0, dtype=wire_dtype).element_size()
    start = time.perf_counter()
    with record_function("## lossy_a2a bwd encode ##"):
        send = torch.cat(
            [b.reshape(-1) for bs in blocks for b in bs] or [grad_output.new_empty(0)]
        ).to(wire_dtype)
    send_sizes = [sum(b.numel() for b in bs) for bs in blocks]
    shares: dict[str, int] = {}
    for bs, specs in zip(blocks, info.layout, strict=True):
        for b, s in zip(bs, specs, strict=True):
            # Raw: the rows sent, as in the forward (rows / rows_sent scale it to TorchRec's).
            raw = b.numel() * in_elem
            shares[s.table] = shares.get(s.table, 0) + raw
            stats.record_block("bwd", s.table, raw, b.numel() * wire_elem, 0.0, 0.0)
    stats.record_time("bwd", "encode", shares, time.perf_counter() - start)
    recv_sizes = [
        sum(
            sum(fr) * s.dim
            for s, fr in zip(info.layout[my_rank], info.owner_rows(my_rank, p), strict=True)
        )
        for p in range(world)
    ]
    recv = torch.empty(sum(recv_sizes), dtype=wire_dtype, device=grad_output.device)
    with record_function("## lossy_a2a bwd payload ##"):
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg, async_op=True)
    myreq.dense_blocks = recv_sizes
    return recv, work


def _owner_grad_dedupe(
    recv: torch.Tensor,
    myreq: LossyRequest,
    info: LossyAll2AllPooledInfo,
    my_rank: int,
    world: int,
) -> torch.Tensor:
    """Gradient receive under output dedupe: each distinct bag's summed gradient at its row
    (:func:`place_grad_block`), as the owner's ``[B_global, D_local]`` gradient."""
    specs = info.layout[my_rank]
    owner = [info.owner_feats(my_rank, p) for p in range(world)]
    block_rows = [[sum(r for r, _ in fr) for fr in feats] for feats in owner]
    if myreq.dense_blocks is None:
        assert myreq.recv_sizes is not None
        blocks = decode_payloads(
            "bwd",
            recv,
            myreq.recv_sizes,
            [specs] * world,
            block_rows,
            info,
            my_rank,
            _take_self_blocks(myreq),
            _take_skeletons(myreq),
        )
    else:
        start = time.perf_counter()
        with record_function("## lossy_a2a bwd decode ##"):
            flat = recv.to(info.dtype).split(
                [br * s.dim for brs in block_rows for br, s in zip(brs, specs, strict=True)]
            )
            it = iter(flat)
            blocks = [
                [next(it).view(br, s.dim) for br, s in zip(brs, specs, strict=True)]
                for brs in block_rows
            ]
        elem = recv.element_size()
        shares: dict[str, int] = {}
        for i, s in enumerate(specs):
            n = sum(block_rows[p][i] for p in range(world)) * s.dim * elem
            shares[s.table] = shares.get(s.table, 0) + n
        info.comms.stats.record_time("bwd", "decode", shares, time.perf_counter() - start)
    pieces = []
    for p in range(world):
        rows = info.batch_size_per_rank[p]
        parts = [
            place_grad_block(b, s, rows, fr)
            for b, s, fr in zip(blocks[p], specs, owner[p], strict=True)
        ]
        pieces.append(
            torch.cat(parts, dim=1) if parts else recv.new_empty((rows, 0), dtype=info.dtype)
        )
    return torch.cat(pieces, dim=0)


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
    LossyAll2AllPooledReq.apply(group, myreq, info, a2a_pooled_embs_tensor)
    return myreq
