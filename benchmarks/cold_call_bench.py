"""What a call costs inside a training step, where the model's work has just evicted the caches.

Each call is timed (thread CPU time, one thread) in a loop and again right after a matmul that
stands in for the step's own work, on example-like blocks (``--blocks`` tables of ``--rows`` x
``--dim`` pooled embeddings for one peer): our pooled encode and decode, the codec alone,
TorchRec's FP16 and MX4 qcomm codecs on the fused buffer, a plain copy, and a profiler range
with and without ``profile_range``. Run::

    python benchmarks/cold_call_bench.py [--json out.json]

Prints one row per call (mean over ``--reps`` calls) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from codec_bench import QComm
from table_fmt import cell
from torch.profiler import record_function

from torchrec_lossy.codec import compress_groups, decompress_groups
from torchrec_lossy.config import ErrorBound, LossyCommsConfig
from torchrec_lossy.distributed import BlockSpec, LossyComms, StaticBounds
from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.pooled_blocks import LossyAll2AllPooledInfo, cut_block
from torchrec_lossy.distributed.pooled_decode import decode_payloads
from torchrec_lossy.distributed.pooled_payload import start_encode, warm_up_host
from torchrec_lossy.profile_range import profile_range


def mean_cpu_us(fn: Callable[[], object], reps: int, before: Callable[[], object]) -> float:
    """Mean thread CPU time of ``fn`` in microseconds, ``before`` run (untimed) before each call.

    Args:
        fn: The call.
        reps: Timed calls (after 10 untimed ones).
        before: Run before each call.

    Returns:
        Microseconds per call.
    """
    total = 0.0
    for i in range(reps + 10):
        before()
        start = time.thread_time()
        fn()
        if i >= 10:
            total += time.thread_time() - start
    return 1e6 * total / reps


def qcomm_calls(fused: torch.Tensor) -> dict[str, Callable[[], object]]:
    """TorchRec's FP16 and MX4 forward qcomm codecs on ``fused``, encode and decode apart.

    Args:
        fused: The ``[rows, tables * dim]`` float32 buffer TorchRec's all-to-all would send.

    Returns:
        Call name to the call.
    """
    codecs, flat, calls = QComm().codecs, fused.view(-1), {}
    for name in ("fp16", "mx4"):
        codec = codecs[name]
        ctx = codec.create_context()
        encoded = codec.encode(flat, ctx)
        calls[f"TorchRec {name} encode"] = lambda c=codec, x=ctx: c.encode(flat, x)
        calls[f"TorchRec {name} decode"] = lambda c=codec, e=encoded, x=ctx: c.decode(e, x)
    return calls


def all_calls(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    """Every measured call on one set of example-like blocks.

    Args:
        args: The command line.

    Returns:
        Call name to the call.
    """
    torch.manual_seed(0)
    names = [f"t{i}" for i in range(args.blocks)]
    specs = tuple(BlockSpec(n, args.dim * i, 1, args.dim) for i, n in enumerate(names))
    config = LossyCommsConfig(default_bound=ErrorBound("relative", 0.03))
    comms = LossyComms(config=config, bounds=StaticBounds(names, config))
    info = LossyAll2AllPooledInfo(
        batch_size_per_rank=[args.rows, args.rows],
        layout=[specs, specs],
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(names),
    )
    # Embedding-like rows: a few hundred distinct vectors, repeated (ids repeat in a batch).
    distinct = torch.randn(300, args.dim * args.blocks) * 0.05
    emb = distinct[torch.randint(0, 300, (2 * args.rows,))].contiguous()
    blocks = [[cut_block(emb, args.rows * p, args.rows, 0, s) for s in specs] for p in range(2)]
    bounds = [[0.001] * args.blocks]

    def encode() -> list[torch.Tensor]:
        return start_encode("fwd", blocks, [specs, specs], info, emb.device, my_rank=0).read()

    payload, grouped = encode()[1], compress_groups([blocks[1]], bounds)

    def decode() -> object:
        sizes = [0, payload.numel()]
        rows = [args.rows, args.rows]
        return decode_payloads("fwd", payload, sizes, [specs, specs], rows, info, 0, blocks[0])

    def ranged(make: Callable[[str], AbstractContextManager]) -> Callable[[], None]:
        def call() -> None:
            with make("## cold_call_bench ##"):
                pass

        return call

    return {
        "ours: pooled encode, one peer": encode,
        "ours: pooled decode, one peer": decode,
        "ours: codec encode (compress_groups)": lambda: compress_groups([blocks[1]], bounds),
        "ours: codec decode (decompress_groups)": lambda: decompress_groups(
            grouped.buffer, grouped.sizes, label=False
        ),
        **qcomm_calls(emb[args.rows :]),  # the peer's rows, as TorchRec's all-to-all sends them
        "plain copy of the blocks (torch.cat)": lambda: torch.cat(blocks[1]),
        "record_function range, no profiler": ranged(record_function),
        "profile_range range, no profiler": ranged(profile_range),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=7, help="tables sent to the peer")
    ap.add_argument("--rows", type=int, default=512, help="rows per block (the batch)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--evict", type=int, default=2048, help="the matmul: [N, N] by [N, 64]")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    values = args.rows * args.blocks * args.dim
    if values % 32:
        ap.error(f"--rows x --blocks x --dim is {values} values: MX4 needs a multiple of 32")
    torch.set_num_threads(1)
    warm_up_host()
    big = torch.randn(args.evict, args.evict)
    rows = []
    for name, fn in all_calls(args).items():
        loop = mean_cpu_us(fn, args.reps, lambda: None)
        cold = mean_cpu_us(fn, args.reps, lambda: big @ big[:, :64])
        rows.append({"call": name, "loop_us": loop, "after_matmul_us": cold})
    print("| call | in a loop (us) | after the matmul (us) | ratio |\n|---|---:|---:|---:|")
    for r in rows:
        ratio = r["after_matmul_us"] / r["loop_us"] if r["loop_us"] > 0 else None
        print(
            f"| {r['call']} | {cell(r['loop_us'], '.1f')} | {cell(r['after_matmul_us'], '.1f')} "
            f"| {cell(ratio, '.1f')} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "calls": rows}, f, indent=2)


if __name__ == "__main__":
    main()
