"""The compiled CPU encoder, batched: one compiled call encodes every block of every payload.

The blocks are concatenated (values, raw bits, rows) with per-block offsets and one numba call
(``_compress_kernel``) runs every stage over them: no Python runs per block, so small all-to-all
payloads pay for their bytes, not for the stages. Its bytes are the device path's: the mode
choice (``size_model``), the grid rule (``quantize.block_bound`` / ``block_grid``) and the
checksum are shared (docs/codec.md, "Backends"). Its reader is ``host_decompress``.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np
import torch

from torchrec_lossy.codec import huffman, packed, quantize, vector_lz
from torchrec_lossy.codec import size_model as sm
from torchrec_lossy.codec.bounds import BoundKind
from torchrec_lossy.codec.container import (
    DESCRIPTOR_WORDS,
    HEADER_WORDS,
    BlockColumns,
    header_words,
    skeletons_kernel,
    split_skeletons,
)
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    DESCRIPTOR,
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    FLAG_PACKED,
    MODE_LZ,
    MODE_PACKED,
    MODE_QUANT,
    MODE_QUANT_LZ,
    MODE_RAW,
    PACKED_GROUP,
    SEGMENT_HEADER_WORDS,
    descriptor_mode,
    dtype_itemsize,
    refs_packing,
    words_for_bytes,
    write_segment_header,
)
from torchrec_lossy.codec.host_records import Blocks, Codes, Dedupe, Grids, Segments
from torchrec_lossy.codec.outliers import inlier_ranges_kernel
from torchrec_lossy.config import CodecConfig


@dataclass(frozen=True)
class BatchEncoded:
    """Payloads and what happened to each of their blocks.

    Attributes:
        payload: The payloads' bytes (uint8), one per group, back to back.
        sizes: Bytes of each group's payload.
        columns: Per group, the stats of its blocks.
        skeletons: Per group, its payload's skeleton (``container.payload_skeletons``).
    """

    payload: np.ndarray
    sizes: list[int]
    columns: list[BlockColumns]
    skeletons: list[np.ndarray]


class _ThreadWorkBuffers(threading.local):
    """Per-thread work buffers, kept between calls: a fresh multi-megabyte array costs a page
    fault per 4 KiB on first touch, which on small payloads cost as much as a stage.

    Memory only, no per-call state: every call overwrites what it reads, and nothing it returns
    points into a buffer (the kernel writes the payload to a fresh array).
    """

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def array(self, name: str, n: int, dtype: type[np.generic]) -> np.ndarray:
        """An ``n``-element 1-D array (uninitialised), valid until the next ``array(name)``
        (``torch.from_numpy`` of it for torch callers)."""
        buf = self.arrays.get(name)
        if buf is None or buf.dtype != dtype or buf.shape[0] < n:
            buf = np.empty(max(n, 1024), dtype)
            self.arrays[name] = buf
        return buf[:n]


class _Inputs(NamedTuple):
    """What :func:`compress_blocks` hands the kernel (per block: ``[n]``)."""

    x: np.ndarray  # float32 values of every block, back to back
    # int64 [n]: each block's address where the kernel copies the blocks into ``x`` itself
    # (quantize.gather_ranges_kernel, contiguous float32 blocks); empty: ``x`` holds them
    src: np.ndarray
    bits: np.ndarray  # int32 raw bits, same layout (16-bit ones sign-extended)
    # int64 [4 * n]: the rows, the columns, the dtype code, then the bound's kind
    # (bounds.BoundKind) of each block (flat: cut up in the kernel, where it costs nothing)
    layout: np.ndarray
    bounds: np.ndarray  # float64 (relative ones resolved in place)
    groups: np.ndarray  # int64 [G] blocks per payload
    keys: np.ndarray  # int64 rounding keys (quantize.block_keys)
    # Work arrays the kernel overwrites: uint16 as long as x; int32 [4 * total rows] (the two
    # dedupes' ids and first rows).
    symbols: np.ndarray
    rows: np.ndarray


class _Knobs(NamedTuple):
    """The codec knobs the kernel reads (``CodecConfig``'s)."""

    quantization: bool
    lz: bool
    stochastic: bool  # stochastic rounding (its grid: quantize.grid_bound)
    chunk: int  # Huffman symbols per chunk
    packed: bool  # the packed format (CodecConfig.format "packed")


_WORK_BUFFERS = _ThreadWorkBuffers()  # memory reused per thread, not state
BOUND_VALUE = int(BoundKind.VALUE)  # as the compiled kernel compares it
BOUND_RELATIVE = int(BoundKind.RELATIVE)
_NEVER = 1 << 40  # the words of a mode that must not be chosen


def _flatten(
    blocks: Sequence[torch.Tensor], rows: list[int], dims: list[int], all_float32: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All blocks' values as one float32 array and their raw bits as one int32 array, or
    where the kernel is to copy them from: (values, bits, ``_Inputs.src``).

    16-bit blocks' bits are their int16 view widened to int32 (sign-extended). An all-float32
    payload of contiguous blocks on the host (``all_float32``, blocks on one device) is not
    copied here: the values are a reused buffer that the kernel's range pass fills as it reads
    each block where it lies (the bits are a view of it); other float32 blocks cost one copy
    into that buffer. ``rows`` / ``dims``: each block's shape.
    """
    if not blocks:
        return np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(0, np.int64)
    blocks = [b.detach() if b.requires_grad else b for b in blocks]
    if all_float32 and blocks[0].device.type == "cpu":
        x_np = _WORK_BUFFERS.array("x", sum(r * d for r, d in zip(rows, dims, strict=True)),
                                   np.float32)  # fmt: skip
        if all(b.is_contiguous() for b in blocks):
            # (Strided blocks, e.g. column slices of one buffer, read in place measured
            # slower than torch's copy then the range pass: they take that path.)
            return x_np, x_np.view(np.int32), np.array([b.data_ptr() for b in blocks], np.int64)
        dim = dims[0]
        if dim and dims.count(dim) == len(dims):
            # One copy straight from the blocks, whatever their strides (flattening a strided
            # block first would copy it twice).
            torch.cat(blocks, out=torch.from_numpy(x_np).view(-1, dim))
        else:
            torch.cat([b.reshape(-1) for b in blocks], out=torch.from_numpy(x_np))
        return x_np, x_np.view(np.int32), np.zeros(0, np.int64)
    flat = [b.reshape(-1) for b in blocks]
    x = torch.cat([f.float() for f in flat]).cpu().numpy()
    bits = torch.cat(
        [
            f.view(torch.int32 if f.element_size() == 4 else torch.int16).to(torch.int32)
            for f in flat
        ]
    )
    return x, bits.cpu().numpy(), np.zeros(0, np.int64)


@numba.njit(cache=True, nogil=True, inline="always")
def _put_rows(
    out: np.ndarray, pos: int, bits: np.ndarray, rows: np.ndarray, dim: int, itemsize: int
) -> int:
    """Writes the raw bits of ``rows`` of a flat block as bytes, padded to a word; -> words."""
    if itemsize == 4:
        k = pos
        for r in rows:
            src = bits[r * dim : (r + 1) * dim]
            dst = out[k : k + dim]
            for j in range(dim):
                dst[j] = np.uint32(src[j])
            k += dim
        return k - pos
    k = 0
    for r in rows:
        src = bits[r * dim : (r + 1) * dim]
        for j in range(dim):
            half = np.uint32(src[j]) & np.uint32(0xFFFF)
            out[pos + (k >> 1)] |= half << np.uint32(16 * (k & 1))
            k += 1
    return (k + 1) >> 1


@numba.njit(cache=True, nogil=True, inline="always")
def _put_escapes(
    out: np.ndarray, pos: int, blk_sym: np.ndarray, blk_bits: np.ndarray, sent: np.ndarray,
    dim: int, isz: int, n_esc: int,
) -> int:  # fmt: skip
    """Writes the escapes of the ``sent`` rows of a block: their positions, then their raw
    bits (padded to a word); -> the word after them."""
    esc_bits_at = pos + n_esc
    k = 0
    for i in range(sent.shape[0]):
        r = sent[i]
        for j in range(dim):
            e = r * dim + j
            if blk_sym[e] == ESCAPE_SYMBOL:
                out[pos + k] = i * dim + j
                v = np.uint32(blk_bits[e])
                if isz == 4:
                    out[esc_bits_at + k] = v
                else:
                    half = (v & np.uint32(0xFFFF)) << np.uint32(16 * (k & 1))
                    out[esc_bits_at + (k >> 1)] |= half
                k += 1
    return esc_bits_at + (n_esc * isz + 3) // 4


@numba.njit(cache=True, nogil=True, inline="always")
def _put_refs_and_escapes(
    out: np.ndarray, pos: int, b: int, symbols: np.ndarray, bits: np.ndarray, blocks: Blocks,
    segs: Segments, rows: Dedupe, sent: np.ndarray, n_esc: int,
) -> int:  # fmt: skip
    """Writes block ``b``'s references (quant+lz: its rows' ids among ``rows``) and then its
    ``n_esc`` escapes among the rows ``sent`` at ``pos``, as both segment kinds carry them
    before their coded values; -> the word after them."""
    if segs.mode[b] == MODE_QUANT_LZ:
        r0 = blocks.row_off[b]
        pos += vector_lz.pack_refs_into(
            rows.ids[r0 : r0 + blocks.rows[b]], segs.sent[b], segs.ref_mode[b], out[pos:]
        )
    if n_esc:
        at = slice(blocks.elem_off[b], blocks.elem_off[b + 1])
        pos = _put_escapes(
            out, pos, symbols[at], bits[at], sent, blocks.dims[b], blocks.itemsize[b], n_esc
        )
    return pos


@numba.njit(cache=True, nogil=True, inline="always")
def _put_coded(
    out: np.ndarray, pos: int, b: int, symbols: np.ndarray, bits: np.ndarray, blocks: Blocks,
    grids: Grids, segs: Segments, rows: Dedupe, codes: Codes, entry: np.ndarray,
) -> int:  # fmt: skip
    """Writes block ``b``'s quantized segment at ``pos`` (its rows deduplicated by ``rows``
    for quant+lz); -> the word after it. ``entry``: the encoder's table, overwritten."""
    lz = segs.mode[b] == MODE_QUANT_LZ
    n_rows, dim = blocks.rows[b], blocks.dims[b]
    r0 = blocks.row_off[b]
    n_sent = segs.sent[b]
    sent = rows.first[r0 : r0 + n_sent] if lz else blocks.every_row[r0 : r0 + n_rows]
    base, plan = codes.base[b], codes.plan[:, b]
    lo, count, n_esc = plan[2], plan[3], plan[4]
    lengths = codes.lengths[codes.len_off[b] : codes.len_off[b + 1]]
    esc = lengths.shape[0] - 1
    # The compact code's entries at their symbols (value symbols from base, then the escape).
    compact = huffman.code_entries(lengths, huffman.canonical_codes_kernel(lengths))
    entry[base : base + esc] = compact[:esc]
    entry[ESCAPE_SYMBOL] = compact[esc]
    chunk = segs.chunk
    n_chunks = (n_sent * dim + chunk - 1) // chunk
    pos = write_segment_header(
        out, pos, (grids.step[b], grids.center[b], n_sent, n_esc, chunk, n_chunks, lo, count,
                   lengths[esc], segs.ref_mode[b], segs.ref_width[b]),
    )  # fmt: skip
    nibbles = huffman.pack_codebook_kernel(lengths, lo - base, count)
    out[pos:].view(np.uint8)[: nibbles.shape[0]] = nibbles
    pos += words_for_bytes(nibbles.shape[0])
    pos = _put_refs_and_escapes(out, pos, b, symbols, bits, blocks, segs, rows, sent, n_esc)
    blk_sym = symbols[blocks.elem_off[b] : blocks.elem_off[b + 1]]
    stream = out[pos + n_chunks :]
    w = huffman.encode_into(
        blk_sym.reshape(n_rows, dim), sent, entry, chunk, out[pos : pos + n_chunks], stream
    )
    return pos + n_chunks + w


@numba.njit(cache=True, nogil=True, inline="always")
def _put_packed(
    out: np.ndarray, pos: int, b: int, symbols: np.ndarray, bits: np.ndarray, blocks: Blocks,
    grids: Grids, segs: Segments, rows: Dedupe, n_esc: int, widths: np.ndarray,
) -> int:  # fmt: skip
    """Writes block ``b``'s packed segment at ``pos`` (its rows deduplicated by ``rows`` for
    quant+lz; ``n_esc`` escapes among the values sent, ``widths`` its groups' widths), its
    checksum in the header last; -> the word after it."""
    lz = segs.mode[b] == MODE_QUANT_LZ
    n_rows, dim = blocks.rows[b], blocks.dims[b]
    r0 = blocks.row_off[b]
    n_sent = segs.sent[b]
    sent = rows.first[r0 : r0 + n_sent] if lz else blocks.every_row[r0 : r0 + n_rows]
    head = pos
    pos += SEGMENT_HEADER_WORDS
    pos = _put_refs_and_escapes(out, pos, b, symbols, bits, blocks, segs, rows, sent, n_esc)
    blk_sym = symbols[blocks.elem_off[b] : blocks.elem_off[b + 1]]
    pos += packed.put_stream(out, pos, blk_sym, sent, dim, widths)
    check = np.int64(packed.segment_checksum(out[head + SEGMENT_HEADER_WORDS : pos]))
    n_groups = (n_sent * dim + PACKED_GROUP - 1) // PACKED_GROUP
    write_segment_header(
        out, head, (grids.step[b], grids.center[b], n_sent, n_esc, PACKED_GROUP, n_groups,
                    check & 0xFFFF, check >> 16, 0, segs.ref_mode[b], segs.ref_width[b]),
    )  # fmt: skip
    return pos


@numba.njit(cache=True, nogil=True)
def _emit_kernel(
    out: np.ndarray, symbols: np.ndarray, bits: np.ndarray, blocks: Blocks, grids: Grids,
    segs: Segments, dedupe: tuple[Dedupe, Dedupe], codes: tuple[Codes, Codes],
    plan: np.ndarray, widths: tuple[np.ndarray, np.ndarray], is_packed: bool,
) -> np.ndarray:  # fmt: skip
    """Writes every block's segment back to back into zeroed ``out``, ``segs.skip[b]`` words
    before block ``b`` left free (a payload's header and descriptors where its group starts).

    ``dedupe``: the quantized rows' and the raw rows' vector-LZ; ``codes``: the codes of all
    rows and of the distinct quantized rows (Huffman); ``plan``: the size plan
    (:func:`_huffman_plan`; ``is_packed``: quantized blocks are packed, with the group widths
    and their offsets per block of :func:`_packed_plan`). Returns the segment words of each
    block.
    """
    nb = blocks.rows.shape[0]
    seg_words = np.zeros(nb, np.int64)
    entry = np.zeros(ALPHABET_SIZE, np.uint64)
    pos = 0
    for b in range(nb):
        pos += segs.skip[b]
        m = segs.mode[b]
        dim, isz = blocks.dims[b], blocks.itemsize[b]
        r0 = blocks.row_off[b]
        blk_bits = bits[blocks.elem_off[b] : blocks.elem_off[b + 1]]
        p0 = pos
        if m == MODE_RAW:
            every = blocks.every_row[r0 : r0 + blocks.rows[b]]
            pos += _put_rows(out, pos, blk_bits, every, dim, isz)
        elif m == MODE_LZ:
            nu = segs.sent[b]
            pos = write_segment_header(
                out, pos, (0.0, 0, nu, 0, 0, 0, 0, 0, 0, segs.ref_mode[b], segs.ref_width[b])
            )
            ids = dedupe[1].ids[r0 : r0 + blocks.rows[b]]
            pos += vector_lz.pack_refs_into(ids, nu, segs.ref_mode[b], out[pos:])
            pos += _put_rows(out, pos, blk_bits, dedupe[1].first[r0 : r0 + nu], dim, isz)
        elif is_packed:
            lz = m == MODE_QUANT_LZ
            n_esc = plan[2 if lz else 0, b]
            blk_widths = widths[0][widths[1][b] : widths[1][b + 1]]
            pos = _put_packed(
                out, pos, b, symbols, bits, blocks, grids, segs, dedupe[0], n_esc, blk_widths
            )
        else:
            lz = m == MODE_QUANT_LZ
            pos = _put_coded(
                out, pos, b, symbols, bits, blocks, grids, segs, dedupe[0],
                codes[1] if lz else codes[0], entry,
            )  # fmt: skip
        seg_words[b] = pos - p0
    return seg_words


@numba.njit(cache=True, nogil=True)
def _blocks(layout: np.ndarray) -> Blocks:
    """The blocks' layout from ``layout`` (``_compress_kernel``'s)."""
    nb = layout.shape[0] // 4
    rows, dims, dcodes = layout[:nb], layout[nb : 2 * nb], layout[2 * nb : 3 * nb]
    itemsize = np.empty(nb, np.int64)
    elem_off = np.zeros(nb + 1, np.int64)
    row_off = np.zeros(nb + 1, np.int64)
    for b in range(nb):
        itemsize[b] = dtype_itemsize(dcodes[b])
        elem_off[b + 1] = elem_off[b] + rows[b] * dims[b]
        row_off[b + 1] = row_off[b] + rows[b]
    every_row = np.empty(row_off[nb], np.int32)
    for b in range(nb):
        for r in range(rows[b]):
            every_row[row_off[b] + r] = r
    return Blocks(rows, dims, itemsize, elem_off, row_off, every_row)


@numba.njit(cache=True, nogil=True)
def _grids(
    x: np.ndarray, src: np.ndarray, blocks: Blocks, kinds: np.ndarray, bnd: np.ndarray,
    knobs: _Knobs,
) -> Grids:  # fmt: skip
    """Each block's grid by ``quantize``'s rule (``block_bound``, ``block_grid``) over its
    finite range and, where the rule centers on it, its median; relative bounds in ``bnd``
    resolved in place (over the range without outliers). ``src``: ``_Inputs.src`` (where
    given, ``x`` is filled from it first, by the range pass)."""
    if src.shape[0]:
        lo, hi = quantize.gather_ranges_kernel(x, blocks.elem_off, src)
    else:
        lo, hi = quantize.finite_ranges_kernel(x, blocks.elem_off)
    # A relative bound is taken over the range without finite outliers (codec/outliers.py).
    ilo, ihi = inlier_ranges_kernel(x, blocks.elem_off, lo, hi, kinds == BOUND_RELATIVE)
    nb = blocks.rows.shape[0]
    step, inv_step = np.zeros(nb, np.float32), np.zeros(nb, np.float32)
    center, ok = np.zeros(nb, np.int64), np.zeros(nb, np.bool_)
    for b in range(nb):
        e0, e1 = blocks.elem_off[b], blocks.elem_off[b + 1]
        bb = quantize.block_bound(
            kinds[b], bnd[b], ilo[b], ihi[b], e1 - e0, knobs.stochastic, knobs.quantization
        )
        use = quantize.uses_median(bb, lo[b], hi[b])
        g = quantize.block_grid(bb, lo[b], hi[b], quantize.finite_median(x[e0:e1]) if use else 0.0)
        bnd[b], step[b], inv_step[b], center[b], ok[b] = (
            g.bound, g.step, g.inv_step, np.int64(g.center), g.ok
        )  # fmt: skip
    return Grids(step, inv_step, center, ok, kinds == BOUND_VALUE)


@numba.njit(cache=True, nogil=True)
def _codes(sym_lo: np.ndarray, sym_hi: np.ndarray, coded: np.ndarray) -> Codes:
    """Empty compact codes for the ``coded`` blocks (value symbols, then the escape)."""
    nb = sym_lo.shape[0]
    off = np.zeros(nb + 1, np.int64)
    for b in range(nb):
        off[b + 1] = off[b] + (max(sym_hi[b] - sym_lo[b] + 1, 0) + 1 if coded[b] else 0)
    return Codes(sym_lo, off, np.zeros(off[nb], np.uint8), np.zeros((5, nb), np.int64))


@numba.njit(cache=True, nogil=True)
def _huffman_plan(codes: tuple[Codes, Codes], chunk: int) -> np.ndarray:
    """The size plan of the Huffman codes, int64 [5, n]: escapes and code words of all rows,
    the same of the distinct rows, whether quant+lz applies (the words estimated:
    ``size_model.code_words``)."""
    nb = codes[0].base.shape[0]
    plan = np.zeros((5, nb), np.int64)
    for b in range(nb):
        for k in range(2):
            p = codes[k].plan
            plan[2 * k, b] = p[4, b]
            plan[2 * k + 1, b] = sm.code_words(p[1, b], p[0, b], p[3, b], chunk)
        plan[4, b] = codes[1].len_off[b + 1] > codes[1].len_off[b]
    return plan


@numba.njit(cache=True, nogil=True)
def _packed_plan(
    symbols: np.ndarray, blocks: Blocks, grids: Grids, quant: Dedupe
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The size plan (as :func:`_huffman_plan`'s) of the packed codes: exact words
    (``packed.stream_words``). A block whose rows repeat is sent quant+lz (or raw): its
    all-rows size is not computed (a pass over every element saved; the references cost a
    few bits per row where a repeat's codes cost ``dim`` codes). -> (the plan, (uint8 group
    widths of every block's values sent, each block's first width in them)): the emitter
    writes those widths rather than computing them again."""
    nb = blocks.rows.shape[0]
    plan = np.zeros((5, nb), np.int64)
    widths = np.empty(int(blocks.elem_off[nb]) // PACKED_GROUP + nb, np.uint8)
    w_off = np.zeros(nb + 1, np.int64)
    for b in range(nb):
        w_off[b + 1] = w_off[b]
        if not grids.ok[b]:
            continue
        dim, r0 = blocks.dims[b], blocks.row_off[b]
        blk_sym = symbols[blocks.elem_off[b] : blocks.elem_off[b + 1]]
        nu = quant.n_unique[b]
        if quant.selected[b] and nu < blocks.rows[b]:
            first = quant.first[r0 : r0 + nu]
            mine = widths[w_off[b] :]
            plan[2, b], plan[3, b] = packed.stream_words(blk_sym, first, dim, mine)
            plan[1, b], plan[4, b] = _NEVER, 1  # quant never chosen
            n_sent = nu
        else:
            every = blocks.every_row[r0 : r0 + blocks.rows[b]]
            mine = widths[w_off[b] :]
            plan[0, b], plan[1, b] = packed.stream_words(blk_sym, every, dim, mine)
            n_sent = blocks.rows[b]
        w_off[b + 1] = w_off[b] + (n_sent * dim + PACKED_GROUP - 1) // PACKED_GROUP
    return plan, (widths, w_off)


@numba.njit(cache=True, nogil=True)
def _choose_lossy(
    blocks: Blocks, grids: Grids, quant: Dedupe, plan: np.ndarray, lz: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``size_model``'s lossy choice per block: (mode, its words, whether a lossless
    dedupe may still win). ``plan``: the size plan (:func:`_huffman_plan`) of the format."""
    nb = blocks.rows.shape[0]
    mode = np.empty(nb, np.int64)
    best = np.empty(nb, np.int64)
    tried = np.empty(nb, np.bool_)
    for b in range(nb):
        rows, isz, nu = blocks.rows[b], blocks.itemsize[b], quant.n_unique[b]
        numel = blocks.elem_off[b + 1] - blocks.elem_off[b]
        quant_w = sm.quant_words(plan[0, b], isz, plan[1, b])
        quant_lz_w = sm.quant_lz_words(rows, max(nu, 1), plan[2, b], isz, plan[3, b])
        quant_lz_ok = plan[4, b] != 0
        mode[b], best[b] = sm.choose_lossy(
            (numel * isz + 3) // 4, grids.ok[b], quant_w, quant_lz_ok, quant_lz_w
        )
        lower = max(nu, 1) if quant.selected[b] else 1
        lz_allowed = lz and rows > 1 and numel > 0
        tried[b] = sm.lossless_may_win(lz_allowed, rows, blocks.dims[b], isz, lower, best[b])
    return mode, best, tried


@numba.njit(cache=True, nogil=True)
def _segments(
    blocks: Blocks, lossy: tuple, dedupe: tuple[Dedupe, Dedupe], groups: np.ndarray, chunk: int
) -> tuple[Segments, int]:
    """The final mode, the segment header's reference fields and where each segment goes;
    -> (them, words the payloads may take at most).

    ``lossy``: :func:`_choose_lossy`'s result. The reference fields: the packing of the
    distinct vectors sent; a quant block names its rows' id width with no packing. A coded
    stream exceeds its estimate by less than a word a chunk.
    """
    mode, best, tried = lossy
    nb = blocks.rows.shape[0]
    ref_mode = np.empty(nb, np.int64)
    ref_width = np.empty(nb, np.int64)
    sent = np.empty(nb, np.int64)
    total = 0
    for b in range(nb):
        rows, dim = blocks.rows[b], blocks.dims[b]
        nu_q, nu_r = dedupe[0].n_unique[b], dedupe[1].n_unique[b]
        lossless_w = sm.lossless_lz_words(rows, max(nu_r, 1), dim, blocks.itemsize[b])
        numel = blocks.elem_off[b + 1] - blocks.elem_off[b]
        m = sm.choose_lossless(mode[b], best[b], tried[b], lossless_w, numel)
        mode[b] = m
        # The lz modes are chosen only for blocks of 2 rows or more: nu_q, nu_r >= 1 there.
        sent[b] = nu_q if m == MODE_QUANT_LZ else nu_r if m == MODE_LZ else rows
        coded = nu_q if m == MODE_QUANT_LZ else rows if m == MODE_QUANT else 0
        r_mode, ref_width[b], _ = refs_packing(rows, max(sent[b], 1))
        ref_mode[b] = r_mode if m in (MODE_QUANT_LZ, MODE_LZ) else 0
        n_chunks = (coded * dim + chunk - 1) // chunk
        total += (lossless_w if m == MODE_LZ else best[b]) + n_chunks + 2
    skip = np.zeros(nb + 1, np.int64)  # words before a block's segment: its group's lead
    at = 0
    for g in range(groups.shape[0]):
        lead = HEADER_WORDS + DESCRIPTOR_WORDS * groups[g]
        skip[at] += lead  # an empty group's lead lands on the next block
        total += lead
        at += groups[g]
    return Segments(mode, ref_mode, ref_width, sent, skip, chunk), total


@numba.njit(cache=True, nogil=True)
def _put_payload_heads(
    out: np.ndarray, blocks: Blocks, inputs: _Inputs, grids: Grids, segs: Segments,
    seg_words: np.ndarray, is_packed: bool,
) -> np.ndarray:  # fmt: skip
    """Writes each payload's descriptors, then its header (over the finished body; its
    quantized blocks ``MODE_PACKED`` and its flags ``FLAG_PACKED`` where ``is_packed``);
    -> bytes of each payload."""
    nb = blocks.rows.shape[0]
    groups = inputs.groups
    desc = np.zeros(nb, DESCRIPTOR)
    for b in range(nb):
        desc[b]["rows"], desc[b]["dim"] = blocks.rows[b], blocks.dims[b]
        desc[b]["dtype"] = inputs.layout[2 * nb + b]
        mode = descriptor_mode(segs.mode[b], grids.value[b])
        quantized = (segs.mode[b] & MODE_QUANT) != 0
        desc[b]["mode"] = mode | MODE_PACKED if is_packed and quantized else mode
        desc[b]["seg_words"], desc[b]["bound"] = seg_words[b], inputs.bounds[b]
    desc_words = desc.view(np.uint32)
    sizes = np.empty(groups.shape[0], np.int64)
    p0 = 0
    b0 = 0
    for g in range(groups.shape[0]):
        n = groups[g]
        d0 = p0 + HEADER_WORDS
        p1 = d0 + DESCRIPTOR_WORDS * n + seg_words[b0 : b0 + n].sum()
        out[d0 : d0 + DESCRIPTOR_WORDS * n] = desc_words[
            DESCRIPTOR_WORDS * b0 : DESCRIPTOR_WORDS * (b0 + n)
        ]
        out[p0:d0] = header_words(n, out[d0:p1], FLAG_PACKED if is_packed else 0)
        sizes[g] = 4 * (p1 - p0)
        p0 = p1
        b0 += n
    return sizes


@numba.njit(cache=True, nogil=True)
def _compress_kernel(
    inputs: _Inputs, knobs: _Knobs
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every stage of :func:`compress_blocks` after the flattening, in one compiled call.

    ``inputs.bounds`` is updated in place (relative bounds resolved); its work arrays are
    overwritten. Returns (the payloads' words, back to back; bytes of each payload; int64
    [4, n_blocks] mode, segment words, vectors sent, escapes; float64 max error per block;
    the payloads' skeletons and their offsets, as ``container.payload_skeletons`` gives them:
    gathered here, where the words are at hand, rather than in a call of their own).
    """
    x, bits, symbols, bnd = inputs.x, inputs.bits, inputs.symbols, inputs.bounds
    scratch = inputs.rows
    nb = inputs.layout.shape[0] // 4
    blocks = _blocks(inputs.layout)
    q = scratch.shape[0] // 4
    grids = _grids(x, inputs.src, blocks, inputs.layout[3 * nb :], bnd, knobs)
    # (the packed format does not read the symbols' ranges: the Huffman codes' alphabet)
    max_err, sym_lo, sym_hi = quantize.quantize_blocks_kernel(
        x, blocks.elem_off, grids, bnd, inputs.layout[2 * nb : 3 * nb], inputs.keys, symbols,
        not knobs.packed,
    )  # fmt: skip
    # Vector-LZ over the symbols, the Huffman codes of all rows (their histogram from the
    # distinct rows, weighted) and of the distinct rows, the lossy mode choice.
    lz_allowed = np.empty(nb, np.bool_)
    for b in range(nb):
        numel = blocks.elem_off[b + 1] - blocks.elem_off[b]
        lz_allowed[b] = knobs.lz and blocks.rows[b] > 1 and numel > 0 and grids.ok[b]
    quant = vector_lz.dedupe_blocks_kernel(
        symbols, bits, blocks, lz_allowed, False, scratch[:q], scratch[q : 2 * q]
    )
    no_code = np.zeros(nb, np.bool_)
    if knobs.packed:  # no Huffman codes: the packed codes' exact sizes
        codes = (_codes(sym_lo, sym_hi, no_code), _codes(sym_lo, sym_hi, no_code))
        plan, widths = _packed_plan(symbols, blocks, grids, quant)
    else:
        codes = (
            _codes(sym_lo, sym_hi, grids.ok),
            _codes(sym_lo, sym_hi, quant.selected & (quant.n_unique < blocks.rows)),
        )
        huffman.plan_blocks_kernel(symbols, blocks, quant, codes[0], codes[1])
        plan = _huffman_plan(codes, knobs.chunk)
        widths = (np.zeros(0, np.uint8), np.zeros(nb + 1, np.int64))
    lossy = _choose_lossy(blocks, grids, quant, plan, knobs.lz)
    raw = vector_lz.dedupe_blocks_kernel(
        symbols, bits, blocks, lossy[2], True, scratch[2 * q : 3 * q], scratch[3 * q :]
    )
    segs, total = _segments(blocks, lossy, (quant, raw), inputs.groups, knobs.chunk)
    out = np.zeros(total, np.uint32)
    seg_words = _emit_kernel(
        out, symbols, bits, blocks, grids, segs, (quant, raw), codes, plan, widths, knobs.packed
    )
    sizes = _put_payload_heads(out, blocks, inputs, grids, segs, seg_words, knobs.packed)
    per_block = np.zeros((4, nb), np.int64)
    for b in range(nb):
        m = segs.mode[b]
        per_block[0, b], per_block[1, b], per_block[2, b] = m, seg_words[b], segs.sent[b]
        if m in (MODE_QUANT, MODE_QUANT_LZ):
            per_block[3, b] = plan[2 if m == MODE_QUANT_LZ else 0, b]
        else:
            max_err[b] = 0.0
    end = sizes.sum() // 4
    skeletons, skeleton_ends = skeletons_kernel(out[:end], sizes)
    return out[:end], sizes, per_block, max_err, skeletons, skeleton_ends


def compress_blocks(
    blocks: Sequence[torch.Tensor],
    bounds: Sequence[float],
    config: CodecConfig,
    group_sizes: Sequence[int] | None = None,
    kinds: Sequence[int] | None = None,
) -> BatchEncoded:
    """Encodes validated blocks into one payload per group, each stage once over all blocks.

    Args:
        blocks: 2-D float32 / float16 / bfloat16 tensors (validated by the caller).
        bounds: Absolute bound per block (validated).
        config: Codec knobs.
        group_sizes: Blocks per group (consecutive blocks; they sum to ``len(blocks)``); None
            for one group. Each group's payload is the bytes a call with its blocks alone gives.
        kinds: Per block, its bound's ``bounds.BoundKind``: a fraction of its finite range is
            resolved as ``bounds.absolute_bounds`` does (from the range this pass computes
            anyway), a per-value bound quantizes on the per-value grid; None: all absolute.

    Returns:
        The payloads and per-block results.
    """
    nb = len(blocks)
    groups = (nb,) if group_sizes is None else tuple(group_sizes)
    rows = [b.shape[0] for b in blocks]
    dims = [b.shape[1] for b in blocks]
    dcodes = [DTYPE_CODES[b.dtype] for b in blocks]
    # Each numpy call costs microseconds on arrays this small: one per input dtype.
    kind = [BoundKind.ABSOLUTE] * nb if kinds is None else list(kinds)
    layout = np.array(rows + dims + dcodes + kind, np.int64)
    bnd = np.array(bounds, np.float64)
    x, bits, src = _flatten(blocks, rows, dims, dcodes.count(1) == nb)
    group_arr, keys = _group_keys(groups, config.rounding == "stochastic", config.seed)
    knobs = _Knobs(
        config.enable_quantization, config.enable_lz,
        config.rounding == "stochastic", config.huffman_chunk_symbols,
        config.format == "packed",
    )  # fmt: skip
    symbols = _WORK_BUFFERS.array("symbols", x.shape[0], np.uint16)
    scratch = _WORK_BUFFERS.array("rows", 4 * sum(rows), np.int32)
    words, sizes, per_block, max_err, skel, skel_ends = _compress_kernel(
        _Inputs(x, src, bits, layout, bnd, group_arr, keys, symbols, scratch), knobs
    )
    mode, seg_words, n_unique, n_escapes = per_block
    itemsize = [b.element_size() for b in blocks]
    flat = BlockColumns.assemble(
        (rows, dims, itemsize), mode, seg_words, bnd, max_err, (n_unique, n_escapes)
    )
    cuts = itertools.pairwise(itertools.accumulate(groups, initial=0))
    # One destination (2 ranks): nothing to cut.
    columns = [flat] if len(groups) == 1 else [flat.slice(a, b) for a, b in cuts]
    return BatchEncoded(
        words.view(np.uint8), sizes.tolist(), columns, split_skeletons(skel, skel_ends)
    )


@functools.lru_cache(maxsize=256)
def _group_keys(
    groups: tuple[int, ...], stochastic: bool, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """int64 blocks per group and each block's rounding key (``quantize.block_keys``: counted
    within its own payload), once per layout and seed rather than per call (the kernel only
    reads them)."""
    local = np.array([i for n in groups for i in range(n)], np.int64)
    return np.array(groups, np.int64), quantize.block_keys(stochastic, seed, local)


__all__ = ["BatchEncoded", "compress_blocks"]
