"""Tests of torchrec_lossy.adaptive: the homogenization index, classes, decay and checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from torchrec_lossy import traffic
from torchrec_lossy.adaptive import (
    UNASSIGNED,
    AdaptiveBounds,
    classify,
    decay_factor,
    homogenization_stats,
    reclassify,
)
from torchrec_lossy.config import (
    ErrorBound,
    ErrorBoundSchedule,
    HomogenizationConfig,
    LossyCommsConfig,
    TableCodecConfig,
)


def block_with_distinct(n: int, k: int, dim: int = 4) -> torch.Tensor:
    """n rows cycling through k vectors whose base-8 digits (scaled by 1/7) tell them apart.

    Distinct vectors differ by >= 1/7 in some element, far more than twice the reference bound
    (0.06 of the range at most), so quantization keeps them all apart: U_raw = U_q = k.
    """
    assert k <= 8**dim
    j = torch.arange(n) % k
    digits = torch.stack([(j // 8**d) % 8 for d in range(dim)], dim=1)
    return digits.to(torch.float32) / 7.0


def comms(**homogenization: object) -> LossyCommsConfig:
    return LossyCommsConfig(homogenization=HomogenizationConfig(enabled=True, **homogenization))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------------
# The index on tables of known diversity
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(1024, 1), (1024, 3), (1024, 100), (1000, 1000), (64, 7)])
def test_index_of_repeated_distinct_vectors(n: int, k: int) -> None:
    s = homogenization_stats(block_with_distinct(n, k), 0.03)
    assert (s.rows, s.distinct_raw, s.distinct_quantized) == (n, k, k)
    assert s.kept == 1.0
    assert s.index == pytest.approx(1.0 - k / n, abs=1e-15)


def test_index_counts_rows_the_quantizer_merges() -> None:
    # Six distinct rows inside one quantization bin (range 1, eb 0.03, bin width 0.06) and one
    # vector repeated twice far away: U_raw = 7, U_q = 2.
    rows = [[0.001 * i, 0.0] for i in range(6)] + [[1.0, 1.0], [1.0, 1.0]]
    s = homogenization_stats(torch.tensor(rows), 0.03)
    assert (s.rows, s.distinct_raw, s.distinct_quantized) == (8, 7, 2)
    assert s.repetition == pytest.approx(1 / 8)
    assert s.kept == pytest.approx(2 / 7)
    # The quantizer merges 5 of 7 distinct vectors: 2 kappa - 1 < 0, the index is 0 (tight).
    assert s.index == 0.0
    # At a 100x tighter reference bound nothing merges.
    assert homogenization_stats(torch.tensor(rows), 0.0003).distinct_quantized == 7


def test_index_is_the_smaller_of_repetition_and_kept_distinctness() -> None:
    # 10 far-apart vectors repeated over 100 rows, plus one row merging with vector 0.
    near = block_with_distinct(1, 1) + 0.001
    s = homogenization_stats(torch.cat([block_with_distinct(100, 10), near]), 0.03)
    assert (s.rows, s.distinct_raw, s.distinct_quantized) == (101, 11, 10)
    assert s.repetition == pytest.approx(90 / 101)
    assert s.index == pytest.approx(2 * 10 / 11 - 1)  # the merge limits the index
    s = homogenization_stats(block_with_distinct(100, 10), 0.03)
    assert s.index == pytest.approx(0.9)  # nothing merged: the repetition share


def test_index_edge_cases() -> None:
    const = torch.full((16, 3), 0.5)
    s = homogenization_stats(const, 0.03)
    assert (s.distinct_raw, s.distinct_quantized, s.index) == (1, 1, 1 - 1 / 16)
    # Non-finite values never merge with finite ones, and -0.0 is not +0.0 bitwise.
    x = torch.tensor([[0.0, 1.0], [float("nan"), 1.0], [float("inf"), 1.0], [-0.0, 1.0]])
    s = homogenization_stats(x, 0.03)
    assert (s.distinct_raw, s.distinct_quantized) == (4, 3)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        s = homogenization_stats(block_with_distinct(256, 5).to(dtype), 0.03)
        assert (s.distinct_raw, s.distinct_quantized) == (5, 5)
    with pytest.raises(ValueError, match="2-D float"):
        homogenization_stats(torch.zeros(4), 0.03)
    with pytest.raises(ValueError, match="2-D float"):
        homogenization_stats(torch.zeros(4, 2, dtype=torch.int32), 0.03)


def test_index_falls_with_table_size_on_zipf_traffic() -> None:
    gen = torch.Generator().manual_seed(0)
    indices = []
    for card in (4, 100, 10_000, 1_000_000):
        ids = traffic.sample_ids(card, 2048, gen, alpha=1.2)
        _, inverse = torch.unique(ids, return_inverse=True)
        # One random vector per distinct id: only the id distribution differs between tables.
        block = torch.randn(int(inverse.max()) + 1, 16, generator=gen)[inverse]
        indices.append(homogenization_stats(block, 0.03).index)
    assert indices == sorted(indices, reverse=True)
    assert indices[0] > 0.99 and indices[-1] < 0.7


@pytest.mark.parametrize(("preset", "dim"), [("criteo_kaggle", 32), ("criteo_1tb", 128)])
def test_default_classes_reproduce_the_published_split(preset: str, dim: int) -> None:
    """Computed classes on Criteo-like traffic match the paper's split by table size.

    The split (traffic.paper_class_bounds: tight from 100K rows, loose below 1K) is reproduced
    exactly on 1TB-like traffic. On Kaggle-like traffic the 93,145- and 142,572-row tables
    straddle the 100K cut with indices ~0.02 apart around the low threshold; either may land
    on the other side for some seeds, so those two are checked against the threshold instead.
    """
    names = [f"t{i}" for i in range(26)]
    config = comms(update_period=1)
    bounds = AdaptiveBounds(names, config)
    for batch in range(config.homogenization.warmup_windows):
        blocks = traffic.make_blocks(
            traffic.TrafficSpec(preset=preset, dim=dim, batch_rows=1024, batch=batch)
        )
        for name, block in zip(names, blocks, strict=True):
            bounds.observe(name, block, 0.0)
        bounds.step()
    bounds.eval()
    tel = bounds.telemetry()
    cards = traffic.table_cardinalities(preset)
    low, high = config.homogenization.thresholds
    for name, card, expected in zip(names, cards, traffic.paper_class_bounds(preset), strict=True):
        if preset == "criteo_kaggle" and card in (93_145, 142_572):
            assert abs(tel[name]["index"] - low) < 0.02, (card, tel[name])
            assert tel[name]["class"] in ("tight", "base")
        else:
            assert bounds.bound(name).value == expected, (card, tel[name])
    by_size = [tel[names[i]]["index"] for i in sorted(range(26), key=cards.__getitem__)]
    # Small tables are homogeneous, 40M-row tables diverse.
    assert by_size[0] > 0.99 and by_size[-1] < 0.35 < high


# ------------------------------------------------------------------------------------------------
# Classes and hysteresis
# ------------------------------------------------------------------------------------------------


def test_classify_and_reclassify() -> None:
    th = (0.4, 0.7)
    assert [classify(x, th) for x in (0.0, 0.399, 0.4, 0.699, 0.7, 1.0)] == [0, 0, 1, 1, 2, 2]
    assert reclassify(UNASSIGNED, 0.41, th, 0.05) == 1
    assert reclassify(0, 0.44, th, 0.05) == 0  # not past low + hysteresis
    assert reclassify(0, 0.45, th, 0.05) == 1
    assert reclassify(0, 0.80, th, 0.05) == 2  # far past both thresholds: straight to loose
    assert reclassify(0, 0.72, th, 0.05) == 1  # past high, not high + hysteresis
    assert reclassify(2, 0.66, th, 0.05) == 2
    assert reclassify(2, 0.64, th, 0.05) == 1
    assert reclassify(1, 0.36, th, 0.05) == 1
    assert reclassify(1, 0.349, th, 0.05) == 0


def test_hysteresis_keeps_a_table_from_flapping() -> None:
    n = 1000
    config = comms(
        thresholds=(0.4, 0.7),
        update_period=1,
        sample_rows=n,
        smoothing=1.0,
        hysteresis=0.05,
        warmup_windows=1,
    )
    bounds = AdaptiveBounds(["t"], config)
    classes = []
    # Index alternates 0.38 / 0.42 around the low threshold, then jumps to 0.5, then 0.3.
    for index in [0.38, 0.42] * 5 + [0.5, 0.42, 0.38, 0.3]:
        k = round(n * (1 - index))
        bounds.observe("t", block_with_distinct(n, k), 0.0)
        bounds.step()
        classes.append(bounds.table_class_name("t"))
        assert bounds.telemetry()["t"]["index"] == pytest.approx(1 - k / n)
    # smoothing 1: warm after one window; the first window is provisional (no hysteresis).
    assert classes[:10] == ["tight"] * 10
    assert classes[10:] == ["base", "base", "base", "tight"]


def test_class_bounds_apply_unless_pinned_or_absolute() -> None:
    config = LossyCommsConfig(
        default_bound=ErrorBound("relative", 0.02),
        tables={
            "pinned": TableCodecConfig(bound=ErrorBound("relative", 0.002)),
            "abs": TableCodecConfig(bound=ErrorBound("absolute", 0.5)),
            "raw*": TableCodecConfig(compress=False),
        },
        homogenization=HomogenizationConfig(enabled=True, update_period=1),
    )
    names = ["t", "pinned", "abs", "raw0"]
    bounds = AdaptiveBounds(names, config)
    assert [bounds.bound(n) for n in names] == [
        ErrorBound("relative", 0.02),  # no window yet: configured bound
        ErrorBound("relative", 0.002),
        ErrorBound("absolute", 0.5),
        ErrorBound("relative", 0.02),
    ]
    loose = block_with_distinct(1024, 2)
    for n in names:
        bounds.update_index(n, loose)
    assert bounds.table_class_name("t") == "loose"
    assert bounds.bound("t") == ErrorBound("relative", 0.05)
    assert bounds.bound("raw0") == ErrorBound("relative", 0.05)  # compress is the sharder's call
    assert bounds.bound("pinned") == ErrorBound("relative", 0.002)
    assert bounds.bound("abs") == ErrorBound("absolute", 0.5)
    with pytest.raises(KeyError, match="unknown table 'nope'"):
        bounds.bound("nope")


# ------------------------------------------------------------------------------------------------
# Observation cadence
# ------------------------------------------------------------------------------------------------


def test_observe_runs_on_update_iterations_and_gathers_small_blocks() -> None:
    bounds = AdaptiveBounds(["t"], comms(update_period=10, sample_rows=64))
    small = block_with_distinct(16, 4)
    for it in range(25):
        bounds.observe("t", small, 0.1)
        bounds.observe("t", small, 0.1)  # a second shard of the same table: ignored
        bounds.step()
        # Windows start at update iterations 0, 10, 20 and fill 4 iterations later.
        assert bounds.telemetry()["t"]["windows"] == sum(it >= done for done in (3, 13, 23))
    assert bounds.window_stats.tolist() == [[64, 4, 4]]
    assert bounds.telemetry()["t"]["last_abs_bound"] == 0.1


def test_large_blocks_are_strided_to_the_window() -> None:
    bounds = AdaptiveBounds(["t"], comms(update_period=1, sample_rows=100))
    bounds.observe("t", block_with_distinct(1000, 10), 0.0)
    # Rows 0, 10, 20, ... are all vector 0.
    assert bounds.window_stats.tolist() == [[100, 1, 1]]


def test_observe_is_a_no_op_in_eval_or_when_disabled() -> None:
    bounds = AdaptiveBounds(["t"], comms(update_period=1))
    bounds.eval()
    bounds.observe("t", block_with_distinct(2048, 2), 0.0)
    assert bounds.telemetry()["t"]["windows"] == 0
    off = AdaptiveBounds(["t"], LossyCommsConfig())
    off.observe("t", block_with_distinct(2048, 2), 0.0)
    assert off.telemetry()["t"]["windows"] == 0


# ------------------------------------------------------------------------------------------------
# Iteration-wise decay
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "iteration", "expected"),
    [
        ("step", 0, 2.0),
        ("step", 6553, 2.0),  # floor(6553 * 10 / 65536) = 0
        ("step", 6554, 1.9),  # floor(65540 / 65536) = 1
        ("step", 32768, 1.5),
        ("step", 65535, 1.1),
        ("step", 65536, 1.0),
        ("step", 10**7, 1.0),
        ("linear", 0, 2.0),
        ("linear", 16384, 1.75),
        ("linear", 32768, 1.5),
        ("linear", 65535, 2.0 - 65535 / 65536),
        ("linear", 65536, 1.0),
        ("log", 0, 2.0),
        ("log", 255, 2.0 - math.log(256) / math.log(65537)),
        ("log", 65535, 2.0 - math.log(65536) / math.log(65537)),
        ("log", 65536, 1.0),
        ("constant", 0, 1.0),
        ("constant", 100, 1.0),
    ],
)
def test_schedule_values(kind: str, iteration: int, expected: float) -> None:
    schedule = ErrorBoundSchedule(kind=kind)  # type: ignore[arg-type]
    assert decay_factor(schedule, iteration) == pytest.approx(expected, rel=1e-15, abs=1e-15)


def test_custom_step_schedule() -> None:
    s = ErrorBoundSchedule(kind="step", start_factor=3.0, decay_iterations=100, steps=4)
    assert [decay_factor(s, t) for t in (0, 24, 25, 50, 75, 99, 100)] == [
        3.0,
        3.0,
        2.5,
        2.0,
        1.5,
        1.5,
        1.0,
    ]
    with pytest.raises(ValueError, match="iteration=-1"):
        decay_factor(s, -1)


def test_bound_decays_in_training_only() -> None:
    config = LossyCommsConfig(
        default_bound=ErrorBound("relative", 0.6),
        tables={"a*": TableCodecConfig(bound=ErrorBound("absolute", 0.25))},
        schedule=ErrorBoundSchedule(kind="linear", start_factor=2.0, decay_iterations=4, steps=1),
    )
    bounds = AdaptiveBounds(["t", "abs"], config)
    assert bounds.bound("t") == ErrorBound("relative", 1.0)  # 1.2 capped at 1
    assert bounds.bound("abs") == ErrorBound("absolute", 0.5)  # absolute bounds decay too
    bounds.step()
    assert bounds.bound("abs") == ErrorBound("absolute", 0.25 * 1.75)
    bounds.eval()
    assert bounds.bound("abs") == ErrorBound("absolute", 0.25)  # eval: factor 1
    bounds.step()  # evaluation iterations do not count
    bounds.train()
    assert bounds.telemetry()["abs"]["iteration"] == 1
    for _ in range(3):
        bounds.step()
    assert bounds.bound("t") == ErrorBound("relative", 0.6)


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------


def _drive(bounds: AdaptiveBounds, iterations: range) -> list[tuple[float, str]]:
    seen = []
    for it in iterations:
        k = 900 if (it // 7) % 2 else 100  # index 0.12 or 0.9: the class moves
        bounds.observe("a", block_with_distinct(1024, k), 0.0)
        bounds.observe("b", block_with_distinct(1024, 3), 0.0)
        seen.append((bounds.bound("a").value, bounds.table_class_name("a")))
        bounds.step()
    return seen


def test_state_dict_round_trip_resumes_mid_schedule() -> None:
    config = LossyCommsConfig(
        schedule=ErrorBoundSchedule(kind="step", start_factor=2.0, decay_iterations=40, steps=4),
        homogenization=HomogenizationConfig(
            enabled=True, update_period=3, smoothing=0.5, warmup_windows=4
        ),
    )
    reference = AdaptiveBounds(["a", "b"], config)
    expected = _drive(reference, range(60))

    first = AdaptiveBounds(["a", "b"], config)
    assert _drive(first, range(23)) == expected[:23]
    state = first.state_dict()
    assert set(state) == {
        "iteration",
        "index",
        "windows",
        "table_class",
        "window_stats",
        "table_hash",
    }
    resumed = AdaptiveBounds(["a", "b"], config)
    resumed.load_state_dict(state)

    # Everything but the last absolute bound seen (transient telemetry) is restored.
    def strip(tel: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
        return {t: {k: v for k, v in d.items() if k != "last_abs_bound"} for t, d in tel.items()}

    assert strip(resumed.telemetry()) == strip(first.telemetry())
    assert _drive(resumed, range(23, 60)) == expected[23:]
    for key, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_state_dict_rejects_other_tables() -> None:
    state = AdaptiveBounds(["a", "b"], LossyCommsConfig()).state_dict()
    with pytest.raises(RuntimeError, match="built for other tables"):
        AdaptiveBounds(["b", "a"], LossyCommsConfig()).load_state_dict(state)
    with pytest.raises(ValueError, match="duplicates"):
        AdaptiveBounds(["a", "a"], LossyCommsConfig())
