"""Device-resident, batched compress: every stage runs once for all blocks, one sync in all.

``compress_device`` builds the CPU backend's payload byte for byte, and its ``BlockStats``,
without the blocks leaving their device; ``start_groups_device`` builds several payloads at once
and stops before the one device-to-host read (:class:`PendingCompress`). The data-sized stages
run over the caller's ``kernel_set.KernelSet``, each stage a function passing a record to the
next. Stages, host tables and the sync: docs/kernels.md, "Device-resident compress".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import torch

from torchrec_lossy.codec import encode_columns as ec
from torchrec_lossy.codec import host_sync, quantize
from torchrec_lossy.codec import size_model as sm
from torchrec_lossy.codec.bounds import BoundKind
from torchrec_lossy.codec.container import (
    DESCRIPTOR_WORDS,
    HEADER_WORDS,
    MASK32,
    BlockColumns,
    BlockStats,
    segment_checksums,
    skeleton_index,
    skeleton_words,
)
from torchrec_lossy.codec.device_packed_decode import checksum_tiles
from torchrec_lossy.codec.encode_columns import EncodeColumns
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    DESCRIPTOR,
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    HEADER,
    MAGIC,
    MAX_CODE_LENGTH,
    MODE_LZ,
    MODE_QUANT,
    MODE_QUANT_LZ,
    MODE_RAW,
    PACKED_GROUP,
    SEGMENT_HEADER_WORDS,
    VERSION,
    descriptor_mode,
    pack_records,
    ref_width,
    reference_words,
    refs_packing,
    segment_header_words,
    words_for_bits,
    words_for_bytes,
)
from torchrec_lossy.codec.kernel_set import KernelSet, load_kernels
from torchrec_lossy.codec.launch_tables import block_for, column_multipliers, tile_table
from torchrec_lossy.codec.outliers import OUTLIER_OCTAVES
from torchrec_lossy.config import CodecConfig
from torchrec_lossy.profile_range import profile_range

_QUANT_BLOCK = 4096  # elements per quantize tile
ROWS_TILE = 1024  # words per program of the packed encode's raw-rows launch
_TRASH = 4096  # words of the assembly buffer's trash area (a power of two)
# Per-block rows of a compress's readback: mode, vectors sent, escapes, segment words, max error
# and bound (float64 bits).
_STAT_ROWS = 6
_Array = TypeVar("_Array", np.ndarray, torch.Tensor)


# ---- what is known before the data is read ---------------------------------------------------


@dataclass(frozen=True)
class Columns(Generic[_Array]):
    """The int64 columns a compress derives from shapes, bounds and config: numpy arrays on the
    host, tensors on the device (``host_sync.upload_record``). Per block unless said."""

    rows: _Array
    dim: _Array
    itemsize: _Array
    elem_off: _Array  # first element in the flat layout
    row_off: _Array  # first row in the flat layout
    bound_bits: _Array  # float64 bits of the bound (relative: the fraction of the range)
    quant_try: _Array  # 1 where the data may let it quantize (quantize.grid_before_data)
    kind: _Array  # bounds.BoundKind
    group: _Array  # its payload
    local: _Array  # its index in its payload
    group_blocks: _Array  # per payload, its blocks
    group_first: _Array  # per payload, its first block
    group_end: _Array  # per payload, its first block plus its blocks
    heads_before: _Array  # per payload, the header and descriptor words of the payloads before
    lead_words: _Array  # per block, the header and descriptor words of its payload and those before
    lz_allowed: _Array  # 1 where vector-LZ may run
    raw_words: _Array  # words of its raw segment
    first_slot: _Array  # its first Huffman chunk slot
    n_slots: _Array  # its chunk slots (the worst case: every row sent)
    slot_blk: _Array  # per chunk slot, its block
    slot_k: _Array  # per chunk slot, its chunk in the block
    tiles: _Array  # the quantize launch's tiles (launch_tables.tile_table rows, flattened)
    mults: _Array  # the row hash's column multipliers
    ps_slots: _Array  # packed: per group slot (block, group in it), flattened; may-quantize blocks
    ps_first: _Array  # packed: per block its first slot, then the slot count (n_blocks + 1)
    rw_tiles: _Array  # packed: per raw-rows tile (block, first word), flattened
    rf_tiles: _Array  # packed: per references tile (block, first row), flattened; lz blocks
    record: _Array  # the launchers' record, grid fields 0, flattened (encode_columns.host_record)


@dataclass(frozen=True)
class HostTables:
    """Everything a compress derives from shapes, bounds and config, on the host (no data)."""

    cols: Columns[np.ndarray]  # uploaded in one copy
    n_blocks: int  # of all payloads
    n_elems: int
    n_rows: int
    max_dim: int
    stochastic: bool  # stochastic rounding (quantize.grid_bound)
    quantization: bool  # CodecConfig.enable_quantization
    tile_block: int  # elements per quantize tile
    stream_words: int  # worst-case words of all Huffman streams
    body_max: int  # words of all payloads at most (every segment is at most its raw one's)
    chunk: int  # symbols per Huffman chunk


def _slots(numel: np.ndarray, quant_try: np.ndarray, chunk: int) -> tuple:
    """Huffman chunk slots: the worst case (every row sent) of the blocks that may quantize.

    Returns:
        (per block: its slots, its first slot; per slot: its block, its chunk index; the
        worst-case words of all their streams).
    """
    slots = np.where(quant_try == 1, (numel + chunk - 1) // chunk, 0)
    first_slot = np.cumsum(slots) - slots
    slot_blk = np.repeat(np.arange(numel.shape[0], dtype=np.int64), slots)
    slot_k = np.arange(int(slots.sum()), dtype=np.int64) - first_slot[slot_blk]
    slot_syms = np.minimum(chunk, numel[slot_blk] - slot_k * chunk)
    stream_words = int(words_for_bits(slot_syms * MAX_CODE_LENGTH).sum())
    return slots, first_slot, slot_blk, slot_k, stream_words


def _packed_tables(
    numel: np.ndarray, quant_try: np.ndarray, raw_words: np.ndarray, lz_rows: np.ndarray,
    packed: bool,
) -> tuple[np.ndarray, ...]:  # fmt: skip
    """The packed encode launches' static tables: group slots (every value sent) of the blocks
    that may quantize, tiles of every block's raw words and of the rows of every block that
    may send references (``lz_rows``: its rows where vector-LZ may run, else 0), ``ROWS_TILE``
    each.

    Returns:
        (flattened [n_slots, 2] slots, [n_blocks + 1] first slots, flattened [n_tiles, 2]
        tiles, flattened [n_ref_tiles, 2] reference tiles); empty unless ``packed``.
    """
    if not packed:
        empty = np.zeros(0, dtype=np.int64)
        return empty, np.zeros(numel.shape[0] + 1, dtype=np.int64), empty, empty
    per = np.where(quant_try == 1, (numel + PACKED_GROUP - 1) // PACKED_GROUP, 0)
    first = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
    blk = np.repeat(np.arange(numel.shape[0], dtype=np.int64), per)
    slots = np.stack([blk, np.arange(blk.shape[0], dtype=np.int64) - first[blk]], axis=1)
    tiles, owner = checksum_tiles(np.zeros_like(raw_words), raw_words, ROWS_TILE)
    ref_tiles, ref_owner = checksum_tiles(np.zeros_like(lz_rows), lz_rows, ROWS_TILE)
    return (
        slots.reshape(-1),
        first,
        np.stack([owner, tiles[:, 1]], axis=1).reshape(-1),
        np.stack([ref_owner, ref_tiles[:, 1]], axis=1).reshape(-1),
    )


def host_tables(
    blocks: Sequence[torch.Tensor],
    bounds: Sequence[float],
    kinds: Sequence[int],
    group_sizes: Sequence[int],
    config: CodecConfig,
) -> HostTables:
    """:class:`HostTables` of a compress (arguments as :func:`start_groups_device`)."""
    b = len(blocks)
    if b >= 1 << 23:  # the row hash keeps the block id in 23 bits
        raise ValueError(f"{b} blocks in one payload: pass fewer than 2**23")
    rows = np.array([t.shape[0] for t in blocks], dtype=np.int64)
    dim = np.array([t.shape[1] for t in blocks], dtype=np.int64)
    itemsize = np.array([t.element_size() for t in blocks], dtype=np.int64)
    numel = rows * dim
    max_dim = int(dim.max()) if b else 0
    stochastic, quantization = config.rounding == "stochastic", config.enable_quantization
    kind = np.array(kinds, dtype=np.int64).reshape(b)
    bound = np.array(bounds, dtype=np.float64).reshape(b)
    before = quantize.grid_before_data(kind, bound, numel, stochastic, quantization)
    quant_try = before.ok.astype(np.int64)
    sizes = np.array(group_sizes, dtype=np.int64).reshape(len(group_sizes))
    local = np.arange(b, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    tile_block = block_for(int(numel.max()) if b else 1, _QUANT_BLOCK)
    tiles = tile_table(numel, tile_block)  # over the blocks that may quantize
    slots, first_slot, slot_blk, slot_k, stream_words = _slots(
        numel, quant_try, config.huffman_chunk_symbols
    )
    elem_off, row_off = np.cumsum(numel) - numel, np.cumsum(rows) - rows
    group = np.repeat(np.arange(len(group_sizes), dtype=np.int64), sizes)
    heads = HEADER_WORDS + DESCRIPTOR_WORDS * sizes  # each payload's header and descriptors
    group_first = np.cumsum(sizes) - sizes
    raw_words = words_for_bytes(numel * itemsize)
    packed = config.format == "packed"
    lz_allowed = ((rows > 1) & config.enable_lz).astype(np.int64)
    ps_slots, ps_first, rw_tiles, rf_tiles = _packed_tables(
        numel, quant_try, raw_words, rows * lz_allowed, packed
    )
    record = ec.host_record(
        b,
        dtype=np.array([DTYPE_CODES[t.dtype] for t in blocks], dtype=np.int64),
        sr_key=quantize.block_keys(stochastic, config.seed, local),
        value=kind == BoundKind.VALUE,
        elem_off=elem_off,
        row_off=row_off,
        dim=dim,
    )
    cols = Columns(
        rows=rows,
        dim=dim,
        itemsize=itemsize,
        elem_off=elem_off,
        row_off=row_off,
        bound_bits=bound.view(np.int64),
        quant_try=quant_try,
        kind=kind,
        group=group,
        local=local,
        group_blocks=sizes,
        group_first=group_first,
        group_end=group_first + sizes,
        heads_before=np.cumsum(heads) - heads,
        lead_words=np.cumsum(heads)[group],
        lz_allowed=lz_allowed,
        raw_words=raw_words,
        first_slot=first_slot,
        n_slots=slots,
        slot_blk=slot_blk,
        slot_k=slot_k,
        tiles=tiles[quant_try[tiles[:, 2]] == 1].reshape(-1),
        mults=column_multipliers(max(max_dim, 1)),
        ps_slots=ps_slots,
        ps_first=ps_first,
        rw_tiles=rw_tiles,
        rf_tiles=rf_tiles,
        record=record.reshape(-1),
    )
    return HostTables(
        cols=cols,
        n_blocks=b,
        n_elems=int(numel.sum()),
        n_rows=int(rows.sum()),
        max_dim=max_dim,
        stochastic=stochastic,
        quantization=quantization,
        tile_block=tile_block,
        stream_words=stream_words,
        # The mode choice (size_model.choose_lossy / choose_lossless) only ever picks a mode
        # smaller than raw, so the raw segments bound the payloads: ~1.0x the input, exact
        # for incompressible data.
        body_max=DESCRIPTOR_WORDS * b + int(cols.raw_words.sum()) + HEADER_WORDS * len(sizes),
        chunk=config.huffman_chunk_symbols,
    )


# ---- the device stages' records ----------------------------------------------------------------


class Flat(NamedTuple):
    """Every element and every row of the blocks, back to back in block order."""

    x: torch.Tensor  # float32 value of every element
    bits: torch.Tensor  # int32 raw bits (16-bit dtypes sign-extend, as the CPU path's astype)
    e_blk: torch.Tensor  # block of every element
    e_loc: torch.Tensor  # its index within the block
    e_dim: torch.Tensor  # its block's columns (at least 1)
    r_blk: torch.Tensor  # block of every row
    r_elem: torch.Tensor  # first element of every row

    def source(self, valid: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """Per element lane, the flat element it sends: column ``e_loc % dim`` of flat row
        ``row`` (0 where not ``valid``)."""
        if not self.x.shape[0]:
            return self.e_loc
        last = max(self.r_elem.shape[0] - 1, 0)
        return torch.where(valid, self.r_elem[row.clamp(max=last)] + self.e_loc % self.e_dim, 0)


class Dedupe(NamedTuple):
    """Repeated rows of every block (``vector_lz.representatives``)."""

    first: torch.Tensor  # per row, 1 for a first occurrence
    ids: torch.Tensor  # per row, its distinct vector's id in its block
    base: torch.Tensor  # per block, the first occurrences before it
    n_unique: torch.Tensor  # per block, its distinct vectors
    # block b's first occurrences' rows at [base[b], + n_unique[b]) (one table for both dedupes
    # of a compress: ``vector_lz_stage``)
    first_rows: torch.Tensor
    # [n_rows + 1] first occurrences before each row, plus a constant (a view of both
    # dedupes' ranks)
    rank: torch.Tensor

    def row(self, flat: Flat, vec: torch.Tensor) -> torch.Tensor:
        """Per element lane, the flat row of distinct vector ``vec`` of the lane's block."""
        return self.first_rows[
            (self.base[flat.e_blk] + vec).clamp(max=self.first_rows.shape[0] - 1)
        ]


class _Codes(NamedTuple):
    """Huffman codes of histograms (every block's symbols, then its distinct rows' ones)."""

    lengths: torch.Tensor  # int64 [n, ALPHABET_SIZE] code lengths
    words: torch.Tensor  # codebook + chunk table + bitstream (``size_model.code_words``)
    sym_lo: torch.Tensor  # first value symbol of the codebook
    sym_count: torch.Tensor  # value symbols of the codebook
    n_esc: torch.Tensor  # escapes


class GridStage(NamedTuple):
    """The grid stage's result (:func:`grid_stage`)."""

    cols: EncodeColumns  # the launchers' record, its grid fields written
    stats: torch.Tensor  # int64 [n_blocks, GRID_STATS] (``quantize.block_grids``)

    @property
    def ok(self) -> torch.Tensor:
        """Per block, whether it is quantized (its quantize tiles ran: the rule before the
        data allowed it, a superset)."""
        return self.stats[:, ec.GRID_OK] == 1

    @property
    def bound_bits(self) -> torch.Tensor:
        """int64 [n_blocks] float64 bits of each block's bound (relative ones resolved)."""
        return self.cols.column(ec.BOUND_BITS)


class Sends(NamedTuple):
    """What every block sends, each [n_blocks]."""

    mode: torch.Tensor  # MODE_* (without MODE_VALUE)
    is_q: torch.Tensor  # a Huffman-coded mode
    is_qlz: torch.Tensor
    is_lz: torch.Tensor
    has_refs: torch.Tensor
    n_sent: torch.Tensor  # vectors sent (rows without references)
    n_sym: torch.Tensor  # symbols coded
    lengths: torch.Tensor  # [n_blocks, ALPHABET_SIZE] code lengths of its histogram
    codes: torch.Tensor  # their canonical codes
    n_escapes: torch.Tensor
    sym_lo: torch.Tensor
    sym_count: torch.Tensor
    n_chunks: torch.Tensor
    ref_mode: torch.Tensor
    ref_width: torch.Tensor
    refs_words: torch.Tensor


class Coded(NamedTuple):
    """The sent symbol stream (element layout: block b's at elem_off[b], n_sym[b] long), coded."""

    valid: torch.Tensor  # per element lane, whether it carries a sent symbol
    sym: torch.Tensor  # int64 sent symbols
    bits: torch.Tensor  # int32 raw bits of the sent elements
    chunk_ends: torch.Tensor  # per chunk slot, the end of its bits, in stream words
    stream: torch.Tensor  # every block's bitstream words, back to back
    base: torch.Tensor  # per block, its first stream word
    words: torch.Tensor  # per block, its stream words


class Sections(NamedTuple):
    """Where everything goes, in words of the buffer (payloads back to back)."""

    seg_words: torch.Tensor  # per block
    payload_base: torch.Tensor  # per payload, its first word
    payload_words: torch.Tensor  # per payload
    body_words: torch.Tensor  # per payload
    seg_start: torch.Tensor  # per block, its segment's first word
    refs_at: torch.Tensor  # its references (the codebook precedes them)
    escp_at: torch.Tensor  # its escape positions, or (mode lz) its distinct rows
    escb_at: torch.Tensor  # its escaped values
    table_at: torch.Tensor  # its chunk table
    stream_at: torch.Tensor  # its bitstream


# ---- the device stages ---------------------------------------------------------------------


def flatten(
    blocks: Sequence[torch.Tensor], ht: HostTables, t: Columns, elements: bool = True
) -> Flat:
    """:class:`Flat` of the blocks; without ``elements`` (the packed path, whose launches find
    each element's block themselves) the per-element columns are left empty, and the raw bits
    of float32-only blocks are a view of the values (one copy of the input, not two)."""
    dev = t.rows.device
    flat = [b.detach().contiguous().reshape(-1) for b in blocks]
    x = torch.cat([torch.zeros(0, device=dev), *(f.float() for f in flat)])
    if not elements and all(f.element_size() == 4 for f in flat):
        bits = x.view(torch.int32)
    else:
        wide = [f.view(torch.int32 if f.element_size() == 4 else torch.int16) for f in flat]
        bits = torch.cat([torch.zeros(0, dtype=torch.int32, device=dev), *(w.int() for w in wide)])
    blk_ids = torch.arange(ht.n_blocks, device=dev)
    r_blk = torch.repeat_interleave(blk_ids, t.rows, output_size=ht.n_rows)
    if not elements:
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return Flat(x, bits, none, none, none, r_blk, none)
    r_loc = torch.arange(ht.n_rows, device=dev) - t.row_off[r_blk]
    r_elem = t.elem_off[r_blk] + r_loc * t.dim[r_blk]
    e_blk = torch.repeat_interleave(blk_ids, t.rows * t.dim, output_size=ht.n_elems)
    e_loc = torch.arange(ht.n_elems, device=dev) - t.elem_off[e_blk]
    return Flat(x, bits, e_blk, e_loc, t.dim[e_blk].clamp(min=1), r_blk, r_elem)


def bases(counts: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums of int64 counts with the total appended (``n + 1`` entries)."""
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])


def grid_stage(k: KernelSet, ht: HostTables, t: Columns, flat: Flat) -> GridStage:
    """Stage 1: every block's bound, step and center (``quantize``'s rule: ``block_bound``,
    ``block_grid``) from its finite and inlier ranges and, where the rule centers on it, its
    median (a radix select, no sort), in one launch (``quantize.block_grids``) that writes
    them into the launchers' record (the host laid out every other field)."""
    cols = EncodeColumns(t.record.view(-1, ec.N_FIELDS), ht.n_blocks)
    rule = ec.GridRule(
        t.kind, t.bound_bits, t.quant_try, OUTLIER_OCTAVES, ht.stochastic, ht.quantization,
        (quantize.block_bound, quantize.uses_median, quantize.block_grid),
    )  # fmt: skip
    return GridStage(cols, k.quantize.block_grids(flat.x, cols, t.rows, rule))


def quantize_stage(
    k: KernelSet, ht: HostTables, t: Columns, flat: Flat, cols: EncodeColumns,
    histograms: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Stage 2: quantize, escapes and (``histograms``: the entropy format's) histograms
    (``quantize.quantize_tiles``, one launch).

    Returns:
        (int16 symbol of every element, [n_blocks, ALPHABET_SIZE] histograms, float64 max error
        per block).
    """
    tiles = t.tiles.reshape(-1, 3)
    sym, hist, tile_err = k.quantize.quantize_tiles(flat.x, tiles, cols, ht.tile_block, histograms)
    max_err = torch.zeros(ht.n_blocks, dtype=torch.float64, device=flat.x.device)
    return sym, hist, max_err.scatter_reduce(0, tiles[:, 2], tile_err, "amax")


def vector_lz_stage(
    k: KernelSet, symbols: torch.Tensor, ht: HostTables, t: Columns, flat: Flat,
    cols: EncodeColumns,
) -> tuple[Dedupe, Dedupe]:  # fmt: skip
    """Stage 3: repeated rows of every block, over the quantized symbols and over the raw bits
    (``vector_lz.representatives_pair``: hash with the block in the top bits, sort, verify,
    both dedupes in the same launches), ranked together: the raw-bits dedupe's first
    occurrences follow the symbols', and both index the one ``first_rows`` table.

    Returns:
        (the symbols' dedupe, the raw bits' dedupe).
    """
    r_blk, dev = flat.r_blk, flat.x.device
    n_rows = r_blk.shape[0]
    rep, is_first = k.vector_lz.representatives_pair(
        symbols, flat.bits, r_blk, cols, ht.max_dim, t.mults
    )
    firsts = is_first.to(torch.int64)
    rank0 = bases(firsts.reshape(-1))
    rank = rank0[1:]  # inclusive count of first occurrences, both dedupes' rows in a row
    shift = torch.arange(2, device=dev)[:, None] * n_rows  # each dedupe's first entry
    row_off = t.row_off + shift
    base = rank0[row_off]  # [2, n_blocks] first occurrences before the block
    n_unique = rank0[row_off + t.rows] - base
    ids = rank[(rep + shift).reshape(-1)].view(2, n_rows) - 1 - base[:, r_blk]
    first_rows = WordBuffer(2 * n_rows, dev)  # each first occurrence's row at its rank
    entries = torch.arange(2 * n_rows, device=dev)
    first_rows.put(rank - 1, entries % max(n_rows, 1), firsts.reshape(-1) == 1)
    rows = first_rows.buf
    by_sym, by_raw = (
        Dedupe(firsts[d], ids[d], base[d], n_unique[d], rows, rank0[d * n_rows :][: n_rows + 1])
        for d in range(2)
    )
    return by_sym, by_raw


def _codes(k: KernelSet, hists: torch.Tensor, chunk: int) -> _Codes:
    """Stage 4a: the per-block code plan for many histograms (``codebook.code_lengths``)."""
    hists = hists.to(torch.int64)
    lengths = k.codebook.code_lengths(hists).to(torch.int64)
    value = lengths[:, :ESCAPE_SYMBOL] > 0
    used = value.any(dim=1)
    lo = torch.where(used, value.to(torch.int8).argmax(dim=1), 0)
    hi = ESCAPE_SYMBOL - 1 - value.flip(1).to(torch.int8).argmax(dim=1)
    count = torch.where(used, hi - lo + 1, 0)
    bits = (hists * lengths).sum(dim=1)
    words = sm.code_words(hists.sum(dim=1), bits, count, chunk)
    return _Codes(lengths, words, lo, count, hists[:, ESCAPE_SYMBOL])


def _choose_mode(
    t: Columns, quant_ok: torch.Tensor, c: _Codes, dq: Dedupe, dr: Dedupe
) -> torch.Tensor:
    """Stage 4b: the mode of every block, by ``size_model`` (as on the host path)."""
    nb = t.rows.shape[0]
    rows, dim, itemsize, lz_allowed = t.rows, t.dim, t.itemsize, t.lz_allowed == 1
    quant_w = sm.quant_words(c.n_esc[:nb], itemsize, c.words[:nb])
    qlz_w = sm.quant_lz_words(rows, dq.n_unique, c.n_esc[nb:], itemsize, c.words[nb:])
    qlz_ok = quant_ok & lz_allowed & (dq.n_unique < rows)
    mode, best = sm.choose_lossy(t.raw_words, quant_ok, quant_w, qlz_ok, qlz_w)
    nu_lower = torch.where(quant_ok & lz_allowed, dq.n_unique, 1)
    lz_tried = sm.lossless_may_win(lz_allowed, rows, dim, itemsize, nu_lower, best)
    lossless_w = sm.lossless_lz_words(rows, dr.n_unique, dim, itemsize)
    return sm.choose_lossless(mode, best, lz_tried, lossless_w, rows * dim)


def _sends(
    k: KernelSet, t: Columns, mode: torch.Tensor, c: _Codes, dq: Dedupe, dr: Dedupe, chunk: int
) -> Sends:
    """Stage 5a: what every block sends, from its mode."""
    nb = mode.shape[0]
    is_q = (mode == MODE_QUANT) | (mode == MODE_QUANT_LZ)
    is_qlz, is_lz = mode == MODE_QUANT_LZ, mode == MODE_LZ
    has_refs = is_qlz | is_lz
    n_sent = torch.where(is_qlz, dq.n_unique, torch.where(is_lz, dr.n_unique, t.rows))
    n_sym = torch.where(is_q, n_sent * t.dim, 0)
    blk_ids = torch.arange(nb, device=mode.device)
    sel = torch.where(is_qlz, nb + blk_ids, blk_ids)  # which histogram / code each block uses
    lengths = c.lengths[sel]
    ref_mode, _, ref_bits = refs_packing(t.rows, torch.where(has_refs, n_sent, 1))
    return Sends(
        mode=mode,
        is_q=is_q,
        is_qlz=is_qlz,
        is_lz=is_lz,
        has_refs=has_refs,
        n_sent=n_sent,
        n_sym=n_sym,
        lengths=lengths,
        codes=k.codebook.canonical_codes(lengths),
        n_escapes=torch.where(is_q, c.n_esc[sel], 0),
        sym_lo=torch.where(is_q, c.sym_lo[sel], 0),
        sym_count=torch.where(is_q, c.sym_count[sel], 0),
        n_chunks=(n_sym + chunk - 1) // chunk,
        ref_mode=torch.where(has_refs, ref_mode, 0),
        ref_width=ref_width(n_sent),
        refs_words=torch.where(has_refs, words_for_bits(ref_bits), 0),
    )


def _encode(
    k: KernelSet,
    ht: HostTables,
    t: Columns,
    flat: Flat,
    sym: torch.Tensor,
    dq: Dedupe,
    s: Sends,
) -> Coded:
    """Stage 5b: the sent symbol stream and the Huffman encode of every chunk of every block
    (``huffman.encode_chunks``, chunk slots sized for the worst case)."""
    e_blk, e_loc, dev = flat.e_blk, flat.e_loc, flat.x.device
    valid = e_loc < s.n_sym[e_blk]
    vec = e_loc // flat.e_dim  # sent vector
    row = torch.where(s.is_qlz[e_blk], dq.row(flat, vec), t.row_off[e_blk] + vec)
    src = flat.source(valid, row)
    sym64 = sym.to(torch.int64) & 0xFFFF
    sent = torch.where(valid, sym64[src], 0) if ht.n_elems else sym64
    slot_blk, slot_k, ck = t.slot_blk, t.slot_k, ht.chunk
    c_lo = t.elem_off[slot_blk] + slot_k * ck
    c_hi = t.elem_off[slot_blk] + torch.minimum((slot_k + 1) * ck, s.n_sym[slot_blk])
    chunk_ends, stream = k.huffman.encode_chunks(
        sent.to(torch.int32),
        c_lo,
        torch.maximum(c_hi, c_lo),
        slot_blk * ALPHABET_SIZE,
        s.lengths.to(torch.int32),
        s.codes,
        ck,
        ht.stream_words,
    )
    ends0 = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), chunk_ends])
    base = ends0[t.first_slot]
    words = ends0[t.first_slot + t.n_slots] - base
    bits = flat.bits[src] if ht.n_elems else flat.bits
    return Coded(valid, sent, bits, chunk_ends, stream, base, words)


def sections(t: Columns, s: Sends, dr: Dedupe, stream_words: torch.Tensor) -> Sections:
    """Stage 6: every section's offset (cumsums); payload g's header, descriptors and segments
    from ``payload_base[g]`` on."""
    uniq_words = torch.where(s.is_lz, words_for_bytes(dr.n_unique * t.dim * t.itemsize), 0)
    nib_words = torch.where(s.is_q, words_for_bytes((s.sym_count + 1) // 2), 0)
    esc_words = sm.escape_words(s.n_escapes, t.itemsize)  # positions, then values
    coded = nib_words + esc_words + s.n_chunks + torch.where(s.is_q, stream_words, 0)
    body = SEGMENT_HEADER_WORDS + s.refs_words + uniq_words + coded
    seg_words = torch.where(s.mode == MODE_RAW, t.raw_words, body)
    return place(t, seg_words, (nib_words, s.refs_words, esc_words), s.n_escapes, s.n_chunks)


def place(
    t: Columns, seg_words: torch.Tensor, words: tuple[torch.Tensor | int, ...],
    n_escapes: torch.Tensor, n_chunks: torch.Tensor | int,
) -> Sections:  # fmt: skip
    """Every section's offset from the blocks' segment sizes (cumsums over the blocks).

    Args:
        t: The compress's columns.
        seg_words: Per block, its segment's words.
        words: Per block, the words of its codebook, references and escapes (each a tensor,
            or 0 for every block).
        n_escapes: Per block, its escapes.
        n_chunks: Per block, its chunks (0: no chunk table).

    Returns:
        The :class:`Sections`.
    """
    nib_words, refs_words, esc_words = words
    # Payloads back to back, each its header, descriptors, then its blocks' segments: the
    # segments' words before a block (one cumsum) plus the headers and descriptors before its
    # first segment (from the shapes, on the host).
    segs = bases(seg_words)
    seg_start = segs[:-1] + t.lead_words
    body_words = DESCRIPTOR_WORDS * t.group_blocks + (segs[t.group_end] - segs[t.group_first])
    payload_words = HEADER_WORDS + body_words
    payload_base = t.heads_before + segs[t.group_first]
    refs_at = seg_start + SEGMENT_HEADER_WORDS + nib_words
    escp_at = refs_at + refs_words
    table_at = escp_at + esc_words
    return Sections(
        seg_words=seg_words,
        payload_base=payload_base,
        payload_words=payload_words,
        body_words=body_words,
        seg_start=seg_start,
        refs_at=refs_at,
        escp_at=escp_at,
        escb_at=escp_at + n_escapes,
        table_at=table_at,
        stream_at=table_at + n_chunks,
    )


class WordBuffer:
    """An integer buffer and the masked writes into it: the payloads' words (int64 lanes
    holding uint32 words, or int32 words: adds of disjoint bits never overflow), or the table
    of a dedupe's first rows.

    Writes are collected and added in one ``index_add_`` when the buffer is next read
    (:attr:`buf`), so the buffer is touched once per read, not once per section. Masked lanes
    add 0 to a trash area past the end, spread so that a GPU does not serialise them on one
    address.

    Args:
        n_words: Words (entries) of the buffer before the trash area.
        dev: The device.
        dtype: int64, or int32 (values are then taken modulo 2**32).
    """

    def __init__(self, n_words: int, dev: torch.device, dtype: torch.dtype = torch.int64) -> None:
        self._buf = torch.zeros(n_words + _TRASH, dtype=dtype, device=dev)
        self._n_words = n_words
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @property
    def words(self) -> torch.Tensor:
        """The words without the pending writes (for a launch that adds into them while the
        small writes stay pending)."""
        return self._buf

    @property
    def buf(self) -> torch.Tensor:
        """The words, every write so far added (the trash area past ``n_words``)."""
        if self._pending:
            dest, value, valid = (
                torch.cat(p) if len(p) > 1 else p[0] for p in zip(*self._pending, strict=True)
            )
            self._pending = []
            trash = self._n_words + (torch.arange(dest.shape[0], device=dest.device) & (_TRASH - 1))
            dest = torch.where(valid, dest, trash)
            self._buf.index_add_(0, dest, torch.where(valid, value, 0).to(self._buf.dtype))
        return self._buf

    def put(self, dest: torch.Tensor, value: torch.Tensor, valid: torch.Tensor) -> None:
        """Per lane, adds word ``value`` at word ``dest`` where ``valid`` (words from 0)."""
        n = dest.shape[0]
        self._pending.append((dest, value.expand(n), valid.expand(n)))

    def put_records(self, at: torch.Tensor, words: torch.Tensor, valid: torch.Tensor) -> None:
        """Writes record ``i`` (``words[i]``, from ``format.pack_records``) at word
        ``at[i]`` where ``valid[i]``."""
        n, w = words.shape
        dest = at[:, None] + torch.arange(w, device=at.device)
        self.put(dest.reshape(-1), words.reshape(-1), valid[:, None].expand(n, w).reshape(-1))

    def put_elements(
        self,
        at: torch.Tensor,
        k: torch.Tensor,
        size: torch.Tensor,
        raw: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """Per lane, element ``k`` (raw bits ``raw``, ``size`` bytes: 4 take a word, 2 half)
        of a section of raw values at word ``at``, where ``valid``."""
        wide = size == 4
        raw64 = raw.to(torch.int64)
        value = torch.where(wide, raw64 & MASK32, (raw64 & 0xFFFF) << (16 * (k % 2)))
        self.put(at + torch.where(wide, k, k // 2), value, valid)


def descriptor_at(t: Columns, sec: Sections) -> torch.Tensor:
    """Per block, the word of its descriptor."""
    return sec.payload_base[t.group] + HEADER_WORDS + DESCRIPTOR_WORDS * t.local


def descriptor_words(
    shape: tuple[torch.Tensor, torch.Tensor], rec: EncodeColumns, s: Sends,
    seg_words: torch.Tensor, packed_bit: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Every block's descriptor words, int64 ``[n_blocks, DESCRIPTOR_WORDS]`` (``shape``: its
    rows and columns; ``packed_bit``: added to the quantized blocks' mode byte)."""
    mode = descriptor_mode(s.mode, rec.column(ec.VALUE))
    desc = {
        "rows": shape[0],
        "dim": shape[1],
        "dtype": rec.column(ec.DTYPE),
        "mode": torch.where(s.is_q, mode | packed_bit, mode),
        "seg_words": seg_words,
        "bound": rec.column(ec.BOUND_BITS),
    }
    return pack_records(DESCRIPTOR, desc)


def put_descriptors(
    out: WordBuffer, t: Columns, rec: EncodeColumns, s: Sends, sec: Sections
) -> None:
    """Every block's descriptor."""
    words = descriptor_words((t.rows, t.dim), rec, s, sec.seg_words)
    out.put_records(descriptor_at(t, sec), words, torch.ones_like(s.is_q))


def segment_header_records(
    rec: EncodeColumns, s: Sends, group_symbols: int, n_groups: torch.Tensor,
    escape_length: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Every block's segment header words, int64 ``[n_blocks, SEGMENT_HEADER_WORDS]`` (mode lz
    fills n_unique and the references only), the grid from the launchers' record; the two
    formats differ only in the fields passed here.

    Args:
        rec: The blocks' encode record.
        s: What each block sends.
        group_symbols: Symbols per chunk (entropy) or per group (packed) of a quantized block.
        n_groups: Per block, its chunks or groups.
        escape_length: Per block, the escape symbol's code length field.

    Returns:
        The words.
    """
    is_q = s.is_q
    head = segment_header_words(
        (
            torch.where(is_q, rec.floats(ec.STEP_BITS), 0.0),
            torch.where(is_q, rec.column(ec.CENTER), 0),
            s.n_sent,
            s.n_escapes,
            torch.where(is_q, group_symbols, 0),
            n_groups,
            s.sym_lo,
            s.sym_count,
            escape_length,
            s.ref_mode,
            s.ref_width,
        )
    )
    return torch.stack([w.to(torch.int64) for w in head], dim=1)


def _put_headers(
    out: WordBuffer, t: Columns, rec: EncodeColumns, s: Sends, sec: Sections, chunk: int
) -> None:
    """Descriptors, segment headers (every mode but raw; mode lz fills n_unique and the
    references only) and codebook nibbles (lengths of symbols sym_lo .., low nibble first);
    the grid from the launchers' record."""
    put_descriptors(out, t, rec, s, sec)
    is_q, dev = s.is_q, t.rows.device
    escape_length = torch.where(is_q, s.lengths[:, ESCAPE_SYMBOL], 0)
    words = segment_header_records(rec, s, chunk, s.n_chunks, escape_length)
    out.put_records(sec.seg_start, words, s.mode != MODE_RAW)
    k = torch.arange(ESCAPE_SYMBOL, device=dev)
    nib = s.lengths.gather(1, (s.sym_lo[:, None] + k).clamp(max=ALPHABET_SIZE - 1))
    out.put(
        (sec.seg_start[:, None] + SEGMENT_HEADER_WORDS + k // 8).reshape(-1),
        (nib << (4 * (k % 8))).reshape(-1),
        (k[None, :] < s.sym_count[:, None]).reshape(-1),
    )


def put_references(
    out: WordBuffer,
    t: Columns,
    flat: Flat,
    s: Sends,
    sec: Sections,
    dedupes: tuple[Dedupe, Dedupe],
) -> None:
    """Every block's vector references, MSB-first: fixed width, or a flag bit (1: first
    occurrence) and the repeats' ids (``dedupes``: over the symbols, over the raw bits)."""
    dq, dr = dedupes
    r_blk = flat.r_blk
    qlz = s.is_qlz[r_blk]
    first = torch.where(qlz, dq.first, dr.first) == 1
    flagged = s.ref_mode[r_blk] == 1
    r_len = torch.where(flagged & first, 1, s.ref_width[r_blk] + flagged.to(torch.int64))
    r_len = torch.where(s.has_refs[r_blk], r_len, 0)
    r_val = torch.where(flagged & first, 1, torch.where(qlz, dq.ids, dr.ids))
    r_start = bases(r_len)
    off, head, tail, spill = reference_words(r_start[:-1] - r_start[t.row_off[r_blk]], r_len, r_val)
    at = sec.refs_at[r_blk] + off
    out.put(at, head, r_len > 0)
    out.put(at + 1, tail, spill)


def put_escapes(out: WordBuffer, t: Columns, flat: Flat, c: Coded, sec: Sections) -> None:
    """Escapes: positions in the sent stream, then the escaped elements' raw bits."""
    e_blk = flat.e_blk
    is_esc = c.valid & (c.sym == ESCAPE_SYMBOL)
    rank0 = bases(is_esc.to(torch.int64))
    k = rank0[:-1] - rank0[t.elem_off[e_blk]]
    out.put(sec.escp_at[e_blk] + k, flat.e_loc, is_esc)
    out.put_elements(sec.escb_at[e_blk], k, t.itemsize[e_blk], c.bits, is_esc)


def _put_streams(
    out: WordBuffer, ht: HostTables, t: Columns, s: Sends, c: Coded, sec: Sections
) -> None:
    """Chunk tables (chunk ends relative to the block's bitstream), then the bitstreams."""
    slot_blk, slot_k = t.slot_blk, t.slot_k
    used = slot_k < s.n_chunks[slot_blk]
    out.put(sec.table_at[slot_blk] + slot_k, c.chunk_ends - c.base[slot_blk], used)
    last = max(ht.n_blocks - 1, 0)
    w = torch.arange(ht.stream_words, device=c.stream.device)
    w_blk = torch.searchsorted(c.base + c.words, w, right=True).clamp(max=last)
    w_used = w < (c.base + c.words)[w_blk] if ht.n_blocks else w < 0
    dest = sec.stream_at[w_blk] + w - c.base[w_blk]
    out.put(dest, c.stream.to(torch.int64) & MASK32, w_used & s.is_q[w_blk])


def put_rows(out: WordBuffer, t: Columns, flat: Flat, s: Sends, dr: Dedupe, sec: Sections) -> None:
    """Raw blocks, and the distinct rows of lossless vector-LZ blocks."""
    e_blk, e_loc = flat.e_blk, flat.e_loc
    size = t.itemsize[e_blk]
    out.put_elements(sec.seg_start[e_blk], e_loc, size, flat.bits, (s.mode == MODE_RAW)[e_blk])
    valid = s.is_lz[e_blk] & (e_loc < dr.n_unique[e_blk] * t.dim[e_blk])
    src = flat.source(valid, dr.row(flat, e_loc // flat.e_dim))
    out.put_elements(sec.escp_at[e_blk], e_loc, size, flat.bits[src], valid)


def close(
    out: WordBuffer, ht: HostTables, t: Columns, sec: Sections, group_sizes: list[int],
    flags: int = 0, checksums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Checksums and headers; the int32 payload words and the skeletons (what a decoder's
    layout depends on, for the receiver). ``checksums``: the payloads' (None: computed here
    over the buffer)."""
    dev = sec.payload_base.device
    if checksums is None:
        checksums = segment_checksums(out.buf, sec.payload_base + HEADER_WORDS, sec.body_words)
    header = {
        "magic": MAGIC,
        "version": VERSION,
        "flags": flags,
        "n_blocks": t.group_blocks,
        "body_words": sec.body_words,
        "checksum": checksums,
    }
    # Tensor-indexed writes (no host tensor is built, no sync), with the buffer's last writes.
    at = (sec.payload_base[:, None] + torch.arange(HEADER_WORDS, device=dev)).reshape(-1)
    out.put(at, pack_records(HEADER, header).reshape(-1), torch.ones_like(at, dtype=torch.bool))
    buf = out.buf
    index = skeleton_index(sec.payload_base, sec.payload_words, group_sizes, sec.seg_start)
    if buf.dtype == torch.int32:
        return buf[: ht.body_max], buf[index].to(torch.int64) & MASK32
    # Each int64 lane holds a uint32 word: its low half (little-endian: CPU and CUDA) is the
    # int32 word, a strided view, so nothing is converted (finish copies the payload's words).
    return buf[: ht.body_max].view(torch.int32)[::2], buf[index]


def compress_device(
    blocks: Sequence[torch.Tensor],
    bounds: Sequence[float],
    config: CodecConfig,
    kinds: Sequence[int] | None = None,
    kernels: KernelSet | None = None,
) -> tuple[torch.Tensor, list[BlockStats]]:
    """Compresses blocks on their device; the payload equals ``pipeline.compress``'s (CPU).

    Args:
        blocks: Validated 2-D float32 / float16 / bfloat16 tensors, all on one device (CUDA, or
            CPU under ``TRITON_INTERPRET=1`` or with the torch twins).
        bounds: Validated absolute error bounds (floats >= 0), one per block.
        config: Codec knobs (its ``backend`` is not read: ``kernels`` are the stages).
        kinds: Per block, its ``BoundKind`` (absolute, or per-value); None: all absolute.
        kernels: The kernel set (``kernel_set.load_kernels``); None: the Triton launchers.

    Returns:
        (1-D uint8 payload on the blocks' device, one BlockStats per block). Exactly one
        device-to-host transfer is made (``host_sync.to_host``).
    """
    kinds = list(kinds or [BoundKind.ABSOLUTE] * len(blocks))
    if kernels is None:
        kernels = load_kernels(blocks[0].device if blocks else torch.device("cpu"))
    with profile_range("## lossy_codec encode ##"):
        pending = start_groups_device(blocks, bounds, kinds, [len(blocks)], config, kernels)
        buf, _, stats, _ = pending.finish(host_sync.to_host(pending.readback, "compress").tolist())
    return buf, stats[0]


def start_groups_device(
    blocks: Sequence[torch.Tensor],
    bounds: Sequence[float],
    kinds: Sequence[int],
    group_sizes: Sequence[int],
    config: CodecConfig,
    kernels: KernelSet,
) -> PendingCompress:
    """Compresses several payloads (groups of consecutive blocks) in one pass, without a sync.

    Payload ``g`` holds blocks ``sum(group_sizes[:g]) ..`` and is byte-identical to
    :func:`compress_device` of those blocks (with relative bounds resolved as
    :func:`torchrec_lossy.codec.bounds.absolute_bounds` does, on the device).

    Args:
        blocks: Validated blocks, all on one device.
        bounds: Per block: the absolute bound, or for a relative block the fraction of its
            finite range (``max - min`` over the finite elements, float32).
        kinds: Per block, its ``BoundKind``.
        group_sizes: Blocks per payload.
        config: Codec knobs (its ``backend`` is not read: ``kernels`` are the stages).
        kernels: The kernel set (``kernel_set.load_kernels``).

    Returns:
        The pending compress: read its ``readback`` (alone or with other tensors, in one copy)
        and pass the values to ``finish``.
    """
    if config.format == "packed":  # its own coding stages (codec/device_packed_compress.py)
        from torchrec_lossy.codec.device_packed_compress import start_packed_groups

        return start_packed_groups(blocks, bounds, kinds, group_sizes, config, kernels)
    k, group_sizes = kernels, list(group_sizes)  # k: as the stage functions name it
    with profile_range("## lossy_codec encode ##"):
        ht = host_tables(blocks, bounds, kinds, group_sizes, config)
        dev = blocks[0].device if blocks else torch.device("cpu")
        t: Columns[torch.Tensor] = host_sync.upload_record(ht.cols, dev)
        flat = flatten(blocks, ht, t)
        grid = grid_stage(k, ht, t, flat)
        cols = grid.cols
        sym, hist, max_err = quantize_stage(k, ht, t, flat, cols)
        dq, dr = vector_lz_stage(k, sym, ht, t, flat, cols)
        # Distinct rows' histograms: the quantized symbols of first occurrences only.
        keep = dq.first[t.row_off[flat.e_blk] + flat.e_loc // flat.e_dim].to(torch.int32)
        hist_u = k.huffman.histogram_tiles(
            sym, keep, t.tiles.reshape(-1, 3), ht.n_blocks, ht.tile_block
        )
        codes = _codes(k, torch.cat([hist, hist_u]), ht.chunk)
        s = _sends(k, t, _choose_mode(t, grid.ok, codes, dq, dr), codes, dq, dr, ht.chunk)
        coded = _encode(k, ht, t, flat, sym, dq, s)
        sec = sections(t, s, dr, coded.words)
        out = WordBuffer(ht.body_max, dev)
        _put_headers(out, t, cols, s, sec, ht.chunk)
        put_references(out, t, flat, s, sec, (dq, dr))
        put_escapes(out, t, flat, coded, sec)
        _put_streams(out, ht, t, s, coded, sec)
        put_rows(out, t, flat, s, dr, sec)
        words32, skeleton = close(out, ht, t, sec, group_sizes)
        per_block = (s.mode, s.n_sent, s.n_escapes, sec.seg_words)
        errs = torch.where(s.is_q, max_err, 0.0).view(torch.int64)
        readback = torch.cat([sec.payload_words, *per_block, errs, grid.bound_bits, skeleton])
        return PendingCompress(words32, readback, ht, group_sizes)


@dataclass(frozen=True)
class PendingCompress:
    """A compress whose payloads are built on the device, waiting for its one host read.

    :attr:`readback` is the int64 tensor the host must read (the payload sizes first, one per
    group, in words, then the per-block stats); a caller may read it together with tensors of
    its own in one copy, then call :meth:`finish` with its values.

    Attributes:
        words: int32 words of the payloads back to back (and slack; may be a strided view).
        readback: The values the host needs.
        tables: The host tables of the call (shapes).
        group_sizes: Blocks per payload.
    """

    words: torch.Tensor
    readback: torch.Tensor
    tables: HostTables
    group_sizes: list[int]

    @property
    def device_sizes(self) -> torch.Tensor:
        """int64 bytes of each payload, on the device (no sync)."""
        return 4 * self.readback[: len(self.group_sizes)]

    @property
    def device_skeleton(self) -> torch.Tensor:
        """int64 skeleton words of every payload (``container.skeleton_index``), on the device."""
        return self.readback[len(self.group_sizes) + _STAT_ROWS * self.tables.n_blocks :]

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
        c, ng, nb = self.tables.cols, len(self.group_sizes), self.tables.n_blocks
        sizes = [4 * int(w) for w in host[:ng]]
        end = ng + _STAT_ROWS * nb
        h = np.array(host[ng:end], dtype=np.int64).reshape(_STAT_ROWS, nb)
        skel = np.array(host[end:], dtype=np.int64).astype(np.uint32)
        skel_ends = np.cumsum([skeleton_words(n) for n in self.group_sizes], dtype=np.int64)
        errs, bounds_used = h[4].view(np.float64), h[5].view(np.float64)
        stats = BlockColumns.assemble(
            (c.rows, c.dim, c.itemsize), h[0], h[3], bounds_used, errs, (h[1], h[2])
        ).stats()
        words = self.words[: sum(sizes) // 4]
        payload = words.clone(memory_format=torch.contiguous_format).view(torch.uint8)
        first = np.cumsum(self.group_sizes, dtype=np.int64) - self.group_sizes
        per_group = [stats[a : a + n] for a, n in zip(first, self.group_sizes, strict=True)]
        return payload, sizes, per_group, np.split(skel, skel_ends[:-1]) if ng else []
