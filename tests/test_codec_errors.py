"""Input validation: every bad argument raises ValueError naming the culprit and the fix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchrec_lossy.codec import CodecError, compress, compress_with_stats, decompress


def good(rows: int = 4, dim: int = 3) -> torch.Tensor:
    return torch.randn(rows, dim)


@pytest.mark.parametrize(
    ("bad", "fix"),
    [
        (torch.randn(2, 3, 4), "reshape"),
        (torch.randn(6), "reshape"),
        (torch.tensor(1.5), "reshape"),
        (torch.ones(4, 3, dtype=torch.int32), "float32"),
        (torch.ones(4, 3, dtype=torch.int64), "float32"),
        (torch.ones(4, 3, dtype=torch.uint8), "float32"),
        (torch.ones(4, 3, dtype=torch.bool), "float32"),
        (torch.randn(4, 3, dtype=torch.float64), "float32"),
        (torch.randn(4, 3, dtype=torch.complex64), "float32"),
        (np.ones((4, 3), np.float32), "torch.Tensor"),
        ([[1.0, 2.0]], "torch.Tensor"),
    ],
    ids=[
        "3d",
        "1d",
        "0d",
        "int32",
        "int64",
        "uint8",
        "bool",
        "float64",
        "complex64",
        "numpy",
        "list",
    ],
)
@pytest.mark.parametrize("fn", [compress, compress_with_stats])
def test_bad_block_names_its_index_and_the_fix(fn, bad, fix):
    with pytest.raises(ValueError, match=r"block 1\b") as info:
        fn([good(), bad, good()], [0.1, 0.1, 0.1])
    assert fix in str(info.value)
    assert not isinstance(info.value, CodecError)


@pytest.mark.parametrize(
    "bound", [-1e-3, -0.0 - 1e-300, math.nan, math.inf, -math.inf, "abc", None, [0.1]]
)
def test_bad_bound_names_its_index_and_the_fix(bound):
    with pytest.raises(ValueError, match=r"error bound 2\b") as info:
        compress([good(), good(), good()], [0.1, 0.0, bound])
    msg = str(info.value)
    assert ">= 0" in msg, msg


def test_negative_zero_bound_is_lossless_not_an_error():
    x = torch.randn(8, 4)
    out = decompress(compress([x], [-0.0]))[0]
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize(("n_blocks", "n_bounds"), [(2, 1), (1, 2), (0, 1), (3, 0)])
def test_mismatched_bound_count(n_blocks, n_bounds):
    with pytest.raises(ValueError, match=rf"{n_blocks} blocks but {n_bounds} error bounds") as info:
        compress([good() for _ in range(n_blocks)], [0.1] * n_bounds)
    assert "one bound per block" in str(info.value)


def test_single_tensor_instead_of_a_list():
    with pytest.raises(ValueError, match="single tensor") as info:
        compress(good(), [0.1])
    assert "[tensor]" in str(info.value)


def test_numeric_bound_types_are_accepted():
    x = good(16, 8)
    for b in (0.1, 1, np.float32(0.1), np.float64(0.1), torch.tensor(0.1)):
        out = decompress(compress([x], [b]))[0]
        assert float((out - x).abs().max()) <= float(b)


def test_bounds_may_be_any_sequence():
    x = good(16, 8)
    for bounds in ((0.1,), np.array([0.1]), torch.tensor([0.1])):
        out = decompress(compress([x], bounds))[0]
        assert float((out - x).abs().max()) <= 0.1


def test_no_blocks_is_a_valid_empty_payload():
    payload, stats = compress_with_stats([], [])
    assert stats == []
    assert payload.numel() == 32
    assert decompress(payload) == []


@pytest.mark.parametrize(
    "payload",
    [
        torch.zeros(64, dtype=torch.int8),
        torch.zeros(64, dtype=torch.int32),
        torch.zeros(64, dtype=torch.float32),
        torch.zeros(8, 8, dtype=torch.uint8),
        torch.zeros((), dtype=torch.uint8),
        b"\x00" * 64,
        np.zeros(64, np.uint8),
        None,
    ],
    ids=["int8", "int32", "float32", "2d", "0d", "bytes", "numpy", "None"],
)
def test_decompress_rejects_non_payloads(payload):
    with pytest.raises(CodecError, match=r"1-D torch\.uint8"):
        decompress(payload)


def test_decompress_of_a_valid_payload_reshaped_2d_is_rejected():
    payload = compress([good()], [0.1])
    with pytest.raises(CodecError, match=r"1-D torch\.uint8"):
        decompress(payload.reshape(-1, 4))
    with pytest.raises(CodecError, match=r"1-D torch\.uint8"):
        decompress(payload.view(torch.int8))


def test_decompress_of_a_payload_view_at_an_odd_offset():
    """A payload slice that is not 4-byte aligned in memory still decodes."""
    x = good(32, 8)
    payload = compress([x], [0.05])
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), payload])[1:]
    assert shifted.data_ptr() % 4 != 0
    out = decompress(shifted)[0]
    assert float((out - x).abs().max()) <= 0.05


def test_max_elements_limit():
    payload = compress([good(10, 10)], [0.1])
    assert decompress(payload, max_elements=100)[0].shape == (10, 10)
    with pytest.raises(CodecError, match="max_elements"):
        decompress(payload, max_elements=99)


def test_blocks_on_different_devices():
    with pytest.raises(ValueError, match=r"block 1 is on meta but block 0 is on cpu") as info:
        compress([good(), torch.empty(4, 3, device="meta")], [0.1, 0.1])
    assert "one device" in str(info.value)


@pytest.mark.parametrize("bad", [[[1.0, 2.0]], None, 3.0], ids=["list", "None", "float"])
def test_bad_first_block_names_its_index(bad):
    """Expected ValueError "block 0 is a list: pass a torch.Tensor"; got AttributeError
    "'list' object has no attribute 'device'"."""
    with pytest.raises(ValueError, match=r"block 0 is a \w+: pass a torch\.Tensor"):
        compress([bad, good()], [0.1, 0.1])


def test_bound_too_large_for_a_float():
    """float(10**400) raises OverflowError, which _validate_inputs does not catch."""
    with pytest.raises(ValueError, match=r"error bound 0\b"):
        compress([good()], [10**400])
