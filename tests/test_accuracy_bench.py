"""The accuracy bench's own logic: variant specs, the YAML they write, the paired summary.

No training runs here (the bench itself does those); these check that a variant given on the
command line becomes a config the example accepts and that the paired deltas, the seed spread
and the target verdict are computed as documented.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import accuracy_bench as ab  # noqa: E402

from torchrec_lossy.config import LossyPlanConfig, load_yaml  # noqa: E402


def test_variant_spec_parses_comm_qcomm_and_dotted_comms_keys() -> None:
    v = ab.parse_variant("x=lossy;backward=bf16;default_bound.value=0.02;input_dist.enabled=false")
    assert (v.name, v.comm, v.qcomm_backward) == ("x", "lossy", None)
    assert v.comms == {
        "backward": "bf16",
        "default_bound.value": 0.02,
        "input_dist.enabled": False,
    }
    q = ab.parse_variant("m=mx4;qcomm_backward=mx4")
    assert (q.comm, q.qcomm_backward, q.comms) == ("mx4", "mx4", {})


@pytest.mark.parametrize(
    "spec",
    ["nocomm", "x=zstd", "=lossy", "x=lossy;backward", "x=mx4;backward=bf16"],
)
def test_bad_variant_specs_are_rejected_with_the_expected_form(spec: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--variant"):
        ab.parse_variant(spec)


def test_variant_yaml_is_a_valid_plan_config(tmp_path: Path) -> None:
    v = ab.parse_variant("x=lossy;backward=lossy;default_bound.value=0.02")
    path = ab._variant_config(v, tmp_path)
    assert path is not None
    cfg = load_yaml(LossyPlanConfig, path)
    assert cfg.comms.backward == "lossy"
    assert cfg.comms.default_bound.value == 0.02
    assert cfg.comms.format == "entropy"  # every table coded, whatever the link
    bval = load_yaml(LossyPlanConfig, ab._variant_config(ab.BUILTIN["lossy-bval"], tmp_path))
    assert (bval.comms.backward_bound.mode, bval.comms.backward_bound.value) == ("value", 1 / 32)
    assert bval.comms.format == "entropy"
    # The default variant too (the example's default, comms.format auto, may send raw).
    default = ab._variant_config(ab.BUILTIN["lossy"], tmp_path)
    assert default is not None and load_yaml(LossyPlanConfig, default).comms.format == "entropy"
    assert ab._variant_config(ab.BUILTIN["mx4"], tmp_path) is None


def test_example_args_pair_the_runs() -> None:
    args = ab.parse_args(["--datasets", "synthetic"])
    out = Path("/tmp/never-written")
    a = ab.example_args(args, "synthetic", ab.BUILTIN["none"], 1, out)
    b = ab.example_args(args, "synthetic", ab.BUILTIN["mx4"], 1, out)
    # Only the comm flags and the output path differ between two modes of one seed.
    strip = {"--comm", "--qcomm-backward", "--metrics-json"}

    def fixed(xs: list[str]) -> list[str]:
        return [x for i, x in enumerate(xs) if x not in strip and xs[i - 1] not in strip]

    assert fixed(a) == fixed(b)
    assert b[b.index("--qcomm-backward") + 1] == "mx4"
    assert a[a.index("--sharding") + 1] == "table_wise"
    assert int(a[a.index("--steps") + 1]) * 2 * int(a[a.index("--batch-size") + 1]) >= 1_000_000


def _run(
    mode: str,
    seed: int,
    auc: float,
    logloss: float = 0.5,
    wire: float = 100.0,
    train_loss: float | None = None,
) -> dict[str, Any]:
    final_train = logloss if train_loss is None else train_loss
    return {
        "dataset": "synthetic",
        "mode": mode,
        "seed": seed,
        "rss": {"workers": [{"peak_mib": 600.0, "growth_2nd_half_mib": 1.0}]},
        "metrics": {
            "final": {"auc": auc, "logloss": logloss, "train_loss": final_train, "eval_rows": 10},
            "history": {"train_loss": [0.7, logloss]},
            "run": {"steps_run": 2, "global_batch_size": 4, "comm_description": mode},
            "plan": {"summary": "TW 26"},
            "comms": {
                "fwd_ratio": 1.0,
                "bwd_ratio": 2.0,
                "input_wire_bytes_per_step": wire,
                "fwd_wire_bytes_per_step": 2 * wire,
                "bwd_wire_bytes_per_step": wire,
            },
            "timing": {"step_time_s_median": 0.01},
        },
    }


def test_summary_pairs_by_seed_and_checks_the_target() -> None:
    runs = [
        _run("none", 0, 0.760),
        _run("none", 1, 0.764),  # spread 0.004
        _run("lossy", 0, 0.7598, wire=1.0),
        _run("lossy", 1, 0.7642, wire=1.0),  # dAUC -0.0002, +0.0002: mean 0, SE 0.0002
        _run("mx4", 0, 0.750, wire=10.0),
        _run("mx4", 1, 0.752, wire=10.0),  # mean -0.011: lost
        _run("lossy-bf16", 0, 0.770),
        _run("lossy-bf16", 1, 0.774),  # +0.010: a gain is no loss
        _run("lossy-rtn", 0, 0.760, logloss=0.501),
        _run("lossy-rtn", 1, 0.764, logloss=0.501),  # same AUC, log loss +0.001: missed
    ]
    variants = [ab.BUILTIN[n] for n in ("none", "lossy", "mx4", "lossy-bf16", "lossy-rtn")]
    s = ab.summarize(runs, variants, "mx4")["synthetic"]
    assert s["none_auc_spread"] == pytest.approx(0.004)
    lossy = s["modes"]["lossy"]
    assert lossy["dauc_by_seed"] == {0: pytest.approx(-0.0002), 1: pytest.approx(0.0002)}
    assert lossy["dauc_mean"] == pytest.approx(0.0, abs=1e-12)
    assert lossy["dauc_se"] == pytest.approx(0.0002)
    assert lossy["dauc_vs_ref_mean"] == pytest.approx(0.011)
    assert lossy["step_wire_bytes"] == pytest.approx(4.0)
    assert lossy["bytes_vs_none"] == pytest.approx(100.0)
    assert lossy["target"]["met"] and lossy["target"]["not_worse_than_ref"]
    mx4 = s["modes"]["mx4"]
    assert mx4["dauc_mean"] == pytest.approx(-0.011) and not mx4["target"]["met"]
    assert s["modes"]["lossy-bf16"]["target"]["met"]
    rtn = s["modes"]["lossy-rtn"]
    assert rtn["dlogloss_mean"] == pytest.approx(0.001) and not rtn["target"]["met"]
    assert "target" not in s["modes"]["none"]
    table = ab.format_table({"synthetic": s})
    assert "| mx4 | 2 |" in table and "MISSED" in table and "+0.0000 ± 0.0002" in table
    assert "| 100.0x |" in table


def test_a_mode_worse_than_the_reference_misses_the_target() -> None:
    runs = [
        _run("none", 0, 0.760),
        _run("none", 1, 0.770),
        _run("mx4", 0, 0.7601),
        _run("mx4", 1, 0.7701),
        _run("lossy", 0, 0.7598),
        _run("lossy", 1, 0.7698),  # -0.0002 vs none (within the floor), -0.0003 vs mx4, SE 0
    ]
    variants = [ab.BUILTIN[n] for n in ("none", "mx4", "lossy")]
    target = ab.summarize(runs, variants, "mx4")["synthetic"]["modes"]["lossy"]["target"]
    assert not target["not_worse_than_ref"] and not target["met"]


def test_seed_lists_take_ranges(tmp_path: Path) -> None:
    assert ab.parse_args(["--seeds", "0-3,7"]).seeds == [0, 1, 2, 3, 7]
    args = ab.parse_args(["--datasets", "movielens"])
    assert len(args.seeds) == 20 and args.ref == "mx4"
    flags = ab.example_args(args, "movielens", ab.BUILTIN["lossy"], 0, tmp_path)
    assert flags[flags.index("--dataset") + 1] == "criteo-kaggle"
    assert flags[flags.index("--data-path") + 1].endswith("movielens_small_criteo.tsv.gz")


def test_tail_reports_spread_worst_seed_and_train_loss_gap() -> None:
    # Issue 32's pattern: a mean at parity hiding one bad seed whose training loss ended high.
    none = [0.760, 0.770, 0.765, 0.772]
    lossy = [0.7605, 0.7695, 0.7502, 0.7723]  # +0.0005, -0.0005, -0.0148 (seed 2), +0.0003
    mx4 = [0.7590, 0.7690, 0.7640, 0.7710]  # -0.001 each: sd 0
    runs = []
    for seed in range(4):
        runs += [
            _run("none", seed, none[seed], train_loss=0.296),
            _run("lossy", seed, lossy[seed], train_loss=0.351 if seed == 2 else 0.297),
            _run("mx4", seed, mx4[seed], logloss=0.5 + 0.001 * seed, train_loss=0.300),
        ]
    variants = [ab.BUILTIN[n] for n in ("none", "lossy", "mx4")]
    s = ab.summarize(runs, variants, "mx4")["synthetic"]["modes"]
    lossy_s = s["lossy"]
    deltas = [a - b for a, b in zip(lossy, none, strict=True)]
    assert lossy_s["dauc_tail"]["sd"] == pytest.approx(ab.statistics.stdev(deltas))
    assert lossy_s["dauc_tail"]["worst"] == {"seed": 2, "delta": pytest.approx(-0.0148)}
    assert lossy_s["dfinal_train_loss_by_seed"][2] == pytest.approx(0.055)
    assert lossy_s["dfinal_train_loss_mean"] == pytest.approx((0.055 + 3 * 0.001) / 4)
    assert lossy_s["dfinal_train_loss_tail"]["worst"] == {"seed": 2, "delta": pytest.approx(0.055)}
    assert lossy_s["dlogloss_tail"]["sd"] == pytest.approx(0.0, abs=1e-12)
    mx4_s = s["mx4"]
    assert mx4_s["dlogloss_tail"]["worst"] == {"seed": 3, "delta": pytest.approx(0.003)}
    assert mx4_s["dauc_tail"]["sd"] == pytest.approx(0.0, abs=1e-9)
    # One seed past the reference's worst (-0.001) misses the tail; the mean target is judged
    # apart from it.
    assert lossy_s["tail"]["worst_floor"] == pytest.approx(-0.001)
    assert lossy_s["tail"]["met"] is False and mx4_s["tail"]["met"] is True
    table = ab.format_table({"synthetic": ab.summarize(runs, variants, "mx4")["synthetic"]})
    assert "synthetic tail:" in table
    assert "| lossy | 4 |" in table and "-0.0148 (s2)" in table and "+0.0550 (s2)" in table


def test_tail_sd_is_judged_against_the_reference_in_the_same_run() -> None:
    runs = []
    for seed, (n, a, m) in enumerate([(0.76, 0.761, 0.758), (0.77, 0.769, 0.772)]):
        runs += [_run("none", seed, n), _run("lossy", seed, a), _run("mx4", seed, m)]
    variants = [ab.BUILTIN[n] for n in ("none", "lossy", "mx4")]
    modes = ab.summarize(runs, variants, "mx4")["synthetic"]["modes"]
    # lossy: +0.001, -0.001 (sd 0.0014); mx4: -0.002, +0.002 (sd 0.0028): half MX4's spread.
    assert modes["lossy"]["tail"]["dauc_sd_vs_ref"] == pytest.approx(0.5)
    assert modes["lossy"]["tail"]["met"]
    runs[1] = _run("lossy", 0, 0.764)  # +0.004, -0.001: sd 0.0035 > 1.2 x 0.0028
    modes = ab.summarize(runs, variants, "mx4")["synthetic"]["modes"]
    assert modes["lossy"]["tail"]["dauc_sd_vs_ref"] == pytest.approx(1.25)
    assert modes["lossy"]["tail"]["met"] is False
    # Without the reference's runs the sd cannot be judged: said so, not passed or failed.
    alone = ab.summarize([r for r in runs if r["mode"] != "mx4"], variants[:2], "mx4")
    assert alone["synthetic"]["modes"]["lossy"]["tail"]["met"] is None
    assert "| sd not judged |" in ab.format_table(alone)


def test_tail_floor_is_the_worse_of_mx4s_and_fp16s_worst_seed() -> None:
    # Seed chaos: FP16 both ways (near-lossless) has a seed at -0.0092; a mode whose worst seed
    # is milder and whose spread is within 1.2x MX4's meets the tail, -0.005 or not.
    none = [0.760, 0.770, 0.765, 0.772]
    deltas = {
        "mx4": [-0.0088, 0.0030, -0.0010, 0.0020],
        "fp16": [0.0010, -0.0092, 0.0020, 0.0030],
        "lossy": [-0.0065, 0.0020, 0.0000, 0.0010],  # worst -0.0065: past -0.005, above -0.0092
        "lossy-bval": [-0.0100, 0.0030, 0.0000, 0.0010],  # past both worsts
    }
    runs = [_run("none", k, a) for k, a in enumerate(none)]
    runs += [_run(m, k, none[k] + d) for m, ds in deltas.items() for k, d in enumerate(ds)]
    variants = [ab.BUILTIN[n] for n in ("none", *deltas)]
    modes = ab.summarize(runs, variants, "mx4")["synthetic"]["modes"]
    assert modes["lossy"]["tail"]["worst_floor"] == pytest.approx(-0.0092)
    assert modes["lossy"]["tail"]["dauc_sd_vs_ref"] <= ab.SD_VS_REF_CEIL
    assert modes["lossy"]["tail"]["met"] is True
    assert modes["lossy-bval"]["tail"]["met"] is False
    # Without MX4 or FP16 in the run, the fixed floor judges the worst seed.
    alone = [r for r in runs if r["mode"] in ("none", "lossy")]
    solo = ab.summarize(alone, [ab.BUILTIN["none"], ab.BUILTIN["lossy"]], "mx4")["synthetic"]
    assert solo["modes"]["lossy"]["tail"]["worst_floor"] == ab.WORST_DAUC_FLOOR
    assert solo["modes"]["lossy"]["tail"]["met"] is False
