"""comms.format: the candidates' admission, the pick, measured speeds and their fallback."""

from __future__ import annotations

import dataclasses
import json
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
from torchrec_lossy.planner.speeds import Speeds, default_speeds, measure_speeds


def test_casts_are_admitted_where_the_bound_can_be_met() -> None:
    # Inside the normal range each cast meets its per-value error...
    x = torch.tensor([3.0, -0.7, 1e-3, 1e3], dtype=torch.float32)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        err = ((x.to(dtype).float() - x).abs() / x.abs()).max().item()
        assert err <= CANDIDATES[name].value_error
    # ...outside it not (fp16 below 6.1e-5 or past 65504, bf16 on float32 subnormals): the
    # seam sends such a block exactly (tests/distributed/test_cast_blocks.py), so a per-value
    # or relative bound at least the cast's error admits it, an absolute one never (its scale
    # is the data's), nor a tighter one.
    tiny = torch.tensor([1e-6, 1e-40], dtype=torch.float32)
    assert ((tiny.to(torch.float16).float() - tiny).abs() / tiny).max() > 0.01
    assert ((tiny.to(torch.bfloat16).float() - tiny).abs() / tiny).max() > 2.0**-8
    for name in ("fp16", "bf16"):
        for bound in (ErrorBound("value", 0.5), ErrorBound("relative", 0.01)):
            assert admits(CANDIDATES[name], bound)
        assert not admits(CANDIDATES[name], ErrorBound("absolute", 1.0))
    assert admits(CANDIDATES["fp16"], ErrorBound("relative", 0.001))
    assert not admits(CANDIDATES["bf16"], ErrorBound("relative", 0.001))  # 2**-8 > 0.001
    assert not admits(CANDIDATES["fp16"], ErrorBound("value", 2.0**-12))
    for name in ("raw", "entropy", "packed"):  # exact, or error-bounded by construction
        assert admits(CANDIDATES[name], ErrorBound("relative", 0.0))


@pytest.mark.parametrize("codec_format", ["entropy", "packed"])
@pytest.mark.parametrize("bound", [ErrorBound("relative", 0.03), ErrorBound("absolute", 0.004)])
def test_admitted_codec_formats_meet_the_bound_on_adversarial_blocks(
    codec_format: str, bound: ErrorBound
) -> None:
    from torchrec_lossy.codec import compress, decompress
    from torchrec_lossy.config import CodecConfig

    gen = torch.Generator().manual_seed(3)
    blocks = [
        torch.randn(64, 16, generator=gen),
        torch.randn(64, 8, generator=gen) * 1e4 + 5e4,  # far from zero, wide
        torch.full((32, 4), 1e-7) * torch.arange(128).view(32, 4),  # tiny values
        torch.randn(16, 16, generator=gen).repeat(4, 1),  # repeated rows (the dedupe)
    ]
    assert admits(CANDIDATES[codec_format], bound)
    eb = [bound.value * float(b.max() - b.min()) if bound.mode == "relative" else bound.value
          for b in blocks]  # fmt: skip
    out = decompress(compress(blocks, eb, CodecConfig(format=codec_format)))  # type: ignore[arg-type]
    for b, o, e in zip(blocks, out, eb, strict=True):
        assert (o - b).abs().max().item() <= e


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
    # A free fp16 wins on the fast link where the bound admits it, never under an absolute one.
    free_fp16 = WireFormat("fp16", 2.0)
    with_fp16 = {**formats, "fp16": (free_fp16, free_fp16)}
    assert choose_format(with_fp16, ErrorBound("value", 0.01), fast_link).name == "fp16"
    assert choose_format(with_fp16, bound, fast_link).name == "fp16"
    assert choose_format(with_fp16, ErrorBound("absolute", 1.0), fast_link).name == "raw"


def test_format_key_is_validated_and_resolved_per_table() -> None:
    config = LossyCommsConfig(
        format="entropy",
        tables={"a": TableCodecConfig(format="raw"), "b": TableCodecConfig(compress=False)},
    )
    assert [config.table(n).format for n in ("a", "b", "c")] == ["raw", "raw", "entropy"]
    assert [config.table(n).compress for n in ("a", "b", "c")] == [False, False, True]
    assert LossyCommsConfig().format == "auto"
    # A cast table skips the codec (the seam casts its blocks where their bound admits it).
    cast = LossyCommsConfig(format="fp16", tables={"b": TableCodecConfig(format="bf16")})
    assert [cast.table(n).format for n in ("a", "b")] == ["fp16", "bf16"]
    assert [cast.table(n).compress for n in ("a", "b")] == [False, False]
    with pytest.raises(ConfigError, match=r"format='fp8' is invalid: allowed one of 'auto', 'raw'"):
        LossyCommsConfig(format="fp8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"tables.format='zstd' is invalid"):
        TableCodecConfig(format="zstd")  # type: ignore[arg-type]


TABLES = [EmbeddingTableConfig(f"t{i}", 1000 * (i + 1), 16) for i in range(3)]


def test_measured_speeds_are_sane_and_cached_per_shape() -> None:
    cache: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the example runs (OMP_NUM_THREADS=1); threads on a busy
    try:  # machine make a tiny index_add_ take 0.1 s
        speeds = measure_speeds(TABLES, 64, LossyCommsConfig(), torch.device("cpu"), cache, reps=1)
    finally:
        torch.set_num_threads(threads)
    assert speeds.source.startswith("measured on cpu, 3 blocks x 64 rows")
    assert set(speeds.formats) == {"entropy", "packed", "fp16", "bf16", "dedupe"}
    assert all(0 < v < 1e5 for pair in speeds.formats.values() for v in pair)
    # Both codec formats' ratios on the same blocks: the packed one is the larger payload.
    assert set(speeds.ratios) == {"entropy", "packed", "dedupe"}
    assert speeds.ratios["dedupe"] >= 1.0  # rows / distinct rows
    assert 1.0 < speeds.ratios["packed"] <= speeds.ratios["entropy"]
    assert speeds.ratio_factor("packed") == speeds.ratios["packed"] / speeds.ratios["entropy"]
    again = measure_speeds(TABLES, 64, LossyCommsConfig(), torch.device("cpu"), cache)
    assert again is speeds and len(cache) == 1
    # Saved as JSON (a resumed run plans from its first attempt's figures) and read back equal.
    assert Speeds.from_dict(json.loads(json.dumps(speeds.to_dict()))) == speeds
    with pytest.raises(ValueError, match=r"unknown keys \['gib'\]; re-measure"):
        Speeds.from_dict({**speeds.to_dict(), "gib": 1})
    with pytest.raises(ValueError, match="need \\(encode, decode\\) per format"):
        Speeds.from_dict({**speeds.to_dict(), "formats": {"packed": [1.0]}})


def test_failed_calibration_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torchrec_lossy.planner import speeds as speeds_mod

    # A broken clock: every trial takes zero time, every throughput is infinite.
    monkeypatch.setattr(speeds_mod, "_clock", lambda: 0.0)
    with caplog.at_level(logging.WARNING):
        got = measure_speeds(TABLES, 64, LossyCommsConfig(), torch.device("cpu"), reps=1,
                             world_size=2)  # fmt: skip
    assert got.formats == default_speeds("cpu", "x").formats
    assert got.source.startswith("defaults: calibration failed") and "nonsense" in got.source
    # One warning for it all: the seam's fixed cost, timed by the same clock, is not timed.
    assert got.seam_ms is None
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_a_burst_of_load_at_start_up_does_not_decide_the_format(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import itertools
    import time

    from torchrec_lossy.planner import speeds as speeds_mod
    from torchrec_lossy.planner.lossy_model import LossyCommsModel

    tables = [EmbeddingTableConfig(f"t{i}", 1000 * (i + 1), 16, (f"f{i}",)) for i in range(3)]
    rows, reps, burst_s = 1024, 3, 0.2
    # Load at start-up: the first `reps` trials each take burst_s longer. Timed one format
    # after the other, they were all of the entropy encoder's trials (2.5e-4 GiB/s, a sane
    # figure, 1,000x too slow); interleaved, one trial of three formats.
    reads = itertools.count()
    monkeypatch.setattr(
        speeds_mod,
        "_clock",
        lambda: time.perf_counter() + burst_s * min((next(reads) + 1) // 2, reps),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = measure_speeds(tables, rows, LossyCommsConfig(), torch.device("cpu"), reps=reps)
    finally:
        torch.set_num_threads(threads)
    raw_gib = 3 * rows * 16 * 4 / 2**30
    assert got.source.startswith("measured") and got.formats["entropy"][0] > 10 * raw_gib / burst_s
    # On a slow link (16 Mbit/s) the codec pays many times over; priced at the burst's speed it
    # would not: raw or a cast (half the bytes at the casts' measured speed).
    plan = _one_host_plan(0.002, tables=3, dim=16, rows=1000, batch=2 * rows)
    bw = gib_s_to_bytes_per_ms(0.002)
    assert LossyCommsModel(plan, bw, speeds=got).table_format("t0") in ("entropy", "packed")
    slowed = {f: (raw_gib / burst_s, got.formats[f][1]) for f in ("entropy", "packed")}
    slowed_speeds = dataclasses.replace(got, formats={**got.formats, **slowed})
    slowed_pick = LossyCommsModel(plan, bw, speeds=slowed_speeds).table_format("t0")
    assert slowed_pick in ("raw", "fp16", "bf16")


def test_packed_format_key_sets_the_codec_format_and_one_codec_format_per_run() -> None:
    from torchrec_lossy.config import CodecConfig

    packed = LossyCommsConfig(format="packed", tables={"a": TableCodecConfig(format="raw")})
    assert packed.codec.format == "packed" and packed.table("b").compress
    assert packed.table("b").format == "packed" and not packed.table("a").compress
    per_table = LossyCommsConfig(tables={"a": TableCodecConfig(format="packed")})
    assert per_table.codec.format == "packed"
    with pytest.raises(ConfigError, match=r"format='entropy/packed' is invalid: allowed one"):
        LossyCommsConfig(format="entropy", tables={"a": TableCodecConfig(format="packed")})
    with pytest.raises(ConfigError, match=r"format='entropy' is invalid: allowed 'packed'"):
        LossyCommsConfig(format="entropy", codec=CodecConfig(format="packed"))


def _one_host_plan(
    link_gib_s: float, tables: int = 3, dim: int = 32, rows: int = 10_000, batch: int = 512
) -> object:
    """Two ranks on one host's link of ``link_gib_s``, ``tables`` single-feature tables."""
    from torchrec_lossy.config import LossyPlanConfig, PlannerConfig, TopologyConfig

    return LossyPlanConfig(
        embedding_tables=tuple(
            EmbeddingTableConfig(f"t{i}", rows, dim, (f"f{i}",)) for i in range(tables)
        ),
        topology=TopologyConfig(
            world_size=2, compute_device="cpu", intra_host_bandwidth_gib_s=link_gib_s
        ),
        planner=PlannerConfig(global_batch_size=batch),
    )


def _speeds(entropy: tuple[float, float], packed: tuple[float, float]) -> object:
    from torchrec_lossy.planner.speeds import Speeds

    casts = {"fp16": (3.0, 3.0), "bf16": (3.0, 3.0)}
    return Speeds({"entropy": entropy, "packed": packed, **casts}, "test",
                  ratios={"entropy": 30.0, "packed": 24.0})  # fmt: skip


def test_auto_picks_the_codec_format_from_measured_speeds_and_raw_on_a_fast_link() -> None:
    from torchrec_lossy.planner.lossy_model import LossyCommsModel

    slow = _one_host_plan(0.116)
    bw = gib_s_to_bytes_per_ms(0.116)
    # Packed codes 4x faster at 0.8x the ratio: it wins on a 1 Gbit/s link...
    model = LossyCommsModel(slow, bw, speeds=_speeds((0.3, 1.0), (1.2, 4.0)))
    assert model.codec_format == "packed"
    comms = model.resolved_comms(["t0", "t1", "t2"])
    assert comms.codec.format == "packed" and comms.format == "packed"
    assert {comms.table(n).format for n in ("t0", "t1", "t2")} == {"packed"}
    assert "packed" in model.pays_note and "entropy" in model.pays_note  # both estimates
    # ...as fast as the entropy format it loses (a smaller ratio for nothing).
    model = LossyCommsModel(slow, bw, speeds=_speeds((1.0, 2.0), (1.0, 2.0)))
    assert model.codec_format == "entropy"
    assert model.resolved_comms(["t0"]).codec.format == "entropy"
    # On a link faster than either codec every table goes raw.
    fast = _one_host_plan(50.0)
    model = LossyCommsModel(fast, gib_s_to_bytes_per_ms(50.0), speeds=_speeds((1, 2), (2, 4)))
    comms = model.resolved_comms(["t0", "t1", "t2"])
    assert [comms.table(n).compress for n in ("t0", "t1", "t2")] == [False] * 3
    # A codec format the config names is the only one considered.
    named = dataclasses.replace(slow, comms=LossyCommsConfig(format="entropy"))
    model = LossyCommsModel(named, bw, speeds=_speeds((0.3, 1.0), (1.2, 4.0)))
    assert model.codec_format == "entropy"


def test_auto_picks_a_cast_only_where_the_bound_admits_it() -> None:
    from torchrec_lossy.planner.lossy_model import LossyCommsModel
    from torchrec_lossy.planner.speeds import Speeds

    link = 5.0  # GiB/s: raw 0.4 s per GiB both ways, a cast at 100 GiB/s 0.24, the codec >2
    plan = _one_host_plan(link)
    tables = {
        "t1": TableCodecConfig(bound=ErrorBound("absolute", 0.001)),  # no cast: its scale
        "t2": TableCodecConfig(bound=ErrorBound("relative", 0.001)),  # fp16 only: 2**-8 > it
    }
    plan = dataclasses.replace(plan, comms=LossyCommsConfig(tables=tables))
    casts = {"fp16": (100.0, 100.0), "bf16": (100.0, 100.0)}
    speeds = Speeds({"entropy": (0.3, 1.0), "packed": (0.3, 1.0), **casts}, "test",
                    ratios={"entropy": 30.0, "packed": 24.0})  # fmt: skip
    model = LossyCommsModel(plan, gib_s_to_bytes_per_ms(link), speeds=speeds)
    assert [model.table_format(t) for t in ("t0", "t1", "t2")] == ["fp16", "raw", "fp16"]
    est = model._choice(30.0, "t0", gib_s_to_bytes_per_ms(link)).estimates
    assert est["fp16"] == est["bf16"] < est["raw"] < est["entropy"]  # the tie: fp16
    comms = model.resolved_comms(["t0", "t1", "t2"])
    assert [comms.table(t).format for t in ("t0", "t1", "t2")] == ["fp16", "raw", "fp16"]
    assert not any(comms.table(t).compress for t in ("t0", "t1", "t2"))
    assert "fp16 for 2 tables" in model.pays_note
    # bf16 alone faster: the relative 0.001 table keeps fp16, the default one takes bf16.
    faster = dataclasses.replace(speeds, formats={**speeds.formats, "bf16": (200.0, 200.0)})
    model = LossyCommsModel(plan, gib_s_to_bytes_per_ms(link), speeds=faster)
    assert [model.table_format(t) for t in ("t0", "t1", "t2")] == ["bf16", "raw", "fp16"]
    # A gradient bound no cast meets: the cast table's gradient priced exact (fp32).
    tight = dataclasses.replace(plan.comms, backward_bound=ErrorBound("value", 2.0**-13))
    model = LossyCommsModel(dataclasses.replace(plan, comms=tight), gib_s_to_bytes_per_ms(link),
                            speeds=speeds)  # fmt: skip
    fwd, bwd = model._cast_wires("fp16")
    assert fwd.ratio == 2.0 and bwd.ratio == 1.0
    # On a link faster than a cast, raw.
    fast = dataclasses.replace(_one_host_plan(500.0), comms=LossyCommsConfig(tables=tables))
    model = LossyCommsModel(fast, gib_s_to_bytes_per_ms(500.0), speeds=speeds)
    assert {model.table_format(t) for t in ("t0", "t1", "t2")} == {"raw"}


def test_auto_takes_torchrecs_own_path_only_where_nothing_is_coded_and_dedupe_does_not_pay() -> (
    None
):
    from torchrec_lossy.planner.lossy_model import LossyCommsModel

    def speeds(dedupe: tuple[float, float] | None) -> Speeds:
        base = _speeds((0.3, 1.0), (0.3, 1.0))
        if dedupe is None:
            return base
        return dataclasses.replace(
            base,
            formats={**base.formats, "dedupe": dedupe},
            ratios={**base.ratios, "dedupe": 4.0},
        )

    fast = _one_host_plan(50.0)
    bw = gib_s_to_bytes_per_ms(50.0)
    model = LossyCommsModel(fast, bw, speeds=speeds((1.0, 0.3)))
    assert model.torchrec_path and "TorchRec's own all-to-all" in model.pays_note
    # Dedupe cheap enough to pay for its 4x fewer bytes: the seam stays, raw.
    model = LossyCommsModel(fast, bw, speeds=speeds((1e4, 1e4)))
    assert not model.torchrec_path and "the seam raw" in model.pays_note
    # Not measured, a table coded, or a format forced: never.
    assert not LossyCommsModel(fast, bw, speeds=speeds(None)).torchrec_path
    slow = _one_host_plan(0.116)
    assert not LossyCommsModel(
        slow, gib_s_to_bytes_per_ms(0.116), speeds=speeds((1.0, 0.3))
    ).torchrec_path
    forced = dataclasses.replace(fast, comms=LossyCommsConfig(format="raw"))
    assert not LossyCommsModel(forced, bw, speeds=speeds((1.0, 0.3))).torchrec_path


def test_the_seams_dedupe_shrinks_raw_bytes_and_codec_time_alike() -> None:
    from torchrec_lossy.planner.lossy_model import LossyCommsModel

    slow = _one_host_plan(0.116)
    bw = gib_s_to_bytes_per_ms(0.116)
    plain = _speeds((0.3, 1.0), (0.3, 1.0))
    deduped = dataclasses.replace(plain, ratios={**plain.ratios, "dedupe": 4.0})
    a = LossyCommsModel(slow, bw, speeds=plain)._choice(30.0, "t0", bw).estimates
    b = LossyCommsModel(slow, bw, speeds=deduped)._choice(30.0, "t0", bw).estimates
    assert b["raw"] == pytest.approx(a["raw"] / 4)  # a quarter of the rows travel
    # The coded wire time is the codec ratios', unchanged (the gradient's: backward_ratio).
    wire = 1 / (30.0 * bw) + 1 / (slow.planner.backward_ratio * bw)
    assert b["entropy"] - wire == pytest.approx((a["entropy"] - wire) / 4)  # codec time too


def _bench_plan(link_gib_s: float) -> object:
    """The e2e bench's layout: 26 single-feature tables of dim 128, two ranks on one link."""
    return _one_host_plan(link_gib_s, tables=26, dim=128, rows=100_000, batch=4096)


def _run3_speeds(seam_ms: float | None) -> object:
    """Speeds as the quiet run 3 measured them at 2,048 rows (docs/benchmarks.md)."""
    from torchrec_lossy.planner.speeds import Speeds

    return Speeds(
        {"entropy": (0.93, 2.9), "packed": (0.918, 2.99), "dedupe": (5.8, 1.15),
         "fp16": (13.5, 10.7), "bf16": (13.6, 11.5)},
        "test", round_ms=0.104, ratios={"entropy": 66.4, "packed": 40.8, "dedupe": 3.74},
        seam_ms=seam_ms, rows=2048,
    )  # fmt: skip


def test_the_seams_measured_fixed_cost_sends_a_fast_link_to_torchrecs_path() -> None:
    from torchrec_lossy.planner.lossy_model import LossyCommsModel

    ten = _bench_plan(1.16)  # 10 Gbit/s
    bw = gib_s_to_bytes_per_ms(1.16)
    # Run 3's miss: without the fixed cost the seam (raw, 3.7x fewer rows) priced cheaper.
    assert not LossyCommsModel(ten, bw, speeds=_run3_speeds(None)).torchrec_path
    # Its fixed 36.6 ms a step (timed as run 3's layout takes here) is more than the ~22 ms of
    # fp32 wire the seam could save: TorchRec's own all-to-all, every table raw, said once.
    model = LossyCommsModel(ten, bw, speeds=_run3_speeds(36.6))
    assert model.torchrec_path
    assert model.pays_note.count("TorchRec's own all-to-all") == 1 and "36.8 of it" in (
        model.pays_note
    )
    assert {model.table_format(f"t{i}") for i in range(26)} == {"raw"}
    assert {model.for_table(f"t{i}").fwd.ratio for i in range(26)} == {1.0}
    # Free of that cost the seam's dedupe pays: the seam, raw.
    assert not LossyCommsModel(ten, bw, speeds=_run3_speeds(0.0)).torchrec_path
    # On 1 Gbit/s the codec pays for the fixed cost many times over: the seam, coded.
    one = _bench_plan(0.116)
    model = LossyCommsModel(one, gib_s_to_bytes_per_ms(0.116), speeds=_run3_speeds(36.6))
    # (At the configured ratio 10 the codec and a cast of the 3.74x fewer distinct rows are
    # within 4% of each other: either, never raw.)
    assert not model.torchrec_path and model.table_format("t0") != "raw"
    # A format forced, or a table configured coded: never TorchRec's path.
    forced = dataclasses.replace(ten, comms=LossyCommsConfig(format="entropy"))
    assert not LossyCommsModel(forced, bw, speeds=_run3_speeds(36.6)).torchrec_path
    one_coded = dataclasses.replace(
        ten, comms=LossyCommsConfig(tables={"t3": TableCodecConfig(format="entropy")})
    )
    model = LossyCommsModel(one_coded, bw, speeds=_run3_speeds(36.6))
    assert not model.torchrec_path and model.table_format("t3") == "entropy"


def test_measure_speeds_times_the_seams_fixed_cost_and_agrees_on_it() -> None:
    tables = [EmbeddingTableConfig(f"t{i}", 1000, 16, (f"f{i}",)) for i in range(4)]
    speeds = measure_speeds(tables, 256, LossyCommsConfig(), torch.device("cpu"), reps=1,
                            world_size=2)  # fmt: skip
    assert speeds.rows == 256 and speeds.seam_ms is not None and speeds.seam_ms >= 0.0
    assert "seam's fixed cost" in speeds.describe()
    assert (
        measure_speeds(tables, 256, LossyCommsConfig(), torch.device("cpu"), reps=1).seam_ms is None
    )
