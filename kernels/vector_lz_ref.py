"""Torch twins of ``kernels/vector_lz.py``'s launchers: same names, signatures and bits, no triton.

:func:`representatives` dedupes each block's rows with :func:`dedupe_reference` over
:func:`element_keys` (the first identical row represents a group); :func:`unpack_refs_blocks` reads
each block's references from its bits, fixed-width rows at once, flagged rows one after the
other as the stream dictates, with the launcher's checks. They are the oracle of the Triton
kernels and the ``"reference"`` kernel set: one Python iteration per block (per row only for
flagged references, whose positions depend on the rows before).
"""

from __future__ import annotations

import torch

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import encode_columns as ec
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.encode_columns import EncodeColumns
from torchrec_lossy.codec.format import ESCAPE_SYMBOL


def dedupe_reference(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``codec.vector_lz.dedupe_blocks_kernel`` on one block (the test oracle).

    Args:
        keys: [rows, dim] int64 element identities (:func:`element_keys`).

    Returns:
        (ids [rows] numbered by first occurrence, first_rows [n_unique]).
    """
    if keys.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    n = int(inverse.max()) + 1
    rows = torch.arange(keys.shape[0])
    first = torch.full((n,), keys.shape[0], dtype=torch.int64).scatter_reduce(
        0, inverse, rows, reduce="amin"
    )
    order = torch.argsort(first)  # renumber the distinct vectors by first occurrence
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n)
    return rank[inverse], first[order]


def element_keys(symbols: torch.Tensor | None, bits: torch.Tensor) -> torch.Tensor:
    """Element identities as ``dedupe_blocks_kernel`` compares them (torch, for the oracle).

    Args:
        symbols: [rows, dim] symbols, or None for raw (lossless) dedupe.
        bits: [rows, dim] raw bits as int32.

    Returns:
        [rows, dim] int64 keys.
    """
    raw_key = bits.long() & 0xFFFFFFFF
    if symbols is None:
        return bits.long()
    return torch.where(symbols == ESCAPE_SYMBOL, (1 << 32) | raw_key, symbols.long())


def _row_keys(
    symbols: torch.Tensor | None, bits: torch.Tensor, row_off: torch.Tensor, dim: int
) -> torch.Tensor:
    """int64 [rows, max(dim, 1)] element keys of rows (one 0 column for rows without elements:
    they are all equal)."""
    if dim == 0:
        return torch.zeros(row_off.shape[0], 1, dtype=torch.int64)
    idx = row_off[:, None] + torch.arange(dim, device=row_off.device)[None, :]
    sym = None if symbols is None else symbols[idx].long() & 0xFFFF  # the uint16 symbols
    return element_keys(sym, bits[idx]).cpu()


def representatives(
    symbols: torch.Tensor | None, bits: torch.Tensor, row_blk: torch.Tensor,
    cols: EncodeColumns, max_dim: int, mults: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Twin of ``kernels.vector_lz.representatives`` (its docstring has the full contract).

    Args:
        symbols: int16 bits of every element's symbol; None for raw (lossless) dedupe.
        bits: int32 raw bits of every element.
        row_blk: Per row, its block (a block's rows are consecutive).
        cols: The blocks' compress record (``encode_columns``); read per block: its elements
            per row, first row and first element.
        max_dim: Largest row (not needed here).
        mults: The hash's multipliers (not needed here: nothing is hashed).

    Returns:
        (int32 per row, the global index of the first row of its block equal to it, element key
        by element key; int32 per row, 1 where that is the row itself).
    """
    del max_dim, mults
    rows, dev = row_blk.shape[0], bits.device
    rep = torch.zeros(rows, dtype=torch.int32, device=dev)
    blocks, counts = torch.unique_consecutive(row_blk, return_counts=True)
    dims, row_off, elem_off = (cols.column(f).tolist() for f in (ec.DIM, ec.ROW_OFF, ec.ELEM_OFF))
    start = 0
    for b, n in zip(blocks.tolist(), counts.tolist(), strict=True):
        first = elem_off[b] + (start - row_off[b]) * dims[b]
        offsets = first + torch.arange(n, device=dev) * dims[b]
        ids, first_rows = dedupe_reference(_row_keys(symbols, bits, offsets, dims[b]))
        rep[start : start + n] = (first_rows[ids] + start).to(torch.int32)
        start += n
    is_first = (rep == torch.arange(rows, device=dev)).to(torch.int32)
    return rep, is_first


def representatives_pair(
    symbols: torch.Tensor, bits: torch.Tensor, row_blk: torch.Tensor, cols: EncodeColumns,
    max_dim: int, mults: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Twin of ``kernels.vector_lz.representatives_pair``: :func:`representatives` over the
    symbols, then over the raw bits, stacked.

    Args:
        symbols, bits, row_blk, cols, max_dim, mults: As :func:`representatives`.

    Returns:
        (rep, is_first): int32 [2, rows] each.
    """
    by_sym = representatives(symbols, bits, row_blk, cols, max_dim, mults)
    by_raw = representatives(None, bits, row_blk, cols, max_dim, mults)
    return torch.stack([by_sym[0], by_raw[0]]), torch.stack([by_sym[1], by_raw[1]])


def _bit_stream(refs: torch.Tensor, n_bits: int) -> torch.Tensor:
    """The bits of int32 words MSB-first (int64 0 / 1), zero-padded to at least ``n_bits``."""
    shifts = torch.arange(31, -1, -1, device=refs.device)
    bits = ((refs.long()[:, None] >> shifts) & 1).reshape(-1)
    return torch.cat([bits, bits.new_zeros(max(n_bits - bits.shape[0], 0))])


def _fixed_ids(
    refs: torch.Tensor, rows: int, width: int, n_unique: int
) -> tuple[torch.Tensor, bool]:
    """REFS_FIXED: row ``r``'s id in bits ``[r * width, (r + 1) * width)``.

    Returns:
        (int64 [rows] ids, bits past the end reading as 0; whether every id is within the
        references' bits and below ``n_unique``).
    """
    pos = torch.arange(rows, device=refs.device) * width
    k = torch.arange(width, device=refs.device)
    stream = _bit_stream(refs, rows * width)
    v = (stream[pos[:, None] + k] << (width - 1 - k)).sum(dim=1)
    ok = (pos + width <= refs.shape[0] * 32) & (v < n_unique)
    return v, bool(ok.all())


def _flagged_ids(
    refs: torch.Tensor, rows: int, width: int, n_unique: int
) -> tuple[list[int], bool]:
    """REFS_FLAGGED: per row a flag (1: the next new vector) or a 0 and a ``width``-bit id.

    Returns:
        (the ids of the rows read before the first failure; whether every row was read within
        the references' bits with an id below ``n_unique``, introducing ``n_unique`` vectors).
    """
    n_bits = refs.shape[0] * 32
    stream = "".join(map(str, _bit_stream(refs, n_bits + width + 1).tolist()))
    ids: list[int] = []
    pos = seen = 0
    for _ in range(rows):
        first = stream[pos] == "1"
        used = 1 if first else 1 + width
        v = seen if first else int(stream[pos + 1 : pos + used] or "0", 2)
        if pos + used > n_bits or v >= n_unique:
            return ids, False
        ids.append(v)
        seen += first
        pos += used
    return ids, seen == n_unique


def unpack_refs_blocks(
    words: torch.Tensor, cols: DecodeColumns, n_ids: int, n_fixed_rows: int
) -> torch.Tensor:
    """Twin of ``kernels.vector_lz.unpack_refs_blocks`` (its docstring has the full contract).

    Args:
        words: The payload as int32 words.
        cols: The blocks' decode record (``decode_columns``); read: where each REFS_FIXED
            block's rows start, the REFS_FIXED and REFS_FLAGGED blocks, and per block its
            references' word and words, rows, distinct vectors, id width and first output entry;
            written: ``REFS_BAD`` raised to 1 for a block whose references fail the checks (an
            id not below ``n_unique``, bits running out, a flagged block introducing other than
            ``n_unique`` vectors).
        n_ids: Length of the output.
        n_fixed_rows: Rows of all REFS_FIXED blocks (not needed here).

    Returns:
        int32 [n_ids] vector id of every row; where ``bad``: a fixed block's ids as read, a
        flagged block's up to its first failure, then 0 (the launcher leaves those unspecified).
    """
    fields = (dc.FIXED_BASE, dc.FIXED_BLOCKS, dc.FLAGGED_BLOCKS, dc.REF_OFF, dc.REF_WORDS)
    fixed_base, fixed_blocks, flagged_blocks, ref_off, ref_words = map(cols.column, fields)
    fields = (dc.ROWS, dc.N_UNIQUE, dc.WIDTH, dc.ID_BASE, dc.REFS_BAD)
    rows, n_unique, width, id_base, bad = map(cols.column, fields)
    del n_fixed_rows
    ids = torch.zeros(n_ids, dtype=torch.int32, device=words.device)
    off, n_words, n_rows, uniq, widths, base = (
        t.tolist() for t in (ref_off, ref_words, rows, n_unique, width, id_base)
    )
    fixed_rows = fixed_base.diff().tolist()
    blocks = [(b, n, _fixed_ids) for b, n in zip(fixed_blocks.tolist(), fixed_rows, strict=True)]
    blocks += [(b, n_rows[b], _flagged_ids) for b in flagged_blocks.tolist()]
    for b, n, unpack in blocks:
        v, ok = unpack(words[off[b] : off[b] + n_words[b]], n, widths[b], uniq[b])
        ids[base[b] : base[b] + len(v)] = torch.as_tensor(v, dtype=torch.int64).to(ids)
        if not ok:
            bad[b] = bad[b].clamp(min=1)
    return ids


__all__ = [
    "dedupe_reference",
    "element_keys",
    "representatives",
    "representatives_pair",
    "unpack_refs_blocks",
]
