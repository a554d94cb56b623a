"""Stochastic rounding in the quantize stage: the bound, unbiasedness, determinism, backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchrec_lossy.codec import compress_with_stats, decompress, quantize
from torchrec_lossy.config import CodecConfig, ConfigError
from torchrec_lossy.kernels import quantize_ref


def _sr(seed: int, backend: str = "cpu") -> CodecConfig:
    return CodecConfig(rounding="stochastic", seed=seed, backend=backend)


def test_hash_twins_agree() -> None:
    """The Python, torch and numba hashes draw the same u (the Triton twin is checked below)."""
    key = quantize.stochastic_key(123, 4)
    u = quantize_ref.uniform_reference(1000, key)
    expected = torch.tensor([(quantize.mix32(i ^ key) >> 8) * 2.0**-24 for i in range(1000)])
    assert torch.equal(u, expected.float())
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.03  # roughly uniform
    assert quantize.stochastic_key(123, 4) != quantize.stochastic_key(123, 5)
    assert quantize.stochastic_key(123, 4) != quantize.stochastic_key(124, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bound_holds_adversarially(dtype: torch.dtype) -> None:
    """Values on, just beside and halfway between grid points of step = bound, at the edges of
    the alphabet, tiny and huge: every finite element decodes within the bound, over many seeds."""
    bound = 0.0125
    grid = torch.arange(-2100, 2100, dtype=torch.float64) * bound
    eps = torch.tensor([0.0, 1e-9, -1e-9, 0.5 * bound, 0.999999 * bound, -0.999999 * bound])
    x = (grid[:, None] + eps[None, :]).reshape(-1, 8).to(dtype)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    for seed in range(6):
        payload, stats = compress_with_stats([x], [bound], _sr(seed))
        (y,) = decompress(payload)
        fin = torch.isfinite(x)
        err = (y.double() - x.double()).abs()[fin]
        assert float(err.max()) <= bound, (seed, float(err.max()))
        assert stats[0].max_error <= bound
        # Non-finite values travel exactly (escapes).
        assert torch.equal(y[~fin].double().nan_to_num(), x[~fin].double().nan_to_num())
        assert stats[0].mode in ("quant", "quant+lz")


def test_unbiased_and_nearest_is_not() -> None:
    """Averaged over seeds, stochastic reconstructions converge to x; round to nearest keeps a
    systematic error on values off its grid."""
    bound = 0.1
    x = torch.full((64, 16), 0.37)  # 0.37 / 0.1 = 3.7 steps: SR gives 0.3 or 0.4
    x[0, 0] = 0.0  # keep a range so the center is well defined
    acc = torch.zeros_like(x, dtype=torch.float64)
    n = 40
    for seed in range(n):
        (y,) = decompress(compress_with_stats([x], [bound], _sr(seed))[0])
        near = torch.minimum((y[1:] - 0.3).abs(), (y[1:] - 0.4).abs())
        assert float(near.max()) < 1e-6
        acc += y.double()
    mean_err = float((acc / n - x.double())[1:].mean())
    # Per element the draw has std 0.1 * sqrt(0.21) ~ 0.046; over 63 * 16 * 40 draws ~ 2.3e-4.
    assert abs(mean_err) < 1.5e-3
    (yn,) = decompress(compress_with_stats([x], [bound], CodecConfig())[0])
    assert abs(float((yn.double() - x.double())[1:].mean())) > 0.02  # nearest: biased


def test_deterministic_and_seed_dependent() -> None:
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
    a = compress_with_stats([x, x], [0.05, 0.05], _sr(7))[0]
    b = compress_with_stats([x, x], [0.05, 0.05], _sr(7))[0]
    c = compress_with_stats([x, x], [0.05, 0.05], _sr(8))[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    y0, y1 = decompress(a)
    assert not torch.equal(y0, y1)  # blocks draw with different keys


def test_zero_rows_stay_exact_and_cheap() -> None:
    """Zeros round to themselves (frac 0), so all-zero rows are identical vectors that the
    vector-LZ stage sends once: a mostly-zero gradient block costs little more than its rows."""
    g = torch.zeros(4096, 64)
    g[:64] = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    payload, stats = compress_with_stats([g], [0.01 * float(g.max() - g.min())], _sr(3))
    (y,) = decompress(payload)
    assert torch.equal(y[64:], g[64:])
    assert stats[0].mode == "quant+lz"
    dense = compress_with_stats([g[:64].clone()], [stats[0].bound], _sr(3))[1][0].wire_bytes
    assert stats[0].wire_bytes < dense + 4096 * 2  # at most ~2 bytes per zero row


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backends_byte_identical(backend: str) -> None:
    gen = torch.Generator().manual_seed(4)
    blocks = [torch.randn(40, 16, generator=gen), torch.randn(7, 8, generator=gen).half()]
    blocks.append(torch.zeros(0, 4))
    bounds = [0.02, 0.05, 0.1]
    cpu = compress_with_stats(blocks, bounds, _sr(11))[0]
    other = compress_with_stats(blocks, bounds, _sr(11, backend))[0]
    assert torch.equal(cpu, other)
    for y, x, eb in zip(decompress(other), blocks, bounds, strict=True):
        assert bool(((y.double() - x.double()).abs() <= eb).all())


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match=r"codec\.rounding"):
        CodecConfig(rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"codec\.seed"):
        CodecConfig(seed=1.5)  # type: ignore[arg-type]


def test_grid_bound() -> None:
    assert quantize.grid_bound(0.2, False) == 0.2
    assert quantize.grid_bound(0.2, True) == 0.1
    assert np.float32(quantize.quant_params(0.1, np.zeros(4, np.float32)).step) <= 0.2
