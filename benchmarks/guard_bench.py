"""The guard's overhead (issue 32: under 1% of ``make demo``'s step).

Two measurements:

1. ``--pairs N``: the demo's command (2 ranks, ``--link-gbit 1``) run N times with
   ``comms.guard`` off and N times on, alternating in pairs (order swapped every pair against
   drift); per run the median steady step time and the guard's own seconds (its decisions,
   all-reduces included: ``guard.seconds`` of the metrics), per pair the step-time change.
2. Always: the encoders' bound lookup (``pooled_payload.codec_bounds``) per call over 26
   tables, guard off / on and untripped / on with a tightened table, best of 5 x 2,000 calls.

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
    args = ap.parse_args(argv)
    for key, us in lookup_us().items():
        print(f"codec_bounds guard {key}: {us:.2f} us/call", flush=True)
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
