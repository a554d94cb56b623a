"""The forward's blocks through the seam's encoder and decoder in each wire format (issue 34).

One rank's forward to one destination (``--tables`` Kaggle-like tables, ``--rows`` rows each,
dim ``--dim``; ``torchrec_lossy.traffic``), through ``pooled_payload.start_encode`` and
``pooled_decode.decode_payloads`` (the seam's own code, no collective) in five modes, interleaved
call by call so the machine's load hits them alike:

- ``raw``: every block fp32 (``format: raw``);
- ``fp16`` / ``bf16``: every block checked against its bound and cast
  (``distributed/cast_blocks.py``; default bound, relative 0.01);
- ``entropy`` / ``packed``: the codec at the default bound.

Prints per mode the payload bytes, the ratio, the median encode and decode ms, the share of
blocks cast, the check alone (``cast_blocks.admissible``) and the bare cast, and the wire ms of
those bytes at 1 and 10 Gbit/s (bytes / rate: no collective is run); ``--json`` writes them.

    .venv/bin/python benchmarks/cast_bench.py
    .venv/bin/python benchmarks/cast_bench.py --tables 26 --rows 2048 --dim 128 --reps 15
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

MODES = ("raw", "fp16", "bf16", "entropy", "packed")
RATES_GBIT = (1.0, 10.0)


def _info(mode: str, names: list[str], specs: tuple) -> Any:
    """The call's info with every table in ``mode`` (the default bound), two ranks."""
    from torchrec_lossy.config import LossyCommsConfig
    from torchrec_lossy.distributed import LossyComms, StaticBounds
    from torchrec_lossy.distributed.call_ledger import CallLedger
    from torchrec_lossy.distributed.cast_blocks import cast_tables
    from torchrec_lossy.distributed.pooled_blocks import LossyAll2AllPooledInfo

    config = LossyCommsConfig(format=mode, error_sample_every=0)  # type: ignore[arg-type]
    comms = LossyComms(config=config, bounds=StaticBounds(names, config))
    return LossyAll2AllPooledInfo(
        batch_size_per_rank=[0, 0],
        layout=[specs, specs],
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(names),
        casts=cast_tables(config, names),
    )


def run(tables: int, rows: int, dim: int, reps: int, seed: int) -> dict[str, Any]:
    """Times every mode, interleaved; returns the figures."""
    from torchrec_lossy.config import ErrorBound
    from torchrec_lossy.distributed import BlockSpec
    from torchrec_lossy.distributed.cast_blocks import admissible
    from torchrec_lossy.distributed.pooled_decode import decode_payloads
    from torchrec_lossy.distributed.pooled_payload import start_encode, warm_up_host
    from torchrec_lossy.traffic import TrafficSpec, make_blocks

    warm_up_host()
    blocks = make_blocks(TrafficSpec("criteo_kaggle", dim=dim, batch_rows=rows, seed=seed))
    blocks = blocks[:tables]
    names = [f"t{i}" for i in range(len(blocks))]
    specs = tuple(BlockSpec(n, dim * k, 1, dim) for k, n in enumerate(names))
    infos = {m: _info(m, names, specs) for m in MODES}
    sent = [[], blocks]  # rank 0 sends rank 1 its blocks (its own: none)
    times: dict[str, dict[str, list[float]]] = {m: {"enc": [], "dec": []} for m in MODES}
    wire: dict[str, int] = {}
    worst: dict[str, float] = {}
    for r in range(reps + 1):  # the first call of each mode warms it up
        for m in MODES:
            info = infos[m]
            t0 = time.perf_counter()
            payloads = start_encode("fwd", sent, [(), specs], info, torch.device("cpu")).read()
            t1 = time.perf_counter()
            got = decode_payloads(
                "fwd", payloads[1], [0, payloads[1].numel()], [(), specs], [0, rows], info, 0
            )
            t2 = time.perf_counter()
            if r:
                times[m]["enc"].append(t1 - t0)
                times[m]["dec"].append(t2 - t1)
            wire[m] = payloads[1].numel()
            worst[m] = max(
                float(((g - b).abs().max() / (b.max() - b.min())).item())
                for g, b in zip(got[1], blocks, strict=True)
            )
    raw_bytes = sum(b.numel() * 4 for b in blocks)
    check: dict[str, float] = {}
    bare: dict[str, float] = {}
    bound = [ErrorBound()] * len(blocks)
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        cs, bs = [], []
        flags = admissible(blocks, [dt] * len(blocks), bound)
        for _ in range(reps):
            t0 = time.perf_counter()
            admissible(blocks, [dt] * len(blocks), bound)
            t1 = time.perf_counter()
            for b in blocks:
                b.to(dt)
            bs.append(time.perf_counter() - t1)
            cs.append(t1 - t0)
        check[name], bare[name] = statistics.median(cs), statistics.median(bs)
        check[name + "_cast_share"] = float(flags.float().mean())
    out: dict[str, Any] = {
        "tables": len(blocks), "rows": rows, "dim": dim, "reps": reps, "raw_bytes": raw_bytes,
        "load": os.getloadavg()[0], "threads": torch.get_num_threads(), "modes": {},
    }  # fmt: skip
    for m in MODES:
        enc, dec = statistics.median(times[m]["enc"]), statistics.median(times[m]["dec"])
        row = {
            "wire_bytes": wire[m],
            "ratio": raw_bytes / wire[m],
            "encode_ms": 1e3 * enc,
            "decode_ms": 1e3 * dec,
            "max_error_over_range": worst[m],
        }
        for g in RATES_GBIT:
            w = 1e3 * wire[m] * 8 / (g * 1e9)
            row[f"wire_ms_{g:g}gbit"] = w
            row[f"total_ms_{g:g}gbit"] = w + 1e3 * (enc + dec)
        out["modes"][m] = row
    out["check_ms"] = {k: 1e3 * v if not k.endswith("share") else v for k, v in check.items()}
    out["bare_cast_ms"] = {k: 1e3 * v for k, v in bare.items()}
    return out


def table(res: dict[str, Any]) -> str:
    """The markdown table of :func:`run`'s figures."""
    lines = [
        f"{res['tables']} tables x {res['rows']} rows x dim {res['dim']} "
        f"({res['raw_bytes'] / 2**20:.2f} MiB fp32), {res['reps']} interleaved reps, "
        f"load {res['load']:.1f}, {res['threads']} threads",
        "",
        "| mode | wire bytes | ratio | encode ms | decode ms | max err / range "
        + "".join(f"| wire + codec ms at {g:g} Gbit/s " for g in RATES_GBIT)
        + "|",
        "|---|---:|---:|---:|---:|---:" + "|---:" * len(RATES_GBIT) + "|",
    ]
    for m, r in res["modes"].items():
        lines.append(
            f"| {m} | {r['wire_bytes']:,} | {r['ratio']:.2f}x | {r['encode_ms']:.2f} "
            f"| {r['decode_ms']:.2f} | {r['max_error_over_range']:.2g} "
            + "".join(f"| {r[f'total_ms_{g:g}gbit']:.2f} " for g in RATES_GBIT)
            + "|"
        )
    c, b = res["check_ms"], res["bare_cast_ms"]
    lines += [
        "",
        f"check alone: fp16 {c['fp16']:.2f} ms, bf16 {c['bf16']:.2f} ms (blocks cast: fp16 "
        f"{100 * c['fp16_cast_share']:.0f}%, bf16 {100 * c['bf16_cast_share']:.0f}%); bare "
        f"cast: fp16 {b['fp16']:.2f} ms, bf16 {b['bf16']:.2f} ms",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the example's 1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = run(args.tables, args.rows, args.dim, args.reps, args.seed)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
