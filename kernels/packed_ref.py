"""Torch twin of the packed format's coded values (docs/format.md, "Packed segments"), and of
``kernels/packed.py``'s decode launchers (same names, signatures and outputs bit for bit).

The oracle of ``codec/packed.py``'s numba stream (``put_stream`` / ``decode_stream``, the host
path) and the statement a device kernel follows: every step is element-wise or per group of
``PACKED_GROUP`` values, the only cross-group step an exclusive prefix sum of the widths, so
each group's words go to their offset with no sort, no atomics and no worst-case buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import encode_columns as ec
from torchrec_lossy.codec import packed_columns as pc
from torchrec_lossy.codec import size_model as sm
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.encode_columns import GRID_OK, EncodeColumns
from torchrec_lossy.codec.format import (
    DECODE_BAD_CHECKSUM,
    DECODE_BAD_PACKED_CODE,
    DECODE_BAD_PACKED_ESCAPES,
    DECODE_BAD_WIDTH,
    DESCRIPTOR,
    DESCRIPTOR_WORDS,
    ESCAPE_SYMBOL,
    MODE_LZ,
    MODE_PACKED,
    MODE_QUANT,
    MODE_QUANT_LZ,
    MODE_RAW,
    PACKED_GROUP,
    PACKED_MAX_WIDTH,
    REFS_OUT_OF_RANGE,
    SEGMENT_HEADER_WORDS,
    SYMBOL_OFFSET,
    descriptor_mode,
    pack_records,
    ref_width,
    reference_words,
    refs_packing,
    segment_header_words,
    unzigzag,
    words_for_bits,
    words_for_bytes,
    zigzag,
)
from torchrec_lossy.codec.launch_tables import NO_FAILURE

_M32 = 0xFFFFFFFF


def _bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bit lengths of int64 values in [0, 2**24) (exact in float32's log2 there)."""
    return torch.where(x > 0, torch.floor(torch.log2(x.float())).long() + 1, 0)


def pack_codes(symbols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The width bytes and packed code words of one block's sent symbols.

    Args:
        symbols: int64 [n] symbols of the values sent, in order (``ESCAPE_SYMBOL`` where
            escaped: code 0).

    Returns:
        (uint8 [ceil(n / PACKED_GROUP)] widths; int64 [sum of widths] code words, each in
        [0, 2**32)).
    """
    n = symbols.shape[0]
    n_groups = -(-n // PACKED_GROUP)
    codes = torch.where(symbols == ESCAPE_SYMBOL, 0, zigzag(symbols))
    padded = torch.zeros(n_groups * PACKED_GROUP, dtype=torch.int64, device=symbols.device)
    padded[:n] = codes
    widths = _bit_length(padded.view(n_groups, PACKED_GROUP).amax(dim=1))
    first_word = torch.cumsum(widths, 0) - widths  # each group's offset: a prefix sum
    total = int(widths.sum())
    k = torch.arange(n_groups * PACKED_GROUP, device=symbols.device)
    group = k // PACKED_GROUP
    bit = first_word[group] * 32 + (k % PACKED_GROUP) * widths[group]
    word, shift = bit >> 5, bit & 31
    # A code spans at most two words; bits never overlap, so adding is OR-ing.
    words = torch.zeros(total + 1, dtype=torch.int64, device=symbols.device)
    words.index_add_(0, word, (padded << shift) & _M32)
    words.index_add_(0, word + 1, padded >> (32 - shift))
    return widths.to(torch.uint8), words[:total]


def unpack_codes(widths: torch.Tensor, words: torch.Tensor, n: int) -> torch.Tensor:
    """The symbols of ``n`` packed values (the mirror of :func:`pack_codes`; the widths and
    codes are assumed valid: the host decoder is the one that checks).

    Args:
        widths: uint8 [ceil(n / PACKED_GROUP)] widths.
        words: int64 code words (values in [0, 2**32)).
        n: Values.

    Returns:
        int64 [n] symbols (escaped positions decode as ``SYMBOL_OFFSET``, code 0).
    """
    w = widths.to(torch.int64)
    first_word = torch.cumsum(w, 0) - w
    k = torch.arange(n, device=words.device)
    group = k // PACKED_GROUP
    bit = first_word[group] * 32 + (k % PACKED_GROUP) * w[group]
    word, shift = bit >> 5, bit & 31
    padded = torch.cat([words, torch.zeros(1, dtype=torch.int64, device=words.device)])
    pair = padded[word.clamp(max=words.shape[0])] | (
        padded[(word + 1).clamp(max=words.shape[0])] << 32
    )
    return unzigzag((pair >> shift) & ((1 << w[group]) - 1))


def segment_checksum(words: torch.Tensor) -> int:
    """``sum_j w_j * (2 j + 1) mod 2**32`` (``codec/packed.py``'s ``segment_checksum``).

    Args:
        words: int64 words (values in [0, 2**32)).

    Returns:
        The checksum.
    """
    j = torch.arange(words.shape[0], device=words.device)
    return int(((words * (2 * j + 1)) & _M32).sum() & _M32)


# ---- twins of kernels/packed.py's decode launchers ---------------------------------------------


def packed_checksums(words: torch.Tensor, tiles: torch.Tensor, tile: int) -> torch.Tensor:
    """Twin of ``kernels.packed.packed_checksums``.

    Args:
        words: int32 payload words.
        tiles: int64 [n_tiles, 3] (first word, its index in its segment, words <= ``tile``).
        tile: Words per tile.

    Returns:
        int64 [n_tiles] partial sums (wrapping).
    """
    lane = torch.arange(tile, device=words.device)
    mask = lane[None, :] < tiles[:, 2:3]
    at = torch.where(mask, tiles[:, :1] + lane, 0)
    w = words[at].to(torch.int64) & _M32
    return torch.where(mask, w * (2 * (tiles[:, 1:2] + lane) + 1), 0).sum(dim=1)


def _group_blocks(cols: DecodeColumns, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per global group, its block and its index in the block."""
    chunk_base = cols.column(dc.CHUNK_BASE)
    g = torch.arange(n_groups, device=chunk_base.device)
    b = (torch.searchsorted(chunk_base, g, right=True) - 1).clamp(0, cols.n_blocks - 1)
    return b, g - chunk_base[b]


def packed_widths(words: torch.Tensor, cols: DecodeColumns, n_groups: int) -> torch.Tensor:
    """Twin of ``kernels.packed.packed_widths`` (its docstring has the contract).

    Args:
        words: int32 payload words.
        cols: The blocks' decode record (``TABLE_BAD`` and ``ESC_BAD`` written).
        n_groups: Groups of all blocks.

    Returns:
        int16 [n_groups] widths.
    """
    if not n_groups:
        return torch.zeros(0, dtype=torch.int16, device=words.device)
    b, cl = _group_blocks(cols, n_groups)
    ct = cols.column(dc.CT_OFF)[b]
    word = words[ct + cl // 4].to(torch.int64) & _M32
    w = (word >> ((cl % 4) * 8)) & 0xFF
    table_bad, esc_bad = cols.column(dc.TABLE_BAD), cols.column(dc.ESC_BAD)
    over = w > PACKED_MAX_WIDTH
    table_bad.scatter_reduce_(0, b[over], torch.ones_like(b[over]), "amax")
    sym_base = cols.column(dc.SYM_BASE)
    n_sym = (sym_base[1:] - sym_base[:-1])[b]
    n_esc, pos_at = cols.column(dc.N_ESC)[b], cols.column(dc.ESC_POS_OFF)[b]
    k = cl[:, None] * PACKED_GROUP + torch.arange(PACKED_GROUP, device=words.device)
    listed = k < n_esc[:, None]
    pos = torch.where(listed, words[torch.where(listed, pos_at[:, None] + k, 0)], 0)
    before = listed & (k > 0)
    prev = words[torch.where(before, pos_at[:, None] + k - 1, 0)].to(torch.int64) & _M32
    prev = torch.where(before, prev, -1)
    pos = pos.to(torch.int64) & _M32
    bad = listed & ((pos >= n_sym[:, None]) | (pos <= prev))
    blk = b[:, None].expand_as(k)
    esc_bad.scatter_reduce_(0, blk[bad], k[bad], "amin")
    return w.to(torch.int16)


class PackedValues(NamedTuple):
    """Every sent value of every packed block, as ``kernels.packed.packed_code`` reads them
    ([n_groups, PACKED_GROUP] lanes)."""

    block: torch.Tensor  # each lane's block
    index: torch.Tensor  # its value in the block
    valid: torch.Tensor  # whether it is one of the block's values
    code: torch.Tensor  # its code
    before: torch.Tensor  # listed escapes at or before it
    found: torch.Tensor  # whether it is listed
    short: torch.Tensor  # per group: the block's last, and its widths' sum is not the codes'


def packed_values(
    words: torch.Tensor, cols: DecodeColumns, widths: torch.Tensor, ends: torch.Tensor
) -> PackedValues:
    """Every packed value's code and escape (``packed_code`` over all groups at once).

    Args:
        words: int32 payload words.
        cols: The blocks' decode record.
        widths: int16 [n_groups] widths.
        ends: int32 [n_groups] their inclusive prefix sum.

    Returns:
        The lanes (:class:`PackedValues`).
    """
    dev = words.device
    n_groups = widths.shape[0]
    w, ends = widths.to(torch.int64), ends.to(torch.int64)
    b, cl = _group_blocks(cols, n_groups)
    chunk_base = cols.column(dc.CHUNK_BASE)
    g0, g1 = chunk_base[b], chunk_base[b + 1]
    first = ends[g0] - w[g0]
    off = ends - w - first
    bs, bs_words = cols.column(dc.BS_OFF)[b], cols.column(dc.BS_WORDS)[b]
    short = (torch.arange(n_groups, device=dev) == g1 - 1) & (off + w != bs_words)
    sym_base = cols.column(dc.SYM_BASE)
    n_sym = sym_base[b + 1] - sym_base[b]
    j = torch.arange(PACKED_GROUP, device=dev)
    i = cl[:, None] * PACKED_GROUP + j
    valid = i < n_sym[:, None]
    wc = w.clamp(max=32)[:, None]
    bit = off[:, None] * 32 + j * wc
    at = bit >> 5
    lo_ok = valid & (wc > 0) & (at < bs_words[:, None])
    hi_ok = valid & (wc > 0) & (at + 1 < bs_words[:, None])
    lo = torch.where(lo_ok, words[torch.where(lo_ok, bs[:, None] + at, 0)], 0).to(torch.int64)
    hi = torch.where(hi_ok, words[torch.where(hi_ok, bs[:, None] + at + 1, 0)], 0).to(torch.int64)
    code = (((lo & _M32) | ((hi & _M32) << 32)) >> (bit & 31)) & ((1 << wc) - 1)
    # Escapes: listed positions <= i, counted over the block's list (the kernel searches it).
    n_esc, pos_at = cols.column(dc.N_ESC), cols.column(dc.ESC_POS_OFF)
    before = torch.zeros_like(i)
    found = torch.zeros_like(valid)
    for blk in torch.unique(b).tolist():
        ne, at0 = int(n_esc[blk]), int(pos_at[blk])
        if ne == 0:
            continue
        pos = words[at0 : at0 + ne].to(torch.int64) & _M32
        rows = b == blk
        c = torch.searchsorted(pos, i[rows], right=True)
        before[rows] = c
        found[rows] = (c > 0) & (pos[(c - 1).clamp(min=0)] == i[rows])
    block = b[:, None].expand_as(i)
    return PackedValues(block, i, valid, code, before, found & valid, short)


def check_groups(
    words: torch.Tensor, cols: DecodeColumns, widths: torch.Tensor, ends: torch.Tensor,
    esc_iter: int,
) -> None:  # fmt: skip
    """Twin of ``kernels.packed.check_groups`` (its docstring has the contract).

    Args:
        words: int32 payload words.
        cols: The blocks' decode record (``TABLE_BAD``, ``FAIL``, ``ESC_BAD`` written).
        widths: int16 [n_groups] widths.
        ends: int32 [n_groups] their inclusive prefix sum.
        esc_iter: Binary-search steps (unused: the twin counts directly).
    """
    if not widths.shape[0]:
        return
    v = packed_values(words, cols, widths, ends)
    short_blk = v.block[:, 0][v.short]
    cols.column(dc.TABLE_BAD).scatter_reduce_(0, short_blk, torch.ones_like(short_blk), "amax")
    bad = v.valid & (v.code > 2 * SYMBOL_OFFSET)
    cols.column(dc.FAIL).scatter_reduce_(0, v.block[bad], v.index[bad], "amin")
    esc_bad = v.found & (v.code != 0)
    cols.column(dc.ESC_BAD).scatter_reduce_(0, v.block[esc_bad], v.index[esc_bad], "amin")


def symbols_and_ranks(
    words: torch.Tensor, cols: DecodeColumns, widths: torch.Tensor, ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed blocks' sent symbols and escape ranks, as a Huffman decode gives them
    (``quantize_ref.decode_packed_outputs`` feeds them to ``decode_outputs``).

    Args:
        words: int32 payload words.
        cols: The blocks' decode record.
        widths: int16 [n_groups] widths.
        ends: int32 [n_groups] their inclusive prefix sum.

    Returns:
        (int16 symbols, ``ESCAPE_SYMBOL`` where listed; int32 inclusive escape ranks), over
        ``SYM_BASE``'s total.
    """
    sym_base = cols.column(dc.SYM_BASE)
    n = int(sym_base[-1])
    sym_out = torch.zeros(max(n, 1), dtype=torch.int16, device=words.device)
    rank_out = torch.zeros(max(n, 1), dtype=torch.int32, device=words.device)
    if not widths.shape[0]:
        return sym_out, rank_out
    v = packed_values(words, cols, widths, ends)
    sym = torch.where(v.found, ESCAPE_SYMBOL, unzigzag(v.code))
    n_esc = cols.column(dc.N_ESC)
    esc_before = (torch.cumsum(n_esc, 0) - n_esc)[v.block]
    dest = (sym_base[v.block] + v.index)[v.valid]
    sym_out[dest] = sym[v.valid].to(torch.int16)
    rank_out[dest] = (esc_before + v.before)[v.valid].to(torch.int32)
    return sym_out, rank_out


def packed_status(cols: DecodeColumns, sums: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.packed.packed_status``: each packed block's status in the CPU
    decoder's order: its references, then its checksum, its widths, a code, its escapes.

    Args:
        cols: The decode record after the packed stages (status rows ``REFS_BAD``, ``TABLE_BAD``,
            ``FAIL``, ``ESC_BAD``).
        sums: int64 [n_blocks] checksums of the segments' words (low 32 bits compared with the
            header's ``sym_lo | sym_count << 16``).

    Returns:
        int32 [n_blocks]: 0, ``REFS_OUT_OF_RANGE`` or a packed ``DECODE_*`` code (0 for blocks
        without codes).
    """
    stored = cols.column(dc.SYM_LO) | (cols.column(dc.SYM_COUNT) << 16)
    code = torch.where(cols.column(dc.ESC_BAD) != NO_FAILURE, DECODE_BAD_PACKED_ESCAPES, 0)
    code = torch.where(cols.column(dc.FAIL) != NO_FAILURE, DECODE_BAD_PACKED_CODE, code)
    code = torch.where(cols.column(dc.TABLE_BAD) != 0, DECODE_BAD_WIDTH, code)
    code = torch.where((sums & _M32) != stored, DECODE_BAD_CHECKSUM, code)
    code = torch.where(cols.column(dc.HAS_STREAM) != 0, code, 0)
    return torch.where(cols.column(dc.REFS_BAD) != 0, REFS_OUT_OF_RANGE, code).to(torch.int32)


# ---- twins of kernels/packed.py's encode launchers ---------------------------------------------


def _source(
    rows: torch.Tensor, f: torch.Tensor, e: torch.Tensor, valid: torch.Tensor, lz: int, base: int
) -> torch.Tensor:
    """Per lane, the flat element value ``e`` of its block's sent rows reads (``f``: the lanes'
    block records, [n, N_FIELDS]); 0 where not ``valid``."""
    dim = f[:, pc.DIM, None]
    vec = e // dim
    is_lz = f[:, lz, None] == 1
    first = rows[torch.where(valid & is_lz, f[:, base, None] + vec, 0)]
    local = torch.where(is_lz, first - f[:, pc.ROW_OFF, None], vec)
    return torch.where(valid, f[:, pc.ELEM_OFF, None] + local * dim + (e - vec * dim), 0)


def _stream_lanes(
    sym: torch.Tensor, rows: torch.Tensor, rec: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per slot x 32 lanes: (block records, value index, element read, escape, zigzag code)."""
    f = rec[slots[:, 0]]
    v = slots[:, 1:2] * PACKED_GROUP + torch.arange(PACKED_GROUP, device=sym.device)
    valid = v < f[:, pc.N_SYM, None]
    elem = _source(rows, f, v, valid, pc.Q_LZ, pc.Q_BASE)
    symbol = torch.where(valid, sym[elem].to(torch.int64) & 0xFFFF, 0)
    esc = valid & (symbol == ESCAPE_SYMBOL)
    return f, v, elem, esc, torch.where(valid & ~esc, zigzag(symbol), 0)


def _stream_widths(
    sym: torch.Tensor, rows: torch.Tensor, rec: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group slot (block, group in it): its width (0 for an unused slot) and escapes."""
    if not slots.shape[0]:
        empty = torch.zeros(0, dtype=torch.int64, device=sym.device)
        return empty, empty
    _, _, _, esc, code = _stream_lanes(sym, rows, rec, slots)
    top = code.amax(dim=1)
    shifts = torch.arange(PACKED_MAX_WIDTH, device=sym.device)
    return ((top[:, None] >> shifts) > 0).sum(dim=1), esc.sum(dim=1)


def _bases(counts: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums with the total appended."""
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])


def stream_plan(
    sym: torch.Tensor, rows: torch.Tensor, inputs: pc.PlanInputs, n_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of ``kernels.packed.stream_plan`` (its docstring has the contract): the group
    slots' widths and escapes, their prefix sums, the host's ``_packed_plan`` and
    ``size_model``'s mode choice over ``[n_blocks]`` tensors.

    Args:
        sym: int16 symbols of every element.
        rows: int64 first occurrences' rows of the quantized dedupe.
        inputs: Per block, what the plan reads.
        n_slots: Group slots of all blocks (``inputs.first_slot[-1]``).

    Returns:
        (int64 [3, n_slots]: widths, first word in the block's codes, escapes of the block
        before it; int64 [PLAN_FIELDS, n_blocks]; int64 [n_blocks, HEAD_WORDS]).
    """
    i, dev = inputs, sym.device
    nb = i.rows.shape[0]
    ok = i.grid[:, GRID_OK] == 1
    lz_allowed = i.lz_allowed == 1
    plan_lz = ok & lz_allowed & (i.nu_q < i.rows)
    n_sym = torch.where(ok, torch.where(plan_lz, i.nu_q, i.rows) * i.dim, 0)
    cols = [torch.zeros_like(i.rows)] * pc.N_FIELDS
    cols[pc.ELEM_OFF], cols[pc.ROW_OFF], cols[pc.DIM] = i.elem_off, i.row_off, i.dim.clamp(min=1)
    cols[pc.N_SYM], cols[pc.Q_LZ], cols[pc.Q_BASE] = n_sym, plan_lz.long(), i.q_base
    first = i.first_slot
    blk = torch.repeat_interleave(
        torch.arange(nb, device=dev), first[1:] - first[:-1], output_size=n_slots
    )
    slots = torch.stack([blk, torch.arange(n_slots, device=dev) - first[blk]], dim=1)
    widths, esc = _stream_widths(sym, rows, torch.stack(cols, dim=1), slots)
    w_before, e_before = _bases(widths), _bases(esc)
    n_groups = (n_sym + PACKED_GROUP - 1) // PACKED_GROUP
    n_esc = e_before[first[1:]] - e_before[first[:-1]]
    stream_words = words_for_bytes(n_groups) + w_before[first[1:]] - w_before[first[:-1]]
    # The mode (size_model: the host's _choose_lossy over the packed segments' exact words).
    rows_, dim, itemsize = i.rows, i.dim, i.itemsize
    quant_w = sm.quant_words(n_esc, itemsize, stream_words)
    qlz_w = sm.quant_lz_words(rows_, i.nu_q.clamp(min=1), n_esc, itemsize, stream_words)
    mode, best = sm.choose_lossy(i.raw_words, ok & ~plan_lz, quant_w, plan_lz, qlz_w)
    nu_lower = torch.where(ok & lz_allowed, i.nu_q.clamp(min=1), 1)
    tried = sm.lossless_may_win(lz_allowed, rows_, dim, itemsize, nu_lower, best)
    lossless_w = sm.lossless_lz_words(rows_, i.nu_r.clamp(min=1), dim, itemsize)
    mode = sm.choose_lossless(mode, best, tried, lossless_w, rows_ * dim)
    # What it sends and its segment's sections (device_compress.sections: no codebook, no
    # chunk table; the widths and codes are the stream).
    is_q = (mode == MODE_QUANT) | (mode == MODE_QUANT_LZ)
    is_qlz, is_lz = mode == MODE_QUANT_LZ, mode == MODE_LZ
    has_refs = is_qlz | is_lz
    n_sent = torch.where(is_qlz, i.nu_q, torch.where(is_lz, i.nu_r, rows_))
    ref_mode, _, ref_bits = refs_packing(rows_, torch.where(has_refs, n_sent, 1))
    n_escapes = torch.where(is_q, n_esc, 0)
    esc_words = sm.escape_words(n_escapes, itemsize)
    refs_words = torch.where(has_refs, words_for_bits(ref_bits), 0)
    uniq_words = torch.where(is_lz, words_for_bytes(i.nu_r * dim * itemsize), 0)
    body = SEGMENT_HEADER_WORDS + refs_words + uniq_words + esc_words
    body = body + torch.where(is_q, stream_words, 0)
    fields = {
        pc.MODE: mode,
        pc.IS_Q: is_q,
        pc.IS_QLZ: is_qlz,
        pc.IS_LZ: is_lz,
        pc.HAS_REFS: has_refs,
        pc.N_SENT: n_sent,
        pc.N_ESCAPES: n_escapes,
        pc.PLAN_REF_MODE: torch.where(has_refs, ref_mode, 0),
        pc.PLAN_REF_WIDTH: ref_width(n_sent),
        pc.REFS_WORDS: refs_words,
        pc.ESC_WORDS: esc_words,
        pc.SEG_WORDS: torch.where(mode == MODE_RAW, i.raw_words, body),
        pc.N_GROUPS: torch.where(is_q, n_groups, 0),
        pc.SENT_SYM: torch.where(is_q, n_sym, 0),
        pc.STREAM_LZ: plan_lz,
    }
    fields.update(dict.fromkeys((pc.DESC_S0, pc.DESC_T, pc.HEAD_S0, pc.HEAD_T), mode))  # below
    plan = torch.stack([fields[f].to(torch.int64) for f in range(pc.PLAN_FIELDS)])
    heads = _heads(inputs, plan)
    k = torch.arange(pc.HEAD_WORDS, device=dev)
    desc = k < DESCRIPTOR_WORDS
    j = 2 * torch.where(desc, k, k - DESCRIPTOR_WORDS) + 1  # 2 j + 1, j its word in its record
    head = (mode != MODE_RAW)[:, None] & ~desc  # a raw block has no segment header
    for f, keep, weight in ((pc.DESC_S0, desc, 1), (pc.DESC_T, desc, j), (pc.HEAD_S0, head, 1),
                            (pc.HEAD_T, head, j)):  # fmt: skip
        plan[f] = torch.where(keep, heads * weight, 0).sum(dim=1)
    s_first = first[blk]
    code_off = w_before[:-1] - w_before[s_first]
    slot_cols = torch.stack([widths, code_off, e_before[:-1] - e_before[s_first]])
    return slot_cols, plan, heads


def _heads(inputs: pc.PlanInputs, plan: torch.Tensor) -> torch.Tensor:
    """Every block's descriptor and segment header words (``format.DESCRIPTOR``,
    ``segment_header_words``; the checksum field 0), as ``device_compress``'s writers."""
    enc = EncodeColumns(inputs.enc, inputs.rows.shape[0])
    mode, is_q = plan[pc.MODE], plan[pc.IS_Q] == 1
    mode_byte = descriptor_mode(mode, enc.column(ec.VALUE))
    desc = {
        "rows": inputs.rows,
        "dim": inputs.dim,
        "dtype": enc.column(ec.DTYPE),
        "mode": torch.where(is_q, mode_byte | MODE_PACKED, mode_byte),
        "seg_words": plan[pc.SEG_WORDS],
        "bound": enc.column(ec.BOUND_BITS),
    }
    zero = torch.zeros_like(mode)
    fields = (
        torch.where(is_q, enc.floats(ec.STEP_BITS), 0.0),
        torch.where(is_q, enc.column(ec.CENTER), 0),
        plan[pc.N_SENT],
        plan[pc.N_ESCAPES],
        torch.where(is_q, PACKED_GROUP, 0),
        plan[pc.N_GROUPS],
        zero,
        zero,
        zero,
        plan[pc.PLAN_REF_MODE],
        plan[pc.PLAN_REF_WIDTH],
    )
    head = torch.stack([w.to(torch.int64) for w in segment_header_words(fields)], dim=1)
    return torch.cat([pack_records(DESCRIPTOR, desc), head], dim=1)


def _add(
    buf: torch.Tensor, at: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
    sums: torch.Tensor, blk: torch.Tensor,
) -> None:  # fmt: skip
    """Adds ``value`` (uint32 words) at word ``at`` where ``mask`` (0 at word 0 elsewhere: no
    change), and to block ``blk``'s sums ``value`` and ``value * (2 at + 1)``."""
    value = torch.where(mask, value, 0)
    buf.index_add_(0, torch.where(mask, at, 0).reshape(-1), value.reshape(-1).to(buf.dtype))
    blk = blk.expand(value.shape).reshape(-1)
    sums[0].index_add_(0, blk, value.reshape(-1))
    sums[1].index_add_(0, blk, (value * (2 * at + 1)).reshape(-1))


def _put_stream(
    buf: torch.Tensor, sym: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor,
    rec: torch.Tensor, slots: torch.Tensor, widths: torch.Tensor, code_off: torch.Tensor,
    esc_base: torch.Tensor, sums: torch.Tensor,
) -> None:  # fmt: skip
    """The packed streams' part of :func:`put_data`."""
    if not slots.shape[0]:
        return
    f, v, elem, esc, code = _stream_lanes(sym, rows, rec, slots)
    k, w, blk = slots[:, 1], widths, slots[:, 0]
    used = k * PACKED_GROUP < f[:, pc.N_SYM]
    _add(buf, f[:, pc.TABLE_AT] + k // 4, w << (8 * (k % 4)), used, sums, blk)
    blk = blk[:, None]
    bit = 32 * code_off[:, None] + (v - k[:, None] * PACKED_GROUP) * w[:, None]
    at, sh = f[:, pc.CODES_AT, None] + bit // 32, bit % 32
    live = code != 0
    _add(buf, at, (code << sh) & _M32, live, sums, blk)
    spill = live & (sh + w[:, None] > 32)
    _add(buf, at + 1, code >> torch.where(spill, 32 - sh, 0), spill, sums, blk)
    e = esc.to(torch.int64)
    rank = esc_base[:, None] + torch.cumsum(e, dim=1) - e
    _add(buf, f[:, pc.ESCP_AT, None] + rank, v, esc, sums, blk)
    raw = bits[elem].to(torch.int64)
    wide = f[:, pc.ITEMSIZE, None] == 4
    value = torch.where(wide, raw & _M32, (raw & 0xFFFF) << (16 * (rank % 2)))
    at = f[:, pc.ESCB_AT, None] + torch.where(wide, rank, rank // 2)
    _add(buf, at, value, esc, sums, blk)


def _put_rows(
    buf: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor, rec: torch.Tensor,
    tiles: torch.Tensor, tile: int, sums: torch.Tensor,
) -> None:  # fmt: skip
    """The raw rows' part of :func:`put_data` (their words still 0)."""
    if not tiles.shape[0]:
        return
    f = rec[tiles[:, 0]]
    w = tiles[:, 1:2] + torch.arange(tile, device=bits.device)
    n, wide = f[:, pc.R_N, None], f[:, pc.ITEMSIZE, None] == 4
    valid = w < torch.where(wide, n, (n + 1) // 2)
    b0 = bits[_source(rows, f, torch.where(wide, w, 2 * w), valid, pc.R_LZ, pc.R_BASE)]
    v1 = valid & ~wide & (2 * w + 1 < n)
    b1 = bits[_source(rows, f, 2 * w + 1, v1, pc.R_LZ, pc.R_BASE)].to(torch.int64)
    b0 = b0.to(torch.int64)
    value = torch.where(wide, b0 & _M32, (b0 & 0xFFFF) | torch.where(v1, (b1 & 0xFFFF) << 16, 0))
    _add(buf, f[:, pc.R_AT, None] + w, value, valid, sums, tiles[:, :1])


def _put_refs(
    buf: torch.Tensor, d: pc.PutDedupes, rec: torch.Tensor, tiles: torch.Tensor, tile: int,
    sums: torch.Tensor,
) -> None:  # fmt: skip
    """The references' part of :func:`put_data` (every block's rows at once)."""
    if not tiles.shape[0]:
        return
    f = rec[tiles[:, 0]]
    loc = tiles[:, 1:2] + torch.arange(tile, device=buf.device)
    valid = loc < f[:, pc.REF_ROWS, None]
    qlz = f[:, pc.REF_QLZ, None] == 1
    row_off = f[:, pc.ROW_OFF, None]
    row = torch.where(valid, row_off + loc, 0)
    rank = torch.where(qlz, d.q_rank[row], d.r_rank[row])
    lead = (torch.where(qlz, d.q_rank[row + 1], d.r_rank[row + 1]) - rank) == 1
    before = rank - torch.where(qlz, d.q_rank[row_off], d.r_rank[row_off])
    flagged = f[:, pc.REF_MODE, None] == 1
    width = f[:, pc.REF_WIDTH, None]
    lead = flagged & lead  # a first occurrence: its flag bit alone
    r_len = torch.where(lead, 1, width + flagged.to(torch.int64))
    r_val = torch.where(lead, 1, torch.where(qlz, d.q_ids[row], d.r_ids[row]))
    pos = torch.where(flagged, loc + (loc - before) * width, loc * width)
    off, head, tail, spill = reference_words(pos, r_len, r_val)
    at = f[:, pc.REFS_AT, None] + off
    live = valid & (r_len > 0)
    _add(buf, at, head, live, sums, tiles[:, :1])
    _add(buf, at + 1, tail, live & spill, sums, tiles[:, :1])


def put_data(
    buf: torch.Tensor, sym: torch.Tensor, bits: torch.Tensor, dedupes: pc.PutDedupes,
    rec: torch.Tensor, slots: torch.Tensor, stream: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tiles: tuple[torch.Tensor, torch.Tensor], tile: int,
) -> torch.Tensor:  # fmt: skip
    """Twin of ``kernels.packed.put_data`` (arguments and result as there)."""
    widths, code_off, esc_base = stream
    sums = torch.zeros(2, rec.shape[0], dtype=torch.int64, device=buf.device)
    _put_stream(buf, sym, bits, dedupes.q_rows, rec, slots, widths, code_off, esc_base, sums)
    _put_rows(buf, bits, dedupes.r_rows, rec, tiles[0], tile, sums)
    _put_refs(buf, dedupes, rec, tiles[1], tile, sums)
    return sums


__all__ = [
    "PackedValues",
    "check_groups",
    "pack_codes",
    "packed_checksums",
    "packed_status",
    "packed_values",
    "packed_widths",
    "put_data",
    "segment_checksum",
    "stream_plan",
    "symbols_and_ranks",
    "unpack_codes",
]
