"""The fixed cost of one coded exchange: two rounds (sizes, then payloads) against one (slots).

``--world`` gloo ranks on localhost each run a forward and a backward of the lossy pooled
all-to-all (``alltoall_pooled_lossy``, the seam's own path) on small blocks, so that the time is
the exchange's fixed cost rather than its bytes, in three modes interleaved call by call (the
machine's load hits them alike):

- ``two_rounds``: the size exchange, then the payloads (``LossyAll2AllPooledInfo.slots`` None:
  every call as before the slots);
- ``one_round``: the dist's slot history (``exchange_slots.SlotHistory``): after the first call
  of a kind, one all-to-all of fixed-capacity slots per direction (overflows counted);
- ``torchrec``: one fp32 ``all_to_all_single`` of the same rows each way (TorchRec's fixed cost,
  no codec).

Prints the median ms of a forward + backward per mode over ``--calls`` calls (the first
``--warmup`` dropped), and the medians' differences; ``--json`` writes them.

    .venv/bin/python benchmarks/exchange_rounds_bench.py --world 2
    .venv/bin/python benchmarks/exchange_rounds_bench.py --world 4 --rows 64 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("two_rounds", "one_round", "torchrec")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _info(world: int, tables: int, dim: int, rows: int, slots: bool) -> Any:
    """A table-wise layout (table ``t`` on rank ``t % world``) at the default config."""
    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed import BlockSpec, LossyComms, StaticBounds
    from torchrec_lossy.distributed.call_ledger import CallLedger
    from torchrec_lossy.distributed.exchange_slots import SlotHistory
    from torchrec_lossy.distributed.pooled_blocks import LossyAll2AllPooledInfo

    names = [f"t{i}" for i in range(tables)]
    config = LossyCommsConfig(backward="lossy")
    comms = LossyComms(config=config, bounds=StaticBounds(names, config))
    layout = [
        tuple(BlockSpec(n, dim * k, 1, dim) for k, n in enumerate(names[r::world]))
        for r in range(world)
    ]
    return LossyAll2AllPooledInfo(
        batch_size_per_rank=[rows] * world,
        layout=layout,
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(names),
        slots=SlotHistory(world) if slots else None,
    )


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy
        from torchrec_lossy.distributed.pooled_payload import warm_up_host

        warm_up_host()
        infos = {m: _info(world, args.tables, args.dim, args.rows, m == "one_round") for m in MODES}
        dims = [sum(s.width for s in specs) for specs in infos["one_round"].layout]
        d_local = dims[rank]
        g = torch.Generator().manual_seed(rank)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        isends = [0]
        real_isend = dist.isend

        def counting_isend(*a: Any, **kw: Any) -> Any:
            isends[0] += 1
            return real_isend(*a, **kw)

        dist.isend = counting_isend  # type: ignore[assignment]
        for call in range(args.calls):
            x = torch.randn(args.rows * world, d_local, generator=g)
            for mode in MODES:
                dist.barrier()
                start = time.perf_counter()
                if mode == "torchrec":  # each rank's columns differ: flat, uneven splits
                    mine = [args.rows * d_local] * world
                    theirs = [args.rows * d for d in dims]
                    recv = torch.empty(sum(theirs))
                    dist.all_to_all_single(recv, x.reshape(-1), theirs, mine)
                    grad = torch.empty(sum(theirs))
                    dist.all_to_all_single(torch.empty(sum(mine)), grad, mine, theirs)
                else:
                    xr = x.clone().requires_grad_()
                    y = alltoall_pooled_lossy(xr, infos[mode]).wait()
                    y.backward(torch.ones_like(y))
                if call >= args.warmup:
                    times[mode].append(1e3 * (time.perf_counter() - start))
        med = {m: statistics.median(v) for m, v in times.items()}
        out.put((rank, med, isends[0]))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Runs the bench; prints the table (rank 0's medians and the slowest rank's)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="gloo ranks on localhost")
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rows", type=int, default=64, help="batch per rank")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.world < 2 or args.calls <= args.warmup:
        ap.error("--world >= 2 and --calls > --warmup")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args, q)) for r in range(args.world)
    ]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join()
    slowest = {m: max(r[1][m] for r in results) for m in MODES}
    overflows = sum(r[2] for r in results)
    print(
        f"exchange_rounds_bench: {args.world} ranks, {args.tables} tables x dim {args.dim}, "
        f"{args.rows} rows/rank, {args.calls - args.warmup} calls (median ms, fwd + bwd)"
    )
    print("| mode | median ms (slowest rank) |\n|---|---:|")
    for m in MODES:
        print(f"| {m} | {slowest[m]:.3f} |")
    saved = slowest["two_rounds"] - slowest["one_round"]
    print(
        f"one round saves {saved:.3f} ms per fwd + bwd; the seam's fixed cost over TorchRec's: "
        f"{slowest['two_rounds'] - slowest['torchrec']:.3f} ms (two rounds) -> "
        f"{slowest['one_round'] - slowest['torchrec']:.3f} ms (one round); "
        f"{overflows} overflow sends over all ranks"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_ms": slowest, "overflow_sends": overflows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
