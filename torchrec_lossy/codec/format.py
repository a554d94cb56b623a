"""Wire format of a compressed payload (specified in docs/format.md).

A payload is a sequence of little-endian 32-bit words::

    header (32 B) | block descriptors (24 B each) | block segments (4-byte aligned each)

Each descriptor gives its segment's length, so a decoder finds every segment without parsing the
others. Fields live in the record dtypes (:data:`HEADER`, :data:`DESCRIPTOR`,
:data:`SEGMENT_HEADER`): every writer fills them, none hard-codes a word offset.
"""

from __future__ import annotations

from collections.abc import Mapping

import numba
import numpy as np
import torch

from torchrec_lossy.codec.elementwise import (
    N,
    binary_exponent,
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
# (:func:`value_code`; the segment header's step is 2**-m, its center the block's largest
# code qmax). Never set on raw / lz blocks; the stats report the mode without it.
MODE_VALUE = 4
# Bit 3 of a quantized block's descriptor mode: its codes are packed (``CodecConfig.format``
# "packed"; docs/format.md, "Packed segments"): fixed-width zigzag codes per group of
# PACKED_GROUP values instead of a Huffman stream. A decoder that predates it rejects the mode.
MODE_PACKED = 8
# Header flags bit 0: the payload was written in the packed format (its quantized blocks are
# packed). Informative: a decoder reads each block by its mode; routing reads it without
# parsing the descriptors.
FLAG_PACKED = 1
PACKED_GROUP = 32  # values per width byte: a group of width w takes exactly w words
# The widest code: zigzag of a symbol's offset from SYMBOL_OFFSET (|offset| <= SYMBOL_OFFSET);
# wider is a corrupt width (an element the alphabet cannot hold is escaped, never packed).
PACKED_MAX_WIDTH = MAX_CODE_LENGTH


@jitable
def mode_valid(mode: N) -> N:
    """Whether a descriptor's mode byte is one a decoder reads.

    Args:
        mode: Descriptor mode bytes.

    Returns:
        True for 0..3, 6, 7 (quantized on the per-value grid) and those quantized modes with
        ``MODE_PACKED`` (10, 11, 14, 15).
    """
    base = mode & ~MODE_PACKED
    packed_ok = ((mode & MODE_PACKED) == 0) | ((mode & MODE_QUANT) != 0)
    valid = (base <= MODE_QUANT_LZ) | ((base >= MODE_VALUE | MODE_QUANT) & (base <= 7))
    return valid & packed_ok & (mode <= 15)


@jitable
def zigzag(symbols: N) -> N:
    """Packed codes of symbols: the zigzag of ``symbol - SYMBOL_OFFSET`` (0, -1, 1, -2, ..
    -> 0, 1, 2, 3, ..), so symbols near the center take few bits. Ints, arrays, tensors.

    Args:
        symbols: Value symbols (0 .. 2 * SYMBOL_OFFSET).

    Returns:
        The codes, in 0 .. 2 * SYMBOL_OFFSET (12 bits).
    """
    s = symbols - SYMBOL_OFFSET
    return where(s < 0, -2 * s - 1, 2 * s)


@jitable
def unzigzag(codes: N) -> N:
    """Symbols of packed codes (the mirror of :func:`zigzag`); a code above
    ``2 * SYMBOL_OFFSET`` gives a symbol outside the values (the decoder rejects it).

    Args:
        codes: Non-negative codes.

    Returns:
        The symbols.
    """
    half = codes >> 1
    return SYMBOL_OFFSET + where((codes & 1) == 1, -half - 1, half)


@jitable
def descriptor_mode(mode: N, value_grid: N) -> N:
    """The mode byte an encoder writes: ``MODE_VALUE`` added where a quantized block's codes
    are on the per-value grid (raw / lz blocks never carry it).

    Args:
        mode: The blocks' ``MODE_*`` as sent (0..3).
        value_grid: Nonzero where the block's bound is per-value.

    Returns:
        The descriptor mode bytes.
    """
    return where(((mode & MODE_QUANT) != 0) & (value_grid != 0), mode | MODE_VALUE, mode)


# Stochastic rounding's constants, shared by every backend: the draw is u = (hash >> 8) * 2**-24
# (24 bits, exact in float32); NEAREST_KEY is the ``sr_key`` of round-to-nearest.
NEAREST_KEY = -1  # stochastic keys are in [0, 2**32)
U_SCALE = 2.0**-24


# The per-value relative grid (``ErrorBound(mode="value")``): its symbol rules below are shared
# by every backend so that all write the same bytes (``codec.quantize`` compiles them into its
# numba kernels and runs them over numpy arrays, ``kernels/quantize_ref.py`` runs them on torch
# tensors, ``kernels/quantize.py`` has their Triton twins). Integer-only: keep m mantissa bits of
# |x|'s float32, rounded to nearest (the carry into the exponent is the right rounding), so
# |x' - x| <= 2**-(m + 1) |x| for normal values; what that misses (denormals, overflow, the cast
# to fp16 / bf16) fails the float64 check and is escaped. Symbol of x: SYMBOL_OFFSET + sign(x)
# (qmax - q + 1), counted down from the block's largest code qmax, so the large values, which
# every block has, sit next to the symbol of +0.0 (SYMBOL_OFFSET) and the codebook spans the
# block's octaves, not the whole alphabet; codes SYMBOL_OFFSET or more below qmax are escaped.


@jitable
def value_code(mag_bits: N, shift: N) -> N:
    """Codes of magnitudes: float32 bits of ``|x|`` rounded to nearest to a multiple of
    ``2**shift`` and divided by it (``shift = 23 - m``). Integers: ints, arrays, tensors.

    Args:
        mag_bits: float32 bits of ``|x|`` (non-negative, < 2**31).
        shift: ``23 - m``.

    Returns:
        The codes q.
    """
    return (mag_bits + ((1 << shift) >> 1)) >> shift


@jitable
def value_symbol(bits: N, shift: N, qmax: N) -> tuple[N, N]:
    """Symbols of float32 values on the per-value grid, and their reconstructions' bits.

    Args:
        bits: float32 bits of the values as non-negative ints (< 2**32).
        shift: ``23 - m``.
        qmax: The block's largest code (of its largest finite ``|x|``).

    Returns:
        (symbol, ``ESCAPE_SYMBOL`` where a code does not fit (``-0.0`` included: it would
        decode as ``+0.0``); float32 bits of the reconstruction ``sign * (q << shift)``, as
        non-negative ints). The caller still escapes what fails the float64 check.
    """
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    q = value_code(mag, shift)
    d = qmax - q  # < 0 only for non-finite values
    fits = where(mag == 0, sign == 0, (d >= 0) & (d < SYMBOL_OFFSET))
    sym = SYMBOL_OFFSET + where(mag == 0, 0, where(sign == 0, d + 1, -d - 1))
    return where(fits, sym, ESCAPE_SYMBOL), ((q << shift) & 0x7FFFFFFF) | sign


@jitable
def value_decode_bits(symbols: N, shift: N, qmax: N) -> N:
    """float32 bits of the values of per-value-grid symbols (the decoder's half of
    :func:`value_symbol`; any symbol maps to some bits, so a corrupt stream cannot crash it).

    Args:
        symbols: Symbols (ints, arrays or tensors).
        shift: ``23 - m``.
        qmax: The block's largest code.

    Returns:
        float32 bits as non-negative ints.
    """
    s = symbols - SYMBOL_OFFSET
    q = qmax + 1 - where(s < 0, -s, s)
    mag = where((s == 0) | (q < 0), 0, (q << shift) & 0x7FFFFFFF)
    return mag | where(s < 0, 0x80000000, 0)


@jitable
def value_shift(step: float) -> int:
    """``23 - m`` from a segment header's step ``2**-m`` (its binary exponent; any step a
    decoder accepts, in [2**-23, 1], gives a shift in 0..23).

    Args:
        step: The segment header's step.

    Returns:
        The shift.
    """
    return 22 + binary_exponent(step)  # step = 0.5 * 2**(1 - m) exactly


# How the row -> distinct-vector references of an LZ block are packed.
REFS_FIXED = 0  # every row: its vector id in ref_width bits
REFS_FLAGGED = 1  # every row: 1 flag bit (1 = first occurrence); repeats add their id

# Huffman decode errors, shared by the CPU kernel and the Triton kernels (0 = success).
DECODE_INVALID_CODE = -1
DECODE_OUT_OF_BITS = -2
DECODE_BAD_CHUNK_TABLE = -3
DECODE_BAD_ESCAPES = -4
DECODE_BAD_CODEBOOK = -5
DECODE_BAD_WIDTH = -6  # a packed group's width over PACKED_MAX_WIDTH, or widths past the stream
DECODE_BAD_CHECKSUM = -7  # a packed block's checksum
DECODE_BAD_PACKED_CODE = -8  # a packed code that is no value symbol
DECODE_BAD_PACKED_ESCAPES = -9  # packed escape positions
# The packed decoder's statuses (their message says "packed codes", the others' "Huffman").
PACKED_DECODE_ERRORS = (
    DECODE_BAD_WIDTH, DECODE_BAD_CHECKSUM, DECODE_BAD_PACKED_CODE, DECODE_BAD_PACKED_ESCAPES,
)  # fmt: skip
DECODE_ERRORS = {
    DECODE_INVALID_CODE: "a bit pattern that no code starts with",
    DECODE_OUT_OF_BITS: "a chunk runs out of bits",
    DECODE_BAD_CHUNK_TABLE: "the chunk table decreases or does not end at the bitstream's end",
    DECODE_BAD_ESCAPES: "escape positions disagree with the escape symbols",
    DECODE_BAD_CODEBOOK: "code lengths over the limit or a Kraft sum over 1",
    DECODE_BAD_WIDTH: "a packed group's width is over 12 bits or the widths do not add up "
    "to the packed codes' words",
    DECODE_BAD_CHECKSUM: "the block's checksum does not match its words",
    DECODE_BAD_PACKED_CODE: "a code that is no value symbol",
    DECODE_BAD_PACKED_ESCAPES: "escape positions not increasing, past the block's values or "
    "over a nonzero code",
}
# Device block status for invalid vector references (the Triton decoder's, beside DECODE_*).
REFS_OUT_OF_RANGE = 1
# A segment's verdicts: its checks, in the order its sections are read (wire order), each
# with four integer details (unused ones 0) that ``container.segment_error`` puts in its message
# (the first detail is a SECTIONS index for a truncated section, the step's float32 bits for the
# grids, the Huffman decoder's DECODE_* status for the stream). :func:`segment_checks` makes them.
(
    SEGMENT_OK, SEGMENT_TRUNCATED, SEGMENT_TRAILING, SEGMENT_BAD_REFS, SEGMENT_BAD_PACKING,
    SEGMENT_REFS_RANGE, SEGMENT_BAD_VALUE_GRID, SEGMENT_BAD_GRID, SEGMENT_BAD_CODEBOOK,
    SEGMENT_BAD_VECTORS, SEGMENT_BAD_ESCAPES, SEGMENT_BAD_CHUNKS, SEGMENT_BAD_STREAM,
) = range(13)  # fmt: skip
# A segment's sections in wire order (SEGMENT_TRUNCATED's first detail indexes them).
SECTIONS = (
    "raw values", "segment header", "codebook", "references", "distinct vectors",
    "escape positions", "escaped values", "chunk table",
)  # fmt: skip
(
    SECTION_RAW, SECTION_HEADER, SECTION_CODEBOOK, SECTION_REFS, SECTION_VECTORS,
    SECTION_ESC_POS, SECTION_ESC_VALUES, SECTION_CHUNKS,
) = range(len(SECTIONS))  # fmt: skip

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}
FLOAT32_CODE = DTYPE_CODES[torch.float32]
FLOAT16_CODE = DTYPE_CODES[torch.float16]
BFLOAT16_CODE = DTYPE_CODES[torch.bfloat16]


@jitable
def dtype_itemsize(dtype_code: N) -> N:
    """Bytes per element of ``DTYPE_CODES`` codes (compiled code cannot read the dict).

    Args:
        dtype_code: Valid dtype codes: ints, arrays or tensors.

    Returns:
        4 for float32, 2 for the 16-bit dtypes.
    """
    return 2 + 2 * (dtype_code == FLOAT32_CODE)


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


def pack_records(record: np.dtype, fields: Mapping[str, torch.Tensor | int]) -> torch.Tensor:
    """Packs records of a ``format`` structured dtype into little-endian 32-bit words.

    The field layout (offsets, sizes) comes from ``record`` itself, so the device path writes
    exactly the bytes a numpy structured array would.

    Args:
        record: ``format.HEADER``, ``DESCRIPTOR`` or ``SEGMENT_HEADER``.
        fields: Field name to its raw bits as an int64 tensor [n] (floats passed as their bit
            pattern, signed values as two's complement) or a Python int; fields left out are 0.
            At least one value must be a tensor (it gives ``n`` and the device).

    Returns:
        int64 [n, record.itemsize // 4] words, each in [0, 2**32).
    """
    unknown = set(fields) - set(record.names)
    if unknown:
        raise ValueError(f"fields {sorted(unknown)} are not in the record {record.names}")
    ref = next(v for v in fields.values() if isinstance(v, torch.Tensor))
    # Per word: its constant bits (the int fields) and its tensor terms, OR-ed (disjoint bits)
    # into one column each, so the record costs a few element-wise ops per tensor field.
    const = [0] * (record.itemsize // 4)
    terms: list[torch.Tensor | None] = [None] * len(const)

    def add(word: int, part: torch.Tensor | int) -> None:
        if isinstance(part, int):
            const[word] |= part
        else:
            terms[word] = part if terms[word] is None else terms[word] | part

    for name, value in fields.items():
        field_dtype, offset = record.fields[name][:2]
        size = field_dtype.itemsize
        word, shift = divmod(offset, 4)
        v = value.to(torch.int64) if isinstance(value, torch.Tensor) else value
        if size == 8:
            add(word, v & _M32)
            add(word + 1, (v >> 32) & _M32)
        else:
            part = v & ((1 << (8 * size)) - 1)
            add(word, part << (8 * shift) if shift else part)
    cols = [
        torch.full_like(ref, c, dtype=torch.int64) if t is None else (t | c if c else t)
        for t, c in zip(terms, const, strict=True)
    ]
    return torch.stack(cols, dim=1)


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
def _refs_sizes(rows: N, n_unique: N) -> tuple[N, N, N]:
    """(id width, bits of the references packed REFS_FIXED, packed REFS_FLAGGED)."""
    width = ref_width(n_unique)
    return width, rows * width, rows + (rows - n_unique) * width


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
    _, fixed, flagged = _refs_sizes(rows, n_unique)
    return where(mode == REFS_FIXED, fixed, flagged)


@jitable
def refs_packing(rows: N, n_unique: N) -> tuple[N, N, N]:
    """The cheaper reference packing of blocks with ``n_unique`` distinct vectors.

    Args:
        rows: Rows per block.
        n_unique: Distinct vectors per block (>= 1).

    Returns:
        (packing: REFS_FIXED on a tie, else REFS_FLAGGED; id width; bits of that packing).
    """
    width, fixed, flagged = _refs_sizes(rows, n_unique)
    flag = fixed > flagged
    return where(flag, REFS_FLAGGED, REFS_FIXED), width, where(flag, flagged, fixed)


def reference_words(
    pos: torch.Tensor, r_len: torch.Tensor, r_val: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """References written MSB-first: value ``r_val`` in ``r_len`` bits at bit ``pos`` of a
    block's references spans at most two words.

    Returns:
        (its first word in the references, that word's bits, the next word's bits, whether it
        spills into the next word).
    """
    end = pos % 32 + r_len
    head = torch.where(
        end <= 32, r_val << (32 - end).clamp(min=0), r_val >> (end - 32).clamp(min=0)
    )
    tail = (r_val << (64 - end).clamp(0, 63)) & _M32
    return pos // 32, head & _M32, tail, end > 32


@jitable
def segment_checks(desc: tuple, header: tuple) -> tuple[tuple, tuple]:
    """Every check of a block's segment that its fields decide, in wire order, and where its
    sections lie (docs/format.md).

    The one statement of what a well-formed segment is: a decoder's fast path takes "all
    pass" (:func:`segment_layout`), the host decoder names a rejected block's error by the
    first that fails (a section's fields are checked before the section is taken), with the
    two checks that need the data where they lie in wire order: the entries whose status is
    ``SEGMENT_REFS_RANGE`` (the references' ids, vector-LZ blocks) and ``SEGMENT_BAD_STREAM``
    (the Huffman stream's decode, quantized blocks) always pass here. Element-wise over ints,
    numpy arrays, torch tensors and numba scalars.

    Args:
        desc: (mode, rows, dim, bytes per element, segment words) of the block's descriptor.
        header: The segment header's fields in ``SEGMENT_HEADER`` order (int64 but ``step``;
            zeros for a raw block, which has no header).

    Returns:
        (one (passes, ``SEGMENT_*`` status, its four details) per check; the sections: vectors
        sent, offset of the references, reference words, codebook words, offset of the escape
        positions, of the chunk table, of the bitstream, offsets in words from the segment's
        start, only meaningful where every check passes).
    """
    mode, rows, dim, itemsize, seg = desc
    step, center, n_unique, n_esc, chunk, n_chunks, lo, count, esc_len = header[:9]
    ref_mode, width = header[9], header[10]
    head = SEGMENT_HEADER_WORDS
    # Each check passes for the modes it does not concern.
    not_raw, lz, quant = mode != MODE_RAW, (mode & 1) == 1, (mode & 2) == 2
    not_lz, not_quant, not_value = (mode & 1) == 0, (mode & 2) == 0, (mode & MODE_VALUE) == 0
    not_lz_only = not_lz | quant
    # The sections: nu clipped to the rows, so that the sizes stay small.
    nu = where(lz & (n_unique >= 1) & (n_unique <= rows), n_unique, rows)
    ref_words = where(lz, words_for_bits(refs_bits(rows, nu, ref_mode)), 0)
    # A packed block (MODE_PACKED) has no codebook (``sym_lo`` / ``sym_count`` hold its
    # checksum) and one width byte per group where the chunk table is.
    packed = (mode & MODE_PACKED) != 0
    cb_words = where(packed, 0, words_for_bytes((count + 1) // 2))
    ref_off = head + where(quant, cb_words, 0)
    esc_at = head + cb_words + ref_words
    ct_at = esc_at + n_esc + words_for_bytes(n_esc * itemsize)
    bs_at = ct_at + where(packed, words_for_bytes(n_chunks), n_chunks)
    n_raw = words_for_bytes(rows * dim * itemsize)
    vec_at, n_vec = head + ref_words, words_for_bytes(nu * dim * itemsize)  # an lz block's
    n_sym, esc_end = nu * dim, esc_at + n_esc
    bits = float32_bits(step)
    # The per-value grid (MODE_VALUE): step 2**-m for m in 0..23, center qmax >= 0, and no code
    # above qmax reconstructs past float32's infinity (the code of the largest finite |x| is at
    # most 0x7F800000 >> shift), so no stream decodes to a NaN, which backends would cast apart.
    value = (mode & MODE_VALUE) == MODE_VALUE
    value_step = (step >= 2.0**-23) & (step <= 1.0)
    shift = where(value_step, ((bits >> 23) & 0xFF) - 104, 0)  # 23 - m
    value_ok = value_step & (center >= 0) & (center <= (0x7F800000 >> shift))
    grid_ok = isfinite(step) & (step > 0) & where(value, value_ok, abs(center) <= MAX_CENTER)
    codebook_ok = packed | ((lo + count <= ESCAPE_SYMBOL) & (esc_len <= MAX_CODE_LENGTH))
    refs_ok = (n_unique >= 1) & (n_unique <= rows) & (width == ref_width(nu))
    chunk_ok = where(packed, chunk == PACKED_GROUP, chunk >= 1)
    chunks_ok = chunk_ok & (n_chunks == -(-n_sym // clamp_min(chunk, 1)))
    truncated = SEGMENT_TRUNCATED
    checks = (
        (not_raw | (n_raw <= seg), truncated, SECTION_RAW, n_raw, 0, seg),
        (not_raw | (n_raw >= seg), SEGMENT_TRAILING, seg - n_raw, 0, 0, 0),
        ((mode == MODE_RAW) | (seg >= head), truncated, SECTION_HEADER, head, 0, seg),
        (not_quant | not_value | value_ok, SEGMENT_BAD_VALUE_GRID, bits, center, 0, 0),
        (not_quant | grid_ok, SEGMENT_BAD_GRID, bits, center, 0, 0),
        (not_quant | codebook_ok, SEGMENT_BAD_CODEBOOK, lo, count, esc_len, 0),
        (not_quant | (head + cb_words <= seg), truncated, SECTION_CODEBOOK, cb_words, head, seg),
        (not_lz | refs_ok, SEGMENT_BAD_REFS, n_unique, width, rows, 0),
        (not_lz | (ref_mode <= REFS_FLAGGED), SEGMENT_BAD_PACKING, ref_mode, 0, 0, 0),
        (not_lz | (ref_off + ref_words <= seg), truncated, SECTION_REFS, ref_words, ref_off, seg),
        (True, SEGMENT_REFS_RANGE, 0, 0, 0, 0),  # the references' ids (data)
        (not_quant | lz | (n_unique == rows), SEGMENT_BAD_VECTORS, n_unique, rows, 0, 0),
        (not_lz_only | (vec_at + n_vec <= seg), truncated, SECTION_VECTORS, n_vec, vec_at, seg),
        (not_lz_only | (vec_at + n_vec >= seg), SEGMENT_TRAILING, seg - vec_at - n_vec, 0, 0, 0),
        (not_quant | (n_esc <= n_sym), SEGMENT_BAD_ESCAPES, n_esc, n_sym, 0, 0),
        (not_quant | (esc_end <= seg), truncated, SECTION_ESC_POS, n_esc, esc_at, seg),
        (not_quant | (ct_at <= seg), truncated, SECTION_ESC_VALUES, ct_at - esc_end, esc_end, seg),
        (not_quant | chunks_ok, SEGMENT_BAD_CHUNKS, n_chunks, chunk, n_sym, 0),
        (not_quant | (bs_at <= seg), truncated, SECTION_CHUNKS, n_chunks, ct_at, seg),
        (True, SEGMENT_BAD_STREAM, 0, 0, 0, 0),  # the stream's decode, or the packed codes' (data)
    )
    return checks, (nu, ref_off, ref_words, cb_words, esc_at, ct_at, bs_at)


@jitable
def segment_layout(desc: tuple, header: tuple) -> tuple:
    """Whether a block's segment is well-formed (every :func:`segment_checks` passes), and
    where its sections lie.

    The fast path of the batched host decoder (per block, compiled) and of the device
    decoder's planner (over ``[n_blocks]`` arrays); for a block it rejects, the host decoder
    (``host_decompress``) names the first of the same checks that fails. Element-wise over
    ints, numpy arrays, torch tensors and numba scalars.

    Args:
        desc: (mode, rows, dim, bytes per element, segment words) of the block's descriptor.
        header: The segment header's fields in ``SEGMENT_HEADER`` order (int64 but ``step``;
            zeros for a raw block, which has no header).

    Returns:
        (well-formed, then :func:`segment_checks`' sections). Only ``well-formed`` is
        meaningful where it is False.
    """
    checks, sections = segment_checks(desc, header)
    ok = True
    for check in checks:
        ok = ok & check[0]
    return (ok,) + sections  # noqa: RUF005 (numba builds no starred tuple)
