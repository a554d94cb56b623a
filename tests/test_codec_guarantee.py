"""The codec's guarantee on adversarial blocks (DESIGN §4).

Every finite element decodes within its block's absolute bound (checked in float64), NaN keeps its
exact bits, +-Inf is exact, bound 0 is bit-exact, and shapes, dtypes and devices are preserved,
whatever the data: specials, huge and subnormal values, degenerate shapes, far-from-zero blocks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_lossy.codec import CodecConfig, compress, compress_with_stats, decompress
from torchrec_lossy.codec.format import BITS_DTYPES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
F32_MAX = float(np.finfo(np.float32).max)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor (int32 for float32, int16 for the 16-bit types)."""
    return t.contiguous().view(BITS_DTYPES[t.dtype])


def from_bits(bits: list[int], dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    """A tensor of ``dtype`` whose elements have the given (unsigned) bit patterns."""
    np_bits = np.array(bits, dtype=np.uint32 if dtype == torch.float32 else np.uint16)
    return torch.from_numpy(np_bits.reshape(shape)).view(dtype)


def finite_range(x: torch.Tensor) -> float:
    """max - min of the finite elements in float64 (0 when there are none)."""
    xd = x.double()
    fin = xd[torch.isfinite(xd)]
    return float(fin.max() - fin.min()) if fin.numel() else 0.0


def assert_within_bound(x: torch.Tensor, out: torch.Tensor, bound: float, what: str = "") -> None:
    """The guarantee, element by element."""
    assert out.shape == x.shape, f"{what}: shape {tuple(out.shape)} != {tuple(x.shape)}"
    assert out.dtype == x.dtype, f"{what}: dtype {out.dtype} != {x.dtype}"
    assert out.device == x.device, f"{what}: device {out.device} != {x.device}"
    xb, ob = bits_of(x), bits_of(out)
    if bound == 0:
        diff = (xb != ob).nonzero()
        assert diff.numel() == 0, f"{what}: bound 0 but bits differ at {diff[:5].tolist()}"
    nan = torch.isnan(x)
    assert torch.equal(xb[nan], ob[nan]), f"{what}: NaN bit patterns changed"
    inf = torch.isinf(x)
    assert torch.equal(xb[inf], ob[inf]), f"{what}: an infinity changed"
    fin = torch.isfinite(x)
    err = (x.double() - out.double()).abs()
    bad = fin & ~(err <= bound)  # ~(<=) also catches a finite element decoded to NaN
    if bool(bad.any()):
        i = tuple(bad.nonzero()[0].tolist())
        pytest.fail(
            f"{what}: element {i}: x={float(x[i])!r} decoded {float(out[i])!r}, "
            f"|err|={float(err[i])!r} > bound {bound!r}"
        )


def roundtrip(blocks: list[torch.Tensor], bounds: list[float]) -> None:
    payload, stats = compress_with_stats(blocks, bounds)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    out = decompress(payload)
    assert len(out) == len(blocks) == len(stats)
    for i, (x, y, b, s) in enumerate(zip(blocks, out, bounds, stats, strict=True)):
        assert_within_bound(x, y, b, f"block {i} ({s.mode})")
        fin = torch.isfinite(x)
        actual = float((x.double() - y.double()).abs()[fin].max()) if bool(fin.any()) else 0.0
        # The reported max error is the one the decoder actually produces.
        assert s.max_error == actual, f"block {i}: stats.max_error {s.max_error} != {actual}"
        if s.mode in ("raw", "lz"):
            assert actual == 0.0


# ---------------------------------------------------------------------------------------------
# Adversarial blocks


def _nan_bits(dtype: torch.dtype) -> list[int]:
    if dtype == torch.float32:  # quiet, negative quiet, signalling, max payloads
        return [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC0BEEF]
    if dtype == torch.float16:
        return [0x7E00, 0xFE00, 0x7C01, 0x7FFF, 0xFFFF, 0x7D5A]
    return [0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFFFF, 0x7FA5]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _case(name: str, dtype: torch.dtype) -> torch.Tensor:
    g = _gen(sum(map(ord, name)))
    fi = torch.finfo(dtype)
    if name == "nan":
        x = torch.randn(6, 8, generator=g).to(dtype)
        bx = bits_of(x).clone()
        nan = torch.tensor(_nan_bits(dtype), dtype=torch.int64)
        nan = nan - (1 << (8 * x.element_size())) * (nan >= 1 << (8 * x.element_size() - 1))
        bx.view(-1)[torch.arange(0, 48, 4)[: nan.numel()]] = nan.to(bx.dtype)
        bx.view(-1)[torch.arange(2, 48, 4)[: nan.numel()]] = nan.to(bx.dtype)
        return bx.view(dtype)
    if name == "all_nan":
        return from_bits((_nan_bits(dtype) * 4)[:24], dtype, (4, 6))
    if name == "inf":
        x = torch.randn(6, 8, generator=g)
        x[0, 0], x[1, 3], x[5, 7], x[2, 2] = math.inf, -math.inf, math.inf, -math.inf
        return x.to(dtype)
    if name == "all_inf":
        return torch.tensor([[math.inf, -math.inf] * 4] * 3).to(dtype)
    if name == "huge":
        x = torch.randn(8, 8, generator=g).double()
        x[0, :4] = torch.tensor([1e30, -1e30, fi.max, -fi.max], dtype=torch.float64)
        x[3, 5], x[7, 7] = fi.max, -fi.max
        return x.to(dtype)
    if name == "float_max_only":
        return torch.tensor([[fi.max, -fi.max, fi.max], [fi.max, fi.max, -fi.max]]).to(dtype)
    if name == "denormal":
        tiny = float(fi.smallest_normal)
        sub = [tiny * k / 64 for k in range(1, 33)] + [tiny, -tiny, tiny / 3, -tiny / 7]
        return torch.tensor(sub, dtype=torch.float64).reshape(4, 9).to(dtype)
    if name == "denormal_and_one":
        x = torch.full((4, 8), float(fi.smallest_normal) / 8, dtype=torch.float64)
        x[1, 1], x[2, 5] = 1.0, -float(fi.smallest_normal) / 3
        return x.to(dtype)
    if name == "negzero":
        x = torch.zeros(5, 6)
        x[::2] = -0.0
        x[1, 1] = 0.25
        return x.to(dtype)
    if name == "all_negzero":
        return torch.full((3, 5), -0.0).to(dtype)
    if name == "constant":
        return torch.full((16, 12), 0.37).to(dtype)
    if name == "empty":
        return torch.zeros(0, 8, dtype=dtype)
    if name == "zero_dim":
        return torch.zeros(5, 0, dtype=dtype)
    if name == "empty_empty":
        return torch.zeros(0, 0, dtype=dtype)
    if name == "one_row":
        return torch.randn(1, 16, generator=g).to(dtype)
    if name == "one_element":
        return torch.tensor([[-3.25]]).to(dtype)
    if name.startswith("dim"):
        return torch.randn(37, int(name[3:]), generator=g).to(dtype)
    if name == "identical_rows":
        return torch.randn(1, 24, generator=g).to(dtype).repeat(50, 1)
    if name == "repeated_rows":
        base = torch.randn(5, 16, generator=g).to(dtype)
        return base[torch.randint(0, 5, (300,), generator=g)]
    if name == "repeated_rows_with_specials":
        base = torch.randn(4, 8, generator=g)
        base[0, 0], base[1, 1], base[2, 2] = math.nan, math.inf, 1e30
        base = base.to(dtype)
        return base[torch.randint(0, 4, (200,), generator=g)]
    if name == "far_from_zero":
        return (1e6 + 0.01 * torch.randn(64, 8, generator=g, dtype=torch.float64)).to(dtype)
    if name == "far_negative":
        return (-3e4 + torch.randn(64, 8, generator=g, dtype=torch.float64)).to(dtype)
    if name == "outliers":  # a Gaussian bulk whose outliers leave the 4095-symbol alphabet
        x = torch.randn(64, 16, generator=g)
        x.view(-1)[torch.randint(0, 1024, (40,), generator=g)] *= 1e4
        return x.to(dtype)
    if name == "wide_uniform":
        return (torch.rand(32, 32, generator=g) * 2000 - 1000).to(dtype)
    if name == "random_bits":
        width = 8 * torch.empty(0, dtype=dtype).element_size()
        hi = 1 << width
        raw = torch.randint(0, hi, (24, 9), generator=g, dtype=torch.int64)
        raw = raw - hi * (raw >= hi // 2)
        return raw.to(BITS_DTYPES[dtype]).view(dtype)
    if name == "mixed":
        x = torch.randn(40, 12, generator=g, dtype=torch.float64) * 3
        flat = x.view(-1)
        specials = [
            math.nan,
            math.inf,
            -math.inf,
            1e30,
            -1e30,
            float(fi.max),
            float(fi.smallest_normal) / 4,
            -0.0,
            0.0,
            1e6,
            -1e-30,
        ]
        idx = torch.randperm(flat.numel(), generator=g)[: 3 * len(specials)]
        for k, i in enumerate(idx.tolist()):
            flat[i] = specials[k % len(specials)]
        x[7] = x[3]
        x[20] = x[3]
        return x.to(dtype)
    raise AssertionError(name)


CASES = [
    "nan",
    "all_nan",
    "inf",
    "all_inf",
    "huge",
    "float_max_only",
    "denormal",
    "denormal_and_one",
    "negzero",
    "all_negzero",
    "constant",
    "empty",
    "zero_dim",
    "empty_empty",
    "one_row",
    "one_element",
    "dim1",
    "dim3",
    "dim7",
    "dim33",
    "identical_rows",
    "repeated_rows",
    "repeated_rows_with_specials",
    "far_from_zero",
    "far_negative",
    "outliers",
    "wide_uniform",
    "random_bits",
    "mixed",
]
# (label, absolute bound or None, relative bound or None)
BOUNDS = [
    ("0", 0.0, None),
    ("1e-30", 1e-30, None),
    ("1e-7", 1e-7, None),
    ("1e-3", 1e-3, None),
    ("rel0.01", None, 0.01),
    ("rel0.05", None, 0.05),
    ("1.0", 1.0, None),
    ("1e30", 1e30, None),
    ("1e38", 1e38, None),
    ("2e38", 2e38, None),  # 2 * bound overflows float32
    ("fmax", F32_MAX, None),
]


def _bound(x: torch.Tensor, absolute: float | None, relative: float | None) -> float:
    return absolute if absolute is not None else relative * finite_range(x)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_adversarial_block(dtype, name):
    x = _case(name, dtype)
    for label, absolute, relative in BOUNDS:
        bound = _bound(x, absolute, relative)
        try:
            roundtrip([x], [bound])
        except (Exception, pytest.fail.Exception) as e:  # name the bound that failed
            raise AssertionError(f"{name} {dtype} bound {label} = {bound!r}: {e!r}") from e


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("label", "absolute", "relative"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_all_adversarial_blocks_in_one_payload(dtype, label, absolute, relative):
    blocks = [_case(n, dtype) for n in CASES]
    roundtrip(blocks, [_bound(x, absolute, relative) for x in blocks])


def test_mixed_dtypes_and_bounds_in_one_payload():
    blocks, bounds = [], []
    for k, name in enumerate(CASES):
        x = _case(name, DTYPES[k % 3])
        _, ab, rel = BOUNDS[k % len(BOUNDS)]
        blocks.append(x)
        bounds.append(_bound(x, ab, rel))
    roundtrip(blocks, bounds)


def test_every_mode_is_reached_by_the_catalogue():
    """The adversarial catalogue exercises the four encodings, so the checks above cover them."""
    modes = set()
    for dtype in DTYPES:
        blocks = [_case(n, dtype) for n in CASES]
        for _, ab, rel in BOUNDS:
            stats = compress_with_stats(blocks, [_bound(x, ab, rel) for x in blocks])[1]
            modes.update(s.mode for s in stats)
    assert modes == {"raw", "lz", "quant", "quant+lz"}


@pytest.mark.parametrize(
    ("value", "bound"),
    [(1e38, 1e-7), (10.0, 1e-38), (1e10, 1e-30), (F32_MAX, 1e-30), (-1e35, 1e-3), (-F32_MAX, 1.0)],
)
def test_midpoint_far_from_zero_in_steps(value, bound):
    """float32(mid) / step overflows float32: the encoder must fall back, not raise.

    Regression: quant_params used to take ``math.floor`` of the infinite float32 product and raise
    ``OverflowError: cannot convert float infinity to integer``.
    """
    x = torch.full((4, 4), value)
    x[1, 1] = value * 0.999
    roundtrip([x], [bound])


def test_bound_zero_is_lossless_for_random_bits():
    for dtype in DTYPES:
        x = _case("random_bits", dtype)
        out = decompress(compress([x], [0.0]))[0]
        assert torch.equal(bits_of(out), bits_of(x))


def test_input_tensors_are_not_modified():
    x = _case("mixed", torch.float32)
    before = bits_of(x).clone()
    compress([x], [0.1])
    assert torch.equal(bits_of(x), before)


def test_non_contiguous_blocks():
    base = torch.randn(40, 32, generator=_gen(3))
    for x in (base.t(), base[:, ::3], base[::2, 5:9]):
        assert not x.is_contiguous()
        roundtrip([x], [0.01])


@pytest.mark.parametrize("fmt", ["entropy", "packed"])
def test_blocks_read_in_place_give_the_copies_bytes(fmt: str) -> None:
    """Contiguous float32 blocks are read where they lie by the encoder's range pass
    (``quantize.gather_ranges_kernel``), strided ones copied first: both give the same bytes
    and stats, whatever the blocks' storage (offsets into one buffer, empty blocks,
    non-finite values, a repeated row)."""
    config = CodecConfig(format=fmt)
    buf = torch.randn(9000, generator=_gen(7))
    buf[[5, 700, 4100]] = torch.tensor([math.nan, math.inf, -math.inf])
    blocks = [
        buf[3 : 3 + 64 * 16].view(64, 16),  # offset into one buffer
        buf[2000 : 2000 + 40 * 16].view(40, 16),
        buf[:0].view(0, 16),  # empty
        torch.empty(0, 16),  # empty, no storage: address 0
        buf[4000 : 4000 + 50 * 16].view(50, 16).clone(),  # a non-finite value, its own storage
        buf[100:116].view(1, 16).expand(30, 16).contiguous(),  # one row repeated
    ]
    bounds = [0.01, 0.05, 0.01, 0.01, 0.02, 0.01]
    # The same values as strided views (half of a twice-as-wide buffer): copied first.
    strided = [torch.cat([b, b], 1)[:, :16] for b in blocks]
    assert not any(s.is_contiguous() for s in strided if s.numel())
    got, got_stats = compress_with_stats(blocks, bounds, config)
    want, want_stats = compress_with_stats(strided, bounds, config)
    assert torch.equal(got, want)
    assert got_stats == want_stats
    for i, (x, y) in enumerate(zip(blocks, decompress(got), strict=True)):
        assert_within_bound(x, y, bounds[i], f"block {i}")


# ---------------------------------------------------------------------------------------------
# Property test

_SPECIAL32 = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001,
              0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000000]  # fmt: skip
_SPECIAL16 = [0x7E00, 0xFE00, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x0400, 0x7BFF, 0x0000]
_SPECIALBF = [0x7FC0, 0xFFC0, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x0080, 0x7F7F, 0x0000]


def _element_bits(dtype: torch.dtype) -> st.SearchStrategy[int]:
    if dtype == torch.float32:
        floats = st.floats(width=32, allow_nan=False).map(
            lambda v: int(np.array(v, np.float32).view(np.uint32))
        )
        return st.one_of(floats, st.integers(0, 2**32 - 1), st.sampled_from(_SPECIAL32))
    if dtype == torch.float16:
        floats = st.floats(width=16, allow_nan=False).map(
            lambda v: int(np.array(v, np.float16).view(np.uint16))
        )
        return st.one_of(floats, st.integers(0, 2**16 - 1), st.sampled_from(_SPECIAL16))
    normal = st.floats(-1e3, 1e3).map(
        lambda v: int(torch.tensor(v).bfloat16().view(torch.int16)) & 0xFFFF
    )
    return st.one_of(normal, st.integers(0, 2**16 - 1), st.sampled_from(_SPECIALBF))


@st.composite
def _block(draw):
    dtype = draw(st.sampled_from(DTYPES))
    dim = draw(st.integers(0, 9))
    distinct = draw(st.integers(0, 8))
    rows = draw(st.integers(0, 24))
    base = draw(st.lists(_element_bits(dtype), min_size=distinct * dim, max_size=distinct * dim))
    base_t = from_bits(base, dtype, (distinct, dim))
    if distinct == 0:
        rows = 0
    ids = draw(st.lists(st.integers(0, max(distinct - 1, 0)), min_size=rows, max_size=rows))
    x = base_t[torch.tensor(ids, dtype=torch.int64)] if rows else base_t[:0]
    scale = draw(st.sampled_from([None, 1e-9, 1.0, 1e4]))
    if scale is not None and x.numel():  # a well-behaved bulk next to the specials
        x = (x.double().nan_to_num(0, 0, 0).clamp(-1, 1) * scale).to(dtype)
        if draw(st.booleans()):
            x.view(-1)[0] = math.nan
    return x


_bounds = st.one_of(
    st.just(0.0),
    st.sampled_from([1e-30, 1e-7, 1e-3, 0.5, 1e30, 1e38, 2e38, F32_MAX, 1e300]),
    st.floats(min_value=0.0, max_value=1e39, allow_nan=False, allow_infinity=False),
    st.tuples(st.just("rel"), st.sampled_from([0.001, 0.01, 0.05, 0.5])),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_block(), _bounds), min_size=1, max_size=3))
def test_property_guarantee(items):
    blocks, bounds = [], []
    for x, b in items:
        bound = b[1] * finite_range(x) if isinstance(b, tuple) else b
        blocks.append(x)
        bounds.append(bound)
    roundtrip(blocks, bounds)


def test_device_is_preserved():
    x = torch.randn(8, 4)
    payload = compress([x], [0.1])
    assert payload.device == x.device
    assert decompress(payload)[0].device == x.device
