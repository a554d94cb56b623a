"""How much coding the chunked exchange hides under the wire: one round against a ring of rounds.

Gloo ranks each run a forward and a backward of the lossy pooled all-to-all
(``alltoall_pooled_lossy``, the seam's own path; host codec, one-round slots) in two modes
interleaved call by call (the machine's load hits them alike):

- ``whole``: every payload encoded, one all-to-all of slots, every source decoded
  (``SlotHistory(chunks=0)``);
- ``chunked``: a ring of rounds, one per peer (``distributed/exchange_chunks.py``): a round's
  destinations encoded and posted while the previous round travels, each round's sources
  decoded as it arrives.

Per mode: the median step (the exchange's forward + backward, ms), its encode and decode ms (the
call's telemetry), and for ``whole`` the rest, the time that is not coding ("wire": waits,
collectives, copies). Hidden = (whole step - chunked step) / (chunked encode + decode): the share
of the coding the chunks took off the step (the most it can be is min(coding, wire) / coding).
The slowest rank's medians are reported; the load average is printed with them.

    .venv/bin/python benchmarks/overlap_bench.py --world 3              # localhost, spawned
    .venv/bin/python benchmarks/overlap_bench.py --world 4 --json o.json
    # 2 hosts x 2 ranks over a rate-limited link (root; the namespaces are the script's own):
    NETNS_SCRIPT=benchmarks/overlap_bench.py scripts/netns_cluster.sh --rate 1gbit \\
        --nproc-per-node 2 --subnet 10.231.9 --port 29591 -- --json o.json
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

MODES = ("whole", "chunked")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _info(world: int, args: argparse.Namespace, chunks: int) -> Any:
    """A table-wise layout (table ``t`` on rank ``t % world``) at the default config."""
    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed import BlockSpec, LossyComms, StaticBounds
    from torchrec_lossy.distributed.call_ledger import CallLedger
    from torchrec_lossy.distributed.exchange_slots import SlotHistory
    from torchrec_lossy.distributed.pooled_blocks import LossyAll2AllPooledInfo

    names = [f"t{i}" for i in range(args.tables)]
    config = LossyCommsConfig(backward="lossy")
    comms = LossyComms(config=config, bounds=StaticBounds(names, config))
    layout = [
        tuple(BlockSpec(n, args.dim * k, 1, args.dim) for k, n in enumerate(names[r::world]))
        for r in range(world)
    ]
    return LossyAll2AllPooledInfo(
        batch_size_per_rank=[args.rows] * world,
        layout=layout,
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(names),
        slots=SlotHistory(world, chunks),
    )


def _run(rank: int, world: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """This rank's medians per mode (step, encode, decode ms)."""
    from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy
    from torchrec_lossy.distributed.pooled_payload import warm_up_host

    warm_up_host()
    infos = {m: _info(world, args, 0 if m == "whole" else world - 1) for m in MODES}
    d_local = sum(s.width for s in infos["whole"].layout[rank])
    g = torch.Generator().manual_seed(rank)
    samples: dict[str, dict[str, list[float]]] = {
        m: {"step": [], "encode": [], "decode": []} for m in MODES
    }
    for call in range(args.calls):
        # Embedding-like rows: a few hundred distinct vectors plus noise (they compress ~4-8x).
        base = torch.randn(256, d_local, generator=g)
        idx = torch.randint(0, 256, (args.rows * world,), generator=g)
        x = base[idx] + 0.05 * torch.randn(args.rows * world, d_local, generator=g)
        order = MODES if call % 2 == 0 else MODES[::-1]
        for mode in order:
            info = infos[mode]
            info.comms.stats.reset()
            dist.barrier()
            start = time.perf_counter()
            xr = x.clone().requires_grad_()
            y = alltoall_pooled_lossy(xr, info).wait()
            y.backward(torch.ones_like(y))
            step = time.perf_counter() - start
            if call >= args.warmup:
                stats = info.comms.stats
                s = samples[mode]
                s["step"].append(1e3 * step)
                s["encode"].append(1e3 * sum(stats.total(d).encode_s for d in ("fwd", "bwd")))
                s["decode"].append(1e3 * sum(stats.total(d).decode_s for d in ("fwd", "bwd")))
    return {m: {k: statistics.median(v) for k, v in s.items()} for m, s in samples.items()}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    try:
        out.put((rank, _run(rank, world, args)))
    finally:
        dist.destroy_process_group()


def _report(
    results: list[dict[str, dict[str, float]]], args: argparse.Namespace, link: str
) -> None:
    """Prints the table (the slowest rank's medians) and writes the JSON."""
    med = {m: {k: max(r[m][k] for r in results) for k in results[0][m]} for m in MODES}
    whole, chunked = med["whole"], med["chunked"]
    coding = {m: med[m]["encode"] + med[m]["decode"] for m in MODES}
    wire = whole["step"] - coding["whole"]
    hidden = (whole["step"] - chunked["step"]) / coding["chunked"] if coding["chunked"] else 0.0
    ceiling = min(coding["chunked"], max(wire, 0.0)) / coding["chunked"] if coding["chunked"] else 0
    nominal = args.rows * len(results) * args.tables * args.dim * 4 // len(results)
    load = os.getloadavg()
    print(
        f"overlap_bench: {len(results)} ranks ({link}), {args.tables} tables x dim {args.dim}, "
        f"{args.rows} rows/rank ({nominal / 2**20:.1f} MiB nominal per rank), "
        f"{args.calls - args.warmup} calls per mode interleaved; load {load[0]:.1f} "
        "(median ms of the slowest rank, fwd + bwd)"
    )
    print("| mode | step | encode | decode | wire (step - coding) |\n|---|---:|---:|---:|---:|")
    for m in MODES:
        print(
            f"| {m} | {med[m]['step']:.1f} | {med[m]['encode']:.1f} | {med[m]['decode']:.1f} "
            f"| {med[m]['step'] - coding[m]:.1f} |"
        )
    print(
        f"chunked saves {whole['step'] - chunked['step']:.1f} ms a step "
        f"({whole['step'] / chunked['step']:.2f}x): {100 * hidden:.0f} % of the coding hidden "
        f"under the wire (at most {100 * ceiling:.0f} %: min(coding, wire) / coding)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "world": len(results),
                    "link": link,
                    "load": load,
                    "median_ms": med,
                    "per_rank": results,
                    "hidden": hidden,
                    "hidden_ceiling": ceiling,
                },
                f,
                indent=1,
            )


def main(argv: list[str] | None = None) -> int:
    """Runs the bench (spawned on localhost, or as one torchrun rank); prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=3, help="gloo ranks on localhost (spawned)")
    ap.add_argument("--tables", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=2048, help="batch per rank")
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--link", default=None, help="the link's name in the report (torchrun)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.calls <= args.warmup:
        ap.error("--calls > --warmup")
    if "RANK" in os.environ:  # under torchrun (e.g. scripts/netns_cluster.sh): one rank here
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        try:
            world, rank = dist.get_world_size(), dist.get_rank()
            mine = _run(rank, world, args)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            _report(gathered, args, args.link or "torchrun")
        return 0
    if args.world < 3:
        ap.error("--world >= 3: with one peer there is nothing to overlap")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args, q)) for r in range(args.world)
    ]
    for p in procs:
        p.start()
    results = [r for _, r in sorted(q.get(timeout=3600) for _ in procs)]
    for p in procs:
        p.join()
    _report(results, args, "localhost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
