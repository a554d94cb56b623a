"""Gloo ranks on localhost for the in-process benchmarks: spawn, join, collect one result each.

A bench's ``worker(rank, args)`` runs inside :func:`rank_group` (the process group of
``args.world`` ranks, one CPU thread each, as the example runs under torchrun) and returns its
result; :func:`run_ranks` spawns the ranks and returns their results in rank order.
:func:`add_layout_args` adds the flags every such bench shares.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def add_layout_args(ap: argparse.ArgumentParser) -> None:
    """The ranks and the e2e bench's layout: ``--world``, ``--local-world``, ``--rows``, ``--dim``.

    Args:
        ap: The bench's parser.
    """
    ap.add_argument("--world", type=int, default=2, help="gloo ranks on localhost")
    ap.add_argument("--local-world", type=int, default=None, help="ranks per host (topology)")
    ap.add_argument("--rows", type=int, default=2048, help="batch per rank")
    ap.add_argument("--dim", type=int, default=128)


def _entry(
    rank: int, port: int, worker: Callable[[int, Any], Any], args: argparse.Namespace, q: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(LOCAL_WORLD_SIZE=str(args.local_world or args.world))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=900)
    )
    try:
        result = worker(rank, args)
        dist.barrier()  # leave together
        q.put((rank, result))
    finally:
        dist.destroy_process_group()


def run_ranks(worker: Callable[[int, Any], Any], args: argparse.Namespace) -> list[Any]:
    """Runs ``worker(rank, args)`` on ``args.world`` spawned gloo ranks.

    Args:
        worker: A module-level function (spawned processes import it by name).
        args: The bench's flags (picklable; ``world`` and ``local_world`` read here).

    Returns:
        Each rank's result, in rank order.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, port, worker, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return [r for _, r in results]
