"""Device-resident compress of the packed format (docs/format.md, "Packed segments").

:func:`start_packed_groups` builds the host path's packed payloads byte for byte without the
blocks leaving their device, and stops before the one device-to-host read, as
``device_compress.start_groups_device`` does for the entropy format (which calls it for
``CodecConfig(format="packed")``). It shares that path's stages up to the symbols and the two
dedupes (grid, quantize, vector-LZ over the symbols and over the raw bits) and its layout
(``device_compress.place``) and buffer; what differs is the coding:
per group of ``PACKED_GROUP`` sent values its width (the bit length of its largest zigzag
code), each code at its group's word offset (a prefix sum of the widths), the exact segment
sizes in the mode choice (the host's ``_packed_plan``) and each segment's checksum.

Per block, the plan launch (``packed.stream_plan``) writes the stream's widths, the mode
choice, what the block sends, its section sizes and its descriptor and segment header words;
the data launch (``packed.put_data``) writes every data-sized section and the references;
torch lays the segments out (one cumsum) and adds the small writes and checksums. Within issue
31's launch budget, over its torch ops and bytes (docs/kernels.md, "The packed format on the
device").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchrec_lossy.codec import device_compress as dcx
from torchrec_lossy.codec import host_sync
from torchrec_lossy.codec import packed_columns as pc
from torchrec_lossy.codec.container import DESCRIPTOR_WORDS, HEADER_WORDS, MASK32
from torchrec_lossy.codec.device_compress import ROWS_TILE
from torchrec_lossy.codec.format import (
    FLAG_PACKED,
    MODE_RAW,
    SEGMENT_HEADER_WORDS,
    words_for_bytes,
)
from torchrec_lossy.codec.kernel_set import KernelSet
from torchrec_lossy.config import CodecConfig
from torchrec_lossy.profile_range import profile_range


def _record(t: dcx.Columns, fields: dict[int, torch.Tensor]) -> torch.Tensor:
    """The data launch's int64 ``[n_blocks, N_FIELDS]`` record (``codec/packed_columns.py``):
    the shape fields, then ``fields`` (by field index); 0 elsewhere."""
    zero = torch.zeros_like(t.rows)
    cols = [zero] * pc.N_FIELDS
    cols[pc.ELEM_OFF], cols[pc.ROW_OFF], cols[pc.ITEMSIZE] = t.elem_off, t.row_off, t.itemsize
    cols[pc.DIM] = t.dim.clamp(min=1)
    for f, v in fields.items():
        cols[f] = v.to(torch.int64)
    return torch.stack(cols, dim=1)


def _stream_plan(
    k: KernelSet, t: dcx.Columns, sym: torch.Tensor, grid: dcx.GridStage,
    dedupes: tuple[dcx.Dedupe, dcx.Dedupe],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Every block's packed stream and mode in one launch (``packed.stream_plan``): its stream
    (its distinct rows where some repeat and vector-LZ may run: the host's ``_packed_plan``,
    quant is then never chosen; else every row), its group slots' widths, code offsets and
    escape bases, and its mode by ``size_model`` over the packed segments' exact words (the
    host's ``_choose_lossy`` and ``_segments``).

    Returns:
        (int64 [3, n_slots] per slot: width, first word in its block's codes, escapes of its
        block before it; int64 [PLAN_FIELDS, n_blocks] the plan, ``packed_columns``' fields;
        int64 [n_blocks, HEAD_WORDS] its descriptor and segment header words).
    """
    dq, dr = dedupes
    inputs = pc.PlanInputs(
        t.rows, t.dim, t.itemsize, t.elem_off, t.row_off, t.lz_allowed, t.raw_words,
        t.ps_first, grid.stats, dq.n_unique, dr.n_unique, dq.base, grid.cols.cols,
    )  # fmt: skip
    return k.packed.stream_plan(sym, dq.first_rows, inputs, t.ps_slots.shape[0] // 2)


def plan_sends(plan: torch.Tensor) -> dcx.Sends:
    """What every block sends, from its plan (the entropy path's record; no codebook, no
    chunk table: the widths and codes are the segment's 'stream')."""
    is_q, is_qlz, is_lz, has_refs = (plan[pc.IS_Q : pc.HAS_REFS + 1] == 1).unbind(0)
    zero = torch.zeros_like(plan[pc.MODE])
    return dcx.Sends(
        mode=plan[pc.MODE],
        is_q=is_q,
        is_qlz=is_qlz,
        is_lz=is_lz,
        has_refs=has_refs,
        n_sent=plan[pc.N_SENT],
        n_sym=plan[pc.SENT_SYM],
        lengths=zero,
        codes=zero,
        n_escapes=plan[pc.N_ESCAPES],
        sym_lo=zero,
        sym_count=zero,
        n_chunks=zero,
        ref_mode=plan[pc.PLAN_REF_MODE],
        ref_width=plan[pc.PLAN_REF_WIDTH],
        refs_words=plan[pc.REFS_WORDS],
    )


def _sections(t: dcx.Columns, plan: torch.Tensor) -> dcx.Sections:
    """Where everything goes (``device_compress.place`` of the plan's segment sizes: no
    codebook, no chunk table)."""
    words = (0, plan[pc.REFS_WORDS], plan[pc.ESC_WORDS])
    return dcx.place(t, plan[pc.SEG_WORDS], words, plan[pc.N_ESCAPES], 0)


def _put_data(
    k: KernelSet, out: dcx.WordBuffer, t: dcx.Columns, flat: dcx.Flat, sym: torch.Tensor,
    stream: tuple[torch.Tensor, torch.Tensor], s: dcx.Sends, sec: dcx.Sections,
    dedupes: tuple[dcx.Dedupe, dcx.Dedupe],
) -> torch.Tensor:  # fmt: skip
    """The data-sized sections in one launch (``packed.put_data``): every packed block's width
    bytes, codes and escapes, the vector references, the raw blocks' rows and the lossless lz
    blocks' distinct rows, into the words while the small writes stay pending (they are added
    once, at the end).

    Args:
        k: The kernel set.
        out: The payload words.
        t: The compress's columns.
        flat: The blocks' values and raw bits.
        sym: int16 symbols of every element.
        stream: The plan launch's (per-slot columns, plan).
        s: What every block sends.
        sec: Where everything goes.
        dedupes: (the symbols' dedupe, the raw bits' dedupe).

    Returns:
        int64 [2, n_blocks] the data words' sums (``packed.put_data``).
    """
    dq, dr = dedupes
    slots, plan = stream
    raw = s.mode == MODE_RAW
    n_rows = torch.where(raw, t.rows, torch.where(s.is_lz, dr.n_unique, 0))
    d = pc.PutDedupes(dq.first_rows, dr.first_rows, dq.ids, dr.ids, dq.rank, dr.rank)
    rec = _record(
        t,
        {
            pc.N_SYM: plan[pc.SENT_SYM],
            pc.Q_LZ: plan[pc.STREAM_LZ],
            pc.Q_BASE: dq.base,
            pc.TABLE_AT: sec.table_at,
            pc.CODES_AT: sec.table_at + words_for_bytes(plan[pc.N_GROUPS]),
            pc.ESCP_AT: sec.escp_at,
            pc.ESCB_AT: sec.escb_at,
            pc.R_N: n_rows * t.dim,
            pc.R_LZ: s.is_lz,
            pc.R_BASE: dr.base,
            pc.R_AT: torch.where(raw, sec.seg_start, sec.escp_at),
            pc.REFS_AT: sec.refs_at,
            pc.REF_ROWS: torch.where(s.has_refs, t.rows, 0),
            pc.REF_QLZ: s.is_qlz,
            pc.REF_MODE: s.ref_mode,
            pc.REF_WIDTH: s.ref_width,
        },
    )
    tiles = (t.rw_tiles.view(-1, 2), t.rf_tiles.view(-1, 2))
    return k.packed.put_data(
        out.words, sym, flat.bits, d, rec, t.ps_slots.view(-1, 2), (slots[0], slots[1], slots[2]),
        tiles, ROWS_TILE,
    )  # fmt: skip


def _put_heads(
    out: dcx.WordBuffer, t: dcx.Columns, s: dcx.Sends, sec: dcx.Sections, heads: torch.Tensor
) -> torch.Tensor:
    """Every block's descriptor and every packed and lz segment's header (lz: n_unique and
    the references only; the checksum field 0, added by :func:`_checksums`), their words from
    the plan launch.

    Returns:
        Per block, its descriptor's word.
    """
    desc_at = dcx.descriptor_at(t, sec)
    out.put_records(desc_at, heads[:, :DESCRIPTOR_WORDS], torch.ones_like(s.is_q))
    out.put_records(sec.seg_start, heads[:, DESCRIPTOR_WORDS:], s.mode != MODE_RAW)
    return desc_at


def _checksums(
    out: dcx.WordBuffer, t: dcx.Columns, s: dcx.Sends, sec: dcx.Sections,
    sums: tuple[torch.Tensor, torch.Tensor], desc_at: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Every packed segment's checksum over its words after the header (put into its header)
    and every payload's, without reading the words back: ``sum_j w_j (2 j + 1)`` over words
    ``o ..`` is ``S1 - 2 o S0`` with ``S0 = sum w_a``, ``S1 = sum w_a (2 a + 1)`` over their
    positions ``a`` in the buffer, and both sums are linear in the (disjoint-bit) writes: the
    data's per block from ``put_data`` (every word of a segment's body), its descriptor's and
    segment header's from the plan launch (``S0`` and ``T = sum w_j (2 j + 1)`` over the
    record's words: ``S1 = T + 2 at S0`` for a record at word ``at``).

    Args:
        out: The payload words, the small writes pending.
        t: The compress's columns.
        s: What every block sends.
        sec: Where everything goes.
        sums: (int64 [2, n_blocks] ``put_data``'s S0 and S1 of each block's data words; the
            plan).
        desc_at: Per block, its descriptor's word.

    Returns:
        The payloads' checksums (their bodies' words, the segment checksum words included).
    """
    data, plan = sums
    body = sec.seg_start + SEGMENT_HEADER_WORDS
    check = torch.where(s.is_q, (data[1] - 2 * body * data[0]) & MASK32, 0)
    at = sec.seg_start + 6  # the checksum's word in the segment header
    out.put(at, check, s.is_q)
    desc_s0, head_s0 = plan[pc.DESC_S0], plan[pc.HEAD_S0]
    s0 = data[0] + desc_s0 + head_s0 + check
    s1 = data[1] + plan[pc.DESC_T] + plan[pc.HEAD_T] + check * (2 * at + 1)
    s1 = s1 + 2 * (desc_at * desc_s0 + sec.seg_start * head_s0)
    p = data.new_zeros(2, sec.payload_base.shape[0])
    p.index_add_(1, t.group, torch.stack([s0, s1]))
    return p[1] - 2 * (sec.payload_base + HEADER_WORDS) * p[0]


def start_packed_groups(
    blocks: Sequence[torch.Tensor],
    bounds: Sequence[float],
    kinds: Sequence[int],
    group_sizes: Sequence[int],
    config: CodecConfig,
    kernels: KernelSet,
) -> dcx.PendingCompress:
    """``device_compress.start_groups_device`` for ``CodecConfig(format="packed")``.

    Args:
        blocks: Validated blocks, all on one device.
        bounds: Per block: the absolute bound, or for a relative block the fraction of its
            finite range.
        kinds: Per block, its ``BoundKind``.
        group_sizes: Blocks per payload.
        config: Codec knobs (``format`` "packed"; its ``backend`` is not read).
        kernels: The kernel set (``kernel_set.load_kernels``).

    Returns:
        The pending compress (its payloads are the host encoder's bytes).
    """
    k, group_sizes = kernels, list(group_sizes)
    with profile_range("## lossy_codec encode packed ##"):
        ht = dcx.host_tables(blocks, bounds, kinds, group_sizes, config)
        dev = blocks[0].device if blocks else torch.device("cpu")
        t: dcx.Columns[torch.Tensor] = host_sync.upload_record(ht.cols, dev)
        flat = dcx.flatten(blocks, ht, t, elements=False)
        grid = dcx.grid_stage(k, ht, t, flat)
        cols = grid.cols
        sym, _, max_err = dcx.quantize_stage(k, ht, t, flat, cols, histograms=False)
        dq, dr = dcx.vector_lz_stage(k, sym, ht, t, flat, cols)
        slots, plan, heads = _stream_plan(k, t, sym, grid, (dq, dr))
        s = plan_sends(plan)
        sec = _sections(t, plan)
        out = dcx.WordBuffer(ht.body_max, dev, torch.int32)  # the payload's int32 words
        desc_at = _put_heads(out, t, s, sec, heads)
        data = _put_data(k, out, t, flat, sym, (slots, plan), s, sec, (dq, dr))
        checksums = _checksums(out, t, s, sec, (data, plan), desc_at)
        words32, skeleton = dcx.close(out, ht, t, sec, group_sizes, FLAG_PACKED, checksums)
        per_block = (s.mode, s.n_sent, s.n_escapes, sec.seg_words)
        errs = torch.where(s.is_q, max_err, 0.0).view(torch.int64)
        readback = torch.cat([sec.payload_words, *per_block, errs, grid.bound_bits, skeleton])
        return dcx.PendingCompress(words32, readback, ht, group_sizes)


__all__ = ["start_packed_groups"]
