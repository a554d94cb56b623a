"""The named records the compiled host path's stages hand each other.

Every stage of :mod:`torchrec_lossy.codec.host_compress` runs over all blocks of a batch at
once, on flat arrays with one entry per block (or per row, or per element). These tuples name
those arrays by what they are, so a kernel takes a few records instead of tens of positional
arrays; numba compiles them as typed tuples (passed in, built inside kernels, or returned).
Per-block arrays are ``[n]`` (int64 unless said), offsets ``[n + 1]`` (the end last).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Blocks(NamedTuple):
    """Where each block of a batch lies in the flat arrays."""

    rows: np.ndarray
    dims: np.ndarray
    itemsize: np.ndarray  # bytes per element of the block's dtype
    elem_off: np.ndarray  # first element of each block
    row_off: np.ndarray  # first row of each block
    every_row: np.ndarray  # int32 [total rows]: each row's index in its block


class Grids(NamedTuple):
    """Each block's quantization grid."""

    step: np.ndarray  # float32
    inv_step: np.ndarray  # float32
    center: np.ndarray  # code of the block's midpoint (qmax on the per-value grid)
    ok: np.ndarray  # bool: the block is quantized
    value: np.ndarray  # bool: on the per-value grid (its bound is relative)


class Dedupe(NamedTuple):
    """Vector-LZ (``vector_lz.dedupe_blocks_kernel``) of the selected blocks."""

    selected: np.ndarray  # bool: the block was deduplicated
    n_unique: np.ndarray  # distinct vectors (0 where not selected)
    ids: np.ndarray  # int32 [total rows]: block-local vector ids, at each block's rows
    first: np.ndarray  # int32 [total rows]: each distinct vector's first row, likewise


class Codes(NamedTuple):
    """Compact Huffman codes (``huffman.plan_blocks_kernel``): block ``b``'s value symbols
    ``base[b] ..`` then the escape."""

    base: np.ndarray  # each block's lowest value symbol (any rows)
    len_off: np.ndarray  # each block's code lengths in ``lengths`` (empty: not coded)
    lengths: np.ndarray  # uint8, the escape's last in each block's range
    # [5, n]: coded bits, symbols, lowest value symbol with a code, span of the value
    # symbols with a code, escapes (zeros where not coded)
    plan: np.ndarray


class Segments(NamedTuple):
    """What each block's segment holds and where it goes (the mode choice's result)."""

    mode: np.ndarray  # format.MODE_*, without the per-value bit
    ref_mode: np.ndarray  # the segment header's reference packing
    ref_width: np.ndarray  # the segment header's reference id width
    sent: np.ndarray  # vectors sent: the distinct ones (lz modes), else every row
    skip: np.ndarray  # [n + 1] words left free before each segment (a payload's lead)
    chunk: int  # symbols per Huffman chunk


__all__ = ["Blocks", "Codes", "Dedupe", "Grids", "Segments"]
