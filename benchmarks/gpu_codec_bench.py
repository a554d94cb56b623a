"""GPU benchmark of the codec's Triton kernels on realistic DLRM forward all-to-all traffic.

On one CUDA device, with ``triton.testing.do_bench`` (median of its timed runs, L2 flushed
between runs), it reports for one batch of traffic (``make_blocks``, 26 tables, paper class
bounds):

- the batched encode launchers ``device_compress`` runs, each once over every quantized block of
  the batch: ``quantize_tiles`` (+ escapes + histograms), ``representatives`` (vector-LZ),
  ``histogram_tiles``, ``code_lengths``, ``encode_chunks``;
- the device-resident ``compress`` / ``decompress`` (``device_compress``: one launch per stage
  for all blocks, one device-to-host sync; ``device_decompress``: two), what CUDA blocks get
  with ``backend="auto"``, the compiled host path (numba), and whether the payloads are
  byte-identical;
- beside them on the same traffic, fused ``[rows, tables * dim]`` as TorchRec sends it: a
  device-to-device copy, torch's FP16 cast, and fbgemm's FP16 and MX4 quantize / dequantize when
  ``fbgemm_gpu`` imports;
- the production grouped call (``--grouped-shape`` tables x rows x dim blocks per destination,
  ``--destinations`` of them, default 26 x 2048 x 64 x 8): ``compress_groups`` /
  ``decompress_groups`` in every ``--formats`` (``CodecConfig.format``), their payloads checked
  against the compiled host path's bytes, the decode of both formats timed under
  ``torch.cuda.set_sync_debug_mode("error")`` (it reads nothing back given the skeletons; the
  packed format's decode is its own kernels, docs/kernels.md; each format's compress makes its
  one read, the sizes: the packed one on the device since issue 31's first step), beside a plain
  copy, a BF16 cast and fbgemm's Triton MX4 kernel when it imports.

Throughput is GB/s of raw fp32 input (the whole batch) per second of the stage. It prints a table
and writes JSON. It needs only torch and triton, and exits with a message when there is no CUDA
device (the kernels' correctness is tested on CPU by tests/test_kernels.py).

Examples::

    python benchmarks/gpu_codec_bench.py
    python benchmarks/gpu_codec_bench.py --preset criteo_1tb --dim 64 --batch-rows 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from grouped_call import add_grouped_call_args, check_grouped_call_args, grouped_traffic

from torchrec_lossy.traffic import TrafficSpec, paper_traffic


def _fail(msg: str) -> int:
    print(f"gpu_codec_bench: {msg}", file=sys.stderr)
    return 2


class _Batch:
    """Every quantized block of the batch laid out back to back on the device, as the
    device-resident compress lays them out, for the batched production launchers."""

    def __init__(
        self, blocks: list[torch.Tensor], bounds: list[float], chunk: int, dev: torch.device
    ) -> None:
        from torchrec_lossy.codec import quantize as cpu_quantize
        from torchrec_lossy.codec.encode_columns import encode_columns
        from torchrec_lossy.codec.format import ALPHABET_SIZE, BITS_DTYPES, DTYPE_CODES
        from torchrec_lossy.codec.launch_tables import tile_table
        from torchrec_lossy.kernels import codebook
        from torchrec_lossy.kernels import huffman as k_huffman
        from torchrec_lossy.kernels import quantize as k_quantize

        quant = [
            (b, eb, params)
            for b, eb in zip(blocks, bounds, strict=True)
            if (params := cpu_quantize.quant_params(eb, b.reshape(-1).float().numpy())) is not None
        ]
        self.n_blocks = len(quant)
        self.chunk = chunk
        self.block = 4096  # elements per tile, as device_compress
        sizes = np.array([b.numel() for b, _, _ in quant], np.int64)
        self.tiles = torch.from_numpy(tile_table(sizes, self.block)).to(dev)

        def col(values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype)

        self.x = torch.cat([b.reshape(-1).float() for b, _, _ in quant]).to(dev)
        bits = [b.contiguous().view(BITS_DTYPES[b.dtype]).to(torch.int32) for b, _, _ in quant]
        self.bits = torch.cat([t.reshape(-1) for t in bits]).to(dev)
        rows = np.array([b.shape[0] for b, _, _ in quant], np.int64)
        dims = np.array([b.shape[1] for b, _, _ in quant], np.int64)
        self.max_dim = int(dims.max()) if dims.size else 1
        self.cols = encode_columns(
            len(quant), dev,
            step=col([p.step for _, _, p in quant], torch.float32),
            inv_step=col([p.inv_step for _, _, p in quant], torch.float32),
            center=col([p.center for _, _, p in quant]),
            bound=col([eb for _, eb, _ in quant], torch.float64),
            dtype=col([DTYPE_CODES[b.dtype] for b, _, _ in quant]),
            elem_off=torch.from_numpy(np.cumsum(sizes) - sizes),
            row_off=torch.from_numpy(np.cumsum(rows) - rows),
            dim=torch.from_numpy(dims),
        )  # fmt: skip
        self.row_blk = torch.from_numpy(np.repeat(np.arange(len(quant)), rows)).to(dev)
        self.sym = k_quantize.quantize_tiles(self.x, self.tiles, self.cols, self.block)[0]
        self.keep = torch.ones_like(self.sym, dtype=torch.int32)
        self.hist = k_huffman.histogram_tiles(self.sym, self.keep, self.tiles, len(quant), 4096)
        self.lengths = codebook.code_lengths(self.hist)
        self.codes = codebook.canonical_codes(self.lengths)
        # Chunks of ``chunk`` symbols per block (the tiles of ``chunk``), each coded with its
        # block's table.
        chunks = torch.from_numpy(tile_table(sizes, chunk)).to(dev)
        self.chunk_lo, self.chunk_hi = chunks[:, 0].contiguous(), chunks[:, 1].contiguous()
        self.chunk_table = (chunks[:, 2] * ALPHABET_SIZE).contiguous()


def _stage_fns(batch: _Batch) -> dict[str, Callable[[], object]]:
    """One closure per batched production launcher, each over every quantized block at once."""
    from torchrec_lossy.kernels import codebook
    from torchrec_lossy.kernels import huffman as k_huffman
    from torchrec_lossy.kernels import quantize as k_quantize
    from torchrec_lossy.kernels import vector_lz as k_vector_lz

    b = batch
    stream = b.sym.to(torch.int32)
    return {
        "quantize_tiles (+ escapes + histograms)": lambda: k_quantize.quantize_tiles(
            b.x, b.tiles, b.cols, b.block
        ),
        "representatives (vector-LZ, quantized)": lambda: k_vector_lz.representatives(
            b.sym, b.bits, b.row_blk, b.cols, b.max_dim
        ),
        "histogram_tiles": lambda: k_huffman.histogram_tiles(
            b.sym, b.keep, b.tiles, b.n_blocks, b.block
        ),
        "code_lengths": lambda: codebook.code_lengths(b.hist),
        "encode_chunks (1 sync: sizes the words)": lambda: k_huffman.encode_chunks(
            stream, b.chunk_lo, b.chunk_hi, b.chunk_table, b.lengths, b.codes, b.chunk
        ),
    }


def _baseline_fns(
    cpu_blocks: list[torch.Tensor], dev: torch.device
) -> tuple[dict[str, Callable[[], object]], list[str]]:
    """Copy, torch FP16 and fbgemm FP16 / MX4 on the fused buffer TorchRec would send."""
    fused = torch.cat(cpu_blocks, dim=1).float().to(dev).contiguous()
    dst = torch.empty_like(fused)
    half = fused.half()
    fns: dict[str, Callable[[], object]] = {
        "device-to-device copy": lambda: dst.copy_(fused),
        "torch fp16 cast (quantize)": lambda: fused.half(),
        "torch fp16 cast (dequantize)": lambda: half.float(),
    }
    notes = []
    try:  # fbgemm's FP16 comm codec, as TorchRec's qcomm uses it
        from fbgemm_gpu.quantize_utils import fp16_to_fp32, fp32_to_fp16_with_clamp

        fp16 = fp32_to_fp16_with_clamp(fused)
        fns["fbgemm FP16 quantize"] = lambda: fp32_to_fp16_with_clamp(fused)
        fns["fbgemm FP16 dequantize"] = lambda: fp16_to_fp32(fp16)
    except Exception as e:  # fbgemm missing, or a build without these ops
        notes.append(f"fbgemm FP16 skipped ({type(e).__name__}: {e})")
    try:
        from fbgemm_gpu.quantize_utils import fp32_to_mx4, mx4_to_fp32

        flat = fused.reshape(-1)
        mx4 = fp32_to_mx4(flat, group_size=32)
        fns["fbgemm MX4 quantize (group 32)"] = lambda: fp32_to_mx4(flat, group_size=32)
        fns["fbgemm MX4 dequantize (group 32)"] = lambda: mx4_to_fp32(mx4, group_size=32)
    except Exception as e:
        notes.append(f"fbgemm MX4 skipped ({type(e).__name__}: {e})")
    return fns, notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line.

    Args:
        argv: Command-line arguments (None: ``sys.argv``).

    Returns:
        The parsed arguments.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="criteo_kaggle", choices=["criteo_kaggle", "criteo_1tb"])
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-rows", type=int, default=1024)
    p.add_argument("--chunk-symbols", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rep-ms", type=int, default=200, help="do_bench time budget per entry")
    p.add_argument("--json", default="out/gpu_codec_bench.json", help="where to write results")
    add_grouped_call_args(p)
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage kernel table")
    args = p.parse_args(argv)
    check_grouped_call_args(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark.

    Args:
        argv: Command-line arguments (None: ``sys.argv``).

    Returns:
        The exit status: 0, or 2 when no CUDA device / triton is available.
    """
    args = parse_args(argv)

    if not torch.cuda.is_available():
        return _fail(
            "no CUDA device: this benchmark times the Triton kernels on a GPU. (Their "
            "bit-exactness is tested on CPU: pytest tests/test_kernels.py.)"
        )
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _fail("TRITON_INTERPRET=1 is set: unset it, interpreter timings mean nothing")
    try:
        import triton
        from triton.testing import do_bench
    except ImportError:
        return _fail("triton is not installed: pip install triton")

    def bench(fn: Callable[[], object]) -> float:
        return float(do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median"))

    out = run(args, torch.device("cuda"), bench)
    out.update(device=torch.cuda.get_device_name(), triton=triton.__version__)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0 if out["payload_identical_to_cpu"] and out["grouped_identical_to_cpu"] else 1


def run(
    args: argparse.Namespace, dev: torch.device, bench: Callable[[Callable[[], object]], float]
) -> dict[str, Any]:
    """Measures every entry and prints the table.

    Args:
        args: Parsed command line.
        dev: Device of the kernels (CUDA; CPU under TRITON_INTERPRET=1 only to smoke-test this
            script).
        bench: Returns the median milliseconds of a callable.

    Returns:
        The JSON-ready results.
    """
    from torchrec_lossy.codec import pipeline
    from torchrec_lossy.config import CodecConfig

    spec = TrafficSpec(preset=args.preset, dim=args.dim, batch_rows=args.batch_rows, seed=args.seed)
    cpu_blocks, bounds = paper_traffic(spec)
    raw_bytes = sum(b.numel() * 4 for b in cpu_blocks)
    config = CodecConfig(huffman_chunk_symbols=args.chunk_symbols)
    host = dataclasses.replace(config, backend="cpu")  # the compiled host path, off the device
    rows: list[dict[str, Any]] = []

    def record(group: str, name: str, fn: Callable[[], object]) -> None:
        ms = bench(fn)
        rows.append({"group": group, "name": name, "ms": ms, "gbps": raw_bytes / (ms * 1e-3) / 1e9})

    # Bit-exactness on this device first: the device-resident payload against the numba one.
    dev_blocks = [b.to(dev) for b in cpu_blocks]
    host_payload = pipeline.compress(dev_blocks, bounds, host)
    host_decoded = [b.cpu() for b in pipeline.decompress(host_payload, backend="cpu")]
    device_payload = pipeline.compress(dev_blocks, bounds, config)
    device_decoded = [b.cpu() for b in pipeline.decompress(device_payload)]
    pc = host_payload.cpu()
    identical = bool(torch.equal(device_payload.cpu(), pc)) and all(
        torch.equal(a.view(torch.int32), b.view(torch.int32))
        for a, b in zip(device_decoded, host_decoded, strict=True)
    )
    print(
        f"{args.preset} dim {args.dim}, {args.batch_rows} rows x {len(cpu_blocks)} tables = "
        f"{raw_bytes / 1e6:.2f} MB fp32 | ratio {raw_bytes / pc.numel():.2f} | "
        f"device-resident payload byte-identical to the numba host path: {identical}"
    )

    batch = _Batch(cpu_blocks, bounds, args.chunk_symbols, dev)
    for name, fn in {} if args.no_stages else _stage_fns(batch).items():
        record("triton stage", name, fn)
    record(
        "pipeline",
        "compress, device-resident",
        lambda: pipeline.compress(dev_blocks, bounds, config),
    )
    record("pipeline", "decompress, device-resident", lambda: pipeline.decompress(device_payload))
    record(
        "pipeline", "compress, numba host path", lambda: pipeline.compress(dev_blocks, bounds, host)
    )
    record(
        "pipeline",
        "decompress, numba host path",
        lambda: pipeline.decompress(host_payload, backend="cpu"),
    )

    fns, notes = _baseline_fns(cpu_blocks, dev)
    for name, fn in fns.items():
        record("baseline", name, fn)
    grouped, grouped_identical = _grouped_rows(args, dev, bench)

    notes = [
        f"{batch.n_blocks} of {len(cpu_blocks)} blocks quantize; the stages run over those, "
        "each once for all of them (the batched launchers device_compress runs)",
        "GB/s = raw fp32 bytes of the whole batch / median seconds",
        "pipeline rows: device-resident compress (one sync) and decompress (two), then the "
        "numba host path (blocks copied to the host and back)",
        *notes,
    ]
    print(f"{'group':<13} {'entry':<46} {'ms':>9} {'GB/s':>9}")
    for r in rows:
        print(f"{r['group']:<13} {r['name']:<46} {r['ms']:>9.4f} {r['gbps']:>9.2f}")
    for r in grouped:
        print(f"{'grouped':<13} {r['name']:<46} {r['ms']:>9.4f} {r['gbps']:>9.2f}")
    for n in notes:
        print(f"note: {n}")
    return {
        "grouped": grouped,
        "grouped_identical_to_cpu": grouped_identical,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": vars(args),
        "raw_bytes": raw_bytes,
        "payload_bytes": int(pc.numel()),
        "payload_identical_to_cpu": identical,
        "rows": rows,
        "notes": notes,
    }


def _grouped_rows(
    args: argparse.Namespace, dev: torch.device, bench: Callable[[Callable[[], object]], float]
) -> tuple[list[dict[str, Any]], bool]:
    """The production grouped call in every format, beside a copy, a BF16 cast and MX4.

    Returns:
        (one row per entry: name, ms, GB/s of raw fp32 input; whether every format's payloads
        are the host path's bytes and decode to its bits).
    """
    from torchrec_lossy.codec import check_groups, compress_groups, decompress_groups
    from torchrec_lossy.config import CodecConfig

    groups, bounds = grouped_traffic(
        args.grouped_shape, args.destinations, args.preset, args.seed, dev
    )
    raw = sum(b.numel() * 4 for g in groups for b in g)
    out: list[dict[str, Any]] = []
    identical = True

    def record(name: str, fn: Callable[[], object], no_sync: bool = False) -> None:
        def run() -> object:
            if not no_sync or dev.type != "cuda":  # sync debug mode exists on CUDA only
                return fn()
            torch.cuda.set_sync_debug_mode("error")  # a host sync here raises
            try:
                return fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")

        ms = bench(run)
        out.append({"name": name, "ms": ms, "gbps": raw / (ms * 1e-3) / 1e9})

    for fmt in args.formats:
        config = CodecConfig(format=fmt)
        sent = compress_groups(groups, bounds, config)
        host = compress_groups(groups, bounds, CodecConfig(format=fmt, backend="cpu"))
        got, status = decompress_groups(sent.buffer, sent.sizes, skeletons=sent.skeletons)
        check_groups(status)
        expect, _ = decompress_groups(host.buffer, host.sizes, backend="cpu")
        identical = identical and torch.equal(sent.buffer.cpu(), host.buffer.cpu())
        identical = identical and all(
            torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))
            for ga, gb in zip(got, expect, strict=True)
            for a, b in zip(ga, gb, strict=True)
        )
        ratio = raw / sent.buffer.numel()
        record(f"{fmt}: compress_groups ({ratio:.1f}x)", lambda c=config: compress_groups(
            groups, bounds, c))  # fmt: skip
        record(
            f"{fmt}: decompress_groups",
            lambda s=sent: decompress_groups(s.buffer, s.sizes, skeletons=s.skeletons),
            no_sync=True,
        )
    fused = torch.cat([torch.cat(g, dim=1) for g in groups]).contiguous()
    dst = torch.empty_like(fused)
    bf16 = fused.bfloat16()
    record("plain copy", lambda: dst.copy_(fused), no_sync=True)
    record("bf16 cast (encode)", lambda: fused.bfloat16(), no_sync=True)
    record("bf16 cast (decode)", lambda: bf16.float(), no_sync=True)
    try:
        from fbgemm_gpu.triton import dequantize_mx4, quantize_mx4

        flat = fused.reshape(-1)
        mx4 = quantize_mx4(flat, group_size=32)
        record("fbgemm Triton MX4 quantize", lambda: quantize_mx4(flat, group_size=32))
        record("fbgemm Triton MX4 dequantize", lambda: dequantize_mx4(mx4, group_size=32))
    except Exception as e:  # fbgemm missing, or a build without the Triton MX4 kernels
        print(f"note: fbgemm Triton MX4 skipped ({type(e).__name__}: {e})")
    return out, identical


if __name__ == "__main__":
    sys.exit(main())
