"""The compiled host stages one block at a time, for tests: numpy in, numpy out.

Production runs each stage over every block of a batch at once (``host_compress``,
``host_decompress``); these wrappers call the same compiled kernels
(``quantize.quantize_blocks_kernel``, ``vector_lz.dedupe_blocks_kernel``,
``vector_lz.pack_refs_into``, ``huffman.encode_into``) on one block, so a test can compare a
block's stage with its torch twin (``*_reference``) and with the Triton launchers. The
plain-Python references of the Huffman coder and of the reference packing, and the one-block
decode helpers, are here too: only tests call them.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from torchrec_lossy.codec import huffman, vector_lz
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    ESCAPE_SYMBOL,
    MAX_CODE_LENGTH,
    REFS_FLAGGED,
    ref_width,
    words_for_bits,
)
from torchrec_lossy.codec.host_records import Blocks, Grids
from torchrec_lossy.codec.huffman import (
    canonical_codes_kernel,
    code_lengths_kernel,
    decode_range_kernel,
    unpack_codebook_into,
)
from torchrec_lossy.codec.quantize import NEAREST_KEY, quantize_blocks_kernel


def quantize_block(
    x: np.ndarray,
    step: np.float32,
    inv_step: np.float32,
    center: int,
    bound: float,
    dtype_code: int,
    sr_key: int = NEAREST_KEY,
    value: bool = False,
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """Quantizes one flat float32 block (``quantize_blocks_kernel`` on one block).

    Args:
        x: 1-D float32 values (exact copies of the block's fp32/fp16/bf16 values).
        step: Quantization step (float32).
        inv_step: float32 reciprocal of the step.
        center: Code of the block's midpoint (``qmax`` on the per-value grid).
        bound: Absolute bound (relative on the per-value grid), checked in float64.
        dtype_code: The block's dtype code (the reconstruction is rounded to it).
        sr_key: ``NEAREST_KEY`` or the block's stochastic-rounding key.
        value: The per-value grid.

    Returns:
        (uint16 symbols, int64 [ALPHABET_SIZE] histogram, escaped elements, max error over the
        elements not escaped; for ``value`` the max of ``|x - x'| / |x|``).
    """
    grids = Grids(
        np.array([step], np.float32),
        np.array([inv_step], np.float32),
        np.array([center], np.int64),
        np.ones(1, np.bool_),
        np.array([value], np.bool_),
    )
    symbols = np.empty(x.shape[0], np.uint16)
    max_err, _, _ = quantize_blocks_kernel(
        x,
        np.array([0, x.shape[0]], np.int64),
        grids,
        np.array([bound], np.float64),
        np.array([dtype_code], np.int64),
        np.array([sr_key], np.int64),
        symbols,
    )
    hist = np.bincount(symbols, minlength=ALPHABET_SIZE).astype(np.int64)
    return symbols, hist, int(hist[ESCAPE_SYMBOL]), float(max_err[0])


def histogram_rows(symbols: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Symbol counts over the selected rows of a uint16 [rows, dim] matrix.

    Args:
        symbols: uint16 [rows, dim].
        rows: int32 row indices.

    Returns:
        int64 [ALPHABET_SIZE].
    """
    selected = symbols[rows].reshape(-1)
    return np.bincount(selected, minlength=ALPHABET_SIZE).astype(np.int64)


def dedupe(symbols: np.ndarray | None, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Finds repeated rows of one block (``dedupe_blocks_kernel`` on one block).

    Args:
        symbols: [rows, dim] uint16 symbols, or None to compare raw bits only (lossless).
        bits: [rows, dim] int32 raw bits of the block's elements.

    Returns:
        (ids: int32 [rows], the distinct-vector id of each row, numbered by first occurrence;
        first_rows: int32 [n_unique], the row where each distinct vector first occurs).
    """
    rows, dim = bits.shape
    raw = symbols is None
    flat = np.zeros(rows * dim, np.uint16) if raw else symbols.reshape(-1)
    blocks = Blocks(
        np.array([rows], np.int64),
        np.array([dim], np.int64),
        np.array([4], np.int64),
        np.array([0, rows * dim], np.int64),
        np.array([0, rows], np.int64),
        np.arange(rows, dtype=np.int32),
    )
    ids, first = np.empty(rows, np.int32), np.empty(rows, np.int32)
    out = vector_lz.dedupe_blocks_kernel(
        flat, bits.reshape(-1), blocks, np.ones(1, np.bool_), raw, ids, first
    )
    return ids, first[: out.n_unique[0]].copy()


def pack_refs(ids: np.ndarray, n_unique: int, mode: int) -> np.ndarray:
    """Packs vector ids into words (``pack_refs_into`` on a fresh buffer).

    Args:
        ids: int32 [rows] ids numbered by first occurrence.
        n_unique: Distinct vectors.
        mode: REFS_FIXED or REFS_FLAGGED.

    Returns:
        uint32 words.
    """
    words = np.zeros((ids.shape[0] * 33 + 31) // 32 + 1, np.uint32)  # +1: writes may touch it
    return words[: vector_lz.pack_refs_into(ids, n_unique, mode, words)]


def encode(
    symbols: np.ndarray, rows: np.ndarray, lengths: np.ndarray, codes: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Encodes the symbols of the selected rows, in order, into word-aligned chunks
    (``encode_into`` on fresh buffers).

    Args:
        symbols: uint16 [rows, dim] symbols; every symbol encoded needs a nonzero code length.
        rows: int32 indices of the rows to encode (the distinct vectors, or every row).
        lengths: uint8 [ALPHABET_SIZE] code lengths.
        codes: uint32 [ALPHABET_SIZE] canonical codes.
        chunk: Symbols per chunk.

    Returns:
        (chunk_ends: uint32 [n_chunks], the end word of each chunk; words: uint32 bitstream).
    """
    n = rows.shape[0] * symbols.shape[1]
    n_chunks = (n + chunk - 1) // chunk
    chunk_ends = np.empty(n_chunks, np.uint32)
    words = np.empty((n * MAX_CODE_LENGTH + 31) // 32 + n_chunks, np.uint32)
    entry = huffman.code_entries(lengths, codes)
    w = huffman.encode_into(symbols, rows, entry, chunk, chunk_ends, words)
    return chunk_ends, words[:w]


def decode_reference(
    words: list[int], chunk_ends: list[int], n: int, chunk_symbols: int, lengths: torch.Tensor
) -> list[int]:
    """Bit-by-bit canonical Huffman decode (the test oracle).

    Args:
        words: uint32 words.
        chunk_ends: End word of each chunk.
        n: Number of symbols.
        chunk_symbols: Symbols per chunk.
        lengths: Code lengths.

    Returns:
        The symbols.
    """
    codes = canonical_codes_kernel.py_func(lengths.numpy().astype(np.uint8))
    by_code = {(int(lengths[s]), int(codes[s])): s for s in range(len(lengths)) if lengths[s] > 0}
    out: list[int] = []
    start = 0
    for c, end in enumerate(chunk_ends):
        bits = "".join(format(w, "032b") for w in words[start:end])
        pos = 0
        for _ in range(min(chunk_symbols, n - c * chunk_symbols)):
            length = 1
            while (length, int(bits[pos : pos + length] or "x", 2)) not in by_code:
                length += 1
                if length > MAX_CODE_LENGTH or pos + length > len(bits):
                    raise ValueError(f"no code at bit {pos} of chunk {c}")
            out.append(by_code[(length, int(bits[pos : pos + length], 2))])
            pos += length
        start = end
    return out


def encode_reference(
    symbols: torch.Tensor, lengths: torch.Tensor, codes: torch.Tensor, chunk_symbols: int
) -> tuple[list[int], list[int]]:
    """Plain-Python twin of :func:`encode_into` (the test oracle).

    Args:
        symbols: Symbols.
        lengths: Code lengths.
        codes: Canonical codes.
        chunk_symbols: Symbols per chunk.

    Returns:
        (chunk end words, uint32 words) as Python ints.
    """
    syms = symbols.tolist()
    chunk_ends: list[int] = []
    words: list[int] = []
    for c in range(0, len(syms), chunk_symbols):
        bits = "".join(
            format(int(codes[s]), f"0{int(lengths[s])}b") for s in syms[c : c + chunk_symbols]
        )
        bits += "0" * (-len(bits) % 32)
        words += [int(bits[k : k + 32], 2) for k in range(0, len(bits), 32)]
        chunk_ends.append(len(words))
    return chunk_ends, words


@numba.njit(cache=True, nogil=True)
def symbol_range_kernel(lengths: np.ndarray) -> tuple[int, int]:
    """(lowest used value symbol, span of used value symbols) of a code, escape excluded."""
    lo = -1
    hi = -1
    for s in range(ALPHABET_SIZE - 1):
        if lengths[s] > 0:
            if lo < 0:
                lo = s
            hi = s
    return (0, 0) if lo < 0 else (lo, hi - lo + 1)


@numba.njit(cache=True, nogil=True)
def plan_kernel(hist: np.ndarray) -> tuple[np.ndarray, int, int, int, int]:
    """Code lengths of a histogram and the sizes the encoder needs to choose a mode.

    Args:
        hist: int64 [ALPHABET_SIZE] symbol counts.

    Returns:
        (code lengths, encoded bits without chunk padding, number of symbols, lowest used value
        symbol, span of used value symbols).
    """
    lengths = code_lengths_kernel(hist)
    bits = 0
    n = 0
    for s in range(hist.shape[0]):
        bits += hist[s] * lengths[s]
        n += hist[s]
    lo, count = symbol_range_kernel(lengths)
    return lengths, bits, n, lo, count


@numba.njit(cache=True, nogil=True)
def expand_codebook_kernel(
    nibbles: np.ndarray, sym_lo: int, sym_count: int, escape_length: int
) -> np.ndarray:
    """Code lengths over the whole alphabet from the wire codebook.

    Args:
        nibbles: uint8 bytes, two 4-bit lengths each, low nibble first.
        sym_lo: First value symbol of the codebook.
        sym_count: Number of value symbols.
        escape_length: Code length of the escape symbol.

    Returns:
        uint8 [ALPHABET_SIZE] code lengths.
    """
    lengths = np.zeros(ALPHABET_SIZE, dtype=np.uint8)
    unpack_codebook_into(nibbles, sym_count, lengths[sym_lo:])
    lengths[ESCAPE_SYMBOL] = escape_length
    return lengths


@numba.njit(cache=True, nogil=True)
def decode_kernel(
    words: np.ndarray,
    chunk_ends: np.ndarray,
    chunk_symbols: int,
    lengths: np.ndarray,
    escape_positions: np.ndarray,
    out: np.ndarray,
) -> int:
    """Decodes every chunk, validating everything a corrupt stream could get wrong.

    Args:
        words: uint32 bitstream.
        chunk_ends: uint32 [n_chunks] end word of each chunk.
        chunk_symbols: Symbols per chunk (>= 1).
        lengths: uint8 [ALPHABET_SIZE] code lengths.
        escape_positions: uint32 positions where the escape symbol must decode, increasing.
        out: uint16 [n] output symbols.

    Returns:
        0, or one of the DECODE_* error codes.
    """
    return decode_range_kernel(words, chunk_ends, chunk_symbols, lengths, 0, escape_positions, out)


def pack_refs_reference(ids: torch.Tensor, n_unique: int, mode: int) -> torch.Tensor:
    """Plain-Python twin of :func:`pack_refs_into` (the test oracle).

    Args:
        ids: Vector id per row.
        n_unique: Distinct vectors.
        mode: REFS_FIXED or REFS_FLAGGED.

    Returns:
        int64 tensor of the uint32 words' values.
    """
    width = ref_width(n_unique)
    bits: list[int] = []
    seen = 0
    for v in ids.tolist():
        if mode == REFS_FLAGGED:
            bits.append(1 if v == seen else 0)
            if v == seen:
                seen += 1
                continue
        bits.extend((v >> (width - 1 - k)) & 1 for k in range(width))
    words = [0] * words_for_bits(len(bits))
    for i, b in enumerate(bits):
        words[i // 32] |= b << (31 - i % 32)
    return torch.tensor(words, dtype=torch.int64)
