"""Triton vector-LZ: find repeated rows of many blocks at once, and unpack the references.

:func:`representatives` gives each row the first identical row of its block, for the rows of
many blocks in one pass (:func:`representatives_pair`: over the symbols and over the raw bits
in the same launches), found in parallel instead of through the CPU kernel's sequential hash
table: a row hash with the block in the top bits, a stable sort, each hash run's start, then a
key-by-key check along the run, so the result is exact whatever the hash does. The device
compress ranks them into the CPU dedupe's ids. :func:`unpack_refs_blocks` unpacks and checks the
references of every LZ block of a payload in one launch. docs/kernels.md, 'The kernels'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import encode_columns as ec
from torchrec_lossy.codec import launch_tables
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.encode_columns import EncodeColumns
from torchrec_lossy.codec.format import ESCAPE_SYMBOL
from torchrec_lossy.codec.launch_tables import block_for
from torchrec_lossy.kernels.common import find_segment

_ESCAPE: tl.constexpr = tl.constexpr(ESCAPE_SYMBOL)


@triton.jit
def _keys(sym_ptr, bits_ptr, offs, mask, raw):
    """int64 element identities, as ``_key`` in codec/vector_lz.py defines them: the raw bits
    where ``raw`` (per lane), else the symbol, an escaped element keyed by its raw bits."""
    s = tl.load(sym_ptr + offs, mask=mask & ~raw, other=0).to(tl.int32) & 0xFFFF
    esc = ~raw & (s == _ESCAPE)
    # Raw bits are read only where the key is raw or the symbol is the escape.
    b = tl.load(bits_ptr + offs, mask=mask & (raw | esc), other=0).to(tl.int64)
    return tl.where(raw, b, tl.where(esc, (b & 0xFFFFFFFF) | 0x100000000, s.to(tl.int64)))


@triton.jit
def _entry(e, rows, RAW_FIRST: tl.constexpr):
    """Entry ``e`` of the launch: (its row, 1 where it is keyed by raw bits). Entries
    ``[0, rows)`` are the first dedupe's rows, ``[rows, 2 rows)`` the raw-bits dedupe's."""
    second = e >= rows
    row = e - tl.where(second, rows, 0)
    if RAW_FIRST:  # one dedupe, over the raw bits
        second = e >= 0
    return row, second


@triton.jit
def _row_table(row_blk_ptr, cols_ptr, r, mask):
    """Row ``r``'s block, first element and elements, from its block's ``encode_columns`` fields
    (a block's rows are back to back from its ``ELEM_OFF``; 0 where not ``mask``)."""
    blk = tl.load(row_blk_ptr + r, mask=mask, other=0).to(tl.int64)
    col = cols_ptr + blk * ec.N_FIELDS
    dim = tl.load(col + ec.DIM, mask=mask, other=0)
    row0 = tl.load(col + ec.ROW_OFF, mask=mask, other=0)
    off = tl.load(col + ec.ELEM_OFF, mask=mask, other=0) + (r - row0) * dim
    return blk, off, dim


@triton.jit
def _row_hash_kernel(
    sym_ptr, bits_ptr, mults_ptr, hash_ptr, row_blk_ptr, cols_ptr, rows, n,
    RAW_FIRST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Entries of many blocks' rows (one dedupe or both, ``_entry``): row i belongs to block
    # row_blk[i]; the block goes into the top bits and the key kind into the sign bit, so that
    # sorting groups entries by dedupe and block first.
    e = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    emask = e < n
    r, raw = _entry(e, rows, RAW_FIRST)
    blk, off, dim = _row_table(row_blk_ptr, cols_ptr, r, emask)
    max_dim = tl.max(dim, axis=0)  # of this program's rows
    h = tl.zeros([BLOCK_R], dtype=tl.uint64)
    for d0 in range(0, max_dim, BLOCK_D):
        c = d0 + tl.arange(0, BLOCK_D)
        m2 = emask[:, None] & (c[None, :] < dim[:, None])
        key = _keys(sym_ptr, bits_ptr, off[:, None] + c[None, :], m2, raw[:, None])
        mult = tl.load(mults_ptr + c, mask=c < max_dim, other=0).to(tl.uint64, bitcast=True)
        # uint64 products and sums wrap modulo 2**64.
        prod = (key + 1).to(tl.uint64, bitcast=True) * mult[None, :]
        h += tl.sum(tl.where(m2, prod, 0), axis=1)
    h ^= h >> 31
    h *= 0xBF58476D1CE4E5B9
    h ^= h >> 29
    # 40 hash bits below the block id (< 2**23): the result stays exact on collisions.
    out = (blk << 40) | (h >> 24).to(tl.int64, bitcast=True) | (raw.to(tl.int64) << 63)
    tl.store(hash_ptr + e, out, mask=emask)


@triton.jit
def _verify_kernel(
    sym_ptr, bits_ptr, order_ptr, run_ptr, out_ptr, row_blk_ptr, cols_ptr, rows, n,
    RAW_FIRST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # out: [2, n] int32, each entry's representative row, then 1 where it is its own.
    p = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    pmask = p < n
    e = tl.load(order_ptr + p, mask=pmask, other=0)  # the entry at sorted position p
    i, raw = _entry(e, rows, RAW_FIRST)
    q = tl.load(run_ptr + p, mask=pmask, other=0)  # candidate sorted position
    # A run holds rows of one block and one dedupe: row r's first element is
    # off_i + (r - i) * dim.
    _, off_i, dim = _row_table(row_blk_ptr, cols_ptr, i, pmask)
    max_dim = tl.max(dim, axis=0)  # of this program's rows
    rep = i
    pending = pmask
    # Each lane stops at the first identical row of its run; q == p (itself) always matches.
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        # not _: a loop-carried _ (bound above) would change type in the loop
        r, _r_raw = _entry(tl.load(order_ptr + q, mask=pending, other=0), rows, RAW_FIRST)
        off_r = off_i + (r - i) * dim
        n_diff = tl.zeros([BLOCK_R], dtype=tl.int32)
        for d0 in range(0, max_dim, BLOCK_D):
            c = d0 + tl.arange(0, BLOCK_D)
            m2 = pending[:, None] & (c[None, :] < dim[:, None])
            ki = _keys(sym_ptr, bits_ptr, off_i[:, None] + c[None, :], m2, raw[:, None])
            kr = _keys(sym_ptr, bits_ptr, off_r[:, None] + c[None, :], m2, raw[:, None])
            n_diff += tl.sum((ki != kr).to(tl.int32), axis=1)
        same = pending & (n_diff == 0)
        rep = tl.where(same, r, rep)
        pending = pending & (n_diff != 0)
        q = tl.where(pending, q + 1, q)
    tl.store(out_ptr + e, rep.to(tl.int32), mask=pmask)
    tl.store(out_ptr + n + e, (rep == i).to(tl.int32), mask=pmask)


def _dedupe(
    symbols: torch.Tensor | None, bits: torch.Tensor, row_blk: torch.Tensor,
    cols: EncodeColumns, max_dim: int, mults: torch.Tensor | None, both: bool,
) -> torch.Tensor:  # fmt: skip
    """The launches of :func:`representatives` (``both``: of :func:`representatives_pair`).

    Returns:
        int32 [2, entries]: each entry's representative row, then 1 where it is its own.
    """
    dev = bits.device
    rows = row_blk.shape[0]
    n = 2 * rows if both else rows
    out = torch.empty(2, n, dtype=torch.int32, device=dev)
    if rows == 0:
        return out
    raw_first = symbols is None
    bits = bits.contiguous()
    sym = bits if raw_first else symbols.contiguous()  # a placeholder pointer when raw
    row_blk = row_blk.contiguous()
    block_r = block_for(n, 64)
    block_d = block_for(max_dim, 64)
    grid = (triton.cdiv(n, block_r),)
    if mults is None:
        mults = torch.from_numpy(launch_tables.column_multipliers(max(max_dim, 1))).to(dev)
    hashes = torch.empty(n, dtype=torch.int64, device=dev)
    _row_hash_kernel[grid](
        sym, bits, mults, hashes, row_blk, cols.cols, rows, n, RAW_FIRST=raw_first,
        BLOCK_R=block_r, BLOCK_D=block_d,
    )  # fmt: skip
    # Any total order of the hashes groups equal rows; stable keeps each group in row order.
    sorted_hashes, order = torch.sort(hashes, stable=True)
    # Each sorted position's run start: the first position holding its hash.
    run_start = torch.searchsorted(sorted_hashes, sorted_hashes)
    _verify_kernel[grid](
        sym, bits, order, run_start, out, row_blk, cols.cols, rows, n, RAW_FIRST=raw_first,
        BLOCK_R=block_r, BLOCK_D=block_d,
    )  # fmt: skip
    return out


def representatives(
    symbols: torch.Tensor | None,
    bits: torch.Tensor,
    row_blk: torch.Tensor,
    cols: EncodeColumns,
    max_dim: int,
    mults: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first identical row in its block, for the rows of many blocks at once.

    Args:
        symbols: 1-D int16 symbols of every element (the uint16 symbols' bits), or None to
            compare raw bits only (lossless dedupe).
        bits: 1-D int32 raw bits of every element, same layout.
        row_blk: int32 / int64 [rows] block of each row (< 2**23; rows of a block are
            contiguous and in order).
        cols: The blocks' compress record; read: ``DIM`` (elements per row), ``ROW_OFF`` (the
            block's first row) and ``ELEM_OFF`` (its first element): row ``r`` of block ``b``
            starts at element ``ELEM_OFF[b] + (r - ROW_OFF[b]) * DIM[b]``.
        max_dim: The largest ``DIM`` of a block with rows (host-side: sizes the column tile;
            each program loops over its own rows' largest).
        mults: int64 [>= max_dim] column multipliers of the row hash on the device (from
            ``launch_tables.column_multipliers``, as ``device_compress`` uploads them); None
            copies them there (a copy per call: for tests and benchmarks).

    Returns:
        (rep: int32 [rows], the first row of its block identical to each row (global index);
        is_first: int32 [rows], 1 where a row is its own representative). Nothing is synced.
    """
    out = _dedupe(symbols, bits, row_blk, cols, max_dim, mults, both=False)
    return out[0], out[1]


def representatives_pair(
    symbols: torch.Tensor, bits: torch.Tensor, row_blk: torch.Tensor, cols: EncodeColumns,
    max_dim: int, mults: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`representatives` over the symbols and over the raw bits, in the same two launches
    and one sort (the compress needs both dedupes; each launch reads the inputs once).

    Args:
        symbols: 1-D int16 symbols of every element.
        bits, row_blk, cols, max_dim, mults: As :func:`representatives`.

    Returns:
        (rep, is_first): int32 [2, rows] each, row 0 :func:`representatives` of ``symbols``,
        row 1 of the raw bits (``symbols`` None).
    """
    out = _dedupe(symbols, bits, row_blk, cols, max_dim, mults, both=True)
    return out[0].view(2, -1), out[1].view(2, -1)


# ------------------------------------------------------------------------------------------------
# Decode side, batched (device decompress): the references of every LZ block in one launch.


@triton.jit
def _read_bits(words_ptr, n_words, pos, width, mask):
    """``width`` (0..32) bits MSB-first at bit ``pos`` of ``n_words`` words (the reads of the CPU
    ``vector_lz.unpack_refs_kernel``);
    words past the end read as 0, so nothing outside the section is touched."""
    w = pos >> 5
    hi = tl.load(words_ptr + w, mask=mask & (w < n_words), other=0).to(tl.int64) & 0xFFFFFFFF
    lo = tl.load(words_ptr + w + 1, mask=mask & (w + 1 < n_words), other=0).to(tl.int64)
    window = ((hi << 32) | (lo & 0xFFFFFFFF)).to(tl.uint64, bitcast=True)
    window = window << (pos & 31).to(tl.uint64)
    shift = (64 - tl.maximum(width, 1)).to(tl.uint64)  # no shift by 64 when width is 0
    return tl.where(width > 0, (window >> shift).to(tl.int64, bitcast=True), 0)


@triton.jit
def _unpack_fixed(words_ptr, cols_ptr, ids_ptr, stride, n_fixed, n_iter, pid, BLOCK: tl.constexpr):
    # REFS_FIXED: row r's id is at bit r * width; one lane per row of every such block.
    g = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    fixed_base = cols_ptr + dc.FIXED_BASE * stride
    mask = g < tl.load(fixed_base + n_fixed)
    f = find_segment(fixed_base, g, n_fixed, n_iter)
    b = tl.load(cols_ptr + dc.FIXED_BLOCKS * stride + f, mask=mask, other=0)
    r = g - tl.load(fixed_base + f, mask=mask, other=0)
    width = tl.load(cols_ptr + dc.WIDTH * stride + b, mask=mask, other=0)
    n_words = tl.load(cols_ptr + dc.REF_WORDS * stride + b, mask=mask, other=0)
    pos = r * width
    refs = words_ptr + tl.load(cols_ptr + dc.REF_OFF * stride + b, mask=mask, other=0)
    v = _read_bits(refs, n_words, pos, width, mask)
    n_unique = tl.load(cols_ptr + dc.N_UNIQUE * stride + b, mask=mask, other=0)
    ok = (pos + width <= n_words * 32) & (v < n_unique)
    id_ptr = ids_ptr + tl.load(cols_ptr + dc.ID_BASE * stride + b, mask=mask, other=0) + r
    tl.store(id_ptr, v.to(tl.int32), mask=mask)
    tl.atomic_max(cols_ptr + dc.REFS_BAD * stride + b, 1, mask=mask & ~ok, sem="relaxed")


@triton.jit
def _unpack_flagged(words_ptr, cols_ptr, ids_ptr, stride, k):
    # REFS_FLAGGED: a row's bits start where the previous row's end, so one program walks the
    # block (unpack_refs_kernel's loop, same checks in the same order). The bits stream through
    # a 64-bit buffer refilled a word at a time, as in the Huffman decoder, so a row costs
    # register work and a load only every 32 bits.
    b = tl.load(cols_ptr + dc.FLAGGED_BLOCKS * stride + k)
    refs = words_ptr + tl.load(cols_ptr + dc.REF_OFF * stride + b)
    n_words = tl.load(cols_ptr + dc.REF_WORDS * stride + b)
    rows = tl.load(cols_ptr + dc.ROWS * stride + b)
    n_unique = tl.load(cols_ptr + dc.N_UNIQUE * stride + b)
    width = tl.load(cols_ptr + dc.WIDTH * stride + b)
    ids = ids_ptr + tl.load(cols_ptr + dc.ID_BASE * stride + b)
    id_shift = (64 - tl.maximum(width, 1)).to(tl.uint64)
    buf = tl.zeros([], dtype=tl.uint64)  # pending bits, left-aligned
    n_buf = tl.zeros([], dtype=tl.int64)
    w = tl.zeros([], dtype=tl.int64)
    seen = tl.zeros([], dtype=tl.int64)
    r = tl.zeros([], dtype=tl.int64)
    ok = r == 0
    while (r < rows) & ok:
        while (n_buf <= 32) & (w < n_words):
            word = tl.load(refs + w).to(tl.uint32, bitcast=True).to(tl.uint64)
            buf |= word << (32 - n_buf).to(tl.uint64)
            n_buf += 32
            w += 1
        first = (buf >> 63) == 1
        repeat = tl.where(width > 0, ((buf << 1) >> id_shift).to(tl.int64), 0)
        v = tl.where(first, seen, repeat)
        used = tl.where(first, 1, 1 + width)  # the buffer holds every bit left when < 33
        ok = (used <= n_buf) & (v < n_unique)
        tl.store(ids + r, v.to(tl.int32), mask=ok)
        seen += (first & ok).to(tl.int64)
        buf = buf << tl.minimum(used, 63).to(tl.uint64)
        n_buf -= used
        r += 1
    tl.atomic_max(
        cols_ptr + dc.REFS_BAD * stride + b, 1, mask=~ok | (seen != n_unique), sem="relaxed"
    )


@triton.jit
def _unpack_refs_blocks_kernel(
    words_ptr, cols_ptr, ids_ptr, stride, n_fixed, n_iter, n_fixed_programs, BLOCK: tl.constexpr
):  # fmt: skip
    # Programs [0, n_fixed_programs) take the fixed-width rows, the rest one flagged block each.
    # Field F of block b is at cols_ptr + F * stride + b (``decode_columns``).
    pid = tl.program_id(0)
    if pid < n_fixed_programs:
        _unpack_fixed(words_ptr, cols_ptr, ids_ptr, stride, n_fixed, n_iter, pid, BLOCK)
    else:
        _unpack_flagged(words_ptr, cols_ptr, ids_ptr, stride, pid - n_fixed_programs)


def unpack_refs_blocks(
    words: torch.Tensor, cols: DecodeColumns, n_ids: int, n_fixed_rows: int
) -> torch.Tensor:
    """Unpacks and validates the references of many blocks in one launch, no sync.

    Fixed-width blocks get one lane per row; each flagged block gets one program that walks its
    rows (the flags make every row's position depend on the rows before it).

    Args:
        words: int32 payload words; offsets index them.
        cols: The blocks' decode record; read: ``FIXED_BASE`` (first global row of each
            REFS_FIXED block), ``FIXED_BLOCKS``, ``FLAGGED_BLOCKS``, ``REF_OFF``, ``REF_WORDS``,
            ``ROWS``, ``N_UNIQUE``, ``WIDTH`` (``ref_width(n_unique)``, checked by the caller),
            ``ID_BASE`` (where each block's ids start in the output). Written: ``REFS_BAD``
            raised to 1 where ``unpack_refs_kernel`` would fail (an id out of range, bits
            running out, or a flagged block introducing a wrong number of vectors).
        n_ids: Total rows of the LZ blocks (the output's length).
        n_fixed_rows: Total rows of the REFS_FIXED blocks (the last ``FIXED_BASE`` entry).

    Returns:
        int32 [n_ids] vector id of every row (unspecified where ``REFS_BAD``).
    """
    ids = torch.empty(n_ids, dtype=torch.int32, device=words.device)
    n_fixed = cols.n_fixed
    block = 1024
    n_fixed_programs = triton.cdiv(n_fixed_rows, block)
    grid = n_fixed_programs + cols.n_flagged
    if grid:
        _unpack_refs_blocks_kernel[(grid,)](
            words, cols.cols, ids, cols.stride, n_fixed, max(n_fixed, 1).bit_length(),
            n_fixed_programs, BLOCK=block,
        )  # fmt: skip
    return ids


# The @triton.jit kernels by name, for the ahead-of-time compile check (``kernels/_aot.py``);
# callers launch them through the functions above.
JIT_KERNELS = {
    "row_hash_kernel": _row_hash_kernel,
    "unpack_refs_blocks_kernel": _unpack_refs_blocks_kernel,
    "verify_kernel": _verify_kernel,
}
