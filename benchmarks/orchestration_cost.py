"""What the device orchestration alone costs on CPU, beside the whole compiled host path.

The codec keeps two orchestrations (``host_compress`` / ``host_decompress``: numba, one fused
pass per block; ``device_compress`` / ``device_decompress``: torch over batched kernel launches).
This measures the price of running the device one on CPU, as a single orchestration would: each
kernel launcher is replaced by a replay of its recorded result (zero kernel cost), so what is
timed is the orchestration's own torch work. Run::

    python benchmarks/orchestration_cost.py [--json out.json]

Prints one row per payload shape (median of ``--reps`` calls, one thread) and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # recording runs the launchers once on CPU
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import pytest
import torch
from kernel_calls import recorded_calls, snapshot

from torchrec_lossy.codec import compress, decompress
from torchrec_lossy.config import CodecConfig
from torchrec_lossy.kernels import codebook, huffman, quantize, vector_lz

LAUNCHERS = {
    quantize: ["quantize_tiles", "decode_outputs"],
    vector_lz: ["representatives_pair", "unpack_refs_blocks"],
    huffman: ["histogram_tiles", "encode_chunks", "decode_blocks", "check_escapes", "block_status"],
    codebook: ["code_lengths", "canonical_codes", "decode_tables"],
}
SHAPES = [(8, 64, 16), (26, 128, 64)]  # (blocks, rows, dim): a small step's payload, a larger one


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn`` in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def replaying(calls: list, name: str) -> Callable:
    """A stand-in launcher that returns ``name``'s recorded results in turn (and writes what the
    launcher wrote into its buffer arguments)."""
    mine = [c for c in calls if c.name == name]
    state = {"i": 0}

    def launcher(*args: object, **kwargs: object) -> object:
        call = mine[state["i"] % len(mine)]
        state["i"] += 1
        for arg, after in zip(args, call.args_after, strict=False):
            if isinstance(arg, torch.Tensor) and arg.shape == after.shape:
                arg.copy_(after)
        return snapshot(call.result)

    return launcher


def measure(n_blocks: int, rows: int, dim: int, reps: int) -> dict[str, float]:
    """Orchestration-only and host-path times for one payload shape."""
    gen = torch.Generator().manual_seed(0)
    blocks = [0.1 * torch.randn(rows, dim, generator=gen) for _ in range(n_blocks)]
    bounds = [1e-3] * n_blocks
    device_cfg, host_cfg = CodecConfig(backend="triton"), CodecConfig(backend="cpu")
    patch = pytest.MonkeyPatch()
    with contextlib.ExitStack() as stack:
        groups = [stack.enter_context(recorded_calls(patch, m, n)) for m, n in LAUNCHERS.items()]
        payload = compress(blocks, bounds, device_cfg)
        decompress(payload, backend="triton")
    patch.undo()
    flat = [c for group in groups for c in group]
    for module, names in LAUNCHERS.items():
        for name in names:
            patch.setattr(module, name, replaying(flat, name))
    out = {
        "device_orchestration_compress_ms": median_ms(
            lambda: compress(blocks, bounds, device_cfg), reps
        ),
        "device_orchestration_decompress_ms": median_ms(
            lambda: decompress(payload, backend="triton"), reps
        ),
    }
    patch.undo()
    assert torch.equal(compress(blocks, bounds, host_cfg), payload), "paths disagree"
    out["host_compress_ms"] = median_ms(lambda: compress(blocks, bounds, host_cfg), reps)
    out["host_decompress_ms"] = median_ms(lambda: decompress(payload, backend="cpu"), reps)
    return out


def main() -> None:
    """Measures every shape, prints a table and writes JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("| payload | MB | device orchestration only: compress / decompress ms "
          "| host path: compress / decompress ms |")  # fmt: skip
    print("|---|---:|---:|---:|")
    for n_blocks, n_rows, dim in SHAPES:
        r = measure(n_blocks, n_rows, dim, args.reps)
        r.update(blocks=n_blocks, rows=n_rows, dim=dim, mb=n_blocks * n_rows * dim * 4 / 1e6)
        rows.append(r)
        print(f"| {n_blocks} x {n_rows} x {dim} | {r['mb']:.2f} "
              f"| {r['device_orchestration_compress_ms']:.2f} / "
              f"{r['device_orchestration_decompress_ms']:.2f} "
              f"| {r['host_compress_ms']:.2f} / {r['host_decompress_ms']:.2f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
