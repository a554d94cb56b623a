"""The statistic that separates the backward's error models (issue 32), and the error sample
that measures it in training.

A gradient block's rows span decades (a row's gradient scales with how often its bag was
looked up). A bound relative to the block's range leaves the small rows an error that is large
against their own scale; a per-value bound does not. The statistic is the mean over rows of
``sum (x' - x)**2 / sum x**2`` (the row-relative error energy); the error sample reports it
per table and raises an alert past ``ROW_ENERGY_LEVEL``. These tests pin both on the codec's
real bytes: the bad model is flagged, the good ones are not, and a homogeneous block at the
default stays below the level (the level is not just "block mode is bad").
"""

from __future__ import annotations

import math

import pytest
import torch

from torchrec_lossy.codec import BoundKind, CodecConfig, compress_groups, decompress_groups
from torchrec_lossy.distributed import error_sample
from torchrec_lossy.distributed.error_sample import ROW_ENERGY_LEVEL
from torchrec_lossy.distributed.stats import LossyCommsStats

# (label, bound kind, value, rounding): today's backward default and the candidates.
MODELS = {
    "block-relative 0.01": (BoundKind.RELATIVE, 0.01, "nearest"),
    "block-relative 0.01 stochastic": (BoundKind.RELATIVE, 0.01, "stochastic"),
    "per-value 1/32": (BoundKind.VALUE, 1 / 32, "nearest"),
    "per-value 1/8": (BoundKind.VALUE, 1 / 8, "nearest"),
}


def decade_gradients(rows: int = 256, dim: int = 16, decades: float = 5.0) -> torch.Tensor:
    """A gradient block whose row scales spread log-uniformly over ``decades`` (Zipf-like bag
    counts), a few rows zero (bags not looked up)."""
    g = torch.Generator().manual_seed(32)
    scale = 10 ** (-decades * torch.rand(rows, 1, generator=g))
    x = torch.randn(rows, dim, generator=g) * scale
    x[::17] = 0.0
    return x


def row_energy(x: torch.Tensor, y: torch.Tensor) -> float:
    """The statistic, as stated: mean over rows with a nonzero value of their relative error
    energy, over the elements whose error is finite (NaN / Inf travel exactly, apart)."""
    x, y = x.double(), y.double()
    fin = (y - x).isfinite()
    x, y = torch.where(fin, x, 0.0), torch.where(fin, y, 0.0)
    val = x.pow(2).sum(1)
    keep = val > 0
    return float(((y - x).pow(2).sum(1)[keep] / val[keep]).mean())


def roundtrip(x: torch.Tensor, model: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    kind, value, rounding = MODELS[model]
    out = compress_groups([[x]], [[value]], CodecConfig(rounding=rounding, seed=1), [[kind]])
    y = decompress_groups(out.buffer, out.sizes)[0][0][0]
    return out.buffer[: out.sizes[0]], y, out.sizes[0]


def test_row_relative_energy_separates_block_relative_from_per_value() -> None:
    x = decade_gradients()
    energy = {m: row_energy(x, roundtrip(x, m)[1]) for m in MODELS}
    # The block models: the small rows' error is far past their own scale (> 1: worse than
    # sending zeros for them), with stochastic rounding too (it is not rounding bias).
    assert energy["block-relative 0.01"] > 100 * ROW_ENERGY_LEVEL
    assert energy["block-relative 0.01 stochastic"] > 100 * ROW_ENERGY_LEVEL
    # The per-value models: within (2**-(m+1))**2 per element, so per row too.
    assert energy["per-value 1/32"] <= (2**-6) ** 2 < ROW_ENERGY_LEVEL
    assert energy["per-value 1/8"] <= (2**-4) ** 2 < ROW_ENERGY_LEVEL
    # The block-wide energy (the forward's statistic) hardly sees it: the large rows carry
    # the block's energy.
    _, y, _ = roundtrip(x, "block-relative 0.01")
    block_energy = float((y.double() - x.double()).pow(2).sum() / x.double().pow(2).sum())
    assert energy["block-relative 0.01"] > 50 * block_energy


def test_homogeneous_block_at_the_default_stays_under_the_level() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=g)
    for model in ("block-relative 0.01", "per-value 1/32"):
        assert row_energy(x, roundtrip(x, model)[1]) < ROW_ENERGY_LEVEL, model


def test_error_sample_measures_it_and_alerts_by_table_and_call() -> None:
    good = decade_gradients()
    bad = decade_gradients()
    bad[3, 5], bad[4, 0] = math.nan, -math.inf
    kinds = [[BoundKind.VALUE, BoundKind.RELATIVE]]
    out = compress_groups([[good, bad]], [[1 / 32, 0.01]], CodecConfig(), kinds)
    payload = out.buffer[: out.sizes[0]]
    stats = LossyCommsStats()
    error_sample.record_error_samples(stats, "bwd", payload, [good, bad], ["t_good", "t_bad"], 7)
    decoded = decompress_groups(payload, [payload.numel()])[0][0]
    for name, x, y in (("t_good", good, decoded[0]), ("t_bad", bad, decoded[1])):
        t = stats.table(name, "bwd")
        assert t.row_relative_energy == pytest.approx(row_energy(x, y), rel=1e-9)
    bad_t = stats.table("t_bad", "bwd")
    assert bad_t.nonfinite == 2
    assert torch.isnan(decoded[1][3, 5]) and decoded[1][4, 0] == -math.inf  # exact
    alerts = stats.alerts()
    assert [(a.direction, a.table, a.call, a.nonfinite) for a in alerts] == [("bwd", "t_bad", 7, 2)]
    assert alerts[0].row_energy > ROW_ENERGY_LEVEL
    stats.reset()
    assert stats.alerts() == []


def test_the_backward_default_is_one_line_to_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrec_lossy import config

    assert config.LossyCommsConfig().backward_bound == config.ErrorBound("relative", 0.01)
    per_value = config.ErrorBound("value", 0.03125)
    monkeypatch.setattr(config, "DEFAULT_BACKWARD_BOUND", per_value)
    assert config.LossyCommsConfig().backward_bound == per_value
    # A bound the user set is theirs, whatever the default.
    mine = config.ErrorBound("relative", 0.02)
    assert config.LossyCommsConfig(backward_bound=mine).backward_bound == mine


def test_example_summary_groups_alerts_by_table_and_step() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from dlrm_metrics import error_alerts
    from dlrm_report import _alert_lines

    def alert(table: str, call: int, energy: float, nonfinite: int = 0) -> dict[str, object]:
        return {"direction": "bwd", "table": table, "call": call, "row_energy": energy,
                "nonfinite": nonfinite}  # fmt: skip

    rank0 = [alert("t1", 16, 0.5), alert("t1", 48, 0.9), alert("t2", 32, 0.0, nonfinite=3)]
    rank1 = [alert("t1", 32, 0.7)]
    got = error_alerts([rank0, rank1])
    assert got["count"] == 4 and got["level"] == ROW_ENERGY_LEVEL
    assert got["by_table"]["bwd/t1"] == {
        "count": 3, "first_step": 16, "last_step": 48, "max_row_energy": 0.9, "nonfinite": 0
    }  # fmt: skip
    assert got["by_table"]["bwd/t2"]["nonfinite"] == 3
    line, hint = _alert_lines(got)
    assert "4 sampled blocks" in line and "bwd/t1 x3 (steps 16-48, max 0.9)" in line
    assert "bwd/t2 x1 (steps 32-32, max 0, 3 NaN/Inf)" in line
    assert "backward_bound: {mode: value, value: 0.03125}" in hint
    assert _alert_lines(error_alerts([[], []])) == []
    # NaN / Inf alone: reported, without the bound hint.
    (only,) = _alert_lines(error_alerts([[alert("t2", 32, 0.0, nonfinite=1)]]))
    assert "1 NaN/Inf" in only


def test_forward_blocks_alert_on_nan_and_inf_only() -> None:
    x = decade_gradients()
    y = x.clone()
    y[0, 0] = math.inf
    out = compress_groups([[x, y]], [[0.01, 0.01]], CodecConfig(), kinds=True)
    payload = out.buffer[: out.sizes[0]]
    stats = LossyCommsStats()
    error_sample.record_error_samples(stats, "fwd", payload, [x, y], ["t0", "t1"], 3)
    # Both blocks' row energy is far past the level (reported per table), but only the
    # non-finite one is an alert in the forward.
    assert stats.table("t0", "fwd").row_relative_energy > ROW_ENERGY_LEVEL
    assert [(a.table, a.call, a.nonfinite) for a in stats.alerts()] == [("t1", 3, 1)]
