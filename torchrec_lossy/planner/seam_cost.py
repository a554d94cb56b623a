"""The seam's fixed cost per step: its work around the wire that TorchRec's path does not do.

Every step through this project's pooled all-to-all cuts each destination's rows out of the
local output (under the exact output dedupe: the first bag of each distinct bag), expands the
received distinct rows back to the batch, sums the gradient per distinct bag and puts the
owner's gradient back in place, and joins the pieces; TorchRec's path only permutes the
received tensor once per direction. That work runs over the whole batch (the own block too),
whatever the format and the link, so ``comms.format: auto`` prices it as a fixed ms per step
(:attr:`~torchrec_lossy.planner.speeds.Speeds.seam_ms`), not per wire byte: at start-up
:func:`time_seam_step` times the seam's own functions (``pooled_blocks``' cut, expand,
reduce and place) on one rank's Criteo-like step against TorchRec's permute copies, the two
interleaved trial by trial (:func:`~torchrec_lossy.planner.speeds.interleaved_best`).

Each exchange has a fixed cost of its own too: the seam's all-to-all (its call, the payload's
framing, the one-round slots' header and history, the autograd steps, the blocks' cut and join)
against TorchRec's one ``all_to_all_single`` per direction. :func:`time_exchange_ms` measures it
on the run's process group, the ranks running it together, with the seam's own exchange
(``alltoall_pooled_lossy`` with a slot history, every block raw, every row sent: the same bytes
as TorchRec's) on small blocks of the layout, so the time is the fixed part rather than the
bytes; it replaces the two collective rounds the model charged before the one-round slots. The
raw path's cost per byte (framing, checksums) is not in it: under load it is timed as high as
the fixed part, and priced per raw byte it would need the two measured apart (a size sweep).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchrec_lossy.config import EmbeddingTableConfig
from torchrec_lossy.profile_range import profile_range

__all__ = ["time_exchange_ms", "time_seam_step"]

# One feature's dedupe state: (distinct rows, inverse or first-bag index), as the seam's
# ``feats`` (None: every row travels).
_Feats = list[tuple[int, torch.Tensor | None]]


def _dedupe_state(table: EmbeddingTableConfig, rows: int, seed: int) -> tuple[_Feats, _Feats]:
    """A destination's single-hot batch of ``table``: (inverse feats, first-bag feats)."""
    from torchrec_lossy import traffic

    ids = traffic.sample_ids(table.num_embeddings, rows, torch.Generator().manual_seed(seed))
    uniq, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((uniq.numel(),), rows, dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(rows), reduce="amin")
    return [(uniq.numel(), inverse)], [(uniq.numel(), first)]


def _specs(tables: Sequence[EmbeddingTableConfig]) -> list[Any]:
    """One single-feature block per table, side by side in the columns."""
    from torchrec_lossy.distributed.pooled_blocks import BlockSpec

    cols = itertools.accumulate((t.embedding_dim for t in tables), initial=0)
    return [BlockSpec(t.name, c, 1, t.embedding_dim) for t, c in zip(tables, cols, strict=False)]


def time_seam_step(
    tables: Sequence[EmbeddingTableConfig],
    rows: int,
    world_size: int,
    device: torch.device,
    dedupe: bool = True,
    reps: int = 3,
) -> tuple[float, float]:
    """Times one rank's step of the seam's layout work and TorchRec's, wire and codec excluded.

    The tables are spread table-wise over ``world_size`` ranks (this rank owns every
    ``world_size``-th one); every rank has ``rows`` rows (its batch). Per step the seam's forward
    cuts its tables' rows for every destination and expands the received rows of every table;
    its backward sums the gradient per distinct bag and places the owner's gradient; TorchRec
    permutes the received output once per direction.

    Args:
        tables: The tables (single-hot features, their sizes shape the Zipf ids).
        rows: Rows per rank: small, so the time is the fixed part.
        world_size: Ranks of the all-to-all (>= 1).
        device: Where the tensors live.
        dedupe: Whether the seam runs the exact output dedupe (``input_dist.dedupe_outputs`` /
            ``dedupe_lookups``); else it cuts and joins every row.
        reps: Timed runs (the best counts).

    Returns:
        (seam ms, TorchRec ms) per step on this rank.
    """
    from torchrec_lossy.distributed.pooled_blocks import (
        cut_block,
        cut_blocks,
        expand_blocks,
        expand_index,
        join_blocks,
        one_dim,
        place_grad_blocks,
        reduce_grad_blocks,
    )

    if world_size < 1 or rows < 1 or not tables:
        raise ValueError(
            f"time_seam_step: world_size={world_size}, rows={rows}, {len(tables)} tables: need "
            "at least one of each"
        )
    w = world_size
    local = list(tables[::w])
    specs = _specs(local)
    specs_all = _specs(tables)
    # Dedupe state per (destination, local table) and per (table, this rank's batch).
    own = [[_dedupe_state(t, rows, 97 * p + i) for i, t in enumerate(local)] for p in range(w)]
    mine = [_dedupe_state(t, rows, 131 + i) for i, t in enumerate(tables)]
    g = torch.Generator().manual_seed(0)
    d_local, d_all = sum(s.dim for s in specs), sum(s.dim for s in specs_all)
    x = torch.randn(w * rows, d_local, generator=g).to(device)  # this rank's output, all batches
    grad = torch.randn(rows, d_all, generator=g).to(device)  # the gradient of its own batch
    arrived = [  # the distinct rows of each table's features, as they arrive
        torch.randn(f[0][0][0], s.dim, generator=g).to(device)
        for s, f in zip(specs_all, mine, strict=True)
    ]
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def seam() -> None:
        if not dedupe:  # cut every row, join the received blocks
            sent = [[cut_block(x, p * rows, rows, 0, s) for s in specs] for p in range(w)]
            torch.cat([torch.cat(join_blocks(bs, specs, rows), dim=1) for bs in sent])
            return
        # Forward: the owner cuts each destination's distinct bags, the receiver expands (as
        # comm_ops.PooledSteps: the call's indices kept for its backward).
        cut = [cut_blocks(x, p * rows, rows, specs, [f[1] for f in own[p]]) for p in range(w)]
        feats = [[f[0] for f in mine]]
        index = expand_index(feats, rows, device) if one_dim([specs_all]) else None
        expand_blocks([arrived], [specs_all], feats, rows, index)
        # Backward: the receiver sums per distinct bag, the owner places (the cut blocks stand
        # in for the gradient blocks it receives: the same shapes).
        reduce_grad_blocks(grad, [specs_all], feats, index)
        sent, cut_index = [bs for bs, _ in cut], [i for _, i in cut]
        place_grad_blocks(
            sent, specs, [[f[1] for f in own[p]] for p in range(w)], [rows] * w, cut_index
        )

    received = torch.randn(w, rows, -(-d_all // w), generator=g).to(device)

    def torchrec() -> None:  # its received output and its gradient: one permute copy each
        received.transpose(0, 1).reshape(rows, -1)
        grad.t().contiguous()

    from torchrec_lossy.planner.speeds import interleaved_best

    with profile_range("## lossy_a2a calibrate seam step ##"):
        seam(), torchrec()  # first calls load kernels: not timed
        secs = interleaved_best({"seam": seam, "torchrec": torchrec}, reps, sync)
    return 1e3 * secs["seam"], 1e3 * secs["torchrec"]


def time_exchange_ms(
    tables: Sequence[EmbeddingTableConfig],
    group: dist.ProcessGroup,
    device: torch.device,
    rows: int = 64,
    reps: int = 5,
) -> tuple[float, float]:
    """Times a forward and its gradient through the seam's exchange and TorchRec's, on
    ``group`` (a collective: every rank of the group calls it, with the same arguments).

    The tables are spread table-wise (table ``t`` on rank ``t % world``); the seam runs
    ``alltoall_pooled_lossy`` with the dist's slot history (after its first call one round per
    direction, as in training) and every block raw, TorchRec one ``all_to_all_single`` of the
    same rows per direction (the same bytes: their difference is the seam's own fixed cost);
    the two interleaved call by call (the best of ``reps`` each, the ranks meeting at a barrier
    around each call, so the slowest rank's time counts).

    Args:
        tables: The tables (their dims).
        group: The process group of the all-to-all (>= 2 ranks).
        device: Where the tensors live.
        rows: Rows per rank: small, so the time is the fixed part.
        reps: Timed calls of each (the best counts).

    Returns:
        (seam ms, TorchRec ms) per forward + gradient.
    """
    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed.call_ledger import CallLedger
    from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy
    from torchrec_lossy.distributed.comms import LossyComms, StaticBounds
    from torchrec_lossy.distributed.exchange_slots import SlotHistory
    from torchrec_lossy.distributed.pooled_blocks import LossyAll2AllPooledInfo, layout_plans
    from torchrec_lossy.planner.speeds import interleaved_best

    w, rank = dist.get_world_size(group), dist.get_rank(group)
    names = [t.name for t in tables]
    config = LossyCommsConfig()
    comms = LossyComms(config=config, bounds=StaticBounds(names, config))
    layout = [tuple(_specs(tables[r::w])) for r in range(w)]  # as a dist's: its plans apply
    raw = dict.fromkeys(names, False)
    info = LossyAll2AllPooledInfo(
        batch_size_per_rank=[rows] * w,
        layout=layout,
        comms=comms,
        ledger=CallLedger(),
        compress=raw,
        plans=layout_plans(layout, raw, rank),
        slots=SlotHistory(w),
    )
    dims = [sum(s.dim for s in specs) for specs in layout]
    x = torch.randn(rows * w, dims[rank], generator=torch.Generator().manual_seed(rank))
    x = x.to(device)
    mine, theirs = [rows * dims[rank]] * w, [rows * d for d in dims]
    recv = torch.empty(sum(theirs), device=device)
    back = torch.empty(sum(mine), device=device)

    def seam() -> None:
        xr = x.detach().requires_grad_()
        y = alltoall_pooled_lossy(xr, info, group).wait()
        y.backward(torch.ones_like(y))

    def torchrec() -> None:  # each rank's columns differ: flat, uneven splits
        dist.all_to_all_single(recv, x.reshape(-1), theirs, mine, group=group)
        dist.all_to_all_single(back, recv, mine, theirs, group=group)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group)

    with profile_range("## lossy_a2a calibrate exchange ##"):
        seam(), seam(), torchrec()  # the first seam call fills the slot history: not timed
        secs = interleaved_best({"seam": seam, "torchrec": torchrec}, reps, sync)
    return 1e3 * secs["seam"], 1e3 * secs["torchrec"]
