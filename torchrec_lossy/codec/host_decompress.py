"""The compiled CPU decoder, batched: one compiled call reads every segment of one or several
payloads.

``_decode_payloads_kernel`` decodes every block of every payload (references, Huffman streams
straight to values, escapes) into one output buffer. A block it rejects gets the first check it
fails in wire order (``_segment_verdict``), which :meth:`BatchDecoded.error` turns into the
exact ``CodecError`` (docs/codec.md, "Backends").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np
import torch

from torchrec_lossy.codec import huffman, packed, quantize, vector_lz
from torchrec_lossy.codec.container import (
    DESCRIPTOR_WORDS,
    HEADER_OK,
    HEADER_WORDS,
    check_header,
    descriptors,
    header_error,
    segment_error,
)
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    CODE_DTYPES,
    FLOAT32_CODE,
    MODE_LZ,
    MODE_PACKED,
    MODE_RAW,
    MODE_VALUE,
    SEGMENT_BAD_STREAM,
    SEGMENT_HEADER_WORDS,
    SEGMENT_OK,
    SEGMENT_REFS_RANGE,
    CodecError,
    dtype_itemsize,
    read_segment_header,
    segment_checks,
    segment_layout,
)

# What segment_layout takes for a segment without a header: raw, or too short to hold one.
_NO_HEADER = (np.float32(0.0),) + (np.int64(0),) * 10


class _Segment(NamedTuple):
    """One block's segment, as its descriptor places it."""

    start: int  # first word in the payloads' words
    end: int  # the word after it
    rows: int
    dim: int
    dtype_code: int  # format.DTYPE_CODES: 1 (4 bytes per element) or a 2-byte dtype's
    mode: int  # with the per-value bit
    out_at: int  # first element in its output (out32 or out16)


class _Outputs(NamedTuple):
    """The decoded blocks: 4-byte ones' bits (int32), 2-byte ones' (uint16), each back to
    back."""

    out32: np.ndarray
    out16: np.ndarray


class _Scratch(NamedTuple):
    """Work arrays: ``ids`` (int32), ``symbols`` (uint16, at least the alphabet's size),
    ``values`` (float32) and ``halves`` (uint16) of the largest block; ``compact`` (uint8),
    ``vtable`` (float32) and ``vtable16`` (uint16) of the alphabet's size."""

    ids: np.ndarray
    symbols: np.ndarray
    values: np.ndarray
    halves: np.ndarray
    compact: np.ndarray
    vtable: np.ndarray
    vtable16: np.ndarray


@numba.njit(cache=True, nogil=True)
def _huffman_values(
    stream: np.ndarray, chunk_ends: np.ndarray, chunk: int, lengths: np.ndarray,
    vtable: np.ndarray, out: np.ndarray,
) -> bool:  # fmt: skip
    """Decodes a block's symbols straight to their values: ``out[i] = vtable[code index]``.

    For a block with no escapes only: it succeeds exactly where ``huffman.decode_range_kernel``
    with no escape positions does (an escape symbol is an error there). Chunks are independent
    streams: two are decoded side by side, so the table look-ups of one hide the latency of
    the other's.

    Args:
        stream: uint32 bitstream.
        chunk_ends: uint32 end word of each chunk.
        chunk: Symbols per chunk (>= 1).
        lengths: uint8 code lengths of the compact code (value symbols, then the escape).
        vtable: Value of each symbol of the code (int32 bits or uint16 halves; the escape's,
            last, is never kept).
        out: The block's values (as ``vtable``), one per symbol.

    Returns:
        Whether the stream decoded.
    """
    table = huffman.decode_table_kernel(lengths)
    if table.shape[0] == 0:
        return False
    escape = lengths.shape[0] - 1
    escapes = 0  # counted, not branched on: any is an error (the block has no escapes)
    n_chunks = chunk_ends.shape[0]
    peek = huffman.stream_layout(table, chunk_ends, stream.shape[0])
    if peek < 0:
        return False
    sp = np.uint64(64 - peek)
    n = out.shape[0]
    for c in range(0, n_chunks, 2):
        a0 = c * chunk
        a_n = min(n, a0 + chunk) - a0
        wa = np.int64(chunk_ends[c - 1]) if c else np.int64(0)
        ea = np.int64(chunk_ends[c])
        ba = np.uint64(0)
        na = 0
        b0 = a0 + a_n
        b_n = min(n, b0 + chunk) - b0 if c + 1 < n_chunks else 0
        wb = ea
        eb = np.int64(chunk_ends[c + 1]) if c + 1 < n_chunks else ea
        bb = np.uint64(0)
        nb = 0
        for i in range(b_n):  # both chunks (the second is never the longer)
            sa, wa, ba, na = huffman.next_symbol(stream, wa, ea, ba, na, table, sp)
            sb, wb, bb, nb = huffman.next_symbol(stream, wb, eb, bb, nb, table, sp)
            if sa < 0 or sb < 0:
                return False
            escapes += (sa == escape) + (sb == escape)
            out[a0 + i] = vtable[sa]
            out[b0 + i] = vtable[sb]
        for i in range(b_n, a_n):  # the rest of the first
            sa, wa, ba, na = huffman.next_symbol(stream, wa, ea, ba, na, table, sp)
            if sa < 0:
                return False
            escapes += sa == escape
            out[a0 + i] = vtable[sa]
    return escapes == 0


@numba.njit(cache=True, nogil=True, inline="always")
def _expand_rows(
    src32: np.ndarray, src16: np.ndarray, ids: np.ndarray, seg: _Segment, outs: _Outputs
) -> None:
    """Row ``r`` of the block is distinct vector ``ids[r]`` of ``src32`` (int32, a 4-byte
    block) or ``src16`` (uint16)."""
    # Element loops over unsigned flat indices: cheaper than slice copies of a few words, and
    # no per-row views (each one an atomic reference count in this loop) or negative-index
    # wraps (which stop the copy vectorising).
    dim, out32, out16 = np.uint64(seg.dim), outs.out32, outs.out16
    for r in range(seg.rows):
        u = np.uint64(ids[r]) * dim
        at = np.uint64(seg.out_at) + np.uint64(r) * dim
        if seg.dtype_code == FLOAT32_CODE:
            for j in range(seg.dim):
                out32[at + np.uint64(j)] = src32[u + np.uint64(j)]
        else:
            for j in range(seg.dim):
                out16[at + np.uint64(j)] = src16[u + np.uint64(j)]


@numba.njit(cache=True, nogil=True, inline="always")
def _segment_fields(words: np.ndarray, seg: _Segment) -> tuple[tuple, tuple]:
    """(descriptor fields, segment header fields) of a block, as ``format.segment_layout``
    takes them (a header too short to read is zeros: ``segment_checks`` names it)."""
    n_seg = seg.end - seg.start
    desc = (seg.mode, seg.rows, seg.dim, dtype_itemsize(seg.dtype_code), n_seg)
    if seg.mode == MODE_RAW or n_seg < SEGMENT_HEADER_WORDS:
        return desc, _NO_HEADER
    return desc, read_segment_header(words, seg.start)


@numba.njit(cache=True, nogil=True, inline="always")
def _code(
    words: np.ndarray, seg: _Segment, header: tuple, cb_words: int, compact: np.ndarray
) -> np.ndarray:
    """A quantized block's code in its compact form (value symbols ``lo`` .., then the
    escape), unpacked into ``compact`` as the encoder built it: the decode table then costs
    the code's size, not the alphabet's."""
    at = seg.start + SEGMENT_HEADER_WORDS
    count, esc_len = header[7], header[8]
    huffman.unpack_codebook_into(words[at : at + cb_words].view(np.uint8), count, compact)
    compact[count] = esc_len
    return compact[: count + 1]


@numba.njit(cache=True, nogil=True, inline="always")
def _packed_status(
    words: np.ndarray, seg: _Segment, header: tuple, at: tuple, esc_at: int, sym: np.ndarray
) -> int:
    """Checks and decodes a packed block's symbols into ``sym`` (``packed.decode_stream``);
    ``at``: its width bytes' and codes' offsets in the segment, ``esc_at`` its escape
    positions' word in ``words``. -> 0, or the ``DECODE_*`` status."""
    head = seg.start + SEGMENT_HEADER_WORDS
    stored = header[6] | (header[7] << 16)  # sym_lo / sym_count hold the checksum
    esc_pos = words[esc_at : esc_at + header[3]]
    return packed.decode_stream(
        words[head : seg.end], stored, esc_pos, at[0] - SEGMENT_HEADER_WORDS,
        at[1] - SEGMENT_HEADER_WORDS, sym,
    )  # fmt: skip


@numba.njit(cache=True, nogil=True)
def _decode_segment(
    words: np.ndarray, halves: np.ndarray, seg: _Segment, outs: _Outputs, scratch: _Scratch
) -> bool:
    """Decodes one block's segment into its place in ``outs``.

    ``words`` / ``halves`` are views of one buffer (uint32, uint16). Every check of the
    segment is made (``format.segment_layout``'s, the references', the stream's): a block that
    fails one is rejected, and :func:`_segment_verdict` names the check.

    Returns:
        True where it decoded, False where it is rejected.
    """
    s, end, n_rows, dim, dtype_code, m, o = seg
    isz = dtype_itemsize(dtype_code)
    out32, out16 = outs
    ids, symbols, values, halves_out, compact, vtable, vtable16 = scratch
    values_i = values.view(np.int32)
    values_u = values.view(np.uint32)
    desc, header = _segment_fields(words, seg)
    ok, nu, ref_at, ref_words, cb_words, esc_at, ct_at, bs_at = segment_layout(desc, header)
    if not ok:
        return False
    value = (m & MODE_VALUE) == MODE_VALUE  # the per-value grid; the mode without it below
    is_packed = (m & MODE_PACKED) != 0  # fixed-width codes instead of a Huffman stream
    m = m & ~(MODE_VALUE | MODE_PACKED)
    if m == MODE_RAW:
        numel = n_rows * dim
        if isz == 4:
            dst = out32[o : o + numel]
            for k in range(numel):
                dst[k] = np.int32(words[s + k])
        else:
            h = 2 * s
            for k in range(numel):
                out16[o + k] = halves[h + k]
        return True
    step, center, _, n_esc, chunk, _, lo, count, _, ref_mode, width = header
    lz = (m & 1) == 1  # the vector-LZ bit
    ref_at += s
    if lz and vector_lz.unpack_refs_kernel(words[ref_at : ref_at + ref_words], n_rows, nu,
                                           ref_mode, width, ids) != 0:  # fmt: skip
        return False
    if m == MODE_LZ:
        pos = ref_at + ref_words
        _expand_rows(words[pos:].view(np.int32), halves[2 * pos :], ids, seg, outs)
        return True
    n_sym = nu * dim
    esc_at += s
    esc_bits_at = esc_at + n_esc
    ends_at = s + ct_at
    bits_at = s + bs_at
    stream = words[bits_at:end]
    chunk_ends = words[ends_at:bits_at]
    if n_esc == 0 and not is_packed:  # the common case: symbols decode straight to values
        code = _code(words, seg, header, cb_words, compact)
        # The values of the code's symbols, dequantized as every element would be (same bits).
        for k in range(count):
            symbols[k] = lo + k
        quantize.dequantize_kernel(symbols[:count], step, center, vtable[:count], value)
        if isz == 2:
            vt_bits = vtable.view(np.uint32)
            for k in range(count):
                vtable16[k] = np.uint16(quantize.half_bits(np.int64(vt_bits[k]), dtype_code))
            h = halves_out[:n_sym] if lz else out16[o : o + n_sym]
            if not _huffman_values(stream, chunk_ends, chunk, code, vtable16[: count + 1], h):
                return False
        else:
            vi = values_i[:n_sym] if lz else out32[o : o + n_sym]
            vt_i = vtable.view(np.int32)[: count + 1]
            if not _huffman_values(stream, chunk_ends, chunk, code, vt_i, vi):
                return False
    else:
        sym = symbols[:n_sym]
        if is_packed:
            if _packed_status(words, seg, header, (ct_at, bs_at), esc_at, sym) != 0:
                return False
        elif huffman.decode_range_kernel(stream, chunk_ends, chunk,
                                         _code(words, seg, header, cb_words, compact), lo,
                                         words[esc_at : esc_at + n_esc], sym) != 0:  # fmt: skip
            return False
        if isz == 2:  # the round-to-nearest-even cast the encoder checked
            quantize.dequantize_kernel(sym, step, center, values[:n_sym], value)
            h = halves_out[:n_sym]
            for k in range(n_sym):
                h[k] = np.uint16(quantize.half_bits(np.int64(values_u[k]), dtype_code))
            for k in range(n_esc):
                h[np.int64(words[esc_at + k])] = halves[2 * esc_bits_at + k]
            if not lz:
                out16[o : o + n_sym] = h
        else:
            vf = values[:n_sym] if lz else out32.view(np.float32)[o : o + n_sym]
            vi = values_i[:n_sym] if lz else out32[o : o + n_sym]
            quantize.dequantize_kernel(sym, step, center, vf, value)
            for k in range(n_esc):
                vi[np.int64(words[esc_at + k])] = np.int32(words[esc_bits_at + k])
    if lz:  # the distinct vectors, decoded into scratch, to the rows
        _expand_rows(values_i, halves_out, ids, seg, outs)
    return True


@numba.njit(cache=True, nogil=True)
def _data_check(words: np.ndarray, seg: _Segment, status: int, header: tuple, sections: tuple,
                scratch: _Scratch) -> int:  # fmt: skip
    """The check ``format.segment_checks`` leaves to the data, its fields' checks all passed:
    the references' unpacking (``SEGMENT_REFS_RANGE``, a vector-LZ block), the Huffman
    stream's decode (``SEGMENT_BAD_STREAM``, a quantized block) -> 0, or nonzero (the
    decoder's ``DECODE_*`` status for the stream) where it fails."""
    s, mode = seg.start, seg.mode
    nu, ref_at, ref_words, cb_words, esc_at, ct_at, bs_at = sections
    if status == SEGMENT_REFS_RANGE and (mode & 1) == 1:
        refs = words[s + ref_at : s + ref_at + ref_words]
        return vector_lz.unpack_refs_kernel(refs, seg.rows, nu, header[9], header[10], scratch.ids)
    if status == SEGMENT_BAD_STREAM and (mode & MODE_PACKED) != 0:
        sym = scratch.symbols[: nu * seg.dim]
        return _packed_status(words, seg, header, (ct_at, bs_at), s + esc_at, sym)
    if status == SEGMENT_BAD_STREAM and (mode & 2) == 2:
        code = _code(words, seg, header, cb_words, scratch.compact)
        n_esc = header[3]
        return huffman.decode_range_kernel(
            words[s + bs_at : seg.end], words[s + ct_at : s + bs_at], header[4], code,
            header[6], words[s + esc_at : s + esc_at + n_esc], scratch.symbols[: nu * seg.dim],
        )  # fmt: skip
    return 0


@numba.njit(cache=True, nogil=True)
def _segment_verdict(words: np.ndarray, seg: _Segment, scratch: _Scratch) -> tuple:
    """The first check of a block's segment that fails, in wire order: the exact error of a
    block :func:`_decode_segment` rejects, which it runs for only (``SEGMENT_OK`` would be a
    bug). The checks are ``format.segment_checks``', the ones on the data where they lie.
    -> (its ``SEGMENT_*`` status, its four details)."""
    desc, header = _segment_fields(words, seg)
    checks, sections = segment_checks(desc, header)
    for k in range(len(checks)):
        passes, status, a, b, c, d = checks[k]
        if status in (SEGMENT_REFS_RANGE, SEGMENT_BAD_STREAM):
            a = _data_check(words, seg, status, header, sections, scratch)
            passes = a == 0
            a = a if status == SEGMENT_BAD_STREAM else 0
        if not passes:
            return status, (np.int64(a), np.int64(b), np.int64(c), np.int64(d))
    return SEGMENT_OK, (np.int64(0), np.int64(0), np.int64(0), np.int64(0))


@numba.njit(cache=True, nogil=True)
def _decode_payloads_kernel(
    words: np.ndarray, groups: np.ndarray, max_elements: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parses every payload and decodes every block of the ones whose header is sound.

    ``groups`` is int64 [2 * G]: the first word of each payload in ``words``, then the bytes
    of each (one array: reshaped here, where it costs nothing, rather than by the caller).

    Returns:
        (the 4-byte blocks' bits as float32 and the 2-byte ones' as uint16, each back to
        back; int64 [5, n] rows, dim, dtype code, offset in its output and verdict
        (``container.SEGMENT_*``) of every block; int64 [G + 1] first block of each payload;
        int64 [G] blocks of each payload, -1 where its header is rejected; int64 [2, G]
        ``check_header``'s verdict and detail of each payload; int64 [4, n] each block's
        verdict's details).
    """
    n_groups = groups.shape[0] // 2
    group_base, group_bytes = groups[:n_groups], groups[n_groups:]
    n_of = np.empty(n_groups, np.int64)
    heads = np.empty((2, n_groups), np.int64)
    first = np.zeros(n_groups + 1, np.int64)
    for g in range(n_groups):
        status, n = check_header(words, group_base[g], group_bytes[g], max_elements, True)
        heads[0, g], heads[1, g] = status, n
        n_of[g] = n if status == HEADER_OK else -1
        first[g + 1] = first[g] + (n if status == HEADER_OK else 0)
    nb = first[n_groups]
    table = np.empty((5, nb), np.int64)
    details = np.zeros((4, nb), np.int64)
    seg = np.empty((3, nb), np.int64)  # first word, end word and mode of each segment
    n32 = 0
    n16 = 0
    big = ALPHABET_SIZE
    max_rows = 0
    for g in range(n_groups):
        if n_of[g] <= 0:
            continue
        descs = descriptors(words[group_base[g] :])
        at = group_base[g] + HEADER_WORDS + descs.shape[0] * DESCRIPTOR_WORDS
        for k in range(descs.shape[0]):
            b, d = first[g] + k, descs[k]
            rows, dim, code = np.int64(d["rows"]), np.int64(d["dim"]), np.int64(d["dtype"])
            table[0, b], table[1, b], table[2, b] = rows, dim, code
            table[3, b] = n32 if code == FLOAT32_CODE else n16
            if code == FLOAT32_CODE:
                n32 += rows * dim
            else:
                n16 += rows * dim
            seg[0, b], seg[1, b], seg[2, b] = at, at + np.int64(d["seg_words"]), d["mode"]
            at = seg[1, b]
            big = max(big, rows * dim)
            max_rows = max(max_rows, rows)
    outs = _Outputs(np.empty(n32, np.int32), np.empty(n16, np.uint16))
    scratch = _Scratch(
        np.empty(max_rows, np.int32), np.empty(big, np.uint16), np.empty(big, np.float32),
        np.empty(big, np.uint16), np.zeros(ALPHABET_SIZE, np.uint8),
        np.empty(ALPHABET_SIZE, np.float32), np.empty(ALPHABET_SIZE, np.uint16),
    )  # fmt: skip
    halves = words.view(np.uint16)
    for b in range(nb):
        seg_b = _Segment(seg[0, b], seg[1, b], table[0, b], table[1, b], table[2, b], seg[2, b],
                         table[3, b])  # fmt: skip
        table[4, b] = SEGMENT_OK
        if not _decode_segment(words, halves, seg_b, outs, scratch):
            verdict = _segment_verdict(words, seg_b, scratch)
            if verdict[0] == SEGMENT_OK:
                raise AssertionError("a block was rejected by no check")
            table[4, b] = verdict[0]
            details[:, b] = verdict[1]
    return outs.out32.view(np.float32), outs.out16, table, first, n_of, heads, details


@dataclass(frozen=True)
class BatchDecoded:
    """Every block of several payloads, decoded by one compiled call (:func:`decompress_payloads`).

    Attributes:
        out32: Every 4-byte block's bits, back to back, as float32 (the dtype of nearly every
            block: their views need no cast).
        out16: int16 bits of every 2-byte block, back to back.
        layout: int64 [5, n]: rows, dim, dtype code (``format.DTYPE_CODES``), offset in its
            output and status of every block of every accepted payload, in order.
        first: int64 [G + 1]: first block of each payload in ``layout``, then the end.
        n_blocks: int64 [G]: blocks of each payload, -1 where its header or descriptors were
            not sound.
        heads: int64 [2, G]: ``container.check_header``'s verdict on each payload and its
            detail.
        details: int64 [4, n]: the details of each block's verdict (``layout``'s last row).
    """

    out32: torch.Tensor
    out16: torch.Tensor
    layout: np.ndarray
    first: np.ndarray
    n_blocks: np.ndarray
    heads: np.ndarray
    details: np.ndarray

    @functools.cached_property
    def _lists(self) -> tuple[list[list[int]], list[int], list[int]]:
        """``layout``, ``first`` and ``n_blocks`` as Python lists, read once for every
        per-group call (indexing numpy arrays element by element costs more)."""
        return self.layout.tolist(), self.first.tolist(), self.n_blocks.tolist()

    def complete(self, group: int) -> bool:
        """Whether every block of payload ``group`` decoded (else :meth:`error` names what is
        wrong with it).

        Args:
            group: The payload's index.

        Returns:
            True if :meth:`blocks` has them all.
        """
        layout, first, n_blocks = self._lists
        return n_blocks[group] >= 0 and not any(layout[4][first[group] : first[group + 1]])

    def error(self, group: int, buf: np.ndarray, max_elements: int) -> CodecError:
        """The error payload ``group`` (not :meth:`complete`) raises: its header's, else its
        first rejected block's.

        Args:
            group: The payload's index.
            buf: The payload's bytes.
            max_elements: The limit it was decoded under.

        Returns:
            The CodecError (the caller raises it).
        """
        if self.n_blocks[group] < 0:
            return header_error(*self.heads[:, group].tolist(), buf, max_elements)
        b0 = int(self.first[group])
        bad = b0 + int(np.flatnonzero(self.layout[4, b0 : self.first[group + 1]])[0])
        return segment_error(int(self.layout[4, bad]), self.details[:, bad].tolist(), bad - b0)

    def block(self, index: int) -> torch.Tensor:
        """One decoded block (by its index in ``layout``).

        Args:
            index: The block's index.

        Returns:
            A ``[rows, dim]`` view of the outputs in the block's dtype.
        """
        rows, dim, code, at, _ = self.layout[:, index].tolist()
        base = self.out32 if code == FLOAT32_CODE else self.out16
        return base.narrow(0, at, rows * dim).view(CODE_DTYPES[code]).view(rows, dim)

    def blocks(self, group: int) -> list[torch.Tensor]:
        """The blocks of a :meth:`complete` payload, in order.

        Args:
            group: The payload's index.

        Returns:
            ``[rows, dim]`` views of the outputs in each block's dtype.
        """
        layout, first, _ = self._lists
        b0, b1 = first[group], first[group + 1]
        rows, dims, codes = layout[0][b0:b1], layout[1][b0:b1], layout[2][b0:b1]
        if (
            b1 > b0
            and dims[0] > 0
            and dims.count(dims[0]) == len(dims)
            and (codes.count(codes[0]) == len(codes))
        ):  # one dtype and width (the usual payload): one split of one view
            base = self.out32 if codes[0] == FLOAT32_CODE else self.out16
            at, n = layout[3][b0], sum(rows) * dims[0]
            if at or n != base.shape[0]:  # not the whole output (e.g. several payloads)
                base = base.narrow(0, at, n)
            dtype = CODE_DTYPES[codes[0]]
            if base.dtype != dtype:  # float32 blocks are views of out32 as it is
                base = base.view(dtype)
            # The op itself (Tensor.split is a Python wrapper around it).
            return list(base.view(-1, dims[0]).split_with_sizes(rows))
        return [self.block(b) for b in range(b0, b1)]


def decompress_payloads(words: np.ndarray, groups: np.ndarray, max_elements: int) -> BatchDecoded:
    """Parses and decodes every payload of one buffer in one compiled call.

    Every check of ``container.parse_header`` and of the segments is made; a payload that
    fails one is not :meth:`BatchDecoded.complete`, and :meth:`BatchDecoded.error` names the
    first check it failed.

    Args:
        words: The payloads' words (uint32; one buffer).
        groups: int64 [2 * G]: the first word of each payload in ``words``, then the bytes of
            each payload.
        max_elements: Refuse a payload that decodes to more elements than this.

    Returns:
        The decoded blocks and their layout.
    """
    out32, out16, *tables = _decode_payloads_kernel(words, groups, max_elements)
    return BatchDecoded(torch.from_numpy(out32), torch.from_numpy(out16.view(np.int16)), *tables)


__all__ = ["BatchDecoded", "decompress_payloads"]
