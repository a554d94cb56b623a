"""Bytes per step of the KJT input dist: TorchRec's ``KJTAllToAll`` vs the packed format.

A single-process computation: every rank's KJT is encoded with the real encoder
(``torchrec_lossy.dist.input_dist._encode``), and the bytes it hands to the collectives are
summed over ranks: the packed payload words plus the metadata exchange. TorchRec's bytes are its
lengths and ids tensors plus its splits exchange (lengths, values, stride per destination).

Traffic: the 26 Criteo categorical features, one table each, placed table-wise round-robin
(feature ``f`` on rank ``f % world``), single-hot as in the DLRM Criteo pipelines:

- ``synthetic``: Zipf ids from :func:`torchrec_lossy.traffic.sample_ids` with the Kaggle
  cardinalities;
- ``criteo_1tb``: the real ids of the 1TB sample (:func:`torchrec_lossy.traffic.criteo_sample_ids`,
  MLPerf table sizes), split over ranks.

Run: ``.venv/bin/python benchmarks/input_dist_bench.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torchrec import KeyedJaggedTensor

from torchrec_lossy.config import InputDistConfig, LossyCommsConfig
from torchrec_lossy.dist.comms import LossyComms, StaticBounds
from torchrec_lossy.dist.input_dist import _encode
from torchrec_lossy.traffic import criteo_sample_ids, sample_ids, table_cardinalities

NUM_FEATURES = 26


def _kjts(ids: torch.Tensor, world: int) -> tuple[list[KeyedJaggedTensor], list[int]]:
    """Per rank, its single-hot KJT with features ordered by destination; and the splits."""
    order = [f for r in range(world) for f in range(NUM_FEATURES) if f % world == r]
    splits = [sum(1 for f in range(NUM_FEATURES) if f % world == r) for r in range(world)]
    out = []
    for local in ids.chunk(world, dim=0):
        b = local.shape[0]
        out.append(
            KeyedJaggedTensor(
                keys=[f"C{f + 1}" for f in order],
                values=local[:, order].T.reshape(-1).contiguous(),
                lengths=torch.ones(NUM_FEATURES * b, dtype=torch.int64),
            )
        )
    return out, splits


def _measure(ids: torch.Tensor, world: int) -> dict[str, dict[str, float]]:
    kjts, splits = _kjts(ids, world)
    out: dict[str, dict[str, float]] = {}
    for variant, dedupe in (("packed", False), ("packed+dedupe", True)):
        config = LossyCommsConfig(input_dist=InputDistConfig(dedupe=dedupe))
        comms = LossyComms(config=config, bounds=StaticBounds([], config))
        for kjt in kjts:
            _encode(kjt, splits, comms)
        total = comms.stats.total("input")
        if "none" not in out:
            out["none"] = {"bytes": total.raw_bytes, "ratio": 1.0, "repeated_share": 0.0}
        out[variant] = {
            "bytes": total.wire_bytes,
            "ratio": total.raw_bytes / total.wire_bytes,
            "repeated_share": total.repeated_share,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """Prints the table and the JSON; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2048, help="synthetic: samples per rank")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 8])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    g = torch.Generator().manual_seed(0)
    results = []
    for world in args.worlds:
        n = args.batch * world
        cards = table_cardinalities("criteo_kaggle")
        synth = torch.stack([sample_ids(c, n, generator=g) for c in cards], dim=1)
        datasets = [("synthetic_kaggle", synth)]
        try:
            datasets.append(("criteo_1tb_sample", criteo_sample_ids()))
        except FileNotFoundError as e:
            print(f"skipping the real sample: {e}", file=sys.stderr)
        for name, ids in datasets:
            ids = ids[: ids.shape[0] // world * world]
            for variant, r in _measure(ids, world).items():
                results.append(
                    {
                        "dataset": name,
                        "world": world,
                        "batch_per_rank": ids.shape[0] // world,
                        "variant": variant,
                        **r,
                    }
                )
    print(
        f"{'dataset':<20} {'world':>5} {'B/rank':>7} {'variant':<14} {'bytes/step':>11} "
        f"{'B/sample':>9} {'ratio':>6} {'repeated':>8}"
    )
    for r in results:
        per_sample = r["bytes"] / (r["batch_per_rank"] * r["world"])
        print(
            f"{r['dataset']:<20} {r['world']:>5} {r['batch_per_rank']:>7} {r['variant']:<14} "
            f"{r['bytes']:>11.0f} {per_sample:>9.1f} {r['ratio']:>6.2f} "
            f"{r['repeated_share']:>8.1%}"
        )
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
