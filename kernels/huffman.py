"""Triton chunked canonical Huffman: histogram, encode and decode, bit-identical to the CPU path.

:func:`histogram_tiles` counts many blocks' symbols in one launch. :func:`encode_chunks` codes
the chunks of many blocks in four passes without atomics (bits per chunk, a prefix sum for each
chunk's first word, codes placed in 64-bit windows and OR-merged, words joined); no sync when the
caller bounds the word count. :func:`decode_blocks`, :func:`check_escapes` and
:func:`block_status` decode and check every chunk of a payload at once, with the CPU decoder's
symbols and statuses, without a sync. Torch twins: ``kernels/huffman_ref.py``; the passes:
docs/kernels.md, 'The kernels'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import format as wire
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.launch_tables import NO_FAILURE, block_for
from torchrec_lossy.kernels.common import SCAN_SUM, find_segment, inclusive_scan

_ALPHABET: tl.constexpr = tl.constexpr(wire.ALPHABET_SIZE)
_ESCAPE: tl.constexpr = tl.constexpr(wire.ESCAPE_SYMBOL)
_INVALID: tl.constexpr = tl.constexpr(wire.DECODE_INVALID_CODE)
_OUT_OF_BITS: tl.constexpr = tl.constexpr(wire.DECODE_OUT_OF_BITS)
_ENCODE_BLOCK = 1024


@triton.jit
def _histogram_tiles_kernel(sym_ptr, keep_ptr, tile_ptr, hist_ptr, BLOCK: tl.constexpr):
    # One program per tile (first element, end, histogram row): counts the kept symbols.
    pid = tl.program_id(0).to(tl.int64)
    start = tl.load(tile_ptr + 3 * pid)
    end = tl.load(tile_ptr + 3 * pid + 1)
    row = tl.load(tile_ptr + 3 * pid + 2)
    idx = start + tl.arange(0, BLOCK)
    mask = idx < end
    s = tl.load(sym_ptr + idx, mask=mask, other=0).to(tl.int32) & 0xFFFF
    keep = mask & (tl.load(keep_ptr + idx, mask=mask, other=0) != 0)
    hist = tl.histogram(s, _ALPHABET, mask=keep)
    # Integer counts: the atomics' order cannot change the result.
    bins = tl.arange(0, _ALPHABET)
    tl.atomic_add(hist_ptr + row * _ALPHABET + bins, hist, mask=hist > 0, sem="relaxed")


def histogram_tiles(
    symbols: torch.Tensor, keep: torch.Tensor, tiles: torch.Tensor, n_rows: int, block: int
) -> torch.Tensor:
    """Per-segment symbol counts of the kept symbols of many segments, in one launch.

    Args:
        symbols: 1-D int16 / int32 symbols (the uint16 symbols' bits) of every segment.
        keep: 1-D int32 / int64, same length: nonzero where a symbol counts.
        tiles: int64 [n_tiles, 3] from ``launch_tables.tile_table`` with ``block``-element tiles, on
            the symbols' device.
        n_rows: Number of histograms (segments).
        block: Elements per tile (a power of two).

    Returns:
        int32 [n_rows, ALPHABET_SIZE] counts. Nothing is synced.
    """
    hist = torch.zeros(n_rows, wire.ALPHABET_SIZE, dtype=torch.int32, device=symbols.device)
    if tiles.shape[0]:
        _histogram_tiles_kernel[(tiles.shape[0],)](
            symbols.contiguous(),
            keep.contiguous(),
            tiles.contiguous(),
            hist,
            BLOCK=block,
            num_warps=8,
        )
    return hist


@triton.jit
def _chunk_words_kernel(
    stream_ptr, lo_ptr, hi_ptr, tab_ptr, len_ptr, words_ptr, BLOCK: tl.constexpr
):
    # One program per chunk: the number of words its codes fill. A chunk is the stream range
    # [lo, hi) coded with the code table at tab (an offset into the stacked tables); an empty
    # range (a chunk slot its block does not use) fills 0 words.
    c = tl.program_id(0).to(tl.int64)
    lo = tl.load(lo_ptr + c)
    hi = tl.load(hi_ptr + c)
    tab = tl.load(tab_ptr + c)
    bits = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(lo, hi, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < hi
        s = tl.load(stream_ptr + idx, mask=mask, other=0).to(tl.int32) & 0xFFFF
        bits += tl.load(len_ptr + tab + s, mask=mask, other=0).to(tl.int64)
    tl.store(words_ptr + c, (tl.sum(bits, axis=0) + 31) // 32)


@triton.jit
def _or_segments(aw, av, bw, bv):
    # Segmented OR-scan over (start word, value) pairs sorted by word.
    return bw, bv | tl.where(aw == bw, av, 0)


@triton.jit
def _place_codes_kernel(
    stream_ptr,
    lo_ptr,
    hi_ptr,
    tab_ptr,
    len_ptr,
    code_ptr,
    ends_ptr,
    merged_ptr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    lo = tl.load(lo_ptr + c)
    hi = tl.load(hi_ptr + c)
    tab = tl.load(tab_ptr + c)
    first_word = tl.load(ends_ptr + c - 1, mask=c > 0, other=0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    chunk_bits = tl.zeros([], dtype=tl.int64)  # bits placed so far in this chunk
    # The last code of the previous block when its word continues into this block.
    carry_word = tl.zeros([], dtype=tl.int64) - 1
    carry_val = tl.zeros([], dtype=tl.uint64)
    for start in range(lo, hi, BLOCK):
        idx = start + lanes
        mask = idx < hi
        s = tl.load(stream_ptr + idx, mask=mask, other=0).to(tl.int32) & 0xFFFF
        length = tl.load(len_ptr + tab + s, mask=mask, other=0).to(tl.int64)
        code = tl.load(code_ptr + tab + s, mask=mask, other=0).to(tl.uint64, bitcast=True)
        end_bits = chunk_bits + tl.cumsum(length, axis=0)  # bit offsets within the chunk
        pos = first_word * 32 + end_bits - length
        word = pos >> 5
        # The code left-aligned in the 64-bit window of its start word (off + length <= 43).
        shift = 64 - (pos & 31) - length
        val = tl.where(mask & (length > 0), code << tl.where(shift < 64, shift, 0).to(tl.uint64), 0)
        val = tl.where(word == carry_word, val | carry_val, val)
        word = tl.where(mask, word, 0x7FFFFFFFFFFFFFFF)  # padding lanes: a segment of their own
        _, merged = tl.associative_scan((word, val), 0, _or_segments)
        # A lane closes its word's segment when the next code starts in a later word, or when
        # it is the chunk's last code.
        next_word = (first_word * 32 + end_bits) >> 5
        closes = mask & ((next_word != word) | (idx == hi - 1))
        tl.store(merged_ptr + word, merged.to(tl.int64, bitcast=True), mask=closes)
        last = tl.minimum(hi - start, BLOCK) - 1
        at_last = lanes == last
        carry_word = tl.sum(tl.where(at_last, word, 0), axis=0)
        carry_val = tl.sum(tl.where(at_last, merged, 0), axis=0)
        chunk_bits = tl.sum(tl.where(at_last, end_bits, 0), axis=0)


@triton.jit
def _join_words_kernel(merged_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = w < n_words
    own = tl.load(merged_ptr + w, mask=mask, other=0).to(tl.uint64, bitcast=True)
    prev = tl.load(merged_ptr + w - 1, mask=mask & (w > 0), other=0).to(tl.uint64, bitcast=True)
    word = (own >> 32) | (prev & 0xFFFFFFFF)
    tl.store(out_ptr + w, word.to(tl.uint32).to(tl.int32, bitcast=True), mask=mask)


def encode_chunks(
    stream: torch.Tensor,
    chunk_lo: torch.Tensor,
    chunk_hi: torch.Tensor,
    chunk_table: torch.Tensor,
    lengths: torch.Tensor,
    codes: torch.Tensor,
    chunk_symbols: int,
    max_words: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encodes many chunks (of one or many blocks) into one word stream, without atomics.

    Chunk ``c`` codes ``stream[chunk_lo[c]:chunk_hi[c]]`` with the code table starting at
    ``chunk_table[c]`` in the stacked ``lengths`` / ``codes``, and starts on a new word after
    chunk ``c - 1``'s. An empty range is a chunk slot that fills no word (batched callers size
    the chunk table for the worst case).

    Args:
        stream: 1-D int16 / int32 symbols (the uint16 symbols' bits).
        chunk_lo: int64 [n_chunks] first stream position of each chunk.
        chunk_hi: int64 [n_chunks] end (exclusive) stream position of each chunk.
        chunk_table: int64 [n_chunks] offset of the chunk's code table in ``lengths``/``codes``.
        lengths: int32 stacked code-length tables ([k * ALPHABET_SIZE]); every coded symbol
            needs a nonzero length.
        codes: int64 stacked canonical codes, same layout.
        chunk_symbols: Longest chunk (picks the program block size).
        max_words: Size of the returned word buffer (an upper bound of the words written); None
            reads the exact count back from the device (one sync).

    Returns:
        (chunk_ends: int64 [n_chunks], the end word (exclusive) of each chunk in the stream;
        words: int32 [max_words] bits of the uint32 words, zero after the last chunk).
    """
    dev = stream.device
    stream = stream.contiguous()
    n_chunks = chunk_lo.shape[0]
    if n_chunks == 0:
        return torch.empty(0, dtype=torch.int64, device=dev), torch.zeros(
            max_words or 0, dtype=torch.int32, device=dev
        )
    block = block_for(chunk_symbols, _ENCODE_BLOCK)
    lengths = lengths.reshape(-1).contiguous()
    codes = codes.reshape(-1).contiguous()
    chunk_words = torch.empty(n_chunks, dtype=torch.int64, device=dev)
    _chunk_words_kernel[(n_chunks,)](
        stream, chunk_lo, chunk_hi, chunk_table, lengths, chunk_words, BLOCK=block
    )
    chunk_ends = inclusive_scan(chunk_words, SCAN_SUM)
    n_words = int(chunk_ends[-1]) if max_words is None else max_words
    merged = torch.zeros(n_words + 1, dtype=torch.int64, device=dev)
    _place_codes_kernel[(n_chunks,)](
        stream, chunk_lo, chunk_hi, chunk_table, lengths, codes, chunk_ends, merged, BLOCK=block
    )
    words = torch.empty(n_words, dtype=torch.int32, device=dev)
    if n_words:
        join_block = block_for(n_words, 1024)
        _join_words_kernel[(triton.cdiv(n_words, join_block),)](
            merged, words, n_words, BLOCK=join_block
        )
    return chunk_ends, words


@triton.jit
def decode_chunk(words_ptr, w, end, table_ptr, peek_shift, out_ptr, esc_ptr, i, n, chunk_symbols):
    """The CPU decoder's loop (``huffman.decode_range_kernel``) over one chunk, scalar for
    scalar: symbols ``i .. min(i + chunk_symbols, n)`` from words ``w .. end`` (already clamped to
    the stream). Returns where it stopped and the status (0, _INVALID or _OUT_OF_BITS)."""
    shift = tl.zeros([], dtype=tl.uint64) + peek_shift
    hi = tl.minimum(i + chunk_symbols, n)
    buf = tl.zeros([], dtype=tl.uint64)
    n_bits = tl.zeros([], dtype=tl.int64)
    status = tl.zeros([], dtype=tl.int32)
    while (i < hi) & (status == 0):
        while (n_bits <= 32) & (w < end):
            word = tl.load(words_ptr + w).to(tl.uint32, bitcast=True).to(tl.uint64)
            buf |= word << (32 - n_bits).to(tl.uint64)
            n_bits += 32
            w += 1
        entry = tl.load(table_ptr + (buf >> shift).to(tl.int64))
        length = (entry >> 16).to(tl.int64)
        if entry < 0:
            status = tl.full([], _INVALID, tl.int32)
        elif length > n_bits:
            status = tl.full([], _OUT_OF_BITS, tl.int32)
        else:
            sym = entry & 0xFFFF
            tl.store(out_ptr + i, sym.to(tl.int16))
            tl.store(esc_ptr + i, (sym == _ESCAPE).to(tl.int32))
            buf = buf << length.to(tl.uint64)
            n_bits -= length
            i += 1
    return i, status


# ------------------------------------------------------------------------------------------------
# Decode side, batched (device decompress): every chunk of every block in one launch.
#
# The blocks' streams are concatenated: block b owns symbols [sym_base[b], sym_base[b + 1]) and
# global chunks [chunk_base[b], chunk_base[b + 1]) (0 of each for blocks without a stream). Its
# sections are read in place from the payload's words; its per-block status goes to int64 rows
# that start at 0 (flags) or at INT64_MAX (first-failure positions) and are only ever raised /
# lowered by atomics, so the result does not depend on the order programs run in.

_NO_FAIL: tl.constexpr = tl.constexpr(NO_FAILURE)
_REFS_BAD: tl.constexpr = tl.constexpr(wire.REFS_OUT_OF_RANGE)
_BAD_ESCAPES: tl.constexpr = tl.constexpr(wire.DECODE_BAD_ESCAPES)
_BAD_TABLE: tl.constexpr = tl.constexpr(wire.DECODE_BAD_CHUNK_TABLE)
_BAD_CODEBOOK: tl.constexpr = tl.constexpr(wire.DECODE_BAD_CODEBOOK)


@triton.jit
def _decode_blocks_kernel(
    words_ptr, cols_ptr, tables_ptr, out_ptr, esc_ptr, stride, n_blocks, n_iter
):  # fmt: skip
    # One program per chunk; the loop is the CPU decoder's, scalar for scalar.
    # Field F of block b is at cols_ptr + F * stride + b (``decode_columns``).
    c = tl.program_id(0).to(tl.int64)
    chunk_base = cols_ptr + dc.CHUNK_BASE * stride
    b = find_segment(chunk_base, c, n_blocks, n_iter)
    first_chunk = tl.load(chunk_base + b)
    n_chunks = tl.load(chunk_base + b + 1) - first_chunk
    cl = c - first_chunk
    sym0 = tl.load(cols_ptr + dc.SYM_BASE * stride + b)
    n = tl.load(cols_ptr + dc.SYM_BASE * stride + b + 1) - sym0
    ct = words_ptr + tl.load(cols_ptr + dc.CT_OFF * stride + b)
    bs = words_ptr + tl.load(cols_ptr + dc.BS_OFF * stride + b)
    n_words = tl.load(cols_ptr + dc.BS_WORDS * stride + b)
    chunk_symbols = tl.load(cols_ptr + dc.CHUNK_SYMBOLS * stride + b)
    table = tables_ptr + tl.load(cols_ptr + dc.TABLE_IDX * stride + b) * _ALPHABET
    # The chunk table is u32 in the payload: widen without sign extension.
    prev_end = tl.load(ct + cl - 1, mask=cl > 0, other=0).to(tl.int64) & 0xFFFFFFFF
    this_end = tl.load(ct + cl).to(tl.int64) & 0xFFFFFFFF
    bad_table = ((cl > 0) & (this_end < prev_end)) | ((cl == n_chunks - 1) & (this_end != n_words))
    tl.atomic_max(cols_ptr + dc.TABLE_BAD * stride + b, 1, mask=bad_table, sem="relaxed")
    # Clamped to the block's bitstream, so a corrupt table cannot make a program read elsewhere.
    w = tl.minimum(prev_end, n_words)
    end = tl.minimum(this_end, n_words)
    i, status = decode_chunk(
        bs, w, end, table, 52, out_ptr + sym0, esc_ptr + sym0, cl * chunk_symbols, n, chunk_symbols
    )  # 12-bit tables: peek the top 12 of 64 bits
    # Chunks are disjoint, so the smallest (position, code) key names the block's first failure.
    key = i * 8 - status.to(tl.int64)
    tl.atomic_min(cols_ptr + dc.FAIL * stride + b, key, mask=status != 0, sem="relaxed")


@triton.jit
def _escape_check_blocks_kernel(
    esc_ptr, rank_ptr, words_ptr, cols_ptr, stride, total, n_blocks, n_iter, BLOCK: tl.constexpr
):  # fmt: skip
    # As _escape_check_kernel, per block: the k-th escape decoded in block b must sit at the
    # block's escape_positions[k]; the block's first position breaking that is kept.
    g = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = g < total
    is_esc = mask & (tl.load(esc_ptr + g, mask=mask, other=0) == 1)
    sym_base = cols_ptr + dc.SYM_BASE * stride
    b = find_segment(sym_base, g, n_blocks, n_iter)
    sym0 = tl.load(sym_base + b, mask=is_esc, other=0)
    before = tl.load(rank_ptr + sym0 - 1, mask=is_esc & (sym0 > 0), other=0)
    k = (tl.load(rank_ptr + g, mask=is_esc, other=1) - 1 - before).to(tl.int64)
    n_escapes = tl.load(cols_ptr + dc.N_ESC * stride + b, mask=is_esc, other=0)
    in_list = k < n_escapes
    pos_ptr = words_ptr + tl.load(cols_ptr + dc.ESC_POS_OFF * stride + b, mask=is_esc, other=0)
    expected = tl.load(pos_ptr + k, mask=is_esc & in_list, other=0).to(tl.int64) & 0xFFFFFFFF
    i = g - sym0
    bad = is_esc & (~in_list | (expected != i))
    tl.atomic_min(cols_ptr + dc.ESC_BAD * stride + b, i, mask=bad, sem="relaxed")


@triton.jit
def _block_status_kernel(cols_ptr, rank_ptr, code_ptr, stride, n_blocks, BLOCK: tl.constexpr):
    # decode()'s glue, per block: a bad codebook, else a bad chunk table, else the first error in
    # stream order (invalid code, out of bits, misplaced escape), else a missing escape. Bad
    # references come first: the CPU path unpacks them before it decodes the stream.
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = b < n_blocks
    s0 = tl.load(cols_ptr + dc.SYM_BASE * stride + b, mask=mask, other=0)
    s1 = tl.load(cols_ptr + dc.SYM_BASE * stride + b + 1, mask=mask, other=0)
    n = s1 - s0
    r0 = tl.load(rank_ptr + s0 - 1, mask=mask & (s0 > 0), other=0).to(tl.int64)
    r1 = tl.load(rank_ptr + s1 - 1, mask=mask & (s1 > 0), other=0).to(tl.int64)
    n_escapes = tl.load(cols_ptr + dc.N_ESC * stride + b, mask=mask, other=0)
    fail = tl.load(cols_ptr + dc.FAIL * stride + b, mask=mask, other=_NO_FAIL)
    esc_bad = tl.load(cols_ptr + dc.ESC_BAD * stride + b, mask=mask, other=_NO_FAIL)
    stream_pos = tl.where(fail != _NO_FAIL, fail >> 3, n)
    esc_pos = tl.where(esc_bad != _NO_FAIL, esc_bad, n)
    code = tl.where(
        esc_pos < stream_pos,
        _BAD_ESCAPES,
        tl.where(
            stream_pos < n,
            -(fail & 7),
            tl.where(r1 - r0 != n_escapes, _BAD_ESCAPES, 0),
        ),
    )
    table_bad = tl.load(cols_ptr + dc.TABLE_BAD * stride + b, mask=mask, other=0)
    codebook_bad = tl.load(cols_ptr + dc.CODEBOOK_BAD * stride + b, mask=mask, other=0)
    has_stream = tl.load(cols_ptr + dc.HAS_STREAM * stride + b, mask=mask, other=0)
    refs_bad = tl.load(cols_ptr + dc.REFS_BAD * stride + b, mask=mask, other=0)
    code = tl.where(table_bad != 0, _BAD_TABLE, code)
    code = tl.where(codebook_bad != 0, _BAD_CODEBOOK, code)
    code = tl.where(has_stream != 0, code, 0)
    code = tl.where(refs_bad != 0, _REFS_BAD, code)
    tl.store(code_ptr + b, code.to(tl.int32), mask=mask)


def decode_blocks(
    words: torch.Tensor,
    cols: DecodeColumns,
    tables: torch.Tensor,
    n_chunks: int,
    n_symbols: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decodes the Huffman streams of many blocks, every chunk in one launch; no sync.

    Args:
        words: int32 payload words; every offset below indexes them.
        cols: The blocks' decode record; read: ``CHUNK_BASE`` / ``SYM_BASE`` (first global
            chunk / symbol of each block), ``CT_OFF`` / ``BS_OFF`` (word offsets of the chunk
            table / bitstream), ``BS_WORDS``, ``CHUNK_SYMBOLS`` (>= 1 where the block has
            chunks), ``TABLE_IDX`` (each block's table in ``tables``). Written (atomics):
            ``TABLE_BAD`` raised to 1 where the chunk table decreases or does not end at the
            bitstream's end; ``FAIL`` lowered to ``8 * position - DECODE_*`` of the block's
            first failing symbol.
        tables: int32 [n_tables, ALPHABET_SIZE] tables from ``codebook.decode_tables``.
        n_chunks: Total chunks (the last ``CHUNK_BASE`` entry, known to the host).
        n_symbols: Total symbols (the last ``SYM_BASE`` entry).

    Returns:
        (int16 [n_symbols] symbols (uint16 bits), int32 [n_symbols] 1 where the escape symbol
        decoded).
    """
    dev = words.device
    out = torch.zeros(n_symbols, dtype=torch.int16, device=dev)
    is_esc = torch.zeros(n_symbols, dtype=torch.int32, device=dev)
    n_blocks = cols.n_blocks
    if n_chunks:
        _decode_blocks_kernel[(n_chunks,)](
            words, cols.cols, tables, out, is_esc, cols.stride, n_blocks, n_blocks.bit_length(),
            num_warps=1,
        )  # fmt: skip
    return out, is_esc


def check_escapes(is_esc: torch.Tensor, words: torch.Tensor, cols: DecodeColumns) -> torch.Tensor:
    """Ranks the decoded escapes and checks them against each block's escape positions.

    Args:
        is_esc: int32 [n_symbols] from :func:`decode_blocks`.
        words: int32 payload words.
        cols: The blocks' decode record; read: ``SYM_BASE``, ``ESC_POS_OFF`` (word offset of
            each block's escape positions), ``N_ESC``. Written: ``ESC_BAD`` lowered to the
            block's first misplaced escape.

    Returns:
        int32 [n_symbols] inclusive count of escapes over the concatenated streams (escape
        ``k`` of block ``b`` has rank ``k + 1`` plus the rank before ``SYM_BASE[b]``).
    """
    n = is_esc.shape[0]
    rank = inclusive_scan(is_esc, SCAN_SUM)
    if n:
        n_blocks = cols.n_blocks
        block = block_for(n, 4096)
        _escape_check_blocks_kernel[(triton.cdiv(n, block),)](
            is_esc, rank, words, cols.cols, cols.stride, n, n_blocks, n_blocks.bit_length(),
            BLOCK=block,
        )  # fmt: skip
    return rank


def block_status(cols: DecodeColumns, rank: torch.Tensor) -> torch.Tensor:
    """Each block's decode status, as the CPU path would find it; no sync.

    Args:
        cols: The blocks' decode record; read: ``SYM_BASE``, ``N_ESC``, ``HAS_STREAM`` and the
            status rows ``REFS_BAD``, ``CODEBOOK_BAD`` (``codebook.decode_tables``),
            ``TABLE_BAD``, ``FAIL`` (:func:`decode_blocks`), ``ESC_BAD`` (:func:`check_escapes`).
        rank: int32 escape ranks from :func:`check_escapes` (any 1-element tensor if empty).

    Returns:
        int32 [n_blocks]: 0, :data:`REFS_OUT_OF_RANGE`, or a ``DECODE_*`` code.
    """
    n_blocks = cols.n_blocks
    codes = torch.empty(n_blocks, dtype=torch.int32, device=cols.cols.device)
    if n_blocks:
        block = block_for(n_blocks, 1024)
        _block_status_kernel[(triton.cdiv(n_blocks, block),)](
            cols.cols, rank, codes, cols.stride, n_blocks, BLOCK=block
        )
    return codes


# The @triton.jit kernels by name, for the ahead-of-time compile check (``kernels/_aot.py``);
# callers launch them through the functions above.
JIT_KERNELS = {
    "block_status_kernel": _block_status_kernel,
    "chunk_words_kernel": _chunk_words_kernel,
    "decode_blocks_kernel": _decode_blocks_kernel,
    "escape_check_blocks_kernel": _escape_check_blocks_kernel,
    "histogram_tiles_kernel": _histogram_tiles_kernel,
    "join_words_kernel": _join_words_kernel,
    "place_codes_kernel": _place_codes_kernel,
}
