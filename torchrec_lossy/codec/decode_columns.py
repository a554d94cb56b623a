"""The decoder's per-block column record: one int64 tensor the decode launchers share (no triton).

:class:`DecodeColumns` is an int64 ``[N_FIELDS, stride]`` tensor (``stride >= n_blocks + 1``)
that ``device_decompress`` uploads once; a kernel reads field ``F`` of block ``b`` at
``cols_ptr + F * stride + b`` (``decode_columns.F``). A row has ``n_blocks`` entries but the bases
(``*_BASE`` but ``ID_BASE``: ``n_blocks + 1``, the total last; ``FIXED_BASE``: ``n_fixed + 1``)
and the block lists ``FIXED_BLOCKS`` / ``FLAGGED_BLOCKS`` / ``QUANT_BLOCKS`` (``n_fixed`` /
``n_flagged`` / ``n_quant``). docs/kernels.md, 'Device-resident decompress'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

# The fields in row order; the names are ``device_decompress``'s per-block arrays.
FIELDS = (
    "out_base",  # first output element of each block, and the total
    "sym_base",  # first symbol of each block in the concatenated streams, and the total
    "chunk_base",  # first global chunk of each block, and the total
    "fixed_base",  # first global row of each REFS_FIXED block, and the total
    "fixed_blocks",  # the REFS_FIXED blocks
    "flagged_blocks",  # the REFS_FLAGGED blocks
    "quant_blocks",  # the blocks with a Huffman stream
    "mode",  # descriptor mode
    "dtype",  # dtype code (1: 32-bit elements, 2 / 3: 16-bit)
    "dim",  # columns
    "rows",  # rows
    "n_unique",  # vectors sent (rows for modes without references)
    "src_off",  # word offset of the raw values / distinct vectors (raw, lz)
    "id_base",  # first vector id of each LZ block
    "ref_off",  # word offset of the references
    "ref_words",  # words of the references
    "width",  # bits per reference id
    "step_bits",  # float32 bits of the quantization step
    "center",  # code of the block's midpoint
    "cb_off",  # word offset of the wire codebook
    "sym_lo",  # codebook's first symbol
    "sym_count",  # codebook's symbols
    "esc_len",  # code length of the escape symbol
    "table_idx",  # decode table of each block with a stream
    "ct_off",  # word offset of the chunk table
    "bs_off",  # word offset of the bitstream
    "bs_words",  # words of the bitstream
    "chunk_symbols",  # symbols per chunk
    "esc_pos_off",  # word offset of the escape positions
    "esc_val_off",  # word offset of the escaped values
    "n_esc",  # escapes listed
    "has_stream",  # 1 for blocks with a Huffman stream
    "out_off",  # first output word (each block word-aligned)
    # The status rows, written by the kernels and only raised / lowered: flags start at 0, the
    # first-failure rows (fail, esc_bad) at launch_tables.NO_FAILURE.
    "refs_bad",  # status: 1 where the vector references are invalid
    "codebook_bad",  # status: 1 where the wire codebook is invalid
    "table_bad",  # status: 1 where the chunk table is invalid
    "fail",  # status: 8 * position - DECODE_* of the first failing symbol
    "esc_bad",  # status: the first misplaced escape
)
N_FIELDS = len(FIELDS)
(
    OUT_BASE, SYM_BASE, CHUNK_BASE, FIXED_BASE, FIXED_BLOCKS, FLAGGED_BLOCKS, QUANT_BLOCKS, MODE,
    DTYPE, DIM, ROWS, N_UNIQUE, SRC_OFF, ID_BASE, REF_OFF, REF_WORDS, WIDTH, STEP_BITS, CENTER,
    CB_OFF, SYM_LO, SYM_COUNT, ESC_LEN, TABLE_IDX, CT_OFF, BS_OFF, BS_WORDS, CHUNK_SYMBOLS,
    ESC_POS_OFF, ESC_VAL_OFF, N_ESC, HAS_STREAM, OUT_OFF, REFS_BAD, CODEBOOK_BAD, TABLE_BAD, FAIL,
    ESC_BAD,
) = range(N_FIELDS)  # fmt: skip


class DecodeColumns(NamedTuple):
    """Every block's decode fields on the device: one int64 ``[N_FIELDS, stride]`` tensor.

    Attributes:
        cols: int64 [N_FIELDS, stride] (``stride >= n_blocks + 1``): row ``F`` is field ``F``.
        n_blocks: Blocks.
        n_fixed: REFS_FIXED blocks (entries of ``FIXED_BLOCKS``).
        n_flagged: REFS_FLAGGED blocks (entries of ``FLAGGED_BLOCKS``).
        n_quant: Blocks with a stream (entries of ``QUANT_BLOCKS``).
    """

    cols: torch.Tensor
    n_blocks: int
    n_fixed: int
    n_flagged: int
    n_quant: int

    @property
    def stride(self) -> int:
        """Entries per row (what a kernel adds per field)."""
        return self.cols.shape[1]

    def column(self, field: int) -> torch.Tensor:
        """Field ``field``'s entries (a view of its row, so status rows can be written through it).

        Args:
            field: A field index (``MODE``, ``SYM_BASE``, ...).

        Returns:
            int64 1-D view of the row's valid entries (see the module docstring for lengths).
        """
        lengths = {
            FIXED_BASE: self.n_fixed + 1,
            FIXED_BLOCKS: self.n_fixed,
            FLAGGED_BLOCKS: self.n_flagged,
            QUANT_BLOCKS: self.n_quant,
        }
        n = self.n_blocks + (field in (OUT_BASE, SYM_BASE, CHUNK_BASE))
        return self.cols[field, : lengths.get(field, n)]


def stack_columns(field: Callable[[str], np.ndarray], n_blocks: int) -> np.ndarray:
    """The host side of :class:`DecodeColumns`: every field's array as one row, zero-padded.

    Args:
        field: The host int64 array of a field, by its name in :data:`FIELDS`.
        n_blocks: Blocks.

    Returns:
        int64 [N_FIELDS, n_blocks + 1].
    """
    out = np.zeros((N_FIELDS, n_blocks + 1), np.int64)
    for f, name in enumerate(FIELDS):
        values = field(name)
        out[f, : values.shape[0]] = values
    return out
