"""The packed format's coded values, compiled for the host path (docs/format.md, "Packed
segments").

A packed block's sent values (its distinct rows' for quant+lz, every row's for quant) are cut
into groups of ``format.PACKED_GROUP`` values; a group's codes are the zigzag of each symbol's
offset from the center (``format.zigzag``; 0 for an escaped element), written LSB-first in
``w`` bits each, ``w`` the bit length of its largest code. A group of width ``w`` then takes
exactly ``w`` words, so group ``g`` starts at the prefix sum of the widths before it: every
group encodes and decodes on its own (one GPU program each). The segment's checksum
(:func:`segment_checksum`) covers every word after its header.

These are the stream's numba kernels, which ``host_compress`` / ``host_decompress`` call per
block; ``kernels/packed_ref.py`` is their torch twin over many blocks (the test oracle).
"""

from __future__ import annotations

import numba
import numpy as np

from torchrec_lossy.codec.format import (
    DECODE_BAD_CHECKSUM,
    DECODE_BAD_PACKED_CODE,
    DECODE_BAD_PACKED_ESCAPES,
    DECODE_BAD_WIDTH,
    ESCAPE_SYMBOL,
    PACKED_GROUP,
    PACKED_MAX_WIDTH,
    SYMBOL_OFFSET,
    unzigzag,
    words_for_bytes,
    zigzag,
)

_MAX_CODE = 2 * SYMBOL_OFFSET  # the largest code of a value symbol


@numba.njit(cache=True, nogil=True, inline="always")
def _width(bits_or: int) -> int:
    """Bit length of a group's OR of codes (< 2**12): its width."""
    w = 0
    while (bits_or >> w) > 0:
        w += 1
    return w


@numba.njit(cache=True, nogil=True, inline="always")
def _code(s: int) -> int:
    """A symbol's packed code: its zigzag, 0 for an escape (a select: the loops vectorise)."""
    return 0 if s == ESCAPE_SYMBOL else zigzag(s)


@numba.njit(cache=True, nogil=True)
def plan_stream(
    blk_sym: np.ndarray, sent: np.ndarray, dim: int, widths: np.ndarray
) -> tuple[int, int]:
    """The widths of a block's groups, its escapes and its code words.

    Args:
        blk_sym: uint16 symbols of the block, row-major.
        sent: int32 rows sent, in order (the distinct rows' first occurrences, or every row).
        dim: Columns.
        widths: uint8, at least ``ceil(len(sent) * dim / PACKED_GROUP)``: each group's width,
            written.

    Returns:
        (escaped elements among the sent values, words of the packed codes: the widths' sum).
    """
    g = 0
    k = 0
    acc = 0
    n_esc = 0
    words = 0
    for i in range(sent.shape[0]):
        r0 = np.int64(sent[i]) * dim
        j = 0
        while j < dim:  # the row's run of values in the current group
            take = min(dim - j, PACKED_GROUP - k)
            at = np.uint64(r0 + j)  # unsigned: no negative-index wrap to stop vectorising
            for t in range(take):  # reductions only: it vectorises
                s = np.int64(blk_sym[at + np.uint64(t)])
                n_esc += np.int64(s == ESCAPE_SYMBOL)
                acc |= _code(s)
            j += take
            k += take
            if k == PACKED_GROUP:
                w = _width(acc)
                widths[g] = w
                words += w
                g += 1
                k = 0
                acc = 0
    if k:
        w = _width(acc)
        widths[g] = w
        words += w
    return n_esc, words


@numba.njit(cache=True, nogil=True)
def stream_words(
    blk_sym: np.ndarray, sent: np.ndarray, dim: int, widths: np.ndarray
) -> tuple[int, int]:
    """A block's escapes and the words :func:`put_stream` writes for it (width bytes and
    codes): :func:`plan_stream` with the width bytes counted.

    Args:
        blk_sym: uint16 symbols of the block, row-major.
        sent: int32 rows sent, in order.
        dim: Columns.
        widths: uint8 scratch (as :func:`plan_stream`'s).

    Returns:
        (escaped elements among the sent values, words of the width bytes and codes).
    """
    n_esc, code_words = plan_stream(blk_sym, sent, dim, widths)
    n_groups = (sent.shape[0] * dim + PACKED_GROUP - 1) // PACKED_GROUP
    return n_esc, words_for_bytes(n_groups) + code_words


@numba.njit(cache=True, nogil=True)
def put_stream(
    out: np.ndarray, pos: int, blk_sym: np.ndarray, sent: np.ndarray, dim: int,
    widths: np.ndarray,
) -> int:  # fmt: skip
    """Writes a block's width bytes and packed codes at word ``pos`` of zeroed ``out``.

    Args:
        out: uint32 payload words (zero where not yet written).
        pos: First word of the width bytes.
        blk_sym: uint16 symbols of the block, row-major.
        sent: int32 rows sent, in order.
        dim: Columns.
        widths: uint8 [ceil(len(sent) * dim / PACKED_GROUP)]: the groups' widths
            (:func:`plan_stream`'s).

    Returns:
        Words written (width bytes, padded to a word, then the codes).
    """
    n_groups = (sent.shape[0] * dim + PACKED_GROUP - 1) // PACKED_GROUP
    w_words = words_for_bytes(n_groups)
    out[pos : pos + w_words].view(np.uint8)[:n_groups] = widths[:n_groups]
    code_words = 0
    for g in range(n_groups):
        code_words += np.int64(widths[g])
    p = pos + w_words
    end = p + code_words
    acc = np.uint64(0)
    nb = 0
    k = 0
    g = 0
    w = np.int64(widths[0]) if n_groups else 0
    for i in range(sent.shape[0]):
        r0 = np.int64(sent[i]) * dim
        j = 0
        while j < dim:  # the row's run of values in the current group (one width)
            take = min(dim - j, PACKED_GROUP - k)
            at = np.uint64(r0 + j)
            for t in range(take):
                acc |= np.uint64(_code(np.int64(blk_sym[at + np.uint64(t)]))) << np.uint64(nb)
                nb += w
                if nb >= 32:
                    out[np.uint64(p)] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                    p += 1
                    acc >>= np.uint64(32)
                    nb -= 32
            j += take
            k += take
            if k == PACKED_GROUP:
                k = 0
                g += 1
                w = np.int64(widths[g]) if g < n_groups else 0
    while p < end:  # the last group's tail (its codes run short of 32)
        out[p] = np.uint32(acc & np.uint64(0xFFFFFFFF))
        acc >>= np.uint64(32)
        p += 1
    return end - pos


@numba.njit(cache=True, nogil=True)
def segment_checksum(words: np.ndarray) -> np.uint32:
    """A packed segment's checksum: ``sum_j w_j * (2 j + 1) mod 2**32`` over its words after
    the header (the same rule as the payload's, in 32 bits, so a block's writer computes it
    over its own words).

    Args:
        words: uint32 words of the segment after its header.

    Returns:
        The checksum.
    """
    acc = np.uint64(0)  # numba widens uint32 products: sum in 64 bits, keep the low 32
    for j in range(words.shape[0]):
        acc += np.uint64(words[j]) * np.uint64(2 * j + 1)
    return np.uint32(acc & np.uint64(0xFFFFFFFF))


@numba.njit(cache=True, nogil=True)
def decode_stream(
    seg: np.ndarray, stored: int, esc_pos: np.ndarray, widths_at: int, codes_at: int,
    sym: np.ndarray,
) -> int:  # fmt: skip
    """Checks a packed block's words and decodes its symbols (escapes as ``ESCAPE_SYMBOL``).

    Args:
        seg: uint32 words of the segment after its header (to its end).
        stored: The checksum its header holds.
        esc_pos: uint32 escape positions (a view into ``seg``).
        widths_at: Offset of the width bytes in ``seg``.
        codes_at: Offset of the codes in ``seg``.
        sym: uint16 [n_sym]: the sent values' symbols, written.

    Returns:
        0, or the ``DECODE_*`` status of the first check that fails (checksum, widths, a code,
        the escapes).
    """
    if np.int64(segment_checksum(seg)) != np.int64(stored):
        return DECODE_BAD_CHECKSUM
    n_sym = sym.shape[0]
    n_groups = (n_sym + PACKED_GROUP - 1) // PACKED_GROUP
    widths = seg[widths_at:codes_at].view(np.uint8)
    codes = seg[codes_at:]
    total = 0
    for g in range(n_groups):
        w = np.int64(widths[g])
        if w > PACKED_MAX_WIDTH:
            return DECODE_BAD_WIDTH
        total += w
    if total != codes.shape[0]:
        return DECODE_BAD_WIDTH
    p = 0
    e = 0
    top = 0  # the largest code: checked once (a return per symbol measured 15% slower)
    for g in range(n_groups):
        w = np.int64(widths[g])
        cnt = min(PACKED_GROUP, n_sym - e)
        mask = np.uint64((1 << w) - 1)
        acc = np.uint64(0)
        nb = 0
        q = p
        for k in range(cnt):
            if nb < w:
                acc |= np.uint64(codes[np.uint64(q)]) << np.uint64(nb)
                q += 1
                nb += 32
            c = np.int64(acc & mask)
            acc >>= np.uint64(w)
            nb -= w
            top = max(top, c)
            sym[np.uint64(e + k)] = unzigzag(c)  # (garbage past a bad code: then rejected)
        p += w
        e += cnt
    if top > _MAX_CODE:
        return DECODE_BAD_PACKED_CODE
    last = -1
    for k in range(esc_pos.shape[0]):
        at = np.int64(esc_pos[k])
        if at <= last or at >= n_sym or sym[at] != SYMBOL_OFFSET:
            return DECODE_BAD_PACKED_ESCAPES
        sym[at] = ESCAPE_SYMBOL
        last = at
    return 0


__all__ = ["decode_stream", "plan_stream", "put_stream", "segment_checksum", "stream_words"]
