"""Variable-size two-phase all-to-all of pooled embeddings, compressed per (rank, table) block.

TorchRec's ``alltoall_pooled`` sends rows ``[offset_d, offset_d + B_d)`` of the local
``[B_global, D_local_sum]`` pooled embeddings to each rank ``d``; the receiver concatenates what
every source sent along the columns into ``[B_local, D_global_sum]``. Here the same exchange is
done on encoded bytes:

1. The sender cuts its share for each destination into one block per local table shard (rows =
   pooled embedding vectors: a table with ``F`` features gives ``F * B_d`` rows of its width) and
   encodes all blocks for one destination into one payload, each with its table's bound.
2. The payload byte counts are exchanged (one ``all_to_all_single`` of int64, read on the host:
   the exchange's host sync; relative bounds add one more, for all blocks' value ranges).
3. The payloads are exchanged with uneven splits (``all_to_all_single`` on uint8), asynchronously.
4. On wait, each payload is decoded and the blocks are put back where TorchRec's
   ``PooledEmbeddingsAllToAll`` would have put them.

The backward sends the gradient the other way with its own codec (``LossyCommsConfig.backward``).
As in TorchRec (``All2All_Pooled_Req``/``All2All_Pooled_Wait`` in ``comm_ops.py``), the exchange is
an autograd Req/Wait pair around a :class:`~torchrec.distributed.comm_ops.Request`, so pipelines
can overlap it with compute.

Payload of one (source, destination) pair: the blocks of tables that are not compressed travel
first, raw, each padded to 16 bytes; the codec payload of the other blocks follows. The receiver
knows every block's shape from the sharding layout, so no extra framing is needed.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.autograd import Function
from torch.autograd.profiler import record_function
from torchrec.distributed.comm_ops import Request, get_gradient_division
from torchrec.distributed.types import Awaitable, NoWait

from torchrec_lossy.codec import CodecError, compress_with_stats, decompress
from torchrec_lossy.config import ErrorBound
from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.stats import Direction

if TYPE_CHECKING:
    from torchrec_lossy.distributed.input_dist import OutputDedupe

T = TypeVar("T")
_ALIGN = 16  # byte alignment of raw blocks and of payloads handed to the decoder
_CAST_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


class LossyAllToAllError(RuntimeError):
    """A received payload could not be decoded into the blocks the sharding layout expects."""


@dataclass(frozen=True)
class BlockSpec:
    """One table shard's columns in a rank's local pooled-embedding output.

    Attributes:
        table: Table name (bounds, compress flag and telemetry are per table).
        col_offset: First column of the shard in the rank's ``[B, D_local_sum]`` output.
        num_features: Features pooled from this table shard (consecutive column groups).
        dim: Columns per feature (the shard's ``local_cols``).
    """

    table: str
    col_offset: int
    num_features: int
    dim: int

    @property
    def width(self) -> int:
        """Columns the shard occupies: ``num_features * dim``."""
        return self.num_features * self.dim


@dataclass
class LossyAll2AllPooledInfo:
    """Per-call parameters of :func:`alltoall_pooled_lossy` (cf. TorchRec's All2AllPooledInfo).

    Attributes:
        batch_size_per_rank: Batch size of every rank of the group.
        layout: Per rank of the group, its table shards in output column order.
        comms: Shared config, bound provider, telemetry and hooks.
        compress: Table name to whether its blocks go through the codec (else raw).
        dtype: Dtype of the pooled embeddings (set by the forward).
        output_dedupe: Cross-side dedupe state of the input dist that fed this call (rows of
            deduplicated features travel once per distinct bag), or None.
    """

    batch_size_per_rank: list[int]
    layout: Sequence[Sequence[BlockSpec]]
    comms: LossyComms
    compress: dict[str, bool]
    dtype: torch.dtype = torch.float32
    output_dedupe: OutputDedupe | None = None
    dim_sum_per_rank: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.dim_sum_per_rank = [sum(s.width for s in specs) for specs in self.layout]

    @property
    def sum_grads(self) -> bool:
        """Whether gradients travel summed per distinct id (lookup dedupe), else dense."""
        return self.output_dedupe is not None and self.output_dedupe.sum_grads

    def owner_rows(self, my_rank: int, peer: int) -> list[list[int]]:
        """Per local table shard, per feature: rows this rank (the owner) exchanges with
        ``peer`` (its batch size, or the distinct bags of a deduplicated feature)."""
        return [[r for r, _ in f] for f in self.owner_feats(my_rank, peer)]

    def owner_feats(self, my_rank: int, peer: int) -> list[list[tuple[int, torch.Tensor | None]]]:
        """Per local table shard, per feature: (rows sent to ``peer``, the bags they come from:
        None for the first rows (all of them, or a lookup-deduplicated feature's distinct ids))."""
        rows = self.batch_size_per_rank[peer]
        dd = self.output_dedupe
        flat = dd.recv_rows[peer] if dd is not None else None
        if dd is not None and not dd.sum_grads and dd.select is None:
            raise RuntimeError(
                "lossy output dist: the exact output dedupe has no bag selection; the input "
                "dist's KJT must be decoded (its tensors awaitable waited on) before the lookup"
            )
        sel = dd.select[peer] if dd is not None and dd.select is not None else None

        def one(i: int) -> tuple[int, torch.Tensor | None]:
            x = flat[i] if flat is not None else None
            if x is None:
                return rows, None
            return x, sel[i] if sel is not None else None

        return _per_feature(self.layout[my_rank], one, (rows, None))

    def sender_rows(self, my_rank: int, peer: int) -> list[list[tuple[int, torch.Tensor | None]]]:
        """Per table shard of ``peer``, per feature: (rows exchanged, inverse index or None),
        from the side of this rank, which sent ``peer`` the ids."""
        rows = self.batch_size_per_rank[my_rank]
        dd = self.output_dedupe
        flat = dd.send[peer] if dd is not None else None

        def one(i: int) -> tuple[int, torch.Tensor | None]:
            x = flat[i] if flat is not None else None
            return (rows, None) if x is None else x

        return _per_feature(self.layout[peer], one, (rows, None))


def _per_feature(specs: Sequence[BlockSpec], of: Callable[[int], T], default: T) -> list[list[T]]:
    """``of(i)`` for the i-th feature of ``specs`` in order, grouped per spec."""
    out, i = [], 0
    for s in specs:
        out.append([of(i + f) for f in range(s.num_features)])
        i += s.num_features
    return out


class _LossyRequest(Request[torch.Tensor]):
    """TorchRec's Request plus the state of a variable-size exchange."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(pg, device)
        self.recv_sizes: list[int] | None = None  # None: a fixed-size (dense) exchange
        # Dense gradient exchange in block form (lookup dedupe): elements from each peer.
        self.dense_blocks: list[int] | None = None


# ---------------------------------------------------------------------------------------------
# Blocks: cutting a dense tensor into per-(peer, table) blocks and back.


def _cut_block(
    x: torch.Tensor,
    row0: int,
    rows: int,
    col0: int,
    spec: BlockSpec,
    feats: Sequence[tuple[int, torch.Tensor | None]] | None = None,
) -> torch.Tensor:
    """The block of one table shard: its ``F`` column groups stacked as ``F * rows`` vectors.

    With ``feats``, feature ``f`` contributes only ``feats[f] = (r, select)`` rows: its first
    ``r`` rows (select None: a lookup-deduplicated feature's distinct ids), or rows ``select``
    (the first bag of each distinct bag of an exactly deduplicated feature).
    """
    c = col0 + spec.col_offset
    if feats is not None and any(r != rows or sel is not None for r, sel in feats):
        d = spec.dim
        part = x[row0 : row0 + rows]
        return torch.cat(
            [
                part[:r, c + f * d : c + (f + 1) * d]
                if sel is None
                else part[sel, c + f * d : c + (f + 1) * d]
                for f, (r, sel) in enumerate(feats)
            ]
        )
    part = x[row0 : row0 + rows, c : c + spec.width]
    return part.reshape(rows, spec.num_features, spec.dim).transpose(0, 1).reshape(-1, spec.dim)


def _join_blocks(
    blocks: Sequence[torch.Tensor], specs: Sequence[BlockSpec], rows: int
) -> list[torch.Tensor]:
    """Inverse of :func:`_cut_block` for one peer: ``[rows, width]`` pieces in column order."""
    return [
        b.view(s.num_features, rows, s.dim).transpose(0, 1).reshape(rows, s.width)
        for b, s in zip(blocks, specs, strict=True)
    ]


def _expand_block(
    b: torch.Tensor, spec: BlockSpec, rows: int, feats: Sequence[tuple[int, torch.Tensor | None]]
) -> torch.Tensor:
    """Receiver side of a lookup-deduplicated block: ``[rows, width]``, each deduplicated
    feature's distinct rows gathered back by its inverse index (exact: a gather)."""
    pieces = b.split([r for r, _ in feats])
    out = [p if inv is None else p[inv] for p, (_, inv) in zip(pieces, feats, strict=True)]
    return torch.cat(out, dim=1) if out else b.new_empty((rows, 0))


def _reduce_grad_block(
    g: torch.Tensor, col0: int, spec: BlockSpec, feats: Sequence[tuple[int, torch.Tensor | None]]
) -> torch.Tensor:
    """Backward of :func:`_expand_block`: the gradient rows summed per distinct id."""
    pieces = []
    for f, (r, inv) in enumerate(feats):
        c = col0 + spec.col_offset + f * spec.dim
        gf = g[:, c : c + spec.dim]
        if inv is not None:
            gf = gf.new_zeros((r, spec.dim)).index_add_(0, inv, gf)
        pieces.append(gf)
    return torch.cat(pieces) if pieces else g.new_empty((0, spec.dim))


def _pad_block(
    b: torch.Tensor, spec: BlockSpec, rows: int, feat_rows: Sequence[int]
) -> torch.Tensor:
    """Owner side of a deduplicated gradient block: ``[rows, width]``, the rows past each
    feature's distinct ones (its empty bags) zero."""
    out = []
    for p, r in zip(b.split(list(feat_rows)), feat_rows, strict=True):
        out.append(p if r == rows else torch.cat([p, p.new_zeros((rows - r, spec.dim))]))
    return torch.cat(out, dim=1) if out else b.new_empty((rows, 0))


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _aligned(payload: torch.Tensor) -> torch.Tensor:
    return payload if payload.storage_offset() % _ALIGN == 0 else payload.clone()


# ---------------------------------------------------------------------------------------------
# Encode / exchange / decode.


def _finite_ranges(blocks: Sequence[torch.Tensor]) -> list[float]:
    """``max - min`` over the finite elements of each block, with one host sync for all."""
    if not blocks:
        return []
    spans = []
    for b in blocks:
        f = b.float()
        finite = torch.isfinite(f)
        hi = torch.where(finite, f, -math.inf).amax()
        lo = torch.where(finite, f, math.inf).amin()
        spans.append(hi - lo)
    return [s if math.isfinite(s) and s > 0 else 0.0 for s in torch.stack(spans).tolist()]


def _abs_bounds(blocks: Sequence[torch.Tensor], bounds: Sequence[ErrorBound]) -> list[float]:
    """Absolute bound of each block: ``value`` or ``value * (max - min)`` of the block."""
    rel = [
        i
        for i, (b, eb) in enumerate(zip(blocks, bounds, strict=True))
        if eb.mode == "relative" and eb.value > 0 and b.numel() > 0
    ]
    spans = dict(zip(rel, _finite_ranges([blocks[i] for i in rel]), strict=True))
    return [
        eb.value * spans[i] if i in spans else (eb.value if eb.mode == "absolute" else 0.0)
        for i, eb in enumerate(bounds)
    ]


def _encode_payloads(
    direction: Direction,
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    info: LossyAll2AllPooledInfo,
    device: torch.device,
) -> list[torch.Tensor]:
    """Encodes each peer's blocks into one uint8 payload (raw blocks first, then the codec's)."""
    comms = info.comms
    config = comms.config
    stats = comms.stats
    coded = [
        (b, s)
        for bs, ss in zip(blocks_per_peer, specs_per_peer, strict=True)
        for b, s in zip(bs, ss, strict=True)
        if info.compress[s.table]
    ]
    with record_function(f"## lossy_a2a {direction} bounds ##"):
        if direction == "fwd":
            bounds = [comms.bounds.bound(s.table) for _, s in coded]
        else:
            bounds = [config.backward_bound] * len(coded)
        abs_bounds = _abs_bounds([b for b, _ in coded], bounds)
        if direction == "fwd":
            for (b, s), eb in zip(coded, abs_bounds, strict=True):
                comms.bounds.observe(s.table, b, eb)
    next_bound = iter(abs_bounds)

    payloads = []
    with record_function(f"## lossy_a2a {direction} encode ##"):
        for blocks, specs in zip(blocks_per_peer, specs_per_peer, strict=True):
            start = time.perf_counter()
            parts: list[torch.Tensor] = []
            codec_blocks: list[torch.Tensor] = []
            codec_bounds: list[float] = []
            codec_tables: list[str] = []
            shares: dict[str, int] = {}
            for b, s in zip(blocks, specs, strict=True):
                nbytes = b.numel() * b.element_size()
                shares[s.table] = shares.get(s.table, 0) + nbytes
                if info.compress[s.table]:
                    codec_blocks.append(b.contiguous())
                    codec_bounds.append(next(next_bound))
                    codec_tables.append(s.table)
                else:
                    raw = torch.zeros(_padded(nbytes), dtype=torch.uint8, device=b.device)
                    raw[:nbytes] = b.contiguous().view(-1).view(torch.uint8)
                    parts.append(raw)
                    stats.record_block(direction, s.table, nbytes, raw.numel(), 0.0, 0.0)
            if codec_blocks:
                payload, block_stats = compress_with_stats(
                    codec_blocks, codec_bounds, config=config.codec
                )
                parts.append(payload)
                for table, eb, bs in zip(codec_tables, codec_bounds, block_stats, strict=True):
                    stats.record_block(
                        direction, table, bs.raw_bytes, bs.wire_bytes, bs.max_error, eb
                    )
                # The payload header belongs to no block.
                stats.record_container(
                    direction, payload.numel() - sum(bs.wire_bytes for bs in block_stats)
                )
            payloads.append(
                torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
            )
            stats.record_time(direction, "encode", shares, time.perf_counter() - start)
    return payloads


def _exchange(
    direction: Direction,
    payloads: Sequence[torch.Tensor],
    pg: dist.ProcessGroup,
    device: torch.device,
) -> tuple[torch.Tensor, list[int], dist.Work]:
    """Phase 1 (sizes, blocking) and phase 2 (payloads, async) of the variable all-to-all."""
    send_sizes = [int(p.numel()) for p in payloads]
    sizes = torch.tensor(send_sizes, dtype=torch.int64, device=device)
    recv_sizes_t = torch.empty_like(sizes)
    with record_function(f"## lossy_a2a {direction} sizes ##"):
        dist.all_to_all_single(recv_sizes_t, sizes, group=pg, async_op=True).wait()
        recv_sizes = recv_sizes_t.tolist()  # the one device-to-host sync of the exchange
    send = torch.cat([p.to(device) for p in payloads])
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    with record_function(f"## lossy_a2a {direction} payload ##"):
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg, async_op=True)
    return recv, recv_sizes, work


def _decode_peer(
    direction: Direction,
    payload: torch.Tensor,
    peer: int,
    specs: Sequence[BlockSpec],
    block_rows: Sequence[int],
    info: LossyAll2AllPooledInfo,
    my_rank: int,
) -> list[torch.Tensor]:
    """Decodes one peer's payload into its blocks, checked against the expected layout."""
    dtype = info.dtype
    elem = torch.empty(0, dtype=dtype).element_size()

    def fail(why: str) -> NoReturn:
        tables = ", ".join(sorted({s.table for s in specs})) or "none"
        raise LossyAllToAllError(
            f"lossy all-to-all ({direction}) on rank {my_rank}: the payload from rank {peer} "
            f"(tables: {tables}) could not be decoded: {why}. The bytes were corrupted in "
            "transit or the ranks run different torchrec_lossy versions or sharding plans."
        )

    size = payload.numel()
    raw_len = sum(
        _padded(br * s.dim * elem)
        for s, br in zip(specs, block_rows, strict=True)
        if not info.compress[s.table]
    )
    n_coded = sum(1 for s in specs if info.compress[s.table])
    if n_coded == 0 and size != raw_len:
        fail(f"{size} bytes received, expected exactly {raw_len} bytes of raw blocks")
    if size < raw_len:
        fail(f"{size} bytes received, fewer than the {raw_len} bytes of raw blocks")
    decoded: list[torch.Tensor] = []
    if n_coded:
        try:
            decoded = decompress(payload[raw_len:])
        except CodecError as e:
            fail(f"{type(e).__name__}: {e}")
        if len(decoded) != n_coded:
            fail(f"{len(decoded)} blocks decoded, {n_coded} expected")
    blocks: list[torch.Tensor] = []
    coded = iter(decoded)
    raw_at = 0
    for s, br in zip(specs, block_rows, strict=True):
        shape = (br, s.dim)
        if info.compress[s.table]:
            b = next(coded)
            if tuple(b.shape) != shape or b.dtype != dtype:
                fail(f"table {s.table}: block {tuple(b.shape)} {b.dtype}, expected {shape} {dtype}")
        else:
            n = shape[0] * shape[1] * elem
            b = payload[raw_at : raw_at + n].view(dtype).view(shape)
            raw_at += _padded(n)
        blocks.append(b)
    return blocks


def _decode_payloads(
    direction: Direction,
    recv: torch.Tensor,
    recv_sizes: Sequence[int],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    block_rows_per_peer: Sequence[int | Sequence[int]],
    info: LossyAll2AllPooledInfo,
    my_rank: int,
) -> list[list[torch.Tensor]]:
    """Decodes every peer's payload (``recv`` holds them in rank order) into its blocks.

    ``block_rows_per_peer``: per peer, the rows of each block, or one batch size (every block
    then has ``num_features * rows`` rows).
    """
    comms = info.comms
    elem = torch.empty(0, dtype=info.dtype).element_size()
    out: list[list[torch.Tensor]] = []
    offsets = itertools.accumulate(recv_sizes, initial=0)
    with record_function(f"## lossy_a2a {direction} decode ##"):
        for peer, (offset, size) in enumerate(zip(offsets, recv_sizes, strict=False)):
            start = time.perf_counter()
            specs, block_rows = specs_per_peer[peer], block_rows_per_peer[peer]
            if isinstance(block_rows, int):
                block_rows = [s.num_features * block_rows for s in specs]
            payload = recv.narrow(0, offset, size)
            if comms.payload_hook is not None:
                payload = comms.payload_hook(direction, peer, payload)
            # Raw blocks and the codec payload then start 16-byte aligned.
            payload = _aligned(payload)
            out.append(_decode_peer(direction, payload, peer, specs, block_rows, info, my_rank))
            shares: dict[str, int] = {}
            for s, br in zip(specs, block_rows, strict=True):
                shares[s.table] = shares.get(s.table, 0) + br * s.dim * elem
            comms.stats.record_time(direction, "decode", shares, time.perf_counter() - start)
    return out


# ---------------------------------------------------------------------------------------------
# Autograd pair.


def _peer_blocks(
    x: torch.Tensor,
    row_starts: Sequence[int],
    rows: Sequence[int],
    col_bases: Sequence[int],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
) -> list[list[torch.Tensor]]:
    """Cuts ``x`` into the blocks for each peer ``p``: its ``rows[p]`` rows from ``row_starts[p]``,
    its table shards ``specs_per_peer[p]`` at column ``col_bases[p]``."""
    return [
        [_cut_block(x, r0, n, c0, s) for s in specs]
        for r0, n, c0, specs in zip(row_starts, rows, col_bases, specs_per_peer, strict=True)
    ]


def _backward_dense_send(
    grad_output: torch.Tensor, info: LossyAll2AllPooledInfo, wire_dtype: torch.dtype
) -> torch.Tensor:
    """Columns of each source rank, flattened in rank order (TorchRec's recat), as wire_dtype."""
    stats = info.comms.stats
    codec = info.comms.config.backward
    b_local = grad_output.shape[0]
    in_elem, wire_elem = grad_output.element_size(), torch.empty(0, dtype=wire_dtype).element_size()
    start = time.perf_counter()
    with record_function("## lossy_a2a bwd encode ##"):
        by_rank = grad_output.split(info.dim_sum_per_rank, dim=1)
        send = torch.cat([g.contiguous().view(-1) for g in by_rank]).to(wire_dtype)
    shares: dict[str, int] = {}
    col = 0
    for specs in info.layout:
        for s in specs:
            n = b_local * s.width
            shares[s.table] = shares.get(s.table, 0) + n * in_elem
            stats.record_block("bwd", s.table, n * in_elem, n * wire_elem, 0.0, 0.0)
            if codec != "none" and n > 0:
                g = grad_output[:, col + s.col_offset : col + s.col_offset + s.width]
                err = (g - g.to(wire_dtype).to(g.dtype)).abs().amax()
                stats.record_max_error_lazy("bwd", s.table, err)
        col += sum(s.width for s in specs)
    stats.record_time("bwd", "encode", shares, time.perf_counter() - start)
    return send


class LossyAll2AllPooledReq(Function):
    """Encodes and launches the forward exchange; its backward finishes the gradient exchange."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        pg: dist.ProcessGroup,
        myreq: _LossyRequest,
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
        info.dtype = input_embeddings.dtype
        if info.output_dedupe is None:
            blocks = _peer_blocks(
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
                        _cut_block(x, r0s[d], info.batch_size_per_rank[d], 0, s, fr)
                        for s, fr in zip(
                            info.layout[my_rank], info.owner_feats(my_rank, d), strict=True
                        )
                    ]
                    for d in range(world)
                ]
        for d, blocks_d in enumerate(blocks):
            for b, s in zip(blocks_d, info.layout[my_rank], strict=True):
                rows = s.num_features * info.batch_size_per_rank[d]
                info.comms.stats.record_rows("fwd", s.table, rows, b.shape[0])
        payloads = _encode_payloads(
            "fwd", blocks, [info.layout[my_rank]] * world, info, input_embeddings.device
        )
        recv, recv_sizes, work = _exchange("fwd", payloads, pg, input_embeddings.device)
        myreq.req = work
        myreq.tensor = recv
        myreq.recv_sizes = recv_sizes
        myreq.a2ai = info
        myreq.wait_function = LossyAll2AllPooledWait
        ctx.myreq = myreq
        ctx.pg = pg
        return myreq.dummy_tensor

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *unused: torch.Tensor) -> tuple:
        pg = ctx.pg
        myreq: _LossyRequest = ctx.myreq
        info: LossyAll2AllPooledInfo = myreq.a2ai
        my_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        assert myreq.req is not None, "backward of the lossy all-to-all ran before its wait"
        myreq.req.wait()
        myreq.req = None
        recv = myreq.tensor
        b_global = sum(info.batch_size_per_rank)
        d_local = info.dim_sum_per_rank[my_rank]
        if info.sum_grads:
            grad_input = _owner_grad_dedupe(recv, myreq, info, my_rank, world)
        elif myreq.recv_sizes is None:
            start = time.perf_counter()
            with record_function("## lossy_a2a bwd decode ##"):
                grad_input = recv.view(b_global, d_local).to(info.dtype)
            shares = {s.table: b_global * s.width for s in info.layout[my_rank]}
            info.comms.stats.record_time("bwd", "decode", shares, time.perf_counter() - start)
        else:
            blocks = _decode_payloads(
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
            )
            pieces = [
                torch.cat(_join_blocks(bs, info.layout[my_rank], rows), dim=1)
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
        myreq: _LossyRequest,
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
        blocks = _decode_payloads("fwd", recv, recv_sizes, info.layout, block_rows, info, my_rank)
        if info.output_dedupe is None:
            pieces = [
                piece
                for bs, specs in zip(blocks, info.layout, strict=True)
                for piece in _join_blocks(bs, specs, b_local)
            ]
        else:
            with record_function("## lossy_a2a fwd dedupe expand ##"):
                pieces = [
                    _expand_block(b, s, b_local, f)
                    for bs, specs, feats in zip(blocks, info.layout, sender, strict=True)
                    for b, s, f in zip(bs, specs, feats, strict=True)
                ]
        if not pieces:
            return recv.new_empty((b_local, 0), dtype=info.dtype)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
        pg = ctx.pg
        myreq: _LossyRequest = ctx.myreq
        info: LossyAll2AllPooledInfo = myreq.a2ai
        my_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        b_local, d_global = grad_output.shape
        assert d_global == sum(info.dim_sum_per_rank)
        codec = info.comms.config.backward
        grad_output = grad_output.contiguous()
        if info.sum_grads:
            recv, work = _receiver_grad_dedupe(pg, grad_output, myreq, info, my_rank, world)
        elif codec == "lossy":
            # Every source rank gets all local rows of its own columns.
            col_bases = list(itertools.accumulate(info.dim_sum_per_rank, initial=0))[:-1]
            blocks = _peer_blocks(
                grad_output, [0] * world, [b_local] * world, col_bases, info.layout
            )
            payloads = _encode_payloads("bwd", blocks, info.layout, info, grad_output.device)
            recv, recv_sizes, work = _exchange("bwd", payloads, pg, grad_output.device)
            myreq.recv_sizes = recv_sizes
        else:
            wire_dtype = _CAST_DTYPES.get(codec, grad_output.dtype)
            send = _backward_dense_send(grad_output, info, wire_dtype)
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
    myreq: _LossyRequest,
    info: LossyAll2AllPooledInfo,
    my_rank: int,
    world: int,
) -> tuple[torch.Tensor, dist.Work]:
    """Gradient send under lookup dedupe: rows summed per distinct id, then sent as blocks.

    The owner's fused update of a distinct row then sees the same total gradient it would have
    accumulated over the repeated bags (up to float summation order).
    """
    codec = info.comms.config.backward
    stats = info.comms.stats
    col_bases = list(itertools.accumulate(info.dim_sum_per_rank, initial=0))[:-1]
    with record_function("## lossy_a2a bwd dedupe reduce ##"):
        blocks = [
            [
                _reduce_grad_block(grad_output, col_bases[p], s, f)
                for s, f in zip(info.layout[p], info.sender_rows(my_rank, p), strict=True)
            ]
            for p in range(world)
        ]
    myreq.dense_blocks = None
    myreq.recv_sizes = None
    if codec == "lossy":
        payloads = _encode_payloads("bwd", blocks, info.layout, info, grad_output.device)
        recv, recv_sizes, work = _exchange("bwd", payloads, pg, grad_output.device)
        myreq.recv_sizes = recv_sizes
        return recv, work
    wire_dtype = _CAST_DTYPES.get(codec, grad_output.dtype)
    in_elem = grad_output.element_size()
    wire_elem = torch.empty(0, dtype=wire_dtype).element_size()
    b_local = grad_output.shape[0]
    start = time.perf_counter()
    with record_function("## lossy_a2a bwd encode ##"):
        send = torch.cat(
            [b.reshape(-1) for bs in blocks for b in bs] or [grad_output.new_empty(0)]
        ).to(wire_dtype)
    send_sizes = [sum(b.numel() for b in bs) for bs in blocks]
    shares: dict[str, int] = {}
    for bs, specs in zip(blocks, info.layout, strict=True):
        for b, s in zip(bs, specs, strict=True):
            raw = b_local * s.width * in_elem  # what TorchRec's dense gradient would carry
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
    myreq: _LossyRequest,
    info: LossyAll2AllPooledInfo,
    my_rank: int,
    world: int,
) -> torch.Tensor:
    """Gradient receive under lookup dedupe: the distinct rows' gradients, zero for the
    empty bags past them, as the owner's ``[B_global, D_local]`` gradient."""
    specs = info.layout[my_rank]
    owner = [info.owner_rows(my_rank, p) for p in range(world)]
    block_rows = [[sum(fr) for fr in feats] for feats in owner]
    if myreq.dense_blocks is None:
        assert myreq.recv_sizes is not None
        blocks = _decode_payloads(
            "bwd", recv, myreq.recv_sizes, [specs] * world, block_rows, info, my_rank
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
            _pad_block(b, s, rows, fr) for b, s, fr in zip(blocks[p], specs, owner[p], strict=True)
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
    myreq = _LossyRequest(group, device=a2a_pooled_embs_tensor.device)
    LossyAll2AllPooledReq.apply(group, myreq, info, a2a_pooled_embs_tensor)
    return myreq
