"""The size model and the per-block mode choice, written once for the host and device paths.

Every function works element-wise on Python ints, numpy arrays or torch tensors (on any device,
without a sync) and compiles into numba kernels (``elementwise.jitable``): the batched host
kernel (``host_compress``) calls them per block, the device path (``device_compress``) over
``[n_blocks]`` tensors, so both choose the same mode from the same sizes by construction. Sizes
are in 32-bit words of a block's segment (docs/format.md).
"""

from __future__ import annotations

from torchrec_lossy.codec.elementwise import N, jitable, where
from torchrec_lossy.codec.format import (
    MODE_LZ,
    MODE_QUANT,
    MODE_QUANT_LZ,
    MODE_RAW,
    SEGMENT_HEADER_WORDS,
    refs_packing,
    words_for_bits,
    words_for_bytes,
)


@jitable
def escape_words(n_escapes: N, itemsize: N) -> N:
    """Words of the escape positions and escaped values.

    Args:
        n_escapes: Escaped elements.
        itemsize: Bytes per element of the block's dtype.

    Returns:
        Word count.
    """
    return n_escapes + words_for_bytes(n_escapes * itemsize)


@jitable
def code_words(n_symbols: N, code_bits: N, sym_count: N, chunk_symbols: int) -> N:
    """Words of a Huffman-coded stream: codebook, chunk table and bitstream.

    The chunk padding is estimated as half a word per chunk (only the mode choice uses it).

    Args:
        n_symbols: Symbols in the stream.
        code_bits: Bits of the coded symbols.
        sym_count: Value symbols in the codebook (4 bits each).
        chunk_symbols: Symbols per Huffman chunk.

    Returns:
        Estimated word count.
    """
    n_chunks = (n_symbols + chunk_symbols - 1) // chunk_symbols
    codebook = words_for_bytes((sym_count + 1) // 2)
    return codebook + n_chunks + words_for_bits(code_bits) + n_chunks // 2


@jitable
def quant_words(n_escapes: N, itemsize: N, coded_words: N) -> N:
    """Estimated segment words of mode quant.

    Args:
        n_escapes: Escaped elements.
        itemsize: Bytes per element.
        coded_words: :func:`code_words` of the block's symbols.

    Returns:
        Word count.
    """
    return SEGMENT_HEADER_WORDS + escape_words(n_escapes, itemsize) + coded_words


@jitable
def quant_lz_words(rows: N, n_unique: N, n_escapes: N, itemsize: N, coded_words: N) -> N:
    """Estimated segment words of mode quant+lz.

    Args:
        rows: Rows of the block.
        n_unique: Distinct quantized vectors.
        n_escapes: Escaped elements among the distinct vectors.
        itemsize: Bytes per element.
        coded_words: :func:`code_words` of the distinct vectors' symbols.

    Returns:
        Word count.
    """
    ref_bits = refs_packing(rows, n_unique)[2]
    return (
        SEGMENT_HEADER_WORDS
        + words_for_bits(ref_bits)
        + escape_words(n_escapes, itemsize)
        + coded_words
    )


@jitable
def lossless_lz_words(rows: N, n_unique: N, dim: N, itemsize: N) -> N:
    """Segment words of mode lz (lossless vector-LZ).

    Args:
        rows: Rows of the block.
        n_unique: Distinct raw vectors.
        dim: Columns.
        itemsize: Bytes per element.

    Returns:
        Word count.
    """
    return (
        SEGMENT_HEADER_WORDS
        + words_for_bits(refs_packing(rows, n_unique)[2])
        + words_for_bytes(n_unique * dim * itemsize)
    )


@jitable
def choose_lossy(
    raw_words: N, quant_ok: N, quant_w: N, quant_lz_ok: N, quant_lz_w: N
) -> tuple[N, N]:
    """The best of raw, quant and quant+lz (the earlier wins a tie).

    Args:
        raw_words: Words of the raw segment.
        quant_ok: Whether the block can be quantized.
        quant_w: :func:`quant_words` (any value where not ``quant_ok``).
        quant_lz_ok: Whether quant+lz applies (quantized, LZ allowed, some row repeats).
        quant_lz_w: :func:`quant_lz_words` (any value where not ``quant_lz_ok``).

    Returns:
        (mode, its words).
    """
    better = quant_ok & (quant_w < raw_words)
    mode = where(better, MODE_QUANT, MODE_RAW)
    best = where(better, quant_w, raw_words)
    better = quant_lz_ok & (quant_lz_w < best)
    return where(better, MODE_QUANT_LZ, mode), where(better, quant_lz_w, best)


@jitable
def lossless_may_win(lz_allowed: N, rows: N, dim: N, itemsize: N, n_unique_lower: N, best: N) -> N:
    """Whether the lossless dedupe is worth running: its smallest possible size beats ``best``.

    Args:
        lz_allowed: LZ enabled and more than one row.
        rows: Rows.
        dim: Columns.
        itemsize: Bytes per element.
        n_unique_lower: A lower bound on the distinct raw vectors (the quantized count when the
            block was quantized and deduped: raw-identical rows are quantized-identical; else 1).
        best: Words of the best mode so far (:func:`choose_lossy`).

    Returns:
        Whether to dedupe the raw rows.
    """
    return lz_allowed & (lossless_lz_words(rows, n_unique_lower, dim, itemsize) < best)


@jitable
def choose_lossless(mode: N, best: N, tried: N, lossless_w: N, numel: N) -> N:
    """The final mode: lz where it was tried and is strictly smaller.

    Args:
        mode: From :func:`choose_lossy`.
        best: Its words.
        tried: :func:`lossless_may_win`.
        lossless_w: :func:`lossless_lz_words` of the raw distinct count (any value where not
            tried).
        numel: Elements of the block (an empty block stays raw).

    Returns:
        The mode.
    """
    return where(tried & (lossless_w < best) & (numel > 0), MODE_LZ, mode)
