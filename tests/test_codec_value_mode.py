"""The per-value relative bound (``ErrorBound(mode="value")``, ``BoundKind.VALUE``).

Every finite element decodes within ``v * |x|`` (float64), zeros (both signs), NaN and Inf
exactly, whatever the block's scale; the host, the reference and the Triton backends (its
interpreter here) write the same bytes; the grid is ``2**-(m + 1)`` with the m the docstrings
promise; config errors name the fix.
"""

from __future__ import annotations

import math
import os
import struct

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported
from helpers import parse, with_checksum

from torchrec_lossy.codec import (
    BoundKind,
    CodecConfig,
    CodecError,
    compress_groups,
    compress_with_stats,
    decompress,
)
from torchrec_lossy.codec.format import MODE_QUANT, MODE_VALUE
from torchrec_lossy.codec.quantize import value_mantissa_bits
from torchrec_lossy.config import ConfigError, ErrorBound, LossyCommsConfig

V = 0.03
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def adversarial(dtype: torch.dtype) -> list[torch.Tensor]:
    """Blocks that break a range-relative bound: zero rows, specials, an outlier, ten decades."""
    g = torch.Generator().manual_seed(7)
    # fp16 spans 2**-24 .. 65504: keep its decades inside that (the rest is escaped anyway).
    lo, hi = (-3, 4) if dtype == torch.float16 else (-5, 5)
    decades = torch.randn(40, 16, generator=g) * torch.logspace(lo, hi, 40)[:, None]
    specials = torch.randn(64, 8, generator=g)
    specials[0] = 0.0
    specials[1, :4] = -0.0
    specials[2, 0], specials[2, 1], specials[2, 2] = math.nan, math.inf, -math.inf
    specials[3, 0], specials[3, 1] = 1e-40, -3e-39  # float32 denormals
    outlier = torch.randn(6, 8, generator=g)
    outlier[4, 5] = 3e38 if dtype != torch.float16 else 60000.0
    zeros = torch.zeros(5, 4)
    repeated = torch.randn(3, 8, generator=g)[torch.randint(0, 3, (30,), generator=g)]
    return [b.to(dtype) for b in (decades, specials, outlier, zeros, repeated)]


def assert_within(blocks: list[torch.Tensor], out: list[torch.Tensor], v: float) -> None:
    for b, o in zip(blocks, out, strict=True):
        assert o.dtype == b.dtype and o.shape == b.shape
        x, y = b.double(), o.double()
        fin = torch.isfinite(x)
        assert bool(((y[fin] - x[fin]).abs() <= v * x[fin].abs()).all())
        exact = ~fin | (x == 0)  # non-finite and both zeros: bit for bit
        assert torch.equal(b[exact].view(BITS[b.dtype]), o[exact].view(BITS[b.dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_round_trip_within_v_times_x(dtype: torch.dtype, backend: str) -> None:
    blocks = adversarial(dtype)
    kinds = [BoundKind.VALUE] * len(blocks)
    payload, stats = compress_with_stats(
        blocks, [V] * len(blocks), CodecConfig(backend=backend), kinds
    )
    assert_within(blocks, decompress(payload, backend=backend), V)
    for s in stats:
        assert s.bound == V and s.max_error <= 2.0**-6  # the grid's 2**-(m + 1), m = 5
    assert stats[1].mode in ("quant", "quant+lz")  # specials and zeros did not force raw


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_and_reference_write_the_same_bytes(dtype: torch.dtype) -> None:
    blocks = adversarial(dtype)
    bounds = [0.03, 0.01, 0.5, 0.2, 2.0**-24]
    kinds = [BoundKind.VALUE] * len(blocks)
    host, s_host = compress_with_stats(blocks, bounds, CodecConfig(backend="cpu"), kinds)
    ref, s_ref = compress_with_stats(blocks, bounds, CodecConfig(backend="reference"), kinds)
    assert torch.equal(host, ref)
    assert s_host == s_ref
    for backend in ("cpu", "reference"):
        out = decompress(host, backend=backend)
        for b, o, v in zip(blocks, out, bounds, strict=True):
            assert_within([b], [o], v)


def test_ten_decades_keep_their_scale_without_escapes() -> None:
    g = torch.Generator().manual_seed(3)
    block = torch.randn(64, 16, generator=g) * torch.logspace(-5, 5, 64)[:, None]
    payload, (stats,) = compress_with_stats([block], [V], kinds=[BoundKind.VALUE])
    (out,) = decompress(payload)
    assert_within([block], [out], V)
    # 10 decades are 34 octaves of 32 codes each: all fit the alphabet, nothing escapes.
    assert stats.n_escapes == 0 and stats.mode == "quant"
    rel = ((out.double() - block.double()) / block.double()).abs()
    assert 0 < rel.max() <= 2.0**-6  # the small rows are as accurate as the large ones
    assert rel[:8].max() > 2.0**-8  # and really quantized


def test_outlier_sets_the_scale_and_what_is_far_below_escapes() -> None:
    g = torch.Generator().manual_seed(1)
    near = torch.randn(64, 8, generator=g) * 1e30  # ~28 octaves below 3e38: all fit
    near[0, 0] = 3e38
    far = torch.full((64, 8), 1e-3)  # 2**138 below: every such code is escaped
    far[0, 0] = 3e38
    payload, stats = compress_with_stats(
        [near, far], [V, V], CodecConfig(enable_lz=False), kinds=[BoundKind.VALUE] * 2
    )
    assert_within([near, far], decompress(payload), V)
    assert stats[0].mode == "quant" and stats[0].n_escapes == 0
    assert stats[1].mode == "raw"  # 511 escapes: raw is smaller


def test_mantissa_bits_give_the_effective_bound() -> None:
    for v, m in [(0.5, 0), (0.26, 1), (0.25, 1), (0.03, 5), (2.0**-6, 5), (1e-9, 23)]:
        assert value_mantissa_bits(v) == m, v
        assert 2.0 ** -(m + 1) <= v or m == 23


def test_exact_byte_count() -> None:
    # 64 rows of a permutation of (1, 2, 4, 8) x 2: four symbols, 128 each, 2-bit codes.
    g = torch.Generator().manual_seed(0)
    base = torch.tensor([1.0, 2.0, 4.0, 8.0] * 2)
    block = torch.stack([base[torch.randperm(8, generator=g)] for _ in range(64)])
    payload, (stats,) = compress_with_stats(
        [block], [V], CodecConfig(enable_lz=False), kinds=[BoundKind.VALUE]
    )
    # m = 5, shift 18: qmax = q(8.0) = 0x41000000 >> 18 = 4160; symbols 2047 + qmax - q + 1:
    # 8.0 -> 2048 .. 1.0 (q = 4064) -> 2144, so the codebook spans 97 nibbles.
    seg = 8 + math.ceil(math.ceil(97 / 2) / 4) + 1 + 64 * 8 * 2 // 32  # header, book, chunks, bits
    assert stats.mode == "quant" and stats.n_escapes == 0
    assert payload.numel() == 32 + 24 + 4 * seg == 272
    _, descs, _ = parse(payload.numpy().tobytes())
    assert int(descs[0]["mode"]) == MODE_QUANT | MODE_VALUE
    assert torch.equal(decompress(payload)[0], block)  # powers of two are on the grid


def test_grouped_mixes_kinds_and_matches_single_payloads() -> None:
    blocks = adversarial(torch.float32)
    groups = [blocks[:2], blocks[2:]]
    kinds = [[BoundKind.VALUE, BoundKind.RELATIVE], [BoundKind.ABSOLUTE, BoundKind.VALUE, 2]]
    values = [[V, 0.03], [0.01, V, 0.1]]
    out = compress_groups(groups, values, CodecConfig(), kinds=kinds)
    for g, (grp, k, v) in enumerate(zip(groups, kinds, values, strict=True)):
        single, _ = compress_with_stats(grp, v, kinds=k)
        assert torch.equal(out.payload(g), single)
    assert_within(blocks[:1], decompress(out.payload(0))[:1], V)


def test_value_bit_on_a_raw_block_is_corrupt() -> None:
    block = torch.arange(12.0).reshape(3, 4)
    payload = compress_with_stats([block], [0.0], kinds=[BoundKind.VALUE])[0]
    buf = bytearray(payload.numpy().tobytes())
    assert buf[32 + 9] == 0  # raw
    buf[32 + 9] = MODE_VALUE
    bad = torch.frombuffer(bytearray(with_checksum(buf)), dtype=torch.uint8)
    for backend in ("cpu", "reference"):
        with pytest.raises(CodecError, match="mode 4"):
            decompress(bad, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_largest_code_past_infinity_is_corrupt_and_below_it_backends_agree(
    dtype: torch.dtype,
) -> None:
    # A code above 0x7F800000 >> shift reconstructs a float32 NaN, which the backends would cast
    # to float16 / bfloat16 apart: the segment check refuses it; at the limit (infinity) they agree.
    block = (1 + torch.rand(64, 16, generator=torch.Generator().manual_seed(3)) / 2).to(dtype)
    payload = compress_with_stats([block], [V], kinds=[BoundKind.VALUE])[0]
    buf = bytearray(payload.numpy().tobytes())
    _, descs, segs = parse(bytes(buf))
    assert int(descs[0]["mode"]) & (MODE_QUANT | MODE_VALUE) == MODE_QUANT | MODE_VALUE
    at = segs[0][0]
    step = struct.unpack_from("<f", buf, at)[0]
    limit = 0x7F800000 >> (23 - value_mantissa_bits(V))
    assert step == 2.0 ** -value_mantissa_bits(V)
    for center in (limit, limit + 1):
        struct.pack_into("<i", buf, at + 4, center)
        bad = torch.frombuffer(bytearray(with_checksum(buf)), dtype=torch.uint8)
        if center > limit:
            for backend in ("cpu", "reference"):
                with pytest.raises(CodecError, match=f"largest code {center} out of range"):
                    decompress(bad, backend=backend)
            continue
        cpu, ref = decompress(bad, backend="cpu")[0], decompress(bad, backend="reference")[0]
        assert torch.equal(cpu.view(BITS[dtype]), ref.view(BITS[dtype]))


@pytest.mark.parametrize("kind", [k for k in BoundKind if k.max_value < float("inf")])
def test_a_kinds_limit_holds_in_the_config_and_the_codec_alike(kind: BoundKind) -> None:
    over = kind.max_value * 1.25
    with pytest.raises(ConfigError, match=rf"bound.value={over}.*<= {kind.max_value:g}"):
        ErrorBound(kind.name.lower(), over)
    assert ErrorBound(kind.name.lower(), kind.max_value).value == kind.max_value
    with pytest.raises(ValueError, match=rf"{kind.label} bound 0 is {over}"):
        compress_with_stats([torch.ones(2, 2)], [over], kinds=[kind])


def test_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"bound.value=0.6.*<= 0.5"):
        ErrorBound("value", 0.6)
    assert ErrorBound("value", 0.0).value == 0.0  # lossless
    with pytest.raises(ConfigError, match=r"default_bound='value:0.03'.*rounding 'nearest'"):
        LossyCommsConfig(
            codec=CodecConfig(rounding="stochastic"), default_bound=ErrorBound("value", 0.03)
        )
    with pytest.raises(ConfigError, match=r"backward_bound='value:0.01'"):
        LossyCommsConfig(backward_bound=ErrorBound("value", 0.01), backward_rounding="stochastic")
    block = torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"rounding='stochastic'.*rounding='nearest'"):
        compress_with_stats([block], [V], CodecConfig(rounding="stochastic"), [BoundKind.VALUE])
    with pytest.raises(ValueError, match=r"per-value bound 0 is 0.7"):
        compress_with_stats([block], [0.7], kinds=[BoundKind.VALUE])
    with pytest.raises(ValueError, match="bound kinds"):
        compress_groups([[block]], [[V]], kinds=[[3]])


def tiny_blocks() -> list[torch.Tensor]:
    """Small adversarial blocks of every dtype (the Triton interpreter is slow)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 8, generator=g) * torch.logspace(-1, 1, 64)[:, None]
    x[0, :3] = torch.tensor([0.0, -0.0, math.nan])
    x[1, :3] = torch.tensor([math.inf, 1e-40, 3e38])
    x[2] = 0.0
    rep = torch.randn(2, 8, generator=g)[torch.randint(0, 2, (64,), generator=g)]
    return [b.to(d) for d in DTYPES for b in (x, rep)] + [torch.zeros(0, 4)]


@pytest.mark.slow  # the Triton interpreter: about a minute
def test_triton_writes_and_reads_the_host_bytes() -> None:
    pytest.importorskip("triton")
    blocks = tiny_blocks()
    bounds = [0.03, 0.1, 0.01, 0.5, 0.2, 0.03, 0.03]
    kinds = [BoundKind.VALUE] * len(blocks)
    host, s_host = compress_with_stats(blocks, bounds, CodecConfig(backend="cpu"), kinds)
    dev, s_dev = compress_with_stats(blocks, bounds, CodecConfig(backend="triton"), kinds)
    assert torch.equal(host, dev)
    assert s_host == s_dev
    assert sum(s.mode.startswith("quant") for s in s_host) >= 3
    got = decompress(host, backend="triton")
    for b, o, v in zip(blocks, got, bounds, strict=True):
        assert_within([b], [o], v)
    ref = decompress(host, backend="cpu")
    for o, r in zip(got, ref, strict=True):
        assert torch.equal(o.view(BITS[o.dtype]), r.view(BITS[r.dtype]))
    grouped = compress_groups(
        [blocks[:3], blocks[3:]],
        [bounds[:3], bounds[3:]],
        CodecConfig(backend="triton"),
        kinds=[[BoundKind.VALUE, BoundKind.RELATIVE, BoundKind.VALUE], [BoundKind.VALUE] * 4],
    )
    host_g = compress_groups(
        [blocks[:3], blocks[3:]],
        [bounds[:3], bounds[3:]],
        CodecConfig(backend="cpu"),
        kinds=[[BoundKind.VALUE, BoundKind.RELATIVE, BoundKind.VALUE], [BoundKind.VALUE] * 4],
    )
    assert torch.equal(grouped.buffer, host_g.buffer)


def test_adaptive_schedule_caps_value_bounds() -> None:
    from torchrec_lossy.adaptive import AdaptiveBounds
    from torchrec_lossy.config import ErrorBoundSchedule

    comms = LossyCommsConfig(
        default_bound=ErrorBound("value", 0.2),
        schedule=ErrorBoundSchedule(kind="step", start_factor=4.0, decay_iterations=100),
    )
    bounds = AdaptiveBounds(["t"], comms)
    assert bounds.bound("t") == ErrorBound("value", 0.5)


def test_stats_max_error_is_relative() -> None:
    x = torch.tensor([[1.0, 100.0, 1e4, -3.0]]).repeat(256, 1)
    cfg = CodecConfig(enable_lz=False)
    _, (s,) = compress_with_stats([x], [0.1], cfg, kinds=[BoundKind.VALUE])
    assert s.mode == "quant"
    # m = 3 (8 levels per octave): 100 = 1.5625 * 64 is a tie, rounded up to 104 (0.04
    # relative); 1e4 -> 10240 (0.024); 1 and -3 are on the grid.
    assert s.max_error == pytest.approx(0.04, abs=1e-12)


def test_planner_calibrates_value_bounds_with_the_codec() -> None:
    from torchrec_lossy.planner.calibrate import calibrate

    block = adversarial(torch.float32)[0]
    comms = LossyCommsConfig(default_bound=ErrorBound("value", V))
    (cal,) = calibrate({"t": block}, comms).values()
    payload, _ = compress_with_stats([block], [V], kinds=[BoundKind.VALUE])
    assert cal.wire_bytes == payload.numel() and cal.abs_bound == V
    assert cal.bound == ErrorBound("value", V)
