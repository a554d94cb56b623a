"""The pooled all-to-all's blocks: their specs, the call's info, the pure geometry that cuts a
``[B, D]`` tensor into one block per (peer, table shard) and joins them back, and what a dist's
layout fixes for the encoder, built once with the dist (:class:`LayoutPlans`).

What :mod:`.comm_ops` does to the tensor before it enters :func:`.exchange.exchange` and after
it leaves :func:`.exchange.receive`: no codec, no collective, no telemetry (the encoder and the
decoder, :mod:`.pooled_payload` and :mod:`.pooled_decode`, take only the specs and the info).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from torchrec_lossy.codec.container import skeleton_words
from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.cast_blocks import word_count
from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.dedupe import OutputDedupe
from torchrec_lossy.distributed.exchange_slots import SlotHistory

T = TypeVar("T")
# One block's features: (rows exchanged, selected bags / inverse index, or None).
_Feats = Sequence[tuple[int, torch.Tensor | None]]


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
        ledger: The sharded module's call ledger: the call's record is drawn from it, an
            unread device decode status listed in it.
        compress: Table name to whether its blocks go through the codec (else raw).
        dtype: Dtype of the pooled embeddings (:func:`alltoall_pooled_lossy` takes its input's:
            the info itself is never modified).
        output_dedupe: Cross-side dedupe state of the input dist that fed this call (rows of
            deduplicated features travel once per distinct bag), or None.
        exact_forward: The forward travels lossless (bound 0 for every table; the bound
            provider neither asked nor shown the blocks): an exact evaluation.
        same_host: Group indices of the peers on this rank's host (wire bytes are counted by
            link: ``LossyCommsStats.link_bytes``).
        raw_peers: Peers whose blocks skip the codec in both directions (same-host peers
            under ``LossyCommsConfig.intra_host``); symmetric, so sender and receiver agree.
        plans: The encode plans of the dist's layout, built once when the dist was built
            (:func:`layout_plans`); None: each encode plans its call itself (tests, benchmarks).
        slots: The dist's slot history (built with the dist): a host call whose kind has a
            received call takes the one-round slot path (:mod:`.exchange_slots`); None: every
            call exchanges its sizes first.
        casts: Table name to its cast dtype, for the tables whose blocks skip the codec cast
            where their bound admits it (:mod:`.cast_blocks`); not to ``raw_peers``.
    """

    batch_size_per_rank: list[int]
    layout: Sequence[Sequence[BlockSpec]]
    comms: LossyComms
    ledger: CallLedger
    compress: dict[str, bool]
    dtype: torch.dtype = torch.float32
    output_dedupe: OutputDedupe | None = None
    exact_forward: bool = False
    same_host: frozenset[int] = frozenset()
    raw_peers: frozenset[int] = frozenset()
    plans: LayoutPlans | None = None
    slots: SlotHistory | None = None
    casts: dict[str, torch.dtype] = field(default_factory=dict)
    dim_sum_per_rank: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.dim_sum_per_rank = [sum(s.width for s in specs) for specs in self.layout]

    def codes(self, peer: int, table: str) -> bool:
        """Whether a block of ``table`` exchanged with ``peer`` goes through the codec (the
        same either way: ``raw_peers`` is symmetric).

        Args:
            peer: The destination or source.
            table: The block's table.

        Returns:
            True unless the table travels raw or the peer is a raw peer.
        """
        return peer not in self.raw_peers and self.compress[table]

    def cast_dtype(self, peer: int, table: str) -> torch.dtype | None:
        """The dtype a block of ``table`` exchanged with ``peer`` is cast to where its bound
        admits it (symmetric, as :meth:`codes`).

        Args:
            peer: The destination or source.
            table: The block's table.

        Returns:
            ``torch.float16`` / ``torch.bfloat16``, or None (coded, or exactly raw).
        """
        return None if peer in self.raw_peers else self.casts.get(table)

    @property
    def sum_grads(self) -> bool:
        """Whether gradients travel summed per distinct id (lookup dedupe), else dense."""
        return self.output_dedupe is not None and self.output_dedupe.sum_grads

    @property
    def dedupe_grads(self) -> bool:
        """Whether gradients travel one row per distinct bag: always under the lookup dedupe
        (its owner looked up one bag per distinct id), and under the exact output dedupe with
        ``LossyCommsConfig.backward_dedupe`` (the adjoint of sending one row per distinct bag:
        summed on the receiver of the forward, placed at the selected bag by the owner)."""
        dd = self.output_dedupe
        return dd is not None and (dd.sum_grads or self.comms.config.backward_dedupe)

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


def cut_block(
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
        if x.is_contiguous() and x.shape[1] % d == 0 and c % d == 0:
            # One gather of whole d-wide vectors (x as [B * D / d, d]) straight into the
            # block: no per-feature copy joined by a cat.
            per_row, f0 = x.shape[1] // d, c // d
            idx = torch.cat(
                [
                    (row0 + (_arange(r, x.device) if sel is None else sel)) * per_row + f0 + f
                    for f, (r, sel) in enumerate(feats)
                ]
            )
            return x.view(-1, d).index_select(0, idx)
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


def cut_index(
    per_row: int,
    row0: int,
    specs: Sequence[BlockSpec],
    feats: Sequence[_Feats],
    device: torch.device,
) -> torch.Tensor:
    """The rows of one destination's blocks (every spec of one dim ``d``) in ``x`` viewed as
    ``[B * per_row, d]``: :func:`cut_block`'s index of each block, back to back, built at once
    (a few ops for the destination instead of a few per feature).

    Args:
        per_row: ``d``-wide vectors per row of ``x`` (its columns over ``d``).
        row0: The destination's first row in ``x``.
        specs: The blocks' table shards (their columns in ``x``).
        feats: Per spec, per feature: (rows, selected bags or None: the first rows).
        device: Where ``x`` lives (and the selected bags).

    Returns:
        int64 indices, block after block (each block's rows in :func:`cut_block`'s order).
    """
    bases, cols, counts = [], [], []
    for s, ff in zip(specs, feats, strict=True):
        f0 = s.col_offset // s.dim
        for f, (r, sel) in enumerate(ff):
            bases.append(_arange(r, device) if sel is None else sel.to(torch.int64))
            cols.append(f0 + f)
            counts.append(r)
    if not bases:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if device.type == "cpu":
        col = torch.tensor(cols).repeat_interleave(torch.tensor(counts), output_size=sum(counts))
    else:  # device ops only: a host list copied to the device would wait for its stream
        pairs = zip(cols, counts, strict=True)
        col = torch.cat([torch.full((r,), c, dtype=torch.int64, device=device) for c, r in pairs])
    base = torch.cat(bases) if len(bases) > 1 else bases[0]
    return (base + row0) * per_row + col


def cut_blocks(
    x: torch.Tensor,
    row0: int,
    rows: int,
    specs: Sequence[BlockSpec],
    feats: Sequence[_Feats],
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """:func:`cut_block` of every spec of one destination (``feats[i]`` the i-th spec's).

    Where every spec has one dim and ``x`` is contiguous, ONE gather of whole vectors writes
    every block (:func:`cut_index`; the blocks are consecutive slices of its result) instead
    of an index built and a gather per block; the values are the same (exact copies).

    Args:
        x: The ``[B, D]`` output.
        row0: The destination's first row.
        rows: Its batch.
        specs: The table shards.
        feats: Per spec, per feature: (rows, selected bags or None).

    Returns:
        The blocks, and the gather's index (None where the per-block path ran), on ``x``'s
        device: the call's backward places its gradient by it (:func:`place_grad_blocks`).
    """
    d = one_dim([specs])
    if d is None or not specs or not x.is_contiguous() or x.shape[1] % d:
        return [cut_block(x, row0, rows, 0, s, f) for s, f in zip(specs, feats, strict=True)], None
    index = cut_index(x.shape[1] // d, row0, specs, feats, x.device)
    sizes = [sum(r for r, _ in ff) for ff in feats]
    return list(x.view(-1, d).index_select(0, index).split(sizes)), index


def join_blocks(
    blocks: Sequence[torch.Tensor], specs: Sequence[BlockSpec], rows: int
) -> list[torch.Tensor]:
    """Inverse of :func:`cut_block` for one peer: ``[rows, width]`` pieces in column order."""
    return [
        b.view(s.num_features, rows, s.dim).transpose(0, 1).reshape(rows, s.width)
        for b, s in zip(blocks, specs, strict=True)
    ]


def expand_block(
    b: torch.Tensor, spec: BlockSpec, rows: int, feats: Sequence[tuple[int, torch.Tensor | None]]
) -> torch.Tensor:
    """Receiver side of a lookup-deduplicated block: ``[rows, width]``, each deduplicated
    feature's distinct rows gathered back by its inverse index (exact: a gather)."""
    pieces = b.split([r for r, _ in feats])
    out = [p if inv is None else p[inv] for p, (_, inv) in zip(pieces, feats, strict=True)]
    return torch.cat(out, dim=1) if out else b.new_empty((rows, 0))


def reduce_grad_block(
    g: torch.Tensor, col0: int, spec: BlockSpec, feats: Sequence[tuple[int, torch.Tensor | None]]
) -> torch.Tensor:
    """Backward of :func:`expand_block`: the gradient rows summed per distinct bag."""
    pieces = []
    for f, (r, inv) in enumerate(feats):
        c = col0 + spec.col_offset + f * spec.dim
        gf = g[:, c : c + spec.dim]
        if inv is not None:  # from a contiguous copy: index_add_ of a column slice is ~3x slower
            gf = gf.new_zeros((r, spec.dim)).index_add_(0, inv, gf.contiguous())
        pieces.append(gf)
    return torch.cat(pieces) if pieces else g.new_empty((0, spec.dim))


def place_grad_block(
    b: torch.Tensor, spec: BlockSpec, rows: int, feats: Sequence[tuple[int, torch.Tensor | None]]
) -> torch.Tensor:
    """Owner side of a deduplicated gradient block (backward of :func:`cut_block` with
    ``feats``): ``[rows, width]``. A feature's summed rows go to its first rows (select None:
    the lookup dedupe's distinct ids, the empty bags past them zero) or to its selected bags
    (the exact dedupe: every other copy of a distinct bag gets zero, so the lookup's backward
    applies each distinct bag's summed gradient once, as TorchRec applies the sum of its
    copies' gradients)."""
    out = []
    for p, (r, sel) in zip(b.split([r for r, _ in feats]), feats, strict=True):
        if sel is not None:
            out.append(p.new_zeros((rows, spec.dim)).index_copy_(0, sel, p))
        else:
            out.append(p if r == rows else torch.cat([p, p.new_zeros((rows - r, spec.dim))]))
    return torch.cat(out, dim=1) if out else b.new_empty((rows, 0))


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """Row indices ``0..n-1`` (a feature that is not deduplicated: every row, in order)."""
    return torch.arange(n, dtype=torch.int64, device=device)


def one_dim(specs_per_peer: Sequence[Sequence[BlockSpec]]) -> int | None:
    """The column count every feature of ``specs_per_peer`` shares, or None (mixed dims)."""
    dims = {s.dim for specs in specs_per_peer for s in specs}
    return dims.pop() if len(dims) == 1 else None


def expand_index(
    feats_per_peer: Sequence[Sequence[_Feats]], rows: int, device: torch.device
) -> torch.Tensor:
    """The receiver's one index of the batched :func:`expand_blocks` and
    :func:`reduce_grad_blocks` (every feature of one dim): for each output vector (row-major
    over ``[rows, features]``), its row in the received distinct rows joined in order. The
    expand gathers by it and the reduce sums by it, so a call builds it once for both.

    Args:
        feats_per_peer: Per source, per shard, per feature: (rows, inverse index or None).
        rows: This rank's batch.
        device: Where the inverse indices live.

    Returns:
        int64 ``[rows * features]``.
    """
    feats = [f for fs in feats_per_peer for ff in fs for f in ff]
    starts = itertools.accumulate((r for r, _ in feats), initial=0)
    idx = torch.cat(
        [
            o + (_arange(rows, device) if inv is None else inv)
            for o, (_, inv) in zip(starts, feats, strict=False)
        ]
    )
    return idx.view(len(feats), rows).t().reshape(-1)


def expand_blocks(
    blocks: Sequence[Sequence[torch.Tensor]],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    feats_per_peer: Sequence[Sequence[_Feats]],
    rows: int,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`expand_block` of every received block, joined in column order: ``[rows, D]``.

    Where every feature has one dim, one gather writes the output (the distinct rows joined,
    each output vector picked by its feature's inverse index) instead of a gather per feature
    joined by a cat; the values are the same (exact copies).

    Args:
        blocks: Per source, per its table shard: the received (distinct) rows.
        specs_per_peer: Per source, its table shards.
        feats_per_peer: Per source, per shard, per feature: (rows, inverse index or None).
        rows: This rank's batch.
        index: :func:`expand_index` of ``feats_per_peer`` if already built, else None.

    Returns:
        The received output.
    """
    d = one_dim(specs_per_peer)
    flat = [b for bs in blocks for b in bs]
    if d is None or not flat:
        pieces = [
            expand_block(b, s, rows, f)
            for bs, specs, feats in zip(blocks, specs_per_peer, feats_per_peer, strict=True)
            for b, s, f in zip(bs, specs, feats, strict=True)
        ]
        return torch.cat(pieces, dim=1) if pieces else torch.empty((rows, 0))
    src = torch.cat(flat)
    if index is None:
        index = expand_index(feats_per_peer, rows, src.device)
    return src.index_select(0, index).view(rows, -1)


def reduce_grad_blocks(
    g: torch.Tensor,
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    feats_per_peer: Sequence[Sequence[_Feats]],
    index: torch.Tensor | None = None,
) -> list[list[torch.Tensor]]:
    """:func:`reduce_grad_block` of every source's table shards (``g``'s columns in order).

    Where every feature has one dim, one ``index_add_`` over ``g`` (as ``[B * F, d]``) sums
    every feature's rows into one buffer, which the blocks view: each sum adds the same rows in
    the same order as a per-feature ``index_add_`` (bit-identical), with no column copies.

    Args:
        g: The ``[B, D]`` gradient of the received output.
        specs_per_peer: Per source, its table shards (their columns follow each other in ``g``).
        feats_per_peer: Per source, per shard, per feature: (rows, inverse index or None).
        index: :func:`expand_index` of ``feats_per_peer`` if already built (the call's
            forward expanded by it), else None.

    Returns:
        Per source, per shard: its gradient block.
    """
    d = one_dim(specs_per_peer)
    feats = [f for fs in feats_per_peer for ff in fs for f in ff]
    if d is None or not feats or g.shape[1] != len(feats) * d:
        col_bases = itertools.accumulate(
            (sum(s.width for s in ss) for ss in specs_per_peer), initial=0
        )
        return [
            [reduce_grad_block(g, c0, s, f) for s, f in zip(specs, fs, strict=True)]
            for c0, specs, fs in zip(col_bases, specs_per_peer, feats_per_peer, strict=False)
        ]
    rows = g.shape[0]
    starts = list(itertools.accumulate((r for r, _ in feats), initial=0))
    if index is None:
        index = expand_index(feats_per_peer, rows, g.device)
    out = g.new_zeros((starts[-1], d))
    flat_g = g.contiguous().view(-1, d)
    out.index_add_(0, index, flat_g)
    for j, (o, (_, inv)) in enumerate(zip(starts, feats, strict=False)):
        if inv is None:  # copied as it is (the sum with zero would turn -0.0 into 0.0)
            out[o : o + rows] = g[:, j * d : (j + 1) * d]
    sizes = [sum(r for r, _ in ff) for fs in feats_per_peer for ff in fs]
    it = iter(out.split(sizes))
    return [[next(it) for _ in specs] for specs in specs_per_peer]


def place_grad_blocks(
    blocks: Sequence[Sequence[torch.Tensor]],
    specs: Sequence[BlockSpec],
    feats_per_peer: Sequence[Sequence[_Feats]],
    rows_per_peer: Sequence[int],
    index: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """:func:`place_grad_block` of every peer's blocks, joined: the owner's ``[B, D]`` gradient.

    Where every feature has one dim, the output (as ``[B * F, d]``) is zeroed once and each
    block's rows are copied to their bags in one ``index_copy_`` (the same values: copies and
    zeros) instead of a zeroed piece per feature joined by two cats.

    Args:
        blocks: Per peer, per local table shard: the received gradient rows.
        specs: This rank's table shards.
        feats_per_peer: Per peer, per shard, per feature: (rows, selected bags or None).
        rows_per_peer: Each peer's batch.
        index: Per peer, the :func:`cut_blocks` index its forward blocks were cut by (None:
            built here): the gradient rows go back where those rows came from.

    Returns:
        The gradient of this rank's output.
    """
    d = one_dim([specs])
    n = sum(s.num_features for s in specs)
    flat = [b for bs in blocks for b in bs]
    b_all = sum(rows_per_peer)
    if d is None or not flat:
        pieces = []
        for bs, fs, rows in zip(blocks, feats_per_peer, rows_per_peer, strict=True):
            parts = [place_grad_block(b, s, rows, f) for b, s, f in zip(bs, specs, fs, strict=True)]
            pieces.append(torch.cat(parts, dim=1) if parts else torch.empty((rows, 0)))
        return torch.cat(pieces)
    out = flat[0].new_zeros((b_all * n, d))
    row0 = 0
    for p, (bs, fs, rows) in enumerate(zip(blocks, feats_per_peer, rows_per_peer, strict=True)):
        idx = index[p] if index is not None else None
        if idx is None:
            idx = cut_index(n, row0, specs, fs, out.device)
        at = 0
        for b in bs:
            out.index_copy_(0, idx[at : at + b.shape[0]], b)
            at += b.shape[0]
        row0 += rows
    return out.view(b_all, n * d)


def peer_blocks(
    x: torch.Tensor,
    row_starts: Sequence[int],
    rows: Sequence[int],
    col_bases: Sequence[int],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
) -> list[list[torch.Tensor]]:
    """Cuts ``x`` into the blocks for each peer ``p``: its ``rows[p]`` rows from ``row_starts[p]``,
    its table shards ``specs_per_peer[p]`` at column ``col_bases[p]``."""
    return [
        [cut_block(x, r0, n, c0, s) for s in specs]
        for r0, n, c0, specs in zip(row_starts, rows, col_bases, specs_per_peer, strict=True)
    ]


def size_entry_words(
    specs: Sequence[BlockSpec], info: LossyAll2AllPooledInfo, peer: int, my_rank: int
) -> int:
    """Words of one peer's entry in the size exchange: its size, then its codec skeleton.

    Args:
        specs: The specs of the blocks the payload carries.
        info: Compress flags and raw peers.
        peer: The peer the entry is exchanged with.
        my_rank: This rank (its own blocks skip the codec: size only).

    Returns:
        Word count.
    """
    if peer == my_rank:
        return entry_words(0)
    n_cast = sum(1 for s in specs if info.cast_dtype(peer, s.table) is not None)
    return entry_words(sum(1 for s in specs if info.codes(peer, s.table)), n_cast)


def entry_words(n_coded: int, n_cast: int = 0) -> int:
    """Words of a size-exchange entry whose payload carries ``n_coded`` codec blocks and
    ``n_cast`` blocks of cast tables.

    Args:
        n_coded: Codec blocks of the payload.
        n_cast: Blocks of cast tables (each cast or exact, a flag says which).

    Returns:
        Word count: its size, then its cast flags, then its codec skeleton.
    """
    return 1 + word_count(n_cast) + (skeleton_words(n_coded) if n_coded else 0)


@dataclass(frozen=True)
class EncodePlan:
    """What :func:`start_encode` derives from the layout alone (specs, compress flags, sending
    rank): built once per dist, not per call (:class:`LayoutPlans`).

    Attributes:
        peers: The destinations that get a payload built (every one but the sending rank).
        coded: Per destination of ``peers``, the indices of its codec blocks (its codec group).
        raw: (destination, block index, spec) of every raw block, in order.
        tables: The codec blocks' tables, group after group (the codec's flat input order).
        distinct: Those tables once each (the forward asks the bound provider once per table).
        table_at: Index in ``distinct`` of each codec block's table.
        group_of: Destination to its codec group, for destinations with codec blocks.
        meta_splits: Words of the size exchange per destination (:func:`size_entry_words`).
        casts: Per block of ``raw``, its cast dtype where its table is cast, else None.
    """

    peers: tuple[int, ...]
    coded: tuple[tuple[int, ...], ...]
    raw: tuple[tuple[int, int, BlockSpec], ...]
    tables: tuple[str, ...]
    distinct: tuple[str, ...]
    table_at: tuple[int, ...]
    group_of: dict[int, int]
    meta_splits: tuple[int, ...]
    casts: tuple[torch.dtype | None, ...] = ()

    @property
    def cast_at(self) -> tuple[int, ...]:
        """Indices in ``raw`` of the blocks of cast tables, in order."""
        return tuple(k for k, dt in enumerate(self.casts) if dt is not None)


@dataclass(frozen=True)
class LayoutPlans:
    """The encode plans a dist's layout fixes, built once when the dist is built
    (:func:`layout_plans`) and handed to each call in its info: no plan is built per call and
    none is cached in module state.

    Attributes:
        layout: Per rank, its table shards (the dist's layout).
        my_rank: The sending rank.
        send_own: Sending this rank's shards to every peer (the forward).
        send_back: Sending every peer the blocks of its own shards (the gradient).
    """

    layout: tuple[tuple[BlockSpec, ...], ...]
    my_rank: int
    send_own: EncodePlan
    send_back: EncodePlan

    def plan_for(
        self, specs_per_peer: Sequence[Sequence[BlockSpec]], my_rank: int | None
    ) -> EncodePlan | None:
        """The plan of sending blocks of ``specs_per_peer`` from ``my_rank``, if it is one of
        the two this layout fixes.

        Args:
            specs_per_peer: Per destination, the specs of its blocks.
            my_rank: The sending rank.

        Returns:
            The plan, or None for another layout.
        """
        if my_rank != self.my_rank or len(specs_per_peer) != len(self.layout):
            return None
        own = self.layout[my_rank]
        if all(specs == own for specs in specs_per_peer):
            return self.send_own
        if all(a == b for a, b in zip(specs_per_peer, self.layout, strict=True)):
            return self.send_back
        return None


def layout_plans(
    layout: Sequence[Sequence[BlockSpec]],
    compress: dict[str, bool],
    my_rank: int,
    raw_peers: frozenset[int] = frozenset(),
    casts: dict[str, torch.dtype] | None = None,
) -> LayoutPlans:
    """A dist's :class:`LayoutPlans` (call it once, when the dist is built).

    Args:
        layout: Per rank, its table shards.
        compress: Table name to whether its blocks go through the codec (not changed later).
        my_rank: The sending rank.
        raw_peers: Destinations whose blocks all travel raw.
        casts: The cast tables' dtypes (:attr:`LossyAll2AllPooledInfo.casts`), or None.

    Returns:
        The plans.
    """
    specs = tuple(tuple(s) for s in layout)
    own = [specs[my_rank]] * len(specs)
    return LayoutPlans(
        layout=specs,
        my_rank=my_rank,
        send_own=build_encode_plan(own, compress, my_rank, raw_peers, casts),
        send_back=build_encode_plan(specs, compress, my_rank, raw_peers, casts),
    )


def build_encode_plan(
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    compress: dict[str, bool],
    my_rank: int | None,
    raw_peers: frozenset[int],
    casts: dict[str, torch.dtype] | None = None,
) -> EncodePlan:
    """The plan of sending blocks of ``specs_per_peer`` from ``my_rank``.

    Args:
        specs_per_peer: Per destination, the specs of its blocks.
        compress: Table name to whether its blocks go through the codec.
        my_rank: The sending rank (its blocks skip the codec), or None.
        raw_peers: Destinations whose blocks all travel raw.
        casts: The cast tables' dtypes, or None.

    Returns:
        The plan.
    """
    peers = tuple(p for p in range(len(specs_per_peer)) if p != my_rank)

    def codes(p: int, s: BlockSpec) -> bool:
        return compress[s.table] and p not in raw_peers

    coded = tuple(tuple(i for i, s in enumerate(specs_per_peer[p]) if codes(p, s)) for p in peers)
    raw = tuple(
        (p, i, s) for p in peers for i, s in enumerate(specs_per_peer[p]) if not codes(p, s)
    )
    tables = tuple(
        specs_per_peer[p][i].table for p, idx in zip(peers, coded, strict=True) for i in idx
    )
    distinct = tuple(dict.fromkeys(tables))
    casts = casts or {}
    cast_of = tuple(None if p in raw_peers else casts.get(s.table) for p, _, s in raw)
    meta_splits = [1] * len(specs_per_peer)
    for p, idx in zip(peers, coded, strict=True):
        n_cast = sum(
            1 for (q, _, _), dt in zip(raw, cast_of, strict=True) if q == p and dt is not None
        )
        meta_splits[p] = entry_words(len(idx), n_cast)
    return EncodePlan(
        peers=peers,
        coded=coded,
        raw=raw,
        tables=tables,
        distinct=distinct,
        table_at=tuple(distinct.index(t) for t in tables),
        group_of={p: g for g, (p, idx) in enumerate(zip(peers, coded, strict=True)) if idx},
        meta_splits=tuple(meta_splits),
        casts=cast_of,
    )
