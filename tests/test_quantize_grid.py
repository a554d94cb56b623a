"""The per-block grid rule (``quantize.block_bound`` / ``block_grid``) on every backend.

The host codec runs the rule per block inside numba (finite ranges as float64, NaN when a block
has none), the device path over [n_blocks] tensors (float32 ranges, +inf / -inf when none) and
the device's pre-pass over numpy arrays before the data is read. Each must give every block the
same grid, bit for bit, and the grid must satisfy the error model's definitions.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
import torch

from torchrec_lossy.codec import quantize
from torchrec_lossy.codec.bounds import BoundKind
from torchrec_lossy.codec.format import MAX_CENTER, SYMBOL_OFFSET

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


def _blocks() -> list[np.ndarray]:
    """Blocks for every branch: typical, an outlier (median center), empty, no finite value,
    constant, far from 0 (center out of range), huge, subnormal, mixed non-finite, and ranges
    whose float32 arithmetic differs from float64's."""
    rng = np.random.default_rng(20)
    gauss = rng.standard_normal(64).astype(np.float32)
    return [
        gauss * 0.1,
        np.concatenate([gauss, [1e6]]).astype(np.float32),
        np.zeros(0, np.float32),
        np.array([math.nan, math.inf, -math.inf], np.float32),
        np.full(5, 3.0, np.float32),
        (1e6 + gauss).astype(np.float32),
        np.array([1e38, -1e38, 3e38], np.float32),
        (gauss * 1e-40).astype(np.float32),
        np.concatenate([gauss[:7], [math.nan, math.inf, -2.5]]).astype(np.float32),
        np.array([-F32_MAX, F32_MAX], np.float32),  # a span that overflows float32
        np.array([3e38, 2e38], np.float32),  # lo + hi overflows float32, not float64
    ]


_BOUNDS = (0.0, 1e-300, 1e-42, 1e-7, 1e-3, 0.05, 0.3, 0.5, 1e30, 1e300)


def _cases() -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Every block with every bound and every kind."""
    blocks, kinds, bounds = [], [], []
    for x in _blocks():
        for bound in _BOUNDS:
            for kind in BoundKind:
                blocks.append(x)
                kinds.append(int(kind))
                bounds.append(bound)
    return blocks, np.array(kinds, np.int64), np.array(bounds, np.float64)


@numba.njit(nogil=True)
def _rule_numba(
    x: np.ndarray, elem_off: np.ndarray, kinds: np.ndarray, bounds: np.ndarray,
    stochastic: bool, quantization: bool,
) -> tuple:  # fmt: skip
    # As the host codec's kernel: float64 ranges, the median only where the rule centers on it.
    lo, hi = quantize.finite_ranges_kernel(x, elem_off)
    n = kinds.shape[0]
    bound, center = np.empty(n), np.empty(n)
    step, inv_step = np.empty(n, np.float32), np.empty(n, np.float32)
    ok = np.empty(n, np.bool_)
    for b in range(n):
        e0, e1 = elem_off[b], elem_off[b + 1]
        bb = quantize.block_bound(
            kinds[b], bounds[b], lo[b], hi[b], e1 - e0, stochastic, quantization
        )
        use = quantize.uses_median(bb, lo[b], hi[b])
        g = quantize.block_grid(bb, lo[b], hi[b], quantize.finite_median(x[e0:e1]) if use else 0.0)
        bound[b], step[b], inv_step[b], center[b], ok[b] = g
    return bound, step, inv_step, center, ok


def _median_torch(f: torch.Tensor) -> torch.Tensor:
    """np.median of the finite values in float64 (the mean of the middle two), else NaN."""
    s = torch.sort(f[torch.isfinite(f)].double()).values
    n = s.shape[0]
    return (s[(n - 1) // 2] + s[n // 2]) / 2 if n else torch.tensor(math.nan, dtype=torch.float64)


def _rule_torch(blocks, kinds, bounds, stochastic, quantization) -> quantize.BlockGrid:
    # As the device path: float32 ranges (+inf / -inf when none), the median of every block.
    ts = [torch.from_numpy(x) for x in blocks]
    lo = torch.stack([torch.where(torch.isfinite(t), t, math.inf).amin(0, True)[0] if t.numel()
                      else torch.tensor(math.inf) for t in ts])  # fmt: skip
    hi = torch.stack([torch.where(torch.isfinite(t), t, -math.inf).amax(0, True)[0] if t.numel()
                      else torch.tensor(-math.inf) for t in ts])  # fmt: skip
    numel = torch.tensor([t.numel() for t in ts])
    median = torch.stack([_median_torch(t) for t in ts])
    b = quantize.block_bound(
        torch.from_numpy(kinds), torch.from_numpy(bounds), lo, hi, numel, stochastic, quantization
    )
    return quantize.block_grid(b, lo, hi, median)


def _rule_numpy(blocks, kinds, bounds, stochastic, quantization) -> quantize.BlockGrid:
    # Over numpy arrays (the pre-pass's kind), ranges from quantize.finite_ranges_kernel.
    offsets = np.cumsum([0, *(x.shape[0] for x in blocks)])
    lo, hi = quantize.finite_ranges_kernel(np.concatenate(blocks).astype(np.float32), offsets)
    numel = np.array([x.shape[0] for x in blocks])
    median = np.array([np.median(x[np.isfinite(x)].astype(np.float64)) if np.isfinite(x).any()
                       else math.nan for x in blocks])  # fmt: skip
    b = quantize.block_bound(kinds, bounds, lo, hi, numel, stochastic, quantization)
    return quantize.block_grid(b, lo, hi, median)


def _as_numpy(g) -> list[np.ndarray]:
    """The grid's fields as numpy arrays (floats as their bits, so that -0.0 and NaN count)."""
    out = []
    for v in g:
        a = v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        out.append(a.view(np.int64 if a.itemsize == 8 else np.int32) if a.dtype.kind == "f" else a)
    return out


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("quantization", [True, False], ids=["quant", "noquant"])
def test_rule_is_bit_identical_on_numba_torch_numpy(stochastic: bool, quantization: bool) -> None:
    blocks, kinds, bounds = _cases()
    elem_off = np.concatenate([[0], np.cumsum([x.shape[0] for x in blocks])]).astype(np.int64)
    x = np.concatenate(blocks).astype(np.float32)
    host = _rule_numba(x, elem_off, kinds, bounds, stochastic, quantization)
    dev = _rule_torch(blocks, kinds, bounds, stochastic, quantization)
    npy = _rule_numpy(blocks, kinds, bounds, stochastic, quantization)
    names = quantize.BlockGrid._fields
    for name, h, d, n in zip(names, _as_numpy(host), _as_numpy(dev), _as_numpy(npy), strict=True):
        assert h.dtype == d.dtype == n.dtype, name
        bad = np.flatnonzero((h != d) | (h != n))
        assert not bad.size, (name, [(int(kinds[i]), bounds[i], blocks[i][:3]) for i in bad[:3]])
    ok = host[4]
    assert ok.any() == quantization
    if quantization:  # every branch taken: each kind quantizes somewhere, and fails somewhere
        for kind in BoundKind:
            assert ok[kinds == kind].any() and not ok[kinds == kind].all(), kind
    _check_definitions(blocks, kinds, bounds, stochastic, host)


def _check_definitions(blocks, kinds, bounds, stochastic, grid) -> None:
    """The grid against the error model's definitions, block by block (plain Python)."""
    resolved, step, inv_step, center, ok = grid
    for i, x in enumerate(blocks):
        fin = x[np.isfinite(x)]
        kind, v = BoundKind(int(kinds[i])), float(bounds[i])
        if kind == BoundKind.RELATIVE:
            span = float(np.float32(fin.max()) - np.float32(fin.min())) if fin.size else 0.0
            want = v * span if math.isfinite(span) and span > 0 else 0.0
            assert resolved[i] == want, (i, resolved[i], want)
        else:
            assert resolved[i] == v
        if not ok[i]:
            assert step[i] == inv_step[i] == center[i] == 0.0
            continue
        assert x.size and resolved[i] > 0
        if kind == BoundKind.VALUE:  # step 2**-m, the least m with 2**-(m + 1) <= v (m <= 23)
            m = -int(math.log2(step[i]))
            assert step[i] == 2.0**-m and inv_step[i] == 0.0
            assert (m == 23 or 2.0 ** -(m + 1) <= v) and (m == 0 or v < 2.0**-m)
            amax = float(np.abs(fin).max()) if fin.size else 0.0
            assert center[i] == quantize.value_qmax(amax, 23 - m)
            continue
        grid = resolved[i] / 2 if stochastic else resolved[i]
        # the largest float32 at most 2 * grid, normal; inv_step its float32 reciprocal
        assert F32_TINY <= step[i] <= 2 * grid
        assert step[i] == F32_MAX or np.nextafter(step[i], np.float32(np.inf)) > 2 * grid
        assert inv_step[i] == np.float32(1.0 / np.float64(step[i]))
        if not fin.size:
            assert center[i] == 0.0
            continue
        lo, hi = float(fin.min()), float(fin.max())
        fits = hi - lo <= 2 * SYMBOL_OFFSET * min(2 * grid, F32_MAX)
        mid = 0.5 * (lo + hi) if fits else float(np.median(fin.astype(np.float64)))
        assert center[i] == math.floor(float(np.float32(mid) * inv_step[i]) + 0.5)
        assert abs(center[i]) <= MAX_CENTER


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_grid_before_data_covers_every_block(stochastic: bool) -> None:
    """The pre-pass (no data): the same steps where the bound alone decides them, and ``ok``
    wherever the data can make a block ok (the device launches only there)."""
    blocks, kinds, bounds = _cases()
    numel = np.array([x.shape[0] for x in blocks])
    before = quantize.grid_before_data(kinds, bounds, numel, stochastic, True)
    after = _rule_numpy(blocks, kinds, bounds, stochastic, True)
    assert not (after.ok & ~before.ok).any()
    same = after.ok & (kinds != BoundKind.RELATIVE)
    assert np.array_equal(before.step[same], after.step[same])
    assert np.array_equal(before.inv_step[same], after.inv_step[same])
    # a relative bound too small for any range's step is known before the data
    tiny = (kinds == BoundKind.RELATIVE) & (bounds == 1e-300) & (numel > 0)
    assert tiny.any() and not before.ok[tiny].any()
    assert before.ok[(kinds == BoundKind.RELATIVE) & (bounds == 1e-3) & (numel > 0)].all()
