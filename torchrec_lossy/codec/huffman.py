"""Chunked, canonical, length-limited Huffman coding of quantization symbols.

Code lengths are limited to ``MAX_CODE_LENGTH`` (12) bits and deterministic (ties broken by
symbol); the codes are canonical, so only the lengths travel. The stream is cut into word-aligned
chunks with their ends recorded, so chunks decode independently (one GPU lane each) and encode
without atomics after a prefix sum of their sizes. Bits go MSB-first into little-endian uint32
words. Construction: docs/kernels.md, "The kernels"; wire: docs/format.md, "Huffman bitstream".
"""

from __future__ import annotations

import numba
import numpy as np

from torchrec_lossy.codec.codebook import huffman_code_lengths
from torchrec_lossy.codec.format import (
    DECODE_BAD_CHUNK_TABLE,
    DECODE_BAD_CODEBOOK,
    DECODE_BAD_ESCAPES,
    DECODE_INVALID_CODE,
    DECODE_OUT_OF_BITS,
    ESCAPE_SYMBOL,
    MAX_CODE_LENGTH,
)
from torchrec_lossy.codec.host_records import Blocks, Codes, Dedupe

# The length-limited Huffman construction, written once: the torch twin runs it in Python.
code_lengths_kernel = numba.njit(cache=True, nogil=True)(huffman_code_lengths)


@numba.njit(cache=True, nogil=True)
def canonical_codes_kernel(lengths: np.ndarray) -> np.ndarray:
    """Canonical codes from code lengths (codes ordered by length, then symbol).

    Args:
        lengths: uint8 [ALPHABET_SIZE] code lengths.

    Returns:
        uint32 [ALPHABET_SIZE] codes (right-aligned in ``lengths[s]`` bits).
    """
    bl_count = np.zeros(MAX_CODE_LENGTH + 2, dtype=np.int64)
    for s in range(lengths.shape[0]):
        bl_count[lengths[s]] += 1
    bl_count[0] = 0
    next_code = np.zeros(MAX_CODE_LENGTH + 2, dtype=np.int64)
    code = 0
    for length in range(1, MAX_CODE_LENGTH + 1):
        code = (code + bl_count[length - 1]) << 1
        next_code[length] = code
    codes = np.zeros(lengths.shape[0], dtype=np.uint32)
    for s in range(lengths.shape[0]):
        length = lengths[s]
        if length > 0:
            codes[s] = next_code[length]
            next_code[length] += 1
    return codes


@numba.njit(cache=True, nogil=True, inline="always")
def _flush(words: np.ndarray, w: int, acc: np.uint64, n_acc: np.uint64) -> int:
    """Writes the pending bits, left-aligned, as the chunk's last word."""
    if n_acc == 0:
        return w
    words[w] = np.uint32((acc << (np.uint64(32) - n_acc)) & np.uint64(0xFFFFFFFF))
    return w + 1


@numba.njit(cache=True, nogil=True)
def code_entries(lengths: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The encoder's lookup table: ``code << 8 | length`` per symbol.

    Args:
        lengths: uint8 code lengths.
        codes: uint32 canonical codes, same length.

    Returns:
        uint64 entries.
    """
    return (codes.astype(np.uint64) << np.uint64(8)) | lengths.astype(np.uint64)


@numba.njit(cache=True, nogil=True)
def encode_into(
    symbols: np.ndarray,
    rows: np.ndarray,
    entry: np.ndarray,
    chunk_symbols: int,
    chunk_ends: np.ndarray,
    words: np.ndarray,
) -> int:
    """Encodes the symbols of the selected rows, in order, into word-aligned chunks.

    Args:
        symbols: uint16 [rows, dim] symbols.
        rows: int32 indices of the rows to encode, in order.
        entry: uint64 [ALPHABET_SIZE] :func:`code_entries` (every encoded symbol's length > 0).
        chunk_symbols: Symbols per chunk.
        chunk_ends: uint32 [n_chunks] output: end word of each chunk.
        words: uint32 output, at least ``(n * MAX_CODE_LENGTH + 31) // 32 + n_chunks`` words.

    Returns:
        Words written.
    """
    dim = symbols.shape[1]
    w = 0
    c = 0
    in_chunk = 0
    acc = np.uint64(0)  # pending bits, right-aligned; bits above n_acc are stale
    n_acc = np.uint64(0)
    for r in rows:
        for j in range(dim):
            e = entry[symbols[r, j]]
            length = e & np.uint64(0xFF)
            acc = (acc << length) | (e >> np.uint64(8))
            n_acc += length
            if n_acc >= 32:
                n_acc -= np.uint64(32)
                words[w] = np.uint32((acc >> n_acc) & np.uint64(0xFFFFFFFF))
                w += 1
            in_chunk += 1
            if in_chunk == chunk_symbols:
                w = _flush(words, w, acc, n_acc)
                n_acc = np.uint64(0)
                chunk_ends[c] = w
                c += 1
                in_chunk = 0
    if in_chunk > 0:
        w = _flush(words, w, acc, n_acc)
        chunk_ends[c] = w
    return w


@numba.njit(cache=True, nogil=True, inline="always")
def _histogram4(symbols: np.ndarray, base: int, esc: int, hists: np.ndarray, weight: int) -> None:
    """Adds ``weight`` per symbol, compact (``s - base``, the escape at ``esc``), into 4
    interleaved histograms."""
    n = symbols.shape[0]
    n4 = n - n % 4
    for i in range(0, n4, 4):
        for t in range(4):
            s = np.int64(symbols[i + t])
            hists[t, esc if s == ESCAPE_SYMBOL else s - base] += weight
    for i in range(n4, n):
        s = np.int64(symbols[i])
        hists[0, esc if s == ESCAPE_SYMBOL else s - base] += weight


@numba.njit(cache=True, nogil=True, inline="always")
def _plan_into(hists: np.ndarray, base: int, codes: Codes, b: int) -> None:
    """Block ``b``'s code of a compact histogram (4 interleaved ones, summed): its lengths and
    its ``plan`` column into ``codes``."""
    hist = (hists[0] + hists[1] + hists[2] + hists[3]).astype(np.int64)
    width = hist.shape[0]
    esc = width - 1
    blk_lengths = code_lengths_kernel(hist)
    codes.lengths[codes.len_off[b] : codes.len_off[b] + width] = blk_lengths
    plan = codes.plan
    c_lo = -1
    c_hi = -1
    for k in range(width):
        plan[0, b] += hist[k] * blk_lengths[k]
        plan[1, b] += hist[k]
        if k < esc and blk_lengths[k] > 0:
            if c_lo < 0:
                c_lo = k
            c_hi = k
    if c_lo >= 0:
        plan[2, b] = base + c_lo
        plan[3, b] = c_hi - c_lo + 1
    plan[4, b] = hist[esc]


@numba.njit(cache=True, nogil=True)
def plan_blocks_kernel(
    symbols: np.ndarray, blocks: Blocks, dedupe: Dedupe, codes: Codes, distinct: Codes
) -> None:
    """The code plan (code lengths, coded bits, symbol range) of all rows and of the distinct
    rows of every block, in one call.

    Histograms and codes are compact (:class:`~torchrec_lossy.codec.host_records.Codes`), so
    a block costs its symbol span, not the alphabet (the code is the same: ties are broken by
    symbol, whose order the compact index keeps). A deduplicated block's symbols are read
    once: the distinct rows' histogram, plus each repeated vector's repeats, is the histogram
    of all rows.

    Args:
        symbols: uint16 symbols of every block, flat, back to back.
        blocks: The blocks' layout.
        dedupe: The vector-LZ of the symbols (its selected blocks are read by distinct rows).
        codes: The codes of all rows, to fill (``lengths``, ``plan``) for the blocks with a
            range in ``len_off``.
        distinct: The same for the distinct rows (blocks deduplicated and coded).
    """
    for b in range(blocks.dims.shape[0]):
        width = codes.len_off[b + 1] - codes.len_off[b]
        if width == 0:
            continue
        base = codes.base[b]
        esc = width - 1
        # Four interleaved histograms: repeated symbols do not wait on each other's stores.
        hists = np.zeros((4, width), np.int32)
        dim = blocks.dims[b]
        r0 = blocks.row_off[b]
        blk = symbols[blocks.elem_off[b] : blocks.elem_off[b + 1]]
        if not dedupe.selected[b]:  # every row, in order: one flat pass
            _histogram4(blk, base, esc, hists, 1)
        else:
            nu = dedupe.n_unique[b]
            sel = dedupe.first[r0 : r0 + nu]
            for k in range(nu):
                _histogram4(blk[sel[k] * dim : (sel[k] + 1) * dim], base, esc, hists, 1)
            if distinct.len_off[b + 1] > distinct.len_off[b]:
                _plan_into(hists, base, distinct, b)
            # Each distinct vector counts as often as ids refer to it: add its repeats.
            mult = np.zeros(nu, np.int32)
            for v in dedupe.ids[r0 : blocks.row_off[b + 1]]:
                mult[v] += 1
            for k in range(nu):
                if mult[k] > 1:
                    row = blk[sel[k] * dim : (sel[k] + 1) * dim]
                    _histogram4(row, base, esc, hists, mult[k] - 1)
        _plan_into(hists, base, codes, b)


@numba.njit(cache=True, nogil=True)
def decode_table_kernel(lengths: np.ndarray) -> np.ndarray:
    """Builds the one-lookup decode table, or an empty table if the lengths are not a prefix code.

    Args:
        lengths: uint8 [ALPHABET_SIZE] code lengths.

    Returns:
        int32 [2**peek] entries ``symbol | length << 16`` indexed by the next ``peek`` bits, where
        ``peek`` is the longest code length (-1 for bit patterns no code starts with; sized to
        the code so short codes build and stay in cache cheaply), or an empty array when a length
        exceeds the limit or the Kraft sum exceeds 1.
    """
    kraft = 0
    peek = 1
    for s in range(lengths.shape[0]):
        length = lengths[s]
        if length > MAX_CODE_LENGTH:
            return np.empty(0, dtype=np.int32)
        if length > 0:
            kraft += 1 << (MAX_CODE_LENGTH - length)
            peek = max(peek, np.int64(length))
    if kraft > 1 << MAX_CODE_LENGTH:
        return np.empty(0, dtype=np.int32)
    codes = canonical_codes_kernel(lengths)
    table = np.full(1 << peek, -1, dtype=np.int32)
    for s in range(lengths.shape[0]):
        length = lengths[s]
        if length > 0:
            shift = peek - length
            first = np.int64(codes[s]) << shift
            table[first : first + (1 << shift)] = s | (np.int32(length) << 16)
    return table


@numba.njit(cache=True, nogil=True, inline="always")
def stream_layout(table: np.ndarray, chunk_ends: np.ndarray, n_words: int) -> int:
    """The peek width of a decode table, or -1 if the chunk table does not fit the stream.

    The checks every decoder of a chunked stream makes before it reads a symbol.

    Args:
        table: From :func:`decode_table_kernel` (non-empty, ``2**peek`` entries).
        chunk_ends: uint32 end word of each chunk: never decreasing, the last at the end.
        n_words: Words of the stream.

    Returns:
        ``peek`` (the table is indexed by the next ``peek`` bits), or -1.
    """
    prev = np.int64(0)
    for c in range(chunk_ends.shape[0]):
        if np.int64(chunk_ends[c]) < prev:
            return -1
        prev = np.int64(chunk_ends[c])
    if chunk_ends.shape[0] and prev != n_words:
        return -1
    peek = 0
    while (1 << peek) < table.shape[0]:
        peek += 1
    return peek


# What :func:`next_symbol` returns instead of a symbol when the stream is bad.
INVALID_CODE = -1
OUT_OF_BITS = -2


@numba.njit(cache=True, nogil=True, inline="always")
def next_symbol(
    words: np.ndarray, w: int, end: int, buf: np.uint64, n_bits: int, table: np.ndarray,
    shift_peek: np.uint64,
) -> tuple[int, int, np.uint64, int]:  # fmt: skip
    """Reads one symbol of a chunk: the step of every CPU decoder of a chunked stream.

    Args:
        words: uint32 stream.
        w: Next word to load into the bit buffer.
        end: The chunk's end word.
        buf: Bit buffer, the next bit in its top bit.
        n_bits: Valid bits in ``buf``.
        table: From :func:`decode_table_kernel`.
        shift_peek: ``64 - peek`` (:func:`stream_layout`).

    Returns:
        (the symbol's index in the code, or :data:`INVALID_CODE` / :data:`OUT_OF_BITS`;
        ``w``, ``buf``, ``n_bits`` after it).
    """
    while n_bits <= 32 and w < end:
        buf |= np.uint64(words[w]) << np.uint64(32 - n_bits)
        n_bits += 32
        w += 1
    entry = table[np.int64(buf >> shift_peek)]
    if entry < 0:
        return INVALID_CODE, w, buf, n_bits
    length = entry >> 16
    if length > n_bits:
        return OUT_OF_BITS, w, buf, n_bits
    return entry & 0xFFFF, w, buf << np.uint64(length), n_bits - length


@numba.njit(cache=True, nogil=True)
def decode_range_kernel(
    words: np.ndarray,
    chunk_ends: np.ndarray,
    chunk_symbols: int,
    lengths: np.ndarray,
    sym_lo: int,
    escape_positions: np.ndarray,
    out: np.ndarray,
) -> int:
    """Decodes a chunked Huffman stream with a code given for a symbol range: ``lengths[k]`` is
    the length of symbol ``sym_lo + k`` and the last entry the escape's (the wire codebook's
    compact form, as the encoder codes it; the same canonical codes as the whole alphabet's
    lengths, at a fraction of the table-building cost for small blocks).

    Returns:
        0, or one of the DECODE_* error codes.
    """
    table = decode_table_kernel(lengths)
    if table.shape[0] == 0:
        return DECODE_BAD_CODEBOOK
    n_chunks = chunk_ends.shape[0]
    peek = stream_layout(table, chunk_ends, words.shape[0])
    if peek < 0:
        return DECODE_BAD_CHUNK_TABLE
    shift_peek = np.uint64(64 - peek)
    escape = lengths.shape[0] - 1
    n = out.shape[0]
    n_escapes = escape_positions.shape[0]
    k = 0
    start = 0
    for c in range(n_chunks):
        end = np.int64(chunk_ends[c])
        buf = np.uint64(0)
        n_bits = 0
        w = start
        for i in range(c * chunk_symbols, min(n, (c + 1) * chunk_symbols)):
            sym, w, buf, n_bits = next_symbol(words, w, end, buf, n_bits, table, shift_peek)
            if sym < 0:
                return DECODE_INVALID_CODE if sym == INVALID_CODE else DECODE_OUT_OF_BITS
            if sym == escape:
                if k >= n_escapes or escape_positions[k] != i:
                    return DECODE_BAD_ESCAPES
                k += 1
                out[i] = ESCAPE_SYMBOL
            else:
                out[i] = sym_lo + sym
        start = end
    return 0 if k == n_escapes else DECODE_BAD_ESCAPES


@numba.njit(cache=True, nogil=True)
def pack_codebook_kernel(lengths: np.ndarray, sym_lo: int, sym_count: int) -> np.ndarray:
    """The wire codebook: code lengths of value symbols ``sym_lo ..``, two 4-bit nibbles a byte.

    Args:
        lengths: uint8 code lengths indexed by symbol (the whole alphabet, or any slice of it
            with ``sym_lo`` relative to the slice).
        sym_lo: Index in ``lengths`` of the codebook's first value symbol.
        sym_count: Number of value symbols.

    Returns:
        uint8 [ceil(sym_count / 2)], low nibble first (the inverse of ``unpack_codebook_into``).
    """
    nibbles = np.zeros((sym_count + 1) // 2, dtype=np.uint8)
    for k in range(sym_count):
        nibbles[k >> 1] |= lengths[sym_lo + k] << (4 * (k & 1))
    return nibbles


@numba.njit(cache=True, nogil=True, inline="always")
def unpack_codebook_into(nibbles: np.ndarray, sym_count: int, lengths: np.ndarray) -> None:
    """The inverse of :func:`pack_codebook_kernel`: ``sym_count`` code lengths from the wire
    codebook's nibbles (low first) into ``lengths[:sym_count]``."""
    for k in range(sym_count):
        b = nibbles[k >> 1]
        lengths[k] = (b >> 4) if k & 1 else (b & 0xF)
