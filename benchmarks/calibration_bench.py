"""How steady ``comms.format: auto``'s start-up calibration is under load, and what it decides.

``--world`` gloo ranks on localhost run the example's start-up calibration
(``measure_speeds`` with the process group, then ``agree_speeds``) ``--repeats`` times on the
e2e bench's layout (26 Criteo Kaggle tables capped at 100,000 rows, dim 128, ``--rows`` rows per
rank), alternating two orders of timing trials repeat by repeat, so the machine's load hits
both alike:

- ``interleaved``: every figure the best of ``--reps`` rounds of one trial per candidate
  (``speeds.interleaved_best``, what the planner uses);
- ``sequential``: each candidate's ``--reps`` trials back to back (how it was timed before:
  one slow window takes all of a candidate's trials).

Per repeat it prints the agreed figures (the entropy codec's encode / decode GiB/s, bf16's
encode, the seam's fixed cost a step, its exchange's cost over TorchRec's, the collective
round) and what ``auto`` decides with them on each of ``--rates`` (priced as the e2e bench's
``--link-gbit``; ``--local-world`` ranks per host), then each figure's spread (max / min) per
order, and the 1-minute load average.

    .venv/bin/python benchmarks/calibration_bench.py --world 2 --repeats 6
    .venv/bin/python benchmarks/calibration_bench.py --world 4 --local-world 2 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from gloo_ranks import add_layout_args, run_ranks

ORDERS = ("interleaved", "sequential")
FIGURES = ("entropy_enc", "entropy_dec", "bf16_enc", "seam_ms", "exchange_ms", "round_ms")
RATES_GBIT = {"1gbit": 1.0, "10gbit": 10.0, "localhost": None}


def sequential_best(
    interleaved: Callable[..., dict[Hashable, float]],
    fns: Mapping[Hashable, Callable[[], object]],
    reps: int,
    sync: Callable[[], None],
) -> dict[Hashable, float]:
    """The order timed before: each function's trials back to back (the best counts).

    Args:
        interleaved: ``speeds.interleaved_best`` (timing one function at a time).
        fns: What to time, by name.
        reps: Trials per function.
        sync: Waits for the device (or the ranks).

    Returns:
        Seconds per name.
    """
    return {k: interleaved({k: fn}, reps, sync)[k] for k, fn in fns.items()}


def _plan_config(args: argparse.Namespace, rate: str) -> Any:
    """The e2e bench's planner config at ``rate`` (as ``examples/dlrm_env.py`` fits it)."""
    from torchrec_lossy.cardinalities import CRITEO_KAGGLE_CARDINALITIES
    from torchrec_lossy.config import (
        EmbeddingTableConfig,
        LossyPlanConfig,
        TopologyConfig,
        load_yaml,
    )

    base = load_yaml(LossyPlanConfig, args.config)
    tables = tuple(
        EmbeddingTableConfig(f"t_cat_{i}", min(n, 100_000), args.dim, (f"cat_{i}",))
        for i, n in enumerate(CRITEO_KAGGLE_CARDINALITIES)
    )
    gbit = RATES_GBIT[rate]
    local = args.local_world or args.world
    topo = TopologyConfig(world_size=args.world, local_world_size=local, compute_device="cpu")
    if gbit is not None:
        gib_s = gbit * 1e9 / 8 / (1 << 30)
        intra = None if args.world > local else gib_s
        topo = dataclasses.replace(
            topo, intra_host_bandwidth_gib_s=intra, inter_host_bandwidth_gib_s=gib_s
        )
    planner = dataclasses.replace(base.planner, global_batch_size=args.rows * args.world)
    return dataclasses.replace(base, embedding_tables=tables, topology=topo, planner=planner)


def _decision(config: Any, speeds: Any) -> str:
    """What ``auto`` runs with ``speeds``: TorchRec's path, the seam raw, or the codec."""
    from torchrec_lossy.planner import LossyShardingPlanner

    planner = LossyShardingPlanner(config, speeds=speeds, stats=[])
    if planner.torchrec_path:
        return "torchrec"
    comms = planner.comms_config
    coded = sum(comms.table(t.name).compress for t in config.embedding_tables)
    return f"{comms.codec.format} x{coded}" if coded else "seam raw"


def _worker(rank: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--repeats`` calibrations on this rank; the agreed figures and decisions of each."""
    from torchrec_lossy.planner import speeds as speeds_mod

    configs = {r: _plan_config(args, r) for r in args.rates}
    tables = configs[args.rates[0]].embedding_tables
    comms = configs[args.rates[0]].comms
    interleaved = speeds_mod.interleaved_best
    rows = []
    for repeat in range(args.repeats):
        order = ORDERS[repeat % 2]
        speeds_mod.interleaved_best = (  # type: ignore[assignment]
            interleaved
            if order == "interleaved"
            else functools.partial(sequential_best, interleaved)
        )
        try:
            mine = speeds_mod.measure_speeds(
                tables, args.rows, comms, torch.device("cpu"), reps=args.reps,
                world_size=args.world, group=dist.group.WORLD,
            )  # fmt: skip
        finally:
            speeds_mod.interleaved_best = interleaved  # type: ignore[assignment]
        agreed = speeds_mod.agree_speeds(mine, dist.group.WORLD, torch.device("cpu"))
        f = agreed.formats
        rows.append(
            {
                "repeat": repeat,
                "order": order,
                "load": os.getloadavg()[0],
                "entropy_enc": f["entropy"][0],
                "entropy_dec": f["entropy"][1],
                "bf16_enc": f["bf16"][0],
                "seam_ms": agreed.seam_ms,
                "exchange_ms": agreed.exchange_ms,
                "round_ms": agreed.round_ms,
                "decisions": {r: _decision(c, agreed) for r, c in configs.items()},
            }
        )
    return rows


def _spread(rows: list[dict[str, Any]], order: str, key: str) -> str:
    values = [r[key] for r in rows if r["order"] == order and r[key] is not None]
    if not values or min(values) <= 0:
        return "-"
    return f"{max(values) / min(values):.2f}x"


def main(argv: list[str] | None = None) -> int:
    """Runs the bench; prints one row per repeat and the spreads."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layout_args(ap)
    ap.add_argument("--repeats", type=int, default=6, help="calibrations (orders alternate)")
    ap.add_argument("--reps", type=int, default=5, help="trials per figure")
    ap.add_argument("--rates", default="1gbit,10gbit,localhost")
    ap.add_argument("--config", default="configs/criteo_kaggle.yaml")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.rates = [r for r in args.rates.split(",") if r]
    if args.world < 2 or any(r not in RATES_GBIT for r in args.rates):
        ap.error(f"--world >= 2 and --rates among {sorted(RATES_GBIT)}")
    rows = run_ranks(_worker, args)[0]  # the agreed figures: the same on every rank
    print(
        f"calibration_bench: {args.world} ranks ({args.local_world or args.world} per host "
        f"priced), 26 tables x dim {args.dim}, {args.rows} rows/rank, {args.reps} trials a "
        "figure; agreed (slowest rank) figures"
    )
    head = (
        "| # | order | load | entropy enc/dec GiB/s | bf16 enc | seam ms | exchange ms | round ms |"
    )
    print(head + "".join(f" {r} |" for r in args.rates))
    print("|---" * (8 + len(args.rates)) + "|")
    for r in rows:
        cells = [
            str(r["repeat"]),
            r["order"],
            f"{r['load']:.1f}",
            f"{r['entropy_enc']:.3g}/{r['entropy_dec']:.3g}",
            f"{r['bf16_enc']:.3g}",
            *(
                "-" if r[k] is None else f"{r[k]:.3g}"
                for k in ("seam_ms", "exchange_ms", "round_ms")
            ),
            *(r["decisions"][rate] for rate in args.rates),
        ]
        print("| " + " | ".join(cells) + " |")
    print("\nspread (max / min over the repeats of an order):")
    for order in ORDERS:
        parts = ", ".join(f"{k} {_spread(rows, order, k)}" for k in FIGURES)
        print(f"- {order}: {parts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1, default=str)
    return 0 if all(math.isfinite(r["entropy_enc"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
