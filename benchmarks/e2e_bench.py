"""End-to-end benchmark: the DLRM example once per ``--comm`` mode, same seed, data and steps.

Runs ``examples/dlrm_criteo.py`` as a 2-process torchrun job per mode (over the rate-limited
two-namespace link of ``scripts/netns_cluster.sh`` by default, or on localhost with
``--no-netns``), collects each run's ``--metrics-json`` and prints one table: AUC, log loss, step
time, all-to-all bytes (forward, backward and the KJT input dist) and the speedup over ``none``,
plus the targets (lossy at least 1.38x faster than ``none`` and faster than ``mx4``;
``|AUC(lossy) - AUC(none)| <= max(0.0002, seed spread of none)``). ``none`` runs with several
seeds to measure that spread. The ``mx4`` baseline is what TorchRec users run in production:
MX4 forward and MX4 backward (``--qcomm-backward auto``); the other qcomm modes send fp16
gradients. FP8 is not offered: fbgemm-gpu-cpu 1.8.0's FP8 fails (row-wise) or clips at 0.9375
(plain) on CPU.

    sudo python benchmarks/e2e_bench.py                        # 1 Gbit/s netns link, defaults
    sudo python benchmarks/e2e_bench.py --nproc-per-node 2 --modes lossy --intra-host raw
    python benchmarks/e2e_bench.py --no-netns --steps 50       # localhost (loopback) instead
    python benchmarks/e2e_bench.py --modes none,lossy --rate 500mbit --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from table_fmt import cell as _f

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "dlrm_criteo.py"
NETNS = ROOT / "scripts" / "netns_cluster.sh"
# "lossy" is the sharder with the config's comms.format (auto by default); the modes below run
# the same sharder with comms.format forced (a config copy), e.g. issue 34's "entropy" target.
FORCED_FORMAT_MODES: dict[str, str] = {"entropy": "entropy", "packed": "packed", "raw": "raw"}
MODES = ("none", "fp16", "bf16", "int8", "mx4", "lossy", *FORCED_FORMAT_MODES)
QCOMM_BACKWARD = ("auto", "fp32", "fp16", "bf16", "mx4")
SPEEDUP_TARGET = 1.38
AUC_FLOOR = 0.0002
LINK_KEYS = ("fwd_same_host", "fwd_cross_host", "bwd_same_host", "bwd_cross_host")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _rate_gbit(rate: str) -> float:
    """tc rate string (``1gbit``, ``500mbit``, ``100kbit``) in Gbit/s."""
    r = rate.strip().lower()
    for suffix, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6), ("bit", 1e-9)):
        if r.endswith(suffix):
            return float(r[: -len(suffix)]) * scale
    raise argparse.ArgumentTypeError(f"--rate {rate!r}: use a tc rate such as 1gbit or 500mbit")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the bench's command line.

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        The flags.
    """
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--modes", default="none,fp16,mx4,lossy", help="comma-separated --comm modes")
    ap.add_argument("--seeds", type=_ints, default=[0], help="seeds of every mode")
    ap.add_argument("--none-seeds", type=_ints, default=[0, 1, 2], help="seeds of 'none'")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=2048, help="per rank")
    ap.add_argument("--embedding-dim", type=int, default=128)
    ap.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank")
    ap.add_argument("--sharding", default="table_wise", choices=("auto", "table_wise"))
    ap.add_argument(
        "--dataset",
        default="synthetic",
        choices=("synthetic", "criteo-kaggle", "criteo-1tb", "criteo-npy"),
        help="the example's --dataset (file datasets loop over the file for --steps)",
    )
    ap.add_argument("--data-path", default=None, help="the example's --data-path")
    ap.add_argument("--config", default=str(ROOT / "configs" / "criteo_kaggle.yaml"))
    ap.add_argument(
        "--qcomm-backward",
        default="auto",
        choices=QCOMM_BACKWARD,
        help="gradient precision of the qcomm modes; auto: mx4 for mx4 (TorchRec's MX4 both "
        "ways), fp16 for the others",
    )
    net = ap.add_mutually_exclusive_group()
    net.add_argument("--netns", dest="netns", action="store_true", default=True)
    net.add_argument("--no-netns", dest="netns", action="store_false", help="localhost instead")
    ap.add_argument("--rate", default="1gbit", help="netns link rate (tc syntax)")
    ap.add_argument(
        "--rates",
        default=None,
        help="several links in one invocation, comma-separated tc rates and/or 'localhost' "
        "(e.g. 1gbit,10gbit,localhost): every mode at each, then one table of each mode's step "
        "time relative to the fastest TorchRec option (none / fp16 / mx4) at that rate",
    )
    ap.add_argument("--port", type=int, default=29581, help="netns rendezvous port")
    ap.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="ranks per host (netns node); on localhost the job runs 2 x this many ranks",
    )
    ap.add_argument(
        "--intra-host",
        choices=("auto", "raw", "coded"),
        default=None,
        help="comms.intra_host of the lossy mode (a copy of --config with it set); default: "
        "the config's",
    )
    ap.add_argument("--example-args", default="", help="extra flags for the example (quoted)")
    ap.add_argument("--out-dir", default=None, help="per-run metrics and logs (default: temp)")
    ap.add_argument("--json", default=None, help="write the bench summary here")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per (mode, seed); the fastest one counts"
    )
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown --modes {unknown}; choose from {', '.join(MODES)}")
    args.modes = modes
    if args.dataset != "synthetic" and not args.data_path:
        ap.error(f"--dataset {args.dataset} needs --data-path")
    if args.nproc_per_node < 1:
        ap.error(f"--nproc-per-node {args.nproc_per_node}: use at least 1")
    args.link_gbit = _rate_gbit(args.rate)
    args.rates = [r.strip() for r in (args.rates or "").split(",") if r.strip()]
    for r in args.rates:
        if r != LOCALHOST:  # a bad rate is refused before anything runs
            try:
                _rate_gbit(r)
            except argparse.ArgumentTypeError as e:
                ap.error(f"--rates: {e} (or localhost)")
    return args


def qcomm_backward(args: argparse.Namespace, mode: str) -> str:
    """The gradient precision a qcomm mode runs with.

    Args:
        args: Bench flags.
        mode: A qcomm ``--comm`` mode (``fp16``, ``bf16``, ``int8``, ``mx4``).

    Returns:
        ``--qcomm-backward`` unless it is ``auto``: then ``mx4`` for ``mx4`` (TorchRec users'
        production setting, MX4 both ways) and ``fp16`` for the others.
    """
    if args.qcomm_backward != "auto":
        return str(args.qcomm_backward)
    return "mx4" if mode == "mx4" else "fp16"


def _example_args(args: argparse.Namespace, mode: str, seed: int, metrics: Path) -> list[str]:
    out = [
        "--comm", "lossy" if mode in FORCED_FORMAT_MODES else mode,
        "--seed", str(seed),
        "--steps", str(args.steps),
        "--batch-size", str(args.batch_size),
        "--embedding-dim", str(args.embedding_dim),
        "--eval-batches", str(args.eval_batches),
        "--eval-interval", str(args.steps),  # one evaluation, at the end
        "--sharding", args.sharding,
        "--no-progress",
        "--metrics-json", str(metrics),
    ]  # fmt: skip
    if args.dataset == "synthetic":
        out.append("--pregenerate")  # data generation is not what this bench measures
    else:
        out += ["--dataset", args.dataset, "--data-path", args.data_path]
    if mode == "lossy":
        out += ["--config", str(args.config)]
    elif mode in FORCED_FORMAT_MODES:
        out += ["--config", str(args.forced_configs[mode])]
    elif mode != "none":
        out += ["--qcomm-backward", qcomm_backward(args, mode)]
    if args.netns:
        out += ["--link-gbit", f"{args.link_gbit:g}"]
    return out + shlex.split(args.example_args)


def with_comms(config: str, key: str, value: str, out_dir: Path) -> Path:
    """A copy of the planner config with one ``comms`` key set.

    Args:
        config: The planner config YAML.
        key: The ``comms`` key (``intra_host``, ``format``).
        value: Its value.
        out_dir: Where the copy goes.

    Returns:
        The copy's path.
    """
    import yaml

    data = yaml.safe_load(Path(config).read_text()) or {}
    data.setdefault("comms", {})[key] = value
    path = out_dir / f"{Path(config).stem}_{key}_{value}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_one(
    args: argparse.Namespace, mode: str, seed: int, repeat: int, out_dir: Path
) -> dict[str, Any]:
    """Runs the example once and returns its metrics plus how the run went.

    Args:
        args: Bench flags.
        mode: ``--comm`` mode.
        seed: Model seed.
        repeat: Repeat number (0-based).
        out_dir: Where the run's metrics and log go.

    Returns:
        The run record (``metrics`` is None if the run failed).
    """
    name = f"{mode}_s{seed}" + (f"_r{repeat}" if args.repeats > 1 else "")
    metrics = out_dir / f"{name}.json"
    log = out_dir / f"{name}.log"
    ex_args = _example_args(args, mode, seed, metrics)
    if args.netns:
        cmd = ["bash", str(NETNS), "--rate", args.rate, "--port", str(args.port)]
        cmd += ["--nproc-per-node", str(args.nproc_per_node)]
        cmd += ["--log-dir", str(out_dir / f"{name}_nodes"), "--", *ex_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={2 * args.nproc_per_node}", str(EXAMPLE), *ex_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: the netns script then removes its namespaces.
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = -1
    wall = time.perf_counter() - start
    record: dict[str, Any] = {
        "mode": mode,
        "seed": seed,
        "repeat": repeat,
        "returncode": rc,
        "wall_s": wall,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg()[0],
        "log": str(log),
        "metrics_path": str(metrics),
        "metrics": json.loads(metrics.read_text()) if rc == 0 and metrics.is_file() else None,
    }
    status = "ok" if record["metrics"] else f"FAILED (exit {rc}, see {log})"
    step = ""
    if record["metrics"]:
        step = f"  step {1e3 * record['metrics']['timing']['step_time_s_median']:.0f} ms"
    print(f"  {name:<14} {wall:6.1f} s  load {load_before:4.1f}{step}  {status}", flush=True)
    return record


def _step_wire_bytes(m: dict[str, Any]) -> float:
    """All-to-all bytes of one step: KJT input, pooled forward and backward (all ranks)."""
    c = m["comms"]
    return sum(c.get(f"{d}_wire_bytes_per_step", math.nan) for d in ("input", "fwd", "bwd"))


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(vals) if vals else math.nan


def _median_s(m: dict[str, Any]) -> float:
    return float(m["timing"]["step_time_s_median"])


def summarize(runs: Sequence[dict[str, Any]], modes: Sequence[str]) -> dict[str, Any]:
    """Per-mode means, speedups over ``none`` and the target checks.

    Args:
        runs: Run records.
        modes: Modes in table order.

    Returns:
        ``{"modes": {mode: {...}}, "targets": {...}}``.
    """
    # Background load only ever slows a run down: of repeats of one (mode, seed), the fastest
    # (by median step time) counts.
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in runs:
        m = r["metrics"]
        if m is None:
            continue
        key = (r["mode"], r["seed"])
        if key not in best or _median_s(m) < _median_s(best[key]):
            best[key] = m
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for (mode, _), m in sorted(best.items(), key=lambda kv: kv[0][1]):
        by_mode.setdefault(mode, []).append(m)
    out: dict[str, Any] = {}
    for mode in modes:
        ms = by_mode.get(mode, [])
        if not ms:
            out[mode] = {"runs": 0}
            continue
        aucs = [m["final"]["auc"] for m in ms]
        bwd = ms[0]["run"].get("qcomm_backward")
        out[mode] = {
            "label": f"{mode} fwd + {bwd} bwd" if bwd else mode,
            "runs": len(ms),
            "seeds": [m["run"]["seed"] for m in ms],
            "auc": _mean(aucs),
            "auc_by_seed": dict(zip([m["run"]["seed"] for m in ms], aucs, strict=True)),
            "auc_spread": (max(aucs) - min(aucs)) if len(aucs) > 1 else None,
            "logloss": _mean([m["final"]["logloss"] for m in ms]),
            "step_ms": 1e3 * _mean([_median_s(m) for m in ms]),
            "step_ms_mean": 1e3 * _mean([m["timing"]["step_time_s_mean"] for m in ms]),
            "examples_per_s": _mean([m["timing"]["examples_per_s"] for m in ms]),
            "fwd_wire_mib": _mean([m["comms"]["fwd_wire_bytes_per_step"] for m in ms]) / 2**20,
            "bwd_wire_mib": _mean([m["comms"]["bwd_wire_bytes_per_step"] for m in ms]) / 2**20,
            # The KJT input dist (packed under --comm lossy, TorchRec's otherwise); metrics
            # written before it was reported have no such entry.
            "input_wire_mib": _mean(
                [m["comms"].get("input_wire_bytes_per_step", math.nan) for m in ms]
            )
            / 2**20,
            "step_wire_mib": _mean([_step_wire_bytes(m) for m in ms]) / 2**20,
            "input_ratio": _mean([m["comms"].get("input_ratio") or math.nan for m in ms]),
            "fwd_ratio": _mean([m["comms"]["fwd_ratio"] or math.nan for m in ms]),
            "bwd_ratio": _mean([m["comms"]["bwd_ratio"] or math.nan for m in ms]),
            "codec_share": _mean([m["timing"]["codec_time_share"] for m in ms]),
            # Lossy mode: wire bytes to same-host and to cross-host peers (all ranks).
            "link_mib": {
                key: _mean([m["comms"].get(f"{key}_bytes_per_step", math.nan) for m in ms]) / 2**20
                for key in LINK_KEYS
            },
            "sharding": ms[0]["plan"]["summary"],
            "comm": ms[0]["run"]["comm_description"],
        }
    base = out.get("none", {})
    for s in out.values():
        if s.get("runs") and base.get("runs"):
            s["speedup"] = base["step_ms"] / s["step_ms"]
            common = set(s["auc_by_seed"]) & set(base["auc_by_seed"])
            if common:
                seed = min(common)
                a, b = s["auc_by_seed"][seed], base["auc_by_seed"][seed]
                # No AUC (an eval set with one class, e.g. a tiny file): no delta.
                s["delta_auc_same_seed"] = a - b if a is not None and b is not None else None
    targets: dict[str, Any] = {}
    lossy, mx4 = out.get("lossy", {}), out.get("mx4", {})
    if lossy.get("runs") and base.get("runs"):
        targets["speedup_vs_none"] = {
            "value": lossy["speedup"],
            "target": SPEEDUP_TARGET,
            "met": lossy["speedup"] >= SPEEDUP_TARGET,
        }
        spread = base.get("auc_spread")
        tol = max(AUC_FLOOR, spread or 0.0)
        delta = lossy.get("delta_auc_same_seed", lossy["auc"] - base["auc"])
        if delta is not None and math.isfinite(delta):  # else no AUC was measured
            targets["auc"] = {
                "delta": delta,
                "none_seed_spread": spread,
                "tolerance": tol,
                "met": abs(delta) <= tol,
            }
    if lossy.get("runs") and mx4.get("runs"):
        targets["faster_than_mx4"] = {
            "mx4_label": mx4["label"],
            "lossy_ms": lossy["step_ms"],
            "mx4_ms": mx4["step_ms"],
            "met": lossy["step_ms"] < mx4["step_ms"],
            # Not a target of this bench (issue 11's byte targets are for the default sharder,
            # this runs configs/criteo_kaggle.yaml): whole-step all-to-all bytes, input included.
            "lossy_step_mib": lossy["step_wire_mib"],
            "mx4_step_mib": mx4["step_wire_mib"],
            "bytes_fewer_than_mx4": mx4["step_wire_mib"] / lossy["step_wire_mib"],
        }
    return {"modes": out, "targets": targets}


LOCALHOST = "localhost"
TORCHREC_OPTIONS = ("none", "fp16", "mx4")
# Issue 34's targets: the default within 5% of the fastest TorchRec option at every rate, and
# at least 2.5x faster than none at 1 Gbit/s.
BEST_OPTION_SLACK = 1.05
SPEEDUP_AT_1GBIT = 2.5
# ... and with the format forced to the codec (mode "entropy"), localhost within 10% of none.
ENTROPY_LOCALHOST_SLACK = 1.10


def rates_summary(per_rate: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each mode's median step time per rate, relative to the fastest TorchRec option there.

    Args:
        per_rate: Rate (tc syntax or ``"localhost"``) to :func:`summarize`'s output.

    Returns:
        ``{rate: {"best_torchrec": mode, "step_ms": {mode: ms}, "vs_best": {mode: x},
        "targets": {...}}}``; ``vs_best`` > 1 is slower than the best TorchRec option.
    """
    out: dict[str, Any] = {}
    for rate, summary in per_rate.items():
        step = {m: s["step_ms"] for m, s in summary["modes"].items() if s.get("runs")}
        options = {m: step[m] for m in TORCHREC_OPTIONS if m in step}
        entry: dict[str, Any] = {"step_ms": step, "targets": {}}
        if options:
            best = min(options, key=options.__getitem__)
            entry["best_torchrec"] = best
            entry["vs_best"] = {m: t / options[best] for m, t in step.items()}
            if "lossy" in step:
                entry["targets"]["within_5pct_of_best"] = (
                    entry["vs_best"]["lossy"] <= BEST_OPTION_SLACK
                )
        if rate != LOCALHOST and _rate_gbit(rate) == 1.0 and "lossy" in step and "none" in step:
            entry["targets"]["2.5x_faster_than_none"] = (
                step["none"] / step["lossy"] >= SPEEDUP_AT_1GBIT
            )
        if rate == LOCALHOST and "entropy" in step and "none" in step:
            entry["targets"]["entropy_within_10pct_of_none"] = (
                step["entropy"] / step["none"] <= ENTROPY_LOCALHOST_SLACK
            )
        out[rate] = entry
    return out


def format_rates_table(rates: dict[str, Any], modes: Sequence[str]) -> str:
    """The per-rate table: median step ms and, in brackets, the ratio to the best TorchRec
    option at that rate (``lossy`` is the default sharder), and the mean 1-minute load average
    before the rate's runs.

    Args:
        rates: :func:`rates_summary`'s output.
        modes: Modes in column order.

    Returns:
        The table.
    """
    head = f"{'link':<10}" + "".join(f"{m:>18}" for m in modes) + "  load  best TorchRec  targets"
    lines = [head]
    for rate, e in rates.items():
        cells = []
        for m in modes:
            t = e["step_ms"].get(m)
            x = e.get("vs_best", {}).get(m)
            cells.append(f"{'-' if t is None else f'{t:.0f} ms ({x:.2f}x)':>18}")
        met = ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in e["targets"].items())
        load = f"{e['load_avg']:4.1f}" if "load_avg" in e else "   -"
        lines.append(
            f"{rate:<10}" + "".join(cells) + f"  {load}  {e.get('best_torchrec', '-'):<13} {met}"
        )
    return "\n".join(lines)


def format_table(summary: dict[str, Any]) -> str:
    """The bench result as a Markdown table plus the target lines.

    Args:
        summary: From :func:`summarize`.

    Returns:
        The text.
    """
    lines = [
        "| comm | runs | AUC | dAUC vs none | log loss | step ms (median) | speedup | fwd MiB/step "
        "| bwd MiB/step | input MiB/step | a2a MiB/step | fwd ratio | bwd ratio | input ratio "
        "| codec share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, s in summary["modes"].items():
        if not s.get("runs"):
            lines.append(f"| {mode} | 0 (failed) |  |  |  |  |  |  |  |  |  |  |  |  |  |")
            continue
        auc = _f(s["auc"], ".4f")
        if s.get("auc_spread") is not None:
            auc += f" (spread {s['auc_spread']:.4f})"
        lines.append(
            f"| {s.get('label', mode)} | {s['runs']} | {auc} "
            f"| {_f(s.get('delta_auc_same_seed'), '+.4f')} "
            f"| {_f(s['logloss'], '.4f')} | {_f(s['step_ms'], '.0f')} "
            f"| {_f(s.get('speedup'), '.2f')}x | {_f(s['fwd_wire_mib'], '.2f')} "
            f"| {_f(s['bwd_wire_mib'], '.2f')} | {_f(s.get('input_wire_mib'), '.3f')} "
            f"| {_f(s.get('step_wire_mib'), '.2f')} "
            f"| {_f(s['fwd_ratio'], '.1f')}x | {_f(s['bwd_ratio'], '.1f')}x "
            f"| {_f(s.get('input_ratio'), '.1f')}x | {_f(100 * s['codec_share'], '.0f')}% |"
        )
    for mode, s in summary["modes"].items():
        links = s.get("link_mib", {})
        if any(math.isfinite(v) for v in links.values()):
            lines.append(
                f"{mode} wire MiB/step by link: "
                + ", ".join(
                    f"{k.replace('_', ' ', 1).replace('_', '-')} {_f(v, '.3f')}"
                    for k, v in links.items()
                )
            )
    t = summary["targets"]
    if "speedup_vs_none" in t:
        x = t["speedup_vs_none"]
        lines.append(
            f"target lossy speedup vs none >= {x['target']}x: {x['value']:.2f}x "
            f"{'MET' if x['met'] else 'MISSED'}"
        )
    if "faster_than_mx4" in t:
        x = t["faster_than_mx4"]
        lines.append(
            f"target lossy faster than {x['mx4_label']}: {x['lossy_ms']:.0f} vs "
            f"{x['mx4_ms']:.0f} ms {'MET' if x['met'] else 'MISSED'}"
        )
        lines.append(
            f"all-to-all MiB/step (input + fwd + bwd): lossy {_f(x['lossy_step_mib'], '.2f')}, "
            f"{x['mx4_label']} {_f(x['mx4_step_mib'], '.2f')} "
            f"(lossy sends {_f(x['bytes_fewer_than_mx4'], '.2f')}x fewer)"
        )
    if "auc" in t:
        x = t["auc"]
        spread = "-" if x["none_seed_spread"] is None else f"{x['none_seed_spread']:.4f}"
        lines.append(
            f"target |AUC(lossy) - AUC(none)| <= max({AUC_FLOOR}, spread {spread}) = "
            f"{x['tolerance']:.4f}: {x['delta']:+.4f} {'MET' if x['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the bench.

    Args:
        argv: Command line.

    Returns:
        Exit status (1 if a run failed).
    """
    args = parse_args(argv)
    if args.netns:
        missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
        if os.geteuid() != 0 or missing:
            print(
                "the netns link needs root and iproute2 (apt-get install -y iproute2); "
                "run as root or pass --no-netns",
                file=sys.stderr,
            )
            return 2
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="e2e_bench."))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.intra_host:
        args.config = str(with_comms(args.config, "intra_host", args.intra_host, out_dir))
    args.forced_configs = {
        m: str(with_comms(args.config, "format", FORCED_FORMAT_MODES[m], out_dir))
        for m in args.modes
        if m in FORCED_FORMAT_MODES
    }
    link = f"netns {args.rate} link" if args.netns else "localhost"
    print(
        f"e2e bench: {', '.join(args.modes)} on {link}; {args.steps} steps, batch "
        f"{args.batch_size}/rank, dim {args.embedding_dim}, sharding {args.sharding}, "
        f"{args.nproc_per_node} rank(s) per host; runs in {out_dir}",
        flush=True,
    )
    plan: list[tuple[str, int]] = []
    for seed in sorted(set(args.seeds) | set(args.none_seeds)):
        for mode in args.modes:
            seeds = args.none_seeds if mode == "none" else args.seeds
            if seed in seeds:
                plan.append((mode, seed))
    if args.rates:
        return run_rates(args, plan, out_dir)
    runs = [
        run_one(args, mode, seed, rep, out_dir)
        for rep in range(args.repeats)
        for mode, seed in plan
    ]
    summary = summarize(runs, args.modes)
    print(format_table(summary), flush=True)
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "modes"} | {"modes": args.modes},
        "host": {"cpus": os.cpu_count()},
        "runs": [{k: v for k, v in r.items() if k != "metrics"} for r in runs],
        "summary": summary,
    }
    for r, full in zip(result["runs"], runs, strict=True):
        m = full["metrics"]
        if m:
            r["auc"] = m["final"]["auc"]
            r["step_ms"] = 1e3 * m["timing"]["step_time_s_mean"]
    path = Path(args.json) if args.json else out_dir / "bench.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"summary: {path}", flush=True)
    return 0 if all(r["metrics"] for r in runs) else 1


def run_rates(args: argparse.Namespace, plan: list[tuple[str, int]], out_dir: Path) -> int:
    """Runs every (mode, seed) at each of ``--rates`` and prints the per-rate table.

    Args:
        args: Parsed flags (``rate`` / ``netns`` / ``link_gbit`` are set per rate here).
        plan: The (mode, seed) runs of one rate.
        out_dir: Where each rate's runs go (one folder per rate).

    Returns:
        Exit status (1 if a run failed).
    """
    per_rate: dict[str, dict[str, Any]] = {}
    all_runs: dict[str, list[dict[str, Any]]] = {}
    for rate in args.rates:
        local = rate == LOCALHOST
        args.netns, args.rate = not local, "1gbit" if local else rate
        args.link_gbit = None if local else _rate_gbit(rate)
        rate_dir = out_dir / rate
        rate_dir.mkdir(exist_ok=True)
        print(f"-- {rate}", flush=True)
        runs = [
            run_one(args, mode, seed, rep, rate_dir)
            for rep in range(args.repeats)
            for mode, seed in plan
        ]
        all_runs[rate] = [{k: v for k, v in r.items() if k != "metrics"} for r in runs]
        per_rate[rate] = summarize(runs, args.modes)
    rates = rates_summary(per_rate)
    for rate, runs in all_runs.items():  # the machine's load beside each rate's figures
        rates[rate]["load_avg"] = _mean([r["load_avg_before"] for r in runs])
    print(format_rates_table(rates, args.modes), flush=True)
    path = Path(args.json) if args.json else out_dir / "bench.json"
    config = {k: v for k, v in vars(args).items() if k not in ("modes", "rate", "link_gbit")}
    result = {"config": config | {"modes": args.modes}, "rates": rates, "per_rate": per_rate}
    path.write_text(json.dumps(result | {"runs": all_runs}, indent=1, default=str))
    print(f"summary: {path}", flush=True)
    ok = all(r["returncode"] == 0 for runs in all_runs.values() for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
