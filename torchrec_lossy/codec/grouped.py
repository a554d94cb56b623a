"""One codec call for the blocks of every destination (compress) or every source (decompress).

:func:`compress_groups` builds one payload per destination in one pass, back to back in one
uint8 buffer, each byte-identical to ``compress`` of its blocks; :func:`decompress_groups`
decodes every source's payload of a received buffer in one pass. On the device path the decode
status stays on the device (:class:`GroupStatus`) until :func:`check_groups` reads it or
:func:`contain_failures` zeroes the failed blocks. Syncs and status: docs/codec.md, "Grouped".
"""

from __future__ import annotations

import functools
import itertools
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from torchrec_lossy.codec import host_sync
from torchrec_lossy.codec.bounds import BoundKind, block_kinds
from torchrec_lossy.codec.container import (
    DEFAULT_MAX_ELEMENTS,
    BlockColumns,
    BlockStats,
    skeleton_words,
    status_error,
)
from torchrec_lossy.codec.format import CodecError
from torchrec_lossy.codec.kernel_set import backend_kernels
from torchrec_lossy.codec.pipeline import (
    check_kinds,
    compress_host_groups,
    decompress_host_groups,
    host_error,
    on_device,
    validate_inputs,
)
from torchrec_lossy.config import Backend, CodecConfig
from torchrec_lossy.profile_range import profile_range

if typing.TYPE_CHECKING:
    from torchrec_lossy.codec.device_decompress import DeviceGroups

_BACKENDS = frozenset(typing.get_args(Backend))
# The host path's readback: nothing to read (shared: an empty tensor holds nothing to change).
_NOTHING_TO_READ = torch.zeros(0, dtype=torch.int64)
_NO_WORDS = np.zeros(0, np.uint32)
# The error of a payload the host path decodes but the device rejected (its skeleton).
_NOT_ANNOUNCED = "corrupt payload: it does not match the layout its sender announced"


@dataclass(frozen=True)
class GroupedPayloads:
    """The payloads of :func:`compress_groups`.

    Attributes:
        buffer: 1-D uint8 tensor on the blocks' device: payload ``g`` at ``offsets[g]``.
        sizes: Bytes of each payload (multiples of 4).
        columns: Per group, the BlockColumns of its blocks (:attr:`stats` as objects).
        skeletons: Per group, the uint32 words its layout depends on
            (``container.skeleton_index``): hand them to :func:`decompress_groups` with the
            payloads and the device path decodes without reading the payloads back.
    """

    buffer: torch.Tensor
    sizes: list[int]
    columns: list[BlockColumns]
    skeletons: list[np.ndarray]

    @functools.cached_property
    def stats(self) -> list[list[BlockStats]]:
        """Per group, one BlockStats per block (built on first use)."""
        return [c.stats() for c in self.columns]

    @functools.cached_property
    def offsets(self) -> list[int]:
        """Byte offset of each payload in :attr:`buffer`."""
        return list(itertools.accumulate(self.sizes, initial=0))[:-1]

    def payload(self, group: int) -> torch.Tensor:
        """Group ``group``'s payload (a view of :attr:`buffer`).

        Args:
            group: Its index.

        Returns:
            1-D uint8 tensor.
        """
        if len(self.sizes) == 1:  # the whole buffer: no view to make
            return self.buffer
        return self.buffer.narrow(0, self.offsets[group], self.sizes[group])


@dataclass
class GroupStatus:
    """The decode status :func:`decompress_groups` leaves for :func:`check_groups`.

    Attributes:
        rejected: Group index to its error, found while reading the layouts (every error of
            the host path).
        device: The device path's decode (``device_decompress.DeviceGroups``: its status still
            on the device, read by :func:`check_groups`), or None.
        buffer: The decoded buffer (to read a failing payload back for its message).
        sizes: Bytes of each payload.
        max_elements: The decode's limit.
    """

    rejected: dict[int, str] = field(default_factory=dict)
    device: DeviceGroups | None = None
    buffer: torch.Tensor | None = None
    sizes: list[int] = field(default_factory=list)
    max_elements: int = DEFAULT_MAX_ELEMENTS


@dataclass
class PendingGroups:
    """A :func:`start_compress_groups` call waiting for its one host read.

    On the device path the payloads are built but their sizes and stats are still on the
    device: read :attr:`readback` (alone, or concatenated with tensors of the caller's, in ONE
    copy) and pass its values to :attr:`finish`. :attr:`device_sizes` are the payload sizes on
    the device, usable before the read (e.g. in a size all-to-all). On the host path everything
    is known already and :attr:`readback` is empty.

    Attributes:
        readback: int64 values the host must read (may be empty).
        finish: Builds the result (the payloads, their sizes and stats) from ``readback``'s
            host values, in order.
        skeleton_sizes: Words of each payload's skeleton.
        make_sizes: Builds :attr:`device_sizes` on first use (the host path's callers mostly
            read ``done`` instead).
        make_skeletons: Builds :attr:`device_skeletons` on first use.
        done: The result, on the host path (known already: ``finish`` returns it); None on
            the device path.
    """

    readback: torch.Tensor
    finish: Callable[[Sequence[int]], GroupedPayloads]
    skeleton_sizes: list[int]
    make_sizes: Callable[[], torch.Tensor]
    make_skeletons: Callable[[], torch.Tensor]
    done: GroupedPayloads | None = None

    @functools.cached_property
    def device_sizes(self) -> torch.Tensor:
        """int64 bytes per payload, on the blocks' device."""
        return self.make_sizes()

    @functools.cached_property
    def device_skeletons(self) -> torch.Tensor:
        """int64 skeleton words of every payload back to back, on the blocks' device (a
        receiver decodes without a read given them: :func:`decompress_groups`)."""
        return self.make_skeletons()


def start_compress_groups(
    groups: Sequence[Sequence[torch.Tensor]],
    error_bounds: Sequence[Sequence[float]],
    config: CodecConfig | None = None,
    kinds: BoundKind | bool | Sequence[Sequence[int]] = BoundKind.ABSOLUTE,
) -> PendingGroups:
    """:func:`compress_groups` without its host read (no sync on the device path).

    Args:
        groups: As :func:`compress_groups`.
        error_bounds: As :func:`compress_groups`.
        config: As :func:`compress_groups`.
        kinds: As :func:`compress_groups`.

    Returns:
        The pending call: read ``readback`` and pass its values to ``finish``.

    Raises:
        ValueError: As :func:`compress_groups`.
    """
    config = config or CodecConfig()
    if isinstance(groups, torch.Tensor):
        raise ValueError("groups must be a sequence of sequences of 2-D tensors, got a tensor")
    sizes = [len(g) for g in groups]
    if len(error_bounds) != len(sizes):
        raise ValueError(
            f"got {len(sizes)} groups but {len(error_bounds)} bound lists: pass one per group"
        )
    flat = [b for g in groups for b in g]
    values = [v for g in error_bounds for v in g]
    values, _ = validate_inputs(flat, values)
    kind = check_kinds(block_kinds(kinds, len(flat)), values, config)
    with profile_range("## lossy_codec encode ##"):
        return start_compress_blocks(flat, values, sizes, config, kind)


def start_compress_blocks(
    blocks: Sequence[torch.Tensor],
    bounds: Sequence[float],
    group_sizes: Sequence[int],
    config: CodecConfig,
    kinds: Sequence[int],
) -> PendingGroups:
    """:func:`start_compress_groups` for blocks the caller has already checked, given flat.

    The entry for callers that build their blocks themselves (the pooled all-to-all): nothing
    is validated again and no per-group lists are built, so a call costs little more than the
    encode itself (the caller labels the profiler range). Anything else should call
    :func:`start_compress_groups`, which checks its input and names what is wrong.

    Args:
        blocks: 2-D float32 / float16 / bfloat16 tensors on one device (any strides), group
            after group.
        bounds: One finite bound >= 0 per block (as ``error_bounds`` of
            :func:`compress_groups`).
        group_sizes: Blocks per group (they add up to ``len(blocks)``).
        config: Codec knobs.
        kinds: Per block, its bound's ``BoundKind``, already checked by the caller
            (``pipeline.check_kinds``, as :func:`start_compress_groups` does).

    Returns:
        The pending call: read ``readback`` and pass its values to ``finish``.
    """
    device = blocks[0].device if blocks else torch.device("cpu")
    sizes = list(group_sizes)
    if on_device(device, config.backend):
        from torchrec_lossy.codec.device_compress import start_groups_device

        kernels = backend_kernels(device, config.backend)
        pending = start_groups_device(blocks, bounds, kinds, sizes, config, kernels)

        def finish(host: Sequence[int]) -> GroupedPayloads:
            buffer, out_sizes, stats, skeletons = pending.finish(host)
            columns = [BlockColumns.of(s) for s in stats]
            return GroupedPayloads(buffer, out_sizes, columns, skeletons)

        return PendingGroups(
            pending.readback,
            finish,
            [skeleton_words(n) for n in sizes],
            lambda: pending.device_sizes,
            lambda: pending.device_skeleton,
        )
    # The host path: every group in one batched pass (relative bounds resolved inside it).
    done = GroupedPayloads(*compress_host_groups(blocks, bounds, sizes, config, kinds))
    readback = _NOTHING_TO_READ
    if device.type != "cpu":
        readback = torch.zeros(0, dtype=torch.int64, device=device)
    # The device-side copies of what is known here are built only if a caller asks.
    skeletons = [*done.skeletons, _NO_WORDS]
    return PendingGroups(
        readback,
        lambda host: done,
        [s.shape[0] for s in done.skeletons],
        lambda: torch.tensor(done.sizes, dtype=torch.int64, device=device),
        lambda: torch.from_numpy(np.concatenate(skeletons).astype(np.int64)).to(device),
        done,
    )


def compress_groups(
    groups: Sequence[Sequence[torch.Tensor]],
    error_bounds: Sequence[Sequence[float]],
    config: CodecConfig | None = None,
    kinds: BoundKind | bool | Sequence[Sequence[int]] = BoundKind.ABSOLUTE,
) -> GroupedPayloads:
    """Compresses the blocks of every group (destination) in one call.

    Args:
        groups: Per group, its 2-D float32 / float16 / bfloat16 blocks (all on one device).
        error_bounds: Per group, one bound per block, of the kind ``kinds`` gives it.
        config: Codec knobs; None uses the defaults.
        kinds: The bounds' ``BoundKind`` (``codec/bounds.py``): one for all, or per group one
            per block. ``ABSOLUTE``; ``RELATIVE`` (or True): the fraction of the block's finite
            range (``max - min``); ``VALUE``: ``|x' - x| <= bound * |x|`` for every element
            (``bound <= 0.5``, round to nearest only).

    Returns:
        The payloads back to back, their sizes and the per-block stats. On the device path
        (``config.backend`` "triton" or "reference", or "auto" on CUDA) exactly one
        device-to-host read.

    Raises:
        ValueError: A bad block, bound, flag or group shape (the message names it and the fix).
    """
    pending = start_compress_groups(groups, error_bounds, config, kinds)
    host = host_sync.to_host(pending.readback).tolist() if pending.readback.numel() else []
    return pending.finish(host)


def decompress_groups(
    buffer: torch.Tensor,
    sizes: Sequence[int],
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    backend: Backend = "auto",
    skeletons: Sequence[np.ndarray] | None = None,
    label: bool = True,
) -> tuple[list[list[torch.Tensor]], GroupStatus]:
    """Decodes every group's (source's) payload of one buffer in one call.

    With ``skeletons`` (the sender's ``GroupedPayloads.skeletons``, e.g. sent beside the sizes)
    the device path reads nothing back: the layouts come from the skeletons, and the device
    checks that every payload matches its skeleton and its checksum (a mismatch is reported by
    :func:`check_groups` like any decode error).

    The blocks must not be used before :func:`check_groups` has passed on the returned status:
    a corrupt payload's blocks may hold garbage (a rejected group's list is empty). On the host
    path errors are found here already and the status only carries them.

    Args:
        buffer: 1-D uint8 tensor: the payloads back to back.
        sizes: Bytes of each payload.
        max_elements: Refuse a payload that decodes to more elements than this.
        backend: As ``CodecConfig.backend``.
        skeletons: Per payload, its announced skeleton (uint32 words), or None.
        label: Whether the host path opens the profiler range ``## lossy_codec decode ##``
            (False when the caller's own range already covers the call).

    Returns:
        (blocks per group, the status to check).

    Raises:
        CodecError: ``buffer`` is not a 1-D uint8 tensor, or ``sizes`` do not add up to it.
    """
    if backend not in _BACKENDS:
        CodecConfig(backend=backend)  # raises, naming the backends
    sizes = [int(n) for n in sizes]
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise CodecError("buffer must be a 1-D torch.uint8 tensor")
    if any(n < 0 for n in sizes) or sum(sizes) != buffer.numel():
        raise CodecError(
            f"payload sizes {sizes} add up to {sum(sizes)} bytes, the buffer has "
            f"{buffer.numel()}: pass the sizes the buffer was built with"
        )
    if on_device(buffer.device, backend):
        from torchrec_lossy.codec.device_decompress import decompress_groups_device

        kernels = backend_kernels(buffer.device, backend)
        got = decompress_groups_device(buffer, sizes, max_elements, kernels, skeletons)
        status = GroupStatus({}, got, buffer, sizes, max_elements)
        for g, part in got.rejected.items():  # None: the announced skeleton was rejected
            status.rejected[g] = _rejected_error(status, g, part)
        return got.blocks, status
    status = GroupStatus()
    out = []
    for g, got in enumerate(decompress_host_groups(buffer, sizes, max_elements, label)):
        if isinstance(got, CodecError):
            status.rejected[g] = str(got)
            got = []
        out.append(got)
    return out, status


@functools.cache
def warm_up_host() -> None:
    """Loads the compiled CPU codec's kernels now (once per process): a tiny encode and decode.

    Numba's first call in a process costs about 0.1 s even from its on-disk cache, and compiles
    the kernels (tens of seconds) on the first run after an install or an edit; a CPU all-to-all
    calls this when it is built, so that neither cost lands in the first training step or in
    its codec time.
    """
    # A repeated row and a range to quantize: quantization, vector-LZ, Huffman, both ways.
    block = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [0.5, 0.25, 3.0]])
    payloads = compress_groups([[block], [block]], [[0.01], [0.0]], CodecConfig(backend="auto"))
    _, status = decompress_groups(payloads.buffer, payloads.sizes, label=False)
    check_groups(status)


def _rejected_error(status: GroupStatus, group: int, part: np.ndarray | None = None) -> str:
    """The CPU path's error for a payload the device path rejected, else that it does not
    match what its sender announced; ``part``: its bytes, read back here where None (only
    on an error path)."""
    if part is None:
        assert status.buffer is not None
        at = sum(status.sizes[:group])
        part = host_sync.to_host(status.buffer.narrow(0, at, status.sizes[group]))
    return str(host_error(part, status.max_elements) or _NOT_ANNOUNCED)


def contain_failures(status: GroupStatus) -> torch.Tensor | None:
    """Zeroes, on the device, the decoded blocks of every group whose decode failed there.

    The deferred alternative to :func:`check_groups`: nothing is read back, so the blocks can be
    used at once without a sync, and a corrupt payload's blocks hold zeros, never garbage. The
    caller must still read the returned flags at a later sync point and, where one is
    nonzero, report :func:`first_failure` (the error is only postponed, not dropped). Errors
    already known on the host (``status.rejected``; every error of the host path) are not
    covered: check those at once, at no cost.

    Args:
        status: From :func:`decompress_groups`.

    Returns:
        int32 per group on the device, nonzero where it failed; None if nothing can fail on
        the device (the host path, or no block decoded there).
    """
    dev = status.device
    if dev is None or dev.failed is None:
        return None
    if dev.out is not None:
        for g, (first, end) in dev.spans.items():
            dev.out[first:end].masked_fill_(dev.failed[g] != 0, 0)
    return dev.failed


def check_groups(status: GroupStatus) -> None:
    """Raises the first failing group's error; call it before the decoded blocks are used.

    On the device path this is where the decode status is read back (one device-to-host copy,
    a sync): call it at a point that synchronises anyway.

    Args:
        status: From :func:`decompress_groups`.

    Raises:
        CodecError: ``"payload <g>: <what is wrong>"`` for the lowest failing group ``g``.
    """
    failure = first_failure(status)
    if failure is not None:
        raise CodecError(f"payload {failure[0]}: {failure[1]}")


def first_failure(status: GroupStatus) -> tuple[int, str] | None:
    """The lowest failing group and its error (the CPU path's message), or None.

    Reads the device status back as :func:`check_groups` does (for callers that report the
    group in their own terms, e.g. the source rank).

    Args:
        status: From :func:`decompress_groups`.

    Returns:
        (group index, what is wrong), or None if every group decoded.
    """
    dev = status.device
    if dev is None or (dev.codes is None and dev.group_bad is None):  # known already
        return min(status.rejected.items()) if status.rejected else None
    failures = dict(status.rejected)
    n_groups = 0 if dev.group_bad is None else dev.group_bad.shape[0]
    parts = [t for t in (dev.group_bad, dev.codes) if t is not None]
    both = host_sync.to_host(torch.cat([t.to(torch.int64) for t in parts]))  # one read
    for g in np.flatnonzero(both[:n_groups]).tolist():  # not the announced payload
        if g not in failures:
            failures[g] = _rejected_error(status, g)
    codes = both[n_groups:]
    for i in np.flatnonzero(codes).tolist():
        g = int(dev.block_group[i])
        if g not in failures:
            local = i - int(np.searchsorted(dev.block_group, g))
            failures[g] = str(status_error(int(codes[i]), local))
    if not failures:
        return None
    g = min(failures)
    return g, failures[g]
