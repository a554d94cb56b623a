"""Codec benchmark on realistic DLRM forward all-to-all traffic, beside TorchRec's qcomm codecs.

For each per-destination block size (rows) and each error-bound setting it reports, per table and
overall: compression ratio (raw bytes / payload bytes, headers included), the order-0 entropy
bound of the same traffic, the largest error as a fraction of the bound and of the block's value
range, and compress/decompress throughput on one thread (MB/s of raw fp32 input, median of
``--reps`` timed runs after a warm-up). In the same run and on the same input: TorchRec's qcomm
codecs (FP16, BF16, INT8 rowwise, MX4) on the fused ``[rows, tables * dim]`` buffer as TorchRec
sends it, and a plain copy. The qcomm columns are skipped with a note where torchrec or fbgemm
cannot be imported.

Examples::

    python benchmarks/codec_bench.py                       # criteo_kaggle, dim 32
    python benchmarks/codec_bench.py --quick
    python benchmarks/codec_bench.py --preset criteo_1tb --dim 64 --per-table
    python benchmarks/codec_bench.py --real --json out/real.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from torchrec_lossy.traffic import (
    DEFAULT_CRITEO_SAMPLE,
    TrafficSpec,
    criteo_sample_ids,
    make_blocks,
    paper_class_bounds,
    relative_to_absolute_bounds,
    table_cardinalities,
)

QCOMM_CODECS = ("fp16", "bf16", "int8", "mx4")
LINK_GBPS_DEFAULT = 12.5  # DESIGN §2: the link speed the transfer model assumes


# ------------------------------------------------------------------------------------------------
# Measurement helpers
# ------------------------------------------------------------------------------------------------


# The clock of every timing: wall time, or with --clock cpu this process's CPU time (on a shared
# machine, wall time counts the time other processes hold the cores; CPU time does not).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock: list[Callable[[], float]] = [time.perf_counter]


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median time of ``fn`` over ``reps`` runs (on the ``--clock``), after one warm-up run.

    Args:
        fn: The work to time.
        reps: Timed runs (at least 1).

    Returns:
        Median seconds per run.
    """
    fn()
    times = []
    for _ in range(max(1, reps)):
        t0 = _clock[0]()
        fn()
        times.append(_clock[0]() - t0)
    return statistics.median(times)


def _range(x: torch.Tensor) -> float:
    return float(x.max()) - float(x.min()) if x.numel() else 0.0


def _max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if a.numel() else 0.0


def _max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|b - a| / |a|`` over the finite elements (0 where both are 0)."""
    x, y = a.to(torch.float64), b.to(torch.float64)
    fin = torch.isfinite(x)
    d = (y[fin] - x[fin]).abs()
    r = torch.where(d > 0, d / x[fin].abs(), 0.0)
    return float(r.max()) if r.numel() else 0.0


def value_bound(setting: str) -> float | None:
    """The per-value bound of a ``value:v`` setting, else None."""
    return float(setting.split(":", 1)[1]) if setting.startswith("value:") else None


def _err_over_bound(err: float, bound: float) -> float:
    if bound > 0:
        return err / bound
    return 0.0 if err == 0 else math.inf


def _fmt_err_bound(value: float | None) -> str:
    """Error / bound truncated (not rounded) to 4 places, so 0.99999 never prints as 1.0000;
    a violation (above 1) is flagged with ``!``."""
    if value is None:
        return "-"
    if value > 1.0:
        return f"{value:.4f}!"
    return f"{math.floor(value * 1e4) / 1e4:.4f}"


def _mbps(raw_bytes: int, seconds: float) -> float:
    return raw_bytes / seconds / 1e6 if seconds > 0 else math.inf


def link_speedup(ratio: float, comp_mbps: float, decomp_mbps: float, link_gbps: float) -> float:
    """Transfer speedup ``1 / (1/R + B/Tc + B/Td)`` over sending raw fp32 on a link of ``B``.

    Args:
        ratio: Compression ratio ``R``.
        comp_mbps: Compress throughput ``Tc`` (MB/s of raw input).
        decomp_mbps: Decompress throughput ``Td`` (MB/s of raw input).
        link_gbps: Link bandwidth ``B`` in GB/s.

    Returns:
        The speedup (below 1: slower than sending raw).
    """
    b = link_gbps * 1e3
    return 1.0 / (1.0 / ratio + b / comp_mbps + b / decomp_mbps)


# ------------------------------------------------------------------------------------------------
# Codecs under test
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CodecRun:
    """One codec's figures on one batch (sums, so batches can be pooled).

    Attributes:
        codec: Name in the table.
        bounds: Bound setting (``"-"`` for codecs without a bound).
        raw_bytes: Input bytes.
        wire_bytes: Encoded bytes (payload with headers).
        comp_s: Median compress seconds.
        decomp_s: Median decompress seconds.
        err_bound: Largest error / bound over blocks (lossy codec only).
        err_range: Largest error / block value range over blocks.
        entropy_bytes: Order-0 entropy bound of the same traffic (lossy codec only).
        error: Why the codec failed, if it did.
    """

    codec: str
    bounds: str
    raw_bytes: int = 0
    wire_bytes: int = 0
    comp_s: float = 0.0
    decomp_s: float = 0.0
    err_bound: float | None = None
    err_range: float = 0.0
    entropy_bytes: float | None = None
    error: str | None = None

    def add(self, other: CodecRun) -> None:
        """Pool another batch's figures into this one."""
        self.raw_bytes += other.raw_bytes
        self.wire_bytes += other.wire_bytes
        self.comp_s += other.comp_s
        self.decomp_s += other.decomp_s
        self.err_range = max(self.err_range, other.err_range)
        if other.err_bound is not None:
            self.err_bound = max(self.err_bound or 0.0, other.err_bound)
        if other.entropy_bytes is not None:
            self.entropy_bytes = (self.entropy_bytes or 0.0) + other.entropy_bytes
        self.error = self.error or other.error

    def summary(self, link_gbps: float) -> dict[str, Any]:
        """The row of the result table, as a JSON-ready dict."""
        out: dict[str, Any] = {"codec": self.codec, "bounds": self.bounds}
        if self.error is not None:
            return {**out, "failed": self.error}
        ratio = self.raw_bytes / self.wire_bytes
        comp, decomp = _mbps(self.raw_bytes, self.comp_s), _mbps(self.raw_bytes, self.decomp_s)
        out.update(
            ratio=ratio,
            entropy_bound_ratio=(
                self.raw_bytes / self.entropy_bytes if self.entropy_bytes else None
            ),
            max_err_over_bound=self.err_bound,
            max_err_over_range=self.err_range,
            compress_mbps=comp,
            decompress_mbps=decomp,
            link_speedup=link_speedup(ratio, comp, decomp, link_gbps) if self.decomp_s else None,
            raw_bytes=self.raw_bytes,
            wire_bytes=self.wire_bytes,
        )
        return out


def _load_lossy(
    fmt: str = "entropy",
) -> tuple[Callable[..., torch.Tensor], Callable[..., list[torch.Tensor]]] | str:
    """The codec's compress/decompress in format ``fmt`` (``CodecConfig.format``), or why they
    cannot be imported."""
    try:
        from torchrec_lossy.codec import BoundKind, CodecConfig, compress_with_stats, decompress
    except Exception as e:  # the codec is optional for this script: report and go on
        return f"torchrec_lossy.codec not importable ({type(e).__name__}: {e})"
    config = CodecConfig(format=fmt)

    def compress(blocks: list[torch.Tensor], bounds: list[float], value: bool = False) -> Any:
        kind = BoundKind.VALUE if value else BoundKind.ABSOLUTE
        return compress_with_stats(blocks, bounds, config, [kind] * len(blocks))[0]

    return compress, decompress


def _load_grouped(
    destinations: int, fmt: str = "entropy"
) -> tuple[Callable[..., torch.Tensor], Callable[..., list[torch.Tensor]]] | str:
    """compress/decompress through the grouped API (``compress_groups`` / ``decompress_groups``
    + ``check_groups``: one payload per destination, the all-to-all's call), with the flat
    signatures of :func:`_load_lossy`; a call whose block count does not split into
    ``destinations`` groups is one group."""
    try:
        from torchrec_lossy.codec import (
            BoundKind,
            CodecConfig,
            check_groups,
            compress_groups,
            decompress_groups,
        )
    except Exception as e:
        return f"torchrec_lossy.codec not importable ({type(e).__name__}: {e})"
    config = CodecConfig(format=fmt)
    sizes: dict[tuple[int, int], list[int]] = {}

    def split(xs: list[Any]) -> list[list[Any]]:
        n = len(xs) // destinations if len(xs) % destinations == 0 else len(xs)
        return [xs[i : i + n] for i in range(0, len(xs), max(n, 1))]

    def compress(blocks: list[torch.Tensor], bounds: list[float], value: bool = False) -> Any:
        kind = BoundKind.VALUE if value else BoundKind.ABSOLUTE
        out = compress_groups(split(blocks), split(bounds), config, kinds=kind)
        sizes[(out.buffer.data_ptr(), out.buffer.numel())] = out.sizes
        return out.buffer

    def decompress(buffer: torch.Tensor) -> list[torch.Tensor]:
        blocks, status = decompress_groups(buffer, sizes[(buffer.data_ptr(), buffer.numel())])
        check_groups(status)
        return [b for g in blocks for b in g]

    return compress, decompress


def _load_entropy_bound() -> tuple[Callable[..., list[float]], str]:
    """The codec's order-0 entropy bound (DESIGN.md section 4)."""
    from torchrec_lossy.codec import entropy_bound_bytes

    return entropy_bound_bytes, "torchrec_lossy.codec.entropy_bound_bytes"


def run_lossy(
    compress: Callable[..., torch.Tensor],
    decompress: Callable[..., list[torch.Tensor]],
    blocks: list[torch.Tensor],
    bounds: list[float],
    reps: int,
    value: bool = False,
) -> tuple[CodecRun, list[torch.Tensor]]:
    """Compress all blocks into one payload; time both directions; check the errors.

    Args:
        compress: ``torchrec_lossy.codec.compress``.
        decompress: ``torchrec_lossy.codec.decompress``.
        blocks: One batch, one block per table.
        bounds: Absolute bound per block (per-value where ``value``).
        reps: Timed repetitions.
        value: Per-value bounds (the error is then relative to each element).

    Returns:
        The figures (without bound name and entropy) and the decoded blocks.
    """
    run = CodecRun("lossy", "", raw_bytes=sum(b.numel() * b.element_size() for b in blocks))
    payload = compress(blocks, bounds, value)
    decoded = decompress(payload)
    if len(decoded) != len(blocks) or any(
        d.shape != b.shape or d.dtype != b.dtype for d, b in zip(decoded, blocks, strict=False)
    ):
        raise RuntimeError("decompress returned blocks of other shapes or dtypes than the input")
    run.wire_bytes = payload.numel() * payload.element_size()
    errs = [_max_abs_err(b, d) for b, d in zip(blocks, decoded, strict=True)]
    rel = [_max_rel_err(b, d) for b, d in zip(blocks, decoded, strict=True)] if value else errs
    run.err_bound = max(_err_over_bound(e, eb) for e, eb in zip(rel, bounds, strict=True))
    run.err_range = max(_err_over_bound(e, _range(b)) for e, b in zip(errs, blocks, strict=True))
    run.comp_s = median_seconds(lambda: compress(blocks, bounds, value), reps)
    run.decomp_s = median_seconds(lambda: decompress(payload), reps)
    return run, decoded


class QComm:
    """TorchRec's forward qcomm codecs, built as a user would, on CPU tensors.

    The registry is built with ``device=cuda`` so that BF16 is measured as BF16: on a CPU device
    TorchRec swaps BF16 for FP16 (gloo has no BF16). Nothing runs on a GPU: the codecs are called
    on CPU tensors. INT8 and MX4 use the contexts TorchRec creates (rowwise row_dim 32, MX4 group
    32), so fused buffers must hold a multiple of 32 values.
    """

    def __init__(self) -> None:
        from torchrec.distributed.fbgemm_qcomm_codec import (
            CommType,
            QCommsConfig,
            get_qcomm_codecs_registry,
        )
        from torchrec.distributed.types import CommOp

        self.codecs: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        op = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL
        for name in QCOMM_CODECS:
            try:
                registry = get_qcomm_codecs_registry(
                    QCommsConfig(forward_precision=CommType(name)),
                    comm_ops=[op],
                    device=torch.device("cuda"),
                )
                assert registry is not None
                self.codecs[name] = registry[op.name].forward
            except Exception as e:
                self.errors[name] = f"{type(e).__name__}: {e}"

    def run(self, name: str, blocks: list[torch.Tensor], reps: int) -> tuple[CodecRun, list[float]]:
        """Encode/decode the fused buffer; error per block as a fraction of its range.

        Args:
            name: One of :data:`QCOMM_CODECS`.
            blocks: One batch, one block per table (same rows).
            reps: Timed repetitions.

        Returns:
            The figures and the per-block error / range.
        """
        if name in self.errors:
            return CodecRun(name, "-", error=self.errors[name]), []
        codec = self.codecs[name]
        fused = torch.cat(blocks, dim=1).contiguous()
        flat = fused.view(-1)
        run = CodecRun(name, "-", raw_bytes=flat.numel() * flat.element_size())
        try:
            ctx = codec.create_context()
            encoded = codec.encode(flat, ctx)
            decoded = codec.decode(encoded, ctx).view(fused.shape)
            run.wire_bytes = encoded.numel() * encoded.element_size()
            run.comp_s = median_seconds(lambda: codec.encode(flat, ctx), reps)
            run.decomp_s = median_seconds(lambda: codec.decode(encoded, ctx), reps)
        except Exception as e:
            run.error = f"{type(e).__name__}: {e}".splitlines()[0]
            return run, []
        per_block = []
        for b, d in zip(blocks, decoded.split([b.shape[1] for b in blocks], 1), strict=True):
            per_block.append(_err_over_bound(_max_abs_err(b, d), _range(b)))
        run.err_range = max(per_block)
        return run, per_block


def run_memcpy(blocks: list[torch.Tensor], reps: int) -> CodecRun:
    """A plain ``copy_`` of the fused buffer, the floor every codec is compared with."""
    fused = torch.cat(blocks, dim=1).contiguous()
    dst = torch.empty_like(fused)
    raw = fused.numel() * fused.element_size()
    t = median_seconds(lambda: dst.copy_(fused), reps)
    return CodecRun("memcpy", "-", raw_bytes=raw, wire_bytes=raw, comp_s=t, decomp_s=t)


# ------------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------------


def relative_bounds(setting: str, preset: str) -> list[float]:
    """Relative bound per table for a setting: ``paper`` (three classes) or a number.

    Args:
        setting: ``"paper"`` or a relative bound such as ``"0.01"``.
        preset: Table sizes (for the paper classes).

    Returns:
        26 relative bounds.
    """
    if setting == "paper":
        return paper_class_bounds(preset)
    try:
        value = float(setting.removeprefix("value:"))
    except ValueError:
        raise SystemExit(
            f"--bounds takes 'paper', numbers such as 0.01 or value:0.03; got {setting!r}"
        ) from None
    if not 0 < value < 1:
        raise SystemExit(f"a relative bound must lie in (0, 1); got {value}")
    return [value] * len(table_cardinalities(preset))


def batches_for(args: argparse.Namespace, rows: int) -> tuple[list[list[torch.Tensor]], int]:
    """The traffic of one block size: ``args.batches`` batches (fewer in --real mode).

    Args:
        args: Parsed command line.
        rows: Rows per block.

    Returns:
        The batches and the rows per block actually used (capped at the sample's rows in --real).
    """
    source = "criteo" if args.real else "zipf"
    count = args.batches
    if args.real:
        available = criteo_sample_ids(args.criteo_path, args.preset).shape[0]
        rows = min(rows, available)
        count = max(1, min(count, available // rows))
    specs = [
        TrafficSpec(
            preset=args.preset,
            dim=args.dim,
            batch_rows=rows,
            seed=args.seed,
            batch=i,
            source=source,
            criteo_path=args.criteo_path,
        )
        for i in range(count)
    ]
    batches = [make_blocks(s) for s in specs]
    if args.destinations > 1:  # one compress call per group: every destination's blocks
        more = [
            make_blocks(dataclasses.replace(s, batch=s.batch + k * count))
            for s in specs
            for k in range(1, args.destinations)
        ]
        per = args.destinations - 1
        batches = [b + [t for m in more[i * per : (i + 1) * per] for t in m] for i, b in
                   enumerate(batches)]  # fmt: skip
    return batches, rows


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration and gather the results.

    Args:
        args: Parsed command line.

    Returns:
        JSON-ready results: ``config``, ``environment``, ``notes``, ``results`` and ``per_table``.
    """
    notes: list[str] = []
    _clock[0] = CLOCKS[args.clock]
    codecs = {
        fmt: _load_grouped(args.destinations, fmt) if args.grouped else _load_lossy(fmt)
        for fmt in args.formats
    }
    for lossy in codecs.values():
        if isinstance(lossy, str):
            notes.append(f"lossy codec skipped: {lossy}")
            break
    if "numba" in sys.modules:  # already imported (by the codec): pin its pool too
        numba = sys.modules["numba"]
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    entropy_fn, entropy_source = _load_entropy_bound()
    qcomm: QComm | None = None
    if not args.no_qcomm:
        try:
            qcomm = QComm()
        except Exception as e:  # GPU boxes may have torch without torchrec/fbgemm
            notes.append(
                f"qcomm codecs skipped: torchrec/fbgemm not usable ({type(e).__name__}: {e})"
            )
    cards = table_cardinalities(args.preset)
    results: list[dict[str, Any]] = []
    per_table: list[dict[str, Any]] = []

    for asked_rows in args.rows:
        batches, rows = batches_for(args, asked_rows)
        if rows != asked_rows:
            notes.append(f"--real: {asked_rows} rows asked, the sample gives {rows} per block")
        head = {"rows": rows, "batches": len(batches), "tables": len(cards), "dim": args.dim,
                "destinations": args.destinations}  # fmt: skip

        for setting, (fmt, lossy) in itertools.product(args.bounds, codecs.items()):
            name = "lossy" if fmt == "entropy" else f"lossy-{fmt}"
            rel = relative_bounds(setting, args.preset) * args.destinations
            per_value = value_bound(setting) is not None
            pooled = CodecRun(name, setting)
            tables = [
                {"table": f"C{t + 1}", "cardinality": c, "eb_rel": r, "raw_bytes": 0,
                 "wire_bytes": 0, "entropy_bytes": 0.0, "distinct_vectors": 0,
                 "max_err_over_bound": 0.0, "eb_abs": []}
                for t, (c, r) in enumerate(zip(cards, rel[: len(cards)], strict=True))
            ]  # fmt: skip
            lossy_ok = not isinstance(lossy, str)
            for blocks in batches:
                bounds = rel if per_value else relative_to_absolute_bounds(blocks, rel)
                ent = entropy_fn(blocks, bounds, [per_value] * len(blocks))
                if isinstance(lossy, str):
                    run, decoded = CodecRun(name, setting, error=lossy), None
                else:
                    try:
                        run, decoded = run_lossy(*lossy, blocks, bounds, args.reps, per_value)
                    except Exception as e:
                        run, decoded = (
                            CodecRun(name, setting, error=f"{type(e).__name__}: {e}"),
                            None,
                        )
                lossy_ok = lossy_ok and decoded is not None
                run.codec, run.bounds, run.entropy_bytes = name, setting, sum(ent)
                pooled.add(run)
                for t, (b, eb) in enumerate(zip(blocks, bounds, strict=True)):
                    row = tables[t % len(cards)]
                    row["raw_bytes"] += b.numel() * b.element_size()
                    row["entropy_bytes"] += ent[t]
                    row["eb_abs"].append(eb)
                    row["distinct_vectors"] += int(torch.unique(b, dim=0).shape[0])
                    if decoded is None:
                        continue
                    err_of = _max_rel_err if per_value else _max_abs_err
                    err = _err_over_bound(err_of(b, decoded[t]), eb)
                    row["max_err_over_bound"] = max(row["max_err_over_bound"], err)
                    if args.per_table:
                        # Standalone payload of one table, its own header included.
                        row["wire_bytes"] += lossy[0]([b], [eb], per_value).numel()
            results.append({**head, **pooled.summary(args.link_gbps)})
            for row in tables:
                row["entropy_bound_ratio"] = (  # None: a constant block, bound 0 bytes
                    row["raw_bytes"] / row["entropy_bytes"] if row["entropy_bytes"] > 0 else None
                )
                row["ratio"] = (
                    row["raw_bytes"] / row["wire_bytes"] if lossy_ok and row["wire_bytes"] else None
                )
                row["distinct_vectors"] /= len(batches) * args.destinations
                row["eb_abs"] = statistics.mean(row["eb_abs"])
                if not lossy_ok:
                    row["max_err_over_bound"] = None
                per_table.append({**head, "bounds": setting, "format": fmt, **row})

        qcomm_tables: dict[str, list[float]] = {}
        if qcomm is not None:
            for name in QCOMM_CODECS:
                pooled = CodecRun(name, "-")
                errs: list[list[float]] = []
                for blocks in batches:
                    run, per_block = qcomm.run(name, blocks, args.reps)
                    pooled.add(run)
                    errs.append(per_block)
                results.append({**head, **pooled.summary(args.link_gbps)})
                if pooled.error is None:
                    qcomm_tables[name] = [max(e) for e in zip(*errs, strict=True)]
        pooled = CodecRun("memcpy", "-")
        for blocks in batches:
            pooled.add(run_memcpy(blocks, args.reps))
        results.append({**head, **pooled.summary(args.link_gbps)})
        for row in per_table:
            if row["rows"] == rows:
                t = int(row["table"][1:]) - 1
                row["qcomm_err_over_range"] = {k: v[t] for k, v in qcomm_tables.items()}

    if qcomm is not None:
        notes.append(
            "qcomm: fused [rows, tables*dim] buffer as TorchRec sends it; BF16 measured as BF16 "
            "(TorchRec swaps it for FP16 on CPU/gloo); INT8 rowwise row_dim 32, MX4 group 32"
        )
    notes.append(f"entropy bound from {entropy_source}")
    violated = [
        f"{r['rows']} rows, bounds {r['bounds']}"
        for r in results
        if r["codec"].startswith("lossy") and (r.get("max_err_over_bound") or 0.0) > 1.0
    ]
    if violated:
        notes.append(f"ERROR BOUND VIOLATED by the lossy codec: {'; '.join(violated)}")
    return {
        "config": {
            "preset": args.preset,
            "dim": args.dim,
            "rows": args.rows,
            "bounds": args.bounds,
            "reps": args.reps,
            "batches": args.batches,
            "destinations": args.destinations,
            "grouped": args.grouped,
            "formats": args.formats,
            "clock": args.clock,
            "seed": args.seed,
            "source": "criteo" if args.real else "zipf",
            "criteo_path": str(args.criteo_path or DEFAULT_CRITEO_SAMPLE) if args.real else None,
            "threads": args.threads,
            "link_gbps": args.link_gbps,
        },
        "environment": _environment(),
        "notes": notes,
        "results": results,
        "per_table": per_table,
    }


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    for mod in ("torchrec", "fbgemm_gpu", "numba"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    return env


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return format(value, spec)


def format_report(report: dict[str, Any], per_table: bool) -> str:
    """Readable tables of a :func:`benchmark` report.

    Args:
        report: The report.
        per_table: Add the per-table detail.

    Returns:
        The text.
    """
    cfg = report["config"]
    lines = [
        f"preset {cfg['preset']}, dim {cfg['dim']}, ids {cfg['source']}, "
        f"{cfg['threads']} thread(s), reps {cfg['reps']}, {cfg.get('clock', 'wall')} clock; "
        "MB/s of raw fp32 input; "
        f"link x = transfer speedup over raw fp32 at {cfg['link_gbps']} GB/s"
    ]
    header = (
        f"{'rows':>5} {'codec':<7} {'bounds':<6} {'ratio':>7} {'H0 bnd':>7} {'err/eb':>7} "
        f"{'err/rng':>8} {'comp MB/s':>10} {'dec MB/s':>9} {'link x':>7}"
    )
    current = None
    for r in report["results"]:
        if r["rows"] != current:
            current = r["rows"]
            lines += ["", f"{r['rows']} rows x {r['tables']} tables x "
                      f"{r.get('destinations', 1)} destination(s) x dim {r['dim']}, "
                      f"{r['batches']} batch(es)", header]  # fmt: skip
        if "failed" in r:
            lines.append(f"{r['rows']:>5} {r['codec']:<7} {r['bounds']:<6} FAILED: {r['failed']}")
            continue
        lines.append(
            f"{r['rows']:>5} {r['codec']:<7} {r['bounds']:<6} {r['ratio']:>6.2f}x "
            f"{_fmt(r['entropy_bound_ratio'], '6.2f'):>6}{'x' if r['entropy_bound_ratio'] else ' '}"
            " "
            f"{_fmt_err_bound(r['max_err_over_bound']):>7} {r['max_err_over_range']:>8.5f} "
            f"{r['compress_mbps']:>10.1f} {r['decompress_mbps']:>9.1f} "
            f"{_fmt(r['link_speedup'], '7.3f'):>7}"
        )
    if per_table:
        lines += ["", "per table (ratio: the table alone in a payload; H0 bnd: entropy bound; "
                  "distinct: mean distinct vectors per block)"]  # fmt: skip
        current = None
        for r in report["per_table"]:
            key = (r["rows"], r["bounds"])
            if key != current:
                current = key
                qnames = list(r.get("qcomm_err_over_range", {}))
                lines += [
                    "",
                    f"{r['rows']} rows, bounds {r['bounds']}",
                    f"{'table':<5} {'rows':>9} {'eb_rel':>6} {'distinct':>8} {'ratio':>8} "
                    f"{'H0 bnd':>9} {'err/eb':>7}" + "".join(f" {q + ' e/r':>10}" for q in qnames),
                ]
            q = r.get("qcomm_err_over_range", {})
            lines.append(
                f"{r['table']:<5} {r['cardinality']:>9} {r['eb_rel']:>6.2f} "
                f"{r['distinct_vectors']:>8.1f} {_fmt(r['ratio'], '7.2f'):>7}x "
                f"{_fmt(r['entropy_bound_ratio'], '8.2f'):>8}x "
                f"{_fmt_err_bound(r['max_err_over_bound']):>7}"
                + "".join(f" {v:>10.5f}" for v in q.values())
            )
    if report["notes"]:
        lines += ["", *(f"note: {n}" for n in report["notes"])]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed arguments, with ``--quick`` applied.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset", choices=["criteo_kaggle", "criteo_1tb"], default=None,
        help="table sizes; default criteo_kaggle, or criteo_1tb with --real (1TB sample)",
    )  # fmt: skip
    p.add_argument("--dim", type=int, default=None, help="default: 32 (kaggle), 64 (1tb)")
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 256], help="rows per block")
    p.add_argument(
        "--bounds", nargs="+", default=["paper", "0.01", "0.05"],
        help="'paper' (0.01/0.03/0.05 by table size), uniform relative bounds and/or "
        "per-value bounds such as value:0.03 (|x' - x| <= 0.03 |x|)",
    )  # fmt: skip
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (median)")
    p.add_argument("--batches", type=int, default=4, help="batches per block size")
    p.add_argument(
        "--destinations", type=int, default=1,
        help="destinations per compress call: each call takes every table's block of this many "
        "destinations (the batched CPU path's case, e.g. 8)",
    )  # fmt: skip
    p.add_argument(
        "--grouped", action="store_true",
        help="with --destinations: compress_groups / decompress_groups (one payload per "
        "destination, as the all-to-all calls them) instead of one payload for all",
    )  # fmt: skip
    p.add_argument(
        "--formats", nargs="+", choices=["entropy", "packed"], default=["entropy"],
        help="the codec's wire formats to run (CodecConfig.format); packed rows are "
        "'lossy-packed'",
    )  # fmt: skip
    p.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall",
        help="time with the wall clock, or this process's CPU time (a loaded, shared machine)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real", action="store_true", help="ids from the real Criteo sample")
    p.add_argument("--criteo-path", type=Path, default=None, help="Criteo TSV(.gz) for --real")
    p.add_argument("--threads", type=int, default=1, help="torch and numba threads")
    p.add_argument("--link-gbps", type=float, default=LINK_GBPS_DEFAULT)
    p.add_argument("--no-qcomm", action="store_true", help="skip TorchRec's qcomm codecs")
    p.add_argument("--per-table", action="store_true", help="print per-table detail")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="256 rows, paper bounds, 1 batch, 3 reps")
    args = p.parse_args(argv)
    if args.preset is None:
        args.preset = "criteo_1tb" if args.real else "criteo_kaggle"
    if args.dim is None:
        args.dim = 32 if args.preset == "criteo_kaggle" else 64
    if args.quick:
        args.rows, args.bounds, args.batches, args.reps = [256], ["paper"], 1, 3
    if min(args.dim, args.reps, args.batches, args.destinations, *args.rows) < 1:
        p.error("--dim, --rows, --reps, --batches and --destinations must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    args = parse_args(argv)
    # One thread for every codec: numba reads this before its first parallel kernel compiles.
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    report = benchmark(args)
    print(format_report(report, args.per_table))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
