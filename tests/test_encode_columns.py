"""The compressor's column record (``codec/encode_columns.py``): one int64 tensor, block ``b``
in row ``b``, field ``F`` in column ``F``, float fields stored as their exact bits, fields not
given at their defaults."""

from __future__ import annotations

import math

import pytest
import torch

from torchrec_lossy.codec import encode_columns as ec


def test_fields_are_rows_in_order_with_exact_float_bits() -> None:
    step = torch.tensor([0.1, -(2.0**-149), math.inf], dtype=torch.float32)  # a negative denormal
    bound = torch.tensor([1e-300, -0.0, math.nan], dtype=torch.float64)
    dim = torch.tensor([3, 0, 7])
    rec = ec.encode_columns(3, torch.device("cpu"), step=step, bound=bound, dim=dim)
    assert rec.cols.shape == (3, ec.N_FIELDS) and rec.n_blocks == 3
    assert len(set(ec.FIELDS)) == ec.N_FIELDS
    for f, name in enumerate(ec.FIELDS):
        assert getattr(ec, name.upper()) == f, name
    assert torch.equal(rec.floats(ec.STEP_BITS).view(torch.int32), step.view(torch.int32))
    assert torch.equal(rec.floats(ec.BOUND_BITS).view(torch.int64), bound.view(torch.int64))
    flat = rec.cols.reshape(-1)  # what a kernel reads at cols_ptr + b * N_FIELDS + F
    assert [int(flat[b * ec.N_FIELDS + ec.DIM]) for b in range(3)] == [3, 0, 7]
    # A float32 field's bits are sign-extended: a kernel reads them back through int32.
    assert int(rec.column(ec.STEP_BITS)[1]) == int(step.view(torch.int32)[1]) < 0


def test_defaults_and_empty_record() -> None:
    rec = ec.encode_columns(2, torch.device("cpu"), center=torch.tensor([5, 6]))
    assert rec.column(ec.SR_KEY).tolist() == [-1, -1]  # round to nearest
    assert rec.column(ec.VALUE).tolist() == [0, 0] and rec.column(ec.CENTER).tolist() == [5, 6]
    empty = ec.encode_columns(0, torch.device("cpu"))
    assert empty.cols.shape == (1, ec.N_FIELDS) and empty.column(ec.DIM).numel() == 0


def test_wrong_names_and_float_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown encode fields"):
        ec.encode_columns(1, torch.device("cpu"), steps=torch.zeros(1))
    with pytest.raises(ValueError, match=r"step is torch\.float64: pass it as torch\.float32"):
        ec.encode_columns(1, torch.device("cpu"), step=torch.zeros(1, dtype=torch.float64))
