"""The packed encode launches' per-block record (``kernels/packed.py``: ``stream_widths``,
``put_data``; their twins in ``kernels/packed_ref.py``).

One int64 ``[n_blocks, N_FIELDS]`` tensor, field ``F`` of block ``b`` at ``b * N_FIELDS + F``,
stacked once per launch by ``codec/device_packed_compress.py``: the kernels take one pointer
instead of a dozen per-block tensors. Fields a launch does not read are 0.
"""

from __future__ import annotations

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
N_FIELDS = 15

__all__ = [
    "CODES_AT",
    "DIM",
    "ELEM_OFF",
    "ESCB_AT",
    "ESCP_AT",
    "ITEMSIZE",
    "N_FIELDS",
    "N_SYM",
    "Q_BASE",
    "Q_LZ",
    "ROW_OFF",
    "R_AT",
    "R_BASE",
    "R_LZ",
    "R_N",
    "TABLE_AT",
]
