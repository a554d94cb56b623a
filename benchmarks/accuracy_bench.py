"""Accuracy protocol: paired DLRM runs per comm mode, several seeds, AUC and log loss deltas.

Runs ``examples/dlrm_criteo.py`` as a 2-process torchrun job (gloo, localhost) once per
(dataset, seed, mode). Within a seed every mode sees the same model initialisation, the same
data in the same order and the same (table-wise) plan: only the all-to-all codec differs. Per
seed it reports the held-out AUC and log loss; per mode the mean paired deltas against ``none``
with their standard errors, the paired dAUC against MX4 both ways (``--ref``) and the whole-step
all-to-all bytes, and the tail (issue 32): the sd of the paired deltas, the worst seed, and the
end-of-training train-loss gap (mean and worst). The target (issue 18): mean dAUC >= -0.0005,
mean dLogLoss <= +0.0005 and no worse than MX4. Datasets: the real ratings logs in
../shared/data ``movielens`` (4 epochs), ``ciao`` and ``ciaodvd`` (1 epoch each: they
overfit), ``synthetic`` (the example's planted-signal stream) and ``real`` (the 1,000-row
Criteo 1TB sample). Every run's resident memory (RSS of each worker, sampled from /proc) and
the finiteness of its loss curve are recorded too, so a long run doubles as the memory /
divergence check.

Modes are named variants. Built in: ``none``, ``mx4`` (TorchRec MX4 forward and backward),
``fp16`` / ``bf16`` (TorchRec FP16 / BF16 both ways), ``lossy`` (the sharder's defaults, no config),
``lossy-bf16`` (``comms.backward: bf16``), ``lossy-rtn`` (``comms.backward: lossy``:
round-to-nearest at ``comms.backward_bound``) and ``lossy-bval`` (the per-value backward bound
1/32, issue 32). ``--variant NAME=SPEC`` adds one: SPEC is a
``--comm`` mode followed by ``;key=value`` items; ``qcomm_backward=X`` (qcomm modes),
``config=PATH`` (a planner YAML to start from) or any ``comms`` key, dotted for nested ones,
value in YAML syntax (``backward=lossy;backward_bound.value=0.02``).

    python benchmarks/accuracy_bench.py                                   # full protocol
    python benchmarks/accuracy_bench.py --datasets movielens --seeds 0-19 --modes none,mx4,lossy
    python benchmarks/accuracy_bench.py --datasets synthetic --steps 100 --seeds 0
    python benchmarks/accuracy_bench.py --modes none,lossy --variant \\
        'lossy-sr=lossy;backward_bound={mode: relative, value: 0.01};backward_rounding=stochastic'

The JSON (``--json``) is rewritten after every run, so an interrupted bench loses nothing;
``--resume`` reuses the finished runs found in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from table_fmt import cell as _f

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "dlrm_criteo.py"


def shared_data(name: str) -> Path:
    """A file of the shared data folder beside the checkout (<repo>/../shared/data; from a
    worktree nested one level deeper, one more up): the first that exists."""
    found = (d / "shared" / "data" / name for d in ROOT.parents)
    return next((p for p in found if p.is_file()), ROOT.parent / "shared" / "data" / name)


REAL_SAMPLE = shared_data("criteo_1tb_day0_head1000.tsv.gz")
# The real ratings logs (Criteo Kaggle TSV), each with its default epochs (../shared/data/README).
RATINGS_LOGS = {
    "movielens": (shared_data("movielens_small_criteo.tsv.gz"), 4),
    "ciao": (shared_data("ciao_criteo.tsv.gz"), 1),
    "ciaodvd": (shared_data("ciaodvd_criteo.tsv.gz"), 1),
}
COMMS = ("none", "fp16", "bf16", "int8", "mx4", "lossy")
DATASETS = ("synthetic", "real", *RATINGS_LOGS)
# Issue 18: mean paired dAUC vs none >= -0.0005 and mean dLogLoss <= +0.0005, each with its
# standard error printed beside it, and no worse than TorchRec MX4 both ways in the same run.
DAUC_FLOOR = -0.0005
DLOGLOSS_CEIL = 0.0005
# Issue 32's tail: the sd of the paired dAUC at most 1.2x that of the reference (MX4 both ways)
# in the same run, and no seed's paired dAUC below the worse of the reference's and the FP16
# control's worst seeds in the same run (docs/accuracy.md: a fixed floor such as issue 32's
# -0.005 measures the log's seed chaos, which FP16 both ways misses too). Without either in the
# run the worst seed is judged against the fixed floor.
WORST_DAUC_FLOOR = -0.005
TAIL_CONTROLS = ("fp16",)
SD_VS_REF_CEIL = 1.2


@dataclass(frozen=True)
class Variant:
    """One comm mode of the protocol.

    Attributes:
        name: Name in the table and the JSON.
        comm: The example's ``--comm``.
        qcomm_backward: ``--qcomm-backward`` of a TorchRec qcomm mode (None: the example's).
        config: Planner YAML the variant starts from (None: the defaults).
        comms: ``comms`` overrides (dotted keys) written into the variant's YAML.
    """

    name: str
    comm: str
    qcomm_backward: str | None = None
    config: str | None = None
    comms: dict[str, Any] = field(default_factory=dict)


BUILTIN = {
    "none": Variant("none", "none"),
    "fp16": Variant("fp16", "fp16", qcomm_backward="fp16"),
    "bf16": Variant("bf16", "bf16", qcomm_backward="bf16"),
    "mx4": Variant("mx4", "mx4", qcomm_backward="mx4"),
    "lossy": Variant("lossy", "lossy"),
    "lossy-bf16": Variant("lossy-bf16", "lossy", comms={"backward": "bf16"}),
    "lossy-rtn": Variant("lossy-rtn", "lossy", comms={"backward": "lossy"}),
    # Issue 32's candidate backward: per-value 1/32 (|x' - x| <= |x| / 64 per gradient element).
    "lossy-bval": Variant(
        "lossy-bval", "lossy", comms={"backward_bound": {"mode": "value", "value": 0.03125}}
    ),
}


def parse_variant(text: str) -> Variant:
    """Parses ``NAME=COMM[;key=value...]`` (see the module docstring).

    Args:
        text: The spec.

    Returns:
        The variant.

    Raises:
        argparse.ArgumentTypeError: On a malformed spec, naming it and the expected form.
    """
    name, sep, spec = text.partition("=")
    parts = [p.strip() for p in spec.split(";") if p.strip()]
    if not sep or not name.strip() or not parts or parts[0] not in COMMS:
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected NAME=COMM[;key=value...] with COMM one of "
            f"{', '.join(COMMS)}, e.g. 'lossy-sr=lossy;backward=lossy'"
        )
    qcomm, config, comms = None, None, {}
    for item in parts[1:]:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"--variant {text!r}: item {item!r} is not key=value")
        key = key.strip()
        if key == "qcomm_backward":
            qcomm = value.strip()
        elif key == "config":
            config = value.strip()
        else:
            comms[key] = yaml.safe_load(value)
    if parts[0] != "lossy" and (comms or config):
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: comms keys and config apply to COMM lossy only"
        )
    return Variant(name.strip(), parts[0], qcomm, config, comms)


def _ints(text: str) -> list[int]:
    """``"0,3,5"`` or ranges ``"0-19"`` (inclusive), mixed: ``"0-9,20"``."""
    out: list[int] = []
    for item in (v.strip() for v in text.split(",")):
        lo, sep, hi = item.partition("-")
        if sep and lo:
            out += range(int(lo), int(hi) + 1)
        elif item:
            out.append(int(item))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the bench's command line.

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        The flags, with ``variants`` (list of :class:`Variant`) and ``datasets`` resolved.
    """
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--modes",
        default="none,mx4,bf16,fp16,lossy",
        help=f"built-in variants, comma-separated: {', '.join(BUILTIN)}",
    )
    ap.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        help="extra variant NAME=COMM[;key=value...] (repeatable)",
    )
    ap.add_argument(
        "--datasets",
        default="movielens,ciao,ciaodvd,synthetic,real",
        help="of " + ", ".join(DATASETS),
    )
    ap.add_argument(
        "--ref", default="mx4", help="second reference mode: paired dAUC against it too"
    )
    ap.add_argument(
        "--seeds", type=_ints, default=list(range(20)), help="model seeds (paired), e.g. 0-19"
    )
    ap.add_argument("--data-seed", type=int, default=0, help="synthetic stream (same every run)")
    g = ap.add_argument_group("synthetic stream")
    g.add_argument("--steps", type=int, default=1000, help="1000 x 512 x 2 ranks = 1,024,000")
    g.add_argument("--batch-size", type=int, default=512, help="per rank")
    g.add_argument("--eval-batches", type=int, default=32, help="held-out batches per rank")
    g = ap.add_argument_group("real Criteo 1TB sample (1,000 rows)")
    g.add_argument("--real-path", default=str(REAL_SAMPLE), help="read in place, never copied")
    g.add_argument("--real-epochs", type=int, default=4)
    g.add_argument(
        "--real-batch-size",
        type=int,
        default=32,
        help="per rank (MX4: dim x 13 x it must be a multiple of 32)",
    )
    g.add_argument(
        "--real-holdout-every", type=int, default=2, help="every N-th row of a rank is held out"
    )
    g = ap.add_argument_group("real ratings logs (MovieLens, Ciao, CiaoDVD; Criteo Kaggle TSV)")
    for log, (path, epochs) in RATINGS_LOGS.items():
        g.add_argument(f"--{log}-path", default=str(path), help="read in place, never copied")
        g.add_argument(f"--{log}-epochs", type=int, default=epochs)
    ap.add_argument("--embedding-dim", type=int, default=16)
    ap.add_argument("--example-args", default="", help="extra flags for every run (quoted)")
    ap.add_argument("--out-dir", default=None, help="per-run metrics and logs (default: temp)")
    ap.add_argument("--json", default=None, help="bench result (default: OUT_DIR/accuracy.json)")
    ap.add_argument("--resume", action="store_true", help="reuse finished runs in --out-dir")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--rss-interval", type=float, default=2.0, help="seconds between samples")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        ap.error(f"--modes {unknown}: unknown; built in: {', '.join(BUILTIN)} (or use --variant)")
    args.variants = [BUILTIN[n] for n in names] + list(args.variant)
    seen = [v.name for v in args.variants]
    if len(set(seen)) != len(seen):
        ap.error(f"variant names must be unique, got {seen}")
    if "none" not in seen:
        ap.error("the protocol pairs every mode with 'none': add it to --modes")
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    bad = sorted(set(args.datasets) - set(DATASETS))
    if bad:
        ap.error(f"--datasets {bad}: choose from {', '.join(DATASETS)}")
    paths = {"real": args.real_path} | {log: getattr(args, f"{log}_path") for log in RATINGS_LOGS}
    for dataset, path in paths.items():
        if dataset in args.datasets and not Path(path).is_file():
            ap.error(f"--{dataset}-path {path}: no such file (or drop {dataset!r} from --datasets)")
    return args


def _variant_config(variant: Variant, out_dir: Path) -> Path | None:
    """Writes the planner YAML of a lossy variant (its overrides on its config, if any); None
    for the other modes."""
    if variant.comm != "lossy":
        return None
    doc: dict[str, Any] = {}
    if variant.config:
        doc = yaml.safe_load(Path(variant.config).read_text()) or {}
    # Every table coded, whatever the link (paired runs measure the codec; the default
    # comms.format auto would send raw where the codec does not pay).
    comms = doc.setdefault("comms", {})
    comms.setdefault("format", "entropy")
    for key, value in variant.comms.items():
        *parents, leaf = key.split(".")
        node = comms
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = out_dir / f"config_{variant.name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def example_args(
    args: argparse.Namespace, dataset: str, variant: Variant, seed: int, out_dir: Path
) -> list[str]:
    """The example's flags for one run.

    Args:
        args: Bench flags.
        dataset: One of :data:`DATASETS`.
        variant: The comm mode.
        seed: Model seed.
        out_dir: Where the run's files go.

    Returns:
        The flags (metrics to ``OUT_DIR/<dataset>_<variant>_s<seed>.json``).
    """
    name = f"{dataset}_{variant.name}_s{seed}"
    out = [
        "--comm", variant.comm,
        "--seed", str(seed),
        "--embedding-dim", str(args.embedding_dim),
        "--sharding", "table_wise",  # one plan for every mode: all 26 tables on the wire
        "--no-progress",
        "--metrics-json", str(out_dir / f"{name}.json"),
    ]  # fmt: skip
    if dataset == "synthetic":
        out += [
            "--data-seed", str(args.data_seed),
            "--steps", str(args.steps),
            "--batch-size", str(args.batch_size),
            "--eval-batches", str(args.eval_batches),
            "--eval-interval", str(args.steps),
        ]  # fmt: skip
    elif dataset in RATINGS_LOGS:  # the example's defaults (batch, hold-out) for a real log
        out += [
            "--dataset", "criteo-kaggle",
            "--data-path", getattr(args, f"{dataset}_path"),
            "--epochs", str(getattr(args, f"{dataset}_epochs")),
            "--eval-batches", "1000000",  # all held-out rows
            "--eval-interval", "1000000",  # one evaluation, at the end
        ]  # fmt: skip
    else:
        out += [
            "--dataset", "criteo-1tb",
            "--data-path", args.real_path,
            "--epochs", str(args.real_epochs),
            "--batch-size", str(args.real_batch_size),
            "--holdout-every", str(args.real_holdout_every),
            "--eval-batches", "1000000",  # all held-out rows
            "--eval-interval", "1000000",  # one evaluation, at the end
        ]  # fmt: skip
    if variant.qcomm_backward:
        out += ["--qcomm-backward", variant.qcomm_backward]
    config = _variant_config(variant, out_dir)
    if config is not None:
        out += ["--config", str(config)]
    return out + args.example_args.split()


def _children(pid: int) -> list[int]:
    """All descendants of ``pid`` (from /proc), best effort."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """Samples the resident memory of every descendant of a process until stopped.

    Args:
        pid: The torchrun process.
        interval: Seconds between samples.
    """

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: dict[int, list[tuple[float, float]]] = {}
        self._stop_event = threading.Event()
        self._t0 = time.perf_counter()

    def run(self) -> None:
        """Samples until :meth:`stop`."""
        while not self._stop_event.wait(self.interval):
            t = time.perf_counter() - self._t0
            for child in _children(self.pid):
                rss = _rss_mib(child)
                if rss is not None:
                    self.samples.setdefault(child, []).append((t, rss))

    def stop(self) -> dict[str, Any]:
        """Stops sampling.

        Returns:
            Per worker (the two processes with the largest peak RSS): peak RSS, RSS at the
            middle and at the end of the run, and the growth over the second half, MiB.
        """
        self._stop_event.set()
        self.join()
        workers = sorted(self.samples.values(), key=lambda s: -max(r for _, r in s))[:2]
        out = []
        for s in workers:
            mid = s[len(s) // 2][1]
            out.append(
                {"peak_mib": max(r for _, r in s), "mid_mib": mid, "end_mib": s[-1][1],
                 "growth_2nd_half_mib": s[-1][1] - mid, "samples": len(s)}
            )  # fmt: skip
        return {"workers": out}


def run_one(
    args: argparse.Namespace, dataset: str, variant: Variant, seed: int, out_dir: Path
) -> dict[str, Any]:
    """Runs the example once (or reuses a finished run with ``--resume``).

    Args:
        args: Bench flags.
        dataset: One of :data:`DATASETS`.
        variant: The comm mode.
        seed: Model seed.
        out_dir: Where the run's metrics and log go.

    Returns:
        The run record (``metrics`` is None if the run failed).
    """
    name = f"{dataset}_{variant.name}_s{seed}"
    metrics_path, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    record: dict[str, Any] = {"dataset": dataset, "mode": variant.name, "seed": seed}
    if args.resume and metrics_path.is_file():
        prev = out_dir / f"{name}.run.json"
        record |= json.loads(prev.read_text()) if prev.is_file() else {}
        record["metrics"] = json.loads(metrics_path.read_text())
        print(f"  {name:<28} reused", flush=True)
        return record
    metrics_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(EXAMPLE), *example_args(args, dataset, variant, seed, out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        sampler = RssSampler(proc.pid, args.rss_interval)
        sampler.start()
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = -1
        rss = sampler.stop()
    record |= {
        "command": " ".join(cmd),
        "returncode": rc,
        "wall_s": time.perf_counter() - start,
        "rss": rss,
        "log": str(log),
    }
    (out_dir / f"{name}.run.json").write_text(json.dumps(record, indent=1))
    ok = rc == 0 and metrics_path.is_file()
    record["metrics"] = json.loads(metrics_path.read_text()) if ok else None
    tail = f"AUC {record['metrics']['final']['auc']}" if ok else f"FAILED (exit {rc}, see {log})"
    print(f"  {name:<28} {record['wall_s']:6.1f} s  {tail}", flush=True)
    return record


def mean_finite(values: Sequence[float | None]) -> float | None:
    """Mean of the finite values (None if there is none)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(vals) if vals else None


def sem_finite(values: Sequence[float | None]) -> float | None:
    """Standard error of the mean (None below two finite values)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else None


def _run_facts(r: dict[str, Any]) -> dict[str, Any]:
    """What the summary needs from one finished run."""
    m = r["metrics"]
    losses = m["history"]["train_loss"]
    workers = (r.get("rss") or {}).get("workers") or []
    return {
        "auc": m["final"]["auc"],
        "logloss": m["final"]["logloss"],
        "train_loss": m["final"]["train_loss"],
        "train_loss_mean": mean_finite(losses),
        "finite": all(v is not None and math.isfinite(v) for v in losses),
        "eval_rows": m["final"]["eval_rows"],
        "samples": m["run"]["steps_run"] * m["run"]["global_batch_size"],
        "comm": m["run"]["comm_description"],
        "plan": m["plan"]["summary"],
        "fwd_ratio": m["comms"]["fwd_ratio"],
        "bwd_ratio": m["comms"]["bwd_ratio"],
        "bwd_wire_bytes_per_step": m["comms"]["bwd_wire_bytes_per_step"],
        "step_wire_bytes": sum(
            m["comms"][f"{d}_wire_bytes_per_step"] or 0 for d in ("input", "fwd", "bwd")
        ),
        "step_ms": 1e3 * m["timing"]["step_time_s_median"],
        "rss_peak_mib": max((w["peak_mib"] for w in workers), default=None),
        "rss_growth_mib": max((w["growth_2nd_half_mib"] for w in workers), default=None),
    }


def sd_finite(values: Sequence[float | None]) -> float | None:
    """Sample standard deviation of the finite values (None below two)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.stdev(vals) if len(vals) > 1 else None


def worst_seed(deltas: dict[int, float], lower_is_worse: bool) -> dict[str, Any] | None:
    """The seed whose paired delta is worst: the lowest (AUC) or the highest (losses).

    Args:
        deltas: Paired delta per seed.
        lower_is_worse: True for a metric where a drop is a loss (AUC).

    Returns:
        ``{"seed": s, "delta": d}`` (the lowest seed on a tie), or None without a finite delta.
    """
    finite = {s: d for s, d in deltas.items() if d is not None and math.isfinite(d)}
    if not finite:
        return None
    sign = 1.0 if lower_is_worse else -1.0
    seed = min(finite, key=lambda k: (sign * finite[k], k))
    return {"seed": seed, "delta": finite[seed]}


def tail_facts(deltas: dict[int, float], lower_is_worse: bool) -> dict[str, Any]:
    """The spread of one metric's paired deltas over seeds: what a user training once meets.

    Args:
        deltas: Paired delta per seed.
        lower_is_worse: As :func:`worst_seed`.

    Returns:
        ``{"sd": ..., "worst": {"seed", "delta"} or None}``.
    """
    return {"sd": sd_finite(list(deltas.values())), "worst": worst_seed(deltas, lower_is_worse)}


def paired_deltas(
    mine: dict[int, dict[str, Any]], ref: dict[int, dict[str, Any]], key: str
) -> dict[int, float]:
    """Per seed run by both: ``mine[key] - ref[key]`` (seeds where either lacks it skipped)."""
    return {
        s: f[key] - ref[s][key]
        for s, f in mine.items()
        if s in ref and f[key] is not None and ref[s][key] is not None
    }


def summarize(
    runs: Sequence[dict[str, Any]], variants: Sequence[Variant], ref_name: str = "mx4"
) -> dict[str, Any]:
    """Per dataset and mode: per-seed metrics, paired deltas vs ``none``, the target check.

    Args:
        runs: Run records.
        variants: Modes in table order.
        ref_name: Second reference: the paired mean dAUC against this mode is reported too
            (``mx4``: the target asks for no worse than TorchRec MX4 both ways).

    Returns:
        ``{dataset: {"none_auc_spread": ..., "modes": {mode: {...}}}}``.
    """
    facts: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in runs:
        if r.get("metrics"):
            facts[(r["dataset"], r["mode"], r["seed"])] = _run_facts(r)
    out: dict[str, Any] = {}
    for dataset in dict.fromkeys(k[0] for k in facts):
        none = {s: f for (d, m, s), f in facts.items() if d == dataset and m == "none"}
        ref = {s: f for (d, m, s), f in facts.items() if d == dataset and m == ref_name}
        none_aucs = [f["auc"] for f in none.values() if f["auc"] is not None]
        spread = max(none_aucs) - min(none_aucs) if len(none_aucs) > 1 else None
        modes: dict[str, Any] = {}
        for v in variants:
            mine = {s: f for (d, m, s), f in facts.items() if d == dataset and m == v.name}
            if not mine:
                continue
            seeds = sorted(mine)
            dauc = paired_deltas(mine, none, "auc")
            dll = paired_deltas(mine, none, "logloss")
            dtl = paired_deltas(mine, none, "train_loss_mean")
            # The end-of-training train-loss gap (the example's final.train_loss: the mean of
            # the run's last steps, right across a resume).
            dfinal = paired_deltas(mine, none, "train_loss")
            mean_dauc = mean_finite(list(dauc.values()))
            dauc_ref = paired_deltas(mine, ref, "auc")
            none_bytes = mean_finite([f["step_wire_bytes"] for f in none.values()])
            step_bytes = mean_finite([mine[k]["step_wire_bytes"] for k in seeds])
            s: dict[str, Any] = {
                "seeds": seeds,
                "per_seed": {k: mine[k] for k in seeds},
                "auc": mean_finite([mine[k]["auc"] for k in seeds]),
                "logloss": mean_finite([mine[k]["logloss"] for k in seeds]),
                "dauc_by_seed": dauc,
                "dauc_mean": mean_dauc,
                "dauc_se": sem_finite(list(dauc.values())),
                "dlogloss_by_seed": dll,
                "dlogloss_mean": mean_finite(list(dll.values())),
                "dlogloss_se": sem_finite(list(dll.values())),
                "dtrain_loss_mean": mean_finite(list(dtl.values())),
                "dauc_tail": tail_facts(dauc, lower_is_worse=True),
                "dlogloss_tail": tail_facts(dll, lower_is_worse=False),
                "dfinal_train_loss_by_seed": dfinal,
                "dfinal_train_loss_mean": mean_finite(list(dfinal.values())),
                "dfinal_train_loss_tail": tail_facts(dfinal, lower_is_worse=False),
                "ref": ref_name,
                "dauc_vs_ref_mean": mean_finite(list(dauc_ref.values())),
                "dauc_vs_ref_se": sem_finite(list(dauc_ref.values())),
                "step_wire_bytes": step_bytes,
                "bytes_vs_none": none_bytes / step_bytes if none_bytes and step_bytes else None,
                "finite": all(mine[k]["finite"] for k in seeds),
                "comm": mine[seeds[0]]["comm"],
                "plan": mine[seeds[0]]["plan"],
                "samples_per_run": mine[seeds[0]]["samples"],
                "fwd_ratio": mean_finite([mine[k]["fwd_ratio"] for k in seeds]),
                "bwd_ratio": mean_finite([mine[k]["bwd_ratio"] for k in seeds]),
                "rss_peak_mib": max((mine[k]["rss_peak_mib"] or 0.0) for k in seeds),
                "rss_growth_mib": max((mine[k]["rss_growth_mib"] or 0.0) for k in seeds),
            }
            if v.name != "none" and mean_dauc is not None and s["dlogloss_mean"] is not None:
                s["target"] = _target(s, v.name == ref_name)
            modes[v.name] = s
        _tail_vs_ref(modes, ref_name)
        out[dataset] = {"none_auc_spread": spread, "none_seeds": sorted(none), "modes": modes}
    return out


def _tail_vs_ref(modes: dict[str, Any], ref_name: str) -> None:
    """Issue 32's tail check of every mode but ``none``, in place: the sd of its paired dAUC
    against the reference's (same run) and its worst seed against the worse of the reference's
    and the :data:`TAIL_CONTROLS`' worst seeds in the same run (:data:`WORST_DAUC_FLOOR` when
    the run has neither)."""
    ref_sd = (modes.get(ref_name) or {}).get("dauc_tail", {}).get("sd")
    worsts = [
        w["delta"]
        for m in (ref_name, *TAIL_CONTROLS)
        if (w := (modes.get(m) or {}).get("dauc_tail", {}).get("worst")) is not None
    ]
    floor = min(worsts) if worsts else WORST_DAUC_FLOOR
    for name, s in modes.items():
        if name == "none":
            continue
        sd, worst = s["dauc_tail"]["sd"], s["dauc_tail"]["worst"]
        ratio = sd / ref_sd if sd is not None and ref_sd else None
        met: bool | None
        if worst is None or worst["delta"] < floor:
            met = False
        elif name == ref_name:
            met = True
        elif ratio is None:  # no spread of the reference to judge against: said, not guessed
            met = None
        else:
            met = ratio <= SD_VS_REF_CEIL
        s["tail"] = {
            "dauc_sd_vs_ref": ratio,
            "sd_ceil": SD_VS_REF_CEIL,
            "worst_floor": floor,
            "met": met,
        }


def _target(s: dict[str, Any], is_ref: bool) -> dict[str, Any]:
    """Issue 18's target for one mode: dAUC and dLogLoss vs ``none`` within their limits, and
    (unless the mode is the reference itself) no worse than the reference (MX4) by more than
    one standard error of the paired difference."""
    vs_ref = s["dauc_vs_ref_mean"]
    not_worse = is_ref or (vs_ref is not None and vs_ref >= -(s["dauc_vs_ref_se"] or 0.0))
    return {
        "floor": DAUC_FLOOR,
        "ceil": DLOGLOSS_CEIL,
        "paired_seeds": len(s["dauc_by_seed"]),
        "met": s["dauc_mean"] >= DAUC_FLOOR and s["dlogloss_mean"] <= DLOGLOSS_CEIL and not_worse,
        "not_worse_than_ref": not_worse,
    }


def _pm(mean: float | None, se: float | None) -> str:
    return f"{_f(mean, '+.4f')} ± {_f(se, '.4f')}"


def _worst(w: dict[str, Any] | None) -> str:
    return "-" if w is None else f"{_f(w['delta'], '+.4f')} (s{w['seed']})"


def format_tail(d: dict[str, Any], ref: str) -> list[str]:
    """One dataset's tail table (issue 32): the spread of the paired deltas over seeds, the
    worst seed and the end-of-training train-loss gap, every mode side by side.

    Args:
        d: One dataset of :func:`summarize`'s result.
        ref: The reference mode's name.

    Returns:
        Markdown lines.
    """
    lines = [
        f"| mode | paired | sd dAUC | sd vs {ref} | worst dAUC (seed) | sd dLogLoss "
        "| worst dLogLoss (seed) | train-loss gap mean | worst gap (seed) | tail |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode, s in d["modes"].items():
        if mode == "none":
            continue
        t = s.get("tail") or {}
        verdict = {True: "met", False: "MISSED", None: "sd not judged"}[t["met"]] if t else "-"
        ratio = t.get("dauc_sd_vs_ref")
        lines.append(
            f"| {mode} | {len(s['dauc_by_seed'])} | {_f(s['dauc_tail']['sd'], '.4f')} "
            f"| {_f(ratio, '.2f')}{'x' if ratio is not None else ''} "
            f"| {_worst(s['dauc_tail']['worst'])} | {_f(s['dlogloss_tail']['sd'], '.4f')} "
            f"| {_worst(s['dlogloss_tail']['worst'])} "
            f"| {_f(s['dfinal_train_loss_mean'], '+.4f')} "
            f"| {_worst(s['dfinal_train_loss_tail']['worst'])} | {verdict} |"
        )
    return lines


def format_table(summary: dict[str, Any]) -> str:
    """The summary as Markdown tables, one per dataset.

    Args:
        summary: From :func:`summarize`.

    Returns:
        The text.
    """
    lines = []
    for dataset, d in summary.items():
        spread = _f(d["none_auc_spread"], ".4f")
        ref = next(iter(d["modes"].values()))["ref"] if d["modes"] else "-"
        lines += [
            f"\n{dataset}: seed spread of none (max - min AUC over seeds {d['none_seeds']}) "
            f"= {spread}",
            "| mode | seeds | mean AUC | log loss | mean dAUC ± SE | mean dLogLoss ± SE "
            f"| d train loss | dAUC vs {ref} ± SE | step bytes | fewer bytes than none "
            "| fwd ratio | bwd ratio | RSS peak / growth MiB | target |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for mode, s in d["modes"].items():
            t = s.get("target")
            verdict = "-" if t is None else ("met" if t["met"] else "MISSED")
            if not s["finite"]:
                verdict += " (non-finite loss)"
            lines.append(
                f"| {mode} | {len(s['seeds'])} | {_f(s['auc'], '.4f')} "
                f"| {_f(s['logloss'], '.4f')} | {_pm(s['dauc_mean'], s['dauc_se'])} "
                f"| {_pm(s['dlogloss_mean'], s['dlogloss_se'])} "
                f"| {_f(s['dtrain_loss_mean'], '+.4f')} "
                f"| {_pm(s['dauc_vs_ref_mean'], s['dauc_vs_ref_se'])} "
                f"| {_f(s['step_wire_bytes'], ',.0f')} | {_f(s['bytes_vs_none'], '.1f')}x "
                f"| {_f(s['fwd_ratio'], '.1f')}x | {_f(s['bwd_ratio'], '.1f')}x "
                f"| {_f(s['rss_peak_mib'], '.0f')} / {_f(s['rss_growth_mib'], '+.0f')} "
                f"| {verdict} |"
            )
        lines += ["", f"{dataset} tail:", *format_tail(d, ref), ""]
        lines.append("comm per mode: " + "; ".join(
            f"{mode}: {s['comm']}" for mode, s in d["modes"].items()
        ))  # fmt: skip
        plans = {s["plan"] for s in d["modes"].values()}
        if len(plans) > 1:  # --sharding auto: the planner prices each mode's wire format
            lines.append("plans differ: " + "; ".join(
                f"{mode}: {s['plan']}" for mode, s in d["modes"].items()
            ))  # fmt: skip
    lines.append(
        f"target: mean paired dAUC >= {DAUC_FLOOR}, mean dLogLoss <= +{DLOGLOSS_CEIL}, and dAUC "
        "vs the reference (MX4 both ways) >= -1 SE; step bytes = input + forward + backward "
        "all-to-all wire bytes per training step; tail: sd of the paired dAUC <= "
        f"{SD_VS_REF_CEIL}x the reference's, no seed's dAUC below the worse of the reference's "
        f"and {'/'.join(TAIL_CONTROLS)}'s worst seeds (without them: {WORST_DAUC_FLOOR}); "
        "train-loss gap: the paired difference of the example's final.train_loss"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the protocol.

    Args:
        argv: Command line.

    Returns:
        Exit status (1 if a run failed).
    """
    args = parse_args(argv)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="accuracy_bench."))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = Path(args.json) if args.json else out_dir / "accuracy.json"
    plan = [
        (dataset, seed, v)
        for dataset in args.datasets
        for seed in args.seeds
        for v in args.variants
    ]
    print(
        f"accuracy bench: {len(plan)} runs ({', '.join(v.name for v in args.variants)}; "
        f"seeds {args.seeds}; {', '.join(args.datasets)}); runs in {out_dir}; JSON {path}",
        flush=True,
    )
    config = {
        k: v for k, v in vars(args).items() if k not in ("variants", "variant", "datasets")
    } | {"datasets": args.datasets, "variants": [vars(v) for v in args.variants]}
    runs: list[dict[str, Any]] = []
    for dataset, seed, variant in plan:
        runs.append(run_one(args, dataset, variant, seed, out_dir))
        summary = summarize(runs, args.variants, args.ref)
        result = {
            "config": config,
            "host": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
            "complete": len(runs) == len(plan),
            "runs": [{k: v for k, v in r.items() if k != "metrics"} for r in runs],
            "summary": summary,
        }
        path.write_text(json.dumps(result, indent=1, default=str))
    print(format_table(summarize(runs, args.variants, args.ref)), flush=True)
    print(f"JSON: {path}", flush=True)
    return 0 if all(r.get("metrics") for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
