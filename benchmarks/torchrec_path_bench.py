"""Does ``auto``'s TorchRec path cost anything over plain TorchRec? And the seam's raw path?

``--world`` gloo ranks on localhost shard one EmbeddingBagCollection (26 Criteo Kaggle tables
capped at ``--cap`` rows, dim ``--dim``, table-wise, one plan for all) three times and train
the copies step by step, interleaved call by call so the machine's load hits them alike:

- ``none``: TorchRec's ``EmbeddingBagCollectionSharder`` (the e2e bench's ``none``);
- ``auto_torchrec``: what ``comms.format: auto`` hands out when it takes TorchRec's own
  all-to-all, ``CheckedEmbeddingBagCollectionSharder`` (the ranks' configs checked at sharding);
- ``seam_raw``: this project's sharder with every table raw (``auto``'s other choice on a fast
  link: the exact dedupe, the packed KJT input dist, the seam's exchange);
- ``seam_packed`` / ``seam_entropy`` (``--modes``): the sharder with ``comms.format`` forced to
  the codec's packed / entropy format (issue 34's "forced entropy" step against ``none``).

``--seam-cost`` also times, on the same ranks between the steps, what ``comms.format: auto``
charges the seam at start-up (``planner/seam_cost.py``: its layout work a step and its
exchange's fixed cost, each against TorchRec's, on the same 26 tables) and prints their medians.

Each step is a forward (input dist, lookup, output dist), a sum loss and its backward (the
fused optimizer's update); the same Zipf batch of ``--rows`` rows per rank for every mode (a
fresh copy each), the modes' order rotating step by step.
Prints the median ms a step per mode (the slowest rank's), its ratio to ``none``, the median of
the step-by-step ratios to ``none`` (each step's load cancels; the largest over ranks) and the
load.

    .venv/bin/python benchmarks/torchrec_path_bench.py --world 2 --steps 30
    .venv/bin/python benchmarks/torchrec_path_bench.py --world 4 --local-world 2 --json out.json
    .venv/bin/python benchmarks/torchrec_path_bench.py --dim 16 --rows 512 --seam-cost \
        --modes none,seam_raw,seam_packed,seam_entropy      # the `make demo` model's shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from gloo_ranks import add_layout_args, run_ranks

MODES = ("none", "auto_torchrec", "seam_raw", "seam_packed", "seam_entropy")
DEFAULT_MODES = "none,auto_torchrec,seam_raw"


def _sharders(names: list[str]) -> dict[str, Any]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_lossy.config import LossyCommsConfig, TableCodecConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder
    from torchrec_lossy.distributed.torchrec_path import CheckedEmbeddingBagCollectionSharder

    raw = LossyCommsConfig(format="raw", tables={n: TableCodecConfig(format="raw") for n in names})
    return {
        "none": EmbeddingBagCollectionSharder(),
        "auto_torchrec": CheckedEmbeddingBagCollectionSharder(raw),
        "seam_raw": LossyEmbeddingBagCollectionSharder(comms_config=raw),
        "seam_packed": LossyEmbeddingBagCollectionSharder(
            comms_config=LossyCommsConfig(format="packed")
        ),
        "seam_entropy": LossyEmbeddingBagCollectionSharder(
            comms_config=LossyCommsConfig(format="entropy")
        ),
    }


def _batch(names: list[str], sizes: list[int], rows: int, seed: int) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lossy import traffic

    ids = [
        traffic.sample_ids(n, rows, torch.Generator().manual_seed(seed * 131 + i))
        for i, n in enumerate(sizes)
    ]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n in names],
        values=torch.cat(ids),
        lengths=torch.ones(rows * len(names), dtype=torch.int32),
    )


def _seam_cost(names: list[str], sizes: list[int], args: argparse.Namespace) -> dict[str, float]:
    """What ``auto`` measures of the seam at start-up (``planner/seam_cost.py``), on these
    tables: its layout work a step and its exchange's fixed cost, each against TorchRec's."""
    from torchrec_lossy.config import EmbeddingTableConfig
    from torchrec_lossy.planner.seam_cost import time_exchange_ms, time_seam_step

    tables = [
        EmbeddingTableConfig(name=n, num_embeddings=s, embedding_dim=args.dim)
        for n, s in zip(names, sizes, strict=True)
    ]
    cpu = torch.device("cpu")
    seam, torchrec = time_seam_step(tables, args.rows, args.world, cpu, True, reps=3)
    seam_x, torchrec_x = time_exchange_ms(tables, dist.group.WORLD, cpu, reps=3)
    return {"seam_step": seam - torchrec, "exchange": seam_x - torchrec_x}


def _worker(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """The copies trained step by step, interleaved; this rank's median ms a step each."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_lossy.cardinalities import CRITEO_KAGGLE_CARDINALITIES

    modes = args.modes
    sizes = [min(n, args.cap) for n in CRITEO_KAGGLE_CARDINALITIES]
    names = [f"t{i}" for i in range(len(sizes))]
    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=args.dim, num_embeddings=s,
                           feature_names=[f"f_{n}"])
        for n, s in zip(names, sizes, strict=True)
    ]  # fmt: skip
    sharders = _sharders(names)
    topo = Topology(
        world_size=args.world,
        local_world_size=args.local_world or args.world,
        compute_device="cpu",
    )
    constraints = {n: ParameterConstraints(sharding_types=["table_wise"]) for n in names}
    planner = EmbeddingShardingPlanner(topology=topo, constraints=constraints)
    meta = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    plan = planner.collective_plan(meta, [sharders["none"]], dist.group.WORLD)
    models = {}
    for mode in modes:
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        models[mode] = DistributedModelParallel(
            ebc, device=torch.device("cpu"), plan=plan, sharders=[sharders[mode]]
        )
    times: dict[str, list[float]] = {m: [] for m in modes}
    costs: dict[str, list[float]] = {"seam_step": [], "exchange": []}
    n = len(modes)
    for step in range(args.steps + args.warmup):
        # The order rotates step by step, and each mode gets its own copy of the batch (a KJT
        # caches its offsets and permutes: the first user of a shared one would pay for all).
        for mode in modes[step % n :] + modes[: step % n]:
            kjt = _batch(names, sizes, args.rows, 1000 * step + rank)
            dist.barrier()
            t0 = time.perf_counter()
            pooled = models[mode](kjt).wait()
            pooled.values().sum().backward()
            dist.barrier()  # the step ends when the slowest rank's does
            if step >= args.warmup:
                times[mode].append(1e3 * (time.perf_counter() - t0))
        if args.seam_cost and step >= args.warmup and step % 5 == 0:
            for k, v in _seam_cost(names, sizes, args).items():
                costs[k].append(v)
    # Paired: each step's time over none's of the same step (the load of that step cancels).
    base = times[modes[0]]
    paired = {m: statistics.median(a / b for a, b in zip(times[m], base, strict=True))
              for m in modes}  # fmt: skip
    return {
        "median_ms": {m: statistics.median(v) for m, v in times.items()},
        "paired": paired,
        "seam_cost": {k: statistics.median(v) for k, v in costs.items() if v},
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the bench; prints the medians and their ratios to ``none``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layout_args(ap)
    ap.add_argument("--cap", type=int, default=100_000, help="rows per table at most")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {MODES}")
    ap.add_argument("--seam-cost", action="store_true", help="also time planner/seam_cost.py")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error("--world >= 2")
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or args.modes[0] != "none" or not set(args.modes) <= set(MODES):
        ap.error(f"--modes {args.modes}: 'none' first, then any of {MODES}")
    load0 = os.getloadavg()[0]
    results = run_ranks(_worker, args)
    modes = args.modes
    slowest = {m: max(r["median_ms"][m] for r in results) for m in modes}
    paired = {m: max(r["paired"][m] for r in results) for m in modes}
    costs = {k: max(r["seam_cost"][k] for r in results) for k in results[0]["seam_cost"]}
    load = (load0 + os.getloadavg()[0]) / 2
    print(
        f"torchrec_path_bench: {args.world} ranks, 26 tables x dim {args.dim} (<= {args.cap:,} "
        f"rows), {args.rows} rows/rank, {args.steps} steps interleaved; load {load:.1f}"
    )
    print(
        "| mode | median ms a step (slowest rank) | vs none | step by step vs none (median) |\n"
        "|---|---:|---:|---:|"
    )
    for m in modes:
        ratio = slowest[m] / slowest["none"]
        print(f"| {m} | {slowest[m]:.1f} | {ratio:.3f}x | {paired[m]:.3f}x |")
    if costs:
        print(
            f"seam_cost (median over the steps, slowest rank): layout work {costs['seam_step']:.2f}"
            f" ms a step over TorchRec's, exchange {costs['exchange']:.2f} ms over TorchRec's"
        )
    if args.json:
        with open(args.json, "w") as f:
            out = {"args": vars(args), "median_ms": slowest, "paired": paired, "load": load,
                   "seam_cost": costs}  # fmt: skip
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
