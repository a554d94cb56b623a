"""The payload container: header, block descriptors, checksums and the payloads' skeletons.

One module for what wraps the blocks' segments (docs/format.md), used by the host path
(``pipeline``) and the device paths (``device_compress``, ``device_decompress``, ``grouped``)
alike: the host builds and parses records with numpy, the device builds them with
``format.pack_records`` from the same record dtypes, and both checksum through
:func:`checksum` / :func:`segment_checksums`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch

from torchrec_lossy.codec.elementwise import jitable
from torchrec_lossy.codec.format import (  # *_WORDS: re-exported for importers
    CODE_DTYPES,
    DECODE_ERRORS,
    DESCRIPTOR,
    DESCRIPTOR_WORDS,
    HEADER,
    HEADER_WORDS,
    MAGIC,
    MODE_NAMES,
    PACKED_DECODE_ERRORS,
    REFS_OUT_OF_RANGE,
    SECTIONS,
    SEGMENT_BAD_CHUNKS,
    SEGMENT_BAD_CODEBOOK,
    SEGMENT_BAD_ESCAPES,
    SEGMENT_BAD_GRID,
    SEGMENT_BAD_PACKING,
    SEGMENT_BAD_REFS,
    SEGMENT_BAD_STREAM,
    SEGMENT_BAD_VALUE_GRID,
    SEGMENT_BAD_VECTORS,
    SEGMENT_HEADER_WORDS,
    SEGMENT_REFS_RANGE,
    SEGMENT_TRAILING,
    SEGMENT_TRUNCATED,
    VERSION,
    CodecError,
    checksum_words,
    mode_valid,
)

# A payload may not ask the decoder for more output elements than this (a crafted payload must not
# be able to make it allocate without bound); pass ``max_elements`` to decompress to raise it.
DEFAULT_MAX_ELEMENTS = 1 << 28
MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class BlockStats:
    """What happened to one block.

    Attributes:
        rows: Rows of the block.
        dim: Columns of the block.
        raw_bytes: Bytes of the block as a tensor.
        wire_bytes: Bytes it took in the payload (descriptor and segment; the 32-byte payload
            header is not attributed to any block).
        mode: ``"raw"``, ``"lz"``, ``"quant"`` or ``"quant+lz"``.
        bound: Absolute error bound.
        max_error: Max |x - x'| over the finite elements (0 for lossless modes).
        n_unique: Distinct vectors sent (rows when no vector-LZ).
        n_escapes: Elements sent verbatim by the escape path.
    """

    rows: int
    dim: int
    raw_bytes: int
    wire_bytes: int
    mode: str
    bound: float
    max_error: float
    n_unique: int
    n_escapes: int


# BlockStats' fields in order, which BlockColumns repeats as lists.
_STAT_FIELDS = tuple(f.name for f in dataclasses.fields(BlockStats))


@dataclass(frozen=True)
class BlockColumns:
    """What :class:`BlockStats` says of each of several blocks, one list per field.

    Cheaper to build and to read than one object per block on small payloads (the host path
    reports its blocks this way; :meth:`stats` gives the objects).

    Attributes:
        rows: Rows of each block.
        dim: Columns of each block.
        raw_bytes: Bytes of each block as a tensor.
        wire_bytes: Bytes each took in the payload (descriptor and segment).
        mode: Mode name of each block.
        bound: Absolute error bound of each block.
        max_error: Max |x - x'| over the finite elements of each block.
        n_unique: Distinct vectors sent per block.
        n_escapes: Elements sent verbatim per block.
    """

    rows: list[int]
    dim: list[int]
    raw_bytes: list[int]
    wire_bytes: list[int]
    mode: list[str]
    bound: list[float]
    max_error: list[float]
    n_unique: list[int]
    n_escapes: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    def slice(self, first: int, end: int) -> BlockColumns:
        """Blocks ``[first, end)``.

        Args:
            first: First block.
            end: One past the last block.

        Returns:
            Their columns.
        """
        return BlockColumns(*(getattr(self, f)[first:end] for f in _STAT_FIELDS))

    def stats(self) -> list[BlockStats]:
        """One :class:`BlockStats` per block.

        Returns:
            The objects, in block order.
        """
        fields = (getattr(self, f) for f in _STAT_FIELDS)
        return [BlockStats(*row) for row in zip(*fields, strict=True)]

    @staticmethod
    def assemble(
        shape: tuple[Sequence[int], Sequence[int], Sequence[int]],
        mode: Sequence[int],
        seg_words: Sequence[int],
        bound: Sequence[float],
        max_error: Sequence[float],
        sent: tuple[Sequence[int], Sequence[int]],
    ) -> BlockColumns:
        """The columns from an encoder's per-block results: the one place every backend's
        stats are derived (sizes, mode names) from what it wrote.

        Args:
            shape: (rows, columns, bytes per element) of each block.
            mode: Mode of each block (``MODE_*``).
            seg_words: Segment words of each block.
            bound: Absolute error bound of each block.
            max_error: Max error of each block (0 for lossless modes).
            sent: (distinct vectors sent, escaped elements) of each block.

        Returns:
            The columns (Python ints and floats).
        """
        rows, dim, itemsize = (np.asarray(v, dtype=np.int64) for v in shape)
        return BlockColumns(
            rows=rows.tolist(),
            dim=dim.tolist(),
            raw_bytes=(rows * dim * itemsize).tolist(),
            wire_bytes=(DESCRIPTOR.itemsize + 4 * np.asarray(seg_words, np.int64)).tolist(),
            mode=[MODE_NAMES[m] for m in np.asarray(mode).tolist()],
            bound=np.asarray(bound, np.float64).tolist(),
            max_error=np.asarray(max_error, np.float64).tolist(),
            n_unique=np.asarray(sent[0], np.int64).tolist(),
            n_escapes=np.asarray(sent[1], np.int64).tolist(),
        )

    @staticmethod
    def of(stats: Sequence[BlockStats]) -> BlockColumns:
        """The columns of ``stats``.

        Args:
            stats: One BlockStats per block.

        Returns:
            Their columns.
        """
        return BlockColumns(*([getattr(b, f) for b in stats] for f in _STAT_FIELDS))


# ---------------------------------------------------------------------------------------------
# Checksum: sum_i w_i * (2 i + 1) mod 2**64 over 32-bit words (docs/format.md).


def segment_checksums(
    words: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """The checksum of several word ranges of one buffer, on its device, without a host sync.

    Every single-bit flip changes a checksum (each weight ``2 i + 1`` is odd, ``i`` counted
    from the range's start), so do swapped words; integer sums are exact and order-free, so
    sender and receiver agree on any device.

    Args:
        words: 1-D int32 (or int64 holding uint32 values) buffer.
        starts: int64 [n] first word of each range (on ``words``' device).
        lengths: int64 [n] words of each range; ranges must not overlap.

    Returns:
        int64 [n] checksums (the uint64 value's bits).
    """
    n = starts.shape[0]
    out = torch.zeros(n, dtype=torch.int64, device=words.device)
    if n == 0 or words.numel() == 0:
        return out
    u = words.to(torch.int64) & MASK32
    pos = torch.arange(u.shape[0], device=words.device)
    ends = starts + lengths
    # Ranges are sorted by start for the search; the answer goes back to the caller's order.
    order = torch.argsort(starts)
    seg_sorted = (torch.searchsorted(starts[order], pos, right=True) - 1).clamp(min=0)
    seg = order[seg_sorted]
    inside = (pos >= starts[seg]) & (pos < ends[seg])
    # int64 products and sums wrap modulo 2**64, which is exactly the checksum's arithmetic.
    terms = torch.where(inside, u * ((pos - starts[seg]) * 2 + 1), 0)
    return out.index_add_(0, seg, terms)


def checksum(words: np.ndarray | torch.Tensor) -> int | torch.Tensor:
    """The payload checksum of a run of 32-bit words.

    Args:
        words: 1-D uint32 numpy array (host: the compiled kernel), or an int32 / int64 tensor
            on any device (no sync: :func:`segment_checksums` over one range).

    Returns:
        A Python int in [0, 2**64) for numpy input; an int64 0-d tensor (the uint64 bits) on
        the tensor's device otherwise.
    """
    if isinstance(words, np.ndarray):
        return int(checksum_words(words))
    dev = words.device
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    n = torch.full((1,), words.shape[0], dtype=torch.int64, device=dev)
    return segment_checksums(words, zero, n)[0]


# ---------------------------------------------------------------------------------------------
# Records built on the device from the format's numpy record dtypes.


# ---------------------------------------------------------------------------------------------
# Skeletons: the words a decoder's layout depends on.


def upload(
    arrays: Sequence[np.ndarray | Sequence[int]], device: torch.device
) -> list[torch.Tensor]:
    """Host int64 arrays to the device in one non-blocking copy (pinned on CUDA: no sync).

    Args:
        arrays: 1-D integer arrays.
        device: Target device.

    Returns:
        int64 tensors on ``device``, one per array (views of one buffer).
    """
    arrays = [np.asarray(a, np.int64).reshape(-1) for a in arrays]
    sizes = [a.shape[0] for a in arrays]
    host = torch.from_numpy(np.concatenate(arrays or [np.zeros(1, np.int64)]))
    if device.type == "cuda":  # a pageable source would make the copy synchronise
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    if len(arrays) == 1:
        return [flat]
    return list(flat[: sum(sizes)].split(sizes)) if arrays else []


@jitable
def skeleton_words(n_blocks: int) -> int:
    """Words of the skeleton of a payload with ``n_blocks`` blocks (:func:`skeleton_index`).

    Args:
        n_blocks: Blocks in the payload.

    Returns:
        ``8 + 14 * n_blocks``.
    """
    return HEADER_WORDS + (DESCRIPTOR_WORDS + SEGMENT_HEADER_WORDS) * n_blocks


def skeleton_index(
    payload_base: torch.Tensor,
    payload_words: torch.Tensor,
    group_blocks: Sequence[int],
    seg_start: torch.Tensor,
) -> torch.Tensor:
    """Word positions of the payloads' skeletons: header, descriptors, segment headers.

    A payload's layout (where every section lies, how big every decode grid is) depends on
    these words only: a decoder that is given them needs no read of the payload itself, and
    can check the payload against them on the device. Group ``g``'s skeleton is ``8 + 14 n``
    words for ``n`` blocks: its header and descriptors, then 8 words from each segment's start
    (clamped to the payload's last word, as ``device_decompress`` reads them: raw segments have
    no header).

    Args:
        payload_base: int64 [G] first word of each payload in the buffer.
        payload_words: int64 [G] words of each payload.
        group_blocks: Blocks of each payload (host).
        seg_start: int64 [sum(group_blocks)] first word of each segment in the buffer.

    Returns:
        int64 positions, the skeletons of every payload back to back (on the tensors' device).
    """
    dev = payload_base.device
    n = np.asarray(group_blocks, dtype=np.int64).reshape(-1)
    head = HEADER_WORDS + DESCRIPTOR_WORDS * n
    k_head = np.arange(int(head.sum())) - np.repeat(np.cumsum(head) - head, head)
    # Order: group by group, its head then its segment headers.
    size = head + SEGMENT_HEADER_WORDS * n
    start = np.cumsum(size) - size
    block_first = np.cumsum(n) - n
    local = np.arange(int(n.sum())) - np.repeat(block_first, n)
    seg_at = (np.repeat(start + head, n) + SEGMENT_HEADER_WORDS * local)[:, None] + np.arange(
        SEGMENT_HEADER_WORDS
    )
    group_of_head, k_head_t, group_of_block, head_at, seg_at_t = upload(
        [
            np.repeat(np.arange(n.shape[0]), head),
            k_head,
            np.repeat(np.arange(n.shape[0]), n),
            np.repeat(start, head) + k_head,
            seg_at.reshape(-1),
        ],
        dev,
    )
    heads = payload_base[group_of_head] + k_head_t
    last = (payload_base + payload_words - 1)[group_of_block]
    segs = torch.minimum(
        seg_start[:, None] + torch.arange(SEGMENT_HEADER_WORDS, device=dev), last[:, None]
    )
    out = torch.empty(int(size.sum()), dtype=torch.int64, device=dev)
    out[head_at] = heads
    out[seg_at_t] = segs.reshape(-1)
    return out


@numba.njit(cache=True, nogil=True, inline="always")
def descriptors(payload: np.ndarray) -> np.ndarray:
    """The block descriptors of a payload whose header is sound (uint32 words, from its
    header on), as a view of ``DESCRIPTOR`` records."""
    n_blocks = np.int64(payload[:HEADER_WORDS].view(HEADER)[0]["n_blocks"])
    return payload[HEADER_WORDS : HEADER_WORDS + DESCRIPTOR_WORDS * n_blocks].view(DESCRIPTOR)


@numba.njit(cache=True, nogil=True)
def skeletons_kernel(words: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`payload_skeletons` in one compiled pass."""
    ends = np.zeros(sizes.shape[0] + 1, np.int64)
    starts = np.zeros(sizes.shape[0] + 1, np.int64)
    for g in range(sizes.shape[0]):  # sized first: a payload's skeleton words per block
        starts[g + 1] = starts[g] + sizes[g] // 4
        n = descriptors(words[starts[g] : starts[g + 1]]).shape[0]
        ends[g + 1] = ends[g] + skeleton_words(n)
    out = np.empty(ends[-1], np.uint32)
    for g in range(sizes.shape[0]):
        payload = words[starts[g] : starts[g + 1]]
        descs = descriptors(payload)
        head = HEADER_WORDS + DESCRIPTOR_WORDS * descs.shape[0]
        at = ends[g]
        out[at : at + head] = payload[:head]
        at += head
        start = head
        for b in range(descs.shape[0]):  # 8 words from each segment's start, clamped
            for k in range(SEGMENT_HEADER_WORDS):
                out[at + k] = payload[min(start + k, payload.shape[0] - 1)]
            at += SEGMENT_HEADER_WORDS
            start += np.int64(descs[b]["seg_words"])
    return out, ends


def payload_skeletons(words: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """The skeletons (:func:`skeleton_index`) of well-formed payloads, on the host.

    The words :func:`skeleton_index` names for each payload alone, gathered in one compiled
    pass (its torch ops cost more than the words they gather on small payloads).

    Args:
        words: The payloads as uint32 words, back to back (made by ``compress``).
        sizes: Bytes of each payload.

    Returns:
        Per payload, its uint32 skeleton words.
    """
    return split_skeletons(*skeletons_kernel(words, np.asarray(sizes, np.int64).reshape(-1)))


def split_skeletons(skeletons: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    """:func:`skeletons_kernel`'s result cut per payload.

    Args:
        skeletons: uint32 skeleton words of every payload, back to back.
        ends: int64 [G + 1]: offset of each payload's skeleton in them, then the end.

    Returns:
        Per payload, its skeleton (the array itself for one payload: nothing to cut).
    """
    if ends.shape[0] == 2:
        return [skeletons]
    return [skeletons[a:b] for a, b in itertools.pairwise(ends.tolist())]


# ---------------------------------------------------------------------------------------------
# Host side: header, descriptor parse.


@numba.njit(cache=True, nogil=True)
def header_words(n_blocks: int, body: np.ndarray, flags: int = 0) -> np.ndarray:
    """The payload header for a body (uint32 words, descriptors and segments), as words
    (``flags``: ``format.FLAG_PACKED`` for a packed-format payload)."""
    header = np.zeros(1, HEADER)
    h = header[0]
    h["magic"], h["version"], h["n_blocks"] = MAGIC, VERSION, n_blocks
    h["flags"] = flags
    h["body_words"], h["checksum"] = body.shape[0], checksum_words(body)
    return header.view(np.uint32)


def check_payload(payload: object) -> None:
    """Raises CodecError unless ``payload`` is a 1-D uint8 tensor.

    Args:
        payload: What the caller passed as a payload.

    Raises:
        CodecError: It is not a 1-D torch.uint8 tensor.
    """
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise CodecError(
            f"payload must be a 1-D torch.uint8 tensor, got {type(payload).__name__}"
            + (
                f" {payload.dtype} {tuple(payload.shape)}"
                if isinstance(payload, torch.Tensor)
                else ""
            )
        )


# check_header's verdicts (the order it checks in); parse_header names each.
HEADER_OK = 0
HEADER_TRUNCATED = 1
HEADER_BAD_MAGIC = 2
HEADER_BAD_VERSION = 3
HEADER_BAD_LENGTH = 4
HEADER_BAD_CHECKSUM = 5
HEADER_BAD_DESCRIPTORS = 6
HEADER_BAD_SEGMENTS = 7
HEADER_BAD_BLOCK = 8
HEADER_TOO_LARGE = 9
_DTYPE_CODE_RANGE = (min(CODE_DTYPES), max(CODE_DTYPES))
# The message of each header verdict (check_header's), formatted with the header's fields and
# the payload's length ``n``, the limit, the failing block and its fields, the elements' total.
_HEADER_WHAT = {
    HEADER_TRUNCATED: "truncated payload: {n} bytes, shorter than the 32-byte header",
    HEADER_BAD_MAGIC: "not a torchrec-lossy payload: magic 0x{magic:08x}, "
    f"expected 0x{MAGIC:08x}",
    HEADER_BAD_VERSION: "payload format version {version} is not supported "
    f"(this build reads version {VERSION})",
    HEADER_BAD_LENGTH: "truncated or padded payload: {n} bytes, the header says {length}",
    HEADER_BAD_CHECKSUM: "corrupt payload: checksum mismatch",
    HEADER_BAD_DESCRIPTORS: "corrupt payload: {n_blocks} block descriptors do not fit",
    HEADER_BAD_SEGMENTS: "corrupt payload: segment lengths do not add up to the body",
    HEADER_BAD_BLOCK: "corrupt payload: block {block}: dtype {dtype} / mode {mode}",
    HEADER_TOO_LARGE: "payload decodes to {total} elements, more than max_elements="
    "{max_elements}: pass a larger max_elements if it is trusted",
}
# The message of each segment verdict (``format.SEGMENT_*``; ``format.segment_checks`` and the
# host decoder's data checks make them), its details in order.
_SEGMENT_WHAT = {
    SEGMENT_TRUNCATED: "{0} needs {1} words at word {2} of a {3}-word segment",
    SEGMENT_TRAILING: "{0} trailing words",
    SEGMENT_BAD_REFS: "{0} distinct vectors with {1}-bit ids for {2} rows",
    SEGMENT_BAD_PACKING: "unknown reference packing {0}",
    SEGMENT_REFS_RANGE: "vector references out of range",
    SEGMENT_BAD_VALUE_GRID: "per-value grid step {0} / largest code {1} out of range",
    SEGMENT_BAD_GRID: "quantization step {0} / center {1} out of range",
    SEGMENT_BAD_CODEBOOK: "codebook range {0}+{1} / escape length {2} out of range",
    SEGMENT_BAD_VECTORS: "{0} vectors for {1} rows",
    SEGMENT_BAD_ESCAPES: "{0} escapes for {1} elements",
    SEGMENT_BAD_CHUNKS: "{0} chunks of {1} symbols for {2} symbols",
    SEGMENT_BAD_STREAM: "{0}: {1}",
}


@numba.njit(cache=True, nogil=True)
def check_header(
    words: np.ndarray, base: int, n_bytes: int, max_elements: int, verify_checksum: bool
) -> tuple[int, int]:
    """Every check of a payload before its segments, the one both host decoders make.

    Args:
        words: uint32 words holding the payload at word ``base`` (its whole words).
        base: First word of the payload.
        n_bytes: Bytes of the payload.
        max_elements: Refuse payloads that decode to more elements than this in total.
        verify_checksum: False for a skeleton (the device checks the real payload's checksum).

    Returns:
        (``HEADER_OK``, block count), or (the first failed check's ``HEADER_*``, the failing
        block for ``HEADER_BAD_BLOCK``, else 0).
    """
    if n_bytes < HEADER_WORDS * 4:
        return HEADER_TRUNCATED, 0
    header = words[base : base + HEADER_WORDS].view(HEADER)[0]
    if header["magic"] != MAGIC:
        return HEADER_BAD_MAGIC, 0
    if header["version"] != VERSION:
        return HEADER_BAD_VERSION, 0
    if n_bytes % 4 or header["body_words"] != np.uint64(n_bytes // 4 - HEADER_WORDS):
        return HEADER_BAD_LENGTH, 0
    body = words[base + HEADER_WORDS : base + n_bytes // 4]
    if verify_checksum and checksum_words(body) != header["checksum"]:
        return HEADER_BAD_CHECKSUM, 0
    n_blocks = np.int64(header["n_blocks"])
    if n_blocks * DESCRIPTOR_WORDS > body.shape[0]:
        return HEADER_BAD_DESCRIPTORS, 0
    descs = body[: n_blocks * DESCRIPTOR_WORDS].view(DESCRIPTOR)
    seg_total = 0
    for b in range(n_blocks):
        seg_total += np.int64(descs[b]["seg_words"])
    if seg_total != body.shape[0] - n_blocks * DESCRIPTOR_WORDS:
        return HEADER_BAD_SEGMENTS, 0
    for b in range(n_blocks):
        code, mode = descs[b]["dtype"], descs[b]["mode"]
        if not _DTYPE_CODE_RANGE[0] <= code <= _DTYPE_CODE_RANGE[1] or not mode_valid(mode):
            return HEADER_BAD_BLOCK, b
    total = 0
    for b in range(n_blocks):
        rows, dim = np.int64(descs[b]["rows"]), max(np.int64(descs[b]["dim"]), 1)
        if rows > (max_elements - total) // dim:  # no int64 wrap-around
            return HEADER_TOO_LARGE, 0
        total += rows * dim
    return HEADER_OK, n_blocks


def header_error(status: int, detail: int, buf: np.ndarray, max_elements: int) -> CodecError:
    """The error naming :func:`check_header`'s verdict on a payload.

    Args:
        status: The verdict (a ``HEADER_*`` other than ``HEADER_OK``).
        detail: Its detail (the failing block for ``HEADER_BAD_BLOCK``).
        buf: The payload's bytes.
        max_elements: The limit it was checked against.

    Returns:
        The CodecError (the caller raises it).
    """
    what = {"n": buf.shape[0], "max_elements": max_elements, "block": detail}
    if status != HEADER_TRUNCATED:
        header = buf[: HEADER.itemsize].view(HEADER)[0]
        what.update({name: int(header[name]) for name in HEADER.names})
        what["length"] = HEADER.itemsize + 4 * what["body_words"]
    if status in (HEADER_BAD_BLOCK, HEADER_TOO_LARGE):  # the header's checks passed
        descs = buf[HEADER.itemsize : HEADER.itemsize + DESCRIPTOR.itemsize * what["n_blocks"]]
        descs = descs.view(DESCRIPTOR)
        what["dtype"], what["mode"] = int(descs[detail]["dtype"]), int(descs[detail]["mode"])
        what["total"] = sum(int(d["rows"]) * max(int(d["dim"]), 1) for d in descs)
    return CodecError(_HEADER_WHAT[status].format(**what))


def segment_error(status: int, details: Sequence[int], block: int) -> CodecError:
    """The error naming a segment's verdict (the first of its checks it fails, ``SEGMENT_*``).

    Args:
        status: The verdict (not ``SEGMENT_OK``).
        details: Its four integer details, in the order its message names them (unused: 0).
        block: The block's index in its payload.

    Returns:
        The CodecError (the caller raises it).
    """
    d: list[object] = list(details)
    if status == SEGMENT_TRUNCATED:
        d[0] = SECTIONS[d[0]]
    elif status in (SEGMENT_BAD_VALUE_GRID, SEGMENT_BAD_GRID):
        d[0] = float(np.array(d[0], np.uint32).view(np.float32))
    elif status == SEGMENT_BAD_STREAM:
        coded = "packed codes" if d[0] in PACKED_DECODE_ERRORS else "Huffman stream"
        d = [coded, DECODE_ERRORS[d[0]], *d[1:]]
    return CodecError(f"corrupt payload: block {block}: " + _SEGMENT_WHAT[status].format(*d))


def status_error(code: int, block: int) -> CodecError:
    """The CPU path's error for a block's device decode status (a kernel's per-block code).

    Args:
        code: Nonzero status (``REFS_OUT_OF_RANGE`` or a ``DECODE_*`` code).
        block: The block's index in its payload.

    Returns:
        The CodecError (the caller raises it).
    """
    if code == REFS_OUT_OF_RANGE:
        return segment_error(SEGMENT_REFS_RANGE, (0, 0, 0, 0), block)
    return segment_error(SEGMENT_BAD_STREAM, (code, 0, 0, 0), block)


def parse_header(
    buf: np.ndarray, max_elements: int, verify_checksum: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validates a payload's header and descriptors (everything before the segments).

    Shared by the CPU decoder and ``device_decompress``, so both reject alike.

    Args:
        buf: The payload's bytes (1-D uint8, on the host).
        max_elements: Refuse payloads that decode to more elements than this in total.
        verify_checksum: False for a skeleton (see :func:`skeleton_index`): the device checks
            the real payload's checksum instead.

    Returns:
        (body as uint32 words, the descriptors as ``DESCRIPTOR`` records, word offset of each
        segment in the body plus the body's end).

    Raises:
        CodecError: Anything wrong before the segments.
    """
    n = buf.shape[0]
    words = buf[: n - n % 4].view(np.uint32)
    status, detail = check_header(words, 0, n, max_elements, verify_checksum)
    if status != HEADER_OK:
        raise header_error(status, detail, buf, max_elements)
    body = words[HEADER_WORDS:]
    descs = body[: detail * DESCRIPTOR_WORDS].view(DESCRIPTOR)
    offsets = np.concatenate([[0], np.cumsum(descs["seg_words"], dtype=np.int64)])
    return body, descs, offsets + detail * DESCRIPTOR_WORDS
