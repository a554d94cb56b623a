"""The packed encode launches' per-block records (``kernels/packed.py``: ``stream_plan``,
``put_data``; their twins in ``kernels/packed_ref.py``).

The data launch's record: one int64 ``[n_blocks, N_FIELDS]`` tensor, field ``F`` of block
``b`` at ``b * N_FIELDS + F``, stacked by ``codec/device_packed_compress.py``: the kernel takes
one pointer instead of a dozen per-block tensors. Fields it does not read are 0. The plan
launch's inputs (:class:`PlanInputs`) and outputs (the ``PLAN_FIELDS`` rows, ``HEAD_WORDS``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ELEM_OFF = 0  # the block's first element in the flat layout
ROW_OFF = 1  # its first row
DIM = 2  # its columns (at least 1)
ITEMSIZE = 3  # bytes per raw element (4, or 2 for fp16 / bf16)
N_SYM = 4  # values of its packed stream (0: no stream)
Q_LZ = 5  # 1 where the stream is the distinct rows (quantized dedupe), else every row
Q_BASE = 6  # the quantized dedupe's first occurrences before the block (its distinct rows' rows)
TABLE_AT = 7  # word of its width bytes
CODES_AT = 8  # word of its codes
ESCP_AT = 9  # word of its escape positions
ESCB_AT = 10  # word of its escaped values
R_N = 11  # raw elements to copy: every element (raw), the distinct rows' (lz), else 0
R_LZ = 12  # 1 where they are the distinct rows of the raw-bits dedupe
R_BASE = 13  # that dedupe's first occurrences before the block
R_AT = 14  # word where they go
REFS_AT = 15  # word of its references
REF_ROWS = 16  # rows whose references it sends (every row where it sends them, else 0)
REF_QLZ = 17  # 1 where they are the quantized dedupe's ids (quant+lz), else the raw bits'
REF_MODE = 18  # their packing (format.REFS_FIXED / REFS_FLAGGED)
REF_WIDTH = 19  # bits per id
N_FIELDS = 20

# The plan launch's output (``packed.stream_plan``): int64 [PLAN_FIELDS, n_blocks], field-major
# (row ``F`` of it is field ``F`` of every block), every block's mode and what it sends (the
# host's ``_packed_plan``, ``size_model``'s choice and the segment's section sizes).
MODE = 0  # MODE_* (without MODE_VALUE)
IS_Q = 1  # 1 where a packed (quantized) mode
IS_QLZ = 2  # 1 where quant+lz
IS_LZ = 3  # 1 where lossless lz
HAS_REFS = 4  # 1 where it sends references (quant+lz, lz)
N_SENT = 5  # vectors sent
N_ESCAPES = 6  # escapes sent (0 unless packed)
PLAN_REF_MODE = 7  # references' packing (0 without references)
PLAN_REF_WIDTH = 8  # format.ref_width(n_sent)
REFS_WORDS = 9  # words of the references
ESC_WORDS = 10  # words of the escape positions and values
SEG_WORDS = 11  # words of its segment
N_GROUPS = 12  # groups of its packed stream (0 unless packed)
SENT_SYM = 13  # values of its packed stream (0 unless packed)
STREAM_LZ = 14  # 1 where its stream is its distinct rows (the quantized dedupe's)
# Its descriptor's and segment header's words (below; the header's only where it has one):
# S0 their sum, T their sum weighted by 2 j + 1 for word j of the record (both wrapping).
DESC_S0 = 15
DESC_T = 16
HEAD_S0 = 17
HEAD_T = 18
PLAN_FIELDS = 19
# The plan launch's third output: int64 [n_blocks, HEAD_WORDS], each block's descriptor words,
# then its segment header's (``format.DESCRIPTOR`` / ``SEGMENT_HEADER``; the checksum field 0).
HEAD_WORDS = 14


class PlanInputs(NamedTuple):
    """What the plan launch reads per block besides the symbols: int64 [n_blocks] tensors
    (``first_slot`` [n_blocks + 1], ``grid`` [n_blocks, GRID_STATS])."""

    rows: torch.Tensor
    dim: torch.Tensor
    itemsize: torch.Tensor
    elem_off: torch.Tensor
    row_off: torch.Tensor
    lz_allowed: torch.Tensor  # 1 where vector-LZ may run
    raw_words: torch.Tensor  # words of its raw segment
    first_slot: torch.Tensor  # its first group slot, then the slot count
    grid: torch.Tensor  # the grid launch's output (``encode_columns.GRID_OK``: quantized)
    nu_q: torch.Tensor  # distinct vectors of its symbols
    nu_r: torch.Tensor  # distinct vectors of its raw bits
    q_base: torch.Tensor  # the symbols' dedupe's first occurrences before it
    enc: torch.Tensor  # the encode record, its grid written (``encode_columns``)


class PutDedupes(NamedTuple):
    """Both dedupes' per-row tables the data launch reads (``device_compress.Dedupe``)."""

    q_rows: torch.Tensor  # int64: the symbols' dedupe's first occurrences' rows
    r_rows: torch.Tensor  # the raw bits' dedupe's
    q_ids: torch.Tensor  # int64 per row: its distinct vector's id in its block (symbols)
    r_ids: torch.Tensor  # (raw bits)
    q_rank: torch.Tensor  # int64 [n_rows + 1]: first occurrences before each row (+ a constant)
    r_rank: torch.Tensor


__all__ = [
    "CODES_AT",
    "DESC_S0",
    "DESC_T",
    "DIM",
    "ELEM_OFF",
    "ESCB_AT",
    "ESCP_AT",
    "ESC_WORDS",
    "HAS_REFS",
    "HEAD_S0",
    "HEAD_T",
    "HEAD_WORDS",
    "IS_LZ",
    "IS_Q",
    "IS_QLZ",
    "ITEMSIZE",
    "MODE",
    "N_ESCAPES",
    "N_FIELDS",
    "N_GROUPS",
    "N_SENT",
    "N_SYM",
    "PLAN_FIELDS",
    "PLAN_REF_MODE",
    "PLAN_REF_WIDTH",
    "Q_BASE",
    "Q_LZ",
    "REFS_AT",
    "REFS_WORDS",
    "REF_MODE",
    "REF_QLZ",
    "REF_ROWS",
    "REF_WIDTH",
    "ROW_OFF",
    "R_AT",
    "R_BASE",
    "R_LZ",
    "R_N",
    "SEG_WORDS",
    "SENT_SYM",
    "STREAM_LZ",
    "TABLE_AT",
    "PlanInputs",
    "PutDedupes",
]
