"""GPU benchmark of the codec's Triton kernels on realistic DLRM forward all-to-all traffic.

On one CUDA device, with ``triton.testing.do_bench`` (median of its timed runs, L2 flushed
between runs), it reports for one batch of traffic (``make_blocks``, 26 tables, paper class
bounds):

- every Triton stage on device-resident tensors: quantize (+ escapes + histogram), dequantize,
  vector-LZ dedupe, row histogram, reference packing, Huffman encode and decode;
- the device-resident ``compress`` (``device_compress``: one launch per stage for all blocks, one
  device-to-host sync), what CUDA blocks get with ``backend="auto"``;
- the full ``compress`` / ``decompress`` stage by stage (``pipeline.compress_staged`` /
  ``decompress_staged``) through ``TritonOps`` (tests/triton_stage_ops.py: every stage call copies
  its inputs to the device and its outputs back), the compiled host path (numba), and whether
  the payloads are byte-identical;
- beside them on the same traffic, fused ``[rows, tables * dim]`` as TorchRec sends it: a
  device-to-device copy, torch's FP16 cast, and fbgemm's FP16 and MX4 quantize / dequantize when
  ``fbgemm_gpu`` imports.

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

from torchrec_lossy.traffic import TrafficSpec, paper_traffic


def _fail(msg: str) -> int:
    print(f"gpu_codec_bench: {msg}", file=sys.stderr)
    return 2


class _Block:
    """One block's device-resident inputs and intermediate results for the stage timings."""

    def __init__(self, block: torch.Tensor, bound: float, chunk: int, dev: torch.device) -> None:
        from torchrec_lossy.codec import huffman
        from torchrec_lossy.codec import quantize as cpu_quantize
        from torchrec_lossy.codec.format import (
            BITS_DTYPES,
            DTYPE_CODES,
            ESCAPE_SYMBOL,
            REFS_FIXED,
            refs_packing,
        )
        from torchrec_lossy.kernels import huffman as k_huffman
        from torchrec_lossy.kernels import quantize as k_quantize
        from torchrec_lossy.kernels import vector_lz as k_vector_lz

        self.rows, self.dim = block.shape
        self.chunk = chunk
        self.dtype_code = DTYPE_CODES[block.dtype]
        x = block.reshape(-1).float()
        self.bound = bound
        self.params = cpu_quantize.quant_params(bound, x.numpy())
        self.x = x.to(dev)
        self.bits = block.contiguous().view(BITS_DTYPES[block.dtype]).to(torch.int32).to(dev)
        if self.params is None:  # bound 0 or too small: the lossless path only
            self.sym = None
            return
        p = self.params
        sym, _, _ = k_quantize.quantize(
            self.x, p.step, p.inv_step, p.center, bound, self.dtype_code
        )
        self.sym = sym.reshape(self.rows, self.dim)
        self.ids, self.first = k_vector_lz.dedupe(self.sym, self.bits)
        self.n_unique = self.first.shape[0]
        self.ref_mode = (
            int(refs_packing(self.rows, self.n_unique)[0]) if self.rows > 1 else REFS_FIXED
        )
        hist = k_huffman.histogram_rows(self.sym, self.first).cpu().numpy().astype(np.int64)
        lengths = huffman.code_lengths_kernel(hist)
        codes = huffman.canonical_codes_kernel(lengths)
        self.lengths = torch.from_numpy(lengths.astype(np.int32)).to(dev)
        self.codes = torch.from_numpy(codes.astype(np.int64)).to(dev)
        self.ends, self.words = k_huffman.encode(
            self.sym, self.first, self.lengths, self.codes, chunk
        )
        self.table = torch.from_numpy(huffman.decode_table_kernel(lengths)).to(dev)
        sent = self.sym[self.first.long()].reshape(-1)
        self.n_sent = sent.shape[0]
        self.esc = torch.nonzero((sent.int() & 0xFFFF) == ESCAPE_SYMBOL).reshape(-1)


def _stage_fns(blocks: list[_Block]) -> dict[str, Callable[[], object]]:
    """One closure per Triton stage, each running the stage over every quantized block."""
    from torchrec_lossy.kernels import huffman as k_huffman
    from torchrec_lossy.kernels import quantize as k_quantize
    from torchrec_lossy.kernels import vector_lz as k_vector_lz

    q = [b for b in blocks if b.sym is not None]

    def quantize() -> None:
        for b in q:
            p = b.params
            k_quantize.quantize(b.x, p.step, p.inv_step, p.center, b.bound, b.dtype_code)

    def dequantize() -> None:
        for b in q:
            k_quantize.dequantize(b.sym.reshape(-1), b.params.step, b.params.center)

    def dedupe() -> None:
        for b in q:
            k_vector_lz.dedupe(b.sym, b.bits)

    def histogram() -> None:
        for b in q:
            k_huffman.histogram_rows(b.sym, b.first)

    def pack_refs() -> None:
        for b in q:
            k_vector_lz.pack_refs(b.ids, b.n_unique, b.ref_mode)

    def encode() -> None:
        for b in q:
            k_huffman.encode(b.sym, b.first, b.lengths, b.codes, b.chunk)

    def decode() -> None:
        for b in q:
            k_huffman.decode(b.words, b.ends, b.n_sent, b.chunk, b.table, b.esc)

    return {
        "quantize + escapes + histogram": quantize,
        "dequantize": dequantize,
        "vector-LZ dedupe (1 sync/block)": dedupe,
        "histogram of distinct rows": histogram,
        "pack references": pack_refs,
        "Huffman encode, distinct rows (1 sync/block)": encode,
        "Huffman decode + escape check": decode,
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


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark.

    Args:
        argv: Command-line arguments (None: ``sys.argv``).

    Returns:
        The exit status: 0, or 2 when no CUDA device / triton is available.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="criteo_kaggle", choices=["criteo_kaggle", "criteo_1tb"])
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-rows", type=int, default=1024)
    p.add_argument("--chunk-symbols", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rep-ms", type=int, default=200, help="do_bench time budget per entry")
    p.add_argument("--json", default="out/gpu_codec_bench.json", help="where to write results")
    args = p.parse_args(argv)

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
    return 0 if out["payload_identical_to_cpu"] else 1


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
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from triton_stage_ops import TritonOps  # the stage-level oracle of the kernel tests

    from torchrec_lossy.codec import pipeline
    from torchrec_lossy.config import CodecConfig

    spec = TrafficSpec(preset=args.preset, dim=args.dim, batch_rows=args.batch_rows, seed=args.seed)
    cpu_blocks, bounds = paper_traffic(spec)
    raw_bytes = sum(b.numel() * 4 for b in cpu_blocks)
    config = CodecConfig(huffman_chunk_symbols=args.chunk_symbols)
    limit = pipeline.DEFAULT_MAX_ELEMENTS
    host = dataclasses.replace(config, backend="cpu")  # the compiled host path, off the device
    rows: list[dict[str, Any]] = []

    def record(group: str, name: str, fn: Callable[[], object]) -> None:
        ms = bench(fn)
        rows.append({"group": group, "name": name, "ms": ms, "gbps": raw_bytes / (ms * 1e-3) / 1e9})

    # Bit-exactness on this device first: the payload through TritonOps against CpuOps.
    dev_blocks = [b.to(dev) for b in cpu_blocks]
    triton_ops = TritonOps(dev)
    # label -> (encode, decode): stage by stage through TritonOps; the compiled host path (numba)
    codecs: dict[str, tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], object]]] = {
        "TritonOps": (
            lambda: pipeline.compress_staged(dev_blocks, bounds, config, triton_ops)[0],
            lambda p: pipeline.decompress_staged(p, limit, triton_ops),
        ),
        "numba host path": (
            lambda: pipeline.compress(dev_blocks, bounds, host),
            lambda p: pipeline.decompress(p, backend="cpu"),
        ),
    }
    payloads = {label: encode() for label, (encode, _) in codecs.items()}
    decoded = {label: [b.cpu() for b in codecs[label][1](p)] for label, p in payloads.items()}
    (pt, dt), (pc, dc) = ((payloads[k].cpu(), decoded[k]) for k in codecs)
    identical = bool(torch.equal(pt, pc)) and all(
        torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(dt, dc, strict=True)
    )
    device_payload = pipeline.compress(dev_blocks, bounds, config)
    device_decoded = [b.cpu() for b in pipeline.decompress(device_payload)]
    identical = (
        identical
        and bool(torch.equal(device_payload.cpu(), pc))
        and all(
            torch.equal(a.view(torch.int32), b.view(torch.int32))
            for a, b in zip(device_decoded, dc, strict=True)
        )
    )
    print(
        f"{args.preset} dim {args.dim}, {args.batch_rows} rows x {len(cpu_blocks)} tables = "
        f"{raw_bytes / 1e6:.2f} MB fp32 | ratio {raw_bytes / pt.numel():.2f} | "
        f"device-resident and TritonOps payloads byte-identical to the numba host path: {identical}"
    )

    blocks = [
        _Block(b, eb, args.chunk_symbols, dev) for b, eb in zip(cpu_blocks, bounds, strict=True)
    ]
    n_quant = sum(b.sym is not None for b in blocks)
    for name, fn in _stage_fns(blocks).items():
        record("triton stage", name, fn)
    record(
        "pipeline",
        "compress, device-resident",
        lambda: pipeline.compress(dev_blocks, bounds, config),
    )
    record("pipeline", "decompress, device-resident", lambda: pipeline.decompress(device_payload))
    for label, (encode, decode) in codecs.items():
        record("pipeline", f"compress, {label}", encode)
        record("pipeline", f"decompress, {label}", lambda p=payloads[label], d=decode: d(p))

    fns, notes = _baseline_fns(cpu_blocks, dev)
    for name, fn in fns.items():
        record("baseline", name, fn)

    notes = [
        f"{n_quant} of {len(blocks)} blocks quantize; the stages run over those",
        "GB/s = raw fp32 bytes of the whole batch / median seconds",
        "pipeline rows: device-resident compress (one sync) and decompress (two), then "
        "host-orchestrated ones "
        "(every TritonOps stage call copies in and out)",
        *notes,
    ]
    print(f"{'group':<13} {'entry':<46} {'ms':>9} {'GB/s':>9}")
    for r in rows:
        print(f"{r['group']:<13} {r['name']:<46} {r['ms']:>9.4f} {r['gbps']:>9.2f}")
    for n in notes:
        print(f"note: {n}")
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": vars(args),
        "raw_bytes": raw_bytes,
        "payload_bytes": int(pt.numel()),
        "payload_identical_to_cpu": identical,
        "rows": rows,
        "notes": notes,
    }


if __name__ == "__main__":
    sys.exit(main())
