"""The named records the compiled host path's stages hand each other.

Every stage of :mod:`torchrec_lossy.codec.host_compress` runs over all blocks of a batch at
once, on flat arrays with one entry per block (or per row, or per element). These tuples name
those arrays by what they are, so a kernel takes a few records instead of tens of positional
arrays; numba compiles them as typed tuples (passed in, built inside kernels, or returned).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Blocks(NamedTuple):
    """Where each block of a batch lies in the flat arrays.

    Attributes:
        rows: int64 [n] rows per block.
        dims: int64 [n] columns per block.
        itemsize: int64 [n] bytes per element of the block's dtype.
        elem_off: int64 [n + 1] first element of each block, then the end.
        row_off: int64 [n + 1] first row of each block, then the total.
        every_row: int32 [total rows] each row's index in its block (the rows of a block
            sent whole).
    """

    rows: np.ndarray
    dims: np.ndarray
    itemsize: np.ndarray
    elem_off: np.ndarray
    row_off: np.ndarray
    every_row: np.ndarray


class Grids(NamedTuple):
    """Each block's quantization grid.

    Attributes:
        step: float32 [n] steps.
        inv_step: float32 [n] their reciprocals.
        center: int64 [n] codes of the blocks' midpoints (qmax on the per-value grid).
        ok: bool [n] blocks that are quantized.
        value: bool [n] blocks on the per-value grid (their bound is relative).
    """

    step: np.ndarray
    inv_step: np.ndarray
    center: np.ndarray
    ok: np.ndarray
    value: np.ndarray


class Dedupe(NamedTuple):
    """Vector-LZ (``vector_lz.dedupe_blocks_kernel``) of the selected blocks.

    Attributes:
        selected: bool [n] blocks deduplicated.
        n_unique: int64 [n] distinct vectors per block (0 where not selected).
        ids: int32 [total rows] block-local vector ids, at each block's rows.
        first: int32 [total rows] the row where each distinct vector first occurs, at each
            block's row offset.
    """

    selected: np.ndarray
    n_unique: np.ndarray
    ids: np.ndarray
    first: np.ndarray


class Codes(NamedTuple):
    """Compact Huffman codes of the blocks (``huffman.plan_blocks_kernel``): block ``b``'s
    value symbols ``base[b] ..`` then the escape.

    Attributes:
        base: int64 [n] each block's lowest value symbol (any rows).
        len_off: int64 [n + 1] start of each block's code lengths in ``lengths`` (an empty
            range: the block is not coded).
        lengths: uint8 code lengths, the escape's last in each block's range.
        plan: int64 [5, n] coded bits, symbols, lowest value symbol with a code, span of the
            value symbols with a code, escapes (zeros where not coded).
    """

    base: np.ndarray
    len_off: np.ndarray
    lengths: np.ndarray
    plan: np.ndarray


class Segments(NamedTuple):
    """What each block's segment holds and where it goes (the mode choice's result).

    Attributes:
        mode: int64 [n] block modes (``format.MODE_*``, without the per-value bit).
        ref_mode: int64 [n] the segment header's reference packing.
        ref_width: int64 [n] the segment header's reference id width.
        skip: int64 [n + 1] words left free before each block's segment (its payload's header
            and descriptors where a payload starts).
        chunk: Symbols per Huffman chunk.
    """

    mode: np.ndarray
    ref_mode: np.ndarray
    ref_width: np.ndarray
    skip: np.ndarray
    chunk: int


__all__ = ["Blocks", "Codes", "Dedupe", "Grids", "Segments"]
