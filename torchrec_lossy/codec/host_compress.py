"""The compiled CPU encoder, batched: one compiled call encodes every block of every payload.

The blocks are concatenated (values, raw bits, rows) with per-block offsets, and one numba call
(``_compress_kernel``) runs every stage over the whole concatenation: finite ranges and relative
bounds, quantization, vector-LZ, Huffman planning, the mode choice, the payload writer, the
descriptors, headers and checksums. No Python runs per block, and the fixed cost of a call is a
few numpy / torch calls around the compiled one, so small all-to-all payloads pay for their
bytes, not for the stages. The bytes are those of the stage-by-stage path (``pipeline`` with
``ReferenceOps``, the test oracle), and the mode choice is ``size_model``'s, the relative bound
``bounds.finite_span``'s and the checksum ``format``'s, shared with the device path (the first
two compile into the kernel through ``elementwise``). Its reader is
:mod:`torchrec_lossy.codec.host_decompress`.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch

from torchrec_lossy.codec import huffman, quantize, vector_lz
from torchrec_lossy.codec import size_model as sm
from torchrec_lossy.codec.bounds import BoundKind, finite_span
from torchrec_lossy.codec.container import (
    DESCRIPTOR_WORDS,
    HEADER_WORDS,
    BlockColumns,
    skeletons_kernel,
)
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    CODE_DTYPES,
    DESCRIPTOR,
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    HEADER,
    MAGIC,
    MODE_LZ,
    MODE_QUANT,
    MODE_QUANT_LZ,
    MODE_RAW,
    MODE_VALUE,
    SEGMENT_HEADER,
    SEGMENT_HEADER_WORDS,
    VERSION,
    checksum_words,
    refs_packing,
    words_for_bytes,
)
from torchrec_lossy.config import CodecConfig


@dataclass(frozen=True)
class BatchEncoded:
    """Payloads and what happened to each of their blocks (arrays, one entry per block).

    Attributes:
        payload: The payloads' bytes (uint8), one per group, back to back.
        sizes: Bytes of each group's payload.
        bounds: Absolute bound per block (relative ones resolved).
        rows: Rows per block.
        dims: Columns per block.
        dtype_codes: Dtype code (``format.DTYPE_CODES``) per block.
        per_block: int64 [4, n]: mode, segment words, vectors sent (rows for raw and quant)
            and escaped elements per block.
        max_error: Max error per block (0 for lossless modes).
        skeletons: Each payload's skeleton (``container.payload_skeletons``), uint32 words.
    """

    payload: np.ndarray
    sizes: list[int]
    bounds: np.ndarray
    rows: list[int]
    dims: list[int]
    dtype_codes: list[int]
    per_block: np.ndarray
    max_error: np.ndarray
    skeletons: list[np.ndarray]

    @property
    def mode(self) -> np.ndarray:
        """Block modes."""
        return self.per_block[0]

    @property
    def seg_words(self) -> np.ndarray:
        """Segment words per block."""
        return self.per_block[1]

    @property
    def n_unique(self) -> np.ndarray:
        """Vectors sent per block (rows for raw and quant)."""
        return self.per_block[2]

    @property
    def n_escapes(self) -> np.ndarray:
        """Escaped elements per block."""
        return self.per_block[3]

    def columns(self) -> BlockColumns:
        """Every block's stats as BlockColumns (the kernel's arrays read to lists).

        Returns:
            The columns, in block order.
        """
        itemsize = [CODE_DTYPES[c].itemsize for c in self.dtype_codes]
        return BlockColumns.assemble(
            (self.rows, self.dims, itemsize), self.mode, self.seg_words, self.bounds,
            self.max_error, (self.n_unique, self.n_escapes),
        )  # fmt: skip


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.shape[0] + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


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


_WORK_BUFFERS = _ThreadWorkBuffers()  # memory reused per thread, not state
# BoundKind's values as the compiled kernel compares them.
BOUND_RELATIVE = int(BoundKind.RELATIVE)
BOUND_VALUE = int(BoundKind.VALUE)


def _flatten(
    blocks: Sequence[torch.Tensor], rows: list[int], dims: list[int], all_float32: bool
) -> tuple[np.ndarray, np.ndarray]:
    """All blocks' values as one float32 array and their raw bits as one int32 array.

    16-bit bits are sign-extended, as ``pipeline``'s ``astype(np.int32)``; an all-float32
    payload on the host (``all_float32``, blocks on one device) costs one copy into a reused
    buffer (the bits are a view of the values). ``rows`` / ``dims``: each block's shape.
    """
    if not blocks:
        return np.zeros(0, np.float32), np.zeros(0, np.int32)
    blocks = [b.detach() if b.requires_grad else b for b in blocks]
    if all_float32 and blocks[0].device.type == "cpu":
        dim = dims[0]
        if dim and dims.count(dim) == len(dims):
            # One copy straight from the blocks, whatever their strides (flattening a strided
            # block first would copy it twice).
            x_np = _WORK_BUFFERS.array("x", sum(rows) * dim, np.float32)
            torch.cat(blocks, out=torch.from_numpy(x_np).view(-1, dim))
        else:
            flat = [b.reshape(-1) for b in blocks]
            x_np = _WORK_BUFFERS.array("x", sum(f.shape[0] for f in flat), np.float32)
            torch.cat(flat, out=torch.from_numpy(x_np))
        return x_np, x_np.view(np.int32)
    flat = [b.reshape(-1) for b in blocks]
    x = torch.cat([f.float() for f in flat]).cpu().numpy()
    bits = torch.cat(
        [
            f.view(torch.int32 if f.element_size() == 4 else torch.int16).to(torch.int32)
            for f in flat
        ]
    )
    return x, bits.cpu().numpy()


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


@numba.njit(cache=True, nogil=True)
def _emit_kernel(
    out: np.ndarray,
    bits: np.ndarray,
    symbols: np.ndarray,
    elem_off: np.ndarray,
    row_off: np.ndarray,
    rows: np.ndarray,
    dims: np.ndarray,
    itemsize: np.ndarray,
    mode: np.ndarray,
    ref_mode: np.ndarray,
    ref_width: np.ndarray,
    step: np.ndarray,
    center: np.ndarray,
    chunk: int,
    every_row: np.ndarray,
    ids_q: np.ndarray,
    first_q: np.ndarray,
    nu_q: np.ndarray,
    ids_r: np.ndarray,
    first_r: np.ndarray,
    nu_r: np.ndarray,
    sym_base: np.ndarray,
    plan_q: np.ndarray,
    len_off_q: np.ndarray,
    lengths_q: np.ndarray,
    plan_u: np.ndarray,
    len_off_u: np.ndarray,
    lengths_u: np.ndarray,
    skip: np.ndarray,
) -> np.ndarray:
    """Writes every block's segment back to back into zeroed ``out``, ``skip[b]`` words before
    block ``b`` left free (a payload's header and descriptors where its group starts).

    ``plan_q`` / ``plan_u``: int64 [5, n_blocks] (bits, symbols, sym_lo, sym_count, escapes) of
    the all-rows and the distinct-rows codes; ``ref_mode`` / ``ref_width``: the segment header's
    reference fields. Returns the segment words of each block.
    """
    nb = rows.shape[0]
    seg_words = np.zeros(nb, np.int64)
    entry = np.zeros(ALPHABET_SIZE, np.uint64)
    pos = 0
    for b in range(nb):
        pos += skip[b]
        m = mode[b]
        n_rows = rows[b]
        dim = dims[b]
        isz = itemsize[b]
        r0 = row_off[b]
        blk_bits = bits[elem_off[b] : elem_off[b + 1]]
        p0 = pos
        if m == MODE_RAW:
            pos += _put_rows(out, pos, blk_bits, every_row[r0 : r0 + n_rows], dim, isz)
        elif m == MODE_LZ:
            nu = nu_r[b]
            hdr = np.zeros(1, SEGMENT_HEADER)  # the format's record: unnamed fields are 0
            h = hdr[0]
            h["n_unique"], h["ref_mode"], h["ref_width"] = nu, ref_mode[b], ref_width[b]
            out[pos : pos + SEGMENT_HEADER_WORDS] = hdr.view(np.uint32)
            pos += SEGMENT_HEADER_WORDS
            pos += vector_lz.pack_refs_into(ids_r[r0 : r0 + n_rows], nu, ref_mode[b], out[pos:])
            pos += _put_rows(out, pos, blk_bits, first_r[r0 : r0 + nu], dim, isz)
        else:
            lz = m == MODE_QUANT_LZ
            plan = plan_u if lz else plan_q
            n_sent = nu_q[b] if lz else n_rows
            sent = first_q[r0 : r0 + n_sent] if lz else every_row[r0 : r0 + n_rows]
            base = sym_base[b]
            lo = plan[2, b]
            count = plan[3, b]
            n_esc = plan[4, b]
            off = len_off_u[b] if lz else len_off_q[b]
            nxt = len_off_u[b + 1] if lz else len_off_q[b + 1]
            lengths = lengths_u[off:nxt] if lz else lengths_q[off:nxt]
            width_c = lengths.shape[0]
            codes = huffman.canonical_codes_kernel(lengths)
            for k in range(width_c - 1):
                entry[base + k] = (np.uint64(codes[k]) << np.uint64(8)) | np.uint64(lengths[k])
            esc_len = lengths[width_c - 1]
            entry[ESCAPE_SYMBOL] = (np.uint64(codes[width_c - 1]) << np.uint64(8)) | np.uint64(
                esc_len
            )
            n_sym = n_sent * dim
            n_chunks = (n_sym + chunk - 1) // chunk
            hdr = np.zeros(1, SEGMENT_HEADER)
            h = hdr[0]
            h["step"], h["center"], h["n_unique"] = step[b], center[b], n_sent
            h["n_escapes"], h["chunk_symbols"], h["n_chunks"] = n_esc, chunk, n_chunks
            h["sym_lo"], h["sym_count"], h["escape_length"] = lo, count, esc_len
            h["ref_mode"], h["ref_width"] = ref_mode[b], ref_width[b]
            out[pos : pos + SEGMENT_HEADER_WORDS] = hdr.view(np.uint32)
            pos += SEGMENT_HEADER_WORDS
            nibbles = huffman.pack_codebook_kernel(lengths, lo - base, count)
            out[pos : pos + words_for_bytes(nibbles.shape[0])].view(np.uint8)[
                : nibbles.shape[0]
            ] = nibbles
            pos += words_for_bytes(nibbles.shape[0])
            if lz:
                pos += vector_lz.pack_refs_into(
                    ids_q[r0 : r0 + n_rows], n_sent, ref_mode[b], out[pos:]
                )
            blk_sym = symbols[elem_off[b] : elem_off[b + 1]]
            if n_esc:
                esc_bits_at = pos + n_esc
                k = 0
                for i in range(n_sent):
                    r = sent[i]
                    for j in range(dim):
                        e = r * dim + j
                        if blk_sym[e] == ESCAPE_SYMBOL:
                            out[pos + k] = i * dim + j
                            v = np.uint32(blk_bits[e])
                            if isz == 4:
                                out[esc_bits_at + k] = v
                            else:
                                out[esc_bits_at + (k >> 1)] |= (v & np.uint32(0xFFFF)) << np.uint32(
                                    16 * (k & 1)
                                )
                            k += 1
                pos = esc_bits_at + (n_esc * isz + 3) // 4
            w = huffman.encode_into(
                blk_sym.reshape(n_rows, dim),
                sent,
                entry,
                chunk,
                out[pos : pos + n_chunks],
                out[pos + n_chunks :],
            )
            pos += n_chunks + w
        seg_words[b] = pos - p0
    return seg_words


@numba.njit(cache=True, nogil=True, inline="always")
def _code_offsets(sym_lo: np.ndarray, sym_hi: np.ndarray, active: np.ndarray) -> np.ndarray:
    """Start of each block's compact code lengths (value symbols, then the escape)."""
    nb = sym_lo.shape[0]
    off = np.zeros(nb + 1, np.int64)
    for b in range(nb):
        off[b + 1] = off[b] + (max(sym_hi[b] - sym_lo[b] + 1, 0) + 1 if active[b] else 0)
    return off


@numba.njit(cache=True, nogil=True)
def _compress_kernel(
    x: np.ndarray,
    bits: np.ndarray,
    layout: np.ndarray,
    bnd: np.ndarray,
    groups: np.ndarray,
    keys: np.ndarray,
    quantization: bool,
    lz: bool,
    grid_scale: float,
    chunk: int,
    symbols: np.ndarray,
    row_scratch: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every stage of :func:`compress_blocks` after the flattening, in one compiled call.

    ``layout`` is int64 [4 * n_blocks]: the rows, then the columns, then the dtype code, then
    the bound's kind (``bounds.BoundKind``), of each block. ``bnd`` is updated in place
    (relative bounds resolved); the scratch arrays (``symbols`` as long as ``x``,
    ``row_scratch`` int32 [4 * rows]) are overwritten. (Flat arrays: reshaped here, where it
    costs nothing, rather than by the caller.) Returns (the payloads' words, back to back;
    bytes of each payload; int64 [4, n_blocks] mode, segment words, vectors sent, escapes;
    float64 max error per block; the payloads' skeletons and their offsets, as
    ``container.payload_skeletons`` gives them: gathered here, where the words are at hand,
    rather than in a call of their own).
    """
    nb = layout.shape[0] // 4
    rows, dims, dcodes = layout[:nb], layout[nb : 2 * nb], layout[2 * nb : 3 * nb]
    kinds = layout[3 * nb :]
    ng = groups.shape[0]
    q = row_scratch.shape[0] // 4
    ids_q, first_q = row_scratch[:q], row_scratch[q : 2 * q]
    ids_r, first_r = row_scratch[2 * q : 3 * q], row_scratch[3 * q :]
    itemsize = np.empty(nb, np.int64)
    elem_off = np.zeros(nb + 1, np.int64)
    row_off = np.zeros(nb + 1, np.int64)
    for b in range(nb):
        itemsize[b] = 4 if dcodes[b] == 1 else 2
        elem_off[b + 1] = elem_off[b] + rows[b] * dims[b]
        row_off[b + 1] = row_off[b] + rows[b]
    n_rows = row_off[nb]
    every_row = np.empty(n_rows, np.int32)
    for b in range(nb):
        for r in range(rows[b]):
            every_row[row_off[b] + r] = r

    # 1. Quantization parameters (quantize.quant_params, for every block at once); relative
    # bounds resolved as bounds.absolute_bounds does; the per-value grid's (value_params)
    # from the same ranges.
    lo, hi = quantize.finite_ranges_kernel(x, elem_off)
    wanted = np.zeros(nb, np.bool_)
    value = np.zeros(nb, np.bool_)
    grid = np.empty(nb, np.float64)
    mid = np.zeros(nb, np.float64)
    for b in range(nb):
        if kinds[b] == BOUND_RELATIVE:
            span = finite_span(np.float32(lo[b]), np.float32(hi[b]))
            bnd[b] = bnd[b] * span if bnd[b] > 0 else 0.0
        numel = elem_off[b + 1] - elem_off[b]
        wanted[b] = bnd[b] > 0 and numel > 0 and quantization
        if kinds[b] == BOUND_VALUE:
            value[b] = wanted[b]
            wanted[b] = False  # not on the absolute grid
            continue
        # The grid the codes live on (quantize.grid_bound: half the bound for stochastic).
        grid[b] = grid_scale * bnd[b]
        if np.isnan(lo[b]):
            continue
        if quantize.midpoint_fits(lo[b], hi[b], grid[b]):
            mid[b] = 0.5 * (lo[b] + hi[b])
        elif wanted[b]:  # outliers: the median of the block's finite values
            v = x[elem_off[b] : elem_off[b + 1]]
            fin = v[np.isfinite(v)].astype(np.float64)
            mid[b] = np.median(fin)
    step, inv_step, center, quant_ok = quantize.quant_params_blocks_kernel(grid, mid, wanted)
    for b in range(nb):
        if value[b]:
            amax = max(abs(lo[b]), abs(hi[b])) if not np.isnan(lo[b]) else 0.0
            step[b], center[b] = quantize.value_params(bnd[b], amax)
            quant_ok[b] = True

    # 2. Quantize (only the active blocks' symbols are ever read).
    max_err, sym_lo, sym_hi = quantize.quantize_blocks_kernel(
        x, elem_off, step, inv_step, center, bnd, dcodes, quant_ok, symbols, keys, value
    )

    # 3. Vector-LZ over the symbols.
    lz_allowed = np.empty(nb, np.bool_)
    deduped = np.empty(nb, np.bool_)
    for b in range(nb):
        lz_allowed[b] = lz and rows[b] > 1 and elem_off[b + 1] > elem_off[b]
        deduped[b] = quant_ok[b] and lz_allowed[b]
    nu_q = vector_lz.dedupe_blocks_kernel(
        symbols, bits, elem_off, row_off, dims, deduped, False, ids_q, first_q
    )
    quant_lz_ok = np.empty(nb, np.bool_)
    for b in range(nb):
        quant_lz_ok[b] = deduped[b] and nu_q[b] < rows[b]

    # 4. Huffman codes of all rows (their histogram from the distinct rows, weighted) and of
    # the distinct rows; sizes; mode choice (size_model, per block).
    len_off_q = _code_offsets(sym_lo, sym_hi, quant_ok)
    len_off_u = _code_offsets(sym_lo, sym_hi, quant_lz_ok)
    lengths_q = np.zeros(len_off_q[nb], np.uint8)
    lengths_u = np.zeros(len_off_u[nb], np.uint8)
    plan_q, plan_u = huffman.plan_blocks_kernel(
        symbols, elem_off, row_off, dims, first_q, nu_q, ids_q, deduped, sym_lo, sym_hi,
        quant_ok, quant_lz_ok, len_off_q, lengths_q, len_off_u, lengths_u,
    )  # fmt: skip
    mode = np.empty(nb, np.int64)
    best = np.empty(nb, np.int64)
    tried = np.empty(nb, np.bool_)
    for b in range(nb):
        isz = itemsize[b]
        quant_w = sm.quant_words(
            plan_q[4, b], isz, sm.code_words(plan_q[1, b], plan_q[0, b], plan_q[3, b], chunk)
        )
        quant_lz_w = sm.quant_lz_words(
            rows[b], max(nu_q[b], 1), plan_u[4, b], isz,
            sm.code_words(plan_u[1, b], plan_u[0, b], plan_u[3, b], chunk),
        )  # fmt: skip
        raw_words = ((elem_off[b + 1] - elem_off[b]) * isz + 3) // 4
        mode[b], best[b] = sm.choose_lossy(
            raw_words, quant_ok[b], quant_w, quant_lz_ok[b], quant_lz_w
        )
        lower = max(nu_q[b], 1) if deduped[b] else 1
        tried[b] = sm.lossless_may_win(lz_allowed[b], rows[b], dims[b], isz, lower, best[b])
    nu_r = vector_lz.dedupe_blocks_kernel(
        symbols, bits, elem_off, row_off, dims, tried, True, ids_r, first_r
    )
    # The segment header's reference fields: the packing of the distinct vectors sent; a quant
    # block names its rows' id width with no packing. And each segment's size bound: a coded
    # stream exceeds its estimate by less than a word a chunk.
    ref_mode = np.empty(nb, np.int64)
    ref_width = np.empty(nb, np.int64)
    seg_max = np.empty(nb, np.int64)
    for b in range(nb):
        lossless_w = sm.lossless_lz_words(rows[b], max(nu_r[b], 1), dims[b], itemsize[b])
        m = sm.choose_lossless(
            mode[b], best[b], tried[b], lossless_w, elem_off[b + 1] - elem_off[b]
        )
        mode[b] = m
        sent = rows[b]
        coded = 0
        if m == MODE_QUANT_LZ:
            sent = max(nu_q[b], 1)
            coded = nu_q[b]
        elif m == MODE_LZ:
            sent = max(nu_r[b], 1)
        elif m == MODE_QUANT:
            coded = rows[b]
        r_mode, ref_width[b], _ = refs_packing(rows[b], max(sent, 1))
        ref_mode[b] = r_mode if m in (MODE_QUANT_LZ, MODE_LZ) else 0
        n_chunks = (coded * dims[b] + chunk - 1) // chunk
        seg_max[b] = (lossless_w if m == MODE_LZ else best[b]) + n_chunks + 2

    # 5. The payloads: header, descriptors, segments per group, written in place.
    skip = np.zeros(nb + 1, np.int64)  # words before a block's segment: its group's lead
    total = seg_max.sum()
    at = 0
    for g in range(ng):
        lead = HEADER_WORDS + DESCRIPTOR_WORDS * groups[g]
        skip[at] += lead  # an empty group's lead lands on the next block
        total += lead
        at += groups[g]
    out = np.zeros(total, np.uint32)
    seg_words = _emit_kernel(
        out, bits, symbols, elem_off, row_off, rows, dims, itemsize, mode, ref_mode, ref_width,
        step, center, chunk, every_row, ids_q, first_q, nu_q, ids_r, first_r, nu_r, sym_lo,
        plan_q, len_off_q, lengths_q, plan_u, len_off_u, lengths_u, skip,
    )  # fmt: skip
    desc = np.zeros(nb, DESCRIPTOR)
    for b in range(nb):
        desc[b]["rows"], desc[b]["dim"] = rows[b], dims[b]
        quantized = mode[b] == MODE_QUANT or mode[b] == MODE_QUANT_LZ
        desc[b]["dtype"] = dcodes[b]
        desc[b]["mode"] = mode[b] | MODE_VALUE if value[b] and quantized else mode[b]
        desc[b]["seg_words"], desc[b]["bound"] = seg_words[b], bnd[b]
    desc_words = desc.view(np.uint32)
    header = np.zeros(ng, HEADER)
    sizes = np.empty(ng, np.int64)
    p0 = 0
    b0 = 0
    for g in range(ng):
        n = groups[g]
        d0 = p0 + HEADER_WORDS
        p1 = d0 + DESCRIPTOR_WORDS * n + seg_words[b0 : b0 + n].sum()
        out[d0 : d0 + DESCRIPTOR_WORDS * n] = desc_words[
            DESCRIPTOR_WORDS * b0 : DESCRIPTOR_WORDS * (b0 + n)
        ]
        header[g]["magic"], header[g]["version"], header[g]["n_blocks"] = MAGIC, VERSION, n
        header[g]["body_words"] = p1 - d0
        header[g]["checksum"] = checksum_words(out[d0:p1])
        sizes[g] = p1 - p0
        p0 = p1
        b0 += n
    header_words = header.view(np.uint32)
    p0 = 0
    for g in range(ng):
        out[p0 : p0 + HEADER_WORDS] = header_words[HEADER_WORDS * g : HEADER_WORDS * (g + 1)]
        p0 += sizes[g]
        sizes[g] *= 4

    per_block = np.zeros((4, nb), np.int64)
    for b in range(nb):
        m = mode[b]
        per_block[0, b] = m
        per_block[1, b] = seg_words[b]
        per_block[2, b] = nu_q[b] if m == MODE_QUANT_LZ else nu_r[b] if m == MODE_LZ else rows[b]
        if m == MODE_QUANT:
            per_block[3, b] = plan_q[4, b]
        elif m == MODE_QUANT_LZ:
            per_block[3, b] = plan_u[4, b]
        if m != MODE_QUANT and m != MODE_QUANT_LZ:
            max_err[b] = 0.0
    skeletons, skeleton_ends = skeletons_kernel(out[:p0], sizes)
    return out[:p0], sizes, per_block, max_err, skeletons, skeleton_ends


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
    x, bits = _flatten(blocks, rows, dims, dcodes.count(1) == nb)
    n_rows = sum(rows)
    group_arr, keys = _group_keys(groups, config.rounding == "stochastic", config.seed)
    words, sizes, per_block, max_err, skel, skel_ends = _compress_kernel(
        x, bits, layout, bnd, group_arr, keys, config.enable_quantization,
        config.enable_lz, quantize.grid_bound(1.0, config.rounding == "stochastic"),
        config.huffman_chunk_symbols, _WORK_BUFFERS.array("symbols", x.shape[0], np.uint16),
        _WORK_BUFFERS.array("rows", 4 * n_rows, np.int32),
    )  # fmt: skip
    if len(groups) == 1:  # one destination (2 ranks): nothing to cut
        skeletons = [skel]
    else:
        ends = skel_ends.tolist()
        skeletons = [skel[a:b] for a, b in itertools.pairwise(ends)]
    return BatchEncoded(
        words.view(np.uint8), sizes.tolist(), bnd, rows, dims, dcodes, per_block, max_err, skeletons
    )


@functools.lru_cache(maxsize=256)
def _group_keys(
    groups: tuple[int, ...], stochastic: bool, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """int64 blocks per group and each block's rounding key (``pipeline.sr_keys``: counted
    within its own payload), once per layout and seed rather than per call (the kernel only
    reads them)."""
    local = np.array([i for n in groups for i in range(n)], np.int64)
    return np.array(groups, np.int64), quantize.block_keys(stochastic, seed, local)


__all__ = ["BatchEncoded", "compress_blocks"]
