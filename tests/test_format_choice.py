"""comms.format: the candidates' admission, the pick, measured speeds and their fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from torchrec_lossy.config import (
    ConfigError,
    EmbeddingTableConfig,
    ErrorBound,
    LossyCommsConfig,
    TableCodecConfig,
)
from torchrec_lossy.planner.cost import RAW, WireFormat, gib_s_to_bytes_per_ms
from torchrec_lossy.planner.formats import CANDIDATES, admits, choose_format
from torchrec_lossy.planner.speeds import default_speeds, measure_speeds


def test_casts_are_admitted_only_under_per_value_bounds_they_meet() -> None:
    fp16, bf16 = CANDIDATES["fp16"], CANDIDATES["bf16"]
    assert admits(bf16, ErrorBound("value", 2.0**-8)) and not admits(
        bf16, ErrorBound("value", 0.003)
    )
    assert admits(fp16, ErrorBound("value", 0.001)) and not admits(fp16, ErrorBound("value", 1e-4))
    # A range-relative or absolute bound can be smaller than a large value's cast error.
    for bound in (ErrorBound("relative", 0.5), ErrorBound("absolute", 1.0)):
        assert not admits(fp16, bound) and not admits(bf16, bound)
    for name in ("raw", "entropy"):  # exact, or error-bounded by construction
        assert admits(CANDIDATES[name], ErrorBound("relative", 0.0))


def test_choice_is_the_least_estimated_time_and_never_an_inadmissible_format() -> None:
    entropy = WireFormat("lossy", 20.0, 1.0, 2.0)
    formats = {"raw": (RAW, RAW), "entropy": (entropy, entropy)}
    slow_link = gib_s_to_bytes_per_ms(0.1)  # 1/0.1 per GiB raw vs 1/2 + 1 + 1/2 coded
    fast_link = gib_s_to_bytes_per_ms(10.0)
    bound = ErrorBound("relative", 0.03)
    assert choose_format(formats, bound, slow_link).name == "entropy"
    fast = choose_format(formats, bound, fast_link)
    assert fast.name == "raw" and fast.estimates["entropy"] > fast.estimates["raw"]
    assert "entropy" in fast.reason(10.0) and "10 GiB/s" in fast.reason(10.0)
    # A free fp16 would win on the fast link, but it is not sent in the forward yet, and a
    # relative bound does not admit it.
    free_fp16 = WireFormat("fp16", 2.0)
    with_fp16 = {**formats, "fp16": (free_fp16, free_fp16)}
    assert choose_format(with_fp16, ErrorBound("value", 0.01), fast_link).name == "raw"


def test_format_key_is_validated_and_resolved_per_table() -> None:
    config = LossyCommsConfig(
        format="entropy",
        tables={"a": TableCodecConfig(format="raw"), "b": TableCodecConfig(compress=False)},
    )
    assert [config.table(n).format for n in ("a", "b", "c")] == ["raw", "raw", "entropy"]
    assert [config.table(n).compress for n in ("a", "b", "c")] == [False, False, True]
    assert LossyCommsConfig().format == "auto"
    with pytest.raises(ConfigError, match=r"format='fp16' is invalid: allowed 'auto', 'raw'"):
        LossyCommsConfig(format="fp16")
    with pytest.raises(ConfigError, match=r"tables.format='zstd' is invalid"):
        TableCodecConfig(format="zstd")  # type: ignore[arg-type]


TABLES = [EmbeddingTableConfig(f"t{i}", 1000 * (i + 1), 16) for i in range(3)]


def test_measured_speeds_are_sane_and_cached_per_shape() -> None:
    cache: dict = {}
    speeds = measure_speeds(TABLES, 64, LossyCommsConfig(), torch.device("cpu"), cache, reps=1)
    assert speeds.source.startswith("measured on cpu, 3 blocks x 64 rows")
    assert set(speeds.formats) == {"entropy", "fp16", "bf16"}
    assert all(0 < v < 1e5 for pair in speeds.formats.values() for v in pair)
    again = measure_speeds(TABLES, 64, LossyCommsConfig(), torch.device("cpu"), cache)
    assert again is speeds and len(cache) == 1


def test_failed_calibration_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torchrec_lossy.planner import speeds as speeds_mod

    def zero_time(*args: object, **kwargs: object) -> float:
        return 0.0  # a broken clock: infinite throughput

    monkeypatch.setattr(speeds_mod, "_best_s", zero_time)
    with caplog.at_level(logging.WARNING):
        got = measure_speeds(TABLES, 64, LossyCommsConfig(), torch.device("cpu"), reps=1)
    assert got.formats == default_speeds("cpu", "x").formats
    assert got.source.startswith("defaults: calibration failed")
    assert len([r for r in caplog.records if "calibration failed" in r.message]) == 1
