"""Bytes per step of the input and output dists: TorchRec (none / qcomm) vs torchrec-lossy.

A single-process computation with the real encoders, byte counts summed over all ranks of one
step (the self-send included, as TorchRec's all-to-alls do):

- input dist: every rank's KJT is encoded by ``torchrec_lossy.distributed.input_dist._encode``; the
  bytes are the packed payload words plus the metadata exchange. TorchRec's (``none`` and every
  qcomm mode: qcomm codecs do not touch the KJT all-to-all) are its lengths and ids tensors plus
  its splits exchange (lengths, values, stride per destination).
- output dist (forward pooled embeddings): ``none`` fp32; ``fp16``/``mx4`` TorchRec's qcomm size
  (``calc_quantized_size`` of each (source, destination) chunk, as ``All2All_Pooled_Req``);
  ``lossy`` the codec payloads of
  ``torchrec_lossy.distributed.pooled_payload.encode_payloads`` at the default bound (relative
  0.03 per table and block), without and with the exact output dedupe (each destination gets
  the pooled row of each distinct id once per table).

Traffic: the 26 Criteo categorical features, one table each, placed table-wise round-robin
(feature ``f`` on rank ``f % world``), single-hot as in the DLRM Criteo pipelines, pooled rows
from the trained-model value model of :mod:`torchrec_lossy.traffic`:

- ``synthetic_kaggle``: Zipf ids from :func:`torchrec_lossy.traffic.sample_ids` with the Kaggle
  cardinalities, dim 32;
- ``criteo_1tb_sample``: the real ids of the 1TB sample
  (:func:`torchrec_lossy.traffic.criteo_sample_ids`, MLPerf table sizes), split over ranks,
  dim 64.

Run: ``.venv/bin/python benchmarks/input_dist_bench.py [--json out.json]``.

``--timing`` instead times the input codec on this machine (CPU ms per step and rank, no
process group): every rank's KJT is encoded (``_encode``, default config: wire dedupe, exact
output dedupe, checksums) and rank 0 decodes what it would receive (``_decode``), at the batch
sizes given by ``--timing-batches`` (default 512, the example's, and 2048), 2 ranks, single-hot
Zipf ids of the Kaggle cardinalities:
``.venv/bin/python benchmarks/input_dist_bench.py --timing``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torchrec import KeyedJaggedTensor
from torchrec.distributed.fbgemm_qcomm_codec import (
    CommType,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from torchrec.distributed.types import CommOp

from torchrec_lossy.config import InputDistConfig, LossyCommsConfig
from torchrec_lossy.distributed.comms import LossyComms, StaticBounds
from torchrec_lossy.distributed.input_dist import (
    _HEADER,
    _PER_FEATURE,
    _decode,
    _distinct_bags,
    _encode,
    _FeatureMeta,
)
from torchrec_lossy.distributed.pooled_payload import (
    BlockSpec,
    LossyAll2AllPooledInfo,
    encode_payloads,
)
from torchrec_lossy.traffic import (
    criteo_sample_ids,
    default_value_model,
    embedding_rows,
    frequency_ranks,
    sample_ids,
    table_cardinalities,
)

NUM_FEATURES = 26
QCOMM = {"fp16": CommType.FP16, "mx4": CommType.MX4}


def _owner(f: int, world: int) -> int:
    return f % world


def _kjts(ids: torch.Tensor, world: int) -> tuple[list[KeyedJaggedTensor], list[int]]:
    """Per rank, its single-hot KJT with features ordered by destination; and the splits."""
    order = [f for r in range(world) for f in range(NUM_FEATURES) if _owner(f, world) == r]
    splits = [sum(1 for f in range(NUM_FEATURES) if _owner(f, world) == r) for r in range(world)]
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


def _input_bytes(ids: torch.Tensor, world: int) -> dict[str, dict[str, float]]:
    kjts, splits = _kjts(ids, world)
    out: dict[str, dict[str, float]] = {}
    for variant, dedupe in (("packed", False), ("packed+dedupe", True)):
        config = LossyCommsConfig(input_dist=InputDistConfig(dedupe=dedupe))
        comms = LossyComms(config=config, bounds=StaticBounds([], config))
        for kjt in kjts:
            _encode(kjt, splits, comms)
        total = comms.stats.total("input")
        if "none" not in out:
            out["none"] = {"bytes": total.raw_bytes, "repeated_share": 0.0}
        out[variant] = {"bytes": total.wire_bytes, "repeated_share": total.repeated_share}
    return out


def _qcomm_bytes(mode: str, elements_per_chunk: list[int]) -> int:
    """TorchRec's qcomm forward bytes: each (source, destination) chunk quantized alone."""
    registry = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=QCOMM[mode], backward_precision=CommType.FP16)
    )
    assert registry is not None
    codec = registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward
    elem = torch.empty((), dtype=codec.quantized_dtype).element_size()
    return sum(
        codec.calc_quantized_size(n, codec.create_context()) * elem for n in elements_per_chunk
    )


def _output_bytes(
    ids: torch.Tensor, ranks: torch.Tensor, world: int, preset: str, dim: int
) -> dict[str, dict[str, float]]:
    """Forward pooled-embedding bytes per step for every mode.

    Args:
        ids: ``[rows, 26]`` ids as they travel (wire dedupe and the output dedupe count these).
        ranks: The same ids as popularity ranks (the value model's row identity).
        world: Ranks.
        preset: Table sizes of the value model.
        dim: Embedding dimension.
    """
    cards = table_cardinalities(preset)
    model = default_value_model(preset)
    config = LossyCommsConfig()
    names = [f"t{f}" for f in range(NUM_FEATURES)]
    layout = [
        tuple(BlockSpec(names[f], 0, 1, dim) for f in range(NUM_FEATURES) if _owner(f, world) == r)
        for r in range(world)
    ]
    batch = ids.shape[0] // world
    chunks = [len(layout[o]) * dim * batch for o in range(world) for _ in range(world)]
    out: dict[str, dict[str, float]] = {
        "none": {"bytes": 4 * sum(chunks), "rows": NUM_FEATURES * ids.shape[0]},
        **{m: {"bytes": _qcomm_bytes(m, chunks)} for m in QCOMM},
    }
    for variant, dedupe in (("lossy", False), ("lossy+out_dedupe", True)):
        comms = LossyComms(config=config, bounds=StaticBounds(names, config))
        info = LossyAll2AllPooledInfo(
            batch_size_per_rank=[batch] * world,
            layout=layout,
            comms=comms,
            compress=comms.compress_flags(names),
        )
        sent_rows = 0
        for o in range(world):
            blocks = []
            for d in range(world):
                rows_d = slice(d * batch, (d + 1) * batch)
                per_table = []
                for spec in layout[o]:
                    f = names.index(spec.table)
                    r = ranks[rows_d, f]
                    if dedupe:  # the first bag of each distinct id, in ascending id order
                        col = ids[rows_d, f]
                        first = _distinct_bags([torch.ones_like(col)], [col])[2][0]
                        if first.numel() < batch:  # as the input dist decides it
                            r = r[first]
                    sent_rows += r.numel()
                    per_table.append(embedding_rows(f, r, dim, cards[f], 0, model))
                blocks.append(per_table)
            payloads = encode_payloads("fwd", blocks, [layout[o]] * world, info, ids.device)
            assert sum(p.numel() for p in payloads) == comms.stats.total("fwd").wire_bytes
            out.setdefault(variant, {"bytes": 0, "rows": 0})
            out[variant]["bytes"] += comms.stats.total("fwd").wire_bytes
            comms.stats.reset()
        out[variant]["rows"] = sent_rows
    return out


def _timing(batch: int, world: int, reps: int) -> dict[str, float]:
    """Median CPU ms per step of one rank's encode and of rank 0's decode (default config)."""
    import time

    g = torch.Generator().manual_seed(0)
    cards = table_cardinalities("criteo_kaggle")
    ids = torch.stack([sample_ids(c, batch * world, generator=g) for c in cards], dim=1)
    kjts, splits = _kjts(ids, world)
    comms = LossyComms(config=LossyCommsConfig(), bounds=StaticBounds([], LossyCommsConfig()))
    keys = kjts[0].keys()[: splits[0]]
    n = _HEADER + _PER_FEATURE * len(keys)
    enc_t, dec_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        encs = [_encode(k, splits, comms, "exact") for k in kjts]
        enc_t.append((time.perf_counter() - t0) / world)
        # What rank 0 receives: each source's first payload and metadata row.
        recv = torch.cat([e.send[: e.send_words[0]] for e in encs])
        rows = [e.meta[:n].tolist() for e in encs]
        metas = [
            [
                _FeatureMeta.from_words(
                    r[_HEADER + i * _PER_FEATURE : _HEADER + (i + 1) * _PER_FEATURE]
                )
                for i in range(len(keys))
            ]
            for r in rows
        ]
        t0 = time.perf_counter()
        _decode(
            recv, [r[0] for r in rows], metas, [r[1] for r in rows], [r[2] for r in rows], keys, 0
        )
        dec_t.append(time.perf_counter() - t0)
        comms.stats.reset()
    enc_t.sort()
    dec_t.sort()
    return {"encode_ms": 1e3 * enc_t[reps // 2], "decode_ms": 1e3 * dec_t[reps // 2]}


def main(argv: list[str] | None = None) -> int:
    """Prints the table and the JSON; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2048, help="synthetic: samples per rank")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 8])
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--timing", action="store_true", help="time the input codec instead")
    p.add_argument("--timing-batches", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--reps", type=int, default=200, help="timing: steps (median reported)")
    args = p.parse_args(argv)
    if args.timing:
        torch.set_num_threads(1)  # as each of the example's two ranks on this 2-core box
        timings = []
        for batch in args.timing_batches:
            t = {"batch_per_rank": batch, "world": 2, **_timing(batch, 2, args.reps)}
            timings.append(t)
            print(
                f"batch {batch:>5}/rank, 2 ranks: encode {t['encode_ms']:.2f} ms, "
                f"decode {t['decode_ms']:.2f} ms per step and rank"
            )
        if args.json:
            with open(args.json, "w") as fh:
                fh.write(json.dumps(timings, indent=1) + "\n")
        return 0

    g = torch.Generator().manual_seed(0)
    results = []
    for world in args.worlds:
        n = args.batch * world
        cards = table_cardinalities("criteo_kaggle")
        synth = torch.stack([sample_ids(c, n, generator=g) for c in cards], dim=1)
        # Zipf ids are popularity ranks already.
        datasets = [("synthetic_kaggle", synth, synth, "criteo_kaggle", 32)]
        try:
            real = criteo_sample_ids()
            ranks = torch.stack([frequency_ranks(real[:, f]) for f in range(NUM_FEATURES)], 1)
            datasets.append(("criteo_1tb_sample", real, ranks, "criteo_1tb", 64))
        except FileNotFoundError as e:
            print(f"skipping the real sample: {e}", file=sys.stderr)
        for name, ids, ranks, preset, dim in datasets:
            keep = ids.shape[0] // world * world
            ids, ranks = ids[:keep], ranks[:keep]
            inp = _input_bytes(ids, world)
            outp = _output_bytes(ids, ranks, world, preset, dim)
            # Modes as a user runs them: TorchRec's input dist with none / qcomm output codecs;
            # ours: the packed, deduplicated input dist with the lossy output dist.
            modes = {
                "none": ("none", "none"),
                "fp16": ("none", "fp16"),
                "mx4": ("none", "mx4"),
                "lossy (no out dedupe)": ("packed+dedupe", "lossy"),
                "lossy": ("packed+dedupe", "lossy+out_dedupe"),
            }
            for mode, (i, o) in modes.items():
                results.append(
                    {
                        "dataset": name,
                        "world": world,
                        "batch_per_rank": keep // world,
                        "dim": dim,
                        "mode": mode,
                        "input_bytes": inp[i]["bytes"],
                        "input_plain_packed_bytes": inp["packed"]["bytes"],
                        "output_bytes": outp[o]["bytes"],
                        "output_rows": outp[o].get("rows", outp["none"]["rows"]),
                        "repeated_share": inp["packed+dedupe"]["repeated_share"],
                    }
                )
    print(
        f"{'dataset':<18} {'world':>5} {'B/rank':>6} {'mode':<22} {'input B':>10} "
        f"{'output B':>11} {'total B':>11} {'in x':>6} {'out x':>6} {'rows sent':>9}"
    )
    base: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        key = (r["dataset"], r["world"])
        if r["mode"] == "none":
            base[key] = r
        b = base[key]
        print(
            f"{r['dataset']:<18} {r['world']:>5} {r['batch_per_rank']:>6} {r['mode']:<22} "
            f"{r['input_bytes']:>10,.0f} {r['output_bytes']:>11,.0f} "
            f"{r['input_bytes'] + r['output_bytes']:>11,.0f} "
            f"{b['input_bytes'] / r['input_bytes']:>6.2f} "
            f"{b['output_bytes'] / r['output_bytes']:>6.2f} "
            f"{r['output_rows'] / b['output_rows']:>9.1%}"
        )
    text = json.dumps(results, indent=1)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
