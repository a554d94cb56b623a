"""Finite outliers of a relative-bound block (codec/outliers.py, issue 32 "Bad input").

A relative bound is taken over the block's finite range without its outliers (elements whose
float32 exponent is at least ``OUTLIER_OCTAVES`` above the block's lower median exponent), so
one huge finite row no longer makes the bound useless for every other row; the outliers travel
verbatim. The rule is checked against a sorted (numpy) statement of its definition, on the host
kernel and its torch twin, and through every compress path, which must write the same bytes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchrec_lossy.codec import (
    BoundKind,
    CodecConfig,
    compress_groups,
    compress_with_stats,
    decompress,
    decompress_groups,
)
from torchrec_lossy.codec.outliers import (
    OUTLIER_OCTAVES,
    inlier_ranges_kernel,
    inlier_ranges_torch,
)
from torchrec_lossy.codec.quantize import finite_ranges_kernel


def definition(x: np.ndarray) -> tuple[float, float]:
    """The rule as docs/format.md states it, with a sort: (lo, hi) of the finite non-outliers."""
    x = x.astype(np.float32).reshape(-1)
    e = (x.view(np.int32) >> 23) & 0xFF
    fin = np.isfinite(x)
    normal = np.sort(e[fin & (e >= 1)])
    keep = fin
    if normal.size:
        median = normal[(normal.size + 1) // 2 - 1]  # lower median: ceil(n / 2)-th smallest
        keep = fin & (e < median + OUTLIER_OCTAVES)
    if not keep.any():
        return math.nan, math.nan
    return float(x[keep].min()), float(x[keep].max())


def adversarial_blocks() -> dict[str, torch.Tensor]:
    """Blocks a gradient or an embedding batch can be: spans of decades, one huge row, zeros,
    specials, subnormals."""
    g = torch.Generator().manual_seed(32)
    small = torch.rand(64, 8, generator=g) * 6 - 3  # |x| < 3
    issue = small.clone()
    issue[17] = 3e38  # the issue's column-wise block
    negative = small.clone()
    negative[3] = -2e30
    decades = torch.randn(40, 16, generator=g) * torch.logspace(-5, 5, 40)[:, None]
    one_huge = torch.randn(32, 16, generator=g)
    one_huge[0] *= 1e9
    zeros = torch.zeros(16, 8)
    mostly_zero = torch.zeros(16, 8)
    mostly_zero[2] = torch.randn(8, generator=g)
    mostly_zero[9, 0] = 1e12
    specials = torch.randn(20, 8, generator=g)
    specials[1, 1], specials[2, 2], specials[3, 3], specials[4] = (
        math.nan,
        math.inf,
        -math.inf,
        1e20,
    )
    subnormal = torch.full((8, 4), 1e-40)
    subnormal[0, 0] = 1.0
    all_special = torch.tensor([[math.nan, math.inf], [-math.inf, math.nan]])
    halves = torch.randn(10, 8, generator=g)
    halves[4:] *= 1e6  # most rows at 1e6: the median is theirs, no element is an outlier
    return {
        "issue": issue,
        "negative": negative,
        "decades": decades,
        "one_huge": one_huge,
        "zeros": zeros,
        "mostly_zero": mostly_zero,
        "specials": specials,
        "subnormal": subnormal,
        "all_special": all_special,
        "halves": halves,
        "plain": small,
    }


BLOCKS = adversarial_blocks()


def host_ranges(blocks: list[torch.Tensor]) -> list[tuple[float, float]]:
    x = torch.cat([b.reshape(-1) for b in blocks]).numpy()
    off = np.cumsum([0] + [b.numel() for b in blocks]).astype(np.int64)
    lo, hi = finite_ranges_kernel(x, off)
    ilo, ihi = inlier_ranges_kernel(x, off, lo, hi, np.ones(len(blocks), np.bool_))
    return list(zip(ilo.tolist(), ihi.tolist(), strict=True))


def torch_ranges(blocks: list[torch.Tensor]) -> list[tuple[float, float]]:
    x = torch.cat([b.reshape(-1) for b in blocks])
    numel = torch.tensor([b.numel() for b in blocks])
    e_blk = torch.repeat_interleave(torch.arange(len(blocks)), numel)
    lo, hi = inlier_ranges_torch(x, e_blk, numel)
    none = lo > hi  # no finite element: the host kernel's NaN
    lo, hi = lo.double().masked_fill(none, math.nan), hi.double().masked_fill(none, math.nan)
    return list(zip(lo.tolist(), hi.tolist(), strict=True))


def test_rule_matches_its_definition_on_every_backend() -> None:
    names = list(BLOCKS)
    want = [definition(BLOCKS[n].numpy()) for n in names]
    for got in (host_ranges(list(BLOCKS.values())), torch_ranges(list(BLOCKS.values()))):
        for n, w, h in zip(names, want, got, strict=True):
            np.testing.assert_equal(h, w, err_msg=n)
    # The rule does what it is for: the issue's 3e38 row and the 1e9 / 1e12 / 1e20 values are
    # outliers, a spread of ten decades over rows and most of the block at 1e6 are not.
    assert want[names.index("issue")][1] < 3
    assert want[names.index("one_huge")][1] < 1e3
    assert want[names.index("mostly_zero")][1] < 1e3
    assert want[names.index("specials")][1] < 1e3
    assert want[names.index("decades")][1] > 1e4
    assert want[names.index("halves")][1] > 1e5


def test_host_kernel_skips_blocks_it_is_not_asked_about() -> None:
    x = BLOCKS["issue"].reshape(-1).numpy()
    off = np.array([0, x.shape[0]], np.int64)
    lo, hi = finite_ranges_kernel(x, off)
    ilo, ihi = inlier_ranges_kernel(x, off, lo, hi, np.zeros(1, np.bool_))
    assert (ilo[0], ihi[0]) == (lo[0], hi[0])
    assert hi[0] == float(np.float32(3e38))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_issue_case_keeps_ordinary_values_within_their_own_range(dtype: torch.dtype) -> None:
    x = BLOCKS["issue"].clone()
    if dtype != torch.float32:
        x *= 1e-3  # float16's largest value (6e4) is 2**16 above the median exponent
        x[17] = 6e4 if dtype == torch.float16 else 3e38
    x = x.to(dtype)
    inl = torch.ones(x.shape[0], dtype=torch.bool)
    inl[17] = False
    r = 0.03
    xd = x.double()
    own = r * float(xd[inl].max() - xd[inl].min())
    payloads = []
    for backend in ("cpu", "reference"):
        out = compress_groups([[x]], [[r]], CodecConfig(backend=backend), kinds=True)
        payloads.append(out.buffer.numpy().tobytes())
        assert out.stats[0][0].bound == pytest.approx(own, rel=1e-6)
        y = decompress_groups(out.buffer, out.sizes)[0][0][0]
        assert torch.equal(y[17], x[17])  # the outlier row travels verbatim
        err = (y.double() - xd)[inl].abs().max().item()
        assert err <= out.stats[0][0].bound, backend
    payload, stats = compress_with_stats([x], [r], CodecConfig(), [BoundKind.RELATIVE])
    assert payload.numpy().tobytes() == payloads[0] == payloads[1]
    assert stats[0].bound == pytest.approx(own, rel=1e-6)
    # Before the rule, the bound was 0.03 of 3e38 (9e36): the same block without its outlier
    # row gets the same bound as the block with it now.
    alone, alone_stats = compress_with_stats([x[inl]], [r], CodecConfig(), [BoundKind.RELATIVE])
    assert alone_stats[0].bound == stats[0].bound
    assert decompress(alone)[0].shape == x[inl].shape


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_element_within_its_bound_on_adversarial_blocks(rounding: str) -> None:
    names = list(BLOCKS)
    blocks = [BLOCKS[n] for n in names]
    r = 0.01
    payloads = []
    for backend in ("cpu", "reference"):
        cfg = CodecConfig(backend=backend, rounding=rounding, seed=5)
        out = compress_groups([blocks], [[r] * len(blocks)], cfg, kinds=True)
        payloads.append(out.buffer.numpy().tobytes())
        decoded = decompress_groups(out.buffer, out.sizes)[0][0]
        for n, x, y, st in zip(names, blocks, decoded, out.stats[0], strict=True):
            lo, hi = definition(x.numpy())
            span = float(np.float32(hi) - np.float32(lo)) if lo <= hi else 0.0  # float32
            assert st.bound == pytest.approx(r * span, rel=1e-9, abs=0), n
            fin = torch.isfinite(x)
            assert torch.equal(x[~fin].isnan(), y[~fin].isnan()), n
            assert torch.equal(x[torch.isinf(x)], y[torch.isinf(x)]), n
            err = (y.double() - x.double()).abs()[fin]
            assert bool((err <= st.bound).all()), (n, err.max().item(), st.bound)
    assert payloads[0] == payloads[1]


def test_blocks_without_outliers_keep_their_whole_range() -> None:
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randn(50, 16, generator=g) * s for s in (1e-3, 1.0, 1e4)]
    blocks.append(torch.randn(30, 8, generator=g) * torch.logspace(-4, 0, 8))  # 4 decades
    x = torch.cat([b.reshape(-1) for b in blocks]).numpy()
    off = np.cumsum([0] + [b.numel() for b in blocks]).astype(np.int64)
    lo, hi = finite_ranges_kernel(x, off)
    assert host_ranges(blocks) == list(zip(lo.tolist(), hi.tolist(), strict=True))


def test_triton_backend_writes_the_same_bytes() -> None:
    """The device path's grid stage is torch ops on every backend; its Triton kernels then see
    the resolved bound (the interpreter on CPU, small sizes)."""
    pytest.importorskip("triton", reason="triton is not installed")
    x = BLOCKS["issue"][:16, :4].clone()
    x[5] = 3e38
    y = BLOCKS["one_huge"][:8, :4]
    blocks, fractions = [[x, y]], [[0.03, 0.01]]
    got = {
        b: compress_groups(blocks, fractions, CodecConfig(backend=b), kinds=True)
        for b in ("cpu", "triton")
    }
    assert got["triton"].buffer.numpy().tobytes() == got["cpu"].buffer.numpy().tobytes()
    assert got["triton"].stats[0][0].bound == got["cpu"].stats[0][0].bound < 1.0
