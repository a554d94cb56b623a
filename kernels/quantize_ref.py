"""Torch twins of ``kernels/quantize.py``'s launchers: same names, signatures and bits, no triton.

:func:`quantize_tiles` quantizes each block with :func:`quantize_reference` (the twin of
``codec.quantize.quantize_blocks_kernel`` on one block) and takes each tile's max error from the
reconstruction :func:`dequantize_reference` gives (what the decoder will produce);
:func:`decode_outputs` expands, dequantizes and fills in the escaped values block by block. They
are the oracle of the Triton kernels and the ``"reference"`` kernel set: written for clarity, one
Python iteration per block (or tile), never per element.
"""

from __future__ import annotations

import math

import torch

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import encode_columns as ec
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.encode_columns import EncodeColumns, GridRule
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    CODE_DTYPES,
    ESCAPE_SYMBOL,
    FLOAT32_CODE,
    NEAREST_KEY,
    SYMBOL_OFFSET,
    U_SCALE,
    dtype_itemsize,
    float32_from_bits,
    value_decode_bits,
    value_shift,
    value_symbol,
)
from torchrec_lossy.codec.quant_params import QuantParams
from torchrec_lossy.config import BoundKind
from torchrec_lossy.kernels.packed_ref import symbols_and_ranks


def uniform_reference(n: int, key: int) -> torch.Tensor:
    """Torch twin of the per-element draw (``codec.quantize.mix32``): float32 ``u`` in [0, 1)
    for elements ``0 .. n-1``.

    Args:
        n: Elements of the block.
        key: The block's key (``codec.quantize.stochastic_key``).

    Returns:
        float32 [n].
    """
    m = 0xFFFFFFFF
    h = (torch.arange(n, dtype=torch.int64) & m) ^ key
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & m  # int64 wrap-around keeps the low 32 bits right
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & m
    h = h ^ (h >> 16)
    return (h >> 8).float() * U_SCALE


def quantize_reference(
    x: torch.Tensor, params: QuantParams, bound: float, sr_key: int = NEAREST_KEY
) -> tuple[torch.Tensor, float]:
    """Torch twin of ``codec.quantize.quantize_blocks_kernel`` on one block (the test oracle).

    Args:
        x: Block of any accepted dtype, any shape.
        params: Quantization parameters.
        bound: Absolute bound.
        sr_key: ``NEAREST_KEY`` or the block's stochastic-rounding key.

    Returns:
        (int64 symbols, flat, ESCAPE_SYMBOL where escaped; max error over non-escaped elements).
    """
    xf = x.reshape(-1).float()
    if params.value:
        return _quantize_value_reference(x, xf, params, bound)
    step = torch.tensor(params.step, dtype=torch.float32)
    inv = torch.tensor(params.inv_step, dtype=torch.float32)
    if sr_key == NEAREST_KEY:
        qf = torch.floor(xf * inv + 0.5)
    else:
        t = xf * inv
        fl = torch.floor(t)
        qf = torch.where(uniform_reference(xf.shape[0], sr_key) < t - fl, fl + 1.0, fl)
    rel = qf.double() - params.center
    recon = (qf * step).to(x.dtype)
    err = (recon.double() - xf.double()).abs()
    ok = torch.isfinite(xf) & (rel.abs() <= SYMBOL_OFFSET) & torch.isfinite(recon) & (err <= bound)
    symbols = torch.where(ok, rel.nan_to_num(0).long() + SYMBOL_OFFSET, ESCAPE_SYMBOL)
    max_error = float(err[ok].max()) if bool(ok.any()) else 0.0
    return symbols, max_error


def _quantize_value_reference(
    x: torch.Tensor, xf: torch.Tensor, params: QuantParams, bound: float
) -> tuple[torch.Tensor, float]:
    """:func:`quantize_reference` on the per-value grid (max error: the relative one)."""
    bits = xf.view(torch.int32).long() & 0xFFFFFFFF
    sym, rb = value_symbol(bits, value_shift(params.step), params.center)
    recon = float32_from_bits(rb).to(x.dtype).double()
    err = (recon - xf.double()).abs()
    ax = xf.double().abs()
    ok = (sym != ESCAPE_SYMBOL) & (err <= bound * ax)  # False for NaN and Inf too
    rel = torch.where(ok & (ax > 0), err / ax, 0.0)
    return torch.where(ok, sym, ESCAPE_SYMBOL), float(rel.max()) if rel.numel() else 0.0


def dequantize_reference(symbols: torch.Tensor, params: QuantParams) -> torch.Tensor:
    """Torch twin of ``codec.quantize.dequantize_kernel``.

    Args:
        symbols: Integer symbols.
        params: Quantization parameters.

    Returns:
        float32 reconstructions (escaped positions hold garbage, to be overwritten).
    """
    if params.value:
        shift = value_shift(params.step)
        bits = value_decode_bits(symbols.long(), shift, params.center)  # in [0, 2**32)
        return float32_from_bits(bits)
    q = (symbols.long() - SYMBOL_OFFSET + params.center).float()
    return q * torch.tensor(params.step, dtype=torch.float32)


def _block_ranges(tiles: list[list[int]]) -> dict[int, tuple[int, int]]:
    """Each block's element range, the union of its tiles (``tile_table``: contiguous)."""
    ranges: dict[int, tuple[int, int]] = {}
    for lo, hi, b in tiles:
        first, end = ranges.get(b, (lo, hi))
        ranges[b] = (min(first, lo), max(end, hi))
    return ranges


def _errors(x: torch.Tensor, symbols: torch.Tensor, params: QuantParams) -> torch.Tensor:
    """float64 error of each element the decoder reconstructs from its symbol (0 if escaped).

    Args:
        x: The block's values in its dtype.
        symbols: Their symbols (``quantize_reference``).
        params: The block's grid.

    Returns:
        ``|x' - x|`` (relative, ``|x' - x| / |x|``, on the per-value grid; 0 for ``x == 0``).
    """
    exact = x.double()
    err = (dequantize_reference(symbols, params).to(x.dtype).double() - exact).abs()
    if params.value:
        err = torch.where(exact != 0, err / exact.abs(), 0.0)
    return torch.where(symbols != ESCAPE_SYMBOL, err, 0.0)


def quantize_tiles(
    x: torch.Tensor, tiles: torch.Tensor, cols: EncodeColumns, block: int,
    histograms: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Twin of ``kernels.quantize.quantize_tiles`` (its docstring has the full contract).

    Args:
        x: float32 values of all blocks, back to back (exactly representable in their dtype).
        tiles: The launch's tiles, rows (first element, end element, block).
        cols: The blocks' compress record (``encode_columns``); read per block: its float32
            step and ``1 / step``, the code of its center (qmax on the per-value grid), its
            float64 bound (relative on the per-value grid), its dtype code, its
            stochastic-rounding key or -1 (element ``i`` of a block draws with counter ``i``,
            whichever tile holds it) and whether it is on the per-value grid.
        block: Tile size (not needed here: the tiles say where they are).
        histograms: Whether to count the symbols (else the histograms are [0, ALPHABET_SIZE]).

    Returns:
        (int16 symbol bits of every element, 0 where no tile reaches; int32 symbol counts per
        block and symbol; float64 per tile, the largest error of its elements not escaped).
    """
    del block
    dev = x.device
    symbols = torch.zeros(x.shape[0], dtype=torch.int16, device=dev)
    n_hist = cols.n_blocks if histograms else 0
    hist = torch.zeros(n_hist, ALPHABET_SIZE, dtype=torch.int32, device=dev)
    err = torch.zeros(x.shape[0], dtype=torch.float64, device=dev)
    tile_list = tiles.reshape(-1, 3).tolist()
    steps, inv, bounds = (
        cols.floats(f).tolist() for f in (ec.STEP_BITS, ec.INV_STEP_BITS, ec.BOUND_BITS)
    )
    centers, codes, keys, values = (
        cols.column(f).tolist() for f in (ec.CENTER, ec.DTYPE, ec.SR_KEY, ec.VALUE)
    )
    for b, (lo, hi) in _block_ranges(tile_list).items():
        params = QuantParams(steps[b], inv[b], centers[b], value=values[b] != 0)
        xb = x[lo:hi].cpu().to(CODE_DTYPES[codes[b]])  # the references draw on the CPU
        sym, _ = quantize_reference(xb, params, bounds[b], keys[b])
        symbols[lo:hi] = sym.to(torch.int16)
        if histograms:
            hist[b] = torch.bincount(sym, minlength=ALPHABET_SIZE).to(torch.int32)
        err[lo:hi] = _errors(xb, sym, params)
    tile_err = [err[lo:hi].max() if hi > lo else err.new_zeros(()) for lo, hi, _ in tile_list]
    errors = torch.stack(tile_err) if tile_err else err.new_zeros(0)
    return symbols, hist, errors


def block_medians(
    x: torch.Tensor, elem_off: torch.Tensor, numel: torch.Tensor, n_finite: torch.Tensor,
    need: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The median part of :func:`block_grids` (the grid launch's radix select, here by two
    stable sorts of every element: the oracle)."""
    nb, n_el = elem_off.shape[0], x.shape[0]
    if not n_el:
        return torch.zeros(nb, dtype=torch.float64, device=x.device)
    blk = torch.repeat_interleave(torch.arange(nb, device=x.device), numel, output_size=n_el)
    keyed = torch.where(torch.isfinite(x), x, math.inf)
    order = torch.argsort(keyed, stable=True)
    order = order[torch.argsort(blk[order], stable=True)]
    ordered = keyed[order].double()
    upper = (elem_off + n_finite // 2).clamp(max=n_el - 1)
    lower = (elem_off + (n_finite - 1) // 2).clamp(min=0, max=n_el - 1)
    return torch.where(need & (n_finite > 0), (ordered[lower] + ordered[upper]) / 2, 0.0)


_BIG = 0x7FFFFFFF  # the order keys' sentinel: NaN bits, never a finite value's key


def key_values(keys: torch.Tensor) -> torch.Tensor:
    """float32 values of int32 order keys (``v ^ ((v >> 31) & 0x7FFFFFFF)``, the host's
    ``finite_ranges_kernel`` keys); the sentinels (no value) to +inf / -inf.

    Args:
        keys: int32 keys: the smallest (sentinel ``0x7FFFFFFF``) or largest (``-0x7FFFFFFF``).

    Returns:
        float32 values, the shape of ``keys``.
    """
    bits = keys ^ ((keys >> 31) & _BIG)
    none = (keys == _BIG) | (keys == -_BIG)
    inf = torch.where(keys > 0, math.inf, -math.inf)
    return torch.where(none, inf, bits.view(torch.float32))


def block_ranges(
    x: torch.Tensor, elem_off: torch.Tensor, numel: torch.Tensor, octaves: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranges part of :func:`block_grids` (the grid launch's finite and inlier ranges; the
    outlier rule's histogram by ``index_add_``)."""
    nb, dev = elem_off.shape[0], x.device
    blk = torch.repeat_interleave(torch.arange(nb, device=dev), numel, output_size=x.shape[0])
    v = x.contiguous().view(torch.int32)
    e = (v >> 23) & 0xFF
    key = v ^ ((v >> 31) & _BIG)
    hist = torch.zeros(nb * 256, dtype=torch.int64, device=dev)
    hist.index_add_(0, blk * 256 + e, ((e >= 1) & (e <= 254)).to(torch.int64))
    hist = hist.view(nb, 256)
    half = (hist.sum(1) + 1) // 2
    median = (torch.cumsum(hist, 1) < half[:, None]).sum(1)
    fin = e != 255
    inlier = fin & (e < (median + octaves)[blk])

    def keys(keep: torch.Tensor) -> torch.Tensor:
        lo = torch.full((nb,), _BIG, dtype=torch.int32, device=dev)
        hi = torch.full((nb,), -_BIG, dtype=torch.int32, device=dev)
        lo = lo.scatter_reduce(0, blk, torch.where(keep, key, _BIG), "amin")
        return torch.stack([lo, hi.scatter_reduce(0, blk, torch.where(keep, key, -_BIG), "amax")])

    lo, hi = key_values(keys(fin)).unbind(0)
    ilo, ihi = key_values(keys(inlier)).unbind(0)
    n_fin = torch.zeros(nb, dtype=torch.int64, device=dev).index_add_(0, blk, fin.to(torch.int64))
    return lo, hi, ilo, ihi, n_fin


def block_grids(
    x: torch.Tensor, cols: EncodeColumns, rows: torch.Tensor, rule: GridRule
) -> torch.Tensor:
    """Twin of ``quantize.block_grids``: :func:`block_ranges`, the grid rule the caller passes
    (``rule.rule``: ``codec.quantize``'s) over ``[n_blocks]`` tensors and :func:`block_medians`
    (the sorting oracle) where it is used."""
    numel = rows * cols.column(ec.DIM)
    elem_off = cols.column(ec.ELEM_OFF)
    lo, hi, ilo, ihi, n_fin = block_ranges(x, elem_off, numel, rule.octaves)
    # A relative bound is taken over the range without finite outliers (codec/outliers.py).
    rel = rule.kind == int(BoundKind.RELATIVE)
    given = rule.bound_bits.view(torch.float64)
    block_bound, uses_median, block_grid = rule.rule
    b = block_bound(
        rule.kind, given, torch.where(rel, ilo, lo), torch.where(rel, ihi, hi), numel,
        rule.stochastic, rule.quantization,
    )  # fmt: skip
    need = uses_median(b, lo, hi)
    median = block_medians(x, elem_off, numel, n_fin, need) + 0.0  # a -0.0 tie: +0.0
    g = block_grid(b, lo, hi, median)
    cols.set(step=g.step, inv_step=g.inv_step, center=g.center.to(torch.int64), bound=g.bound)
    ok = (g.ok & (rule.quant_try == 1)).to(torch.int64)
    f64 = [v.double().view(torch.int64) for v in (lo, hi, ilo, ihi)]
    return torch.stack([ok, *f64, n_fin, median.view(torch.int64)], dim=1)


def _half_bits(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int16 bits of float32 values rounded to a 16-bit dtype (nearest even, as the kernel).

    A NaN (only a crafted per-value-grid payload decodes to one) keeps torch's bits, which the
    kernel's do not match (they differ between the interpreter and the GPU, too).
    """
    return v.to(dtype).view(torch.int16)


def _quantized(
    sym: torch.Tensor, params: QuantParams, dtype_code: int, escaped: torch.Tensor
) -> torch.Tensor:
    """Dequantized values as output bits (int32 words or int16 halves by dtype), where
    ``escaped`` the values given (already in output bits)."""
    v = dequantize_reference(sym, params)
    wide = dtype_code == FLOAT32_CODE
    bits = v.view(torch.int32) if wide else _half_bits(v, CODE_DTYPES[dtype_code])
    return torch.where(sym == ESCAPE_SYMBOL, escaped, bits)


def _escaped_values(
    src: torch.Tensor, sym_at: torch.Tensor, rank: torch.Tensor, first: int, n_esc: int, at: int
) -> torch.Tensor:
    """The escaped value of every lane of a quantized block (garbage where not escaped).

    Args:
        src: The payload as words or halves (the block's element width).
        sym_at: Global symbol index of every lane.
        rank: int32 inclusive count of escapes of every symbol (``huffman.check_escapes``).
        first: The block's first symbol.
        n_esc: Its escapes.
        at: Where its escaped values start in ``src``.

    Returns:
        Escape ``k`` of the block (by rank, clamped into ``[0, n_esc)``) for each lane; 0 when
        the block has none.
    """
    if n_esc == 0:
        return torch.zeros_like(sym_at, dtype=src.dtype)
    before = int(rank[first - 1]) if first > 0 else 0
    k = (rank[sym_at].long() - 1 - before).clamp(0, n_esc - 1)
    return src[at + k]


def decode_outputs(
    words: torch.Tensor, cols: DecodeColumns, ids: torch.Tensor, symbols: torch.Tensor,
    rank: torch.Tensor, n_out_words: int, n_elements: int,
) -> torch.Tensor:  # fmt: skip
    """Twin of ``kernels.quantize.decode_outputs`` (its docstring has the full contract).

    Row ``r`` of a block is its vector ``ids[id_base + r]`` (LZ modes) or ``r``, clamped into
    ``[0, n_unique)``; a vector's elements are raw payload values (raw, lz) or dequantized
    symbols with escapes (quant, quant+lz; the per-value grid for mode bit 4).

    Args:
        words: The payload as int32 words (16-bit values through its int16 view).
        cols: The blocks' decode record (``decode_columns``): per block its mode, dtype code,
            columns, vectors sent, raw values' word, first id, first symbol, step bits, center,
            escaped values' word, escapes and first output word; where elements start.
        ids: Vector ids of the LZ blocks' rows.
        symbols: Decoded symbols (int16 bits).
        rank: Inclusive escape count of every symbol.
        n_out_words: Length of the output.
        n_elements: Elements of all blocks.

    Returns:
        int32 [n_out_words]: block ``b``'s elements from word ``out_off[b]``, as 32-bit words or
        16-bit halves by dtype; 0 in what no block writes (the launcher leaves it unspecified).
    """
    out = torch.zeros(n_out_words, dtype=torch.int32, device=words.device)
    if not n_elements:
        return out
    steps = cols.column(dc.STEP_BITS).to(torch.int32).view(torch.float32).tolist()
    base = cols.column(dc.OUT_BASE).tolist()
    per_block = (dc.MODE, dc.DTYPE, dc.DIM, dc.N_UNIQUE, dc.SRC_OFF, dc.ID_BASE, dc.SYM_BASE)
    fields = (*per_block, dc.CENTER, dc.ESC_VAL_OFF, dc.N_ESC, dc.OUT_OFF)
    columns = zip(*(cols.column(f)[: cols.n_blocks].tolist() for f in fields), strict=True)
    for b, (m, code, d, nu, src, idb, sb, c, ev, ne, oo) in enumerate(columns):
        e = torch.arange(base[b + 1] - base[b], device=words.device)
        if not e.numel():
            continue
        r = e // d
        u = ids[idb + r].long() if m & 1 else r
        idx = u.clamp(0, nu - 1) * d + (e - r * d)
        unit = 4 // dtype_itemsize(code)  # output elements per word
        wide = unit == 1
        src_units = words if wide else words.view(torch.int16)
        if m & 2:
            sym = symbols[sb + idx].long() & 0xFFFF
            params = QuantParams(steps[b], 0.0, c, value=(m & 4) == 4)
            escaped = _escaped_values(src_units, sb + idx, rank, sb, ne, unit * ev)
            vals = _quantized(sym, params, code, escaped)
        else:
            vals = src_units[unit * src + idx]
        dst = out if wide else out.view(torch.int16)
        dst[unit * oo + e] = vals
    return out


def decode_packed_outputs(
    words: torch.Tensor,
    cols: DecodeColumns,
    ids: torch.Tensor,
    widths: torch.Tensor,
    ends: torch.Tensor,
    sizes: tuple[int, int],
    esc_iter: int,
) -> torch.Tensor:
    """Twin of ``kernels.quantize.decode_packed_outputs``: the packed values' symbols and ranks
    (``packed_ref.symbols_and_ranks``), then :func:`decode_outputs`.

    Args:
        words: int32 payload words.
        cols: The blocks' decode record.
        ids: Vector ids of the LZ blocks' rows.
        widths: int16 group widths.
        ends: int32 inclusive prefix sum of ``widths``.
        sizes: (words of the output buffer, total elements).
        esc_iter: Binary-search steps (unused).

    Returns:
        As :func:`decode_outputs`.
    """
    symbols, rank = symbols_and_ranks(words, cols, widths, ends)
    return decode_outputs(words, cols, ids, symbols, rank, *sizes)


__all__ = [
    "block_grids",
    "decode_outputs",
    "decode_packed_outputs",
    "dequantize_reference",
    "quantize_reference",
    "quantize_tiles",
    "uniform_reference",
]
