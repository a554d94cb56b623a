"""Wire format of a compressed payload (specified in docs/format.md).

A payload is a sequence of little-endian 32-bit words::

    header (32 B) | block descriptors (24 B each) | block segments (4-byte aligned each)

The header carries a magic, the format version, the block count, the body length and a checksum
of the body (everything after the header). Each descriptor names its block's shape, dtype,
encoding mode, bound and segment length, so a decoder can find every segment without parsing the
others. Encoded segments start with a 32-byte :data:`SEGMENT_HEADER`; their sections are listed in
docs/format.md.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from torchrec_lossy.codec.elementwise import (
    N,
    bit_length,
    clamp_min,
    float32_bits,
    float32_from_bits,
    isfinite,
    jitable,
    where,
)

MAGIC = 0x434C5254  # b"TRLC" read as a little-endian uint32
VERSION = 1

# Huffman alphabet: symbol = q - center + SYMBOL_OFFSET for |q - center| <= SYMBOL_OFFSET; the
# last symbol escapes an element whose value travels verbatim.
MAX_CODE_LENGTH = 12
ALPHABET_SIZE = 1 << MAX_CODE_LENGTH
ESCAPE_SYMBOL = ALPHABET_SIZE - 1
SYMBOL_OFFSET = (ALPHABET_SIZE - 2) // 2  # symbols 0 .. 2 * SYMBOL_OFFSET are values
# |center| stays below this so that float32(q) is exact for every q the alphabet can express.
MAX_CENTER = (1 << 24) - ALPHABET_SIZE

# Block encoding modes: bit 0 = vector-LZ (repeated vectors sent once), bit 1 = quantized.
MODE_RAW = 0
MODE_LZ = 1
MODE_QUANT = 2
MODE_QUANT_LZ = 3
MODE_NAMES = {MODE_RAW: "raw", MODE_LZ: "lz", MODE_QUANT: "quant", MODE_QUANT_LZ: "quant+lz"}
# Bit 2 of a quantized block's descriptor mode: the codes are on the per-value relative grid
# (``quantize.value_code``; the segment header's step is 2**-m, its center the block's largest
# code qmax). Never set on raw / lz blocks; the stats report the mode without it.
MODE_VALUE = 4


@jitable
def mode_valid(mode: N) -> N:
    """Whether a descriptor's mode byte is one a decoder reads.

    Args:
        mode: Descriptor mode bytes.

    Returns:
        True for 0..3, and 6, 7 (quantized on the per-value grid).
    """
    return (mode <= MODE_QUANT_LZ) | ((mode >= MODE_VALUE | MODE_QUANT) & (mode <= 7))


# How the row -> distinct-vector references of an LZ block are packed.
REFS_FIXED = 0  # every row: its vector id in ref_width bits
REFS_FLAGGED = 1  # every row: 1 flag bit (1 = first occurrence); repeats add their id

# Huffman decode errors, shared by the CPU kernel and the Triton kernels (0 = success).
DECODE_INVALID_CODE = -1
DECODE_OUT_OF_BITS = -2
DECODE_BAD_CHUNK_TABLE = -3
DECODE_BAD_ESCAPES = -4
DECODE_BAD_CODEBOOK = -5
DECODE_ERRORS = {
    DECODE_INVALID_CODE: "a bit pattern that no code starts with",
    DECODE_OUT_OF_BITS: "a chunk runs out of bits",
    DECODE_BAD_CHUNK_TABLE: "the chunk table decreases or does not end at the bitstream's end",
    DECODE_BAD_ESCAPES: "escape positions disagree with the escape symbols",
    DECODE_BAD_CODEBOOK: "code lengths over the limit or a Kraft sum over 1",
}
# Device block status for invalid vector references (the Triton decoder's, beside DECODE_*).
REFS_OUT_OF_RANGE = 1

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}
# Integer views that carry each float dtype's bits verbatim.
BITS_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}

HEADER = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("flags", "<u2"),
        ("n_blocks", "<u4"),
        ("reserved", "<u4"),
        ("body_words", "<u8"),
        ("checksum", "<u8"),
    ]
)
DESCRIPTOR = np.dtype(
    [
        ("rows", "<u4"),
        ("dim", "<u4"),
        ("dtype", "u1"),
        ("mode", "u1"),
        ("reserved", "<u2"),
        ("seg_words", "<u4"),
        ("bound", "<f8"),
    ]
)
SEGMENT_HEADER = np.dtype(
    [
        ("step", "<f4"),
        ("center", "<i4"),
        ("n_unique", "<u4"),
        ("n_escapes", "<u4"),
        ("chunk_symbols", "<u4"),
        ("n_chunks", "<u4"),
        ("sym_lo", "<u2"),
        ("sym_count", "<u2"),
        ("escape_length", "u1"),
        ("ref_mode", "u1"),
        ("ref_width", "u1"),
        ("reserved", "u1"),
    ]
)
assert HEADER.itemsize == 32 and DESCRIPTOR.itemsize == 24 and SEGMENT_HEADER.itemsize == 32
# Words of each record (every section of a payload is word-aligned).
HEADER_WORDS = HEADER.itemsize // 4
DESCRIPTOR_WORDS = DESCRIPTOR.itemsize // 4
SEGMENT_HEADER_WORDS = SEGMENT_HEADER.itemsize // 4


class CodecError(ValueError):
    """A payload cannot be decoded: truncated, corrupted, or not a torchrec-lossy payload."""


# The segment header as words: the one writer and reader of every path (the host encoder and
# decoder per block on numba scalars, the device encoder over all blocks' [n] tensors).
_M32 = 0xFFFFFFFF


@jitable
def segment_header_words(fields: tuple) -> tuple:
    """The ``SEGMENT_HEADER`` record's eight words from its fields.

    Args:
        fields: The fields in ``SEGMENT_HEADER`` order, ``reserved`` left out (0), as
            :func:`segment_header_fields` returns them: ``step`` a float (written as float32),
            the rest ints in their field's range. Ints, numba scalars or tensors [n].

    Returns:
        The words, in order, as ints in [0, 2**32) (int64 tensors for tensor fields).
    """
    step, center, n_unique, n_esc, chunk_symbols, n_chunks, lo, count, esc_len = fields[:9]
    ref_mode, width = fields[9], fields[10]
    return (
        float32_bits(step),
        center & _M32,
        n_unique & _M32,
        n_esc & _M32,
        chunk_symbols & _M32,
        n_chunks & _M32,
        (lo & 0xFFFF) | ((count & 0xFFFF) << 16),
        (esc_len & 0xFF) | ((ref_mode & 0xFF) << 8) | ((width & 0xFF) << 16),
    )


@jitable
def segment_header_fields(words: tuple) -> tuple:
    """The mirror of :func:`segment_header_words`: a segment header's fields from its words.

    Args:
        words: Its eight words (uint32 or non-negative ints; an array, a tuple of tensors).

    Returns:
        The fields in ``SEGMENT_HEADER`` order but ``reserved``, as :func:`segment_layout`
        takes them: ``step`` float32, the rest int64.
    """
    center = words[1] & _M32
    lo_count, len_mode_width = words[6] & _M32, words[7] & _M32
    return (
        float32_from_bits(words[0]),
        center - ((center >> 31) << 32),  # int32
        words[2] & _M32,
        words[3] & _M32,
        words[4] & _M32,
        words[5] & _M32,
        lo_count & 0xFFFF,
        lo_count >> 16,
        len_mode_width & 0xFF,
        (len_mode_width >> 8) & 0xFF,
        (len_mode_width >> 16) & 0xFF,
    )


@numba.njit(cache=True, nogil=True, inline="always")
def read_segment_header(words: np.ndarray, at: int) -> tuple:
    """The segment header at word ``at`` of ``words`` (uint32): :func:`segment_header_fields`."""
    return segment_header_fields(words[at : at + SEGMENT_HEADER_WORDS])


@numba.njit(cache=True, nogil=True, inline="always")
def write_segment_header(words: np.ndarray, at: int, fields: tuple) -> int:
    """Writes a segment header (:func:`segment_header_words` of ``fields``) at word ``at`` of
    ``words`` (uint32); -> the word after it."""
    head = segment_header_words(fields)
    for k in range(SEGMENT_HEADER_WORDS):
        words[at + k] = head[k]
    return at + SEGMENT_HEADER_WORDS


@jitable
def words_for_bytes(n_bytes: int) -> int:
    """``ceil(n_bytes / 4)``: the 32-bit words that hold ``n_bytes`` bytes (sections are
    word-aligned)."""
    return (n_bytes + 3) // 4


@jitable
def words_for_bits(n_bits: int) -> int:
    """``ceil(n_bits / 32)``: the 32-bit words that hold ``n_bits`` bits."""
    return (n_bits + 31) // 32


@numba.njit(cache=True, nogil=True)
def checksum_words(words: np.ndarray) -> np.uint64:
    """Position-weighted sum of 32-bit words modulo 2**64.

    Every single-bit flip changes the sum (each weight ``2 i + 1`` is odd), swapped words change
    it too, and the sum parallelises as a plain reduction on a GPU.

    Args:
        words: 1-D uint32 array.

    Returns:
        The checksum.
    """
    acc = np.uint64(0)
    for i in range(words.shape[0]):
        acc += np.uint64(words[i]) * np.uint64(2 * i + 1)
    return acc


# The references of a vector-LZ block (``rows`` row -> distinct-vector ids): the one rule every
# backend's encoder, decoder and size model uses. Element-wise and numba-compilable.


@jitable
def ref_width(n_unique: N) -> N:
    """Bits per vector id.

    Args:
        n_unique: Distinct vectors of a block (>= 1).

    Returns:
        ``bit_length(n_unique - 1)``.
    """
    return bit_length(clamp_min(n_unique - 1, 0))


@jitable
def refs_bits(rows: N, n_unique: N, mode: N) -> N:
    """Bits of a block's references in the given packing.

    Args:
        rows: Rows of the block.
        n_unique: Distinct vectors (>= 1).
        mode: REFS_FIXED, else REFS_FLAGGED is assumed.

    Returns:
        Bit count.
    """
    width = ref_width(n_unique)
    return where(mode == REFS_FIXED, rows * width, rows + (rows - n_unique) * width)


@jitable
def refs_packing(rows: N, n_unique: N) -> tuple[N, N, N]:
    """The cheaper reference packing of blocks with ``n_unique`` distinct vectors.

    Args:
        rows: Rows per block.
        n_unique: Distinct vectors per block (>= 1).

    Returns:
        (packing: REFS_FIXED on a tie, else REFS_FLAGGED; id width; bits of that packing).
    """
    width = ref_width(n_unique)
    fixed = rows * width
    flagged = rows + (rows - n_unique) * width
    return (
        where(fixed > flagged, REFS_FLAGGED, REFS_FIXED),
        width,
        where(fixed > flagged, flagged, fixed),
    )


@jitable
def segment_layout(desc: tuple, header: tuple) -> tuple:
    """Where each section of a block's segment lies, and whether the segment is well-formed.

    The one reading of docs/format.md's segment layout that the batched host decoder (per
    block, compiled) and the device decoder's planner (over ``[n_blocks]`` arrays) use; for a
    block it rejects, the host decoder (``host_decompress``) names the check that failed.
    Element-wise over ints, numpy arrays, torch tensors and numba scalars.

    Args:
        desc: (mode, rows, dim, bytes per element, segment words) of the block's descriptor.
        header: The segment header's fields in ``SEGMENT_HEADER`` order (int64 but ``step``;
            any values for a raw block, which has no header).

    Returns:
        (well-formed; vectors sent; reference words; codebook words; offset of the escape
        positions; of the chunk table; of the bitstream), offsets in words from the segment's
        start. Only ``well-formed`` is meaningful where it is False.
    """
    mode, rows, dim, itemsize, seg = desc
    step, center, n_unique, n_esc, chunk_symbols, n_chunks, lo, count, esc_len = header[:9]
    ref_mode, width = header[9], header[10]
    head = SEGMENT_HEADER_WORDS
    lz = (mode & 1) == 1
    nu_ok = (n_unique >= 1) & (n_unique <= rows)
    nu = where(lz & nu_ok, n_unique, rows)  # clipped, so the sizes below stay small
    refs_ok = nu_ok & (width == ref_width(nu)) & (ref_mode <= REFS_FLAGGED)
    ref_words = where(lz, words_for_bits(refs_bits(rows, nu, ref_mode)), 0)
    n_sym = nu * dim
    cb_words = words_for_bytes((count + 1) // 2)
    esc_pos_off = head + cb_words + ref_words
    ct_off = esc_pos_off + n_esc + words_for_bytes(n_esc * itemsize)
    bs_off = ct_off + n_chunks
    lz_ok = refs_ok & (seg == head + ref_words + words_for_bytes(n_sym * itemsize))
    # The per-value grid (MODE_VALUE): step 2**-m for m in 0..23, center qmax >= 0.
    value = (mode & MODE_VALUE) == MODE_VALUE
    value_ok = (step >= 2.0**-23) & (step <= 1.0) & (center >= 0)
    q_ok = isfinite(step) & (step > 0) & where(value, value_ok, abs(center) <= MAX_CENTER)
    q_ok = q_ok & (lo + count <= ESCAPE_SYMBOL) & (esc_len <= MAX_CODE_LENGTH)
    q_ok = q_ok & where(lz, refs_ok, n_unique == rows) & (n_esc <= n_sym) & (chunk_symbols >= 1)
    q_ok = q_ok & (n_chunks == -(-n_sym // clamp_min(chunk_symbols, 1))) & (bs_off <= seg)
    ok = where(mode == MODE_RAW, seg == words_for_bytes(rows * dim * itemsize), seg >= head)
    ok = ok & where((mode & 2) == 2, q_ok, where(lz, lz_ok, True))
    return ok, nu, ref_words, cb_words, esc_pos_off, ct_off, bs_off
