"""The encoder of the compressed all-to-alls (the lossy wire's, driven by :mod:`.exchange`).

The sender's blocks (one per destination and local table shard, cut by :mod:`.pooled_blocks`:
a table with ``F`` features gives ``F * B_d`` rows of its width) become one payload per
destination, each block with its table's bound: where the destination gets blocks of cast
tables, their cast flags first (:mod:`.cast_blocks`, padded to 16 bytes), then the blocks that
skip the codec (``compress=False``: exact, or cast where flagged), each padded to 16 bytes,
then the codec payload. The receiver knows every block's shape from the sharding layout and
its cast flags from the size exchange (or the payload's own), so no other framing travels.
No collective, no autograd, no telemetry written (it goes to the call's
:class:`.exchange_record.ExchangeRecord`). docs/sharder.md, "How the all-to-all works".
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np
import torch

from torchrec_lossy.codec import BlockStats, host_sync
from torchrec_lossy.codec import warm_up_host as warm_up_codec
from torchrec_lossy.codec.bounds import BoundKind, absolute_bounds
from torchrec_lossy.codec.container import upload
from torchrec_lossy.codec.grouped import GroupedPayloads, PendingGroups, start_compress_blocks
from torchrec_lossy.codec.pipeline import on_device
from torchrec_lossy.config import CodecConfig, ErrorBound, LossyCommsConfig
from torchrec_lossy.distributed import error_sample
from torchrec_lossy.distributed.call_ledger import CallRecord
from torchrec_lossy.distributed.cast_blocks import admissible, flag_words, pack_flags, word_count
from torchrec_lossy.distributed.exchange_record import BlockRecords, ExchangeRecord
from torchrec_lossy.distributed.guard import guarded_bound
from torchrec_lossy.distributed.pooled_blocks import (
    BlockSpec,
    EncodePlan,
    LossyAll2AllPooledInfo,
    build_encode_plan,
)
from torchrec_lossy.distributed.stats import Direction, LossyCommsStats
from torchrec_lossy.profile_range import profile_range

_log = logging.getLogger(__name__)
ALIGN = 16  # byte alignment of raw blocks and of payloads handed to the decoder


def padded_size(nbytes: int) -> int:
    """Bytes a raw block of ``nbytes`` takes in a payload (padded to :data:`ALIGN`)."""
    return -(-nbytes // ALIGN) * ALIGN


def abs_bounds(blocks: Sequence[torch.Tensor], bounds: Sequence[ErrorBound]) -> list[float]:
    """Absolute bound of each block: ``value`` or ``value * (max - min)`` of the block (a
    per-value bound as it is: it has no absolute form).

    The codec's rule (``torchrec_lossy.codec.bounds``), which ``compress_groups`` applies on
    the device; this host form is for callers that need the values before encoding.

    Args:
        blocks: 2-D float tensors.
        bounds: One per block.

    Returns:
        Absolute bounds.
    """
    return absolute_bounds(blocks, [eb.value for eb in bounds], bound_kinds(bounds))


def bound_kinds(bounds: Sequence[ErrorBound]) -> list[BoundKind]:
    """The codec's ``BoundKind`` of each bound.

    Args:
        bounds: Error bounds.

    Returns:
        One kind per bound.
    """
    return [BoundKind.of(eb.mode) for eb in bounds]


@dataclass
class PendingPayloads:
    """Encoded payloads waiting for the one host read of their all-to-all.

    Attributes:
        device_sizes: int64 bytes of each destination's payload, on the device (no sync).
        readback: int64 values the host must read before the payloads exist (may be empty:
            the codec's, then on a device the cast flags); the exchange reads them together
            with the received sizes, in one copy.
        finish: Builds the payloads (and records the telemetry) from ``readback``'s values.
        meta: int64 words to send each destination in the size exchange, back to back: its
            payload size, then its cast flags, then its codec payload's skeleton
            (:func:`size_entry_words` long), on the device; the receiver decodes with them and
            reads nothing back.
        meta_splits: Words of ``meta`` per destination.
        record: The call's record (its number, step, exactness).
        telemetry: The call's telemetry, filled by ``finish``.
        stats: Where :meth:`read` writes it (outside an exchange).
    """

    device_sizes: torch.Tensor
    readback: torch.Tensor
    finish: Callable[[Sequence[int]], list[torch.Tensor]]
    meta: torch.Tensor
    meta_splits: list[int]
    record: CallRecord
    telemetry: ExchangeRecord
    stats: LossyCommsStats

    def read(self) -> list[torch.Tensor]:
        """The payloads at once, without an exchange: reads ``readback`` (one host read, if
        any), calls ``finish`` and writes the call's telemetry (as an exchange would).

        Returns:
            One payload per destination.
        """
        host = host_sync.to_host(self.readback).tolist() if self.readback.numel() else []
        payloads = self.finish(host)
        self.telemetry.write(self.stats)
        return payloads


def _codec_config(config: LossyCommsConfig, record: CallRecord, rank: int) -> CodecConfig:
    """The codec knobs of one all-to-all: the forward's rounding as configured
    (``codec.rounding``), the backward's ``backward_rounding``. Stochastic rounding is seeded
    per (seed, call, sending rank), so every call draws afresh (a seed fixed across calls would
    round each position the same way every step) and a rerun draws the same. Within the call,
    blocks draw by their index in their payload."""
    if record.direction == "fwd":
        rounding, seed = config.codec.rounding, config.codec.seed
    else:
        rounding, seed = config.backward_rounding, config.backward_seed
    if rounding == config.codec.rounding == "nearest":
        return config.codec
    if rounding == "nearest":  # a stochastic forward's codec knobs, for a nearest backward
        return dataclasses.replace(config.codec, rounding="nearest")
    # Tuple hashes of ints are the same in every process (no hash randomization for ints).
    call_seed = hash((seed, record.call, rank)) & ((1 << 63) - 1)
    return dataclasses.replace(config.codec, rounding=rounding, seed=call_seed)


ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)
T = TypeVar("T")


def _size_exchange_words(
    sizes: ArrayT,
    extras: dict[int, list[ArrayT]],
    cat: Callable[[list[ArrayT]], ArrayT],
) -> ArrayT:
    """The size exchange's words (:class:`PendingPayloads` ``meta``), host or device alike.

    Args:
        sizes: int64 payload bytes per destination.
        extras: Per destination with cast blocks or codec blocks, its cast flag words and
            codec skeleton words (those it has, in that order).
        cat: Joins the pieces (``np.concatenate`` or ``torch.cat``).

    Returns:
        Per destination its size, then its extras.
    """
    parts = []
    first = 0  # the first size not in a part yet: runs of sizes go in one slice
    for p in range(len(sizes)):
        extra = extras.get(p)
        if extra:
            parts += [sizes[first : p + 1], *extra]
            first = p + 1
    if first < len(sizes):
        parts.append(sizes[first:])
    return cat(parts) if parts else sizes


def _warn_exact(
    info: LossyAll2AllPooledInfo, direction: Direction, table: str, bs: BlockStats
) -> None:
    """Logs once per table when a block with a bound > 0 had to travel exactly."""
    key = (direction, table)
    if key in info.comms.warned_exact:
        return
    info.comms.warned_exact.add(key)
    _log.warning(
        "lossy all-to-all (%s): a %dx%d block of table %s travelled exactly (mode %s) although "
        "its bound is %.3g: quantizing could not meet the bound (a bound below a float32 step, "
        "or values too far from 0 in steps) or did not pay. Raise the bound, or set "
        "compress=False for the table (logged once per table).",
        direction,
        bs.rows,
        bs.dim,
        table,
        bs.mode,
        bs.bound,
    )


def start_encode(
    direction: Direction,
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    info: LossyAll2AllPooledInfo,
    device: torch.device,
    my_rank: int | None = None,
    record: CallRecord | None = None,
    telemetry: ExchangeRecord | None = None,
) -> PendingPayloads:
    """Encodes every peer's blocks, up to the host read (none made here).

    Every peer's codec blocks go through ONE ``start_compress_blocks`` call (relative bounds are
    resolved there, on the device path on the device). The block a rank sends to itself
    (``my_rank``) does not go through the codec: its payload is empty (zero wire bytes), the
    receiver takes the blocks as they are (``self_blocks`` of ``pooled_decode.decode_call``),
    and its bytes are counted apart (``LossyCommsStats.self_bytes``). The call's telemetry goes
    to ``telemetry`` (the exchange writes it); nothing is written to the stats here.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        blocks_per_peer: Per destination, its blocks (one per spec).
        specs_per_peer: Per destination, the specs of its blocks.
        info: Layout, compress flags and comms state.
        device: Where the payloads and sizes live.
        my_rank: This rank (its own blocks skip the codec), or None to encode every peer.
        record: The call's record (the exchange draws it from the module's ledger); None:
            drawn here, as the exchange would (an encode outside an exchange: tests,
            benchmarks).
        telemetry: The exchange's record to fill; None: a new one, which
            :meth:`PendingPayloads.read` writes (an encode outside an exchange).

    Returns:
        The pending payloads: read ``readback`` (with the exchange's received sizes) and call
        ``finish``, or call ``read`` to do both without an exchange.
    """
    start = time.perf_counter()
    comms = info.comms
    if record is None:  # a call outside an exchange (tests, benchmarks) draws as one would
        record = info.ledger.start(direction, direction == "fwd" and info.exact_forward)
    if telemetry is None:
        telemetry = ExchangeRecord(direction)
    plan = _call_plan(info, blocks_per_peer, specs_per_peer, my_rank, telemetry)
    n_peers = len(blocks_per_peer)
    with profile_range(f"## lossy_a2a {direction} encode ##"):
        pending = _start_codec(blocks_per_peer, info, plan, record, my_rank)
        casts = _start_casts(blocks_per_peer, info, plan, record, device)
        raw_parts = None  # built once the cast flags are on the host (a device's: by finish)
        if casts.host is not None:
            raw_parts = _raw_parts(plan, blocks_per_peer, n_peers, device, casts.host)
        device_sizes, meta = _size_words(pending, plan, raw_parts, casts, blocks_per_peer, device)
    readback = pending.readback
    if casts.host is None:  # a device's cast flags ride the exchange's one read
        readback = torch.cat([readback, casts.flags])
    encode = _EncodeCall(
        direction=direction,
        blocks_per_peer=blocks_per_peer,
        specs_per_peer=specs_per_peer,
        info=info,
        device=device,
        plan=plan,
        pending=pending,
        raw_parts=raw_parts,
        casts=casts,
        sample=_samples_errors(info, record, device),
        setup_s=time.perf_counter() - start,
        record=record,
        telemetry=telemetry,
    )
    return PendingPayloads(
        device_sizes, readback, encode.finish, meta, list(plan.meta_splits), record, telemetry,
        comms.stats,
    )  # fmt: skip


def _call_plan(
    info: LossyAll2AllPooledInfo,
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    my_rank: int | None,
    telemetry: ExchangeRecord,
) -> EncodePlan:
    """A call's plan (the dist's, else planned for the call), its blocks checked against it,
    and the bytes of the blocks this rank keeps counted in ``telemetry``."""
    plan = info.plans.plan_for(specs_per_peer, my_rank) if info.plans is not None else None
    if plan is None:  # a layout the dist did not plan (tests, benchmarks): plan this call
        plan = build_encode_plan(specs_per_peer, info.compress, my_rank, info.raw_peers, info.casts)
    _check_blocks(plan, blocks_per_peer, specs_per_peer)
    if my_rank is not None and my_rank < len(blocks_per_peer):
        own = blocks_per_peer[my_rank]
        telemetry.self_bytes = sum(b.numel() * b.element_size() for b in own)
    return plan


def _start_codec(
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    info: LossyAll2AllPooledInfo,
    plan: EncodePlan,
    record: CallRecord,
    my_rank: int | None,
    bounds: tuple[list[float], list[BoundKind]] | None = None,
) -> PendingGroups:
    """Starts ONE codec call over every peer's codec blocks (a group per peer).

    The codec's input is flat (group after group): the blocks are 2-D float tensors of the
    layout's shapes on one device, so the codec's own checks are skipped. ``bounds``: the
    codec blocks' bounds already asked for the call (a chunk of it), else asked here.
    """
    flat_blocks = [
        blocks_per_peer[p][i] for p, idx in zip(plan.peers, plan.coded, strict=True) for i in idx
    ]
    if not flat_blocks and not on_device(
        _device_of(blocks_per_peer), info.comms.config.codec.backend
    ):
        # Every block raw (format raw, a raw peer, a re-check's raw switch): no codec group is
        # sent, so the codec is not called (its empty groups' headers would go nowhere).
        return _no_codec_groups()
    values, kinds = bounds or codec_bounds(record, info, plan, len(flat_blocks))
    return start_compress_blocks(
        flat_blocks,
        values,
        [len(idx) for idx in plan.coded],
        _codec_config(info.comms.config, record, my_rank or 0),
        kinds,
    )


def _device_of(blocks_per_peer: Sequence[Sequence[torch.Tensor]]) -> torch.device:
    """The device of a call's blocks (the host where it has none)."""
    for bs in blocks_per_peer:
        for b in bs:
            return b.device
    return torch.device("cpu")


def _no_codec_groups() -> PendingGroups:
    """The host codec's result for a call without codec blocks, without calling it: no group
    is sent (``EncodePlan.group_of`` lists only groups with blocks), so nothing of it is read
    but its empty ``readback`` and ``done``."""
    done = GroupedPayloads(torch.zeros(0, dtype=torch.uint8), [], [], [])
    empty = torch.zeros(0, dtype=torch.int64)
    return PendingGroups(empty, lambda host: done, [], lambda: empty, lambda: empty, done)


def _check_blocks(
    plan: EncodePlan,
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
) -> None:
    """Raises ValueError unless every encoded peer has one block per spec (the plan indexes
    them).

    Args:
        plan: The layout's plan.
        blocks_per_peer: Per destination, its blocks.
        specs_per_peer: Per destination, the specs of its blocks.
    """
    for p in plan.peers:
        if len(blocks_per_peer[p]) != len(specs_per_peer[p]):
            raise ValueError(
                f"destination {p}: {len(blocks_per_peer[p])} blocks for "
                f"{len(specs_per_peer[p])} specs: pass one block per spec"
            )


SampleWhere = Literal["host", "device"] | None


def _samples_errors(
    info: LossyAll2AllPooledInfo, record: CallRecord, device: torch.device
) -> SampleWhere:
    """Whether and where this call's sender decodes its payloads for their error samples
    (telemetry and ``comms.guard``): every ``error_sample_every``-th call, never an exact
    forward. ``"host"``: CPU payloads of the host codec, sampled at once; ``"device"``: the
    device codec's payloads, decoded and summed on the device, their sums read with the
    module's next host read (no read of their own); None: no sample (also CUDA payloads of
    the host codec, staged through the host without triton).

    Args:
        info: Config.
        record: The call's record (its number, exactness).
        device: Where the payloads live.

    Returns:
        Where the sample is taken, or None.
    """
    every = info.comms.config.error_sample_every
    if every <= 0 or record.call % every or record.exact:
        return None
    if on_device(device, info.comms.config.codec.backend):
        return "device"
    return "host" if device.type == "cpu" else None


def codec_bounds(
    record: CallRecord, info: LossyAll2AllPooledInfo, plan: EncodePlan, n_blocks: int
) -> tuple[list[float], list[BoundKind]]:
    """Each codec block's bound: 0 for an exact forward, each table's bound now for the
    forward (an adaptive provider moves them; asked once per table), the backward's for the
    backward, each through :func:`guarded_bound` (the guard's hook) when ``comms.guard`` is on.

    Args:
        record: The call's record (direction, exactness).
        info: Comms state (bound provider, config).
        plan: The layout's plan (the codec blocks' tables).
        n_blocks: Codec blocks of the call.

    Returns:
        Bound values and their kinds, one per codec block.
    """
    if record.exact:
        return [0.0] * n_blocks, [BoundKind.ABSOLUTE] * n_blocks
    comms = info.comms
    if record.direction == "bwd" and not _guarded(record, info):  # one for every gradient block
        eb = comms.config.backward_bound
        return [eb.value] * n_blocks, [BoundKind.of(eb.mode)] * n_blocks
    bounds = table_bounds(record, info, plan.distinct)
    at = plan.table_at
    return [bounds[i].value for i in at], bound_kinds([bounds[i] for i in at])


def _guarded(record: CallRecord, info: LossyAll2AllPooledInfo) -> bool:
    """Whether the guard tightened a table of the call's direction (else today's bounds)."""
    guard = info.comms.guard
    return guard is not None and guard.tightens(record.direction)


def table_bounds(
    record: CallRecord, info: LossyAll2AllPooledInfo, tables: Sequence[str]
) -> list[ErrorBound]:
    """Each table's bound in this call (not exact): the forward's now (an adaptive provider
    moves them; asked once per table and call, which holds its own bounds), the backward's
    ``backward_bound``, each through :func:`guarded_bound` (the guard's hook).

    Args:
        record: The call's record (its direction).
        info: Comms state (bound provider, config, guard).
        tables: Table names.

    Returns:
        One bound per table.
    """
    comms, d = info.comms, record.direction
    guard = comms.guard if _guarded(record, info) else None
    return [
        guarded_bound(
            guard, d, t, comms.bounds.bound(t) if d == "fwd" else comms.config.backward_bound
        )
        for t in tables
    ]


@dataclass(frozen=True)
class _CastFlags:
    """Which blocks of cast tables travel cast in one call (:mod:`.cast_blocks`).

    Attributes:
        flags: int64 per block of the plan's ``cast_at``, 1 where cast, on the blocks' device.
        host: The same flags on the host where known without a read (the host path), else
            None (the device path's: read with the exchange's one host read).
    """

    flags: torch.Tensor
    host: list[bool] | None


def _start_casts(
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    info: LossyAll2AllPooledInfo,
    plan: EncodePlan,
    record: CallRecord,
    device: torch.device,
) -> _CastFlags:
    """The cast flags of the call's blocks of cast tables: each admitted on its own data
    against its table's bound in this call (an exact call casts none).

    Args:
        blocks_per_peer: Per destination, its blocks.
        info: Comms state (bounds).
        plan: The layout's plan (its ``cast_at`` blocks).
        record: The call's record (direction, exactness).
        device: Where the blocks live.

    Returns:
        The flags.
    """
    at = plan.cast_at
    if not at or record.exact:
        return _CastFlags(torch.zeros(len(at), dtype=torch.int64, device=device), [False] * len(at))
    raw = [plan.raw[k] for k in at]
    bounds = table_bounds(record, info, [s.table for _, _, s in raw])
    dtypes = [plan.casts[k] for k in at]
    blocks = [blocks_per_peer[p][i] for p, i, _ in raw]
    flags = admissible(blocks, dtypes, bounds)  # type: ignore[arg-type]
    # The device path (also on CPU tensors with the triton / reference backends) reads the
    # flags with the exchange's one read; the host path has them at once.
    if device.type != "cpu" or on_device(device, info.comms.config.codec.backend):
        return _CastFlags(flags, None)
    return _CastFlags(flags, [bool(f) for f in flags.tolist()])


def _raw_parts(
    plan: EncodePlan,
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    n_peers: int,
    device: torch.device,
    cast: Sequence[bool],
) -> list[list[torch.Tensor]]:
    """Per destination, its cast flags and the bytes of its blocks that skip the codec (cast
    where flagged), each padded to :data:`ALIGN`.

    Args:
        plan: The layout's plan (which blocks skip the codec, which of them are cast tables').
        blocks_per_peer: Per destination, its blocks.
        n_peers: Destinations.
        device: Where the parts are made.
        cast: Per block of the plan's ``cast_at``, whether it travels cast.

    Returns:
        uint8 parts per destination, in order.
    """
    raw_parts: list[list[torch.Tensor]] = [[] for _ in range(n_peers)]
    flag_of = dict(zip(plan.cast_at, cast, strict=True))
    for p, flags in _flags_per_peer(plan, cast).items():
        words = torch.tensor(pack_flags(flags), dtype=torch.int64)
        raw_parts[p].append(_padded_bytes(words, device))
    # A run of a destination's blocks that need no cast and no padding is copied in ONE cat
    # (the same bytes as a padded copy each: they end on ALIGN): a few ops per destination.
    run: list[torch.Tensor] = []
    run_peer = -1
    for k, (p, i, _) in enumerate(plan.raw):
        b = blocks_per_peer[p][i]
        dt = plan.casts[k] if flag_of.get(k) else None
        if dt is None and b.device == device and b.numel() * b.element_size() % ALIGN == 0:
            if p != run_peer or (run and run[0].dtype != b.dtype):
                _flush_run(run, raw_parts[run_peer] if run else [])
                run_peer = p
            run.append(b)
            continue
        _flush_run(run, raw_parts[run_peer] if run else [])
        raw_parts[p].append(_padded_bytes(b, device, b.dtype if dt is None else dt))
    _flush_run(run, raw_parts[run_peer] if run else [])
    return raw_parts


def _flush_run(run: list[torch.Tensor], parts: list[torch.Tensor]) -> None:
    """Appends the bytes of the blocks in ``run`` (one dtype, each ending on :data:`ALIGN`)
    to ``parts`` as one part, and empties ``run``."""
    if run:
        flat = [b.reshape(-1) for b in run]
        parts.append(torch.cat(flat).view(torch.uint8))
        run.clear()


def _padded_bytes(
    b: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``b``'s elements in ``dtype`` (None: its own), as bytes zero-padded to :data:`ALIGN`,
    on ``device``: written once, the cast (if any) in the copy."""
    dtype = b.dtype if dtype is None else dtype
    nbytes = b.numel() * dtype.itemsize
    raw = torch.empty(padded_size(nbytes), dtype=torch.uint8, device=device)
    raw[nbytes:].zero_()
    raw[:nbytes].view(dtype).view(b.shape).copy_(b)
    return raw


def _flags_per_peer(plan: EncodePlan, cast: Sequence[T]) -> dict[int, list[T]]:
    """The plan's ``cast_at`` flags (or anything per such block) grouped per destination."""
    out: dict[int, list[T]] = {}
    for k, f in zip(plan.cast_at, cast, strict=True):
        out.setdefault(plan.raw[k][0], []).append(f)
    return out


def _size_words(
    pending: PendingGroups,
    plan: EncodePlan,
    raw_parts: Sequence[Sequence[torch.Tensor]] | None,
    casts: _CastFlags,
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send sizes and size-exchange words: each destination's cast flags and blocks that skip
    the codec, plus its codec payload (a peer without codec blocks sends none); on the host
    path all of it is known already.

    Args:
        pending: The codec's pending payloads.
        plan: The layout's plan.
        raw_parts: Per destination, its flags and raw parts; None while a device's cast flags
            are unread.
        casts: The call's cast flags.
        blocks_per_peer: Per destination, its blocks (a device's cast sizes follow its flags).
        device: Where the sizes and words live.

    Returns:
        int64 payload bytes per destination, and :class:`PendingPayloads` ``meta``.
    """
    n_peers = len(blocks_per_peer)
    group_of = plan.group_of
    done = pending.done
    if done is not None and raw_parts is not None:
        raw_len = [sum(r.numel() for r in parts) for parts in raw_parts]
        for p, g in group_of.items():
            raw_len[p] += done.sizes[g]
        sizes_np = np.array(raw_len, np.int64)
        extras: dict[int, list[np.ndarray]] = {}
        assert casts.host is not None
        for p, flags in _flags_per_peer(plan, casts.host).items():
            extras[p] = [np.array(pack_flags(flags), dtype=np.int64)]
        for p, g in group_of.items():
            extras.setdefault(p, []).append(done.skeletons[g])
        meta_np = _size_exchange_words(sizes_np, extras, np.concatenate)
        device_sizes, meta = torch.from_numpy(sizes_np), torch.from_numpy(meta_np)
        if device.type != "cpu":  # a no-op .to() still costs a dispatch
            device_sizes, meta = device_sizes.to(device), meta.to(device)
        return device_sizes, meta
    raw_len_t = _device_raw_len(plan, raw_parts, casts, blocks_per_peer, device)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    codec_len = [
        pending.device_sizes[group_of[p] : group_of[p] + 1] if p in group_of else zero
        for p in range(n_peers)
    ]
    device_sizes = raw_len_t + torch.cat(codec_len) if n_peers else raw_len_t
    skel_at = list(itertools.accumulate(pending.skeleton_sizes, initial=0))
    extras_t: dict[int, list[torch.Tensor]] = {}
    spans = _flags_per_peer(plan, list(range(len(plan.cast_at))))
    for p, ks in spans.items():
        extras_t[p] = [flag_words(casts.flags[ks[0] : ks[-1] + 1])]
    for p, g in group_of.items():
        extras_t.setdefault(p, []).append(
            pending.device_skeletons[skel_at[g] : skel_at[g + 1]].to(device)
        )
    return device_sizes, _size_exchange_words(device_sizes, extras_t, torch.cat)


def _device_raw_len(
    plan: EncodePlan,
    raw_parts: Sequence[Sequence[torch.Tensor]] | None,
    casts: _CastFlags,
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    device: torch.device,
) -> torch.Tensor:
    """Bytes of each destination's flags and blocks that skip the codec, on the device: a
    cast block's bytes follow its flag there (no read).

    Returns:
        int64 [destinations].
    """
    n_peers = len(blocks_per_peer)
    if raw_parts is not None:
        (t,) = upload([[sum(r.numel() for r in parts) for parts in raw_parts]], device)
        return t
    fixed = [0] * n_peers  # the exact blocks and the flag prefixes: known here
    cast_at = set(plan.cast_at)
    for p, ks in _flags_per_peer(plan, list(plan.cast_at)).items():
        fixed[p] += padded_size(8 * word_count(len(ks)))
    rows: list[list[int]] = [[], [], []]  # per cast block: destination, cast and exact bytes
    for k, (p, i, _) in enumerate(plan.raw):
        b = blocks_per_peer[p][i]
        full = padded_size(b.numel() * b.element_size())
        if k not in cast_at:
            fixed[p] += full
            continue
        dt = plan.casts[k]
        assert dt is not None
        rows[0].append(p)
        rows[1].append(padded_size(b.numel() * dt.itemsize))
        rows[2].append(full)
    fixed_t, peer_t, half_t, full_t = upload([fixed, *rows], device)
    cast_bytes = torch.where(casts.flags.bool(), half_t, full_t)
    return fixed_t.index_add(0, peer_t, cast_bytes)


@dataclass
class _EncodeCall:
    """One :func:`start_encode` call's state, up to its ``finish`` (its arguments, plan,
    pending codec payloads and raw parts).

    Attributes:
        direction: ``"fwd"`` or ``"bwd"``.
        blocks_per_peer: Per destination, its blocks.
        specs_per_peer: Per destination, the specs of its blocks.
        info: Layout, compress flags and comms state.
        device: Where the payloads live.
        plan: The layout's plan.
        pending: The codec's pending payloads.
        raw_parts: Per destination, its cast flags and padded raw blocks; None until
            :meth:`finish` builds them (a device's cast flags unread at the start).
        casts: The call's cast flags.
        sample: Where the sender decodes its payloads for error samples (None: no sample).
        setup_s: Seconds spent before the host read.
        record: The call's record (the error sample's alerts name its number).
        telemetry: The call's telemetry, filled by :meth:`finish` (added to: a chunked call
            finishes once per chunk).
        observed: None: the forward's blocks are shown to the bound provider as they are
            encoded; a list: (destination, block indices, tables, absolute bounds) of each
            codec group is appended for :meth:`CallEncoder.observe` to show them in the
            unchunked call's order.
    """

    direction: Direction
    blocks_per_peer: Sequence[Sequence[torch.Tensor]]
    specs_per_peer: Sequence[Sequence[BlockSpec]]
    info: LossyAll2AllPooledInfo
    device: torch.device
    plan: EncodePlan
    pending: PendingGroups
    raw_parts: list[list[torch.Tensor]] | None
    casts: _CastFlags
    sample: SampleWhere
    setup_s: float
    record: CallRecord
    telemetry: ExchangeRecord
    observed: list[tuple[int, tuple[int, ...], Sequence[str], list[float]]] | None = None

    def finish(self, host: Sequence[int]) -> list[torch.Tensor]:
        """Builds the payloads from the host read's values and fills the call's telemetry.

        Args:
            host: The values of :class:`PendingPayloads` ``readback``.

        Returns:
            One uint8 payload per destination (raw blocks first, then the codec's).
        """
        start = time.perf_counter()
        plan = self.plan
        k = self.pending.readback.numel()
        grouped = self.pending.finish(host[:k])
        cast = self.casts.host
        if cast is None:  # a device's cast flags, read with the codec's values
            cast = [bool(f) for f in host[k:]]
        raw_parts = self.raw_parts
        if raw_parts is None:
            raw_parts = _raw_parts(plan, self.blocks_per_peer, len(self.blocks_per_peer),
                                   self.device, cast)  # fmt: skip
        rec = self._raw_records(cast)
        sent: dict[int, torch.Tensor] = {}
        at = 0  # the first codec block of the group in plan.tables
        for g, (p, idx) in enumerate(zip(plan.peers, plan.coded, strict=True)):
            parts = raw_parts[p]
            if idx:
                payload = grouped.payload(g)
                parts = [*parts, payload]
                self._record_group(rec, grouped, g, plan.tables[at : at + len(idx)], payload)
                at += len(idx)
            if parts:  # a lone part needs no copy (the exchange concatenates the payloads)
                sent[p] = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.sample == "device":
            self._start_device_sample(grouped)
        # Peers sent nothing (the self peer, or no blocks) get an empty payload.
        n_peers = len(self.blocks_per_peer)
        out = [sent[p] if p in sent else _empty_payload(self.device) for p in range(n_peers)]
        same_host = sum(out[p].numel() for p in self.info.same_host if p < n_peers)
        tele = self.telemetry
        links = tele.links or (0, 0)
        tele.links = (links[0] + same_host, links[1] + sum(t.numel() for t in out) - same_host)
        # Every block sent to a peer, in one record; the codec works on all peers at once, so
        # its time is shared out by raw bytes when the record is written.
        tele.blocks = rec if tele.blocks is None else _joined(tele.blocks, rec)
        tele.encode_s += self.setup_s + time.perf_counter() - start
        return out

    def _raw_records(self, cast: Sequence[bool]) -> BlockRecords:
        """The records of the blocks that skip the codec (the cast flags' prefix goes to the
        container); on an error-sampled call each cast block's error, read later.

        Args:
            cast: Per block of the plan's ``cast_at``, whether it travelled cast.

        Returns:
            The call's block records, these blocks first.
        """
        plan = self.plan
        flag_of = dict(zip(plan.cast_at, cast, strict=True))
        rec = BlockRecords(container=None)
        for k, (p, i, s) in enumerate(plan.raw):
            b = self.blocks_per_peer[p][i]
            dt = plan.casts[k] if flag_of.get(k) else None
            rec.tables.append(s.table)
            rec.raw_bytes.append(b.numel() * b.element_size())
            rec.wire_bytes.append(padded_size(b.numel() * (b.dtype if dt is None else dt).itemsize))
            rec.errors.append(0.0)
            rec.abs_bounds.append(0.0 if dt is None else None)  # a cast's: its error, later
            if dt is not None and self.sample is not None and b.numel():
                diff = (b.float() - b.to(dt).float()).abs()
                err = torch.where(torch.isfinite(b), diff, 0.0).amax()
                self.telemetry.lazy_errors.append((s.table, err))
        prefix = sum(
            padded_size(8 * word_count(len(f))) for f in _flags_per_peer(plan, cast).values()
        )
        if prefix:
            rec.container = prefix
        return rec

    def _record_group(
        self,
        rec: BlockRecords,
        grouped: GroupedPayloads,
        g: int,
        tables: Sequence[str],
        payload: torch.Tensor,
    ) -> None:
        """Adds codec group ``g``'s blocks to ``rec``; shows the forward's blocks to the bound
        provider, warns of exact blocks and takes the error sample.

        Args:
            rec: The call's block records.
            grouped: The codec's payloads.
            g: The group (a destination with codec blocks).
            tables: Its blocks' tables.
            payload: Its codec payload.
        """
        p, idx = self.plan.peers[g], self.plan.coded[g]
        cols = grouped.columns[g]
        blocks = self.blocks_per_peer[p]
        info, direction = self.info, self.direction
        if direction == "fwd" and not self.record.exact:
            if self.observed is not None:
                self.observed.append((p, idx, tables, list(cols.bound)))
            else:
                for k, t, bound in zip(idx, tables, cols.bound, strict=True):
                    info.comms.bounds.observe(t, blocks[k], bound)
        if "raw" in cols.mode or "lz" in cols.mode:  # exact blocks: rare, looked at
            for i, (t, bound, mode, rows, dim) in enumerate(
                zip(tables, cols.bound, cols.mode, cols.rows, cols.dim, strict=True)
            ):
                if bound > 0 and mode in ("raw", "lz") and rows * dim >= 1024:
                    _warn_exact(info, direction, t, cols.slice(i, i + 1).stats()[0])
        rec.tables += tables
        rec.raw_bytes += cols.raw_bytes
        rec.wire_bytes += cols.wire_bytes
        rec.errors += cols.max_error
        rec.abs_bounds += cols.bound
        if self.sample == "host":
            sampled = [blocks[k] for k in idx]
            error_sample.record_error_samples(
                info.comms.stats, direction, payload, sampled, tables, self.record.call,
                self._guard_levels(tables),
            )  # fmt: skip
        # The payload header belongs to no block.
        rec.container = (rec.container or 0) + grouped.sizes[g] - sum(cols.wire_bytes)

    def _start_device_sample(self, grouped: GroupedPayloads) -> None:
        """Takes the error sample of every codec payload on the device, in one decode; its
        sums ride the module's next host read (the ledger's), which records them.

        Args:
            grouped: The codec's payloads.
        """
        plan, info = self.plan, self.info
        if not plan.tables:
            return
        pairs = zip(plan.peers, plan.coded, strict=True)
        blocks = [[self.blocks_per_peer[p][k] for k in idx] for p, idx in pairs]
        sample = error_sample.start_device_sample(
            info.comms.stats, self.direction, grouped.buffer, grouped.sizes, grouped.skeletons,
            blocks, plan.tables, self.record.call, self._guard_levels(plan.tables),
            info.comms.config.codec.backend,
        )  # fmt: skip
        info.ledger.owe_status(sample)

    def _guard_levels(self, tables: Sequence[str]) -> list[int]:
        """Each block's guard tightenings in force for this call (0 without a guard): its
        alerts name them, so that the guard ignores evidence against a bound it has since
        tightened."""
        guard = self.info.comms.guard
        if guard is None:
            return [0] * len(tables)
        return [guard.level(self.direction, t) for t in tables]


def _joined(a: BlockRecords, b: BlockRecords) -> BlockRecords:
    """Two chunks' block records as one call's (the container: None only where neither made a
    codec payload)."""
    container = (
        None
        if a.container is None and b.container is None
        else ((a.container or 0) + (b.container or 0))
    )
    return BlockRecords(
        a.tables + b.tables, a.raw_bytes + b.raw_bytes, a.wire_bytes + b.wire_bytes,
        a.errors + b.errors, a.abs_bounds + b.abs_bounds, container,
    )  # fmt: skip


def chunk_plan(plan: EncodePlan, dests: Collection[int]) -> tuple[EncodePlan, list[int]]:
    """The part of ``plan`` that sends to ``dests``: its groups and raw blocks in plan order.

    Args:
        plan: A call's plan.
        dests: The destinations of the chunk.

    Returns:
        The chunk's plan, and the index in ``plan.tables`` of each of its codec blocks (the
        call's bounds are sliced by them).
    """
    at = list(itertools.accumulate((len(idx) for idx in plan.coded), initial=0))
    kept = [g for g, p in enumerate(plan.peers) if p in dests]
    peers = tuple(plan.peers[g] for g in kept)
    coded = tuple(plan.coded[g] for g in kept)
    picks = [i for g in kept for i in range(at[g], at[g + 1])]
    tables = tuple(plan.tables[i] for i in picks)
    distinct = tuple(dict.fromkeys(tables))
    sub = EncodePlan(
        peers=peers,
        coded=coded,
        raw=tuple(r for r in plan.raw if r[0] in dests),
        tables=tables,
        distinct=distinct,
        table_at=tuple(distinct.index(t) for t in tables),
        group_of={p: g for g, (p, idx) in enumerate(zip(peers, coded, strict=True)) if idx},
        meta_splits=plan.meta_splits,
        casts=tuple(dt for r, dt in zip(plan.raw, plan.casts, strict=True) if r[0] in dests),
    )
    return sub, picks


@dataclass
class CallEncoder:
    """One call's encode, a group of destinations at a time (the chunked exchange,
    :mod:`.exchange_chunks`), on the compiled host path (nothing to read back).

    The call's bounds are asked once (:func:`codec_bounds`, as :func:`start_encode` asks them)
    and sliced per chunk; each destination's payload is the bytes :func:`start_encode` gives
    it (the codec encodes each destination's group on its own: its stochastic rounding draws by
    the block's index in its payload); the forward's blocks are shown to the bound provider
    once every chunk is encoded, in the unchunked call's order (:meth:`observe`), so that the
    next calls' bounds are the same too.

    Attributes:
        direction: ``"fwd"`` or ``"bwd"``.
        blocks_per_peer: Per destination, its blocks.
        info: Layout, compress flags and comms state.
        device: Where the payloads live (the host).
        my_rank: This rank.
        record: The call's record.
        telemetry: The call's telemetry (each chunk adds to it).
        plan: The call's plan.
        bounds: The call's codec blocks' bound values and kinds, in ``plan.tables`` order.
        sample: Where the sender takes its error samples (:func:`_samples_errors`).
        observed: The codec groups encoded so far, for :meth:`observe`.
    """

    direction: Direction
    blocks_per_peer: Sequence[Sequence[torch.Tensor]]
    info: LossyAll2AllPooledInfo
    device: torch.device
    my_rank: int
    record: CallRecord
    telemetry: ExchangeRecord
    plan: EncodePlan
    bounds: tuple[list[float], list[BoundKind]]
    sample: SampleWhere
    observed: list[tuple[int, tuple[int, ...], Sequence[str], list[float]]] = field(
        default_factory=list
    )

    def encode(self, dests: Collection[int]) -> list[torch.Tensor]:
        """The payloads of ``dests`` (every other destination's empty).

        Args:
            dests: The chunk's destinations.

        Returns:
            One uint8 payload per destination.
        """
        start = time.perf_counter()
        sub, picks = chunk_plan(self.plan, dests)
        values, kinds = self.bounds
        bounds = ([values[i] for i in picks], [kinds[i] for i in picks])
        with profile_range(f"## lossy_a2a {self.direction} encode ##"):
            pending = _start_codec(
                self.blocks_per_peer, self.info, sub, self.record, self.my_rank, bounds
            )
            casts = _start_casts(self.blocks_per_peer, self.info, sub, self.record, self.device)
            assert casts.host is not None, "a chunked encode on the device path"
            raw_parts = _raw_parts(
                sub, self.blocks_per_peer, len(self.blocks_per_peer), self.device, casts.host
            )
        assert not pending.readback.numel(), "a chunked encode on the device path"
        encode = _EncodeCall(
            direction=self.direction,
            blocks_per_peer=self.blocks_per_peer,
            specs_per_peer=(),
            info=self.info,
            device=self.device,
            plan=sub,
            pending=pending,
            raw_parts=raw_parts,
            casts=casts,
            sample=self.sample,
            setup_s=time.perf_counter() - start,
            record=self.record,
            telemetry=self.telemetry,
            observed=self.observed,
        )
        return encode.finish([])

    def observe(self) -> None:
        """Shows the forward's encoded blocks to the bound provider in destination order (as
        the unchunked encode does); call it once, after the last chunk."""
        observed, self.observed = sorted(self.observed, key=lambda o: o[0]), []
        for p, idx, tables, bounds in observed:
            for k, t, bound in zip(idx, tables, bounds, strict=True):
                self.info.comms.bounds.observe(t, self.blocks_per_peer[p][k], bound)


def start_call_encoder(
    direction: Direction,
    blocks_per_peer: Sequence[Sequence[torch.Tensor]],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    info: LossyAll2AllPooledInfo,
    device: torch.device,
    my_rank: int,
    record: CallRecord,
    telemetry: ExchangeRecord,
) -> CallEncoder:
    """A call's :class:`CallEncoder` (arguments as :func:`start_encode`'s): its plan, its
    bounds asked once, its self bytes counted; nothing encoded yet.

    Returns:
        The encoder.
    """
    plan = _call_plan(info, blocks_per_peer, specs_per_peer, my_rank, telemetry)
    n = len(plan.tables)
    return CallEncoder(
        direction, blocks_per_peer, info, device, my_rank, record, telemetry, plan,
        codec_bounds(record, info, plan, n), _samples_errors(info, record, device),
    )  # fmt: skip


def warm_up_host() -> None:
    """Loads the compiled kernels a CPU all-to-all calls (the codec's and the error sample's)
    now, once per process: a dist calls this when it is built, so that loading them does not
    land in the first training step or in its codec time."""
    warm_up_codec()
    error_sample.warm_up_host()


# A zero-byte payload per device (what a peer that is sent nothing gets); never written to.
_EMPTY: dict[torch.device, torch.Tensor] = {}


def _empty_payload(device: torch.device) -> torch.Tensor:
    """The shared empty uint8 payload on ``device`` (allocating one per call costs a dispatch)."""
    empty = _EMPTY.get(device)
    if empty is None:
        empty = _EMPTY[device] = torch.empty(0, dtype=torch.uint8, device=device)
    return empty
