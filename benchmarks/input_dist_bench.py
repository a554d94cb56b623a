"""Bytes per step of the input, output and gradient all-to-alls: TorchRec vs torchrec-lossy.

A single-process computation with the real encoders, byte counts summed over all ranks of one
step (the self-send included, as TorchRec's all-to-alls do):

- input dist: every rank's KJT is encoded by
  ``torchrec_lossy.distributed.input_dist.encode_with_telemetry``; the bytes are the packed
  payload words plus the metadata exchange. TorchRec's (``none`` and every qcomm mode: qcomm
  codecs do not touch the KJT all-to-all) are its lengths and ids tensors plus its splits
  exchange (lengths, values, stride per destination).
- output dist (forward pooled embeddings): ``none`` fp32; ``fp16``/``mx4`` TorchRec's qcomm size
  (``calc_quantized_size`` of each (source, destination) chunk, as ``All2All_Pooled_Req``);
  ``lossy`` the codec payloads of
  ``torchrec_lossy.distributed.pooled_payload.start_encode`` at the default bound (relative
  0.03 per table and block), without and with the exact output dedupe (each destination gets
  the pooled row of each distinct id once per table).

- backward (gradient of the pooled embeddings): ``none`` fp32; ``fp16`` 2 bytes; ``mx4``
  TorchRec's MX4 backward qcomm size; ``lossy`` the default backward (gradient dedupe, then the
  codec at ``LossyCommsConfig().backward_bound``, round to nearest) on gradients of
  :func:`_pooled_grads`.

Traffic: the 26 Criteo categorical features, one table each, placed table-wise round-robin
(feature ``f`` on rank ``f % world``), single-hot as in the DLRM Criteo pipelines, pooled rows
from the trained-model value model of :mod:`torchrec_lossy.traffic`:

- ``synthetic_kaggle``: Zipf ids from :func:`torchrec_lossy.traffic.sample_ids` with the Kaggle
  cardinalities, dim 32;
- ``criteo_1tb_sample``: the real ids of the 1TB sample
  (:func:`torchrec_lossy.traffic.criteo_sample_ids`, MLPerf table sizes), split over ranks,
  dim 64.

Run: ``.venv/bin/python benchmarks/input_dist_bench.py [--json out.json]``.

``--module ec`` measures an ``EmbeddingCollection`` instead (:func:`_ec_results`): sequence
features of :data:`EC_TABLES` (Kaggle cardinalities, Zipf ids, ``--seq-len`` ids per sample,
one table each, table-wise round-robin), bytes of one training step (input KJT + forward
sequence all-to-all + gradient all-to-all) for TorchRec's EC sharder (without and with
``use_index_dedup``, fp32 and with its FP16 / MX4 qcomm on the sequence all-to-all) and ours
(default config, and without the row dedupe).

``--breakdown`` instead parses the lossy backward's payloads of the table-wise EBC into their
parts (:data:`PARTS`: headers, descriptors, codebooks, references, escapes, chunk tables, the
code stream; the size exchange's words apart) at each world, with the bytes per value sent and
the order-0 entropy of the blocks' symbols on the per-value grid (docs/benchmarks.md, "Whole
step": why 8 ranks looked worse, what a lossless change could save).

``--timing`` instead times the input codec on this machine (CPU ms per step and rank, no
process group): every rank's KJT is encoded (``encode_with_telemetry``, default config: wire
dedupe, exact output dedupe, checksums) and rank 0 decodes what it would receive
(``kjt_codec.decode_kjt``), at the batch sizes given by ``--timing-batches`` (default 512, the
example's, and 2048), 2 ranks, single-hot Zipf ids of the Kaggle cardinalities:
``.venv/bin/python benchmarks/input_dist_bench.py --timing``.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from torchrec import KeyedJaggedTensor
from torchrec.distributed.fbgemm_qcomm_codec import (
    CommType,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from torchrec.distributed.types import CommOp

from torchrec_lossy.codec import format as fmt
from torchrec_lossy.codec.container import skeleton_words
from torchrec_lossy.config import ErrorBound, InputDistConfig, LossyCommsConfig
from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.comms import LossyComms, StaticBounds
from torchrec_lossy.distributed.dedupe import distinct_bags
from torchrec_lossy.distributed.input_dist import encode_with_telemetry
from torchrec_lossy.distributed.kjt_codec import decode_kjt, meta_words, parse_meta
from torchrec_lossy.distributed.pooled_blocks import BlockSpec, LossyAll2AllPooledInfo
from torchrec_lossy.distributed.pooled_payload import start_encode
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
# EmbeddingCollection mode: Kaggle table indices (C4, C7, C10, C15, C24, C26) of its features.
EC_TABLES = (3, 6, 9, 14, 23, 25)


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
            encode_with_telemetry(kjt, splits, comms)
        total = comms.stats.total("input")
        if "none" not in out:
            out["none"] = {"bytes": total.raw_bytes, "repeated_share": 0.0}
        out[variant] = {"bytes": total.wire_bytes, "repeated_share": total.repeated_share}
    return out


def _qcomm_bytes(
    mode: str,
    elements_per_chunk: list[int],
    backward: bool = False,
    op: CommOp = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
) -> int:
    """TorchRec's qcomm bytes (forward, or the backward with ``mode`` as its precision): each
    (source, destination) chunk of the all-to-all ``op`` quantized alone."""
    registry = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=QCOMM[mode], backward_precision=QCOMM[mode])
    )
    assert registry is not None
    codecs = registry[op.name]
    codec = codecs.backward if backward else codecs.forward
    elem = torch.empty((), dtype=codec.quantized_dtype).element_size()
    return sum(
        codec.calc_quantized_size(n, codec.create_context()) * elem for n in elements_per_chunk
    )


def _pooled_setup(world: int, dim: int) -> tuple[list[str], list[tuple[BlockSpec, ...]]]:
    """Table names and each rank's table shards (one feature per table, dealt round-robin)."""
    names = [f"t{f}" for f in range(NUM_FEATURES)]
    layout = [
        tuple(BlockSpec(names[f], 0, 1, dim) for f in range(NUM_FEATURES) if _owner(f, world) == r)
        for r in range(world)
    ]
    return names, layout


def _default_info(
    names: list[str],
    layout: list[tuple[BlockSpec, ...]],
    batch: int,
    config: LossyCommsConfig | None = None,
) -> LossyAll2AllPooledInfo:
    """The pooled all-to-all's state with ``config`` (default: the default config) and fresh
    telemetry."""
    config = config or LossyCommsConfig()
    comms = LossyComms(config=config, bounds=StaticBounds(names, config))
    return LossyAll2AllPooledInfo(
        batch_size_per_rank=[batch] * len(layout),
        layout=layout,
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(names),
    )


def _output_bytes(
    ids: torch.Tensor,
    ranks: torch.Tensor,
    world: int,
    preset: str,
    dim: int,
    config: LossyCommsConfig | None = None,
) -> dict[str, dict[str, float]]:
    """Forward pooled-embedding bytes per step for every mode.

    Args:
        ids: ``[rows, 26]`` ids as they travel (wire dedupe and the output dedupe count these).
        ranks: The same ids as popularity ranks (the value model's row identity).
        world: Ranks.
        preset: Table sizes of the value model.
        dim: Embedding dimension.
        config: The lossy forward's config (default: ``LossyCommsConfig()``).
    """
    cards = table_cardinalities(preset)
    model = default_value_model(preset)
    names, layout = _pooled_setup(world, dim)
    batch = ids.shape[0] // world
    chunks = [len(layout[o]) * dim * batch for o in range(world) for _ in range(world)]
    out: dict[str, dict[str, float]] = {
        "none": {"bytes": 4 * sum(chunks), "rows": NUM_FEATURES * ids.shape[0]},
        **{m: {"bytes": _qcomm_bytes(m, chunks)} for m in QCOMM},
    }
    for variant, dedupe in (("lossy", False), ("lossy+out_dedupe", True)):
        info = _default_info(names, layout, batch, config)
        comms = info.comms
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
                        first = distinct_bags([torch.ones_like(col)], [col])[2][0]
                        if first.numel() < batch:  # as the input dist decides it
                            r = r[first]
                    sent_rows += r.numel()
                    per_table.append(embedding_rows(f, r, dim, cards[f], 0, model))
                blocks.append(per_table)
            payloads = start_encode("fwd", blocks, [layout[o]] * world, info, ids.device).read()
            assert sum(p.numel() for p in payloads) == comms.stats.total("fwd").wire_bytes
            out.setdefault(variant, {"bytes": 0, "rows": 0})
            out[variant]["bytes"] += comms.stats.total("fwd").wire_bytes
            comms.stats.reset()
        out[variant]["rows"] = sent_rows
    return out


def _pooled_grads(n: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """A model of DLRM's gradient w.r.t. the pooled embeddings, ``[n, 26, dim]``.

    BCE through the top MLP: sample ``b``'s gradient is ``(p_b - y_b) / n`` (calibrated
    predictions, ``logit ~ N(-1.5, 1)``, ``y ~ Bernoulli(p)``: heavy-tailed over samples) times
    a per-(sample, feature) Jacobian row (``N(0, s_f^2)``, feature scales ``s_f`` log-uniform
    over e^[-1, 1]).
    """
    logits = torch.randn(n, generator=generator) - 1.5
    p = torch.sigmoid(logits)
    y = (torch.rand(n, generator=generator) < p).float()
    scale = torch.exp(torch.rand(NUM_FEATURES, generator=generator) * 2 - 1)
    jac = torch.randn(n, NUM_FEATURES, dim, generator=generator) * scale[None, :, None]
    return ((p - y) / n)[:, None, None] * jac


def _backward_payloads(
    ids: torch.Tensor,
    world: int,
    dim: int,
    generator: torch.Generator,
    config: LossyCommsConfig | None = None,
) -> tuple[list[int], list[tuple[int, list[torch.Tensor], list[list[torch.Tensor]]]]]:
    """The lossy backward's payloads of one step (``config``, default ``LossyCommsConfig()``:
    the gradient dedupe sums each distinct bag's rows, then the codec at ``backward_bound``),
    every sender, each block checked against its bound.

    Returns:
        TorchRec's chunk elements (sender ``d`` sends owner ``o`` the gradient of ``o``'s
        columns for ``d``'s rows), and per sender its rank, its payloads (one per
        destination, its own empty) and its blocks per destination.
    """
    grads = _pooled_grads(ids.shape[0], dim, generator)
    names, layout = _pooled_setup(world, dim)
    batch = ids.shape[0] // world
    chunks = [len(layout[o]) * dim * batch for _ in range(world) for o in range(world)]
    sent = []
    for d in range(world):
        info = _default_info(names, layout, batch, config)
        rows_d = slice(d * batch, (d + 1) * batch)
        blocks = []
        for o in range(world):
            per_table = []
            for spec in layout[o]:
                f = names.index(spec.table)
                g = grads[rows_d, f]
                col = ids[rows_d, f]
                uniq, inv = torch.unique(col, return_inverse=True)
                if uniq.numel() < batch:  # the gradient dedupe: one summed row per distinct id
                    g = g.new_zeros((uniq.numel(), dim)).index_add_(0, inv, g)
                per_table.append(g)
            blocks.append(per_table)
        payloads = start_encode("bwd", blocks, layout, info, ids.device, d).read()
        err = info.comms.stats.total("bwd").max_error_over_bound
        assert err <= 1.0, err
        sent.append((d, payloads, blocks))
    return chunks, sent


def _backward_bytes(
    ids: torch.Tensor,
    world: int,
    dim: int,
    generator: torch.Generator,
    config: LossyCommsConfig | None = None,
) -> dict[str, dict[str, float]]:
    """Gradient all-to-all bytes per step: TorchRec's fp32 / bf16 / MX4 (dense, every row) and
    the lossy backward (:func:`_backward_payloads`), all ranks."""
    chunks, sent = _backward_payloads(ids, world, dim, generator, config)
    total = sum(p.numel() for _, payloads, _ in sent for p in payloads)
    return {
        "none": {"bytes": 4 * sum(chunks)},
        "bf16": {"bytes": 2 * sum(chunks)},
        "mx4": {"bytes": _qcomm_bytes("mx4", chunks, backward=True)},
        "lossy": {"bytes": total},
    }


# The parts of a payload ``--breakdown`` counts, in wire order (docs/format.md).
PARTS = (
    "payload header", "descriptors", "raw blocks", "segment headers", "codebooks",
    "references", "escape positions", "escaped values", "chunk tables", "code stream",
)  # fmt: skip


def _payload_parts(payload: torch.Tensor) -> tuple[dict[str, int], list[dict[str, float]]]:
    """Bytes of each part of a codec payload (:data:`PARTS`, adding up to its size), and per
    quantized block its rows, distinct vectors, step and center (the per-value grid's).

    Args:
        payload: One codec payload (uint8, on the host).

    Returns:
        (bytes per part, one dict per quantized block).
    """
    words = payload.numpy().view(np.uint32)
    head = np.frombuffer(payload.numpy()[: fmt.HEADER.itemsize].tobytes(), fmt.HEADER)[0]
    n = int(head["n_blocks"])
    at = fmt.HEADER_WORDS + n * fmt.DESCRIPTOR_WORDS
    raw_desc = payload.numpy()[4 * fmt.HEADER_WORDS : 4 * at].tobytes()
    descs = np.frombuffer(raw_desc, fmt.DESCRIPTOR)
    parts = dict.fromkeys(PARTS, 0)
    parts["payload header"] = 4 * fmt.HEADER_WORDS
    parts["descriptors"] = 4 * n * fmt.DESCRIPTOR_WORDS
    blocks = []
    for desc in descs:
        mode, seg = int(desc["mode"]), int(desc["seg_words"])
        if mode == fmt.MODE_RAW:
            parts["raw blocks"] += 4 * seg
            at += seg
            continue
        header = fmt.segment_header_fields(tuple(int(w) for w in words[at : at + 8]))
        itemsize = int(fmt.dtype_itemsize(int(desc["dtype"])))
        layout = fmt.segment_layout(
            (mode, int(desc["rows"]), int(desc["dim"]), itemsize, seg), header
        )
        ok, nu, _, ref_words, cb_words, esc_at, ct_at, bs_at = (int(v) for v in layout)
        assert ok and mode & 2, f"a well-formed quantized segment, got mode {mode}"
        n_esc = int(header[3])
        parts["segment headers"] += 4 * fmt.SEGMENT_HEADER_WORDS
        parts["codebooks"] += 4 * cb_words
        parts["references"] += 4 * ref_words
        parts["escape positions"] += 4 * n_esc
        parts["escaped values"] += 4 * (ct_at - esc_at - n_esc)
        parts["chunk tables"] += 4 * (bs_at - ct_at)
        parts["code stream"] += 4 * (seg - bs_at)
        blocks.append(
            {"rows": int(desc["rows"]), "dim": int(desc["dim"]), "n_unique": nu,
             "sym_count": int(header[7]), "escapes": n_esc, "stream_bytes": 4 * (seg - bs_at)}
        )  # fmt: skip
        at += seg
    assert sum(parts.values()) == payload.numel(), (parts, payload.numel())
    return parts, blocks


def _value_entropy_bits(block: torch.Tensor, bound: float) -> tuple[float, float, float]:
    """Order-0 entropies of a block's symbols on the per-value grid of ``bound`` (what an
    ideal per-block code would pay), in bits per value: the codec's symbol (sign and distance
    from the block's largest code), its sign, and the distance alone; every row counted.

    Args:
        block: A gradient block.
        bound: The per-value bound.

    Returns:
        (symbol, sign, distance) entropies.
    """
    m = next(m for m in range(24) if 2.0 ** -(m + 1) <= bound)
    shift = 23 - m
    bits = block.float().contiguous().view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    mag = bits & 0x7FFFFFFF
    q = (mag + ((1 << shift) >> 1)) >> shift
    d = q.max() - q
    sign = (bits >> 31) & 1
    sym = np.where(mag == 0, 0, np.where(sign == 0, d + 1, -d - 1))

    def h(x: np.ndarray) -> float:
        _, counts = np.unique(x, return_counts=True)
        p = counts / counts.sum()
        return float(-(p * np.log2(p)).sum())

    return h(sym), h(sign[mag != 0]), h(d[mag != 0])


def _backward_breakdown(
    ids: torch.Tensor, world: int, dim: int, g: torch.Generator, config: LossyCommsConfig
) -> dict[str, object]:
    """The lossy backward's bytes of one step by payload part, with what a lossless change
    could save (``--breakdown``)."""
    chunks, sent = _backward_payloads(ids, world, dim, g, config)
    bound = config.backward_bound
    parts = dict.fromkeys(PARTS, 0)
    blocks: list[dict[str, float]] = []
    size_words = 0
    entropy = np.zeros(3)
    values = 0
    for d, payloads, per_dest in sent:
        for o, payload in enumerate(payloads):
            if o == d or payload.numel() == 0:
                continue
            got, meta = _payload_parts(payload)
            for k, v in got.items():
                parts[k] += v
            blocks += meta
            size_words += 1 + skeleton_words(len(per_dest[o]))
            if bound.mode == "value":
                for b in per_dest[o]:
                    entropy += b.numel() * np.array(_value_entropy_bits(b, bound.value))
                    values += b.numel()
    total = sum(parts.values())
    sent_values = sum(b["n_unique"] * b["dim"] for b in blocks)
    rows = sum(b["rows"] for b in blocks)
    out: dict[str, object] = {
        "world": world,
        "fp32_bytes": 4 * sum(chunks),
        "fp32_self_bytes": 4 * sum(chunks[d * world + d] for d in range(world)),
        "payload_bytes": total,
        "parts": parts,
        "size_exchange_bytes": 8 * size_words,
        "blocks": len(blocks),
        "rows_sent": rows,
        "values_sent": sent_values,
        "dense_rows": sum(chunks) // dim,
        "stream_bits_per_value": 8 * parts["code stream"] / max(sent_values, 1),
        "bytes_per_sent_value": total / max(sent_values, 1),
        "mean_codebook_symbols": float(np.mean([b["sym_count"] for b in blocks]))
        if blocks
        else 0.0,
    }
    if values:
        sym_h, sign_h, dist_h = entropy / values
        out.update(
            entropy_symbol_bits=sym_h, entropy_sign_bits=sign_h, entropy_distance_bits=dist_h
        )
    return out


def _print_breakdown(rows: list[dict[str, object]]) -> None:
    """Prints ``--breakdown``'s table: bytes per part and per sent value, per world."""
    for r in rows:
        total = r["payload_bytes"]
        print(
            f"{r['dataset']} world {r['world']}: {total:,} B of payloads in {r['blocks']} blocks "
            f"({r['rows_sent']:,} rows of {r['dense_rows']:,} dense, {r['values_sent']:,} "
            f"values); fp32 {r['fp32_bytes']:,} B ({r['fp32_self_bytes']:,} of it self-sends, "
            f"which ours skips); vs fp32 {r['fp32_bytes'] / total:.1f}x, without the self-sends "
            f"{(r['fp32_bytes'] - r['fp32_self_bytes']) / total:.1f}x; size exchange "
            f"{r['size_exchange_bytes']:,} B (not in the table's bytes)"
        )
        for k, v in r["parts"].items():  # type: ignore[union-attr]
            print(f"  {k:<18} {v:>11,} B {v / total:>6.1%}")
        line = (
            f"  {r['bytes_per_sent_value']:.3f} B per sent value; code stream "
            f"{r['stream_bits_per_value']:.3f} bits per value"
        )
        if "entropy_symbol_bits" in r:
            line += (
                f" (order-0 entropy of the symbols {r['entropy_symbol_bits']:.3f}: sign "
                f"{r['entropy_sign_bits']:.3f} + distance {r['entropy_distance_bits']:.3f})"
            )
        print(line + f"; codebook symbols per block {r['mean_codebook_symbols']:.0f}")


def _rw_kjts(
    ids: torch.Tensor, world: int, cards: list[int]
) -> tuple[list[KeyedJaggedTensor], list[int]]:
    """Per rank, its KJT bucketized by row shard as TorchRec's RW input dist sends it (every
    table row-wise over ``world`` ranks); and the splits (26 features to each destination)."""
    from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all

    block_sizes = torch.tensor([(c + world - 1) // world for c in cards])
    kjts = []
    for local in ids.chunk(world, dim=0):
        b = local.shape[0]
        kjt = KeyedJaggedTensor(
            keys=[f"C{f + 1}" for f in range(NUM_FEATURES)],
            values=local.T.reshape(-1).contiguous(),
            lengths=torch.ones(NUM_FEATURES * b, dtype=torch.int64),
        )
        kjts.append(bucketize_kjt_before_all2all(kjt, world, block_sizes)[0])
    return kjts, [NUM_FEATURES] * world


def _rw_input_bytes(ids: torch.Tensor, world: int, cards: list[int]) -> dict[str, float]:
    """Bucketized KJT all-to-all bytes: TorchRec's (lengths, ids, splits) and ours (packed)."""
    kjts, splits = _rw_kjts(ids, world, cards)
    config = LossyCommsConfig()
    comms = LossyComms(config=config, bounds=StaticBounds([], config))
    for kjt in kjts:
        encode_with_telemetry(kjt, splits, comms)
    total = comms.stats.total("input")
    return {"none": total.raw_bytes, "packed": total.wire_bytes}


def _rw_output_bytes(
    ids: torch.Tensor, ranks: torch.Tensor, world: int, preset: str, dim: int
) -> dict[str, float]:
    """Forward bytes of row-wise tables: TorchRec's reduce-scatter (each rank sends its partial
    sums of the whole global batch, fp32 or its FP16 qcomm) and ours (each rank's partial sums
    coded per destination at the default bound; a bag's row lives on the rank owning its id,
    the other ranks' partial sums are zero)."""
    cards = table_cardinalities(preset)
    model = default_value_model(preset)
    names = [f"t{f}" for f in range(NUM_FEATURES)]
    specs = tuple(BlockSpec(n, f * dim, 1, dim) for f, n in enumerate(names))
    batch = ids.shape[0] // world
    raw = world * ids.shape[0] * NUM_FEATURES * dim
    info = _default_info(names, [specs] * world, batch)
    lossy = 0
    for o in range(world):
        blocks = []
        for d in range(world):
            rows_d = slice(d * batch, (d + 1) * batch)
            per_table = []
            for f in range(NUM_FEATURES):
                block = (cards[f] + world - 1) // world
                mine = ids[rows_d, f] // block == o
                rows = torch.zeros(batch, dim)
                rows[mine] = embedding_rows(f, ranks[rows_d, f][mine], dim, cards[f], 0, model)
                per_table.append(rows)
            blocks.append(per_table)
        payloads = start_encode("fwd", blocks, [specs] * world, info, ids.device).read()
        lossy += sum(p.numel() for p in payloads)
    return {"none": 4 * raw, "fp16": 2 * raw, "lossy": lossy}


def _rw_backward_bytes(
    ids: torch.Tensor, world: int, preset: str, dim: int, generator: torch.Generator
) -> dict[str, float]:
    """Gradient bytes of row-wise tables: TorchRec's all-gather (fp32 or FP16 qcomm: every rank
    receives every rank's gradient rows) and ours (each destination's gradient rows coded once
    per source rank with the default backward codec, zero where the source holds no id of the
    bag; no dedupe)."""
    grads = _pooled_grads(ids.shape[0], dim, generator)
    cards = table_cardinalities(preset)
    names = [f"t{f}" for f in range(NUM_FEATURES)]
    specs = tuple(BlockSpec(n, f * dim, 1, dim) for f, n in enumerate(names))
    batch = ids.shape[0] // world
    raw = world * ids.shape[0] * NUM_FEATURES * dim
    total = 0
    for d in range(world):
        info = _default_info(names, [specs] * world, batch)
        rows_d = slice(d * batch, (d + 1) * batch)
        # Source o gets zero rows (the source mask) for the bags whose id it does not hold.
        blocks = [
            [
                grads[rows_d, f]
                * (ids[rows_d, f] // ((cards[f] + world - 1) // world) == o)[:, None]
                for f in range(NUM_FEATURES)
            ]
            for o in range(world)
        ]
        # Every destination coded, its own too: the self-send counted as TorchRec counts it.
        payloads = start_encode("bwd", blocks, [specs] * world, info, ids.device).read()
        total += sum(p.numel() for p in payloads)
        assert info.comms.stats.total("bwd").max_error_over_bound <= 1.0
    return {"none": 4 * raw, "fp16": 2 * raw, "lossy": total}


def _row_wise_results(
    ids: torch.Tensor, ranks: torch.Tensor, world: int, preset: str, dim: int, g: torch.Generator
) -> list[dict[str, float | str | int]]:
    """One row per mode for every table row-wise: TorchRec fp32, TorchRec FP16 both ways (its
    best qcomm for the reduce-scatter path), ours (packed input, coded partial sums, coded
    gradients)."""
    cards = table_cardinalities(preset)
    inp = _rw_input_bytes(ids, world, cards)
    out = _rw_output_bytes(ids, ranks, world, preset, dim)
    bwd = _rw_backward_bytes(ids, world, preset, dim, g)
    rows = []
    for mode, i, o in (
        ("none", "none", "none"),
        ("fp16", "none", "fp16"),
        ("lossy", "packed", "lossy"),
    ):
        rows.append(
            {
                "mode": mode,
                "input_bytes": inp[i],
                "output_bytes": out[o],
                "backward_bytes": bwd[o],
            }
        )
    return rows


def _ec_kjts(
    ids: list[torch.Tensor], world: int
) -> tuple[list[KeyedJaggedTensor], list[int], list[list[int]]]:
    """Per rank, its KJT of the EC's sequence features (feature ``t`` owned by rank
    ``t % world``, keys ordered by owner), the splits, and each owner's features."""
    owned = [[t for t in range(len(ids)) if t % world == r] for r in range(world)]
    order = [t for ts in owned for t in ts]
    kjts = []
    for r in range(world):
        local = [ids[t].chunk(world)[r] for t in order]
        kjts.append(
            KeyedJaggedTensor(
                keys=[f"s{EC_TABLES[t]}" for t in order],
                values=torch.cat([x.reshape(-1) for x in local]),
                lengths=torch.cat(
                    [torch.full((x.shape[0],), x.shape[1], dtype=torch.int64) for x in local]
                ),
            )
        )
    return kjts, [len(ts) for ts in owned], owned


def _ec_seq_grads(n: int, seq_len: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """A model of the gradient of each position's embedding, ``[n, seq_len, dim]``: the sample's
    BCE factor (as :func:`_pooled_grads`) times a per-position Jacobian row ``N(0, s^2)``."""
    logits = torch.randn(n, generator=g) - 1.5
    p = torch.sigmoid(logits)
    y = (torch.rand(n, generator=g) < p).float()
    scale = torch.exp(torch.rand(1, generator=g) * 2 - 1)
    return ((p - y) / n)[:, None, None] * torch.randn(n, seq_len, dim, generator=g) * scale


def _ec_results(world: int, batch: int, seq_len: int, dim: int, g: torch.Generator) -> list[dict]:
    """Bytes of one EC training step (all ranks, self-sends included) for every mode.

    TorchRec's input is its KJT all-to-all (int64 lengths and ids, splits exchange); with
    ``use_index_dedup`` each rank sends each feature's distinct ids of its whole batch (its
    ``jagged_unique_indices``), gets one row per distinct id back and sends one gradient row per
    distinct id. Ours: the packed input dist, one row per distinct id per (destination, table)
    coded at the default bound, the gradient summed per distinct id and coded at the default
    backward bound (``lossy, no row dedupe``: every position's row and gradient coded).
    """
    cards = table_cardinalities("criteo_kaggle")
    model = default_value_model("criteo_kaggle")
    n = batch * world
    ids = [sample_ids(cards[f], n * seq_len, generator=g).view(n, seq_len) for f in EC_TABLES]
    kjts, splits, owned = _ec_kjts(ids, world)
    config = LossyCommsConfig()
    comms = LossyComms(config=config, bounds=StaticBounds([], config))
    for kjt in kjts:
        encode_with_telemetry(kjt, splits, comms)
    inp = comms.stats.total("input")
    names = [f"s{f}" for f in EC_TABLES]
    layout = [tuple(BlockSpec(names[t], 0, 1, dim) for t in ts) for ts in owned]
    # Per (destination rank, feature): its ids, distinct ids, inverse, rows and gradients.
    per = {}
    for t, f in enumerate(EC_TABLES):
        grads = _ec_seq_grads(n, seq_len, dim, g)
        for d in range(world):
            x = ids[t].chunk(world)[d].reshape(-1)
            uniq, inv = torch.unique(x, return_inverse=True)
            rows = embedding_rows(f, uniq, dim, cards[f], 0, model)
            per[d, t] = (x.numel(), uniq.numel(), inv, rows, grads.chunk(world)[d].reshape(-1, dim))
    n_ids = sum(v[0] for v in per.values())
    n_uniq = sum(v[1] for v in per.values())
    elem = kjts[0].values().element_size()
    chunks = [
        [sum(per[d, t][k] for t in owned[o]) * dim for o in range(world) for d in range(world)]
        for k in (0, 1)
    ]
    seq = CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL
    rows: list[dict] = [
        {
            "mode": "torchrec",
            "input_bytes": inp.raw_bytes,
            "output_bytes": 4 * dim * n_ids,
            "backward_bytes": 4 * dim * n_ids,
            "rows": n_ids,
        },
        {
            "mode": "torchrec index_dedup",
            "input_bytes": inp.raw_bytes - elem * (n_ids - n_uniq),
            "output_bytes": 4 * dim * n_uniq,
            "backward_bytes": 4 * dim * n_uniq,
            "rows": n_uniq,
        },
    ]
    for q in QCOMM:
        rows.append(
            {
                **rows[1],
                "mode": f"torchrec index_dedup {q}",
                "output_bytes": _qcomm_bytes(q, chunks[1], op=seq),
                "backward_bytes": _qcomm_bytes(q, chunks[1], backward=True, op=seq),
            }
        )
    for mode, dedupe in (("lossy, no row dedupe", False), ("lossy", True)):
        fwd = bwd = 0
        for o in range(world):  # the owner codes every destination's rows
            info = _default_info(names, [layout[o]] * world, batch)
            blocks = [
                [per[d, t][3] if dedupe else per[d, t][3][per[d, t][2]] for t in owned[o]]
                for d in range(world)
            ]
            fwd += sum(
                p.numel()
                for p in start_encode(
                    "fwd", blocks, [layout[o]] * world, info, torch.device("cpu")
                ).read()
            )
            assert info.comms.stats.total("fwd").max_error_over_bound <= 1.0
        for d in range(world):  # each rank codes its gradient for every owner
            info = _default_info(names, layout, batch)
            blocks = []
            for o in range(world):
                per_t = []
                for t in owned[o]:
                    _, u, inv, _, gr = per[d, t]
                    per_t.append(gr.new_zeros((u, dim)).index_add_(0, inv, gr) if dedupe else gr)
                blocks.append(per_t)
            bwd += sum(
                p.numel()
                for p in start_encode("bwd", blocks, layout, info, torch.device("cpu")).read()
            )
            assert info.comms.stats.total("bwd").max_error_over_bound <= 1.0
        rows.append(
            {
                "mode": mode,
                "input_bytes": inp.wire_bytes,
                "output_bytes": fwd,
                "backward_bytes": bwd,
                "rows": n_uniq if dedupe else n_ids,
            }
        )
    common = {
        "module": "ec",
        "world": world,
        "batch_per_rank": batch,
        "seq_len": seq_len,
        "dim": dim,
        "tables": [f"C{f + 1}:{cards[f]}" for f in EC_TABLES],
    }
    return [
        {**common, **r, "step_bytes": r["input_bytes"] + r["output_bytes"] + r["backward_bytes"]}
        for r in rows
    ]


def _print_ec(results: list[dict]) -> None:
    """The EC table: bytes per step and the reduction against TorchRec with index dedupe."""
    print(
        f"{'world':>5} {'mode':<27} {'input B':>11} {'fwd B':>12} {'bwd B':>12} {'step B':>12} "
        f"{'vs tr':>6} {'vs dedup':>8} {'rows sent':>9}"
    )
    for r in results:
        same = [x for x in results if x["world"] == r["world"]]
        tr, dd = (
            next(x for x in same if x["mode"] == m) for m in ("torchrec", "torchrec index_dedup")
        )
        print(
            f"{r['world']:>5} {r['mode']:<27} {r['input_bytes']:>11,.0f} "
            f"{r['output_bytes']:>12,.0f} {r['backward_bytes']:>12,.0f} "
            f"{r['step_bytes']:>12,.0f} {tr['step_bytes'] / r['step_bytes']:>6.1f} "
            f"{dd['step_bytes'] / r['step_bytes']:>8.1f} "
            f"{r['rows'] / tr['rows']:>9.1%}"
        )


def _timing(batch: int, world: int, reps: int) -> dict[str, float]:
    """Median CPU ms per step of one rank's encode and of rank 0's decode (default config)."""
    import time

    g = torch.Generator().manual_seed(0)
    cards = table_cardinalities("criteo_kaggle")
    ids = torch.stack([sample_ids(c, batch * world, generator=g) for c in cards], dim=1)
    kjts, splits = _kjts(ids, world)
    comms = LossyComms(config=LossyCommsConfig(), bounds=StaticBounds([], LossyCommsConfig()))
    keys = kjts[0].keys()[: splits[0]]
    n = meta_words(len(keys))
    enc_t, dec_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        encs = [encode_with_telemetry(k, splits, comms, "exact") for k in kjts]
        enc_t.append((time.perf_counter() - t0) / world)
        # What rank 0 receives: each source's first payload and metadata row.
        recv = torch.cat([e.send[: e.send_words[0]] for e in encs])
        rows = [parse_meta(e.meta[:n].tolist(), len(keys)) for e in encs]
        metas = [r.features for r in rows]
        t0 = time.perf_counter()
        decode_kjt(
            recv,
            [r.payload_words for r in rows],
            metas,
            [r.batch for r in rows],
            [r.codes for r in rows],
            keys,
            0,
        )
        dec_t.append(time.perf_counter() - t0)
        comms.stats.reset()
    enc_t.sort()
    dec_t.sort()
    return {"encode_ms": 1e3 * enc_t[reps // 2], "decode_ms": 1e3 * dec_t[reps // 2]}


def _parse_bound(text: str) -> ErrorBound:
    """``MODE:VALUE`` (e.g. ``value:0.03125``) as an ``ErrorBound``."""
    mode, _, value = text.partition(":")
    return ErrorBound(mode=mode, value=float(value))


def main(argv: list[str] | None = None) -> int:
    """Prints the table and the JSON; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2048, help="synthetic: samples per rank")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 8])
    p.add_argument("--json", help="also write the results here")
    p.add_argument(
        "--sharding",
        choices=("table_wise", "row_wise"),
        default="table_wise",
        help="every table table-wise round-robin, or every table row-wise over all ranks",
    )
    p.add_argument("--module", choices=("ebc", "ec"), default="ebc", help="module type")
    p.add_argument(
        "--forward-bound",
        metavar="MODE:VALUE",
        help="table-wise EBC: the lossy forward's default_bound instead of the default, e.g. "
        "value:0.03125 (per-value) or relative:0.01",
    )
    p.add_argument(
        "--backward-bound",
        metavar="MODE:VALUE",
        help="table-wise EBC: the lossy backward's backward_bound instead of the default, e.g. "
        "value:0.0625 or relative:0.01",
    )
    p.add_argument(
        "--format",
        choices=("entropy", "packed"),
        default="entropy",
        help="table-wise EBC: the codec format of the lossy forward and backward",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="table-wise EBC: the lossy backward's bytes by payload part instead",
    )
    p.add_argument("--seq-len", type=int, default=50, help="ec: ids per sample and feature")
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

    config = LossyCommsConfig(
        format=args.format,
        **{
            key: _parse_bound(text)
            for key, text in (
                ("default_bound", args.forward_bound),
                ("backward_bound", args.backward_bound),
            )
            if text
        },
    )
    g = torch.Generator().manual_seed(0)
    if args.module == "ec":
        ec = [r for w in args.worlds for r in _ec_results(w, args.batch, args.seq_len, 32, g)]
        _print_ec(ec)
        if args.json:
            with open(args.json, "w") as fh:
                fh.write(json.dumps(ec, indent=1) + "\n")
        return 0
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
            if args.breakdown:
                row = _backward_breakdown(ids, world, dim, g, config)
                results.append({"dataset": name, **row})
                _print_breakdown(results[-1:])
                continue
            if args.sharding == "row_wise":
                for row in _row_wise_results(ids, ranks, world, preset, dim, g):
                    results.append(
                        {
                            "dataset": name,
                            "world": world,
                            "batch_per_rank": keep // world,
                            "dim": dim,
                            "sharding": "row_wise",
                            "output_rows": NUM_FEATURES * keep,
                            **row,
                        }
                    )
                continue
            inp = _input_bytes(ids, world)
            outp = _output_bytes(ids, ranks, world, preset, dim, config)
            bwd = _backward_bytes(ids, world, dim, g, config)
            # Modes as a user runs them: TorchRec's input dist with none / qcomm output codecs;
            # ours: the packed, deduplicated input dist with the lossy output dist.
            # (input, forward, backward): TorchRec's qcomm modes with the same precision both
            # ways (fp16 backward for fp16; "mx4" is MX4 forward + MX4 backward).
            modes = {
                "none": ("none", "none", "none"),
                "fp16": ("none", "fp16", "bf16"),  # 2 bytes a gradient either way
                "mx4": ("none", "mx4", "mx4"),
                "lossy (no out dedupe)": ("packed+dedupe", "lossy", "lossy"),
                "lossy": ("packed+dedupe", "lossy+out_dedupe", "lossy"),
            }
            for mode, (i, o, bw) in modes.items():
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
                        "backward_bytes": bwd[bw]["bytes"],
                        "output_rows": outp[o].get("rows", outp["none"]["rows"]),
                        "repeated_share": inp["packed+dedupe"]["repeated_share"],
                    }
                )
    if args.breakdown:
        if args.json:
            with open(args.json, "w") as fh:
                fh.write(json.dumps(results, indent=1) + "\n")
        return 0
    print(
        f"{'dataset':<18} {'world':>5} {'B/rank':>6} {'mode':<22} {'input B':>10} "
        f"{'output B':>11} {'bwd B':>11} {'step B':>11} {'in x':>6} {'out x':>6} {'bwd x':>6} "
        f"{'step x':>6} {'rows sent':>9}"
    )
    base: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        key = (r["dataset"], r["world"])
        if r["mode"] == "none":
            base[key] = r
        b = base[key]
        step = r["input_bytes"] + r["output_bytes"] + r["backward_bytes"]
        r["step_bytes"] = step
        b_step = b["input_bytes"] + b["output_bytes"] + b["backward_bytes"]
        print(
            f"{r['dataset']:<18} {r['world']:>5} {r['batch_per_rank']:>6} {r['mode']:<22} "
            f"{r['input_bytes']:>10,.0f} {r['output_bytes']:>11,.0f} "
            f"{r['backward_bytes']:>11,.0f} {step:>11,.0f} "
            f"{b['input_bytes'] / r['input_bytes']:>6.2f} "
            f"{b['output_bytes'] / r['output_bytes']:>6.2f} "
            f"{b['backward_bytes'] / r['backward_bytes']:>6.2f} "
            f"{b_step / step:>6.2f} "
            f"{r['output_rows'] / b['output_rows']:>9.1%}"
        )
    text = json.dumps(results, indent=1)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
