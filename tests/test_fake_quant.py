"""The fake-quantization error models keep their stated bounds, including on adversarial blocks."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fake_quant as fq

BOUNDED = [
    f"{scale}-{rounding}:{v}"
    for scale in fq.SCALES
    for rounding in fq.ROUNDINGS
    for v in (0.01, 0.1)
] + ["log:0.01", "log:0.1", "value:0.01", "value:0.1"]  # fmt: skip


def _adversarial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 64, 16, generator=g)
    huge = base.clone()
    huge[0, 3, 5] = 3e38  # one element dominates its block (and a float32 range would overflow)
    huge[1, 7, 1] = -3e38
    wide = base * torch.logspace(-5, 5, 16).view(1, 1, 16)  # ten orders of magnitude in a row
    nonfinite = base.clone()
    nonfinite[0, 0, 0], nonfinite[0, 1, 2], nonfinite[1, 5, 5] = math.nan, math.inf, -math.inf
    return {
        "normal": base,
        "zeros": torch.zeros(2, 64, 16),
        "zero_row": torch.cat([torch.zeros(2, 1, 16), base[:, 1:]], dim=1),
        "huge": huge,
        "denormal": base * 1e-40,
        "wide": wide,
        "nonfinite": nonfinite,
        "all_nan": torch.full((1, 4, 16), math.nan),
    }


@pytest.mark.parametrize("spec", BOUNDED)
def test_models_meet_their_bound_and_carry_non_finite_values(spec: str) -> None:
    model = fq.parse_model(spec)
    for name, x in _adversarial().items():
        y = model(x, torch.Generator().manual_seed(1))
        assert y.shape == x.shape and y.dtype == torch.float32, name
        finite = torch.isfinite(x)
        assert torch.equal(torch.isnan(y), torch.isnan(x)), name
        assert torch.equal(y[torch.isinf(x)], x[torch.isinf(x)]), name
        assert bool(torch.isfinite(y[finite]).all()), name
        err = (y.double() - x.double()).abs()[finite]
        # The bound, plus the one rounding of the float64 result to float32.
        ulp = (torch.nextafter(y, torch.full_like(y, math.inf)) - y).abs().double()[finite]
        bound = fq.stated_bound(model, x)[finite]
        assert bool((err <= bound * (1 + 1e-12) + ulp).all()), (name, float((err - bound).max()))


@pytest.mark.parametrize("v", [0.03, 0.1])
def test_value_spec_is_the_codec_bit_for_bit(v: float) -> None:
    from torchrec_lossy.codec import BoundKind, CodecConfig, compress_with_stats, decompress

    model = fq.parse_model(f"value:{v}")
    quantized = 0
    for name, x in _adversarial().items():
        blocks = list(x)  # the leading dim: independent blocks, as the codec sends them
        kinds = [BoundKind.VALUE] * len(blocks)
        payload, stats = compress_with_stats(blocks, [v] * len(blocks), CodecConfig(), kinds)
        got = model(x)
        for b, s, y, d in zip(blocks, stats, got, decompress(payload), strict=True):
            # A block the codec sends raw (cheaper, e.g. nearly all escaped) decodes exactly;
            # every other one decodes to the grid's bits.
            expected = b if s.mode in ("raw", "lz") else y
            assert torch.equal(d.view(torch.int32), expected.view(torch.int32)), (name, s.mode)
            quantized += s.mode.startswith("quant")
    assert quantized >= 8


def test_nearest_snaps_small_values_to_zero_and_midrise_and_log_do_not() -> None:
    x = torch.randn(1, 512, 16, generator=torch.Generator().manual_seed(2))
    assert float((fq.parse_model("block-nearest:0.03")(x) == 0).float().mean()) > 0.05
    for spec in ("block-midrise:0.03", "log:0.03", "block-dither:0.03"):
        y = fq.parse_model(spec)(x, torch.Generator().manual_seed(0))
        assert int((y == 0).sum()) == 0, spec


@pytest.mark.parametrize("spec", ["block-stochastic:0.1", "block-dither:0.1", "row-stochastic:0.1"])
def test_random_roundings_are_unbiased(spec: str) -> None:
    x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(3))
    model, gen = fq.parse_model(spec), torch.Generator().manual_seed(4)
    mean = torch.stack([model(x, gen) for _ in range(400)]).mean(0)
    step = float(fq.stated_bound(model, x).max())
    # 400 draws of an error bounded by `step`: the mean's sd is at most step / 20.
    assert float((mean - x).abs().max()) < 0.3 * step
    # ... while one draw is off by a sizeable share of the step (the test is not vacuous).
    assert float((model(x, gen) - x).abs().mean()) > 0.1 * step


def test_casts_match_fbgemm_precisions() -> None:
    x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(fq.parse_model("exact")(x), x)
    assert torch.equal(fq.parse_model("fp16")(x), x.half().float())
    assert torch.equal(fq.parse_model("bf16")(x), x.bfloat16().float())
    y = fq.parse_model("mx4")(x)
    rel = (y - x).abs().amax() / (x.amax() - x.amin())
    assert 0 < float(rel) < 0.2  # MX4's error is large but bounded by its group's scale


def test_entropy_orders_bounds_and_counts_side_information() -> None:
    blocks = list(torch.randn(4, 512, 16, generator=torch.Generator().manual_seed(6)).unbind(0))
    specs = ("block-nearest:0.01", "block-nearest:0.03", "row-nearest:0.03", "mx4", "exact")
    bits = {s: fq.code_entropy_bits(fq.parse_model(s), blocks) for s in specs}
    assert bits["block-nearest:0.01"] > bits["block-nearest:0.03"] + 1.0  # 3x finer: ~1.6 bits
    assert bits["mx4"] == 4.25 and bits["exact"] is None
    assert bits["row-nearest:0.03"] > fq.SIDE_BITS["row"]


@pytest.mark.parametrize(
    "spec", ["block:0.03", "block-nearest", "block-nearest:1.5", "cube-nearest:0.1", "log:x"]
)
def test_bad_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError, match="error model"):
        fq.parse_model(spec)


def test_error_stats_measure_energy_dead_zone_and_row_scale() -> None:
    blocks = list(torch.randn(2, 256, 16, generator=torch.Generator().manual_seed(7)).unbind(0))
    exact = fq.error_stats(fq.parse_model("exact"), blocks)
    assert exact["rel_mse"] == exact["zeroed"] == exact["max_rel_row"] == 0.0
    near = fq.error_stats(fq.parse_model("block-nearest:0.03"), blocks)
    sto = fq.error_stats(fq.parse_model("block-stochastic:0.03"), blocks)
    assert near["zeroed"] > 0.05 and 0.3 < sto["rel_mse"] / near["rel_mse"] < 0.7  # var halves
    assert fq.error_stats(fq.parse_model("log:0.03"), blocks)["max_rel_row"] <= 0.03 + 1e-6
    assert 0 < near["row_to_range"] < 1


def test_backward_candidates_on_adversarial_gradients() -> None:
    # Issue 32's candidates (benchmarks/backward_error_study.py): each meets its stated bound
    # on every adversarial gradient block and carries NaN / Inf bit-exact; only the
    # row-relative ones keep every row of a block whose rows span ten decades.
    import backward_error_study as bs

    adv = bs.adversarial_gradients()
    specs = ("value:0.03125", "rowexp-nearest:0.0078125", "groupexp-nearest:0.0078125",
             "block-nearest:0.01")  # fmt: skip
    got = {
        s: {n: bs.adversarial_check(fq.parse_model(s), x) for n, x in adv.items()} for s in specs
    }
    for spec, checks in got.items():
        for name, c in checks.items():
            assert c["over_bound"] <= 1.0 and c["nonfinite_exact"], (spec, name, c)
    decades = {s: got[s]["ten decades"] for s in specs}
    assert decades["value:0.03125"]["row_energy"] <= 2.0**-12
    # rowexp: |e| <= v 2**ceil(log2 max|row|) < 2 v max|row|, so a row's energy <= 64 v**2.
    assert decades["rowexp-nearest:0.0078125"]["row_energy"] <= 64 * 0.0078125**2
    for spec in ("value:0.03125", "rowexp-nearest:0.0078125"):
        assert decades[spec]["rows_zeroed"] == 0.0, spec
    # A group of 32 spans two rows of 16: the larger row's exponent wipes out the smaller.
    assert decades["groupexp-nearest:0.0078125"]["rows_zeroed"] > 0.2
    assert decades["block-nearest:0.01"]["rows_zeroed"] > 0.5
    # One huge finite row: within the block bound, every other row is lost.
    assert got["block-nearest:0.01"]["one huge row"]["rows_zeroed"] > 0.99
    assert got["rowexp-nearest:0.0078125"]["one huge row"]["rows_zeroed"] == 0.0
