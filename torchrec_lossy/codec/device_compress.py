"""Device-resident, batched compress: every stage runs once for all blocks, one sync in all.

``compress_device(blocks, bounds, config)`` builds the same payload, byte for byte, and the same
``BlockStats`` as ``pipeline.compress`` with the CPU backend, without the blocks leaving their
device. ``compress_groups_device`` does the same for several payloads at once (groups of
consecutive blocks, each payload byte-identical to its own compress), and
``start_groups_device`` stops before the read (:class:`PendingCompress`). Blocks are laid out
back to back (elements, rows, chunk slots), and host-side tables derived from the shapes only
(offsets, tiles, chunk slots, bound-derived steps) go to the device in one non-blocking copy;
relative bounds are resolved on the device from each block's finite range. Then, for all blocks
at once:

1. quantization parameters: per-block finite min / max (``segment_reduce``), the median rule
   (a segmented sort), the center (float32 multiply, float64 floor) - torch ops;
2. quantize + escapes + per-block histograms: ``kernels.quantize.quantize_tiles`` (one launch);
3. vector-LZ, quantized and lossless: ``kernels.vector_lz.representatives`` (hash with the block
   in the top bits, one sort, verify), ranks by a cumsum;
4. histograms of the distinct rows (``histogram_tiles``), code lengths of both histograms of every
   block (``kernels.codebook.code_lengths``), the size of every mode and the mode choice by
   ``size_model`` (the functions the host path calls) - torch ops over ``[n_blocks]`` tensors;
5. the sent symbol stream, canonical codes, Huffman encode of every chunk of every block
   (``kernels.huffman.encode_chunks``, chunk slots sized for the worst case);
6. section offsets (cumsums) and payload assembly: every section (descriptors, segment headers,
   codebook nibbles, references, escape positions / bits, chunk tables, bitstreams, raw and
   distinct rows) is added into an int64 word buffer sized for the worst case (each bit has one
   writer, so the sums are ORs); headers, descriptors and segment headers are packed from the
   ``format`` record dtypes (``container.pack_records``), checksums by
   ``container.segment_checksums``.

The single device-to-host transfer (:func:`_host`, or the caller's own for a pending compress)
reads the payload sizes and the per-block scalars of the stats; the payloads are then a slice
of the word buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch.profiler import record_function

from torchrec_lossy.codec import host_sync, quantize
from torchrec_lossy.codec import size_model as sm
from torchrec_lossy.codec.bounds import BoundKind, finite_span
from torchrec_lossy.codec.container import (
    DESCRIPTOR_WORDS,
    HEADER_WORDS,
    MASK32,
    BlockColumns,
    BlockStats,
    pack_records,
    segment_checksums,
    skeleton_index,
)
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    DESCRIPTOR,
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    HEADER,
    MAGIC,
    MAX_CENTER,
    MAX_CODE_LENGTH,
    MODE_LZ,
    MODE_QUANT,
    MODE_QUANT_LZ,
    MODE_RAW,
    MODE_VALUE,
    SEGMENT_HEADER,
    SEGMENT_HEADER_WORDS,
    VERSION,
    refs_packing,
    words_for_bits,
    words_for_bytes,
)
from torchrec_lossy.codec.format import ref_width as id_width
from torchrec_lossy.config import CodecConfig
from torchrec_lossy.kernels import codebook
from torchrec_lossy.kernels import huffman as k_huffman
from torchrec_lossy.kernels import quantize as k_quantize
from torchrec_lossy.kernels import vector_lz as k_vector_lz
from torchrec_lossy.kernels.common import block_for

_A = ALPHABET_SIZE
_QUANT_BLOCK = 4096  # elements per quantize tile
_FLT_MAX = float(np.finfo(np.float32).max)
_MASK32 = MASK32
_TRASH = 4096  # words of the assembly buffer's trash area (a power of two)


def _host(t: torch.Tensor) -> list[int]:
    """The one device-to-host transfer of a compress (counted as ``host_sync``'s "compress").

    Args:
        t: 1-D int64 tensor on the device.

    Returns:
        Its values.
    """
    return host_sync.to_host(t, "compress").tolist()


def _plan(hist: torch.Tensor, lengths: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    """``pipeline._Code.plan`` for many histograms.

    Args:
        hist: [n, ALPHABET_SIZE] symbol counts.
        lengths: int64 [n, ALPHABET_SIZE] their code lengths.
        chunk: Symbols per Huffman chunk.

    Returns:
        (words: codebook + chunk table + bitstream, chunk padding estimated as half a word per
        chunk; sym_lo; sym_count; n_escapes), each int64 [n].
    """
    hist = hist.to(torch.int64)
    bits = (hist * lengths).sum(dim=1)
    n = hist.sum(dim=1)
    value = lengths[:, :ESCAPE_SYMBOL] > 0
    used = value.any(dim=1)
    lo = value.to(torch.int8).argmax(dim=1)
    hi = ESCAPE_SYMBOL - 1 - value.flip(1).to(torch.int8).argmax(dim=1)
    lo = torch.where(used, lo, 0)
    count = torch.where(used, hi - lo + 1, 0)
    return sm.code_words(n, bits, count, chunk), lo, count, hist[:, ESCAPE_SYMBOL]


class _HostTables:
    """Everything derived from shapes, bounds and config, computed on the host (no data).

    Args:
        blocks: The blocks (only their shapes and dtypes are read).
        bounds: Absolute bounds, or for relative blocks the fraction of the block's finite
            range (resolved on the device), or per-value bounds.
        chunk: Symbols per Huffman chunk.
        config: Codec knobs.
        kinds: Per block, its ``BoundKind``.
        group_sizes: Blocks per payload (one payload per group, in block order).
    """

    def __init__(
        self,
        blocks: Sequence[torch.Tensor],
        bounds: Sequence[float],
        chunk: int,
        config: CodecConfig,
        kinds: Sequence[int],
        group_sizes: Sequence[int],
    ) -> None:
        b = len(blocks)
        if b >= 1 << 23:  # the row hash keeps the block id in 23 bits
            raise ValueError(f"{b} blocks in one payload: pass fewer than 2**23")
        self.n_blocks = b
        self.rows = np.array([t.shape[0] for t in blocks], dtype=np.int64)
        self.dim = np.array([t.shape[1] for t in blocks], dtype=np.int64)
        self.itemsize = np.array([t.element_size() for t in blocks], dtype=np.int64)
        self.dtype_code = np.array([DTYPE_CODES[t.dtype] for t in blocks], dtype=np.int64)
        self.numel = self.rows * self.dim
        self.elem_off = np.cumsum(self.numel) - self.numel
        self.row_off = np.cumsum(self.rows) - self.rows
        self.n_elems = int(self.numel.sum())
        self.n_rows = int(self.rows.sum())
        self.max_dim = int(self.dim.max()) if b else 0
        # Step and its reciprocal depend on the bound only (``quant_params_kernel`` with any
        # midpoint); the center needs the data and is computed on the device.
        step = np.zeros(b, np.float32)
        inv_step = np.zeros(b, np.float32)
        quant_try = np.zeros(b, np.int64)
        stochastic = config.rounding == "stochastic"
        self.grid_factor = quantize.grid_bound(1.0, stochastic)  # grid bound / bound
        sizes = np.array(group_sizes, dtype=np.int64).reshape(len(group_sizes))
        first_block = np.cumsum(sizes) - sizes
        local = np.arange(b, dtype=np.int64) - np.repeat(first_block, sizes)
        self.sr_key = quantize.block_keys(stochastic, config.seed, local)
        kind = np.array(kinds, dtype=np.int64).reshape(b)
        rel = (kind == BoundKind.RELATIVE).astype(np.int64)
        value = (kind == BoundKind.VALUE).astype(np.int64)
        self.any_relative = bool(rel.any())
        self.any_value = bool(value.any())
        for i, eb in enumerate(bounds):
            if not (config.enable_quantization and eb > 0 and self.numel[i] > 0):
                continue
            if value[i]:  # the per-value grid: step 2**-m; its qmax needs the data
                step[i], quant_try[i] = 2.0 ** -quantize.value_mantissa_bits(eb), 1
                continue
            if rel[i]:  # the worst case (it may quantize); the device decides
                quant_try[i] = 1
                continue
            grid = self.grid_factor * eb
            s, inv, _, ok = quantize.quant_params_kernel(grid, 0.0)
            if ok:
                step[i], inv_step[i], quant_try[i] = s, inv, 1
        self.quant_try = quant_try
        lz_allowed = np.array([config.enable_lz and r > 1 for r in self.rows], dtype=np.int64)
        raw_words = (self.numel * self.itemsize + 3) // 4
        # Tiles of the quantize launch, over the blocks that may quantize.
        tile_block = block_for(int(self.numel.max()) if b else 1, _QUANT_BLOCK)
        tiles = k_quantize.tile_table(self.numel, tile_block)
        tiles = tiles[quant_try[tiles[:, 2]] == 1]
        self.tile_block = tile_block
        # Huffman chunk slots: the worst case (every row sent) of the blocks that may quantize.
        slots = np.where(quant_try == 1, (self.numel + chunk - 1) // chunk, 0)
        self.first_slot = np.cumsum(slots) - slots
        self.n_slots = int(slots.sum())
        slot_blk = np.repeat(np.arange(b, dtype=np.int64), slots)
        slot_k = np.arange(self.n_slots, dtype=np.int64) - self.first_slot[slot_blk]
        slot_syms = np.minimum(chunk, self.numel[slot_blk] - slot_k * chunk)
        self.stream_words = int(((slot_syms * MAX_CODE_LENGTH + 31) // 32).sum())
        # Worst-case segment of every block: the largest of its modes' worst cases.
        refs_max = (self.rows * 33 + 31) // 32
        quant_max = (
            SEGMENT_HEADER_WORDS
            + 512
            + refs_max
            + self.numel
            + (self.numel * self.itemsize + 3) // 4
            + 2 * slots
            + (self.numel * MAX_CODE_LENGTH + 31) // 32
        )
        seg_max = np.maximum(raw_words, SEGMENT_HEADER_WORDS + refs_max + raw_words)
        seg_max = np.where(quant_try == 1, np.maximum(seg_max, quant_max), seg_max)
        self.n_groups = len(group_sizes)
        self.body_max = DESCRIPTOR_WORDS * b + int(seg_max.sum()) + HEADER_WORDS * self.n_groups
        group = np.repeat(np.arange(self.n_groups, dtype=np.int64), sizes)
        bound_bits = np.array(bounds, dtype=np.float64).view(np.int64)
        mults = k_vector_lz.column_multipliers(max(self.max_dim, 1))
        fields = {
            "rows": self.rows,
            "dim": self.dim,
            "itemsize": self.itemsize,
            "dtype_code": self.dtype_code,
            "elem_off": self.elem_off,
            "row_off": self.row_off,
            "step_bits": step.view(np.int32).astype(np.int64),
            "inv_step_bits": inv_step.view(np.int32).astype(np.int64),
            "bound_bits": bound_bits,
            "quant_try": quant_try,
            "sr_key": self.sr_key,
            "relative": rel,
            "value": value,
            "group": group,
            "local": local,
            "group_blocks": sizes,
            "lz_allowed": lz_allowed,
            "raw_words": raw_words,
            "first_slot": self.first_slot,
            "n_slots": slots,
            "slot_blk": slot_blk,
            "slot_k": slot_k,
            "tiles": tiles.reshape(-1),
            "mults": mults,
        }
        self.fields = fields

    def to_device(self, dev: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """All tables in one host-to-device copy (non-blocking from pinned memory on CUDA).

        Args:
            dev: The blocks' device.

        Returns:
            (device views by name, the host buffer, to keep alive until the copy is done).
        """
        sizes = [v.shape[0] for v in self.fields.values()]
        host = torch.from_numpy(np.concatenate([*self.fields.values(), np.zeros(1, np.int64)]))
        if dev.type == "cuda":
            host = host.pin_memory()
        flat = host.to(dev, non_blocking=True)
        out = {}
        start = 0
        for name, n in zip(self.fields, sizes, strict=True):
            out[name] = flat[start : start + n]
            start += n
        return out, host


def compress_device(
    blocks: Sequence[torch.Tensor],
    bounds: Sequence[float],
    config: CodecConfig,
    kinds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[BlockStats]]:
    """Compresses blocks on their device; the payload equals ``pipeline.compress``'s (CPU).

    Args:
        blocks: Validated 2-D float32 / float16 / bfloat16 tensors, all on one device (CUDA, or
            CPU under ``TRITON_INTERPRET=1``).
        bounds: Validated absolute error bounds (floats >= 0), one per block.
        config: Codec knobs.
        kinds: Per block, its ``BoundKind`` (absolute, or per-value); None: all absolute.

    Returns:
        (1-D uint8 payload on the blocks' device, one BlockStats per block). Exactly one
        device-to-host transfer is made (:func:`_host`).
    """
    buf, _, stats, _ = compress_groups_device(
        list(blocks), list(bounds), list(kinds or [0] * len(blocks)), [len(blocks)], config
    )
    return buf, stats[0]


def compress_groups_device(
    blocks: Sequence[torch.Tensor],
    bounds: Sequence[float],
    kinds: Sequence[int],
    group_sizes: Sequence[int],
    config: CodecConfig,
) -> tuple[torch.Tensor, list[int], list[list[BlockStats]], list[np.ndarray]]:
    """Compresses several payloads (groups of consecutive blocks) in one pass, one host read.

    Payload ``g`` holds blocks ``sum(group_sizes[:g]) ..`` and is byte-identical to
    :func:`compress_device` of those blocks (with relative bounds resolved as
    :func:`torchrec_lossy.codec.grouped.absolute_bounds` does, on the device).

    Args:
        blocks: Validated blocks, all on one device.
        bounds: Per block: the absolute bound, or for a relative block the fraction of its
            finite range (``max - min`` over the finite elements, float32).
        kinds: Per block, its ``BoundKind``.
        group_sizes: Blocks per payload.
        config: Codec knobs.

    Returns:
        (uint8 buffer with the payloads back to back, bytes per payload, BlockStats per payload
        and block, each payload's skeleton). Exactly one device-to-host transfer is made
        (:func:`_host`).
    """
    with record_function("## lossy_codec encode ##"):
        pending = start_groups_device(blocks, bounds, kinds, group_sizes, config)
        return pending.finish(_host(pending.readback))


def start_groups_device(
    blocks: Sequence[torch.Tensor],
    bounds: Sequence[float],
    kinds: Sequence[int],
    group_sizes: Sequence[int],
    config: CodecConfig,
) -> PendingCompress:
    """:func:`compress_groups_device` without its host read (no sync).

    Args:
        blocks: As :func:`compress_groups_device`.
        bounds: As :func:`compress_groups_device`.
        kinds: As :func:`compress_groups_device`.
        group_sizes: As :func:`compress_groups_device`.
        config: Codec knobs.

    Returns:
        The pending compress: read its ``readback`` (alone or with other tensors, in one copy)
        and pass the values to ``finish``.
    """
    dev = blocks[0].device if blocks else torch.device("cpu")
    with record_function("## lossy_codec encode ##"):
        return _compress(list(blocks), list(bounds), list(kinds), list(group_sizes), config, dev)


def _device_quant_params(eb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize.quant_params_kernel``'s step rule on the device (float64 bounds [n]).

    Returns:
        (float32 step, float32 1 / step, whether the step is usable).
    """
    two = (2.0 * eb).clamp(max=_FLT_MAX)
    step = two.float()
    down = (step.view(torch.int32) - 1).view(torch.float32)  # round down: step / 2 <= bound
    step = torch.where(step.double() > 2.0 * eb, down, step)
    ok = step >= float(np.finfo(np.float32).tiny)
    step = torch.where(ok, step, 0.0)
    inv = torch.where(ok, 1.0 / torch.where(ok, step, 1.0), 0.0)
    return step, inv, ok


def _quant_params(
    ht: _HostTables, t: dict[str, torch.Tensor], x: torch.Tensor, e_blk: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Every block's bound, step and center on the device (``quantize.quant_params``' rule).

    Args:
        ht: The host tables.
        t: Their device tensors.
        x: Every element as float32, block after block.
        e_blk: The block of every element.

    Returns:
        (float64 absolute bound, float32 step, float32 1 / step, int64 center, whether each
        block may quantize), each [n_blocks].
    """
    nb, n_el, dev, i64 = ht.n_blocks, ht.n_elems, x.device, torch.int64
    rows, dim, elem_off = t["rows"], t["dim"], t["elem_off"]
    finite = torch.isfinite(x)
    numel = rows * dim

    def per_block(v: torch.Tensor, how: str, initial: float) -> torch.Tensor:
        # Segmented reductions (no atomics); unsafe: skip the length checks, which would sync.
        return torch.segment_reduce(v, how, lengths=numel, unsafe=True, initial=initial)

    lo = per_block(torch.where(finite, x, math.inf), "min", math.inf)
    hi = per_block(torch.where(finite, x, -math.inf), "max", -math.inf)
    has_finite = lo <= hi
    lo64, hi64 = lo.double(), hi.double()
    bound = t["bound_bits"].view(torch.float64)
    step = t["step_bits"].to(torch.int32).view(torch.float32)
    inv_step = t["inv_step_bits"].to(torch.int32).view(torch.float32)
    quant_try = t["quant_try"] == 1
    if ht.any_relative:  # relative bounds: a fraction of the finite range, resolved here
        rel = t["relative"] == 1
        eb = torch.where(rel, bound * finite_span(lo, hi), bound)
        grid = ht.grid_factor * eb  # the grid's bound (half the bound for stochastic rounding)
        r_step, r_inv, r_ok = _device_quant_params(grid)
        step = torch.where(rel, r_step, step)
        inv_step = torch.where(rel, r_inv, inv_step)
        quant_try = torch.where(rel, quant_try & r_ok & (eb > 0), quant_try)
        bound = eb
    narrow = quantize.midpoint_fits(lo64, hi64, ht.grid_factor * bound)
    # Median of the finite values (np.median: the middle one, or the mean of the middle two).
    keyed = torch.where(finite, x, math.inf)
    order = torch.argsort(keyed, stable=True)
    order = order[torch.argsort(e_blk[order], stable=True)]
    ordered = keyed[order].double()
    n_fin = per_block(finite.double(), "sum", 0.0).to(i64)  # exact below 2**53
    upper = (elem_off + n_fin // 2).clamp(max=max(n_el - 1, 0))
    lower = (elem_off + (n_fin - 1) // 2).clamp(min=0, max=max(n_el - 1, 0))
    if n_el:
        median = (ordered[lower] + ordered[upper]) / 2
    else:
        median = torch.zeros(nb, dtype=torch.float64, device=dev)
    mid = torch.where(has_finite, torch.where(narrow, 0.5 * (lo64 + hi64), median), 0.0)
    center_f = torch.floor((mid.float() * inv_step).double() + 0.5)
    quant_ok = quant_try & (center_f.abs() <= MAX_CENTER)  # False for inf / nan
    center = torch.where(quant_ok, center_f, 0.0).to(i64)
    if ht.any_value:  # the per-value grid: center qmax, the code of the largest finite |x|
        val = t["value"] == 1
        amax = torch.where(has_finite, torch.maximum(lo.abs(), hi.abs()), 0.0)
        shift = ((step.view(torch.int32).to(i64) >> 23) & 0xFF) - 104  # 23 - m for 2**-m
        qmax = quantize.value_code(amax.view(torch.int32).to(i64), shift.clamp(0, 23))
        center = torch.where(val & quant_try, qmax, center)
        quant_ok = torch.where(val, quant_try, quant_ok)
    return bound, step, inv_step, center, quant_ok


def _vector_lz(
    symbols: torch.Tensor | None,
    bits: torch.Tensor,
    row_args: tuple,
    t: dict[str, torch.Tensor],
    r_blk: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Repeated rows of every block, over the quantized symbols or (None) the raw bits.

    Args:
        symbols: int16 quantized symbols of every element, or None for the raw bits.
        bits: int32 raw bits of every element.
        row_args: ``k_vector_lz.representatives``' row arguments.
        t: The host tables' device tensors.
        r_blk: The block of every row.

    Returns:
        (per row 1 for a first occurrence, per row its distinct vector's id in its block,
        per block the first occurrences before it, per block its distinct vectors, the
        first occurrences' rows back to back: block b's at [base[b], base[b] + n_unique[b]),
        then a trash area).
    """
    rows, row_off, i64 = t["rows"], t["row_off"], torch.int64
    n_rows, dev = r_blk.shape[0], bits.device
    rep, is_first = k_vector_lz.representatives(symbols, bits, *row_args)
    firsts = is_first.to(i64)
    rank = torch.cumsum(firsts, 0)  # inclusive count of first occurrences
    rank0 = torch.cat([torch.zeros(1, dtype=i64, device=dev), rank])
    base = rank0[row_off]  # first occurrences in the blocks before
    n_unique = rank0[row_off + rows] - base
    ids = rank[rep.to(i64)] - 1 - base[r_blk] if n_rows else rank
    # Repeats write to a (spread) trash area past the end.
    row_ids = torch.arange(n_rows, device=dev)
    first_rows = torch.zeros(n_rows + _TRASH, dtype=i64, device=dev)
    first_rows.scatter_(
        0, torch.where(firsts == 1, rank - 1, n_rows + (row_ids & (_TRASH - 1))), row_ids
    )
    return firsts, ids, base, n_unique, first_rows


class _WordBuffer:
    """The payloads' words (int64 lanes holding uint32 words) and the masked writes into them.

    Masked lanes add 0 to a trash area past the payload, spread so that a GPU does not
    serialise them on one address.

    Args:
        n_words: Words of the payloads.
        n_lanes: The most lanes one write takes.
        dev: The device.
    """

    def __init__(self, n_words: int, n_lanes: int, dev: torch.device) -> None:
        self.buf = torch.zeros(n_words + _TRASH, dtype=torch.int64, device=dev)
        self.trash = n_words + (torch.arange(n_lanes, device=dev) & (_TRASH - 1))

    def put(self, dest: torch.Tensor, value: torch.Tensor, valid: torch.Tensor) -> None:
        """Adds ``value`` at word ``dest`` where ``valid`` (the words start at 0).

        Args:
            dest: Word index per lane.
            value: Word per lane.
            valid: Which lanes write.
        """
        lanes = dest.shape[0]
        dest = torch.where(valid, dest, self.trash[:lanes])
        self.buf.index_add_(0, dest, torch.where(valid, value, 0))

    def put_elements(
        self,
        at: torch.Tensor,
        k: torch.Tensor,
        size: torch.Tensor,
        raw: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """Element ``k`` of a section of raw values at word ``at``: 4-byte values take a word,
        2-byte ones half.

        Args:
            at: The section's first word, per lane.
            k: The element's index in the section, per lane.
            size: The element's bytes (4 or 2), per lane.
            raw: The element's raw bits, per lane.
            valid: Which lanes write.
        """
        wide = size == 4
        raw64 = raw.to(torch.int64)
        value = torch.where(wide, raw64 & _MASK32, (raw64 & 0xFFFF) << (16 * (k % 2)))
        self.put(at + torch.where(wide, k, k // 2), value, valid)


def _put_references(
    out: _WordBuffer,
    r_blk: torch.Tensor,
    row_off: torch.Tensor,
    r_ids: torch.Tensor,
    r_first: torch.Tensor,
    packing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    refs_at: torch.Tensor,
) -> None:
    """Writes every block's vector references, MSB-first: fixed width, or a flag bit (1: first
    occurrence) and the repeats' ids.

    Args:
        out: The payloads' words.
        r_blk: The block of every row.
        row_off: Each block's first row.
        r_ids: Every row's distinct-vector id in its block.
        r_first: Whether every row is a first occurrence.
        packing: Per block (reference mode, id width, whether it sends references).
        refs_at: Per block, the word its references start at.
    """
    ref_mode, ref_width, has_refs = (a[r_blk] for a in packing)
    flagged = ref_mode == 1
    r_len = torch.where(flagged & r_first, 1, ref_width + flagged.to(torch.int64))
    r_len = torch.where(has_refs, r_len, 0)
    r_val = torch.where(flagged & r_first, 1, r_ids)
    r_end = torch.cumsum(r_len, 0)
    r_end0 = torch.cat([torch.zeros(1, dtype=torch.int64, device=r_len.device), r_end])
    pos = r_end - r_len - r_end0[row_off[r_blk]]
    end = pos % 32 + r_len
    head = torch.where(
        end <= 32, r_val << (32 - end).clamp(min=0), r_val >> (end - 32).clamp(min=0)
    )
    out.put(refs_at[r_blk] + pos // 32, head & _MASK32, r_len > 0)
    out.put(refs_at[r_blk] + pos // 32 + 1, (r_val << (64 - end).clamp(0, 63)) & _MASK32, end > 32)


def _compress(
    blocks: list[torch.Tensor],
    bounds: list[float],
    kinds: list[int],
    group_sizes: list[int],
    config: CodecConfig,
    dev: torch.device,
) -> PendingCompress:
    """:func:`start_groups_device` for blocks on ``dev`` (see the module docstring)."""
    chunk = config.huffman_chunk_symbols
    ht = _HostTables(blocks, bounds, chunk, config, kinds, group_sizes)
    t, _pinned = ht.to_device(dev)
    nb, n_el, n_rows = ht.n_blocks, ht.n_elems, ht.n_rows
    i64 = torch.int64
    rows, dim, itemsize = t["rows"], t["dim"], t["itemsize"]
    elem_off, row_off = t["elem_off"], t["row_off"]
    blk_ids = torch.arange(nb, device=dev)

    # ---- flat layouts: every element, every row, back to back in block order ----------------
    flat = [b.detach().contiguous().reshape(-1) for b in blocks]
    empty_f = torch.zeros(0, dtype=torch.float32, device=dev)
    x = torch.cat([f.float() for f in flat]) if flat else empty_f
    # Raw bits as int32; 16-bit dtypes sign-extend, as the CPU path's astype(np.int32).
    bits = (
        torch.cat(
            [
                f.view(torch.int32 if f.element_size() == 4 else torch.int16).to(torch.int32)
                for f in flat
            ]
        )
        if flat
        else torch.zeros(0, dtype=torch.int32, device=dev)
    )
    e_blk = torch.repeat_interleave(blk_ids, rows * dim, output_size=n_el)
    e_loc = torch.arange(n_el, device=dev) - elem_off[e_blk]  # index within the block
    e_dim = dim[e_blk].clamp(min=1)
    r_blk = torch.repeat_interleave(blk_ids, rows, output_size=n_rows)
    r_loc = torch.arange(n_rows, device=dev) - row_off[r_blk]
    r_elem = elem_off[r_blk] + r_loc * dim[r_blk]  # first element of every row

    # ---- 1. quantization parameters -------------------------------------------------------
    bound, step, inv_step, center, quant_ok = _quant_params(ht, t, x, e_blk)

    # ---- 2. quantize, escapes, histograms ---------------------------------------------------
    sym, hist_q, tile_err = k_quantize.quantize_tiles(
        x,
        t["tiles"].reshape(-1, 3),
        step,
        inv_step,
        center,
        bound,
        t["dtype_code"].to(torch.int32),
        ht.tile_block,
        t["sr_key"],
        t["value"],
    )
    max_err = torch.zeros(nb, dtype=torch.float64, device=dev).scatter_reduce(
        0, t["tiles"].reshape(-1, 3)[:, 2], tile_err, "amax"
    )

    # ---- 3. vector-LZ over the quantized symbols and over the raw bits -------------------------
    row_args = (r_elem, dim[r_blk].to(torch.int32), r_blk.to(torch.int32), ht.max_dim, t["mults"])
    first_q, ids_q, base_q, nu_q, first_rows_q = _vector_lz(sym, bits, row_args, t, r_blk)
    first_r, ids_r, base_r, nu_r, first_rows_r = _vector_lz(None, bits, row_args, t, r_blk)

    # ---- 4. distinct-row histograms, code lengths, sizes, mode choice --------------------------
    sym16 = sym.to(i64) & 0xFFFF
    # Distinct rows' histograms: the quantized symbols of first occurrences only.
    keep = first_q[row_off[e_blk] + e_loc // e_dim].to(torch.int32) if n_el else e_blk
    hist_u = k_huffman.histogram_tiles(sym, keep, t["tiles"].reshape(-1, 3), nb, ht.tile_block)
    hists = torch.cat([hist_q, hist_u]).to(i64)
    lengths = codebook.code_lengths(hists).to(i64)
    words, sym_lo, sym_count, n_esc = _plan(hists, lengths, chunk)
    words_q, words_u = words[:nb], words[nb:]
    esc_q, esc_u = n_esc[:nb], n_esc[nb:]

    # The size model and mode choice are size_model's, as on the host path.
    lz_allowed = t["lz_allowed"] == 1
    quant_w = sm.quant_words(esc_q, itemsize, words_q)
    qlz_w = sm.quant_lz_words(rows, nu_q, esc_u, itemsize, words_u)
    qlz_ok = quant_ok & lz_allowed & (nu_q < rows)
    mode, best = sm.choose_lossy(t["raw_words"], quant_ok, quant_w, qlz_ok, qlz_w)
    nu_lower = torch.where(quant_ok & lz_allowed, nu_q, 1)
    lz_tried = sm.lossless_may_win(lz_allowed, rows, dim, itemsize, nu_lower, best)
    lossless_w = sm.lossless_lz_words(rows, nu_r, dim, itemsize)
    mode = sm.choose_lossless(mode, best, lz_tried, lossless_w, rows * dim)

    # ---- 5. what each block sends --------------------------------------------------------------
    is_q = (mode == MODE_QUANT) | (mode == MODE_QUANT_LZ)
    is_qlz = mode == MODE_QUANT_LZ
    is_lz = mode == MODE_LZ
    has_refs = is_qlz | is_lz
    n_sent = torch.where(is_qlz, nu_q, torch.where(is_lz, nu_r, rows))
    n_sym = torch.where(is_q, n_sent * dim, 0)
    sel = torch.where(is_qlz, nb + blk_ids, blk_ids)  # which histogram / code each block uses
    lengths_sel = lengths[sel]
    codes = codebook.canonical_codes(lengths_sel)
    n_escapes = torch.where(is_q, n_esc[sel], 0)
    lo_sel = torch.where(is_q, sym_lo[sel], 0)
    count_sel = torch.where(is_q, sym_count[sel], 0)
    n_chunks = (n_sym + chunk - 1) // chunk
    ref_mode, _, ref_bits = refs_packing(rows, torch.where(has_refs, n_sent, 1))
    ref_mode = torch.where(has_refs, ref_mode, 0)
    ref_width = id_width(n_sent)
    refs_words = torch.where(has_refs, words_for_bits(ref_bits), 0)

    # The sent symbol stream, in the element layout (block b's at elem_off[b], n_sym[b] long).
    s_valid = e_loc < n_sym[e_blk]
    s_vec = e_loc // e_dim  # sent vector
    s_row = torch.where(
        is_qlz[e_blk],
        first_rows_q[(base_q[e_blk] + s_vec).clamp(max=n_rows)],
        row_off[e_blk] + s_vec,
    )
    s_src = (
        torch.where(s_valid, r_elem[s_row.clamp(max=max(n_rows - 1, 0))] + e_loc % e_dim, 0)
        if n_el
        else e_loc
    )
    s_sym = torch.where(s_valid, sym16[s_src], 0) if n_el else sym16
    s_bits = bits[s_src] if n_el else bits

    # ---- Huffman encode of every chunk of every block --------------------------------------
    slot_blk, slot_k = t["slot_blk"], t["slot_k"]
    c_lo = elem_off[slot_blk] + slot_k * chunk
    c_hi = torch.maximum(
        elem_off[slot_blk] + torch.minimum((slot_k + 1) * chunk, n_sym[slot_blk]), c_lo
    )
    chunk_ends, stream = k_huffman.encode_chunks(
        s_sym.to(torch.int32),
        c_lo,
        c_hi,
        slot_blk * _A,
        lengths_sel.to(torch.int32),
        codes,
        chunk,
        ht.stream_words,
    )
    ends0 = torch.cat([torch.zeros(1, dtype=i64, device=dev), chunk_ends])
    stream_base = ends0[t["first_slot"]]
    stream_words = ends0[t["first_slot"] + t["n_slots"]] - stream_base

    # ---- 6. section offsets --------------------------------------------------------------------
    uniq_words = torch.where(is_lz, words_for_bytes(nu_r * dim * itemsize), 0)
    nib_words = torch.where(is_q, words_for_bytes((count_sel + 1) // 2), 0)
    escb_words = words_for_bytes(n_escapes * itemsize)
    seg_words = torch.where(
        mode == MODE_RAW,
        t["raw_words"],
        SEGMENT_HEADER_WORDS
        + refs_words
        + uniq_words
        + nib_words
        + n_escapes
        + escb_words
        + n_chunks
        + torch.where(is_q, stream_words, 0),
    )
    # Payloads back to back: group g's header, descriptors and segments at payload_base[g].
    ng = ht.n_groups
    group, local, group_blocks = t["group"], t["local"], t["group_blocks"]
    group_segs = torch.zeros(ng, dtype=i64, device=dev).index_add_(0, group, seg_words)
    body_words = DESCRIPTOR_WORDS * group_blocks + group_segs  # per payload
    payload_words = HEADER_WORDS + body_words
    payload_base = torch.cumsum(payload_words, 0) - payload_words
    seg_excl = torch.cumsum(seg_words, 0) - seg_words
    group_seg_base = torch.cumsum(group_segs, 0) - group_segs  # segments before the group
    seg_start = (
        payload_base[group]
        + HEADER_WORDS
        + DESCRIPTOR_WORDS * group_blocks[group]
        + seg_excl
        - group_seg_base[group]
    )  # buffer words
    refs_at = seg_start + SEGMENT_HEADER_WORDS + nib_words
    uniq_at = refs_at + refs_words
    escp_at = refs_at + refs_words
    escb_at = escp_at + n_escapes
    table_at = escb_at + escb_words
    stream_at = table_at + n_chunks

    # ---- payload assembly ------------------------------------------------------------------
    total_max = ht.body_max
    n_lanes = max(
        n_el, n_rows, ht.stream_words, ht.n_slots, nb * ESCAPE_SYMBOL, SEGMENT_HEADER_WORDS * nb
    )
    out = _WordBuffer(total_max, n_lanes, dev)
    buf, put, put_elements = out.buf, out.put, out.put_elements

    # Descriptors.
    bound_bits = bound.view(i64)
    desc = pack_records(
        DESCRIPTOR,
        {
            "rows": rows,
            "dim": dim,
            "dtype": t["dtype_code"],
            "mode": torch.where(is_q & (t["value"] == 1), mode | MODE_VALUE, mode),
            "seg_words": seg_words,
            "bound": bound_bits,
        },
    )
    put(
        (
            (payload_base[group] + HEADER_WORDS + DESCRIPTOR_WORDS * local)[:, None]
            + torch.arange(DESCRIPTOR_WORDS, device=dev)
        ).reshape(-1),
        desc.reshape(-1),
        torch.ones(DESCRIPTOR_WORDS * nb, dtype=torch.bool, device=dev),
    )
    # Segment headers (every mode but raw; mode lz fills n_unique and the references only).
    esc_length = lengths_sel[:, ESCAPE_SYMBOL]
    seg_hdr = pack_records(
        SEGMENT_HEADER,
        {
            "step": torch.where(is_q, step.view(torch.int32).to(i64), 0),
            "center": torch.where(is_q, center, 0),
            "n_unique": n_sent,
            "n_escapes": n_escapes,
            "chunk_symbols": torch.where(is_q, chunk, 0),
            "n_chunks": n_chunks,
            "sym_lo": lo_sel,
            "sym_count": count_sel,
            "escape_length": torch.where(is_q, esc_length, 0),
            "ref_mode": ref_mode,
            "ref_width": ref_width,
        },
    )
    put(
        (seg_start[:, None] + torch.arange(SEGMENT_HEADER_WORDS, device=dev)).reshape(-1),
        seg_hdr.reshape(-1),
        (mode != MODE_RAW)[:, None].expand(nb, SEGMENT_HEADER_WORDS).reshape(-1),
    )
    # Codebook nibbles: lengths of symbols sym_lo .., low nibble first.
    k = torch.arange(ESCAPE_SYMBOL, device=dev)
    nib = lengths_sel.gather(1, (lo_sel[:, None] + k).clamp(max=_A - 1)) << (4 * (k % 8))
    put(
        (seg_start[:, None] + SEGMENT_HEADER_WORDS + k // 8).reshape(-1),
        nib.reshape(-1),
        (k[None, :] < count_sel[:, None]).reshape(-1),
    )
    # References, MSB-first: fixed width, or a flag bit (1: first occurrence) and repeats' ids.
    r_ids = torch.where(is_qlz[r_blk], ids_q, ids_r)
    r_first = torch.where(is_qlz[r_blk], first_q, first_r) == 1
    _put_references(out, r_blk, row_off, r_ids, r_first, (ref_mode, ref_width, has_refs), refs_at)
    # Escapes: positions in the sent stream, then the escaped elements' raw bits.
    is_esc = s_valid & (s_sym == ESCAPE_SYMBOL)
    esc_rank = torch.cumsum(is_esc.to(i64), 0)
    esc_rank0 = torch.cat([torch.zeros(1, dtype=i64, device=dev), esc_rank])
    k_esc = esc_rank - 1 - esc_rank0[elem_off[e_blk]] if n_el else esc_rank
    put(escp_at[e_blk] + k_esc, e_loc, is_esc)
    put_elements(escb_at[e_blk], k_esc, itemsize[e_blk], s_bits, is_esc)
    # Chunk tables (chunk ends relative to the block's bitstream), then the bitstreams.
    s_used = slot_k < n_chunks[slot_blk]
    put(table_at[slot_blk] + slot_k, chunk_ends - stream_base[slot_blk], s_used)
    w = torch.arange(ht.stream_words, device=dev)
    w_blk = torch.searchsorted(stream_base + stream_words, w, right=True).clamp(max=max(nb - 1, 0))
    w_used = w < (stream_base + stream_words)[w_blk] if nb else w < 0
    put(stream_at[w_blk] + w - stream_base[w_blk], stream.to(i64) & _MASK32, w_used & is_q[w_blk])
    # Raw blocks, and the distinct rows of lossless vector-LZ blocks.
    e_raw = (mode == MODE_RAW)[e_blk]
    put_elements(seg_start[e_blk], e_loc, itemsize[e_blk], bits, e_raw)
    u_valid = is_lz[e_blk] & (e_loc < nu_r[e_blk] * dim[e_blk])
    u_row = first_rows_r[(base_r[e_blk] + s_vec).clamp(max=n_rows)]
    u_src = (
        torch.where(u_valid, r_elem[u_row.clamp(max=max(n_rows - 1, 0))] + e_loc % e_dim, 0)
        if n_el
        else e_loc
    )
    put_elements(uniq_at[e_blk], e_loc, itemsize[e_blk], bits[u_src] if n_el else bits, u_valid)

    # ---- checksum and header -----------------------------------------------------------------
    header = pack_records(
        HEADER,
        {
            "magic": MAGIC,
            "version": VERSION,
            "n_blocks": group_blocks,
            "body_words": body_words,
            "checksum": segment_checksums(buf, payload_base + HEADER_WORDS, body_words),
        },
    )
    # Tensor-indexed writes (no host tensor is built, no sync).
    buf[(payload_base[:, None] + torch.arange(HEADER_WORDS, device=dev)).reshape(-1)] = (
        header.reshape(-1)
    )
    words = buf[:total_max]
    words32 = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    # ---- what the one device-to-host transfer reads ------------------------------------------
    stats_max_err = torch.where(is_q, max_err, 0.0)
    # The payloads' skeletons (what a decoder's layout depends on), for the receiver.
    skeleton = buf[skeleton_index(payload_base, payload_words, group_sizes, seg_start)]
    readback = torch.cat(
        [
            payload_words,
            mode,
            n_sent,
            n_escapes,
            seg_words,
            stats_max_err.view(i64),
            bound_bits,
            skeleton,
        ]
    )
    return PendingCompress(words32, readback, ht, list(group_sizes))


class PendingCompress:
    """A compress whose payloads are built on the device, waiting for its one host read.

    :attr:`readback` is the int64 tensor the host must read (the payload sizes first, one per
    group, in words, then the per-block stats); a caller may read it together with tensors of
    its own in one copy, then call :meth:`finish` with its values.

    Args:
        words: int32 buffer holding the payloads back to back (and worst-case slack).
        readback: The values the host needs.
        tables: The host tables of the call (shapes).
        group_sizes: Blocks per payload.
    """

    def __init__(
        self,
        words: torch.Tensor,
        readback: torch.Tensor,
        tables: _HostTables,
        group_sizes: list[int],
    ) -> None:
        self.words = words
        self.readback = readback
        self._tables = tables
        self.group_sizes = group_sizes

    @property
    def device_sizes(self) -> torch.Tensor:
        """int64 bytes of each payload, on the device (no sync)."""
        return 4 * self.readback[: len(self.group_sizes)]

    @property
    def device_skeleton(self) -> torch.Tensor:
        """int64 skeleton words of every payload (``container.skeleton_index``), on the device."""
        return self.readback[len(self.group_sizes) + 6 * self._tables.n_blocks :]

    def finish(
        self, host: Sequence[int]
    ) -> tuple[torch.Tensor, list[int], list[list[BlockStats]], list[np.ndarray]]:
        """The payloads and stats, from the host values of :attr:`readback`.

        Args:
            host: ``readback``'s values (e.g. ``readback.tolist()``).

        Returns:
            (uint8 buffer with the payloads back to back, bytes per payload, BlockStats per
            payload and block, uint32 skeleton of every payload).
        """
        ht, ng, nb = self._tables, len(self.group_sizes), self._tables.n_blocks
        sizes = [4 * int(w) for w in host[:ng]]
        h = np.array(host[ng : ng + 6 * nb], dtype=np.int64).reshape(6, nb)
        skel = np.array(host[ng + 6 * nb :], dtype=np.int64).astype(np.uint32)
        skel_sizes = [
            HEADER_WORDS + (DESCRIPTOR_WORDS + SEGMENT_HEADER_WORDS) * n for n in self.group_sizes
        ]
        skeletons = np.split(skel, np.cumsum(skel_sizes)[:-1]) if ng else []
        errs = h[4].view(np.float64)
        bounds_used = h[5].view(np.float64)
        stats = BlockColumns.assemble(
            (ht.rows, ht.dim, ht.itemsize), h[0], h[3], bounds_used, errs, (h[1], h[2])
        ).stats()
        payload = self.words[: sum(sizes) // 4].clone().view(torch.uint8)
        per_group = []
        at = 0
        for n in self.group_sizes:
            per_group.append(stats[at : at + n])
            at += n
        return payload, sizes, per_group, skeletons
