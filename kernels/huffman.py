"""Triton chunked canonical Huffman: histogram, encode and decode, bit-identical to the CPU path.

- :func:`histogram_rows`: symbol counts over selected rows (``histogram_rows_kernel``).
- :func:`encode`: the same words and chunk ends as ``encode_kernel``, in three passes and
  without atomics: (1) one program per chunk sums its code lengths; (2) a prefix sum of the
  chunks' word counts gives every chunk its first word; (3) one program per chunk places each
  code at its bit position: a code starts in word ``w`` and may spill into ``w + 1``, so it is
  written as a 64-bit value aligned on ``w``; a segmented OR-scan merges the codes that start in
  the same word and the last code of each word stores the merged value; (4) each output word is
  the high half of its own 64-bit value ORed with the low half of the previous word's.
- :func:`decode`: one program per chunk walks its bits with the one-lookup table of
  ``decode_table_kernel``; a scan ranks the escapes it decoded so that each is checked against
  the escape positions; same symbols and the same status as ``decode_kernel`` (the first error
  in stream order), computed on the device without a sync.

The code lengths (``code_lengths_kernel``), canonical codes and decode table are built on the
host from the 4096-entry histogram / length table: O(alphabet) work, not O(data).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torchrec_lossy.kernels._common import SCAN_SUM, block_for, inclusive_scan

from torchrec_lossy.codec.format import ALPHABET_SIZE, ESCAPE_SYMBOL
from torchrec_lossy.codec.huffman import (
    DECODE_BAD_CHUNK_TABLE,
    DECODE_BAD_ESCAPES,
    DECODE_INVALID_CODE,
    DECODE_OUT_OF_BITS,
)

_ALPHABET: tl.constexpr = tl.constexpr(ALPHABET_SIZE)
_ESCAPE: tl.constexpr = tl.constexpr(ESCAPE_SYMBOL)
_INVALID: tl.constexpr = tl.constexpr(DECODE_INVALID_CODE)
_OUT_OF_BITS: tl.constexpr = tl.constexpr(DECODE_OUT_OF_BITS)
_HIST_BLOCK = 4096
_ENCODE_BLOCK = 1024


@triton.jit
def _gather_symbols(sym_ptr, rows_ptr, idx, mask, dim):
    """Symbol ``idx`` of the selected rows, in order (``idx`` = position in the encoded stream)."""
    row = tl.load(rows_ptr + idx // dim, mask=mask, other=0).to(tl.int64)
    return tl.load(sym_ptr + row * dim + idx % dim, mask=mask, other=0).to(tl.int32) & 0xFFFF


@triton.jit
def _histogram_rows_kernel(sym_ptr, rows_ptr, hist_ptr, n, dim, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    s = _gather_symbols(sym_ptr, rows_ptr, idx, mask, dim)
    hist = tl.histogram(s, _ALPHABET, mask=mask)
    # Integer counts: the atomics' order cannot change the result.
    tl.atomic_add(hist_ptr + tl.arange(0, _ALPHABET), hist, mask=hist > 0, sem="relaxed")


def histogram_rows(symbols: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Symbol counts over the selected rows of a [rows, dim] symbol matrix.

    Args:
        symbols: [rows, dim] int16 tensor of the uint16 symbols' bits.
        rows: int32 row indices, same device.

    Returns:
        int32 [ALPHABET_SIZE] counts on the symbols' device.
    """
    symbols = symbols.contiguous()
    rows = rows.contiguous()
    dim = symbols.shape[1]
    n = rows.shape[0] * dim
    hist = torch.zeros(ALPHABET_SIZE, dtype=torch.int32, device=symbols.device)
    if n == 0:
        return hist
    block = block_for(n, _HIST_BLOCK)
    _histogram_rows_kernel[(triton.cdiv(n, block),)](
        symbols, rows, hist, n, dim, BLOCK=block, num_warps=8
    )
    return hist


@triton.jit
def _chunk_words_kernel(
    sym_ptr, rows_ptr, len_ptr, words_ptr, n, dim, chunk_symbols, BLOCK: tl.constexpr
):
    # One program per chunk: the number of words its codes fill.
    c = tl.program_id(0).to(tl.int64)
    lo = c * chunk_symbols
    hi = tl.minimum(lo + chunk_symbols, n)
    bits = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(lo, hi, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < hi
        s = _gather_symbols(sym_ptr, rows_ptr, idx, mask, dim)
        bits += tl.load(len_ptr + s, mask=mask, other=0).to(tl.int64)
    tl.store(words_ptr + c, (tl.sum(bits, axis=0) + 31) // 32)


@triton.jit
def _or_segments(aw, av, bw, bv):
    # Segmented OR-scan over (start word, value) pairs sorted by word.
    return bw, bv | tl.where(aw == bw, av, 0)


@triton.jit
def _place_codes_kernel(
    sym_ptr,
    rows_ptr,
    len_ptr,
    code_ptr,
    ends_ptr,
    merged_ptr,
    n,
    dim,
    chunk_symbols,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    lo = c * chunk_symbols
    hi = tl.minimum(lo + chunk_symbols, n)
    first_word = tl.load(ends_ptr + c - 1, mask=c > 0, other=0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    chunk_bits = tl.zeros([], dtype=tl.int64)  # bits placed so far in this chunk
    # The last code of the previous block when its word continues into this block.
    carry_word = tl.zeros([], dtype=tl.int64) - 1
    carry_val = tl.zeros([], dtype=tl.uint64)
    for start in range(lo, hi, BLOCK):
        idx = start + lanes
        mask = idx < hi
        s = _gather_symbols(sym_ptr, rows_ptr, idx, mask, dim)
        length = tl.load(len_ptr + s, mask=mask, other=0).to(tl.int64)
        code = tl.load(code_ptr + s, mask=mask, other=0).to(tl.uint64, bitcast=True)
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


def encode(
    symbols: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    codes: torch.Tensor,
    chunk_symbols: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encodes the symbols of the selected rows into word-aligned chunks, like ``encode_kernel``.

    Args:
        symbols: [rows, dim] int16 tensor of the uint16 symbols' bits; every symbol encoded
            needs a nonzero code length.
        rows: int32 indices of the rows to encode, same device.
        lengths: int32 [ALPHABET_SIZE] code lengths, same device.
        codes: int64 [ALPHABET_SIZE] canonical codes (right-aligned), same device.
        chunk_symbols: Symbols per chunk.

    Returns:
        (chunk_ends: int64 [n_chunks], the end word of each chunk; words: int32 tensor of the
        uint32 bitstream's bits). Sizing ``words`` reads one scalar back from the device.
    """
    symbols = symbols.contiguous()
    rows = rows.contiguous()
    dev = symbols.device
    dim = symbols.shape[1]
    n = rows.shape[0] * dim
    n_chunks = triton.cdiv(n, chunk_symbols)
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=dev), torch.empty(
            0, dtype=torch.int32, device=dev
        )
    block = block_for(chunk_symbols, _ENCODE_BLOCK)
    chunk_words = torch.empty(n_chunks, dtype=torch.int64, device=dev)
    _chunk_words_kernel[(n_chunks,)](
        symbols, rows, lengths, chunk_words, n, dim, chunk_symbols, BLOCK=block
    )
    chunk_ends = inclusive_scan(chunk_words, SCAN_SUM)
    n_words = int(chunk_ends[-1])
    merged = torch.zeros(n_words + 1, dtype=torch.int64, device=dev)
    _place_codes_kernel[(n_chunks,)](
        symbols, rows, lengths, codes, chunk_ends, merged, n, dim, chunk_symbols, BLOCK=block
    )
    words = torch.empty(n_words, dtype=torch.int32, device=dev)
    if n_words:
        join_block = block_for(n_words, 1024)
        _join_words_kernel[(triton.cdiv(n_words, join_block),)](
            merged, words, n_words, BLOCK=join_block
        )
    return chunk_ends, words


@triton.jit
def _decode_kernel(
    words_ptr,
    ends_ptr,
    table_ptr,
    out_ptr,
    esc_ptr,
    status_ptr,
    fail_ptr,
    n,
    n_words,
    chunk_symbols,
    peek_shift,
):
    # One program per chunk, one symbol at a time: decode_kernel's loop, scalar for scalar.
    c = tl.program_id(0).to(tl.int64)
    # Clamped to the stream so a corrupt chunk table cannot make a program read out of bounds
    # (the launcher reports the bad table itself).
    w = tl.minimum(tl.load(ends_ptr + c - 1, mask=c > 0, other=0), n_words).to(tl.int64)
    end = tl.minimum(tl.load(ends_ptr + c), n_words).to(tl.int64)
    shift = tl.zeros([], dtype=tl.uint64) + peek_shift
    i = c * chunk_symbols
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
    tl.store(status_ptr + c, status)
    tl.store(fail_ptr + c, i)  # where the chunk stopped: its end, or the symbol that failed


@triton.jit
def _escape_check_kernel(
    esc_ptr, rank_ptr, expected_ptr, bad_ptr, n, n_escapes, BLOCK: tl.constexpr
):
    # decode_kernel requires the k-th escape decoded to sit at escape_positions[k]; the first
    # position breaking that is where it would have stopped.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    is_esc = tl.load(esc_ptr + i, mask=mask, other=0) == 1
    k = tl.load(rank_ptr + i, mask=mask, other=1).to(tl.int64) - 1
    in_list = k < n_escapes
    expected = tl.load(expected_ptr + k, mask=is_esc & in_list, other=-1)
    bad = is_esc & (~in_list | (expected != i))
    tl.store(bad_ptr + tl.program_id(0), tl.min(tl.where(bad, i, n), axis=0))


def decode(
    words: torch.Tensor,
    chunk_ends: torch.Tensor,
    n: int,
    chunk_symbols: int,
    table: torch.Tensor,
    escape_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decodes and validates every chunk like ``decode_kernel``, without a device sync.

    Args:
        words: int32 tensor of the uint32 bitstream's bits.
        chunk_ends: int64 [n_chunks] end word of each chunk, same device (validated here).
        n: Number of symbols.
        chunk_symbols: Symbols per chunk (>= 1).
        table: int32 decode table from ``decode_table_kernel`` (non-empty; its size is
            ``2**peek``), same device.
        escape_positions: int64 positions where the escape symbol must decode, increasing.

    Returns:
        (int16 symbols [n] (uint16 bits), int32 0-d status: 0 or the DECODE_* code
        ``decode_kernel`` returns for the same input). The codebook check (DECODE_BAD_CODEBOOK)
        is the caller's: it built ``table``.
    """
    dev = words.device
    words = words.contiguous()
    chunk_ends = chunk_ends.contiguous()
    escape_positions = escape_positions.contiguous()
    n_chunks = chunk_ends.shape[0]
    n_words = words.shape[0]
    n_escapes = escape_positions.shape[0]
    out = torch.zeros(n, dtype=torch.int16, device=dev)
    if n_chunks == 0:
        return out, torch.tensor(0 if n_escapes == 0 else DECODE_BAD_ESCAPES, device=dev)
    peek = table.shape[0].bit_length() - 1
    is_esc = torch.zeros(n, dtype=torch.int32, device=dev)
    status = torch.empty(n_chunks, dtype=torch.int32, device=dev)
    stopped = torch.empty(n_chunks, dtype=torch.int64, device=dev)
    # Scalar work: one warp per chunk is all it can use.
    _decode_kernel[(n_chunks,)](
        words,
        chunk_ends,
        table,
        out,
        is_esc,
        status,
        stopped,
        n,
        n_words,
        chunk_symbols,
        64 - peek,
        num_warps=1,
    )
    # Glue on the device (O(n_chunks) torch ops): the first error in stream order wins, as in the
    # sequential kernel.
    none = torch.tensor(n, dtype=torch.int64, device=dev)
    first_fail = torch.where(status != 0, stopped, none)
    stream_pos, stream_chunk = first_fail.min(dim=0)
    esc_pos = none
    n_decoded = torch.zeros((), dtype=torch.int32, device=dev)
    if n:
        rank = inclusive_scan(is_esc, SCAN_SUM)
        block = block_for(n, 4096)
        grid = triton.cdiv(n, block)
        bad = torch.empty(grid, dtype=torch.int64, device=dev)
        _escape_check_kernel[(grid,)](
            is_esc, rank, escape_positions, bad, n, n_escapes, BLOCK=block
        )
        esc_pos = bad.min()
        n_decoded = rank[-1]
    bad_table = (chunk_ends[1:] < chunk_ends[:-1]).any() | (chunk_ends[-1] != n_words)
    result = torch.where(
        bad_table,
        DECODE_BAD_CHUNK_TABLE,
        torch.where(
            esc_pos < stream_pos,
            DECODE_BAD_ESCAPES,
            torch.where(
                stream_pos < n,
                status[stream_chunk],
                torch.where(n_decoded != n_escapes, DECODE_BAD_ESCAPES, 0),
            ),
        ),
    )
    return out, result.to(torch.int32)
