"""The compiled CPU codec, batched: one compiled call encodes every block of every payload.

The blocks are concatenated (values, raw bits, rows) with per-block offsets, and one numba call
(``_compress_kernel``) runs every stage over the whole concatenation: finite ranges and relative
bounds, quantization, vector-LZ, Huffman planning, the mode choice, the payload writer, the
descriptors, headers and checksums; on the way back, one call reads every segment. No Python
runs per block, and the fixed cost of a call is a few numpy / torch calls around the compiled
one, so small all-to-all payloads pay for their bytes, not for the stages. The bytes are those
of the stage-by-stage path (``pipeline`` with ``ReferenceOps``, the test oracle), and the mode
choice is ``size_model``'s, the relative bound ``bounds.finite_span``'s and the checksum
``format``'s, shared with the device path (the first two compile into the kernel through
``elementwise``).
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
from torchrec_lossy.codec.bounds import finite_span
from torchrec_lossy.codec.container import BlockColumns, skeletons_kernel
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    CODE_DTYPES,
    DESCRIPTOR,
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    HEADER,
    MAGIC,
    MAX_CENTER,
    MAX_CODE_LENGTH,
    MODE_LZ,
    MODE_NAMES,
    MODE_QUANT,
    MODE_QUANT_LZ,
    MODE_RAW,
    REFS_FIXED,
    REFS_FLAGGED,
    SYMBOL_OFFSET,
    VERSION,
    checksum_words,
)
from torchrec_lossy.config import CodecConfig

_HEADER_WORDS = HEADER.itemsize // 4
_DESCRIPTOR_WORDS = DESCRIPTOR.itemsize // 4
_SEG_WORDS = sm.SEGMENT_HEADER_WORDS
_FLT_MAX = float(np.finfo(np.float32).max)


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
        rows, dims = self.rows, self.dims
        modes, seg_words, n_unique, n_escapes = self.per_block.tolist()
        return BlockColumns(
            rows=rows,
            dim=dims,
            raw_bytes=[
                r * d * (4 if c == 1 else 2)
                for r, d, c in zip(rows, dims, self.dtype_codes, strict=True)
            ],
            wire_bytes=[DESCRIPTOR.itemsize + 4 * w for w in seg_words],
            mode=[MODE_NAMES[m] for m in modes],
            bound=self.bounds.tolist(),
            max_error=self.max_error.tolist(),
            n_unique=n_unique,
            n_escapes=n_escapes,
        )


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.shape[0] + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


class _Scratch(threading.local):
    """Per-thread work buffers, kept between calls: a fresh multi-megabyte array costs a page
    fault per 4 KiB on first touch, which on small payloads cost as much as a stage."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``n`` elements (uninitialised), valid until the next ``get(name)``."""
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.shape[0] < n:
            buf = torch.empty(max(n, 1024), dtype=dtype)
            self.buffers[name] = buf
        return buf[:n]

    def array(self, name: str, n: int, dtype: type[np.generic]) -> np.ndarray:
        """:meth:`get` for numpy callers: an ``n``-element array (uninitialised), valid until
        the next ``array(name)``."""
        buf = self.arrays.get(name)
        if buf is None or buf.dtype != dtype or buf.shape[0] < n:
            buf = np.empty(max(n, 1024), dtype)
            self.arrays[name] = buf
        return buf[:n]


_SCRATCH = _Scratch()


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
            n = sum(rows) * dim
            x = _SCRATCH.get("x", n, torch.float32)
            torch.cat(blocks, out=x.view(-1, dim))
        else:
            flat = [b.reshape(-1) for b in blocks]
            n = sum(f.shape[0] for f in flat)
            x = torch.cat(flat, out=_SCRATCH.get("x", n, torch.float32))
        x_np = x.numpy()
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
            out[pos + 2] = nu
            out[pos + 7] = (ref_mode[b] << 8) | (ref_width[b] << 16)
            pos += _SEG_WORDS
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
            out[pos] = np.float32(step[b]).view(np.uint32)
            out[pos + 1] = np.uint32(np.int64(center[b]) & 0xFFFFFFFF)
            out[pos + 2] = n_sent
            out[pos + 3] = n_esc
            out[pos + 4] = chunk
            out[pos + 5] = n_chunks
            out[pos + 6] = lo | (count << 16)
            out[pos + 7] = esc_len | (ref_mode[b] << 8) | (ref_width[b] << 16)
            pos += _SEG_WORDS
            for k in range(count):  # the codebook: 4-bit lengths, low nibble first
                byte = k >> 1
                nib = np.uint32(lengths[lo - base + k]) << np.uint32(4 * (k & 1))
                out[pos + (byte >> 2)] |= nib << np.uint32(8 * (byte & 3))
            pos += (((count + 1) // 2) + 3) // 4
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
    whether the bound is relative (1) or absolute (0), of each block. ``bnd`` is updated in
    place (relative bounds resolved); the scratch arrays (``symbols`` as long as ``x``,
    ``row_scratch`` int32 [4 * rows]) are overwritten. (Flat arrays: reshaped here, where it
    costs nothing, rather than by the caller.) Returns (the payloads' words, back to back;
    bytes of each payload; int64 [4, n_blocks] mode, segment words, vectors sent, escapes;
    float64 max error per block; the payloads' skeletons and their offsets, as
    ``container.payload_skeletons`` gives them: gathered here, where the words are at hand,
    rather than in a call of their own).
    """
    nb = layout.shape[0] // 4
    rows, dims, dcodes = layout[:nb], layout[nb : 2 * nb], layout[2 * nb : 3 * nb]
    relative = layout[3 * nb :]
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
    # bounds resolved as bounds.absolute_bounds does.
    lo, hi = quantize.finite_ranges_kernel(x, elem_off)
    wanted = np.zeros(nb, np.bool_)
    grid = np.empty(nb, np.float64)
    mid = np.zeros(nb, np.float64)
    for b in range(nb):
        if relative[b]:
            span = finite_span(np.float32(lo[b]), np.float32(hi[b]))
            bnd[b] = bnd[b] * span if bnd[b] > 0 else 0.0
        numel = elem_off[b + 1] - elem_off[b]
        wanted[b] = bnd[b] > 0 and numel > 0 and quantization
        # The grid the codes live on (quantize.grid_bound: half the bound for stochastic).
        grid[b] = grid_scale * bnd[b]
        if np.isnan(lo[b]):
            continue
        if (hi[b] - lo[b]) <= 2 * SYMBOL_OFFSET * min(2.0 * grid[b], _FLT_MAX):
            mid[b] = 0.5 * (lo[b] + hi[b])
        elif wanted[b]:  # outliers: the median of the block's finite values
            v = x[elem_off[b] : elem_off[b + 1]]
            fin = v[np.isfinite(v)].astype(np.float64)
            mid[b] = np.median(fin)
    step, inv_step, center, quant_ok = quantize.quant_params_blocks_kernel(grid, mid, wanted)

    # 2. Quantize (only the active blocks' symbols are ever read).
    max_err, sym_lo, sym_hi = quantize.quantize_blocks_kernel(
        x, elem_off, step, inv_step, center, bnd, dcodes, quant_ok, symbols, keys
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
        r_mode, ref_width[b], _ = sm.refs(rows[b], max(sent, 1))
        ref_mode[b] = r_mode if m in (MODE_QUANT_LZ, MODE_LZ) else 0
        n_chunks = (coded * dims[b] + chunk - 1) // chunk
        seg_max[b] = (lossless_w if m == MODE_LZ else best[b]) + n_chunks + 2

    # 5. The payloads: header, descriptors, segments per group, written in place.
    skip = np.zeros(nb + 1, np.int64)  # words before a block's segment: its group's lead
    total = seg_max.sum()
    at = 0
    for g in range(ng):
        lead = _HEADER_WORDS + _DESCRIPTOR_WORDS * groups[g]
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
        desc[b]["dtype"], desc[b]["mode"] = dcodes[b], mode[b]
        desc[b]["seg_words"], desc[b]["bound"] = seg_words[b], bnd[b]
    desc_words = desc.view(np.uint32)
    header = np.zeros(ng, HEADER)
    sizes = np.empty(ng, np.int64)
    p0 = 0
    b0 = 0
    for g in range(ng):
        n = groups[g]
        d0 = p0 + _HEADER_WORDS
        p1 = d0 + _DESCRIPTOR_WORDS * n + seg_words[b0 : b0 + n].sum()
        out[d0 : d0 + _DESCRIPTOR_WORDS * n] = desc_words[
            _DESCRIPTOR_WORDS * b0 : _DESCRIPTOR_WORDS * (b0 + n)
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
        out[p0 : p0 + _HEADER_WORDS] = header_words[_HEADER_WORDS * g : _HEADER_WORDS * (g + 1)]
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
    relative: Sequence[bool] | None = None,
) -> BatchEncoded:
    """Encodes validated blocks into one payload per group, each stage once over all blocks.

    Args:
        blocks: 2-D float32 / float16 / bfloat16 tensors (validated by the caller).
        bounds: Absolute bound per block (validated).
        config: Codec knobs.
        group_sizes: Blocks per group (consecutive blocks; they sum to ``len(blocks)``); None
            for one group. Each group's payload is the bytes a call with its blocks alone gives.
        relative: Per block, whether its bound is a fraction of its finite range, resolved as
            ``bounds.absolute_bounds`` does (from the range this pass computes anyway); None:
            all absolute.

    Returns:
        The payloads and per-block results.
    """
    nb = len(blocks)
    groups = (nb,) if group_sizes is None else tuple(group_sizes)
    rows = [b.shape[0] for b in blocks]
    dims = [b.shape[1] for b in blocks]
    dcodes = [DTYPE_CODES[b.dtype] for b in blocks]
    # Each numpy call costs microseconds on arrays this small: one per input dtype.
    rel = [0] * nb if relative is None else [1 if r else 0 for r in relative]
    layout = np.array(rows + dims + dcodes + rel, np.int64)
    bnd = np.array(bounds, np.float64)
    x, bits = _flatten(blocks, rows, dims, dcodes.count(1) == nb)
    n_rows = sum(rows)
    group_arr, keys = _group_keys(groups, config.rounding == "stochastic", config.seed)
    words, sizes, per_block, max_err, skel, skel_ends = _compress_kernel(
        x, bits, layout, bnd, group_arr, keys, config.enable_quantization,
        config.enable_lz, quantize.grid_bound(1.0, config.rounding == "stochastic"),
        config.huffman_chunk_symbols, _SCRATCH.array("symbols", x.shape[0], np.uint16),
        _SCRATCH.array("rows", 4 * n_rows, np.int32),
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


# ---------------------------------------------------------------------------------------------
# Decode: one compiled reader over every segment of one or several payloads.

# Block status of the batched reader: decoded, or left to the per-block decoder (a corrupt
# segment, whose exact error that decoder names, or a float16 quantized block).
_DECODED = 0
_FALL_BACK = 1


@numba.njit(cache=True, nogil=True, inline="always")
def _ref_width(n_unique: int) -> int:
    width = 0
    while (1 << width) < n_unique:
        width += 1
    return width


@numba.njit(cache=True, nogil=True, inline="always")
def _refs(
    words: np.ndarray, pos: int, end: int, rows: int, n_unique: int, ref_mode: int, width: int,
    ids: np.ndarray,
) -> int:  # fmt: skip
    """Unpacks a segment's vector references at word ``pos``; -> the next word, -1 if corrupt."""
    if n_unique < 1 or n_unique > rows or width != _ref_width(n_unique):
        return -1
    if ref_mode == REFS_FIXED:
        n_bits = rows * width
    elif ref_mode == REFS_FLAGGED:
        n_bits = rows + (rows - n_unique) * width
    else:
        return -1
    n_words = (n_bits + 31) // 32
    if pos + n_words > end:
        return -1
    if vector_lz.unpack_refs_kernel(words[pos : pos + n_words], rows, n_unique, ref_mode, width,
                                    ids) != 0:  # fmt: skip
        return -1
    return pos + n_words


@numba.njit(cache=True, nogil=True, inline="always")
def _next_symbol(
    stream: np.ndarray, w: int, end: int, buf: np.uint64, n_bits: int, table: np.ndarray,
    shift_peek: np.uint64,
) -> tuple[int, int, np.uint64, int]:  # fmt: skip
    """One symbol of a chunk (``huffman.decode_range_kernel``'s step): -> (its index in the
    code, or -1 for an invalid entry or a code past the chunk's bits; the stream state)."""
    while n_bits <= 32 and w < end:
        buf |= np.uint64(stream[w]) << np.uint64(32 - n_bits)
        n_bits += 32
        w += 1
    entry = table[np.int64(buf >> shift_peek)]
    length = entry >> 16
    if entry < 0 or length > n_bits:
        return -1, w, buf, n_bits
    return entry & 0xFFFF, w, buf << np.uint64(length), n_bits - length


@numba.njit(cache=True, nogil=True)
def _huffman_values(
    stream: np.ndarray, chunk_ends: np.ndarray, chunk: int, lengths: np.ndarray,
    vtable: np.ndarray, out: np.ndarray,
) -> bool:  # fmt: skip
    """Decodes a block's symbols straight to their values: ``out[i] = vtable[code index]``.

    For a block with no escapes only: it succeeds exactly where ``huffman.decode_range_kernel``
    with no escape positions does (an escape symbol is an error there). Chunks are independent
    streams: two are decoded side by side, so the table look-ups of one hide the latency of
    the other's.

    Args:
        stream: uint32 bitstream.
        chunk_ends: uint32 end word of each chunk.
        chunk: Symbols per chunk (>= 1).
        lengths: uint8 code lengths of the compact code (value symbols, then the escape).
        vtable: Value of each symbol of the code (int32 bits or uint16 halves; the escape's,
            last, is never kept).
        out: The block's values (as ``vtable``), one per symbol.

    Returns:
        Whether the stream decoded.
    """
    table = huffman.decode_table_kernel(lengths)
    if table.shape[0] == 0:
        return False
    escape = lengths.shape[0] - 1
    escapes = 0  # counted, not branched on: any is an error (the block has no escapes)
    n_chunks = chunk_ends.shape[0]
    peek = huffman.stream_layout(table, chunk_ends, stream.shape[0])
    if peek < 0:
        return False
    sp = np.uint64(64 - peek)
    n = out.shape[0]
    for c in range(0, n_chunks, 2):
        a0 = c * chunk
        a_n = min(n, a0 + chunk) - a0
        wa = np.int64(chunk_ends[c - 1]) if c else np.int64(0)
        ea = np.int64(chunk_ends[c])
        ba = np.uint64(0)
        na = 0
        b0 = a0 + a_n
        b_n = min(n, b0 + chunk) - b0 if c + 1 < n_chunks else 0
        wb = ea
        eb = np.int64(chunk_ends[c + 1]) if c + 1 < n_chunks else ea
        bb = np.uint64(0)
        nb = 0
        for i in range(b_n):  # both chunks (the second is never the longer)
            sa, wa, ba, na = _next_symbol(stream, wa, ea, ba, na, table, sp)
            sb, wb, bb, nb = _next_symbol(stream, wb, eb, bb, nb, table, sp)
            if sa < 0 or sb < 0:
                return False
            escapes += (sa == escape) + (sb == escape)
            out[a0 + i] = vtable[sa]
            out[b0 + i] = vtable[sb]
        for i in range(b_n, a_n):  # the rest of the first
            sa, wa, ba, na = _next_symbol(stream, wa, ea, ba, na, table, sp)
            if sa < 0:
                return False
            escapes += sa == escape
            out[a0 + i] = vtable[sa]
    return escapes == 0


@numba.njit(cache=True, nogil=True)
def _decode_segment(
    words: np.ndarray, halves: np.ndarray, floats: np.ndarray, s: int, end: int, n_rows: int,
    dim: int, isz: int, dtype_code: int, m: int, o: int, out32: np.ndarray, out32f: np.ndarray,
    out16: np.ndarray, ids: np.ndarray, symbols: np.ndarray, values: np.ndarray,
    halves_out: np.ndarray, compact: np.ndarray, vtable: np.ndarray, vtable16: np.ndarray,
) -> int:  # fmt: skip
    """Decodes one block's segment ``words[s:end]`` into ``out32`` / ``out16`` at ``o``.

    ``words`` / ``halves`` / ``floats`` are views of one buffer (uint32, uint16, float32);
    ``out32f`` is the float32 view of ``out32``. Every check of ``pipeline``'s per-block
    decoder is made: a block that fails one is ``_FALL_BACK``, left for that decoder to name
    the error, as is a float16 quantized block. ``ids``, ``symbols``, ``values`` (float32) and
    ``halves_out`` (uint16) are scratch of the largest block (``symbols`` at least the
    alphabet's size), ``compact`` (uint8), ``vtable`` (float32) and ``vtable16`` (uint16) of
    the alphabet's size.

    Returns:
        ``_DECODED`` or ``_FALL_BACK``.
    """
    values_i = values.view(np.int32)
    values_u = values.view(np.uint32)
    if m == MODE_RAW:
        numel = n_rows * dim
        if s + (numel * isz + 3) // 4 != end:
            return _FALL_BACK
        if isz == 4:
            dst = out32[o : o + numel]
            for k in range(numel):
                dst[k] = np.int32(words[s + k])
        else:
            h = 2 * s
            for k in range(numel):
                out16[o + k] = halves[h + k]
        return _DECODED
    if end - s < _SEG_WORDS:
        return _FALL_BACK
    n_unique = np.int64(words[s + 2])
    w7 = np.int64(words[s + 7])
    ref_mode = (w7 >> 8) & 0xFF
    width = (w7 >> 16) & 0xFF
    pos = s + _SEG_WORDS
    if m == MODE_LZ:
        pos = _refs(words, pos, end, n_rows, n_unique, ref_mode, width, ids)
        if pos < 0 or pos + (n_unique * dim * isz + 3) // 4 != end:
            return _FALL_BACK
        for r in range(n_rows):
            u = np.int64(ids[r])
            if isz == 4:
                src = words[pos + u * dim : pos + (u + 1) * dim]
                dst = out32[o + r * dim : o + (r + 1) * dim]
                for j in range(dim):
                    dst[j] = np.int32(src[j])
            else:
                h = 2 * pos + u * dim
                for j in range(dim):
                    out16[o + r * dim + j] = halves[h + j]
        return _DECODED
    step = floats[s]
    center = np.int64(np.int32(words[s + 1]))
    n_esc = np.int64(words[s + 3])
    chunk = np.int64(words[s + 4])
    n_chunks = np.int64(words[s + 5])
    lo = np.int64(words[s + 6]) & 0xFFFF
    count = np.int64(words[s + 6]) >> 16
    esc_len = w7 & 0xFF
    if (
        dtype_code == 2
        or not (np.isfinite(step) and step > 0 and abs(center) <= MAX_CENTER)
        or lo + count > ESCAPE_SYMBOL
        or esc_len > MAX_CODE_LENGTH
    ):
        return _FALL_BACK
    n_nib = (count + 1) // 2
    if pos + (n_nib + 3) // 4 > end:
        return _FALL_BACK
    # The code in its compact form (value symbols lo .., then the escape), as the encoder
    # built it: the decode table then costs the code's size, not the alphabet's.
    nibbles = words[pos : pos + (n_nib + 3) // 4].view(np.uint8)
    for k in range(count):
        nib = nibbles[k >> 1]
        compact[k] = (nib >> 4) if k & 1 else (nib & 0xF)
    compact[count] = esc_len
    pos += (n_nib + 3) // 4
    lz = m == MODE_QUANT_LZ
    if lz:
        pos = _refs(words, pos, end, n_rows, n_unique, ref_mode, width, ids)
    elif n_unique != n_rows:
        pos = -1
    n_sym = n_unique * dim
    if pos < 0 or n_esc > n_sym or chunk < 1 or n_chunks != (n_sym + chunk - 1) // chunk:
        return _FALL_BACK
    esc_at = pos
    esc_bits_at = esc_at + n_esc
    ends_at = esc_bits_at + (n_esc * isz + 3) // 4
    if ends_at + n_chunks > end:
        return _FALL_BACK
    bits_at = ends_at + n_chunks
    stream = words[bits_at:end]
    chunk_ends = words[ends_at:bits_at]
    code = compact[: count + 1]
    # The values of the code's symbols, dequantized as every element would be (same bits).
    for k in range(count):
        symbols[k] = lo + k
    quantize.dequantize_kernel(symbols[:count], step, center, vtable[:count])
    if n_esc == 0:  # the common case: symbols decode straight to values
        if isz == 2:
            vt_bits = vtable.view(np.uint32)
            for k in range(count):
                vtable16[k] = np.uint16(quantize.bf16_round_bits(np.int64(vt_bits[k])) >> 16)
            h = halves_out[:n_sym] if lz else out16[o : o + n_sym]
            if not _huffman_values(stream, chunk_ends, chunk, code, vtable16[: count + 1], h):
                return _FALL_BACK
        else:
            vi = values_i[:n_sym] if lz else out32[o : o + n_sym]
            vt_i = vtable.view(np.int32)[: count + 1]
            if not _huffman_values(stream, chunk_ends, chunk, code, vt_i, vi):
                return _FALL_BACK
    else:
        sym = symbols[:n_sym]
        if huffman.decode_range_kernel(stream, chunk_ends, chunk, code, lo,
                                       words[esc_at : esc_at + n_esc], sym) != 0:  # fmt: skip
            return _FALL_BACK
        if isz == 2:  # bfloat16: the round-to-nearest-even cast the encoder checked
            quantize.dequantize_kernel(sym, step, center, values[:n_sym])
            h = halves_out[:n_sym]
            for k in range(n_sym):
                h[k] = np.uint16(quantize.bf16_round_bits(np.int64(values_u[k])) >> 16)
            for k in range(n_esc):
                h[np.int64(words[esc_at + k])] = halves[2 * esc_bits_at + k]
            if not lz:
                out16[o : o + n_sym] = h
        else:
            vf = values[:n_sym] if lz else out32f[o : o + n_sym]
            vi = values_i[:n_sym] if lz else out32[o : o + n_sym]
            quantize.dequantize_kernel(sym, step, center, vf)
            for k in range(n_esc):
                vi[np.int64(words[esc_at + k])] = np.int32(words[esc_bits_at + k])
    if lz:  # the distinct vectors, decoded into scratch, to the rows
        for r in range(n_rows):
            u = np.int64(ids[r]) * dim
            if isz == 2:
                dst16 = out16[o + r * dim : o + (r + 1) * dim]
                for j in range(dim):
                    dst16[j] = halves_out[u + j]
            else:
                dst = out32[o + r * dim : o + (r + 1) * dim]
                for j in range(dim):
                    dst[j] = values_i[u + j]
    return _DECODED


@numba.njit(cache=True, nogil=True)
def _payload_blocks(words: np.ndarray, base: int, n_bytes: int, max_elements: int) -> int:
    """Blocks of the payload at word ``base``, or -1 where ``container.parse_header`` raises
    (the same checks: header, checksum, descriptors, segment lengths, the element limit)."""
    if n_bytes < _HEADER_WORDS * 4:
        return -1
    if words[base] != MAGIC or (words[base + 1] & 0xFFFF) != VERSION:
        return -1
    body_words = np.uint64(words[base + 4]) | (np.uint64(words[base + 5]) << np.uint64(32))
    if (n_bytes - _HEADER_WORDS * 4) % 4 or body_words != np.uint64(n_bytes // 4 - _HEADER_WORDS):
        return -1
    body = words[base + _HEADER_WORDS : base + n_bytes // 4]
    check = np.uint64(words[base + 6]) | (np.uint64(words[base + 7]) << np.uint64(32))
    if checksum_words(body) != check:
        return -1
    n_blocks = np.int64(words[base + 2])
    desc_words = n_blocks * _DESCRIPTOR_WORDS
    if desc_words > body.shape[0]:
        return -1
    total = 0
    seg_total = 0
    for b in range(n_blocks):
        d = body[b * _DESCRIPTOR_WORDS : (b + 1) * _DESCRIPTOR_WORDS]
        seg_total += np.int64(d[3])
        if (d[2] & 0xFF) not in (1, 2, 3) or ((d[2] >> 8) & 0xFF) > MODE_QUANT_LZ:
            return -1
        rows = np.int64(d[0])
        dim = max(np.int64(d[1]), 1)
        if rows > (max_elements - total) // dim:  # total + rows * dim > max_elements, no wrap
            return -1
        total += rows * dim
    if seg_total != body.shape[0] - desc_words:
        return -1
    return n_blocks


@numba.njit(cache=True, nogil=True)
def _decode_payloads_kernel(
    words: np.ndarray, groups: np.ndarray, max_elements: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parses every payload and decodes every block of the ones whose header is sound.

    ``groups`` is int64 [2 * G]: the first word of each payload in ``words``, then the bytes
    of each (one array: reshaped here, where it costs nothing, rather than by the caller).

    Returns:
        (the 4-byte blocks' bits as float32 and the 2-byte ones' as uint16, each back to
        back; int64 [5, n] rows, dim, dtype code, offset in its output and status of every
        block; int64 [G + 1] first block of each payload; int64 [G] blocks of each payload,
        -1 where its header is rejected).
    """
    n_groups = groups.shape[0] // 2
    group_base, group_bytes = groups[:n_groups], groups[n_groups:]
    n_of = np.empty(n_groups, np.int64)
    for g in range(n_groups):
        n_of[g] = _payload_blocks(words, group_base[g], group_bytes[g], max_elements)
    first = np.zeros(n_groups + 1, np.int64)
    for g in range(n_groups):
        first[g + 1] = first[g] + max(n_of[g], 0)
    nb = first[n_groups]
    table = np.empty((5, nb), np.int64)
    seg = np.empty((2, nb), np.int64)
    n32 = 0
    n16 = 0
    big = ALPHABET_SIZE
    max_rows = 0
    for g in range(n_groups):
        body = group_base[g] + _HEADER_WORDS
        at = body + max(n_of[g], 0) * _DESCRIPTOR_WORDS
        for k in range(max(n_of[g], 0)):
            b = first[g] + k
            d = words[body + k * _DESCRIPTOR_WORDS : body + (k + 1) * _DESCRIPTOR_WORDS]
            rows = np.int64(d[0])
            dim = np.int64(d[1])
            code = np.int64(d[2] & 0xFF)
            table[0, b] = rows
            table[1, b] = dim
            table[2, b] = code
            table[3, b] = n32 if code == 1 else n16
            if code == 1:
                n32 += rows * dim
            else:
                n16 += rows * dim
            seg[0, b] = at
            at += np.int64(d[3])
            seg[1, b] = at
            big = max(big, rows * dim)
            max_rows = max(max_rows, rows)
    out32 = np.empty(n32, np.int32)
    out16 = np.empty(n16, np.uint16)
    ids = np.empty(max_rows, np.int32)
    symbols = np.empty(big, np.uint16)
    values = np.empty(big, np.float32)
    halves_out = np.empty(big, np.uint16)
    compact = np.zeros(ALPHABET_SIZE, np.uint8)
    vtable = np.empty(ALPHABET_SIZE, np.float32)
    vtable16 = np.empty(ALPHABET_SIZE, np.uint16)
    halves = words.view(np.uint16)
    floats = words.view(np.float32)
    out32f = out32.view(np.float32)
    for g in range(n_groups):
        for b in range(first[g], first[g + 1]):
            code = table[2, b]
            modes = words[group_base[g] + _HEADER_WORDS + (b - first[g]) * _DESCRIPTOR_WORDS + 2]
            table[4, b] = _decode_segment(
                words, halves, floats, seg[0, b], seg[1, b], table[0, b], table[1, b],
                4 if code == 1 else 2, code, np.int64((modes >> 8) & 0xFF), table[3, b], out32,
                out32f, out16, ids, symbols, values, halves_out, compact, vtable, vtable16,
            )  # fmt: skip
    return out32f, out16, table, first, n_of


@dataclass(frozen=True)
class BatchDecoded:
    """Every block of several payloads, decoded by one compiled call (:func:`decompress_payloads`).

    Attributes:
        out32: Every 4-byte block's bits, back to back, as float32 (the dtype of nearly every
            block: their views need no cast).
        out16: int16 bits of every 2-byte block, back to back.
        layout: int64 [5, n]: rows, dim, dtype code (``format.DTYPE_CODES``), offset in its
            output and status of every block of every accepted payload, in order.
        first: int64 [G + 1]: first block of each payload in ``layout``, then the end.
        n_blocks: int64 [G]: blocks of each payload, -1 where its header or descriptors were
            not sound.
    """

    out32: torch.Tensor
    out16: torch.Tensor
    layout: np.ndarray
    first: np.ndarray
    n_blocks: np.ndarray

    @functools.cached_property
    def accepted(self) -> np.ndarray:
        """bool [G]: whether each payload's header and descriptors were sound."""
        return self.n_blocks >= 0

    @functools.cached_property
    def _lists(self) -> tuple[list[list[int]], list[int], list[int]]:
        """``layout``, ``first`` and ``n_blocks`` as Python lists, read once for every
        per-group call (indexing numpy arrays element by element costs more)."""
        return self.layout.tolist(), self.first.tolist(), self.n_blocks.tolist()

    def complete(self, group: int) -> bool:
        """Whether every block of payload ``group`` decoded here (else the per-block decoder
        must run on it, to decode what was left or to name what is wrong).

        Args:
            group: The payload's index.

        Returns:
            True if :meth:`blocks` has them all.
        """
        layout, first, n_blocks = self._lists
        return n_blocks[group] >= 0 and not any(layout[4][first[group] : first[group + 1]])

    def block(self, index: int) -> torch.Tensor | None:
        """One block (by its index in ``layout``), or None where it was left undecoded.

        Args:
            index: The block's index.

        Returns:
            A ``[rows, dim]`` view of the outputs in the block's dtype, or None.
        """
        rows, dim, code, at, status = self.layout[:, index].tolist()
        if status != _DECODED:
            return None
        base = self.out32 if code == 1 else self.out16
        return base.narrow(0, at, rows * dim).view(CODE_DTYPES[code]).view(rows, dim)

    def blocks(self, group: int) -> list[torch.Tensor]:
        """The blocks of a :meth:`complete` payload, in order.

        Args:
            group: The payload's index.

        Returns:
            ``[rows, dim]`` views of the outputs in each block's dtype.
        """
        layout, first, _ = self._lists
        b0, b1 = first[group], first[group + 1]
        rows, dims, codes = layout[0][b0:b1], layout[1][b0:b1], layout[2][b0:b1]
        if (
            b1 > b0
            and dims[0] > 0
            and dims.count(dims[0]) == len(dims)
            and (codes.count(codes[0]) == len(codes))
        ):  # one dtype and width (the usual payload): one split of one view
            base = self.out32 if codes[0] == 1 else self.out16
            at, n = layout[3][b0], sum(rows) * dims[0]
            if at or n != base.shape[0]:  # not the whole output (e.g. several payloads)
                base = base.narrow(0, at, n)
            dtype = CODE_DTYPES[codes[0]]
            if base.dtype != dtype:  # float32 blocks are views of out32 as it is
                base = base.view(dtype)
            # The op itself (Tensor.split is a Python wrapper around it).
            return list(base.view(-1, dims[0]).split_with_sizes(rows))
        return [self.block(b) for b in range(b0, b1)]


def decompress_payloads(words: np.ndarray, groups: np.ndarray, max_elements: int) -> BatchDecoded:
    """Parses and decodes every payload of one buffer in one compiled call.

    Every check of ``container.parse_header`` and of ``pipeline``'s per-block decoder is made;
    a payload that fails one is left (not :meth:`BatchDecoded.complete`) for that decoder, which
    names the error, as is a float16 quantized block.

    Args:
        words: The payloads' words (uint32; one buffer).
        groups: int64 [2 * G]: the first word of each payload in ``words``, then the bytes of
            each payload.
        max_elements: Refuse a payload that decodes to more elements than this.

    Returns:
        The decoded blocks and their layout.
    """
    out32, out16, layout, first, n_of = _decode_payloads_kernel(words, groups, max_elements)
    return BatchDecoded(
        torch.from_numpy(out32), torch.from_numpy(out16.view(np.int16)), layout, first, n_of
    )


__all__ = ["BatchDecoded", "BatchEncoded", "compress_blocks", "decompress_payloads"]
