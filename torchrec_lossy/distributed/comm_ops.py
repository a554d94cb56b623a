"""The compressed pooled-embedding all-to-all as an autograd Req/Wait pair.

cf. ``torchrec/distributed/comm_ops.py``'s ``All2All_Pooled_Req``/``_Wait``; shared with
:mod:`.sequence_output_dist` (:class:`ExchangeSteps`). Each step cuts or joins its blocks
(pure geometry: :mod:`.pooled_blocks`) and moves them through the one exchange path
(:func:`.exchange.exchange` / :func:`.exchange.receive`) with the direction's wire codec.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Protocol

import torch
import torch.distributed as dist
from torch.autograd import Function
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.types import Awaitable, NoWait

from torchrec_lossy.distributed.call_ledger import CallLedger, read_checked
from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.exchange import (
    LOSSY_WIRE,
    Geometry,
    LossyRequest,
    exchange,
    receive,
    wire_for,
)
from torchrec_lossy.distributed.pooled_blocks import (
    LossyAll2AllPooledInfo,
    cut_blocks,
    expand_blocks,
    expand_index,
    join_blocks,
    one_dim,
    peer_blocks,
    place_grad_blocks,
    reduce_grad_blocks,
)
from torchrec_lossy.profile_range import profile_range


class ExchangeSteps(Protocol):
    """What one variable all-to-all does at each step of :class:`LossyAll2AllReq`/``Wait``.

    The pooled all-to-all's are :class:`PooledSteps`, the sequence all-to-all's
    ``sequence_output_dist.SequenceSteps``; each send step hands its blocks and their geometry
    to :func:`.exchange.exchange`, and the request carries them (wire codec, geometry, byte
    counts, self blocks, skeletons) to the matching receive step's :func:`.exchange.receive`.

    Attributes:
        comms: The module's dists' configuration and telemetry.
        ledger: The module's call ledger (its unread decode statuses).
    """

    comms: LossyComms
    ledger: CallLedger

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
            read_checked(steps.ledger)
        grad = grad_output.contiguous()
        myreq.tensor, myreq.req = steps.send_grad(grad, myreq, my_rank, world)
        return (None, None, myreq.dummy_tensor)


@dataclasses.dataclass
class PooledSteps:
    """The pooled all-to-all's steps (:class:`ExchangeSteps`): blocks of ``[rows, width]``
    per (peer, table shard), cut from and joined into ``[B, D]`` tensors.

    One per call (:func:`alltoall_pooled_lossy`), so it also keeps the call's dedupe gather
    indices from its forward for its backward: the gradient goes back along the rows the
    forward moved (the owner places by its cut's index, the receiver sums by its expand's).

    Args:
        info: The call's layout, batch sizes, dedupe state and comms state.
        cut_index: Per destination, the index its forward blocks were cut by
            (:func:`.pooled_blocks.cut_blocks`; None: the per-block path), once cut.
        expand_index: The receiver's :func:`.pooled_blocks.expand_index`, once expanded.
    """

    info: LossyAll2AllPooledInfo
    cut_index: list[torch.Tensor | None] | None = None
    expand_index: torch.Tensor | None = None

    @property
    def comms(self) -> LossyComms:
        """The module's dists' state."""
        return self.info.comms

    @property
    def ledger(self) -> CallLedger:
        """The module's call ledger."""
        return self.info.ledger

    def send_forward(
        self, x: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> tuple[torch.Tensor, dist.Work]:
        """Cuts ``[B_global, D_local]`` into per-destination blocks and sends them encoded."""
        info = self.info
        _check_pooled_input(x, info, my_rank)
        blocks, self.cut_index = _forward_blocks(x.detach(), info, my_rank, world)
        specs = info.layout[my_rank]
        geometry = Geometry(
            [specs] * world,
            info.layout,
            _forward_rows(info, my_rank, world),
            [[s.num_features * b for s in specs] for b in info.batch_size_per_rank],
        )
        return exchange("fwd", blocks, geometry, LOSSY_WIRE, info, myreq, x.device, my_rank)

    def receive_forward(
        self, recv: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> torch.Tensor:
        """Decodes every source's blocks into ``[B_local, D_global]``."""
        info = self.info
        b_local = info.batch_size_per_rank[my_rank]
        blocks = receive("fwd", recv, info, myreq, my_rank)
        if info.output_dedupe is None:
            pieces = [
                piece
                for bs, specs in zip(blocks, info.layout, strict=True)
                for piece in join_blocks(bs, specs, b_local)
            ]
        else:
            sender = [info.sender_rows(my_rank, p) for p in range(world)]
            if any(bs for bs in blocks):
                with profile_range("## lossy_a2a fwd dedupe expand ##"):
                    if one_dim(info.layout) is not None:
                        self.expand_index = expand_index(sender, b_local, recv.device)
                    return expand_blocks(blocks, info.layout, sender, b_local, self.expand_index)
            pieces = []
        if not pieces:
            return recv.new_empty((b_local, 0), dtype=info.dtype)
        return torch.cat(pieces, dim=1)

    def send_grad(
        self, grad: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> tuple[torch.Tensor, dist.Work]:
        """Sends each source rank the gradient of its columns (:func:`_grad_blocks`) through
        :func:`.exchange.exchange`: encoded, cast or exact."""
        info = self.info
        assert grad.shape[1] == sum(info.dim_sum_per_rank)
        blocks = _grad_blocks(grad, info, my_rank, world, self.expand_index)
        b_local = grad.shape[0]
        geometry = Geometry(
            info.layout,
            [info.layout[my_rank]] * world,
            _grad_rows(info, my_rank, world),
            [[s.num_features * b_local for s in specs] for specs in info.layout],
        )
        wire = wire_for("bwd", info.comms.config, info.dtype, "lossy_a2a")
        return exchange("bwd", blocks, geometry, wire, info, myreq, grad.device, my_rank)

    def receive_grad(
        self, recv: torch.Tensor, myreq: LossyRequest, my_rank: int, world: int
    ) -> torch.Tensor:
        """The owner's ``[B_global, D_local]`` gradient from what the sources sent back
        (:func:`.exchange.receive`), each block put back where :func:`_grad_blocks` cut it."""
        info = self.info
        blocks = receive("bwd", recv, info, myreq, my_rank)
        specs = info.layout[my_rank]
        if info.dedupe_grads and specs:
            feats = [info.owner_feats(my_rank, p) for p in range(len(blocks))]
            return place_grad_blocks(blocks, specs, feats, info.batch_size_per_rank, self.cut_index)
        pieces = []
        for p, bs in enumerate(blocks):
            n = info.batch_size_per_rank[p]
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
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor | None] | None]:
    """Per destination, per local table shard: the rows of its batch (under output dedupe,
    only its distinct bags: the first U rows of each feature); and under the dedupe, each
    destination's cut index (:func:`.pooled_blocks.cut_blocks`), for the backward."""
    r0s = list(itertools.accumulate(info.batch_size_per_rank, initial=0))
    if info.output_dedupe is None:
        blocks = peer_blocks(
            x, r0s[:-1], info.batch_size_per_rank, [0] * world, [info.layout[my_rank]] * world
        )
        return blocks, None
    with profile_range("## lossy_a2a fwd dedupe cut ##"):
        specs = info.layout[my_rank]
        cut = [
            cut_blocks(x, r0s[d], info.batch_size_per_rank[d], specs, info.owner_feats(my_rank, d))
            for d in range(world)
        ]
        return [bs for bs, _ in cut], [idx for _, idx in cut]


def _grad_blocks(
    grad: torch.Tensor,
    info: LossyAll2AllPooledInfo,
    my_rank: int,
    world: int,
    index: torch.Tensor | None = None,
) -> list[list[torch.Tensor]]:
    """Per source rank, per its table shard: the gradient of the rows it sent this rank.

    Every row of its columns (the forward's blocks, adjoint); under ``dedupe_grads`` the rows
    summed per distinct bag, so that the owner's lookup backward sees, per distinct bag, the
    total gradient it would have accumulated over the repeated bags (up to summation order);
    ``index``: the forward's expand index (:func:`.pooled_blocks.expand_index`), if built.
    """
    col_bases = list(itertools.accumulate(info.dim_sum_per_rank, initial=0))[:-1]
    b_local = grad.shape[0]
    if not info.dedupe_grads:
        return peer_blocks(grad, [0] * world, [b_local] * world, col_bases, info.layout)
    with profile_range("## lossy_a2a bwd dedupe reduce ##"):
        feats = [info.sender_rows(my_rank, p) for p in range(world)]
        return reduce_grad_blocks(grad, info.layout, feats, index)


def _forward_rows(info: LossyAll2AllPooledInfo, my_rank: int, world: int) -> list[list[int]]:
    """Per source rank, per its table shard: the rows it sends this rank in the forward (its
    features times this rank's batch, or the distinct bags of deduplicated features)."""
    if info.output_dedupe is None:
        b_local = info.batch_size_per_rank[my_rank]
        return [[s.num_features * b_local for s in specs] for specs in info.layout]
    sender = [info.sender_rows(my_rank, p) for p in range(world)]
    return [[sum(r for r, _ in f) for f in feats] for feats in sender]


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
