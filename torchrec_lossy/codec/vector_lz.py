"""Vector-LZ: every embedding vector that repeats an earlier one in its block becomes a reference.

The symbol is a whole (quantized) vector, and the match search covers the whole block through a
hash table (not the paper's 32-vector window), so a popular id's vector is sent once per block
however far apart its lookups are. Vector ids are numbered by first occurrence and packed
``REFS_FIXED`` or ``REFS_FLAGGED``, whichever is smaller: docs/format.md, "References".
"""

from __future__ import annotations

import numba
import numpy as np

from torchrec_lossy.codec.format import (
    ESCAPE_SYMBOL,
    REFS_FIXED,
    REFS_FLAGGED,
    ref_width,
    refs_bits,
)
from torchrec_lossy.codec.host_records import Blocks, Dedupe

# How _dedupe_into reads a row (a constant at each call: each compiles its own loops): its
# symbols as 64-bit words (quantized, dim % 4 == 0), its raw bits (the lossless dedupe), or
# its symbols packed 4 to a word (quantized, other dims).
_WORDS = 0
_RAW = 1
_PACK = 2


_LANES = np.uint64(0x0001000100010001)  # 1 in each 16-bit lane of a word
_ESCAPES = np.uint64(ESCAPE_SYMBOL * 0x0001000100010001)  # the escape in every lane
_LANE_TOPS = np.uint64(0x8000800080008000)


@numba.njit(cache=True, nogil=True, inline="always")
def _escape_lanes(word: np.uint64) -> np.uint64:
    """Nonzero iff one of the 4 symbols in ``word`` is ``ESCAPE_SYMBOL`` (the zero-lane test
    of the word XOR 4 escapes: exact, and no per-symbol loop)."""
    v = word ^ _ESCAPES
    return (v - _LANES) & ~v & _LANE_TOPS


@numba.njit(cache=True, nogil=True, inline="always")
def _dedupe_into(
    symbols: np.ndarray, bits: np.ndarray, rows: int, dim: int, how: int, ids: np.ndarray,
    first_rows: np.ndarray,
) -> int:  # fmt: skip
    """Finds one block's repeated rows with a hash table over whole rows (``how`` :data:`_RAW`:
    raw bits only, else the symbols, escaped elements by their raw bits): each row's
    distinct-vector id
    into ``ids`` [rows], numbered by first occurrence, and the row where each distinct vector
    first occurs into ``first_rows`` [>= n_unique].

    The rows are read at unsigned flat offsets: a view per row costs an atomic reference count
    in this loop, and a signed index a negative-index wrap that stops the loops vectorising
    (docs/codec.md). Quantized rows of ``dim % 4 == 0`` symbols are hashed and compared as
    64-bit words (about twice as fast).

    Args:
        symbols: uint16 [rows * dim] symbols of the block, flat (not read when ``raw``).
        bits: int32 [rows * dim] raw bits, same layout.
        rows: Rows.
        dim: Columns.
        how: :data:`_RAW`, :data:`_WORDS` (quantized, ``dim % 4 == 0``) or :data:`_PACK`;
            a constant at each call site, so that each is compiled with its own loops (as a
            value read at run time it made the loops 5x slower).
        ids: int32 [rows] output.
        first_rows: int32 [>= n_unique] output.

    Returns:
        The number of distinct vectors.
    """
    n_words = symbols.shape[0] // 4 if how == _WORDS else 0
    words = symbols[: 4 * n_words].view(np.uint64)
    size = 1
    while size < 2 * rows:
        size *= 2
    mask = size - 1
    table = np.full(size, -1, dtype=np.int32)
    hashes = np.empty(rows, dtype=np.uint64)
    mults = np.empty(max(dim, 1), dtype=np.uint64)  # per-word odd multipliers
    m = np.uint64(0x9E3779B97F4A7C15)
    for j in range(dim):
        mults[j] = m | np.uint64(1)
        m = m * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(0x94D049BB133111EB)
    n_unique = 0
    nw = dim // 4
    # The loop calls no function with array arguments: each such call, inlined or not, costs
    # atomic reference counts per row here.
    for i in range(rows):
        # The hash only orders the probes (ids come from exact comparisons), so it may skip the
        # escaped elements' raw bits: a sum of independent products of 64-bit words and
        # per-word odd multipliers, which the compiler vectorises, then one finalising mix.
        h = np.uint64(0)
        a0 = np.uint64(i * dim)
        if how == _WORDS:  # the symbols' row as nw words
            w0 = np.uint64(i * nw)
            for j in range(nw):
                h += (words[w0 + np.uint64(j)] + np.uint64(1)) * mults[j]
        elif how == _RAW:  # 2 raw values per word
            for j in range(dim // 2):
                at = a0 + np.uint64(2 * j)
                word = (np.uint64(np.uint32(bits[at])) << np.uint64(32)) | np.uint64(
                    np.uint32(bits[at + np.uint64(1)])
                )
                h += (word + np.uint64(1)) * mults[j]
            if dim % 2:
                h += np.uint64(np.uint32(bits[a0 + np.uint64(dim - 1)]) + 1) * mults[dim - 1]
        else:  # 4 symbols packed per word
            for j in range(nw):
                at = a0 + np.uint64(4 * j)
                word = (
                    (np.uint64(symbols[at]) << np.uint64(48))
                    | (np.uint64(symbols[at + np.uint64(1)]) << np.uint64(32))
                    | (np.uint64(symbols[at + np.uint64(2)]) << np.uint64(16))
                    | np.uint64(symbols[at + np.uint64(3)])
                )
                h += (word + np.uint64(1)) * mults[j]
            for j in range(dim - dim % 4, dim):
                h += np.uint64(symbols[a0 + np.uint64(j)] + 1) * mults[j]
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(29)
        hashes[i] = h
    # The probes, in a loop of their own: beside the hashes' loop they made the dedupe 1.35x
    # slower (the hashes of later rows do not wait on the probes' branches).
    for i in range(rows):
        h = hashes[i]
        a0 = np.uint64(i * dim)
        slot = np.int64(h & np.uint64(mask))
        while True:
            u = table[slot]
            if u < 0:
                table[slot] = n_unique
                first_rows[n_unique] = i
                ids[i] = n_unique
                n_unique += 1
                break
            r = first_rows[u]
            if hashes[r] == h:
                # Same vector: equal raw bits (_RAW), else equal symbols with equal raw bits
                # where escaped (_WORDS: the words first, then the raw bits only for a row
                # with an escape: they are not in cache). Branch-free loops: they vectorise.
                b0 = np.uint64(r * dim)
                diff = np.int64(0)
                check = True  # compare element by element
                if how == _WORDS:
                    w0, w1 = np.uint64(i * nw), np.uint64(r * nw)
                    wdiff = np.uint64(0)
                    esc = np.uint64(0)
                    for j in range(nw):
                        word = words[w0 + np.uint64(j)]
                        wdiff |= word ^ words[w1 + np.uint64(j)]
                        esc |= _escape_lanes(word)
                    diff = np.int64(wdiff != 0)
                    check = diff == 0 and esc != np.uint64(0)
                if check:
                    for j in range(dim):
                        jj = np.uint64(j)
                        if how == _RAW:
                            diff |= np.int64(bits[a0 + jj] ^ bits[b0 + jj])
                        else:
                            sa = symbols[a0 + jj]
                            escaped_differs = (sa == ESCAPE_SYMBOL) & (
                                bits[a0 + jj] != bits[b0 + jj]
                            )
                            diff |= np.int64(sa ^ symbols[b0 + jj]) | np.int64(escaped_differs)
                if diff == 0:
                    ids[i] = u
                    break
            slot = (slot + 1) & mask
    return n_unique


@numba.njit(cache=True, nogil=True)
def dedupe_blocks_kernel(
    symbols: np.ndarray,
    bits: np.ndarray,
    blocks: Blocks,
    selected: np.ndarray,
    raw: bool,
    ids: np.ndarray,
    first_rows: np.ndarray,
) -> Dedupe:
    """Finds the repeated rows of every selected block of a concatenation, in one call.

    Args:
        symbols: uint16 symbols of every block, flat, back to back (full length even when
            ``raw``, which does not read them).
        bits: int32 raw bits, same layout.
        blocks: The blocks' layout.
        selected: bool [n_blocks] blocks to dedupe.
        raw: Compare raw bits only (lossless dedupe).
        ids: int32 [total rows] output: block-local vector ids, at the block's rows.
        first_rows: int32 [total rows] output: a block's first rows at its row offset.

    Returns:
        The dedupe, over ``ids`` and ``first_rows``.
    """
    nb = blocks.dims.shape[0]
    n_unique = np.zeros(nb, np.int64)
    for b in range(nb):
        if selected[b]:
            s, e = blocks.elem_off[b], blocks.elem_off[b + 1]
            r0, r1 = blocks.row_off[b], blocks.row_off[b + 1]
            rows, dim = r1 - r0, blocks.dims[b]
            sym, raw_bits, ids_b, first_b = symbols[s:e], bits[s:e], ids[r0:r1], first_rows[r0:r1]
            if raw:
                n_unique[b] = _dedupe_into(sym, raw_bits, rows, dim, _RAW, ids_b, first_b)
            elif dim % 4 == 0:
                n_unique[b] = _dedupe_into(sym, raw_bits, rows, dim, _WORDS, ids_b, first_b)
            else:
                n_unique[b] = _dedupe_into(sym, raw_bits, rows, dim, _PACK, ids_b, first_b)
    return Dedupe(selected, n_unique, ids, first_rows)


@numba.njit(cache=True, nogil=True)
def pack_refs_into(ids: np.ndarray, n_unique: int, mode: int, words: np.ndarray) -> int:
    """Packs vector ids into ``words`` (at least the packing's words).

    Args:
        ids: int32 [rows] ids numbered by first occurrence.
        n_unique: Distinct vectors.
        mode: REFS_FIXED or REFS_FLAGGED.
        words: Zeroed uint32 output.

    Returns:
        Words of the packing.
    """
    rows = ids.shape[0]
    width = ref_width(n_unique)
    n_bits = refs_bits(rows, n_unique, mode)
    # MSB-first through a 64-bit accumulator: at most 33 bits
    # join per row and a word leaves as soon as 32 are pending, so nothing overflows.
    acc = np.uint64(0)
    n_acc = np.uint64(0)
    w = 0
    seen = 0
    mask = (np.uint64(1) << np.uint64(width)) - np.uint64(1)
    for r in range(rows):
        v = np.uint64(ids[r]) & mask
        if mode == REFS_FIXED:
            acc = (acc << np.uint64(width)) | v
            n_acc += np.uint64(width)
        elif ids[r] == seen:
            acc = (acc << np.uint64(1)) | np.uint64(1)
            n_acc += np.uint64(1)
            seen += 1
        else:
            acc = (acc << np.uint64(width + 1)) | v  # flag 0, then the id
            n_acc += np.uint64(width + 1)
        if n_acc >= 32:
            n_acc -= np.uint64(32)
            words[w] = np.uint32((acc >> n_acc) & np.uint64(0xFFFFFFFF))
            w += 1
    if n_acc > 0:
        words[w] = np.uint32((acc << (np.uint64(32) - n_acc)) & np.uint64(0xFFFFFFFF))
    return (n_bits + 31) // 32


@numba.njit(cache=True, nogil=True)
def unpack_refs_kernel(
    words: np.ndarray, rows: int, n_unique: int, mode: int, width: int, ids: np.ndarray
) -> int:
    """Unpacks and validates vector ids.

    Args:
        words: uint32 words of the references.
        rows: Rows of the block.
        n_unique: Distinct vectors.
        mode: REFS_FIXED or REFS_FLAGGED.
        width: Bits per id.
        ids: int32 [rows] output.

    Returns:
        0 on success, -1 if an id is out of range or the bits run out.
    """
    n_words = words.shape[0]
    n_bits = n_words * 32
    if width > 32:
        return -1
    flagged = mode != REFS_FIXED
    pos = 0
    seen = 0
    for r in range(rows):
        # The 64 bits from ``pos`` on, left-aligned (33 or more of them valid: a flag and an
        # id fit), read without a branch on the flag: on most blocks a coin flip to the branch
        # predictor, which costs more than the read.
        w = pos >> 5
        # (unsigned indices: in range, and no negative-index wrap to test)
        window = np.uint64(words[np.uint64(w)]) << np.uint64(32) if w < n_words else np.uint64(0)
        if w + 1 < n_words:
            window |= np.uint64(words[np.uint64(w + 1)])
        window <<= np.uint64(pos & 31)
        if flagged:
            flag = np.int64(window >> np.uint64(63))
            rep = np.int64(((window << np.uint64(1)) >> np.uint64(32)) >> np.uint64(32 - width))
            v = seen if flag else rep
            seen += flag
            pos += 1 + (1 - flag) * width
        else:
            v = np.int64((window >> np.uint64(32)) >> np.uint64(32 - width))
            pos += width
        if pos > n_bits or v >= n_unique:
            return -1
        ids[np.uint64(r)] = v
    if mode == REFS_FLAGGED and seen != n_unique:
        return -1
    return 0


__all__ = [
    "REFS_FIXED",
    "REFS_FLAGGED",
    "dedupe_blocks_kernel",
    "pack_refs_into",
    "unpack_refs_kernel",
]
