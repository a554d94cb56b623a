"""Torch twins of ``kernels/huffman.py``'s launchers (no triton): the test oracle.

Same names, signatures and outputs bit for bit (results and the status rows they lower or
raise) as the Triton launchers, for every call the device path makes. Histogram, encode,
escape checks and block status are vectorised over all elements; the decode walks every chunk
in lockstep, one symbol per step, as the kernel's one program per chunk does (the CPU decoder's
loop, ``codec.huffman.decode_range_kernel``, with a bit position instead of a bit buffer).
"""

from __future__ import annotations

import torch

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import format as wire
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.format import (
    DECODE_BAD_CHUNK_TABLE,
    DECODE_BAD_CODEBOOK,
    DECODE_BAD_ESCAPES,
    DECODE_INVALID_CODE,
    DECODE_OUT_OF_BITS,
    REFS_OUT_OF_RANGE,
)
from torchrec_lossy.codec.launch_tables import NO_FAILURE

_U32 = 0xFFFFFFFF


def _ranges(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every index of the ranges ``[lo[r], hi[r])`` (empty where ``hi <= lo``), in order.

    Returns:
        (int64 indices, int64 range of each index).
    """
    sizes = (hi - lo).clamp(min=0)
    owner = torch.repeat_interleave(torch.arange(lo.shape[0], device=lo.device), sizes)
    first = torch.cumsum(sizes, 0) - sizes  # first output position of each range
    idx = lo[owner] + torch.arange(owner.shape[0], device=lo.device) - first[owner]
    return idx, owner


def _segment_of(bases: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``find_segment``: the last segment ``s < len(bases) - 1`` with ``bases[s] <= idx``."""
    return (torch.searchsorted(bases, idx, right=True) - 1).clamp(0, bases.shape[0] - 2)


def histogram_tiles(
    symbols: torch.Tensor, keep: torch.Tensor, tiles: torch.Tensor, n_rows: int, block: int
) -> torch.Tensor:
    """Twin of ``kernels.huffman.histogram_tiles`` (its docstring has the full contract).

    Args:
        symbols: Every segment's symbols (their uint16 bits).
        keep: Per symbol, nonzero where it counts.
        tiles: The launch's tiles, rows (first element, end element, histogram row).
        n_rows: Histograms to return.
        block: Tile size: a tile counts at most its first ``block`` elements, as a program does.

    Returns:
        int32 [n_rows, ALPHABET_SIZE] counts of the kept symbols.
    """
    tiles = tiles.to(torch.int64)
    lo, row = tiles[:, 0], tiles[:, 2]
    idx, tile = _ranges(lo, torch.minimum(tiles[:, 1], lo + block))
    kept = keep[idx] != 0
    bins = row[tile] * wire.ALPHABET_SIZE + (symbols[idx].to(torch.int64) & 0xFFFF)
    counts = torch.bincount(bins[kept], minlength=n_rows * wire.ALPHABET_SIZE)
    return counts.to(torch.int32).reshape(n_rows, wire.ALPHABET_SIZE)


def _code_bits(
    code: torch.Tensor, pos: torch.Tensor, length: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A code's bits at stream bit ``pos`` (MSB first): (its word, the bits it puts there, the
    bits it spills into the next word), all int64 holding uint32 values."""
    end = (pos & 31) + length  # where the code ends, counted from its word's top bit
    head = torch.where(end <= 32, code << (32 - end).clamp(min=0), code >> (end - 32).clamp(min=0))
    tail = torch.where(end > 32, (code << (64 - end).clamp(max=63)) & _U32, 0)
    return pos >> 5, head, tail


def encode_chunks(
    stream: torch.Tensor, chunk_lo: torch.Tensor, chunk_hi: torch.Tensor,
    chunk_table: torch.Tensor, lengths: torch.Tensor, codes: torch.Tensor, chunk_symbols: int,
    max_words: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Twin of ``kernels.huffman.encode_chunks`` (its docstring has the full contract).

    Every code's bit position is a prefix sum of the code lengths, moved by its chunk's padding
    to a word boundary; codes have disjoint bits, so each word is the sum of the bits put in it.

    Args:
        stream: The symbols (their uint16 bits).
        chunk_lo: Per chunk, its first stream position.
        chunk_hi: Per chunk, its end stream position (an empty range fills no word).
        chunk_table: Per chunk, where its code table starts in ``lengths`` / ``codes``.
        lengths: The stacked code-length tables.
        codes: The stacked canonical codes.
        chunk_symbols: Longest chunk (not needed here: it picks the launcher's block size).
        max_words: Words to return; None: the words written.

    Returns:
        (int64 per chunk, its end word; int32 words, zero after the last chunk).
    """
    dev = stream.device
    n_chunks = chunk_lo.shape[0]
    if n_chunks == 0:
        return torch.empty(0, dtype=torch.int64, device=dev), torch.zeros(
            max_words or 0, dtype=torch.int32, device=dev
        )
    idx, chunk = _ranges(chunk_lo, chunk_hi)
    entry = chunk_table[chunk] + (stream[idx].to(torch.int64) & 0xFFFF)
    length = lengths.reshape(-1)[entry].to(torch.int64)
    code = torch.where(length > 0, codes.reshape(-1)[entry], 0)
    chunk_bits = torch.zeros(n_chunks, dtype=torch.int64, device=dev).index_add_(0, chunk, length)
    chunk_words = (chunk_bits + 31) // 32
    chunk_ends = torch.cumsum(chunk_words, 0)
    # Each code's bit position: the bits before it in the stream, moved by its chunk's padding
    # (the chunk's first bit minus the code bits of the chunks before it).
    shift = (chunk_ends - chunk_words) * 32 - (torch.cumsum(chunk_bits, 0) - chunk_bits)
    pos = torch.cumsum(length, 0) - length + shift[chunk]
    n_words = int(chunk_ends[-1]) if max_words is None else max_words
    word, head, tail = _code_bits(code, pos, length)
    acc = torch.zeros(n_words + 1, dtype=torch.int64, device=dev)
    acc.index_add_(0, word, head).index_add_(0, word + 1, tail)
    acc = acc[:n_words]
    return chunk_ends, torch.where(acc > 0x7FFFFFFF, acc - (1 << 32), acc).to(torch.int32)


def _peek(
    words: torch.Tensor, first: torch.Tensor, pos: torch.Tensor, end: torch.Tensor
) -> torch.Tensor:
    """The ``MAX_CODE_LENGTH`` stream bits from bit ``pos`` of the stream at word ``first``,
    reading the words before word ``end`` only (zeros after it, as the decoder's bit buffer)."""
    w = pos >> 5

    def word(k: torch.Tensor) -> torch.Tensor:
        at = (first + k).clamp(0, words.shape[0] - 1)
        return torch.where(k < end, words[at].to(torch.int64) & _U32, 0)

    window = (word(w) << wire.MAX_CODE_LENGTH) | (word(w + 1) >> (32 - wire.MAX_CODE_LENGTH))
    return (window >> (32 - (pos & 31))) & (wire.ALPHABET_SIZE - 1)


def _walk(
    words: torch.Tensor,
    first: torch.Tensor,
    tables: torch.Tensor,
    table_idx: torch.Tensor,
    pos: torch.Tensor,
    end: torch.Tensor,
    i: torch.Tensor,
    stop: torch.Tensor,
    sym0: torch.Tensor,
    out: torch.Tensor,
    is_esc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_chunk`` for every chunk in lockstep: chunk ``c`` decodes its symbols ``i[c] ..
    stop[c] - 1`` from bit ``pos[c]`` of the bitstream at word ``first[c]`` (words before
    ``end[c]``) with table ``table_idx[c]``, symbol ``k`` into ``out`` / ``is_esc`` at
    ``sym0[c] + k``.

    Returns:
        (where each chunk stopped, its status: 0, DECODE_INVALID_CODE or DECODE_OUT_OF_BITS).
    """
    flat, table = tables.reshape(-1), table_idx * wire.ALPHABET_SIZE
    status = torch.zeros_like(i)
    while True:  # one symbol of every chunk still decoding per step
        active = (i < stop) & (status == 0)
        if not bool(active.any()):
            return i, status
        entry = flat[table + _peek(words, first, pos, end)].to(torch.int64)
        length, sym = entry >> 16, entry & 0xFFFF
        invalid = active & (entry < 0)
        short = active & ~invalid & (length > end * 32 - pos)  # more bits than the chunk has
        status = torch.where(
            invalid, DECODE_INVALID_CODE, torch.where(short, DECODE_OUT_OF_BITS, status)
        )
        ok = active & ~invalid & ~short
        at = (sym0 + i)[ok]
        out[at] = sym[ok].to(torch.int16)
        is_esc[at] = (sym[ok] == wire.ESCAPE_SYMBOL).to(torch.int32)
        pos = pos + torch.where(ok, length, 0)
        i = i + ok.to(torch.int64)


def decode_blocks(
    words: torch.Tensor, cols: DecodeColumns, tables: torch.Tensor, n_chunks: int, n_symbols: int
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Decodes the Huffman streams of many blocks, every chunk at once.

    Each chunk reads its block's bitstream between its chunk-table entries (clamped to the
    bitstream) and stops at its first invalid code or at a code longer than the bits left.

    Args:
        words: int32 payload words; every offset below indexes them.
        cols: The blocks' decode record (``decode_columns``); read: each block's first chunk and
            symbol, chunk table and bitstream offsets, bitstream words, symbols per chunk and
            table; written: ``TABLE_BAD`` raised to 1 where the chunk table decreases or does not
            end at the bitstream's end, ``FAIL`` lowered to ``8 * position - DECODE_*`` of the
            block's first failing symbol.
        tables: int32 [n_tables, ALPHABET_SIZE] tables from ``codebook.decode_tables``.
        n_chunks: Total chunks (the last ``CHUNK_BASE`` entry).
        n_symbols: Total symbols (the last ``SYM_BASE`` entry).

    Returns:
        (int16 [n_symbols] symbols (uint16 bits), int32 [n_symbols] 1 where the escape symbol
        decoded).
    """
    fields = (dc.CHUNK_BASE, dc.SYM_BASE, dc.CT_OFF, dc.BS_OFF, dc.BS_WORDS, dc.CHUNK_SYMBOLS)
    chunk_base, sym_base, ct_off, bs_off, bs_words, chunk_symbols = map(cols.column, fields)
    table_idx, table_bad, fail = map(cols.column, (dc.TABLE_IDX, dc.TABLE_BAD, dc.FAIL))
    dev = words.device
    out = torch.zeros(n_symbols, dtype=torch.int16, device=dev)
    is_esc = torch.zeros(n_symbols, dtype=torch.int32, device=dev)
    if n_chunks == 0:
        return out, is_esc
    b = _segment_of(chunk_base, torch.arange(n_chunks, device=dev))
    cl = torch.arange(n_chunks, device=dev) - chunk_base[b]  # the chunk's index in its block
    ends = words[ct_off[b] + cl].to(torch.int64) & _U32  # the chunk table is u32
    starts = torch.where(cl > 0, words[ct_off[b] + cl - 1].to(torch.int64) & _U32, 0)
    last = cl == chunk_base[b + 1] - chunk_base[b] - 1
    bad = ((cl > 0) & (ends < starts)) | (last & (ends != bs_words[b]))
    table_bad.scatter_reduce_(0, b[bad], torch.ones_like(b[bad]), "amax")
    # Clamped to the block's bitstream, as the kernel's reads.
    end = torch.minimum(ends, bs_words[b])
    pos = torch.minimum(starts, bs_words[b]) * 32
    i = cl * chunk_symbols[b]  # the chunk's first symbol in its block
    stop = torch.minimum(i + chunk_symbols[b], sym_base[b + 1] - sym_base[b])
    args = (words, bs_off[b], tables, table_idx[b], pos, end, i, stop, sym_base[b])
    i, status = _walk(*args, out, is_esc)
    failed = status != 0
    fail.scatter_reduce_(0, b[failed], (i * 8 - status)[failed], "amin")
    return out, is_esc


def check_escapes(is_esc: torch.Tensor, words: torch.Tensor, cols: DecodeColumns) -> torch.Tensor:
    """Ranks the decoded escapes and checks them against each block's escape positions.

    Args:
        is_esc: int32 [n_symbols] from :func:`decode_blocks`.
        words: int32 payload words.
        cols: The blocks' decode record; read: each block's first symbol, escape positions'
            word and escapes; written: ``ESC_BAD`` lowered to the block's first misplaced escape.

    Returns:
        int32 [n_symbols] inclusive count of escapes over the concatenated streams.
    """
    fields = (dc.SYM_BASE, dc.ESC_POS_OFF, dc.N_ESC, dc.ESC_BAD)
    sym_base, esc_off, n_esc, esc_bad = map(cols.column, fields)
    rank = torch.cumsum(is_esc, 0, dtype=torch.int32)
    g = torch.nonzero(is_esc == 1).reshape(-1)  # every decoded escape
    if g.shape[0] == 0:
        return rank
    b = _segment_of(sym_base, g)
    sym0 = sym_base[b]
    before = torch.where(sym0 > 0, rank[(sym0 - 1).clamp(min=0)], 0)
    k = (rank[g] - 1 - before).to(torch.int64)  # the escape's index in its block
    in_list = k < n_esc[b]
    at = torch.where(in_list, esc_off[b] + k, 0)
    expected = torch.where(in_list, words[at].to(torch.int64) & _U32, 0)
    i = g - sym0
    bad = ~in_list | (expected != i)
    esc_bad.scatter_reduce_(0, b[bad], i[bad], "amin")
    return rank


def block_status(cols: DecodeColumns, rank: torch.Tensor) -> torch.Tensor:
    """Each block's decode status, as the CPU path would find it.

    Bad references first (the CPU path unpacks them before it decodes the stream), then for
    blocks with a stream: a bad codebook, else a bad chunk table, else the first error in stream
    order (invalid code, out of bits, misplaced escape), else a missing escape.

    Args:
        cols: The blocks' decode record; read: each block's first symbol, escapes, whether it
            has a stream and its status rows (``REFS_BAD``, ``CODEBOOK_BAD``, ``TABLE_BAD``,
            ``FAIL``, ``ESC_BAD``).
        rank: int32 escape ranks from :func:`check_escapes` (any 1-element tensor if empty).

    Returns:
        int32 [n_blocks]: 0, :data:`REFS_OUT_OF_RANGE`, or a ``DECODE_*`` code.
    """
    sym_base, n_esc, has_stream = map(cols.column, (dc.SYM_BASE, dc.N_ESC, dc.HAS_STREAM))
    status = (dc.REFS_BAD, dc.CODEBOOK_BAD, dc.TABLE_BAD, dc.FAIL, dc.ESC_BAD)
    refs_bad, codebook_bad, table_bad, fail, esc_bad = map(cols.column, status)
    s0, s1 = sym_base[:-1], sym_base[1:]
    r0, r1 = (torch.where(s > 0, rank[(s - 1).clamp(min=0)].to(torch.int64), 0) for s in (s0, s1))
    stream_pos = torch.where(fail != NO_FAILURE, fail >> 3, s1 - s0)
    esc_pos = torch.where(esc_bad != NO_FAILURE, esc_bad, s1 - s0)
    missing = torch.where(r1 - r0 != n_esc, DECODE_BAD_ESCAPES, 0)
    code = torch.where(stream_pos < s1 - s0, -(fail & 7), missing)
    code = torch.where(esc_pos < stream_pos, DECODE_BAD_ESCAPES, code)
    code = torch.where(table_bad != 0, DECODE_BAD_CHUNK_TABLE, code)
    code = torch.where(codebook_bad != 0, DECODE_BAD_CODEBOOK, code)
    code = torch.where(has_stream != 0, code, 0)
    code = torch.where(refs_bad != 0, REFS_OUT_OF_RANGE, code)
    return code.to(torch.int32)
