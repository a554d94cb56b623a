"""The decoder's column record (``codec/decode_columns.py``): one int64 tensor, field ``F`` in
row ``F``, each field's valid entries a view (kernels and twins write status rows in place)."""

from __future__ import annotations

import numpy as np
import torch

from torchrec_lossy.codec import decode_columns as dc


def _record() -> tuple[dc.DecodeColumns, dict[str, np.ndarray]]:
    """Three blocks: two REFS_FIXED, one REFS_FLAGGED, two quantized; every other field distinct."""
    n = 3
    arrays = {name: np.arange(n, dtype=np.int64) + 10 * f for f, name in enumerate(dc.FIELDS)}
    for name in ("out_base", "sym_base", "chunk_base"):
        arrays[name] = np.arange(n + 1, dtype=np.int64) + 100
    arrays["fixed_base"] = np.array([0, 4, 9], np.int64)
    arrays["fixed_blocks"] = np.array([0, 2], np.int64)
    arrays["flagged_blocks"] = np.array([1], np.int64)
    arrays["quant_blocks"] = np.array([0, 1], np.int64)
    host = dc.stack_columns(arrays.__getitem__, n)
    return dc.DecodeColumns(torch.from_numpy(host), n, 2, 1, 2), arrays


def test_fields_are_rows_in_order() -> None:
    rec, arrays = _record()
    assert rec.cols.shape == (dc.N_FIELDS, 4) and rec.stride == 4
    assert len(set(dc.FIELDS)) == dc.N_FIELDS
    for f, name in enumerate(dc.FIELDS):
        assert getattr(dc, name.upper()) == f, name
        assert rec.column(f).tolist() == arrays[name].tolist(), name
        flat = rec.cols.reshape(-1)  # what a kernel reads at cols_ptr + F * stride + b
        assert flat[f * rec.stride : f * rec.stride + len(arrays[name])].tolist() == (
            arrays[name].tolist()
        )


def test_columns_are_views_of_the_record() -> None:
    rec, _ = _record()
    rec.column(dc.FAIL)[1] = -7
    rec.column(dc.REFS_BAD).fill_(1)
    assert int(rec.cols[dc.FAIL, 1]) == -7
    assert rec.cols[dc.REFS_BAD, :3].tolist() == [1] * 3
    assert int(rec.cols[dc.REFS_BAD, 3]) == 0  # the padding entry is not a block's
