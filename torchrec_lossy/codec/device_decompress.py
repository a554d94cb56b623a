"""Device-resident, batched decompress: every block of a payload decoded at once, on its device.

:func:`decompress_device` gives the CPU path's bits and ``CodecError`` messages, with one launch
per stage for all blocks over the caller's ``kernel_set.KernelSet``. Host syncs: at most two per
payload, whatever the number of blocks, both through ``host_sync.to_host``: the whole payload
(the host checks its structure and lays out the sections; a rejected one goes to the caller's
``on_reject``), then the per-block status codes (skipped for raw-only payloads). Stages, syncs
and checks: docs/kernels.md, "Device-resident decompress".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import host_sync
from torchrec_lossy.codec.container import (
    DEFAULT_MAX_ELEMENTS,
    DESCRIPTOR_WORDS,
    HEADER_WORDS,
    check_payload,
    parse_header,
    skeleton_words,
    status_error,
    upload,
)
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.device_packed_decode import decode_packed, is_packed, range_checksums
from torchrec_lossy.codec.format import (
    CODE_DTYPES,
    DESCRIPTOR,
    HEADER,
    MODE_RAW,
    REFS_FIXED,
    REFS_FLAGGED,
    SEGMENT_HEADER_WORDS,
    CodecError,
    dtype_itemsize,
    segment_header_fields,
    segment_layout,
    words_for_bytes,
)
from torchrec_lossy.codec.kernel_set import KernelSet, load_kernels
from torchrec_lossy.codec.launch_tables import NO_FAILURE
from torchrec_lossy.profile_range import profile_range

_NONE = np.zeros(0, np.int64)


def _bases(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums with the total appended (``n + 1`` int64 entries)."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


def mixed_formats(mode: np.ndarray) -> bool:
    """Whether quantized blocks of both formats are decoded together (packed and Huffman-coded:
    the device stages take one or the other, so such a call goes to the host path).

    Args:
        mode: Descriptor modes of every block decoded in the call.

    Returns:
        True if both a packed and a Huffman-coded quantized block are among them.
    """
    quant = (mode & 2) == 2
    packed = is_packed(mode)
    return bool((quant & packed).any() and (quant & ~packed).any())


def _decode_on_host(
    buffer: torch.Tensor, buf: np.ndarray | None, sizes: list[int], max_elements: int
) -> list[list[torch.Tensor] | CodecError]:
    """Payloads' blocks decoded by the compiled host path and put on the buffer's device (each
    payload's blocks, or the CodecError it raises): for :func:`mixed_formats` calls."""
    from torchrec_lossy.codec.pipeline import decompress_host_groups

    if buf is None:
        buf = host_sync.to_host(buffer, "decompress")
    got = decompress_host_groups(torch.from_numpy(buf), sizes, max_elements, label=False)
    return [g if isinstance(g, CodecError) else [b.to(buffer.device) for b in g] for g in got]


def _words(t: torch.Tensor) -> torch.Tensor:
    """A uint8 payload's int32 words (a copy only where its start is not word-aligned)."""
    t = t.detach().contiguous()
    return (t.clone() if t.storage_offset() % 4 else t).view(torch.int32)


@dataclass(frozen=True)
class _Layout:
    """Every block's fields and section offsets, int64 [n_blocks] each (word offsets into the
    words of the buffer decoded from); blocks of several payloads concatenate."""

    rows: np.ndarray
    dim: np.ndarray
    dtype: np.ndarray
    mode: np.ndarray
    n_unique: np.ndarray  # vectors sent (rows for raw / quant)
    src_off: np.ndarray  # raw values / distinct vectors (raw, lz)
    ref_off: np.ndarray
    ref_words: np.ndarray
    ref_mode: np.ndarray  # -1 without references
    width: np.ndarray
    has_stream: np.ndarray
    step_bits: np.ndarray
    center: np.ndarray
    cb_off: np.ndarray
    sym_lo: np.ndarray
    sym_count: np.ndarray
    esc_len: np.ndarray
    esc_pos_off: np.ndarray
    n_esc: np.ndarray
    esc_val_off: np.ndarray
    ct_off: np.ndarray
    bs_off: np.ndarray
    bs_words: np.ndarray
    chunk_symbols: np.ndarray
    n_chunks: np.ndarray
    n_sym: np.ndarray
    n_out: np.ndarray
    out_words: np.ndarray


def _segment_headers(body: np.ndarray, start: np.ndarray) -> tuple:
    """Every block's segment header fields, read in place by ``format.segment_header_fields``
    (garbage for raw or short segments, which never use them).

    Returns:
        ``[n_blocks]`` arrays in ``SEGMENT_HEADER`` order but ``reserved``: ``step`` float32,
        the rest int64 (as ``segment_layout`` takes them).
    """
    idx = np.minimum(start[:, None] + np.arange(SEGMENT_HEADER_WORDS), body.shape[0] - 1)
    return segment_header_fields(body[idx].astype(np.int64).T)


def _layout(
    buf: np.ndarray, max_elements: int, verify_checksum: bool = True, first_word: int = 0
) -> _Layout | None:
    """Every block's fields and section offsets, or None if the CPU path would reject a segment.

    The header and descriptors go through the CPU path's own ``container.parse_header`` (which
    raises its ``CodecError``: those checks precede any block on the CPU path too). The segments
    are checked and laid out by ``format.segment_layout`` over all blocks at once (the host
    decoder names the error of a segment that fails).

    Args:
        buf: The payload's bytes.
        max_elements: Refuse payloads that decode to more elements than this in total.
        verify_checksum: False for a skeleton's stand-in (the device checks the payload).
        first_word: The payload's first word in the buffer it is decoded from.

    Returns:
        The layout (word offsets are into that buffer), or None.
    """
    body, descs, offsets = parse_header(buf, max_elements, verify_checksum)
    rows, dim, dtype, mode, seg = (
        descs[name].astype(np.int64) for name in ("rows", "dim", "dtype", "mode", "seg_words")
    )
    step, *header = _segment_headers(body, offsets[:-1])
    center, _, n_esc, chunk_symbols, n_chunks, lo, count, esc_len, ref_mode, width = header
    itemsize = dtype_itemsize(dtype)
    ok, nu, ref_off, ref_words, _, esc_pos_off, ct_off, bs_off = segment_layout(
        (mode, rows, dim, itemsize, seg), (step, *header)
    )
    if not ok.all():
        return None
    base = first_word + HEADER_WORDS + offsets[:-1]  # segment starts, in buffer words
    lz, quant = (mode & 1) == 1, (mode & 2) == 2
    head = SEGMENT_HEADER_WORDS
    n_out = rows * dim
    return _Layout(
        rows=rows,
        dim=dim,
        dtype=dtype,
        mode=mode,
        n_unique=nu,
        src_off=base + np.where(mode == MODE_RAW, 0, head + ref_words),
        ref_off=base + ref_off,
        ref_words=ref_words,
        ref_mode=np.where(lz, ref_mode, -1),
        width=np.where(lz, width, 0),
        has_stream=quant.astype(np.int64),
        step_bits=step.view(np.int32).astype(np.int64),
        center=np.where(quant, center, 0),
        cb_off=base + head,
        sym_lo=np.where(quant, lo, 0),
        sym_count=np.where(quant, count, 0),
        esc_len=np.where(quant, esc_len, 0),
        esc_pos_off=base + esc_pos_off,
        n_esc=np.where(quant, n_esc, 0),
        esc_val_off=base + esc_pos_off + n_esc,
        ct_off=base + ct_off,
        bs_off=base + bs_off,
        bs_words=np.where(quant, seg - bs_off, 0),
        chunk_symbols=np.where(quant, chunk_symbols, 0),
        n_chunks=np.where(quant, n_chunks, 0),
        n_sym=np.where(quant, nu * dim, 0),
        n_out=n_out,
        out_words=words_for_bytes(n_out * itemsize),
    )


def decompress_device(
    payload: torch.Tensor,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    on_reject: Callable[[np.ndarray], object] | None = None,
    kernels: KernelSet | None = None,
) -> list[torch.Tensor]:
    """Decodes a payload made by ``compress`` on the payload's device, all blocks at once.

    Args:
        payload: 1-D uint8 tensor (CUDA, or CPU under ``TRITON_INTERPRET=1`` or with the
            torch twins).
        max_elements: Refuse payloads that decode to more elements than this in total.
        on_reject: Called with the host copy of a payload whose segments the layout checks
            reject, before any launch; it should raise the exact error (``pipeline.decompress``
            passes its host decoder: a data error in an earlier block, which only decoding
            finds, must win, as on the CPU path). Without it a generic CodecError is raised.
        kernels: The kernel set (``kernel_set.load_kernels``); None: the Triton launchers.

    Returns:
        The blocks: same shapes, dtypes and bits as the CPU path's, on the payload's device
        (views into one buffer).

    Raises:
        CodecError: The payload is truncated, corrupted or not a torchrec-lossy payload (the
            CPU path's message).
        RuntimeError: The Triton set was asked for and triton is not installed.
    """
    check_payload(payload)
    if kernels is None:
        kernels = load_kernels(payload.device)
    with profile_range("## lossy_codec decode ##"):
        buf = host_sync.to_host(payload, "decompress")  # sync 1: the whole (compressed) payload
        layout = _layout(buf, max_elements)
        if layout is None:
            if on_reject is not None:
                on_reject(buf)
            # Unreachable with the host decoder while _layout and it agree (tested).
            raise CodecError("corrupt payload: rejected by the device decoder's layout checks")
        if mixed_formats(layout.mode):
            (got,) = _decode_on_host(payload, buf, [buf.shape[0]], max_elements)
            if isinstance(got, CodecError):
                raise got
            return got
        if layout.rows.shape[0] == 0:
            return []
        return _decode_on_device(payload, layout, kernels)[0]


def _upload(lay: _Layout, device: torch.device) -> DecodeColumns:
    """The kernels' record of a layout, in one non-blocking upload: its fields, the numbering
    over all blocks and the status rows at their initial values (only raised / lowered)."""
    n, lz, quant = lay.rows.shape[0], lay.ref_mode >= 0, lay.has_stream == 1
    fixed = np.flatnonzero(lay.ref_mode == REFS_FIXED)
    flagged, quant_blocks = np.flatnonzero(lay.ref_mode == REFS_FLAGGED), np.flatnonzero(quant)
    fields = {
        **vars(lay),
        "id_base": _bases(np.where(lz, lay.rows, 0))[:-1],
        "table_idx": np.where(quant, np.cumsum(quant) - 1, 0),
        "out_off": _bases(lay.out_words)[:-1],
        "out_base": _bases(lay.n_out),
        "sym_base": _bases(lay.n_sym),
        "chunk_base": _bases(lay.n_chunks),
        "fixed_base": _bases(lay.rows[fixed]),
        "fixed_blocks": fixed,
        "flagged_blocks": flagged,
        "quant_blocks": quant_blocks,
        "fail": np.full(n, NO_FAILURE, np.int64),
        "esc_bad": np.full(n, NO_FAILURE, np.int64),
    }
    host = dc.stack_columns(lambda name: fields.get(name, np.zeros(0, np.int64)), n)
    (flat,) = upload([host], device)
    counts = (fixed, flagged, quant_blocks)
    return DecodeColumns(flat.view(dc.N_FIELDS, n + 1), n, *(a.shape[0] for a in counts))


def _decode_symbols(
    words: torch.Tensor, d: DecodeColumns, lay: _Layout, k: KernelSet
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode tables, vector references, Huffman streams and escape ranks of every block.

    Returns:
        (vector ids, int16 symbols, int32 escape ranks; a 1-element dummy where there are none).
    """
    dummy = torch.zeros(1, dtype=torch.int32, device=words.device)
    n_ids, total_sym = int(lay.rows[lay.ref_mode >= 0].sum()), int(lay.n_sym.sum())
    n_fixed_rows = int(lay.rows[lay.ref_mode == REFS_FIXED].sum())
    tables = k.codebook.decode_tables(words, d)
    ids = k.vector_lz.unpack_refs_blocks(words, d, n_ids, n_fixed_rows)
    symbols, is_esc = k.huffman.decode_blocks(words, d, tables, int(lay.n_chunks.sum()), total_sym)
    rank = k.huffman.check_escapes(is_esc, words, d)
    if not total_sym:
        symbols, rank = dummy.view(torch.int16), dummy
    return ids if n_ids else dummy, symbols, rank


def _decode_packed(
    words: torch.Tensor,
    d: DecodeColumns,
    lay: _Layout,
    k: KernelSet,
    extra: tuple[np.ndarray, np.ndarray],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vector references, then every block decoded and every packed block checked
    (``device_packed_decode``; ``extra``: word ranges summed in its checksum launch).

    Returns:
        (int32 output words, int32 status per block, int64 sums of the ``extra`` ranges).
    """
    n_ids = int(lay.rows[lay.ref_mode >= 0].sum())
    n_fixed_rows = int(lay.rows[lay.ref_mode == REFS_FIXED].sum())
    ids = k.vector_lz.unpack_refs_blocks(words, d, n_ids, n_fixed_rows)
    if not n_ids:
        ids = torch.zeros(1, dtype=torch.int32, device=words.device)
    totals = (
        int(lay.n_chunks.sum()),
        int(lay.n_esc.max(initial=0)),
        int(lay.out_words.sum()),
        int(lay.n_out.sum()),
    )
    packed = is_packed(lay.mode).astype(np.int64)
    ranges = (lay.cb_off, lay.bs_off + lay.bs_words, packed, totals)
    return decode_packed(words, d, k, ids, ranges, extra)


def _block_views(out: torch.Tensor, lay: _Layout) -> list[torch.Tensor]:
    """Every block as a view of the output words: one typed view per dtype, then one
    ``as_strided`` per block."""
    halves = out.view(torch.int16)
    typed = {
        code: (out if dtype_itemsize(code) == 4 else halves).view(dtype)
        for code, dtype in CODE_DTYPES.items()
    }
    blocks, out_off = [], _bases(lay.out_words)[:-1]  # each block's first word
    for r, c, d, o, n in zip(
        *(a.tolist() for a in (lay.rows, lay.dim, lay.dtype, out_off, lay.n_out)), strict=True
    ):
        if n == 0:
            blocks.append(torch.empty((r, c), dtype=CODE_DTYPES[d], device=out.device))
        else:
            blocks.append(typed[d].as_strided((r, c), (c, 1), 4 * o // dtype_itemsize(d)))
    return blocks


def _decode_on_device(
    payload: torch.Tensor,
    layout: _Layout,
    k: KernelSet,
    defer_status: bool = False,
    extra: tuple[np.ndarray, np.ndarray] = (_NONE, _NONE),
) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Launches every stage for all blocks and returns them with the device status codes.

    Unless ``defer_status``, the status is read once here and the first error raised. The
    blocks are views of the returned int32 output words. ``extra``: (starts, ends) of word
    ranges whose checksums the packed decode sums in its own launch (returned last; None when
    no block is packed).
    """
    d = _upload(layout, payload.device)
    words = _words(payload)
    sums = None
    if is_packed(layout.mode).any():
        out, codes, sums = _decode_packed(words, d, layout, k, extra)
    else:
        ids, symbols, rank = _decode_symbols(words, d, layout, k)
        n_out_words, n_elements = int(layout.out_words.sum()), int(layout.n_out.sum())
        out = k.quantize.decode_outputs(words, d, ids, symbols, rank, n_out_words, n_elements)
        codes = None
        # What decoding itself can find wrong: references out of range, bad streams.
        if (layout.ref_mode >= 0).any() or layout.has_stream.any():
            codes = k.huffman.block_status(d, rank)
    if codes is not None and not defer_status:  # sync 2: every decode error of every block
        raise_status(host_sync.to_host(codes, "decompress"))
    return _block_views(out, layout), codes, out, sums


def raise_status(codes: np.ndarray) -> None:
    """Raises the first failing block's error of a payload's status codes (if any).

    Args:
        codes: Per-block status codes read back from the device.

    Raises:
        CodecError: Some block failed to decode.
    """
    bad = np.flatnonzero(codes)
    if bad.shape[0]:
        raise status_error(int(codes[bad[0]]), int(bad[0]))


@dataclass
class DeviceGroups:
    """What :func:`decompress_groups_device` decoded, with its status left on the device.

    Attributes:
        blocks: Per payload, its blocks ([] for a rejected one).
        codes: int32 status per decoded block (0: fine), or None if nothing can fail on the
            device.
        block_group: The payload of each entry of ``codes``.
        rejected: Payloads the layout checks rejected, by index: their host bytes (None in
            skeleton mode, where the payload itself was not read).
        group_bad: int32 per payload: 1 where it does not match its skeleton or checksum
            (skeleton mode), else None.
        failed: int32 per payload, nonzero where its decode failed on the device (the OR of
            ``group_bad`` and its blocks' ``codes``), or None if nothing can fail there.
        out: The int32 output words every decoded block is a view of, or None.
        spans: Per payload with decoded blocks, its [first, end) words of ``out``.
    """

    blocks: list[list[torch.Tensor]]
    codes: torch.Tensor | None
    block_group: np.ndarray
    rejected: dict[int, np.ndarray | None]
    group_bad: torch.Tensor | None
    failed: torch.Tensor | None = None
    out: torch.Tensor | None = None
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)


def _failed_groups(
    n_groups: int,
    codes: torch.Tensor | None,
    block_group: np.ndarray,
    group_bad: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Per payload on the device: nonzero where it failed (no host read)."""
    if codes is None and group_bad is None:
        return None
    failed = (
        group_bad.clone()
        if group_bad is not None
        else torch.zeros(n_groups, dtype=torch.int32, device=device)
    )
    if codes is not None:
        (group_of,) = upload([block_group], device)
        failed.scatter_reduce_(0, group_of, (codes != 0).to(torch.int32), "amax")
    return failed


def decompress_groups_device(
    buffer: torch.Tensor,
    sizes: list[int],
    max_elements: int,
    kernels: KernelSet,
    skeletons: Sequence[np.ndarray] | None = None,
) -> DeviceGroups:
    """Decodes several payloads held back to back in one buffer, all blocks in one pass.

    Without ``skeletons``: one host read (the whole buffer, for the layouts). With them (each
    payload's ``container.skeleton_index`` words, announced by its sender): no read at all; the
    layouts come from the skeletons and the device checks each payload against its skeleton and
    its checksum. Either way the decode status is NOT read: it is returned as device tensors for
    the caller to check at a sync point of its choosing.

    Args:
        buffer: 1-D uint8 tensor on the device (CUDA, or CPU: interpreter or twins).
        sizes: Bytes of each payload.
        max_elements: Refuse payloads that decode to more elements than this (each).
        kernels: The kernel set (``kernel_set.load_kernels``).
        skeletons: Per payload, its announced skeleton (uint32 words), or None.

    Returns:
        The blocks and the status, on the device (:class:`DeviceGroups`).
    """
    with profile_range("## lossy_codec decode ##"):
        # The one read, without skeletons.
        buf = host_sync.to_host(buffer, "decompress") if skeletons is None else None
        layouts, rejected, checks = _read_layouts(buf, sizes, max_elements, skeletons)
        modes = [lay.mode for lay in layouts.values()]
        if mixed_formats(np.concatenate([*modes, np.zeros(0, np.int64)])):
            got = _decode_on_host(buffer, buf, sizes, max_elements)
            at = _bases(sizes).tolist()
            bad = {g: (buf[at[g] : at[g + 1]] if buf is not None else None)
                   for g, x in enumerate(got) if isinstance(x, CodecError)}  # fmt: skip
            blocks = [[] if isinstance(x, CodecError) else x for x in got]
            return DeviceGroups(blocks, None, np.zeros(0, np.int64), bad, None)
        out: list[list[torch.Tensor]] = [[] for _ in sizes]
        groups = [np.full(lay.rows.shape[0], g, np.int64) for g, lay in layouts.items()]
        block_group = np.concatenate([*groups, np.zeros(0, np.int64)])
        if not layouts:
            group_bad = _check_skeletons(buffer, sizes, checks, kernels, skeletons is not None)
            failed = _failed_groups(len(sizes), None, block_group, group_bad, buffer.device)
            return DeviceGroups(out, None, block_group, rejected, group_bad, failed)
        merged = _Layout(
            **{
                f.name: np.concatenate([getattr(lay, f.name) for lay in layouts.values()])
                for f in dataclasses.fields(_Layout)
            }
        )
        # A packed decode sums the payloads' checksums in its own checksum launch.
        bodies = _bodies(sizes, checks)
        blocks, codes, words_out, sums = _decode_on_device(
            buffer, merged, kernels, defer_status=True, extra=bodies
        )
        group_bad = _check_skeletons(buffer, sizes, checks, kernels, skeletons is not None, sums)
        for g, b in zip(block_group.tolist(), blocks, strict=True):
            out[g].append(b)
        # Each payload's blocks are consecutive in the merged layout, so in the output words.
        out_bases = _bases(merged.out_words)
        firsts = np.flatnonzero(np.r_[True, block_group[1:] != block_group[:-1]])
        ends = np.r_[firsts[1:], block_group.shape[0]]
        spans = {
            int(block_group[a]): (int(out_bases[a]), int(out_bases[b]))
            for a, b in zip(firsts, ends, strict=True)
        }
        failed = _failed_groups(len(sizes), codes, block_group, group_bad, buffer.device)
        return DeviceGroups(out, codes, block_group, rejected, group_bad, failed, words_out, spans)


def _read_layouts(
    buf: np.ndarray | None,
    sizes: list[int],
    max_elements: int,
    skeletons: Sequence[np.ndarray] | None,
) -> tuple[dict[int, _Layout], dict[int, np.ndarray | None], list[_SkeletonCheck]]:
    """Every payload's layout, from the buffer's host copy ``buf`` or from its skeleton.

    Returns:
        (the layout of every payload with blocks, by payload; the rejected payloads: their
        bytes, None in skeleton mode; what the device checks of each payload in skeleton mode).
    """
    layouts: dict[int, _Layout] = {}
    rejected: dict[int, np.ndarray | None] = {}
    checks: list[_SkeletonCheck] = []
    for g, (at, n) in enumerate(zip(_bases(sizes)[:-1].tolist(), sizes, strict=True)):
        try:
            if buf is not None:
                whole = n % 4 == 0  # a payload is whole words
                lay = _layout(buf[at : at + n], max_elements, first_word=at // 4) if whole else None
            else:
                part, pos = _from_skeleton(np.asarray(skeletons[g], np.uint32), n)
                lay = _layout(part, max_elements, verify_checksum=False, first_word=at // 4)
                words = part.view(np.uint32)[pos]
                checks.append(_SkeletonCheck(g, at // 4 + pos, words, at // 4))
        except CodecError:
            lay = None
        if lay is None:
            rejected[g] = buf[at : at + n] if buf is not None else None
        elif lay.rows.shape[0]:
            layouts[g] = lay
    return layouts, rejected, checks


class _SkeletonCheck(NamedTuple):
    """What the device checks of a payload decoded from its announced skeleton."""

    group: int  # the payload
    pos: np.ndarray  # the skeleton's word positions in the buffer
    words: np.ndarray  # uint32 words announced there
    first_word: int  # the payload's first word in the buffer


def _from_skeleton(skeleton: np.ndarray, n_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A stand-in payload of ``n_bytes`` holding only a skeleton, and the skeleton's positions.

    Raises:
        CodecError: The skeleton cannot be the skeleton of an ``n_bytes`` payload.
    """
    words = n_bytes // 4
    if n_bytes % 4 or words < HEADER_WORDS or skeleton.shape[0] < HEADER_WORDS:
        raise CodecError(f"corrupt payload: a {n_bytes}-byte payload has no valid skeleton")
    n = int(skeleton[:HEADER_WORDS].view(HEADER)[0]["n_blocks"])
    if skeleton.shape[0] != skeleton_words(n):
        raise CodecError("corrupt payload: the skeleton does not match its block count")
    descs = skeleton[HEADER_WORDS : HEADER_WORDS + DESCRIPTOR_WORDS * n].view(DESCRIPTOR)
    seg = descs["seg_words"].astype(np.int64)
    seg_start = HEADER_WORDS + DESCRIPTOR_WORDS * n + np.cumsum(seg) - seg
    # container.skeleton_index of one payload at word 0, on the host (no torch op): its header
    # and descriptors, then 8 words from each segment's start, clamped to its last word.
    seg_at = np.minimum(seg_start[:, None] + np.arange(SEGMENT_HEADER_WORDS), words - 1)
    pos = np.concatenate([np.arange(HEADER_WORDS + DESCRIPTOR_WORDS * n), seg_at.reshape(-1)])
    if pos.shape[0] and (pos.min() < 0 or pos.max() >= words):
        raise CodecError("corrupt payload: the skeleton points outside the payload")
    stand_in = np.zeros(words, np.uint32)
    stand_in[pos] = skeleton
    return stand_in.view(np.uint8), pos


def _bodies(sizes: list[int], checks: list[_SkeletonCheck]) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) in buffer words of the bodies of the payloads checked against their
    skeletons (what each header's checksum covers)."""
    starts = np.array([c.first_word + HEADER_WORDS for c in checks], np.int64)
    ends = np.array([c.first_word + sizes[c.group] // 4 for c in checks], np.int64)
    return starts, ends


def _check_skeletons(
    buffer: torch.Tensor,
    sizes: list[int],
    checks: list[_SkeletonCheck],
    k: KernelSet,
    announced: bool,
    sums: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Per payload on the device: 1 where it differs from its skeleton or fails its checksum
    (None without ``announced`` skeletons).

    Args:
        buffer: The payloads.
        sizes: Bytes of each payload.
        checks: What to check of each payload.
        k: The kernel set (the checksums' tiled sum, where ``sums`` is None).
        announced: Whether the payloads came with skeletons.
        sums: The bodies' checksums (:func:`_bodies`' ranges), if a launch summed them.

    Returns:
        int32 per payload, or None.
    """
    if not announced:
        return None
    bad = torch.zeros(len(sizes), dtype=torch.int32, device=buffer.device)
    if not checks:
        return bad
    words = _words(buffer)
    # The announced checksum: header bytes 24..31 (the skeleton's header is the payload's).
    announced_sums = [c.words[:HEADER_WORDS].view(HEADER)[0]["checksum"] for c in checks]
    pos, expected, group, checksum, ids = upload(
        [
            np.concatenate([c.pos for c in checks]),
            np.concatenate([c.words for c in checks]),
            np.concatenate([np.full(c.pos.shape[0], c.group, np.int64) for c in checks]),
            np.array(announced_sums, np.uint64).view(np.int64),
            [c.group for c in checks],
        ],
        buffer.device,
    )
    differs = ((words[pos].to(torch.int64) & 0xFFFFFFFF) != expected).to(torch.int32)
    bad.scatter_reduce_(0, group, differs, "amax")
    if sums is None:  # wrapping int64 sums: the u64 checksum exactly
        sums = range_checksums(words, k, *_bodies(sizes, checks))
    bad.scatter_reduce_(0, ids, (sums != checksum).to(torch.int32), "amax")
    return bad
