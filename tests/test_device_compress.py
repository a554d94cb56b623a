"""The device-resident, batched compress against the CPU path: same bytes, same stats, one sync.

Without a CUDA device the kernels run on CPU tensors in the Triton interpreter (conftest.py
switches it on before triton is imported). Sizes are small; larger cases carry
``@pytest.mark.slow``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from helpers import (
    DEVICE,
    DTYPES,
    INTERPRETER_WARNINGS,
    SPECIALS,
    bound_for,
    cuda_syncs_only_in_to_host,
    make_block,
)

from torchrec_lossy.codec import device_compress, host_sync, huffman, pipeline
from torchrec_lossy.codec import encode_columns as ec
from torchrec_lossy.codec import quantize as cpu_quantize
from torchrec_lossy.codec.bounds import BoundKind
from torchrec_lossy.codec.format import ALPHABET_SIZE, ESCAPE_SYMBOL
from torchrec_lossy.codec.outliers import OUTLIER_OCTAVES, inlier_ranges_kernel
from torchrec_lossy.config import CodecConfig
from torchrec_lossy.kernels import codebook, quantize_ref
from torchrec_lossy.kernels import quantize as quantize_kernels

pytestmark = INTERPRETER_WARNINGS

REPO = Path(__file__).resolve().parents[1]
BOUND_KINDS = ["zero", "tiny", "rel0.01", "rel0.05", "huge"]


# Both wire formats: the packed one has its own coding stages (device_packed_compress).
FORMATS = ["entropy", "packed"]


def _blocks(kind: str, bound_kind: str) -> tuple[list[torch.Tensor], list[float]]:
    """Odd shapes (0, 1, 7 and 33 rows; dims 1, 3 and 16) in every dtype, one payload."""
    blocks = [
        make_block(rows, dim, dtype, kind, seed=100 * rows + 10 * dim + i)
        for rows in (0, 1, 7, 33)
        for dim in (1, 3, 16)
        for i, dtype in enumerate(DTYPES)
    ]
    return blocks, [bound_for(b, bound_kind) for b in blocks]


def _check(
    blocks: list[torch.Tensor], bounds: list[float], config: CodecConfig
) -> list[pipeline.BlockStats]:
    """compress_device's payload and stats equal the CPU backend's; returns the stats."""
    want, want_stats = pipeline.compress_with_stats(
        blocks, bounds, dataclasses.replace(config, backend="cpu")
    )
    got, got_stats = device_compress.compress_device([b.to(DEVICE) for b in blocks], bounds, config)
    assert got.device.type == DEVICE.type and got.dtype == torch.uint8
    assert torch.equal(got.cpu(), want), "payload bytes differ"
    assert got_stats == want_stats
    return got_stats


# ------------------------------------------------------------------------------------------------
# Codebook kernels
# ------------------------------------------------------------------------------------------------


def _histograms() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    fib = [1, 1]
    for _ in range(40):
        fib.append(fib[-1] + fib[-2])
    out = []
    for kind in range(10):
        h = np.zeros(ALPHABET_SIZE, np.int64)
        if kind == 1:
            h[17] = 5  # one symbol: length 1
        elif kind == 2:
            h[[3, ESCAPE_SYMBOL]] = 1
        elif kind == 3:
            h[:40] = rng.integers(1, 5, 40)  # many ties
        elif kind == 4:
            h[:30] = 2 ** np.arange(30)  # a 29-deep tree: JPEG length limiting
        elif kind == 5:
            h[100:142] = fib  # the deepest tree 42 symbols make
        elif kind == 6:
            h[rng.choice(4095, 120, replace=False)] = rng.integers(1, 3, 120)
            h[ESCAPE_SYMBOL] = 9
        elif kind >= 7:
            h[2000 : 2000 + 8 * kind] = np.exp(rng.normal(0, 4, 8 * kind)).astype(np.int64) + 1
        out.append(h)
    return out


def test_code_lengths_and_codes_match_cpu() -> None:
    hists = _histograms()
    lengths = codebook.code_lengths(torch.from_numpy(np.stack(hists)).to(DEVICE))
    codes = codebook.canonical_codes(lengths)
    assert max(int(huffman.code_lengths_kernel(h).max()) for h in hists) == 12
    for i, h in enumerate(hists):
        want = huffman.code_lengths_kernel(h)
        np.testing.assert_array_equal(lengths[i].cpu().numpy(), want, err_msg=f"hist {i}")
        np.testing.assert_array_equal(
            codes[i].cpu().numpy(), huffman.canonical_codes_kernel(want).astype(np.int64)
        )


def test_code_lengths_of_no_histogram() -> None:
    empty = torch.zeros(0, ALPHABET_SIZE, dtype=torch.int64, device=DEVICE)
    assert codebook.code_lengths(empty).shape == (0, ALPHABET_SIZE)


# ------------------------------------------------------------------------------------------------
# Payloads
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "bound_kind"),
    [
        ("adversarial", "rel0.01"),
        ("adversarial", "zero"),
        ("repeat", "rel0.05"),
        ("repeat", "huge"),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_payload_byte_identical(kind: str, bound_kind: str, fmt: str) -> None:
    blocks, bounds = _blocks(kind, bound_kind)
    _check(blocks, bounds, CodecConfig(huffman_chunk_symbols=64, format=fmt))


@pytest.mark.parametrize(
    ("kind", "bound_kind"), [("adversarial", "rel0.01"), ("repeat", "zero"), ("repeat", "rel0.05")]
)
def test_backends_byte_identical(kind: str, bound_kind: str) -> None:
    """cpu, reference (the device orchestration over the kernels' torch twins) and triton give
    the same payload and stats, and each decodes every payload to the same bits."""
    blocks, bounds = _blocks(kind, bound_kind)
    backends = ("cpu", "reference", "triton")
    got = {
        b: pipeline.compress_with_stats(
            [x.to(DEVICE) for x in blocks], bounds, CodecConfig(backend=b, huffman_chunk_symbols=64)
        )
        for b in backends
    }
    want, want_stats = got["cpu"]
    for b in backends:
        assert torch.equal(got[b][0].cpu(), want.cpu()), f"{b}: payload bytes differ"
        assert got[b][1] == want_stats, b
    want_out = pipeline.decompress(want.cpu(), backend="cpu")
    for b in backends:
        out = pipeline.decompress(want.to(DEVICE), backend=b)
        assert len(out) == len(want_out)
        for i, (x, y) in enumerate(zip(out, want_out, strict=True)):
            assert x.dtype == y.dtype and x.shape == y.shape, (b, i)
            assert torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8)), (b, i)


def test_payload_modes_covered() -> None:
    """The payload tests' blocks reach every mode (raw, lz, quant, quant+lz)."""
    modes = set()
    config = CodecConfig(backend="cpu", huffman_chunk_symbols=64)
    for kind in ("adversarial", "repeat"):
        for bound_kind in BOUND_KINDS:
            blocks, bounds = _blocks(kind, bound_kind)
            modes |= {s.mode for s in pipeline.compress_with_stats(blocks, bounds, config)[1]}
    assert modes == {"raw", "lz", "quant", "quant+lz"}


@pytest.mark.slow
@pytest.mark.parametrize("bound_kind", BOUND_KINDS)
@pytest.mark.parametrize("kind", ["adversarial", "repeat"])
def test_payload_byte_identical_all_bounds(kind: str, bound_kind: str) -> None:
    blocks, bounds = _blocks(kind, bound_kind)
    _check(blocks, bounds, CodecConfig(huffman_chunk_symbols=64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_mode_and_config(fmt: str) -> None:
    """One payload mixing every mode; the same blocks without LZ, without quantization, and with
    a chunk size that is not a power of two."""
    blocks = [
        make_block(40, 8, torch.float32, "repeat", seed=1),  # quant+lz
        make_block(40, 8, torch.float16, "mild", seed=2),  # quant
        make_block(40, 8, torch.bfloat16, "repeat", seed=3),  # lz (bound 0)
        make_block(5, 3, torch.float32, "adversarial", seed=4),  # raw
        make_block(0, 4, torch.float16, "repeat", seed=5),  # empty
        torch.zeros(3, 0),  # zero-width
    ]
    bounds = [bound_for(blocks[0], "rel0.05"), bound_for(blocks[1], "rel0.01"), 0.0, 0.0, 0.1, 0.1]
    stats = _check(blocks, bounds, CodecConfig(huffman_chunk_symbols=64, format=fmt))
    assert [s.mode for s in stats[:4]] == ["quant+lz", "quant", "lz", "raw"]
    for config in (
        CodecConfig(huffman_chunk_symbols=96, enable_lz=False, format=fmt),
        CodecConfig(huffman_chunk_symbols=64, enable_quantization=False, format=fmt),
        CodecConfig(huffman_chunk_symbols=64, rounding="stochastic", seed=5, format=fmt),
    ):
        _check(blocks, bounds, config)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantization_parameters_edge_cases(fmt: str) -> None:
    """The median rule (an outlier stretches the range), blocks without a finite value, a step
    too small for float32 and a center too far from 0."""
    gen = torch.Generator().manual_seed(0)
    outlier = torch.randn(16, 4, generator=gen) * 0.01
    outlier[3, 1] = 1e6  # range >> the alphabet: centered on the median
    even = torch.randn(8, 4, generator=gen) * 0.01  # even count of finite values
    even[0, 0] = float("nan")
    even[1, 1] = -1e7
    nonfinite = torch.tensor([[float("nan"), float("inf")], [float("-inf"), float("nan")]])
    far = torch.full((4, 4), 3e4) + torch.randn(4, 4, generator=gen)
    blocks = [outlier, even, nonfinite, far, torch.randn(4, 4, generator=gen)]
    bounds = [1e-3, 1e-3, 0.5, 1e-4, 1e-45]
    config = CodecConfig(huffman_chunk_symbols=64, format=fmt)
    _check(blocks, bounds, config)
    specials = torch.tensor(SPECIALS * 3).reshape(-1, 3)
    for dtype in DTYPES:
        _check([specials.to(dtype)], [1e-2], config)


def _block_grids(
    impl: Callable, blocks: list[torch.Tensor], bounds: list[float], kinds: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_grids`` (Triton or twin) over 1-D blocks (rows = elements, dim 1).

    Returns:
        (its [n_blocks, GRID_STATS] output, the record with the grid written).
    """
    x = torch.cat(blocks)
    numel = torch.tensor([b.numel() for b in blocks])
    cols = ec.encode_columns(
        len(blocks), x.device, elem_off=torch.cumsum(numel, 0) - numel, dim=torch.ones_like(numel)
    )
    bound = torch.tensor(bounds, dtype=torch.float64)
    kind = torch.tensor(kinds)
    rule = ec.GridRule(
        kind, bound.view(torch.int64), torch.ones_like(kind), OUTLIER_OCTAVES, False, True,
        (cpu_quantize.block_bound, cpu_quantize.uses_median, cpu_quantize.block_grid),
    )  # fmt: skip
    return impl(x, cols, numel, rule), cols.cols[: len(blocks)]


def _stat(out: torch.Tensor, column: int) -> np.ndarray:
    """A float64-bits column of ``block_grids``' output."""
    return out[:, column].contiguous().view(torch.float64).numpy()


def test_block_grids_take_the_host_ranges() -> None:
    """``quantize.block_grids`` (one program per block) and its twin give the host's finite
    range (``finite_ranges_kernel``: order keys, so -0.0 below +0.0), inlier range
    (``inlier_ranges_kernel``: a 3e38 outlier among small values is left out) and finite count:
    NaN / Inf, subnormals, signed zeros, a block with no finite value, an empty block, more than
    one tile."""
    gen = torch.Generator().manual_seed(11)
    outlier = torch.randn(300, generator=gen)
    outlier[17] = 3e38
    blocks = [
        torch.randn(37, generator=gen),
        outlier,
        torch.tensor([-0.0, 0.0, 0.0, -0.0]),
        torch.tensor([float("nan"), 1.0, float("inf"), -2.0, float("-inf")]),
        torch.tensor([1e-40, -1e-42, 1e-45]),
        torch.tensor([float("nan"), float("inf")]),
        torch.zeros(0),
        torch.randn(2500, generator=gen) * 1e3,
    ]
    x = torch.cat(blocks)
    ends = np.append(np.cumsum([0] + [b.numel() for b in blocks])[:-1], x.numel())
    h_lo, h_hi = cpu_quantize.finite_ranges_kernel(x.numpy(), ends)
    i_lo, i_hi = inlier_ranges_kernel(x.numpy(), ends, h_lo, h_hi, np.ones(len(blocks), bool))
    none = np.isnan(h_lo)
    want = [np.where(none, np.inf, h_lo), np.where(none, -np.inf, h_hi)]
    want += [np.where(none, np.inf, i_lo), np.where(none, -np.inf, i_hi)]
    n_fin = [int(torch.isfinite(b).sum()) for b in blocks]
    assert i_hi[1] < 1e30 and h_hi[1] == np.float32(3e38)  # the outlier is left out
    columns = (ec.GRID_LO, ec.GRID_HI, ec.GRID_ILO, ec.GRID_IHI)
    kinds = [int(BoundKind.ABSOLUTE)] * len(blocks)
    for impl in (quantize_kernels.block_grids, quantize_ref.block_grids):
        out, _ = _block_grids(impl, blocks, [1e-3] * len(blocks), kinds)
        assert out[:, ec.GRID_N_FIN].tolist() == n_fin
        for column, w in zip(columns, want, strict=True):
            # Bit equality (signed zeros included).
            got = _stat(out, column).astype(np.float32)
            assert got.view(np.int32).tolist() == w.astype(np.float32).view(np.int32).tolist()


def test_block_grids_select_the_median_without_sorting() -> None:
    """Where the rule centers on the median (``quantize.uses_median``: the range does not fit
    the alphabet), the radix select (``quantize.block_grids``) equals ``np.median`` of the
    block's finite values and its sorting twin: odd and even counts, negative values, ties,
    zeros of both signs, NaN / Inf, subnormals, one finite value, none, and blocks whose rule
    does not use it (0.0); and the grids written equal the host rule's (``block_grid``) under
    each bound kind."""
    gen = torch.Generator().manual_seed(7)
    blocks = [
        torch.randn(37, generator=gen),
        torch.randn(64, generator=gen) * 1e6,
        torch.tensor([3.0, -1.0, 3.0, 3.0, -1.0, 2.0]),
        torch.tensor([-0.0, 0.0, -0.0, 0.0, 5.0, -5.0]),
        torch.tensor([float("nan"), 1.0, float("inf"), -2.0, float("-inf")]),
        torch.tensor([1e-40, -1e-42, 3e38, -3e38, 1e-45]),
        torch.tensor([float("nan"), 7.5]),
        torch.tensor([float("nan"), float("inf")]),
        torch.randn(2500, generator=gen),  # more than one tile
        torch.randn(9, generator=gen),  # fits: the midpoint
    ]
    bounds = [1e-9] * (len(blocks) - 1) + [1.0]
    for kind in (BoundKind.ABSOLUTE, BoundKind.RELATIVE, BoundKind.VALUE):
        kinds = [int(kind)] * len(blocks)
        outs = [_block_grids(impl, blocks, bounds, kinds)
                for impl in (quantize_kernels.block_grids, quantize_ref.block_grids)]  # fmt: skip
        (got, rec), (twin, twin_rec) = outs
        assert torch.equal(got, twin) and torch.equal(rec, twin_rec), kind
        lo, hi = _stat(got, ec.GRID_LO), _stat(got, ec.GRID_HI)
        numel = np.array([b.numel() for b in blocks])
        rel = kind == BoundKind.RELATIVE  # its bound is taken over the inlier range
        b = cpu_quantize.block_bound(
            np.array(kinds), np.array(bounds), _stat(got, ec.GRID_ILO) if rel else lo,
            _stat(got, ec.GRID_IHI) if rel else hi, numel, False, True,
        )  # fmt: skip
        need = cpu_quantize.uses_median(b, lo, hi)
        if kind == BoundKind.ABSOLUTE:
            assert need[:6].all() and need[8] and not need[6] and not need[7] and not need[9]
        want = np.array([
            float(np.median(x[torch.isfinite(x)].double().numpy())) if need[i] else 0.0
            for i, x in enumerate(blocks)
        ])  # fmt: skip
        assert _stat(got, ec.GRID_MEDIAN).tolist() == want.tolist(), kind
        g = cpu_quantize.block_grid(b, lo, hi, want)
        assert got[:, ec.GRID_OK].tolist() == g.ok.astype(int).tolist()
        assert rec[:, ec.STEP_BITS].tolist() == g.step.astype(np.float32).view(np.int32).tolist()
        inv = g.inv_step.astype(np.float32).view(np.int32).tolist()
        assert rec[:, ec.INV_STEP_BITS].tolist() == inv
        assert rec[:, ec.CENTER].tolist() == g.center.astype(np.int64).tolist()
        assert rec[:, ec.BOUND_BITS].tolist() == g.bound.view(np.int64).tolist()


def _random_payload(seed: int) -> tuple[list[torch.Tensor], list[float], CodecConfig]:
    """1-8 blocks of random shapes (zero sizes included), dtypes, data kinds, repetition and
    bounds, and a random config."""
    rng = np.random.default_rng(seed)
    blocks, bounds = [], []
    for i in range(int(rng.integers(1, 9))):
        rows = int(rng.choice([0, 1, 2, 3, 5, 17, 40, 70]))
        dim = int(rng.choice([0, 1, 2, 5, 16, 33]))
        dtype = DTYPES[int(rng.integers(3))]
        kind = str(rng.choice(["adversarial", "mild", "repeat"]))
        b = torch.zeros(rows, 0, dtype=dtype) if dim == 0 else make_block(rows, dim, dtype, kind, i)
        if rows and dim and rng.random() < 0.3:  # few distinct rows
            b = b[torch.from_numpy(rng.integers(0, max(1, rows // 4), rows))].clone()
        blocks.append(b)
        bound_kind = str(rng.choice(BOUND_KINDS))
        bounds.append(0.0 if rows * dim == 0 else bound_for(b, bound_kind))
    config = CodecConfig(
        huffman_chunk_symbols=int(rng.choice([64, 96, 128, 2048])),
        enable_lz=bool(rng.random() < 0.8),
        enable_quantization=bool(rng.random() < 0.85),
    )
    return blocks, bounds, config


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fmt", FORMATS)
def test_random_payloads(seed: int, fmt: str) -> None:
    blocks, bounds, config = _random_payload(seed)
    _check(blocks, bounds, dataclasses.replace(config, format=fmt))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 60))
def test_random_payloads_more(seed: int) -> None:
    _check(*_random_payload(seed))


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_blocks(fmt: str) -> None:
    _check([], [], CodecConfig(format=fmt))


def test_pipeline_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend="triton" (and CUDA blocks with "auto") compress through compress_device."""
    calls: list[int] = []
    real = device_compress.compress_device

    def spy(*args: object) -> tuple[torch.Tensor, list[pipeline.BlockStats]]:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(device_compress, "compress_device", spy)
    blocks = [make_block(9, 4, torch.float32, "repeat", seed=9).to(DEVICE)]
    bounds = [1e-3]
    got = pipeline.compress(blocks, bounds, CodecConfig(backend="triton"))
    assert calls == [1]
    want = pipeline.compress([b.cpu() for b in blocks], bounds, CodecConfig(backend="cpu"))
    assert torch.equal(got.cpu(), want)
    pipeline.compress(blocks, bounds, CodecConfig(backend="auto"))
    assert len(calls) == (2 if DEVICE.type == "cuda" else 1)


# ------------------------------------------------------------------------------------------------
# Host syncs
# ------------------------------------------------------------------------------------------------

# Every way a tensor's value reaches Python.
_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _ours(filename: str) -> bool:
    path = Path(filename).resolve()
    return REPO in path.parents and ".venv" not in path.parts and "tests" not in path.parts


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every tensor-to-Python read made from the project's own code."""
    seen: list[str] = []

    def wrap(name: str, orig: Callable[..., object]) -> Callable[..., object]:
        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            frame = sys._getframe(1)
            if _ours(frame.f_code.co_filename):
                seen.append(f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}")
            return orig(self, *args, **kwargs)

        return read

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    return seen


@pytest.mark.parametrize("fmt", FORMATS)
def test_exactly_one_host_transfer(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """One compress reads one tensor back: the ``host_sync.to_host`` call (one
    ``.cpu()`` copy, then ``.numpy()`` of that host copy), and nothing else of ours reads a
    tensor's value (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``, ``int()``, ...)."""
    blocks, bounds = _blocks("repeat", "rel0.05")
    blocks = [b.to(DEVICE) for b in blocks]
    config = CodecConfig(huffman_chunk_symbols=64, format=fmt)
    device_compress.compress_device(blocks, bounds, config)  # compile / warm up
    before = host_sync.host_reads("compress")
    seen = _count_reads(monkeypatch)
    payload, _ = device_compress.compress_device(blocks, bounds, config)
    monkeypatch.undo()
    assert host_sync.host_reads("compress") - before == 1
    assert [s.split(" at ")[0] for s in seen] == ["cpu", "numpy"], seen
    assert all("host_sync.py" in s for s in seen), seen
    assert payload.numel() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: sync debug mode")
def test_one_cuda_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, torch's sync debug mode raises on any synchronizing call but the one read."""
    blocks, bounds = _blocks("adversarial", "rel0.01")
    blocks = [b.cuda() for b in blocks]
    config = CodecConfig(huffman_chunk_symbols=64)
    device_compress.compress_device(blocks, bounds, config)  # compile / warm up
    with cuda_syncs_only_in_to_host(monkeypatch):
        device_compress.compress_device(blocks, bounds, config)


# ------------------------------------------------------------------------------------------------
# Larger cases
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_payload_realistic_traffic() -> None:
    from torchrec_lossy.traffic import TrafficSpec, paper_traffic

    spec = TrafficSpec(batch_rows=128)
    blocks, bounds = paper_traffic(spec)
    _check(blocks, bounds, CodecConfig())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_payload_larger_blocks(dtype: torch.dtype) -> None:
    blocks = [
        make_block(rows, dim, dtype, kind, seed=rows + dim)
        for rows, dim in [(257, 64), (1000, 8), (129, 33)]
        for kind in ("adversarial", "repeat")
    ]
    bounds = [bound_for(b, k) for b, k in zip(blocks, ["rel0.01", "tiny"] * 3, strict=True)]
    _check(blocks, bounds, CodecConfig())
