"""e2e_bench --rates: the per-rate table against the fastest TorchRec option (no runs here)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e_bench as eb  # noqa: E402


def _summary(**step_ms: float) -> dict[str, Any]:
    return {"modes": {m: {"runs": 1, "step_ms": t} for m, t in step_ms.items()}}


def test_rates_table_compares_each_mode_with_the_fastest_torchrec_option() -> None:
    per_rate = {
        "1gbit": _summary(none=607.0, fp16=402.0, mx4=778.0, lossy=232.0),
        "10gbit": _summary(none=227.0, fp16=204.0, mx4=729.0, lossy=252.0),
        "localhost": _summary(none=188.0, fp16=207.0, lossy=195.0),
    }
    rates = eb.rates_summary(per_rate)
    assert rates["1gbit"]["best_torchrec"] == "fp16"
    assert rates["1gbit"]["vs_best"]["lossy"] == pytest.approx(232 / 402)
    assert rates["1gbit"]["targets"] == {
        "within_5pct_of_best": True,
        "2.5x_faster_than_none": True,  # 607 / 232 = 2.62
    }
    assert rates["10gbit"]["targets"] == {"within_5pct_of_best": False}  # 252 / 204 = 1.24
    assert rates["localhost"]["best_torchrec"] == "none"
    assert rates["localhost"]["targets"]["within_5pct_of_best"]  # 195 / 188 = 1.04
    text = eb.format_rates_table(rates, ["none", "fp16", "mx4", "lossy"])
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["link", "none", "fp16", "mx4", "lossy"]
    assert "232 ms (0.58x)" in lines[1] and "within_5pct_of_best met" in lines[1]
    assert "within_5pct_of_best MISSED" in lines[2]
    assert lines[3].split()[7] == "-"  # no mx4 on localhost: a dash, not a crash


def test_rates_are_checked_before_anything_runs() -> None:
    args = eb.parse_args(["--rates", "1gbit,10gbit,localhost", "--no-netns"])
    assert args.rates == ["1gbit", "10gbit", "localhost"]
    with pytest.raises(SystemExit):
        eb.parse_args(["--rates", "1gbit,fast"])
