"""Triton decode of the packed format (docs/format.md, "Packed segments"): the checks of every
block in three launches, no sort, no host read, no per-value buffer.

:func:`packed_checksums` sums each packed segment's words in tiles (per-tile partials, no
atomics); :func:`packed_widths` reads every group's width byte and checks the escape lists;
:func:`check_groups` checks every sent value's code and escape; :func:`packed_status` gives
each block's status. :func:`packed_code` (a value's
code at its group's offset, a prefix sum of the widths, and its escape by a binary search of
the block's positions) is what ``quantize.decode_packed_outputs`` decodes each output element
with. Torch twins: ``kernels/packed_ref.py``; the stages: docs/kernels.md, "The packed format
on the device".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import encode_columns as ec
from torchrec_lossy.codec import format as wire
from torchrec_lossy.codec import packed_columns as pc
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.encode_columns import GRID_OK, GRID_STATS
from torchrec_lossy.codec.launch_tables import NO_FAILURE, block_for
from torchrec_lossy.codec.packed_columns import PutDedupes
from torchrec_lossy.kernels.common import find_segment

_GROUP: tl.constexpr = tl.constexpr(wire.PACKED_GROUP)
_MAX_WIDTH: tl.constexpr = tl.constexpr(wire.PACKED_MAX_WIDTH)
_MAX_CODE: tl.constexpr = tl.constexpr(2 * wire.SYMBOL_OFFSET)
_OFFSET: tl.constexpr = tl.constexpr(wire.SYMBOL_OFFSET)
_ESCAPE: tl.constexpr = tl.constexpr(wire.ESCAPE_SYMBOL)
_NO_FAIL: tl.constexpr = tl.constexpr(NO_FAILURE)
_BAD_REFS: tl.constexpr = tl.constexpr(wire.REFS_OUT_OF_RANGE)
_BAD_CHECKSUM: tl.constexpr = tl.constexpr(wire.DECODE_BAD_CHECKSUM)
_BAD_WIDTH: tl.constexpr = tl.constexpr(wire.DECODE_BAD_WIDTH)
_BAD_CODE: tl.constexpr = tl.constexpr(wire.DECODE_BAD_PACKED_CODE)
_BAD_ESCAPES: tl.constexpr = tl.constexpr(wire.DECODE_BAD_PACKED_ESCAPES)
_GROUPS_PER_PROGRAM = 32  # groups of one program (32 x 32 lanes)
_SEG_WORDS: tl.constexpr = tl.constexpr(wire.SEGMENT_HEADER_WORDS)
_REFS_FIXED: tl.constexpr = tl.constexpr(wire.REFS_FIXED)
_REFS_FLAGGED: tl.constexpr = tl.constexpr(wire.REFS_FLAGGED)
_MODE_RAW: tl.constexpr = tl.constexpr(wire.MODE_RAW)
_MODE_LZ: tl.constexpr = tl.constexpr(wire.MODE_LZ)
_MODE_QUANT: tl.constexpr = tl.constexpr(wire.MODE_QUANT)
_MODE_QUANT_LZ: tl.constexpr = tl.constexpr(wire.MODE_QUANT_LZ)
_MODE_VALUE: tl.constexpr = tl.constexpr(wire.MODE_VALUE)
_MODE_PACKED: tl.constexpr = tl.constexpr(wire.MODE_PACKED)
_GRID_STATS: tl.constexpr = tl.constexpr(GRID_STATS)
_GRID_OK: tl.constexpr = tl.constexpr(GRID_OK)


@triton.jit
def _checksum_kernel(words_ptr, tile_ptr, part_ptr, TILE: tl.constexpr):
    # One program per tile (first word, its index in the segment, words): the tile's share of
    # sum_j w_j (2 j + 1), wrapping in int64 (only its low 32 bits are compared).
    t = tl.program_id(0).to(tl.int64)
    start = tl.load(tile_ptr + 3 * t)
    j0 = tl.load(tile_ptr + 3 * t + 1)
    n = tl.load(tile_ptr + 3 * t + 2)
    lane = tl.arange(0, TILE)
    mask = lane < n
    w = tl.load(words_ptr + start + lane, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    tl.store(part_ptr + t, tl.sum(tl.where(mask, w * (2 * (j0 + lane) + 1), 0), axis=0))


def packed_checksums(words: torch.Tensor, tiles: torch.Tensor, tile: int) -> torch.Tensor:
    """Per tile, its words' share of their segment's checksum, in one launch.

    Args:
        words: int32 payload words.
        tiles: int64 [n_tiles, 3] (first word in ``words``, that word's index in its segment
            after the header, words: at most ``tile``), on ``words``' device.
        tile: Words per tile (a power of two).

    Returns:
        int64 [n_tiles] partial sums (wrapping).
    """
    n = tiles.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=words.device)
    if n:
        _checksum_kernel[(n,)](words, tiles, out, TILE=tile)
    return out


@triton.jit
def _widths_kernel(
    words_ptr, cols_ptr, widths_ptr, stride, n_groups, n_blocks, n_iter, GB: tl.constexpr,
    GROUP: tl.constexpr,
):  # fmt: skip
    # GB groups per program: each group's width byte (TABLE_BAD raised past the cap), and the
    # escape-list entries k = 32 * group .. + 31 of its block (ESC_BAD lowered where one is not
    # above the one before or not inside the block's values).
    g = tl.program_id(0).to(tl.int64) * GB + tl.arange(0, GB)
    mask = g < n_groups
    chunk_base = cols_ptr + dc.CHUNK_BASE * stride
    b = find_segment(chunk_base, g, n_blocks, n_iter)
    cl = g - tl.load(chunk_base + b, mask=mask, other=0)
    ct = tl.load(cols_ptr + dc.CT_OFF * stride + b, mask=mask, other=0)
    word = tl.load(words_ptr + ct + cl // 4, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    w = (word >> ((cl % 4) * 8)) & 0xFF
    tl.store(widths_ptr + g, w.to(tl.int16), mask=mask)
    one = w * 0 + 1
    tl.atomic_max(cols_ptr + dc.TABLE_BAD * stride + b, one, mask=mask & (w > _MAX_WIDTH))
    s0 = tl.load(cols_ptr + dc.SYM_BASE * stride + b, mask=mask, other=0)
    n_sym = tl.load(cols_ptr + dc.SYM_BASE * stride + b + 1, mask=mask, other=0) - s0
    n_esc = tl.load(cols_ptr + dc.N_ESC * stride + b, mask=mask, other=0)
    pos_at = tl.load(cols_ptr + dc.ESC_POS_OFF * stride + b, mask=mask, other=0)
    k = cl[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    listed = mask[:, None] & (k < n_esc[:, None])
    pos = tl.load(words_ptr + pos_at[:, None] + k, mask=listed, other=0).to(tl.int64) & 0xFFFFFFFF
    before = listed & (k > 0)
    prev = tl.load(words_ptr + pos_at[:, None] + k - 1, mask=before, other=0).to(tl.int64)
    prev = tl.where(before, prev & 0xFFFFFFFF, -1)
    bad = listed & ((pos >= n_sym[:, None]) | (pos <= prev))
    blk = b[:, None] + k * 0
    tl.atomic_min(cols_ptr + dc.ESC_BAD * stride + blk, k, mask=bad)


def packed_widths(words: torch.Tensor, cols: DecodeColumns, n_groups: int) -> torch.Tensor:
    """Every packed group's width, and the checks of the widths and escape lists, in one launch.

    Args:
        words: int32 payload words.
        cols: The blocks' decode record; read: ``CHUNK_BASE`` (first global group of each
            block), ``CT_OFF`` (its width bytes' word), ``SYM_BASE``, ``N_ESC``,
            ``ESC_POS_OFF``. Written (atomics): ``TABLE_BAD`` raised to 1 where a width is
            over ``PACKED_MAX_WIDTH``; ``ESC_BAD`` lowered to the first entry of an escape
            list not above the entry before it or past the block's values.
        n_groups: Groups of all blocks (the last ``CHUNK_BASE`` entry).

    Returns:
        int16 [n_groups] widths (0..255 as stored).
    """
    out = torch.empty(n_groups, dtype=torch.int16, device=words.device)
    if n_groups:
        gb, nb = _GROUPS_PER_PROGRAM, cols.n_blocks
        _widths_kernel[(triton.cdiv(n_groups, gb),)](
            words, cols.cols, out, cols.stride, n_groups, nb, nb.bit_length(), GB=gb, GROUP=_GROUP,
        )  # fmt: skip
    return out


@triton.jit
def packed_code(
    words_ptr, cols_ptr, widths_ptr, ends_ptr, stride, b, i, valid, esc_iter,
):  # fmt: skip
    """Value ``i`` (lanes) of packed block ``b``: its code, the listed escapes at or before it
    (a binary search of the block's positions) and whether ``i`` is listed. The code starts at
    bit ``32 * (widths' prefix sum before its group in the block) + (i % 32) * width``."""
    g0 = tl.load(cols_ptr + dc.CHUNK_BASE * stride + b, mask=valid, other=0)
    g = g0 + i // _GROUP
    w = tl.load(widths_ptr + g, mask=valid, other=0).to(tl.int64)
    w0 = tl.load(widths_ptr + g0, mask=valid, other=0)
    first = tl.load(ends_ptr + g0, mask=valid, other=0) - w0
    off = tl.load(ends_ptr + g, mask=valid, other=0).to(tl.int64) - w - first
    bs = tl.load(cols_ptr + dc.BS_OFF * stride + b, mask=valid, other=0)
    bs_words = tl.load(cols_ptr + dc.BS_WORDS * stride + b, mask=valid, other=0)
    wc = tl.minimum(w, 32)  # a bad width (flagged by packed_widths) still reads in bounds
    bit = off * 32 + (i % _GROUP) * wc
    at = bit >> 5
    lo_ok = valid & (wc > 0) & (at < bs_words)
    hi_ok = valid & (wc > 0) & (at + 1 < bs_words)
    lo = tl.load(words_ptr + bs + at, mask=lo_ok, other=0).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(words_ptr + bs + at + 1, mask=hi_ok, other=0).to(tl.int64) & 0xFFFFFFFF
    code = ((lo | (hi << 32)) >> (bit & 31)) & (((wc * 0 + 1) << wc) - 1)
    n_esc = tl.load(cols_ptr + dc.N_ESC * stride + b, mask=valid, other=0)
    pos_at = tl.load(cols_ptr + dc.ESC_POS_OFF * stride + b, mask=valid, other=0)
    lo_k = i * 0
    hi_k = lo_k + n_esc
    for _ in range(esc_iter):
        active = valid & (lo_k < hi_k)
        mid = (lo_k + hi_k) // 2
        v = tl.load(words_ptr + pos_at + mid, mask=active, other=0).to(tl.int64) & 0xFFFFFFFF
        le = v <= i
        lo_k = tl.where(active & le, mid + 1, lo_k)
        hi_k = tl.where(active & ~le, mid, hi_k)
    has = valid & (lo_k > 0)
    last = tl.load(words_ptr + pos_at + lo_k - 1, mask=has, other=0).to(tl.int64) & 0xFFFFFFFF
    return code, lo_k, has & (last == i)


@triton.jit
def packed_symbol(code, found):
    """The symbol of a packed code (``format.unzigzag``), ``ESCAPE_SYMBOL`` where listed."""
    half = code >> 1
    return tl.where(found, _ESCAPE, _OFFSET + tl.where((code & 1) == 1, -half - 1, half))


@triton.jit
def _check_groups_kernel(
    words_ptr, cols_ptr, widths_ptr, ends_ptr, stride, n_groups, n_blocks, n_iter, esc_iter,
    GB: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    # GB groups x 32 values per program: the checks the decoder makes of every sent value
    # (the output kernel decodes only the values rows refer to); a block's last group checks
    # that the widths add up to the codes' words.
    g = tl.program_id(0).to(tl.int64) * GB + tl.arange(0, GB)
    mask = g < n_groups
    chunk_base = cols_ptr + dc.CHUNK_BASE * stride
    b = find_segment(chunk_base, g, n_blocks, n_iter)
    g0 = tl.load(chunk_base + b, mask=mask, other=0)
    g1 = tl.load(chunk_base + b + 1, mask=mask, other=0)
    w = tl.load(widths_ptr + g, mask=mask, other=0).to(tl.int64)
    end = tl.load(ends_ptr + g, mask=mask, other=0).to(tl.int64)
    w0 = tl.load(widths_ptr + g0, mask=mask, other=0)
    first = tl.load(ends_ptr + g0, mask=mask, other=0) - w0
    bs_words = tl.load(cols_ptr + dc.BS_WORDS * stride + b, mask=mask, other=0)
    short = mask & (g == g1 - 1) & (end - first != bs_words)
    tl.atomic_max(cols_ptr + dc.TABLE_BAD * stride + b, w * 0 + 1, mask=short)
    s0 = tl.load(cols_ptr + dc.SYM_BASE * stride + b, mask=mask, other=0)
    n_sym = tl.load(cols_ptr + dc.SYM_BASE * stride + b + 1, mask=mask, other=0) - s0
    i = (g - g0)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # the value in its block
    valid = mask[:, None] & (i < n_sym[:, None])
    blk = b[:, None] + i * 0
    code, _, found = packed_code(
        words_ptr, cols_ptr, widths_ptr, ends_ptr, stride, blk, i, valid, esc_iter
    )
    tl.atomic_min(cols_ptr + dc.FAIL * stride + blk, i, mask=valid & (code > _MAX_CODE))
    tl.atomic_min(cols_ptr + dc.ESC_BAD * stride + blk, i, mask=found & (code != 0))


def check_groups(
    words: torch.Tensor, cols: DecodeColumns, widths: torch.Tensor, ends: torch.Tensor,
    esc_iter: int,
) -> None:  # fmt: skip
    """Checks every packed value of every block in one launch (status rows only); no sync.

    Args:
        words: int32 payload words.
        cols: The blocks' decode record; read: ``CHUNK_BASE``, ``SYM_BASE``, ``BS_OFF`` /
            ``BS_WORDS`` (the codes), ``N_ESC``, ``ESC_POS_OFF``. Written (atomics):
            ``TABLE_BAD`` raised to 1 where the widths do not add up to the codes' words,
            ``FAIL`` lowered to the first code above ``2 * SYMBOL_OFFSET``, ``ESC_BAD`` lowered
            to the first listed escape whose code is not 0.
        widths: int16 [n_groups] from :func:`packed_widths`.
        ends: int32 [n_groups] inclusive prefix sum of ``widths`` (over all blocks).
        esc_iter: Binary-search steps: at least ``bit_length`` of the largest ``N_ESC``.
    """
    n_groups = widths.shape[0]
    if n_groups:
        gb, nb = _GROUPS_PER_PROGRAM, cols.n_blocks
        _check_groups_kernel[(triton.cdiv(n_groups, gb),)](
            words, cols.cols, widths, ends, cols.stride, n_groups, nb, nb.bit_length(), esc_iter,
            GB=gb, GROUP=_GROUP,
        )  # fmt: skip


@triton.jit
def _status_kernel(cols_ptr, sums_ptr, code_ptr, stride, n_blocks, BLOCK: tl.constexpr):
    # Per block, the CPU decoder's order: references, checksum, widths, a code, the escapes.
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = b < n_blocks
    lo = tl.load(cols_ptr + dc.SYM_LO * stride + b, mask=mask, other=0)
    count = tl.load(cols_ptr + dc.SYM_COUNT * stride + b, mask=mask, other=0)
    sums = tl.load(sums_ptr + b, mask=mask, other=0) & 0xFFFFFFFF
    esc_bad = tl.load(cols_ptr + dc.ESC_BAD * stride + b, mask=mask, other=_NO_FAIL)
    fail = tl.load(cols_ptr + dc.FAIL * stride + b, mask=mask, other=_NO_FAIL)
    table_bad = tl.load(cols_ptr + dc.TABLE_BAD * stride + b, mask=mask, other=0)
    has_stream = tl.load(cols_ptr + dc.HAS_STREAM * stride + b, mask=mask, other=0)
    refs_bad = tl.load(cols_ptr + dc.REFS_BAD * stride + b, mask=mask, other=0)
    code = tl.where(esc_bad != _NO_FAIL, _BAD_ESCAPES, 0)
    code = tl.where(fail != _NO_FAIL, _BAD_CODE, code)
    code = tl.where(table_bad != 0, _BAD_WIDTH, code)
    code = tl.where(sums != (lo | (count << 16)), _BAD_CHECKSUM, code)
    code = tl.where(has_stream != 0, code, 0)
    code = tl.where(refs_bad != 0, _BAD_REFS, code)
    tl.store(code_ptr + b, code.to(tl.int32), mask=mask)


def packed_status(cols: DecodeColumns, sums: torch.Tensor) -> torch.Tensor:
    """Each packed block's status in the CPU decoder's order (``packed.decode_stream``): its
    references, then its checksum, its widths, a code, its escapes; one launch, no sync.

    Args:
        cols: The decode record after the packed stages; read: ``SYM_LO`` / ``SYM_COUNT``
            (the stored checksum), the status rows ``REFS_BAD``, ``TABLE_BAD``, ``FAIL``,
            ``ESC_BAD``, and ``HAS_STREAM``.
        sums: int64 [n_blocks] checksums of the segments' words (low 32 bits compared).

    Returns:
        int32 [n_blocks]: 0, ``REFS_OUT_OF_RANGE`` or a packed ``DECODE_*`` code.
    """
    n = cols.n_blocks
    out = torch.empty(n, dtype=torch.int32, device=sums.device)
    if n:
        block = block_for(n, 1024)
        _status_kernel[(triton.cdiv(n, block),)](cols.cols, sums, out, cols.stride, n, BLOCK=block)
    return out


# ---- encode: the stream's widths and escapes, its words, the raw rows ---------------------------


@triton.jit
def _source_at(rows_ptr, e, valid, dim, lz, base, row_off, elem_off):
    # The flat element that value ``e`` of a block's sent rows reads: column e % dim of its
    # row e // dim, or of that distinct vector's first row where ``lz`` (its first
    # occurrences' rows at ``rows_ptr + base``).
    vec = e // dim
    first = tl.load(rows_ptr + base + vec, mask=valid & lz, other=0)
    local = tl.where(lz, first - row_off, vec)
    return tl.where(valid, elem_off + local * dim + (e - vec * dim), 0)


@triton.jit
def _source(rows_ptr, rec_ptr, blk, e, valid, LZ: tl.constexpr, BASE: tl.constexpr):
    # ``_source_at`` with the block's fields from its packed record (LZ, BASE: the fields).
    dim = tl.load(rec_ptr + blk * pc.N_FIELDS + pc.DIM, mask=valid, other=1)
    lz = tl.load(rec_ptr + blk * pc.N_FIELDS + LZ, mask=valid, other=0) == 1
    base = tl.load(rec_ptr + blk * pc.N_FIELDS + BASE, mask=valid & lz, other=0)
    row_off = tl.load(rec_ptr + blk * pc.N_FIELDS + pc.ROW_OFF, mask=valid, other=0)
    elem_off = tl.load(rec_ptr + blk * pc.N_FIELDS + pc.ELEM_OFF, mask=valid, other=0)
    return _source_at(rows_ptr, e, valid, dim, lz, base, row_off, elem_off)


@triton.jit
def _codes(sym_ptr, elem, valid):
    # Each sent value's escape and zigzag code (0 where escaped or not valid).
    sym = tl.load(sym_ptr + elem, mask=valid, other=0).to(tl.int64) & 0xFFFF
    esc = valid & (sym == _ESCAPE)
    d = sym - _OFFSET
    return esc, tl.where(valid & ~esc, tl.where(d < 0, -2 * d - 1, 2 * d), 0)


@triton.jit
def _word_sums(value, at, mask):
    """Per row of lanes: (sum of the uint32 words ``value`` added at word ``at``, sum of
    ``value * (2 at + 1)``), wrapping in int64 (0 where not ``mask``)."""
    v = tl.where(mask, value, 0)
    return tl.sum(v, axis=1), tl.sum(v * (2 * at + 1), axis=1)


@triton.jit
def _stream_group(
    pid, sym_ptr, bits_ptr, rows_ptr, rec_ptr, slot_ptr, width_ptr, esc_ptr, off_ptr, buf_ptr,
    sums_ptr, n_slots, n_blocks, GB: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    # Program ``pid``'s GB group slots (slot: block, group in the block), 32 lanes each: every
    # sent value's escape and zigzag code; its width byte, its codes at bit k * w of its
    # words, its escapes (ranks from its slot's first), added into the zeroed words (integer
    # adds of disjoint bits: the OR); per slot the words' sum and their sum weighted by
    # 2 * word + 1, added to its block's sums (the segment and payload checksums are linear
    # in them: ``put_data``).
    s = pid * GB + tl.arange(0, GB)
    smask = s < n_slots
    blk = tl.load(slot_ptr + 2 * s, mask=smask, other=0)
    k = tl.load(slot_ptr + 2 * s + 1, mask=smask, other=0)
    n_sym = tl.load(rec_ptr + blk * pc.N_FIELDS + pc.N_SYM, mask=smask, other=0)
    lane = tl.arange(0, GROUP)
    v = k[:, None] * GROUP + lane[None, :]
    valid = smask[:, None] & (v < n_sym[:, None])
    blk2 = blk[:, None] + v * 0
    elem = _source(rows_ptr, rec_ptr, blk2, v, valid, pc.Q_LZ, pc.Q_BASE)
    esc, code = _codes(sym_ptr, elem, valid)
    w = tl.load(width_ptr + s, mask=smask, other=0)
    used = smask & (k * GROUP < n_sym)
    table_at = tl.load(rec_ptr + blk * pc.N_FIELDS + pc.TABLE_AT, mask=used, other=0)
    word = buf_ptr.dtype.element_ty  # int32 words, or int64 lanes (values modulo 2**32)
    table_word = w << (8 * (k % 4))
    tl.atomic_add(buf_ptr + table_at + k // 4, table_word.to(word), mask=used)
    s0 = tl.where(used, table_word, 0)
    s1 = s0 * (2 * (table_at + k // 4) + 1)
    codes_at = tl.load(rec_ptr + blk * pc.N_FIELDS + pc.CODES_AT, mask=used, other=0)
    off = tl.load(off_ptr + s, mask=used, other=0)
    bit = 32 * off[:, None] + lane[None, :] * w[:, None]
    at = codes_at[:, None] + bit // 32
    sh = bit % 32
    live = code != 0
    low = (code << sh) & 0xFFFFFFFF
    tl.atomic_add(buf_ptr + at, low.to(word), mask=live)
    a0, a1 = _word_sums(low, at, live)
    spill = live & (sh + w[:, None] > 32)
    high = code >> tl.where(spill, 32 - sh, 0)
    tl.atomic_add(buf_ptr + at + 1, high.to(word), mask=spill)
    b0, b1 = _word_sums(high, at + 1, spill)
    e = esc.to(tl.int64)
    rank = tl.load(esc_ptr + s, mask=used, other=0)[:, None] + tl.cumsum(e, axis=1) - e
    escp_at = tl.load(rec_ptr + blk2 * pc.N_FIELDS + pc.ESCP_AT, mask=esc, other=0)
    tl.atomic_add(buf_ptr + escp_at + rank, v.to(word), mask=esc)
    c0, c1 = _word_sums(v, escp_at + rank, esc)
    raw = tl.load(bits_ptr + elem, mask=esc, other=0).to(tl.int64)
    wide = tl.load(rec_ptr + blk2 * pc.N_FIELDS + pc.ITEMSIZE, mask=esc, other=4) == 4
    escb_at = tl.load(rec_ptr + blk2 * pc.N_FIELDS + pc.ESCB_AT, mask=esc, other=0)
    value = tl.where(wide, raw & 0xFFFFFFFF, (raw & 0xFFFF) << (16 * (rank % 2)))
    at = escb_at + tl.where(wide, rank, rank // 2)
    tl.atomic_add(buf_ptr + at, value.to(word), mask=esc)
    d0, d1 = _word_sums(value, at, esc)
    tl.atomic_add(sums_ptr + blk, s0 + a0 + b0 + c0 + d0, mask=used)
    tl.atomic_add(sums_ptr + n_blocks + blk, s1 + a1 + b1 + c1 + d1, mask=used)


@triton.jit
def _bit_length(x, BITS: tl.constexpr):
    """``int.bit_length`` of non-negative values below ``2**BITS``."""
    n = x * 0
    for i in tl.static_range(BITS):
        n += ((x >> i) > 0).to(n.dtype)
    return n


@triton.jit
def _refs_bits(rows, n_unique):
    """``format.refs_packing``: (packing, bits) of a block's references (``n_unique`` >= 1)."""
    width = _bit_length(tl.maximum(n_unique - 1, 0), 32)
    fixed = rows * width
    flagged = rows + (rows - n_unique) * width
    flag = fixed > flagged
    return tl.where(flag, _REFS_FLAGGED, _REFS_FIXED), tl.where(flag, flagged, fixed)


@triton.jit
def _lossless_words(rows, n_unique, dim, itemsize):
    """``size_model.lossless_lz_words``."""
    _, bits = _refs_bits(rows, n_unique)
    return _SEG_WORDS + (bits + 31) // 32 + (n_unique * dim * itemsize + 3) // 4


@triton.jit
def _plan_kernel(
    sym_ptr, rows_ptr, nrows_ptr, dim_ptr, size_ptr, eoff_ptr, roff_ptr, lz_ptr, raw_ptr,
    first_ptr, grid_ptr, nuq_ptr, nur_ptr, qbase_ptr, enc_ptr, slot_ptr, plan_ptr, head_ptr,
    n_slots, n_blocks, GB: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    # One program per block: its stream (its distinct rows where some repeat and vector-LZ may
    # run: the host's _packed_plan; else every row), GB group slots x 32 lanes at a time: each
    # slot's width, its first word in the block's codes and the block's escapes before it
    # (running sums); then the block's mode (size_model's choice over the exact words) and
    # what it sends (device_compress.sections' sizes: no codebook, no chunk table); its
    # descriptor and segment header words (device_compress.descriptor_words,
    # segment_header_records; the checksum field 0, added later).
    b = tl.program_id(0).to(tl.int64)
    rows = tl.load(nrows_ptr + b)
    dim = tl.load(dim_ptr + b)
    itemsize = tl.load(size_ptr + b)
    raw_words = tl.load(raw_ptr + b)
    lz_allowed = tl.load(lz_ptr + b) == 1
    ok = tl.load(grid_ptr + b * _GRID_STATS + _GRID_OK) == 1
    nu_q = tl.load(nuq_ptr + b)
    nu_r = tl.load(nur_ptr + b)
    base = tl.load(qbase_ptr + b)
    row_off = tl.load(roff_ptr + b)
    elem_off = tl.load(eoff_ptr + b)
    first = tl.load(first_ptr + b)
    n_slots_b = tl.load(first_ptr + b + 1) - first
    stream_lz = ok & lz_allowed & (nu_q < rows)
    n_sym = tl.where(ok, tl.where(stream_lz, nu_q, rows) * dim, 0)
    dim1 = tl.maximum(dim, 1)
    lane = tl.arange(0, GROUP)
    words = tl.zeros((), tl.int64)
    n_esc = tl.zeros((), tl.int64)
    for g0 in range(0, n_slots_b, GB):
        k = g0 + tl.arange(0, GB)
        kmask = k < n_slots_b
        v = k[:, None] * GROUP + lane[None, :]
        valid = kmask[:, None] & (v < n_sym)
        elem = _source_at(rows_ptr, v, valid, dim1, stream_lz, base, row_off, elem_off)
        esc, code = _codes(sym_ptr, elem, valid)
        width = _bit_length(tl.max(code, axis=1), _MAX_WIDTH)
        e = tl.sum(esc.to(tl.int64), axis=1)
        at = slot_ptr + first + k
        tl.store(at, width, mask=kmask)
        tl.store(at + n_slots, words + tl.cumsum(width, 0) - width, mask=kmask)
        tl.store(at + 2 * n_slots, n_esc + tl.cumsum(e, 0) - e, mask=kmask)
        words += tl.sum(width, axis=0)
        n_esc += tl.sum(e, axis=0)
    n_groups = (n_sym + GROUP - 1) // GROUP
    stream_words = (n_groups + 3) // 4 + words
    # size_model: choose_lossy (quant_words, quant_lz_words), lossless_may_win, choose_lossless.
    esc_w = n_esc + (n_esc * itemsize + 3) // 4
    quant_w = _SEG_WORDS + esc_w + stream_words
    nu_q1 = tl.maximum(nu_q, 1)
    _, qlz_refs = _refs_bits(rows, nu_q1)
    qlz_w = _SEG_WORDS + (qlz_refs + 31) // 32 + esc_w + stream_words
    better = ok & ~stream_lz & (quant_w < raw_words)
    mode = tl.where(better, _MODE_QUANT, _MODE_RAW)
    best = tl.where(better, quant_w, raw_words)
    better = stream_lz & (qlz_w < best)
    mode = tl.where(better, _MODE_QUANT_LZ, mode)
    best = tl.where(better, qlz_w, best)
    nu_lower = tl.where(ok & lz_allowed, nu_q1, 1)
    tried = lz_allowed & (_lossless_words(rows, nu_lower, dim, itemsize) < best)
    lossless_w = _lossless_words(rows, tl.maximum(nu_r, 1), dim, itemsize)
    mode = tl.where(tried & (lossless_w < best) & (rows * dim > 0), _MODE_LZ, mode)
    # What it sends.
    is_q = (mode == _MODE_QUANT) | (mode == _MODE_QUANT_LZ)
    is_qlz = mode == _MODE_QUANT_LZ
    is_lz = mode == _MODE_LZ
    has_refs = is_qlz | is_lz
    n_sent = tl.where(is_qlz, nu_q, tl.where(is_lz, nu_r, rows))
    ref_mode, ref_bits = _refs_bits(rows, tl.where(has_refs, n_sent, 1))
    n_escapes = tl.where(is_q, n_esc, 0)
    esc_words = n_escapes + (n_escapes * itemsize + 3) // 4
    refs_words = tl.where(has_refs, (ref_bits + 31) // 32, 0)
    uniq_words = tl.where(is_lz, (nu_r * dim * itemsize + 3) // 4, 0)
    body = _SEG_WORDS + refs_words + uniq_words + esc_words + tl.where(is_q, stream_words, 0)
    out = plan_ptr + b
    tl.store(out + pc.MODE * n_blocks, mode.to(tl.int64))
    tl.store(out + pc.IS_Q * n_blocks, is_q.to(tl.int64))
    tl.store(out + pc.IS_QLZ * n_blocks, is_qlz.to(tl.int64))
    tl.store(out + pc.IS_LZ * n_blocks, is_lz.to(tl.int64))
    tl.store(out + pc.HAS_REFS * n_blocks, has_refs.to(tl.int64))
    tl.store(out + pc.N_SENT * n_blocks, n_sent)
    tl.store(out + pc.N_ESCAPES * n_blocks, n_escapes)
    tl.store(out + pc.PLAN_REF_MODE * n_blocks, tl.where(has_refs, ref_mode, 0).to(tl.int64))
    tl.store(out + pc.PLAN_REF_WIDTH * n_blocks, _bit_length(tl.maximum(n_sent - 1, 0), 32))
    tl.store(out + pc.REFS_WORDS * n_blocks, refs_words)
    tl.store(out + pc.ESC_WORDS * n_blocks, esc_words)
    tl.store(out + pc.SEG_WORDS * n_blocks, tl.where(mode == _MODE_RAW, raw_words, body))
    tl.store(out + pc.N_GROUPS * n_blocks, tl.where(is_q, n_groups, 0))
    tl.store(out + pc.SENT_SYM * n_blocks, tl.where(is_q, n_sym, 0))
    tl.store(out + pc.STREAM_LZ * n_blocks, stream_lz.to(tl.int64))
    # format.DESCRIPTOR: rows, dim, dtype | mode << 8, seg_words, bound (float64 bits).
    enc = enc_ptr + b * ec.N_FIELDS
    value = tl.load(enc + ec.VALUE) != 0
    mode_byte = tl.where(is_q & value, mode | _MODE_VALUE, mode)  # format.descriptor_mode
    mode_byte = tl.where(is_q, mode_byte | _MODE_PACKED, mode_byte)
    bound = tl.load(enc + ec.BOUND_BITS)
    d0 = rows & 0xFFFFFFFF
    d1 = dim & 0xFFFFFFFF
    d2 = (tl.load(enc + ec.DTYPE) & 0xFF) | ((mode_byte & 0xFF) << 8)
    d3 = tl.where(mode == _MODE_RAW, raw_words, body) & 0xFFFFFFFF
    d4 = bound & 0xFFFFFFFF
    d5 = (bound >> 32) & 0xFFFFFFFF
    # format.SEGMENT_HEADER (format.segment_header_words): step, center, vectors sent,
    # escapes, values per group, groups, the checksum (0 here), ref_mode << 8 | width << 16.
    h0 = tl.where(is_q, tl.load(enc + ec.STEP_BITS), 0) & 0xFFFFFFFF
    h1 = tl.where(is_q, tl.load(enc + ec.CENTER), 0) & 0xFFFFFFFF
    h2 = n_sent & 0xFFFFFFFF
    h3 = n_escapes & 0xFFFFFFFF
    h4 = tl.where(is_q, GROUP, 0).to(tl.int64)
    h5 = tl.where(is_q, n_groups, 0) & 0xFFFFFFFF
    ref_byte = tl.where(has_refs, ref_mode, 0).to(tl.int64) & 0xFF
    h7 = (ref_byte << 8) | ((_bit_length(tl.maximum(n_sent - 1, 0), 32) & 0xFF) << 16)
    head = head_ptr + b * pc.HEAD_WORDS
    tl.store(head, d0)
    tl.store(head + 1, d1)
    tl.store(head + 2, d2)
    tl.store(head + 3, d3)
    tl.store(head + 4, d4)
    tl.store(head + 5, d5)
    tl.store(head + 6, h0)
    tl.store(head + 7, h1)
    tl.store(head + 8, h2)
    tl.store(head + 9, h3)
    tl.store(head + 10, h4)
    tl.store(head + 11, h5)
    tl.store(head + 12, h5 * 0)
    tl.store(head + 13, h7)
    # Their checksum sums (S0, and T = sum w_j (2 j + 1) over the record's words j).
    tl.store(out + pc.DESC_S0 * n_blocks, d0 + d1 + d2 + d3 + d4 + d5)
    tl.store(out + pc.DESC_T * n_blocks, d0 + 3 * d1 + 5 * d2 + 7 * d3 + 9 * d4 + 11 * d5)
    has_head = mode != _MODE_RAW
    tl.store(out + pc.HEAD_S0 * n_blocks, tl.where(has_head, h0 + h1 + h2 + h3 + h4 + h5 + h7, 0))
    head_t = h0 + 3 * h1 + 5 * h2 + 7 * h3 + 9 * h4 + 11 * h5 + 15 * h7
    tl.store(out + pc.HEAD_T * n_blocks, tl.where(has_head, head_t, 0))


def stream_plan(
    sym: torch.Tensor, rows: torch.Tensor, inputs: pc.PlanInputs, n_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every block's packed stream and mode, in one launch (one program per block, no sync):
    its stream (the host's ``_packed_plan``: its distinct rows where some repeat and
    vector-LZ may run, else every row), each of its group slots' width (the bit length of its
    largest zigzag code), first word in the block's codes and the block's escapes before it;
    then its mode by ``size_model`` over the exact segment words and what it sends.

    Args:
        sym: int16 symbols of every element (flat layout).
        rows: int64 per row: the quantized dedupe's first occurrences' rows
            (``device_compress.Dedupe.first_rows``).
        inputs: Per block, what the plan reads (``packed_columns.PlanInputs``).
        n_slots: Group slots of all blocks (``inputs.first_slot[-1]``, from the host tables).

    Returns:
        (int64 [3, n_slots]: each slot's width (0 past its block's stream), first word in its
        block's codes, escapes of its block before it; int64 [PLAN_FIELDS, n_blocks], the
        ``packed_columns`` plan fields; int64 [n_blocks, HEAD_WORDS] its descriptor and
        segment header words, the segment checksum 0).
    """
    i, nb = inputs, inputs.rows.shape[0]
    slots = torch.empty((3, n_slots), dtype=torch.int64, device=sym.device)
    plan = torch.empty((pc.PLAN_FIELDS, nb), dtype=torch.int64, device=sym.device)
    heads = torch.empty((nb, pc.HEAD_WORDS), dtype=torch.int64, device=sym.device)
    if nb:
        _plan_kernel[(nb,)](
            sym, rows, i.rows, i.dim, i.itemsize, i.elem_off, i.row_off, i.lz_allowed,
            i.raw_words, i.first_slot, i.grid, i.nu_q, i.nu_r, i.q_base, i.enc, slots, plan,
            heads, n_slots, nb, GB=_GROUPS_PER_PROGRAM, GROUP=_GROUP,
        )  # fmt: skip
    return slots, plan, heads


@triton.jit
def _rows_tile(
    t, bits_ptr, rows_ptr, rec_ptr, tile_ptr, buf_ptr, sums_ptr, n_blocks, TILE: tl.constexpr
):  # fmt: skip
    # Tile ``t`` (block, first word) of words: the block's raw rows (raw blocks), or its
    # distinct rows (lossless lz), fp32 one per word, 16-bit two per word (low half first);
    # their sums added to the block's, as ``_stream_group``'s.
    blk = tl.load(tile_ptr + 2 * t)
    w = tl.load(tile_ptr + 2 * t + 1) + tl.arange(0, TILE)
    n = tl.load(rec_ptr + blk * pc.N_FIELDS + pc.R_N)
    wide = tl.load(rec_ptr + blk * pc.N_FIELDS + pc.ITEMSIZE) == 4
    valid = w < tl.where(wide, n, (n + 1) // 2)
    blks = blk + w * 0
    e0 = tl.where(wide, w, 2 * w)
    src0 = _source(rows_ptr, rec_ptr, blks, e0, valid, pc.R_LZ, pc.R_BASE)
    b0 = tl.load(bits_ptr + src0, mask=valid, other=0).to(tl.int64)
    v1 = valid & ~wide & (2 * w + 1 < n)
    src1 = _source(rows_ptr, rec_ptr, blks, 2 * w + 1, v1, pc.R_LZ, pc.R_BASE)
    b1 = tl.load(bits_ptr + src1, mask=v1, other=0).to(tl.int64)
    value = tl.where(wide, b0 & 0xFFFFFFFF, (b0 & 0xFFFF) | ((b1 & 0xFFFF) << 16))
    at = tl.load(rec_ptr + blk * pc.N_FIELDS + pc.R_AT)
    tl.store(buf_ptr + at + w, value.to(buf_ptr.dtype.element_ty), mask=valid)
    v = tl.where(valid, value, 0)
    tl.atomic_add(sums_ptr + blk, tl.sum(v, axis=0))
    tl.atomic_add(sums_ptr + n_blocks + blk, tl.sum(v * (2 * (at + w) + 1), axis=0))


@triton.jit
def _refs_tile(
    t, ids_q_ptr, ids_r_ptr, rank_q_ptr, rank_r_ptr, rec_ptr, tile_ptr, buf_ptr, sums_ptr,
    n_blocks, TILE: tl.constexpr,
):  # fmt: skip
    # Tile ``t`` (block, first row) of rows: each row's vector reference, MSB-first at its bit
    # (fixed: row * width; flagged: a flag bit per row, the id after it for a repeat, so the
    # bit is the row plus width times the repeats before it, which the dedupe's ranks give),
    # added into the zeroed words (a reference spans at most two); the words' sums added to
    # the block's, as ``_stream_group``'s.
    blk = tl.load(tile_ptr + 2 * t)
    loc = tl.load(tile_ptr + 2 * t + 1) + tl.arange(0, TILE)
    f = rec_ptr + blk * pc.N_FIELDS
    valid = loc < tl.load(f + pc.REF_ROWS)
    qlz = tl.load(f + pc.REF_QLZ) == 1
    row_off = tl.load(f + pc.ROW_OFF)
    row = row_off + loc
    # First occurrences before the row in its block, and whether it is one (exclusive ranks).
    r0 = tl.load(tl.where(qlz, rank_q_ptr, rank_r_ptr) + row_off)
    rk = tl.load(tl.where(qlz, rank_q_ptr, rank_r_ptr) + row, mask=valid, other=0)
    rk1 = tl.load(tl.where(qlz, rank_q_ptr, rank_r_ptr) + row + 1, mask=valid, other=0)
    ids = tl.load(tl.where(qlz, ids_q_ptr, ids_r_ptr) + row, mask=valid, other=0)
    flagged = tl.load(f + pc.REF_MODE) == 1
    width = tl.load(f + pc.REF_WIDTH)
    lead = flagged & (rk1 - rk == 1)  # a first occurrence: its flag bit alone
    r_len = tl.where(lead, 1, width + flagged.to(tl.int64))
    r_val = tl.where(lead, 1, ids)
    pos = tl.where(flagged, loc + (loc - (rk - r0)) * width, loc * width)
    end = pos % 32 + r_len
    head = (
        tl.where(end <= 32, r_val << tl.maximum(32 - end, 0), r_val >> tl.maximum(end - 32, 0))
        & 0xFFFFFFFF
    )
    at = tl.load(f + pc.REFS_AT) + pos // 32
    word = buf_ptr.dtype.element_ty
    live = valid & (r_len > 0)
    tl.atomic_add(buf_ptr + at, head.to(word), mask=live)
    spill = live & (end > 32)
    tail = (r_val << tl.minimum(tl.maximum(64 - end, 0), 63)) & 0xFFFFFFFF
    tl.atomic_add(buf_ptr + at + 1, tail.to(word), mask=spill)
    h = tl.where(live, head, 0)
    g = tl.where(spill, tail, 0)
    tl.atomic_add(sums_ptr + blk, tl.sum(h + g, axis=0))
    tl.atomic_add(sums_ptr + n_blocks + blk, tl.sum(h * (2 * at + 1) + g * (2 * at + 3), axis=0))


@triton.jit
def _put_data_kernel(
    sym_ptr, bits_ptr, q_rows_ptr, r_rows_ptr, ids_q_ptr, ids_r_ptr, rank_q_ptr, rank_r_ptr,
    rec_ptr, slot_ptr, width_ptr, esc_ptr, off_ptr, tile_ptr, ref_tile_ptr, buf_ptr, sums_ptr,
    n_slots, n_stream, n_row_tiles, n_blocks, GB: tl.constexpr, GROUP: tl.constexpr,
    TILE: tl.constexpr,
):  # fmt: skip
    # The first n_stream programs write the packed streams (GB slots each), the next
    # n_row_tiles one tile of raw rows each, the others one tile of rows' references each:
    # every data-sized section in one launch.
    pid = tl.program_id(0).to(tl.int64)
    if pid < n_stream:
        _stream_group(
            pid, sym_ptr, bits_ptr, q_rows_ptr, rec_ptr, slot_ptr, width_ptr, esc_ptr, off_ptr,
            buf_ptr, sums_ptr, n_slots, n_blocks, GB, GROUP,
        )  # fmt: skip
    elif pid < n_stream + n_row_tiles:
        _rows_tile(
            pid - n_stream, bits_ptr, r_rows_ptr, rec_ptr, tile_ptr, buf_ptr, sums_ptr, n_blocks,
            TILE,
        )  # fmt: skip
    else:
        _refs_tile(
            pid - n_stream - n_row_tiles, ids_q_ptr, ids_r_ptr, rank_q_ptr, rank_r_ptr, rec_ptr,
            ref_tile_ptr, buf_ptr, sums_ptr, n_blocks, TILE,
        )  # fmt: skip


def put_data(
    buf: torch.Tensor, sym: torch.Tensor, bits: torch.Tensor, dedupes: PutDedupes,
    rec: torch.Tensor, slots: torch.Tensor, stream: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tiles: tuple[torch.Tensor, torch.Tensor], tile: int,
) -> torch.Tensor:  # fmt: skip
    """Writes every data-sized section into the zeroed payload words, in one launch: each
    packed block's width bytes, codes and escapes, the vector references of the blocks that
    send them (added: integer adds of disjoint bits), the raw blocks' rows and the lossless lz
    blocks' distinct rows (stored: one writer per word); and per block the sums that give any
    checksum over its words without reading them back (``sum_j w_j (2 j + 1)`` over words
    ``o ..`` is ``S1 - 2 o S0``).

    Args:
        buf: int32 payload words (or int64 lanes holding uint32 words).
        sym: int16 symbols of every element.
        bits: int32 raw bits of every element (16-bit dtypes sign-extended).
        dedupes: Both dedupes' per-row tables (``packed_columns.PutDedupes``).
        rec: int64 [n_blocks, N_FIELDS]; read: ``ELEM_OFF``, ``ROW_OFF``, ``DIM``,
            ``N_SYM`` (0 where a block is not sent packed), ``Q_LZ``, ``Q_BASE``,
            ``TABLE_AT``, ``CODES_AT``, ``ESCP_AT``, ``ESCB_AT``, ``ITEMSIZE``, ``R_N``,
            ``R_LZ``, ``R_BASE``, ``R_AT``, ``REFS_AT``, ``REF_ROWS``, ``REF_QLZ``,
            ``REF_MODE``, ``REF_WIDTH``.
        slots: int64 [n_slots, 2] (block, group in the block) of every group slot.
        stream: int64 [n_slots] each: widths (:func:`stream_plan`), the first word of each
            slot's codes in its block's codes, the escapes of its block before it.
        tiles: int64 [n_tiles, 2] (block, first word) covering each block's raw words, and
            int64 [n_ref_tiles, 2] (block, first row) covering the rows of every block that
            may send references.
        tile: Words (rows) per tile (a power of two).

    Returns:
        int64 [2, n_blocks]: per block, S0 the sum of the (uint32) words written, S1 their sum
        weighted by ``2 a + 1`` for word ``a`` of ``buf`` (both wrapping).
    """
    n, gb, n_blocks = slots.shape[0], _GROUPS_PER_PROGRAM, rec.shape[0]
    n_stream = triton.cdiv(n, gb)
    row_tiles, ref_tiles = tiles
    grid = n_stream + row_tiles.shape[0] + ref_tiles.shape[0]
    sums = torch.zeros(2, n_blocks, dtype=torch.int64, device=buf.device)
    if grid:
        widths, code_off, esc_base = stream
        d = dedupes
        _put_data_kernel[(grid,)](
            sym, bits, d.q_rows, d.r_rows, d.q_ids, d.r_ids, d.q_rank, d.r_rank, rec, slots,
            widths, esc_base, code_off, row_tiles, ref_tiles, buf, sums, n, n_stream,
            row_tiles.shape[0], n_blocks, GB=gb, GROUP=_GROUP, TILE=tile,
        )  # fmt: skip
    return sums


# The @triton.jit kernels by name, for the ahead-of-time compile check (``kernels/_aot.py``).
JIT_KERNELS = {
    "checksum_kernel": _checksum_kernel,
    "widths_kernel": _widths_kernel,
    "check_groups_kernel": _check_groups_kernel,
    "status_kernel": _status_kernel,
    "plan_kernel": _plan_kernel,
    "put_data_kernel": _put_data_kernel,
}

__all__ = [
    "check_groups",
    "packed_checksums",
    "packed_code",
    "packed_status",
    "packed_symbol",
    "packed_widths",
    "put_data",
    "stream_plan",
]
