"""The single-block Triton launchers: the stage-level oracle, for tests only.

Each runs one stage of one block through the production kernels' building blocks
(``quantize_tiles``, ``representatives``, ``histogram_tiles``, ``encode_chunks``, the
``decode_chunk`` loop of ``decode_blocks``) and returns what the numba stage kernel returns
(tests/test_kernels.py), so the batched kernels are checked stage by stage. The
few kernels only a single-block launcher needs (dequantize, id assignment, reference packing,
single-stream decode and escape check) live here with them. Production never runs these: CUDA
tensors go device-resident (``device_compress`` / ``device_decompress``, batched launchers).

Importing this module imports triton (tests/test_kernels.py skips without it).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from torchrec_lossy.codec.format import (
    DECODE_BAD_CHUNK_TABLE,
    DECODE_BAD_ESCAPES,
    REFS_FIXED,
    SYMBOL_OFFSET,
    ref_width,
    refs_bits,
)
from torchrec_lossy.kernels.common import SCAN_MAX, SCAN_SUM, inclusive_scan
from torchrec_lossy.kernels.huffman import decode_chunk, encode_chunks, histogram_tiles
from torchrec_lossy.kernels.launch_tables import block_for, tile_table
from torchrec_lossy.kernels.quantize import quantize_tiles
from torchrec_lossy.kernels.vector_lz import representatives

_BLOCK = 4096  # kernels/quantize.py's element tile
_HIST_BLOCK = 4096  # kernels/huffman.py's histogram tile


# ------------------------------------------------------------------------------------------------
# Quantize


def quantize(
    x: torch.Tensor,
    step: float,
    inv_step: float,
    center: int,
    bound: float,
    dtype_code: int,
    sr_key: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes a flat float32 tensor into symbols on its device; escapes what it cannot cover.

    Args:
        x: 1-D float32 values (exact copies of the block's fp32 / fp16 / bf16 values).
        step: Quantization step (float32-representable).
        inv_step: float32 reciprocal of the step.
        center: Code of the block's midpoint.
        bound: Absolute bound, checked in float64.
        dtype_code: The block's dtype code (the reconstruction is rounded to it).
        sr_key: -1: round to nearest; else the block's stochastic-rounding key.

    Returns:
        (int16 symbols [n] (the uint16 symbols' bits), int32 histogram [ALPHABET_SIZE],
        float64 0-d max error over the elements that were not escaped). Nothing is synced.
    """
    dev = x.device
    n = x.shape[0]
    block = block_for(n, _BLOCK)
    symbols, hist, errors = quantize_tiles(
        x,
        torch.from_numpy(tile_table(np.array([n]), block)).to(dev),
        torch.tensor([step], dtype=torch.float32, device=dev),
        torch.tensor([inv_step], dtype=torch.float32, device=dev),
        torch.tensor([center], dtype=torch.int64, device=dev),
        torch.tensor([bound], dtype=torch.float64, device=dev),
        torch.tensor([dtype_code], dtype=torch.int32, device=dev),
        block,
        torch.tensor([sr_key], dtype=torch.int64, device=dev),
    )
    err = errors.max() if errors.numel() else torch.zeros((), dtype=torch.float64, device=dev)
    return symbols, hist.reshape(-1), err


@triton.jit
def _dequantize_kernel(sym_ptr, out_ptr, n, step, base, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(sym_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    # |s + base| < 2**24, so the int -> float32 conversion is exact.
    tl.store(out_ptr + offs, (s + base).to(tl.float32) * step, mask=mask)


def dequantize(symbols: torch.Tensor, step: float, center: int) -> torch.Tensor:
    """Reconstructs float32 values from symbols (escaped positions get garbage, overwritten later).

    Args:
        symbols: 1-D int16 tensor holding the uint16 symbols' bits.
        step: Quantization step.
        center: Code of the block's midpoint.

    Returns:
        1-D float32 tensor on the symbols' device.
    """
    symbols = symbols.contiguous()
    n = symbols.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=symbols.device)
    if n == 0:
        return out
    block = block_for(n, _BLOCK)
    _dequantize_kernel[(triton.cdiv(n, block),)](
        symbols,
        out,
        n,
        step,
        center - SYMBOL_OFFSET,
        BLOCK=block,
        num_warps=8,
        enable_fp_fusion=False,
    )
    return out


# ------------------------------------------------------------------------------------------------
# Vector-LZ


@triton.jit
def _assign_kernel(
    rep_ptr, first_ptr, rank_ptr, ids_ptr, first_rows_ptr, rows, BLOCK: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < rows
    rep = tl.load(rep_ptr + i, mask=mask, other=0)
    # rank = inclusive count of first occurrences; a first occurrence's id is its rank - 1.
    tl.store(ids_ptr + i, tl.load(rank_ptr + rep, mask=mask, other=1) - 1, mask=mask)
    is_first = tl.load(first_ptr + i, mask=mask, other=0) == 1
    slot = tl.load(rank_ptr + i, mask=mask, other=1) - 1
    tl.store(first_rows_ptr + slot, i.to(tl.int32), mask=mask & is_first)


def dedupe(symbols: torch.Tensor | None, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Finds repeated rows; the result equals ``host_kernels.dedupe``'s.

    Args:
        symbols: [rows, dim] int16 tensor of the uint16 symbols' bits, or None to compare raw
            bits only (lossless dedupe).
        bits: [rows, dim] int32 raw bits of the block's elements, same device.

    Returns:
        (ids: int32 [rows], the distinct-vector id of each row, numbered by first occurrence;
        first_rows: int32 [n_unique], the row where each distinct vector first occurs). Sizing
        ``first_rows`` reads one scalar back from the device.
    """
    rows, dim = bits.shape
    dev = bits.device
    if rows == 0:
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        return empty, empty
    row = torch.arange(rows, dtype=torch.int64, device=dev)
    rep, is_first = representatives(
        None if symbols is None else symbols.reshape(-1),
        bits.reshape(-1),
        row * dim,
        torch.full((rows,), dim, dtype=torch.int32, device=dev),
        torch.zeros(rows, dtype=torch.int32, device=dev),
        dim,
    )
    block = block_for(rows, 1024)
    flat_grid = (triton.cdiv(rows, block),)
    rank = inclusive_scan(is_first, SCAN_SUM)
    n_unique = int(rank[-1])
    ids = torch.empty(rows, dtype=torch.int32, device=dev)
    first_rows = torch.empty(n_unique, dtype=torch.int32, device=dev)
    _assign_kernel[flat_grid](rep, is_first, rank, ids, first_rows, rows, BLOCK=block)
    return ids, first_rows


@triton.jit
def _flagged_len_kernel(ids_ptr, max_ptr, len_ptr, val_ptr, rows, width, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = r < rows
    v = tl.load(ids_ptr + r, mask=mask, other=0)
    before = tl.load(max_ptr + r - 1, mask=mask & (r > 0), other=-1)
    # With ids numbered by first occurrence, a row is a first occurrence iff its id exceeds
    # every earlier id: then it is sent as one flag bit, else as a 0 flag and its id.
    first = v > before
    tl.store(len_ptr + r, tl.where(first, 1, 1 + width).to(tl.int64), mask=mask)
    tl.store(val_ptr + r, tl.where(first, 1, v), mask=mask)


@triton.jit
def _pack_refs_kernel(
    val_ptr,
    ends_ptr,
    out_ptr,
    rows,
    n_words,
    width,
    n_iter,
    FLAGGED: tl.constexpr,
    ROWS_PER_WORD: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    w = tl.program_id(0).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    wmask = w < n_words
    word_start = w * 32
    if FLAGGED:
        # First row whose bits end after the word's first bit (binary search over the ends).
        lo = tl.zeros([BLOCK_W], dtype=tl.int64)
        hi = tl.zeros([BLOCK_W], dtype=tl.int64) + rows
        for _ in range(n_iter):
            active = lo < hi
            mid = (lo + hi) // 2
            e = tl.load(ends_ptr + mid, mask=wmask & active, other=0)
            right = e > word_start
            hi = tl.where(active & right, mid, hi)
            lo = tl.where(active & ~right, mid + 1, lo)
        r0 = lo
    else:
        r0 = word_start // width
    acc = tl.zeros([BLOCK_W], dtype=tl.uint64)
    for k in range(ROWS_PER_WORD):
        r = r0 + k
        rmask = wmask & (r < rows)
        # The row's bits as a value of `length` bits: its id, or for REFS_FLAGGED the single
        # bit 1 (first occurrence) or a 0 bit then its id (repeat).
        v = tl.load(val_ptr + r, mask=rmask, other=0)
        if FLAGGED:
            pos = tl.load(ends_ptr + r - 1, mask=rmask & (r > 0), other=0)
            length = tl.load(ends_ptr + r, mask=rmask, other=0) - pos
        else:
            length = tl.zeros([BLOCK_W], dtype=tl.int64) + width
            pos = r * width
        off = pos - word_start  # the row's first bit relative to the word's first bit
        overlap = rmask & (off < 32) & (off + length > 0)
        shift = 32 - off - length  # in [-32, 31] for overlapping rows
        val = v.to(tl.uint64)
        left = val << tl.where(overlap & (shift > 0), shift, 0).to(tl.uint64)
        right = val >> tl.where(overlap & (shift < 0), -shift, 0).to(tl.uint64)
        part = tl.where(shift >= 0, left, right) & 0xFFFFFFFF
        acc |= tl.where(overlap, part, 0)
    tl.store(out_ptr + w, acc.to(tl.uint32).to(tl.int32, bitcast=True), mask=wmask)


def pack_refs(ids: torch.Tensor, n_unique: int, mode: int) -> torch.Tensor:
    """Packs vector ids into words, bit-identical to ``host_kernels.pack_refs``.

    Args:
        ids: int32 [rows] ids numbered by first occurrence (as :func:`dedupe` returns them).
        n_unique: Distinct vectors.
        mode: REFS_FIXED or REFS_FLAGGED.

    Returns:
        int32 tensor of the uint32 words' bits, on the ids' device.
    """
    ids = ids.contiguous()
    rows = ids.shape[0]
    dev = ids.device
    width = int(ref_width(n_unique))
    n_words = (int(refs_bits(rows, n_unique, mode)) + 31) // 32
    out = torch.empty(n_words, dtype=torch.int32, device=dev)
    if n_words == 0:
        return out
    flagged = mode != REFS_FIXED
    if flagged:
        block = block_for(rows, 1024)
        lengths = torch.empty(rows, dtype=torch.int64, device=dev)
        vals = torch.empty(rows, dtype=torch.int32, device=dev)
        running_max = inclusive_scan(ids, SCAN_MAX)
        _flagged_len_kernel[(triton.cdiv(rows, block),)](
            ids, running_max, lengths, vals, rows, width, BLOCK=block
        )
        ends = inclusive_scan(lengths, SCAN_SUM)
        min_len = 1
    else:
        vals = ids
        ends = ids  # unused: fixed-width rows start at row * width
        min_len = width
    block_w = block_for(n_words, 256)
    _pack_refs_kernel[(triton.cdiv(n_words, block_w),)](
        vals,
        ends,
        out,
        rows,
        n_words,
        width,
        rows.bit_length() + 1,  # binary-search steps over rows + 1 candidates
        FLAGGED=flagged,
        ROWS_PER_WORD=32 // min_len + 2,
        BLOCK_W=block_w,
    )
    return out


# ------------------------------------------------------------------------------------------------
# Huffman


def histogram_rows(symbols: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Symbol counts over the selected rows of a [rows, dim] symbol matrix.

    Args:
        symbols: [rows, dim] int16 tensor of the uint16 symbols' bits.
        rows: int32 row indices, same device.

    Returns:
        int32 [ALPHABET_SIZE] counts on the symbols' device.
    """
    dev = symbols.device
    stream = symbols[rows.long()].reshape(-1)
    n = stream.shape[0]
    block = block_for(n, _HIST_BLOCK)
    tiles = torch.from_numpy(tile_table(np.array([n]), block)).to(dev)
    keep = torch.ones(n, dtype=torch.int32, device=dev)
    return histogram_tiles(stream, keep, tiles, 1, block).reshape(-1)


def encode(
    symbols: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    codes: torch.Tensor,
    chunk_symbols: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encodes the symbols of the selected rows into word-aligned chunks, like host_kernels.encode.

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
    dev = symbols.device
    stream = symbols[rows.long()].reshape(-1).to(torch.int32)
    n = stream.shape[0]
    lo = torch.arange(0, n, chunk_symbols, dtype=torch.int64, device=dev)
    hi = torch.clamp(lo + chunk_symbols, max=n)
    return encode_chunks(stream, lo, hi, torch.zeros_like(lo), lengths, codes, chunk_symbols)


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
    # One program per chunk, one symbol at a time: host_kernels.decode_kernel's loop, scalar for
    # scalar.
    c = tl.program_id(0).to(tl.int64)
    # Clamped to the stream so a corrupt chunk table cannot make a program read out of bounds
    # (the launcher reports the bad table itself).
    w = tl.minimum(tl.load(ends_ptr + c - 1, mask=c > 0, other=0), n_words).to(tl.int64)
    end = tl.minimum(tl.load(ends_ptr + c), n_words).to(tl.int64)
    i, status = decode_chunk(
        words_ptr,
        w,
        end,
        table_ptr,
        peek_shift,
        out_ptr,
        esc_ptr,
        c * chunk_symbols,
        n,
        chunk_symbols,
    )
    tl.store(status_ptr + c, status)
    tl.store(fail_ptr + c, i)  # where the chunk stopped: its end, or the symbol that failed


@triton.jit
def _escape_check_kernel(
    esc_ptr, rank_ptr, expected_ptr, bad_ptr, n, n_escapes, BLOCK: tl.constexpr
):
    # host_kernels.decode_kernel requires the k-th escape decoded to sit at escape_positions[k];
    # the first position breaking that is where it would have stopped.
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
    """Decodes and validates every chunk like ``host_kernels.decode_kernel``, without a sync.

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
        ``host_kernels.decode_kernel`` returns for the same input). The codebook check
        (DECODE_BAD_CODEBOOK) is the caller's: it built ``table``.
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
