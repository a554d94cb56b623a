"""The receiving side of the compressed pooled-embedding all-to-all (see :mod:`.comm_ops`).

:func:`decode_call` decodes every source's codec payload in one codec call and puts the blocks
back in spec order, checked against the sharding layout. On the device path the status is
deferred: failed sources' blocks are zeroed on the device and the call's :class:`DeferredDecode`
goes to the call's awaitable, which the module's ledger lists until
:func:`.call_ledger.read_checked` folds it into the next size-exchange read (docs/kernels.md,
"Syncs per all-to-all"). No collective, no autograd.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from torchrec_lossy.codec import (
    GroupStatus,
    contain_failures,
    decompress_groups,
    first_failure,
    host_sync,
)
from torchrec_lossy.codec.pipeline import on_device
from torchrec_lossy.distributed.call_ledger import CallRecord
from torchrec_lossy.distributed.cast_blocks import unpack_flags, word_count
from torchrec_lossy.distributed.errors import LossyAllToAllError
from torchrec_lossy.distributed.exchange_record import ExchangeRecord
from torchrec_lossy.distributed.pooled_blocks import BlockSpec, LossyAll2AllPooledInfo
from torchrec_lossy.distributed.pooled_payload import ALIGN, padded_size
from torchrec_lossy.distributed.stats import Direction
from torchrec_lossy.profile_range import profile_range

_NO_WORDS = np.zeros(0, dtype=np.uint32)  # a size-exchange entry with nothing past its size


def _aligned(payload: torch.Tensor) -> torch.Tensor:
    return payload if payload.storage_offset() % ALIGN == 0 else payload.clone()


def _fail(
    direction: Direction,
    my_rank: int,
    peer: int,
    specs: Sequence[BlockSpec],
    why: str,
    deferred: str = "",
) -> NoReturn:
    tables = ", ".join(sorted({s.table for s in specs})) or "none"
    raise LossyAllToAllError(
        f"lossy all-to-all ({direction}) on rank {my_rank}: the payload from rank {peer} "
        f"(tables: {tables}) could not be decoded{deferred}: {why}. The bytes were corrupted in "
        "transit or the ranks run different torchrec_lossy versions or sharding plans."
    )


# What the zeroed blocks of a deferred failure did, by direction (for the error message).
_CONTAINED: dict[str, str] = {
    "fwd": "that step's forward used zeros for its blocks, and this error stops the job before "
    "any gradient of that step is applied",
    "bwd": "the rows it carried got a zero gradient in that step (no update for SGD and "
    "Adagrad-style optimizers; momentum optimizers still apply their momentum), and no "
    "corrupted value reached the optimizer",
}


@dataclass
class DeferredDecode:
    """A device decode of :func:`decode_call` whose status is read at a later host read.

    Attributes:
        direction: ``"fwd"`` or ``"bwd"``.
        my_rank: The receiving rank.
        record: The record of the call that received the payloads (its number and step), or
            None for a decode outside an exchange (then checked at once).
        peers: The source rank of each decoded group.
        specs_per_peer: Per source rank, the specs of its blocks.
        status: The decode's status (for the error message).
        flags: int32 per group on the device, nonzero where it failed.
    """

    direction: Direction
    my_rank: int
    record: CallRecord | None
    peers: list[int]
    specs_per_peer: Sequence[Sequence[BlockSpec]]
    status: GroupStatus
    flags: torch.Tensor

    def raise_if_failed(self, flags: Sequence[int]) -> None:
        """Raises :class:`LossyAllToAllError` naming the step and source if a flag is set.

        Args:
            flags: :attr:`flags`, read back.
        """
        bad = [g for g, f in enumerate(flags) if f]
        if not bad:
            return
        found = first_failure(self.status)  # a second read, on the error path only
        g, why = found if found is not None else (bad[0], "the device decode failed")
        peer, rec = self.peers[g], self.record
        where = (
            f" in its {self.direction} all-to-all call {rec.call}, {rec.step_text()}, found at "
            "the next host read"
            if rec is not None
            else ""
        )
        _fail(
            self.direction,
            self.my_rank,
            peer,
            self.specs_per_peer[peer],
            f"CodecError: {why}; {_CONTAINED[self.direction]}",
            where,
        )


def decode_payloads(
    direction: Direction,
    recv: torch.Tensor,
    recv_sizes: Sequence[int],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    block_rows_per_peer: Sequence[int | Sequence[int]],
    info: LossyAll2AllPooledInfo,
    my_rank: int,
    self_blocks: Sequence[torch.Tensor] | None = None,
) -> list[list[torch.Tensor]]:
    """Decodes payloads outside an exchange (benchmarks, tests): :func:`decode_call`, with a
    device decode's status read at once and its telemetry written (as an exchange would).

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        recv: The received bytes, payloads in rank order.
        recv_sizes: Bytes from each peer.
        specs_per_peer: Per peer, the specs of its blocks.
        block_rows_per_peer: Per peer, the rows of each block, or one batch size.
        info: Layout, compress flags and comms state.
        my_rank: This rank.
        self_blocks: The blocks this rank sent itself, or None.

    Returns:
        Per peer, its blocks.

    Raises:
        LossyAllToAllError: A payload does not decode into the expected blocks.
    """
    telemetry = ExchangeRecord(direction)
    blocks, check = decode_call(
        direction, recv, recv_sizes, specs_per_peer, block_rows_per_peer, info, my_rank,
        self_blocks, telemetry=telemetry,
    )  # fmt: skip
    if check is not None:
        check.raise_if_failed(host_sync.to_host(check.flags).tolist())
    telemetry.write(info.comms.stats)
    return blocks


def decode_call(
    direction: Direction,
    recv: torch.Tensor,
    recv_sizes: Sequence[int],
    specs_per_peer: Sequence[Sequence[BlockSpec]],
    block_rows_per_peer: Sequence[int | Sequence[int]],
    info: LossyAll2AllPooledInfo,
    my_rank: int,
    self_blocks: Sequence[torch.Tensor] | None = None,
    skeletons: dict[int, np.ndarray] | None = None,
    record: CallRecord | None = None,
    *,
    telemetry: ExchangeRecord,
) -> tuple[list[list[torch.Tensor]], DeferredDecode | None]:
    """Decodes every peer's payload (``recv`` holds them in rank order) into its blocks.

    Every peer's codec payload goes through ONE ``decompress_groups`` call. On the host path its
    errors are known at once: a corrupt payload raises :class:`LossyAllToAllError` naming the
    source rank and never reaches the caller. On the device path the status is NOT read here
    (that would be a host sync of its own): the blocks of every payload that failed on the device
    are zeroed there (``contain_failures``), so garbage never reaches the caller, and the status
    is returned to the caller's awaitable, read with the next host read of these dists
    (:func:`.call_ledger.read_checked`, in the next size exchange: the backward's for a forward
    decode, the next step's forward for a backward one), which raises the error naming the
    call, the step, the tables and the source rank.

    Args:
        direction: ``"fwd"`` or ``"bwd"``.
        recv: The received bytes, payloads in rank order.
        recv_sizes: Bytes from each peer.
        specs_per_peer: Per peer, the specs of its blocks.
        block_rows_per_peer: Per peer, the rows of each block, or one batch size (every block
            then has ``num_features * rows`` rows).
        info: Layout, compress flags and comms state.
        my_rank: This rank.
        self_blocks: The blocks this rank sent itself (they skipped the codec and the wire), or
            None when its payload is in ``recv`` like every other.
        skeletons: Per peer with codec blocks, its codec payload's skeleton from the size
            exchange (the device path then reads nothing back to decode), or None.
        record: The receiving call's record (named by a deferred error), or None.
        telemetry: The exchange's record; the decode's seconds and bytes per table go there.

    Returns:
        Per peer, its blocks; the device decode's unread status, or None.

    Raises:
        LossyAllToAllError: A payload does not decode into the expected blocks.
    """
    call = _DecodeCall.of(direction, specs_per_peer, block_rows_per_peer, info, my_rank, record)
    start = time.perf_counter()
    with profile_range(f"## lossy_a2a {direction} decode ##"):
        frames = call.frames(recv, recv_sizes, self_blocks is not None, skeletons)
        by_peer, check = call.decode_codec(frames, recv, skeletons is not None)
        out = [
            list(self_blocks)
            if self_blocks is not None and peer == my_rank
            else call.split(peer, frames[peer], by_peer.get(peer, []))
            for peer in range(len(recv_sizes))
        ]
    telemetry.decode_shares, telemetry.decode_s = call.shares(), time.perf_counter() - start
    return out, check


@dataclass(frozen=True)
class _Frame:
    """One source's payload, framed.

    Attributes:
        payload: Its bytes (16-byte aligned: its cast flags and raw blocks first).
        raw_len: Bytes of its cast flags and raw blocks (padded).
        codec: Its codec payload, or None if it has no codec blocks.
        wire: Per block in spec order, the dtype it travelled in when it skipped the codec
            (the call's, or a cast table's where its flag is set), None for a codec block.
        flags_len: Bytes of its cast flags (padded), before its raw blocks.
        skeleton: Its codec skeleton from the size exchange, or None.
    """

    payload: torch.Tensor
    raw_len: int
    codec: torch.Tensor | None
    wire: tuple[torch.dtype | None, ...] = ()
    flags_len: int = 0
    skeleton: np.ndarray | None = None


@dataclass(frozen=True)
class _DecodeCall:
    """The layout of one :func:`decode_call` call, and its steps per source.

    Attributes:
        direction: ``"fwd"`` or ``"bwd"``.
        specs_per_peer: Per source, the specs of its blocks.
        rows_per_peer: Per source, the rows of each block.
        coded_per_peer: Per source, whether each block went through the codec.
        cast_per_peer: Per source, each block's cast dtype where its table is cast (it
            travelled cast where the source's flag says so), else None.
        info: Layout, dtype and comms state.
        my_rank: This rank.
        record: The receiving call's record, or None.
    """

    direction: Direction
    specs_per_peer: Sequence[Sequence[BlockSpec]]
    rows_per_peer: list[list[int]]
    coded_per_peer: list[tuple[bool, ...]]
    cast_per_peer: list[tuple[torch.dtype | None, ...]]
    info: LossyAll2AllPooledInfo
    my_rank: int
    record: CallRecord | None

    @classmethod
    def of(
        cls,
        direction: Direction,
        specs_per_peer: Sequence[Sequence[BlockSpec]],
        block_rows_per_peer: Sequence[int | Sequence[int]],
        info: LossyAll2AllPooledInfo,
        my_rank: int,
        record: CallRecord | None,
    ) -> _DecodeCall:
        """The call's layout from :func:`decode_call`'s arguments.

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            specs_per_peer: Per source, the specs of its blocks.
            block_rows_per_peer: Per source, the rows of each block, or one batch size.
            info: Layout, compress flags and comms state.
            my_rank: This rank.
            record: The receiving call's record, or None.

        Returns:
            The call, with every block's rows and whether it went through the codec.
        """
        return cls(
            direction=direction,
            specs_per_peer=specs_per_peer,
            rows_per_peer=[
                [s.num_features * br for s in specs] if isinstance(br, int) else list(br)
                for specs, br in zip(specs_per_peer, block_rows_per_peer, strict=False)
            ],
            coded_per_peer=[
                tuple(info.codes(peer, s.table) for s in specs)
                for peer, specs in enumerate(specs_per_peer)
            ],
            cast_per_peer=[
                tuple(info.cast_dtype(peer, s.table) for s in specs)
                for peer, specs in enumerate(specs_per_peer)
            ],
            info=info,
            my_rank=my_rank,
            record=record,
        )

    def frames(
        self,
        recv: torch.Tensor,
        recv_sizes: Sequence[int],
        skip_self: bool,
        entries: dict[int, np.ndarray] | None = None,
    ) -> dict[int, _Frame]:
        """Every source's payload in ``recv``, framed (:meth:`frame`).

        Args:
            recv: The received bytes, payloads in rank order.
            recv_sizes: Bytes from each source.
            skip_self: This rank's own blocks skipped the wire (no payload to frame).
            entries: Per source, its size-exchange words past its size (cast flags, then
                codec skeleton), or None (the flags are read from the payloads).

        Returns:
            Source rank to its framed payload.
        """
        offsets = list(itertools.accumulate(recv_sizes, initial=0))
        frames: dict[int, _Frame] = {}
        for peer, size in enumerate(recv_sizes):
            if not skip_self or peer != self.my_rank:
                # The whole buffer when one peer sent everything (2 ranks): no view to make.
                payload = recv if size == recv.shape[0] else recv.narrow(0, offsets[peer], size)
                entry = None if entries is None else entries.get(peer, _NO_WORDS)
                frames[peer] = self.frame(peer, payload, entry)
        return frames

    def shares(self) -> dict[str, int]:
        """The call's decoded bytes per table (its time is shared among them by these).

        Returns:
            Table to the bytes of its blocks, every source's together.
        """
        shares: dict[str, int] = {}
        for specs, rows in zip(self.specs_per_peer, self.rows_per_peer, strict=False):
            for s, br in zip(specs, rows, strict=True):
                shares[s.table] = shares.get(s.table, 0) + br * s.dim * self.info.dtype.itemsize
        return shares

    def fail(self, peer: int, why: str) -> NoReturn:
        """Raises :class:`LossyAllToAllError` for ``peer``'s payload.

        Args:
            peer: The source rank.
            why: What is wrong.
        """
        _fail(self.direction, self.my_rank, peer, self.specs_per_peer[peer], why)

    def frame(self, peer: int, payload: torch.Tensor, entry: np.ndarray | None) -> _Frame:
        """Shows ``peer``'s payload to the payload hook, aligns it, reads its cast flags and
        checks its raw part.

        Args:
            peer: The source rank.
            payload: Its received bytes.
            entry: Its size-exchange words past its size (cast flags, then codec skeleton), or
                None: the cast flags are read from the payload (a host path's).

        Returns:
            The framed payload.

        Raises:
            LossyAllToAllError: The payload is shorter than its raw blocks, or has bytes past
                them although it carries no codec block, or its cast flags are not its blocks'.
        """
        hook = self.info.comms.payload_hook
        if hook is not None:
            payload = hook(self.direction, peer, payload)
        payload = _aligned(payload)  # raw blocks then start 16-byte aligned
        specs, coded = self.specs_per_peer[peer], self.coded_per_peer[peer]
        casts = self.cast_per_peer[peer]
        n_cast = sum(dt is not None for dt in casts)
        n_words = word_count(n_cast)
        flags_len = padded_size(8 * n_words)
        if entry is not None:
            words = entry[:n_words].tolist()
        elif payload.numel() >= flags_len:  # the one-round path: the payload's own (host)
            words = payload[: 8 * n_words].view(torch.int64).tolist()
        else:
            self.fail(peer, f"{payload.numel()} bytes received, fewer than its cast flags'")
        try:
            flags = iter(unpack_flags(words, n_cast))
        except ValueError as e:
            self.fail(peer, str(e))
        wire = tuple(
            None if c else dt if dt is not None and next(flags) else self.info.dtype
            for c, dt in zip(coded, casts, strict=True)
        )
        raw_len = flags_len + sum(
            padded_size(br * s.dim * dt.itemsize)
            for s, br, dt in zip(specs, self.rows_per_peer[peer], wire, strict=True)
            if dt is not None
        )
        size = payload.numel()
        if not any(coded) and size != raw_len:
            self.fail(
                peer, f"{size} bytes received, expected exactly {raw_len} bytes of raw blocks"
            )
        if size < raw_len:
            self.fail(peer, f"{size} bytes received, fewer than the {raw_len} bytes of raw blocks")
        codec = (payload[raw_len:] if raw_len else payload) if any(coded) else None
        skeleton = entry[n_words:] if entry is not None and any(coded) else None
        return _Frame(payload, raw_len, codec, wire, flags_len, skeleton)

    def decode_codec(
        self, frames: dict[int, _Frame], recv: torch.Tensor, skeletons: bool
    ) -> tuple[dict[int, list[torch.Tensor]], DeferredDecode | None]:
        """Decodes every source's codec payload in ONE codec call.

        A host-known failure raises at once; a device decode's status is kept for a later host
        read (:class:`DeferredDecode`), its failed sources' blocks zeroed meanwhile.

        Args:
            frames: Per source, its framed payload.
            recv: The received bytes (an empty buffer is made on their device if no source
                sent codec blocks).
            skeletons: Whether the frames hold their skeletons from the size exchange.

        Returns:
            Per source with codec blocks, its decoded blocks in spec order; the device
            decode's unread status, or None.

        Raises:
            LossyAllToAllError: A payload is not whole words, or failed to decode (host path).
        """
        coded = [(p, f.codec) for p, f in frames.items() if f.codec is not None]
        comms = self.info.comms
        if not coded and not on_device(recv.device, comms.config.codec.backend):
            return {}, None  # every block raw: nothing for the host codec to decode
        peers, parts = [p for p, _ in coded], [c for _, c in coded]
        sizes = [c.numel() for c in parts]
        if sum(sizes) % 4:
            g = next(i for i, n in enumerate(sizes) if n % 4)
            self.fail(
                peers[g], f"CodecError: a {sizes[g]}-byte payload is not a whole number of words"
            )
        # One source (2 ranks): its payload as it came, no copy.
        buffer = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else recv.new_empty(0)
        decoded, status = decompress_groups(
            buffer,
            sizes,
            backend=comms.config.codec.backend,
            skeletons=[frames[p].skeleton for p in peers] if skeletons else None,  # type: ignore[misc]
            label=False,  # inside this call's own range
        )
        flags = contain_failures(status)  # device path: failed groups zeroed, status kept
        check = None
        if flags is None or status.rejected:
            failure = first_failure(status)  # host-known errors: no read on the host path
            if failure is not None:
                self.fail(peers[failure[0]], f"CodecError: {failure[1]}")
        else:
            check = self._defer(frames, peers, status, flags)
        return dict(zip(peers, decoded, strict=True)), check

    def _defer(
        self,
        frames: dict[int, _Frame],
        peers: list[int],
        status: GroupStatus,
        flags: torch.Tensor,
    ) -> DeferredDecode:
        """Device path: zeroes the raw blocks of failed sources (their codec blocks already
        are) and returns the status, for a later host read."""
        for g, peer in enumerate(peers):
            raw_len = frames[peer].raw_len
            if raw_len:
                frames[peer].payload[:raw_len].masked_fill_(flags[g] != 0, 0)
        return DeferredDecode(
            self.direction, self.my_rank, self.record, peers, self.specs_per_peer, status, flags
        )

    def split(self, peer: int, frame: _Frame, decoded: list[torch.Tensor]) -> list[torch.Tensor]:
        """One source's blocks in spec order: raw ones from its payload (cast back where they
        travelled cast), coded ones decoded.

        Args:
            peer: The source rank.
            frame: Its framed payload (its cast flags and raw blocks first).
            decoded: Its coded blocks, decoded, in spec order.

        Returns:
            Its blocks, in spec order.

        Raises:
            LossyAllToAllError: A decoded block's count, shape or dtype is not the layout's.
        """
        specs, block_rows = self.specs_per_peer[peer], self.rows_per_peer[peer]
        coded_flags, dtype = self.coded_per_peer[peer], self.info.dtype
        n_coded = sum(coded_flags)
        if len(decoded) != n_coded:
            self.fail(peer, f"{len(decoded)} blocks decoded, {n_coded} expected")
        if n_coded == len(specs):  # no raw block (the usual payload): check and pass them on
            for s, br, b in zip(specs, block_rows, decoded, strict=True):
                if b.shape != (br, s.dim) or b.dtype != dtype:
                    self._bad_block(peer, s, b, (br, s.dim))
            return decoded
        blocks: list[torch.Tensor] = []
        coded = iter(decoded)
        payload, raw_at = frame.payload, frame.flags_len
        for s, br, wire in zip(specs, block_rows, frame.wire, strict=True):
            shape = (br, s.dim)
            if wire is None:
                b = next(coded)
                if b.shape != shape or b.dtype != dtype:
                    self._bad_block(peer, s, b, shape)
            else:
                n = shape[0] * shape[1] * wire.itemsize
                b = payload[raw_at : raw_at + n].view(wire).view(shape)
                b = b if wire == dtype else b.to(dtype)
                raw_at += padded_size(n)
            blocks.append(b)
        return blocks

    def _bad_block(
        self, peer: int, spec: BlockSpec, block: torch.Tensor, shape: tuple[int, int]
    ) -> NoReturn:
        """Raises :class:`LossyAllToAllError`: ``block`` of ``spec`` is not ``shape`` and the
        call's dtype.

        Args:
            peer: The source rank.
            spec: The block's spec.
            block: The decoded block.
            shape: The layout's shape for it.
        """
        self.fail(
            peer,
            f"table {spec.table}: block {tuple(block.shape)} {block.dtype}, "
            f"expected {shape} {self.info.dtype}",
        )


__all__ = ["DeferredDecode", "decode_call", "decode_payloads"]
