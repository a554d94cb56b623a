"""The guard's overhead (issue 32: under 1% of ``make demo``'s step).

Two measurements:

1. ``--pairs N``: the demo's command (2 ranks, ``--link-gbit 1``) run N times with
   ``comms.guard`` off and N times on, alternating in pairs (order swapped every pair against
   drift); per run the median steady step time and the guard's own seconds (its decisions,
   all-reduces included: ``guard.seconds`` of the metrics), per pair the step-time change.
2. Always: the encoders' bound lookup (``pooled_payload.codec_bounds``) per call over 26
   tables, guard off / on and untripped / on with a tightened table, best of 5 x 2,000 calls;
   the guard's own step (``BoundGuard.step``, alone, no process group) per step over 16-step
   checks; and the error sample's cost per sampled backward call (what the guard acts on), on
   the host path and on the device path (``--sample-backends``: ``reference`` runs the device
   orchestration over torch twins on CPU, ``auto`` on a GPU): one sender's backward encode of
   the 26 Kaggle-size tables at 2 ranks (``input_dist_bench``'s gradients), sampled and not,
   its next host read included, best of ``--sample-reps``.

    .venv/bin/python benchmarks/guard_bench.py --pairs 3 --out-dir runs/guard
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def lookup_us(tables: int = 26, calls: int = 2000, repeats: int = 5) -> dict[str, float]:
    """Microseconds per ``codec_bounds`` call of each direction, by guard state.

    Args:
        tables: Tables of the call (one block each).
        calls: Calls per timing.
        repeats: Timings; the best is kept.

    Returns:
        ``{"<state> <direction>": us}``.
    """
    from torchrec_lossy.config import GuardConfig, LossyCommsConfig
    from torchrec_lossy.distributed.call_ledger import CallRecord
    from torchrec_lossy.distributed.comms import StaticBounds
    from torchrec_lossy.distributed.guard import BoundGuard
    from torchrec_lossy.distributed.pooled_payload import codec_bounds

    names = [f"t_cat_{i}" for i in range(tables)]
    config = LossyCommsConfig()
    tripped = BoundGuard(names, GuardConfig(enabled=True))
    tripped.levels[("bwd", names[3])] = 1
    guards = {
        "off": None,
        "on": BoundGuard(names, GuardConfig(enabled=True)),
        "tripped": tripped,
    }
    plan = SimpleNamespace(distinct=names, table_at=list(range(tables)))
    out = {}
    for state, guard in guards.items():
        comms = SimpleNamespace(config=config, bounds=StaticBounds(names, config), guard=guard)
        info = SimpleNamespace(comms=comms, exact_forward=False)
        for direction in ("fwd", "bwd"):
            record = CallRecord(direction, call=0, step=0)
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(calls):
                    codec_bounds(record, info, plan, tables)  # type: ignore[arg-type]
                best = min(best, time.perf_counter() - start)
            out[f"{state} {direction}"] = 1e6 * best / calls
    return out


def step_us(tables: int = 26, steps: int = 3200, alerts_every: int = 4) -> float:
    """Microseconds per ``BoundGuard.step`` (its steps between checks and its checks alike,
    alone: no process group), with a past-level alert recorded every ``alerts_every`` steps.

    Args:
        tables: The module's tables.
        steps: Steps timed (200 checks at the default ``check_every`` of 16).
        alerts_every: Steps between alerts.

    Returns:
        Mean microseconds per step.
    """
    from torchrec_lossy.config import GuardConfig
    from torchrec_lossy.distributed.guard import BoundGuard
    from torchrec_lossy.distributed.stats import ErrorAlert, LossyCommsStats

    names = [f"t_cat_{i}" for i in range(tables)]
    guard = BoundGuard(names, GuardConfig(enabled=True, max_tightenings=1 << 20))
    stats = LossyCommsStats()
    alert = ErrorAlert("bwd", names[3], 0, 1.0, 0, True)
    elapsed = 0.0
    for s in range(steps):
        if s % alerts_every == 0:
            stats.record_error_samples("bwd", [], [alert])
        start = time.perf_counter()
        guard.step(stats, None)
        elapsed += time.perf_counter() - start
    return 1e6 * elapsed / steps


def sample_ms(backend: str, reps: int = 5) -> dict[str, float]:
    """Milliseconds of one sender's backward encode (26 Kaggle-size tables, 2 ranks, the
    default backward) without and with the error sample, its next host read included.

    Args:
        backend: ``CodecConfig.backend`` (``"cpu"``: the host path; ``"reference"`` /
            ``"auto"`` on CUDA: the device path).
        reps: Timings of each; the best is kept.

    Returns:
        ``{"encode": ms, "sampled": ms, "sample": ms}`` (the last the difference).
    """
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from input_dist_bench import _default_info, _pooled_grads, _pooled_setup

    from torchrec_lossy.config import CodecConfig, LossyCommsConfig
    from torchrec_lossy.distributed.call_ledger import read_checked
    from torchrec_lossy.distributed.pooled_payload import start_encode
    from torchrec_lossy.traffic import sample_ids, table_cardinalities

    torch.set_num_threads(1)  # as each of the example's two ranks on this 2-core box
    world, batch, dim = 2, 2048, 32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    cards = table_cardinalities("criteo_kaggle")
    ids = torch.stack([sample_ids(c, world * batch, generator=g) for c in cards], dim=1)
    grads = _pooled_grads(world * batch, dim, g)
    names, layout = _pooled_setup(world, dim)
    blocks = []
    for o in range(world):  # sender 0's gradient blocks, the gradient dedupe applied
        per_table = []
        for spec in layout[o]:
            f = names.index(spec.table)
            uniq, inv = torch.unique(ids[:batch, f], return_inverse=True)
            per_table.append(
                grads[:batch, f].new_zeros((uniq.numel(), dim)).index_add_(0, inv, grads[:batch, f])
            )
        blocks.append([b.to(device) for b in per_table])
    out = {}
    for name, every in (("encode", 0), ("sampled", 1)):
        config = LossyCommsConfig(codec=CodecConfig(backend=backend), error_sample_every=every)
        info = _default_info(names, layout, batch, config)
        best = math.inf
        for _ in range(reps + 1):  # the first warms up
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            start_encode("bwd", blocks, layout, info, device, 0).read()
            read_checked(info.ledger)  # where the device path's sample is read
            best = min(best, time.perf_counter() - start)
        assert every == 0 or info.comms.stats.table("t1", "bwd").error_count > 0
        out[name] = 1e3 * best
    out["sample"] = out["sampled"] - out["encode"]
    return out


def demo_run(guard: bool, out_dir: Path, tag: str, steps: int | None) -> dict[str, Any]:
    """One run of the demo's command with ``comms.guard`` off or on.

    Args:
        guard: ``comms.guard.enabled``.
        out_dir: Where its config and metrics go.
        tag: The run's file name stem.
        steps: ``--steps`` (None: the demo's default).

    Returns:
        Its median and mean steady step time, training seconds and the guard's seconds.
    """
    config = out_dir / f"{tag}.yaml"
    config.write_text(f"comms:\n  guard:\n    enabled: {'true' if guard else 'false'}\n")
    metrics = out_dir / f"{tag}.json"
    cmd = [
        str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc_per_node=2",
        str(ROOT / "examples" / "dlrm_criteo.py"), "--link-gbit", "1", "--no-progress",
        "--config", str(config), "--metrics-json", str(metrics),
    ]  # fmt: skip
    if steps is not None:
        cmd += ["--steps", str(steps)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    m = json.loads(metrics.read_text())
    g = m.get("guard") or {}
    return {
        "guard": guard,
        "median_s": m["timing"]["step_time_s_median"],
        "mean_s": m["timing"]["step_time_s_mean"],
        "train_s": m["timing"]["train_s"],
        "guard_s": g.get("seconds", 0.0),
        "tightenings": len(g.get("events", [])),
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the measurements and prints them.

    Args:
        argv: Command line (default ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=0, help="paired demo runs (0: lookups only)")
    ap.add_argument("--steps", type=int, help="--steps of each run (default: the demo's)")
    ap.add_argument("--out-dir", default="runs/guard")
    ap.add_argument(
        "--sample-backends", nargs="*", default=["cpu", "reference"],
        help="codec backends whose error-sample cost is measured (none: skip)",
    )  # fmt: skip
    ap.add_argument("--sample-reps", type=int, default=5)
    args = ap.parse_args(argv)
    for key, us in lookup_us().items():
        print(f"codec_bounds guard {key}: {us:.2f} us/call", flush=True)
    print(f"BoundGuard.step: {step_us():.2f} us/step (checks every 16 included)", flush=True)
    for backend in args.sample_backends:
        t = sample_ms(backend, args.sample_reps)
        print(
            f"error sample, backend {backend}: backward encode {t['encode']:.1f} ms, sampled "
            f"{t['sampled']:.1f} ms: the sample {t['sample']:.1f} ms per sampled call "
            f"({100 * t['sample'] / t['encode']:.1f}% of the encode; every 16th call: "
            f"{100 * t['sample'] / t['encode'] / 16:.2f}%)",
            flush=True,
        )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    changes = []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        runs = {
            g: demo_run(g, out_dir, f"pair{i}_{'on' if g else 'off'}", args.steps) for g in order
        }
        off, on = runs[False], runs[True]
        change = on["median_s"] / off["median_s"] - 1
        changes.append(change)
        print(
            f"pair {i}: median step off {1e3 * off['median_s']:.1f} ms, on "
            f"{1e3 * on['median_s']:.1f} ms ({100 * change:+.2f}%); guard "
            f"{1e3 * on['guard_s']:.2f} ms of {on['train_s']:.1f} s training "
            f"({100 * on['guard_s'] / on['train_s']:.4f}%), {on['tightenings']} tightenings",
            flush=True,
        )
        (out_dir / f"pair{i}.json").write_text(json.dumps(runs, indent=1))
    if len(changes) > 1:
        mean = statistics.fmean(changes)
        se = statistics.stdev(changes) / math.sqrt(len(changes))
        print(f"step-time change, guard on vs off: {100 * mean:+.2f}% +- {100 * se:.2f}% (SE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
