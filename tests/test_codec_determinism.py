"""Determinism (same bytes every time, in any process) and the torch reference backend's bytes."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import as_tensor, parse, with_checksum

from torchrec_lossy.codec import (
    CodecConfig,
    CodecError,
    compress,
    compress_with_stats,
    decompress,
    host_decompress,
)

HERE = Path(__file__).resolve().parent
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def catalogue() -> tuple[list[torch.Tensor], list[float]]:
    """Small blocks reaching every mode, both reference packings, escapes and every dtype."""
    g = torch.Generator().manual_seed(2024)
    few = torch.randn(5, 12, generator=g)
    few[2, 3] = math.nan
    many = torch.randn(60, 8, generator=g)
    gauss = torch.randn(40, 16, generator=g)
    gauss[3, 3], gauss[7, 1], gauss[9, 9] = math.inf, -60.0, 55.0  # escapes
    ids = torch.randint(0, 5, (70,), generator=g)
    bits = torch.randint(-(2**31), 2**31 - 1, (6, 7), generator=g, dtype=torch.int32)
    blocks, bounds = [], []
    for dtype in DTYPES:
        blocks += [
            gauss.to(dtype),  # quant
            few[ids].to(dtype),  # quant+lz, fixed refs
            torch.cat([many, many[:5]]).to(dtype),  # quant+lz, flagged refs
            few[ids].to(dtype),  # lz, fixed refs (bound 0)
            torch.cat([many, many[:5]]).to(dtype),  # lz, flagged refs (bound 0)
            torch.zeros(0, 3, dtype=dtype),
            torch.zeros(2, 0, dtype=dtype),
            torch.ones(1, 5, dtype=dtype),
        ]
        bounds += [0.01, 0.02, 0.05, 0.0, 0.0, 0.1, 0.1, 0.1]
    blocks.append(bits.view(torch.float32))  # raw
    bounds.append(0.0)
    return blocks, bounds


CONFIGS = {
    "default": CodecConfig(),
    "chunk64": CodecConfig(huffman_chunk_symbols=64),
    "no_lz": CodecConfig(enable_lz=False, huffman_chunk_symbols=96),
}


def payload_digest(config_name: str) -> str:
    blocks, bounds = catalogue()
    payload = compress(blocks, bounds, CONFIGS[config_name])
    return hashlib.sha256(payload.numpy().tobytes()).hexdigest()


def test_catalogue_reaches_every_mode():
    blocks, bounds = catalogue()
    _, stats = compress_with_stats(blocks, bounds, CONFIGS["chunk64"])
    assert {s.mode for s in stats} == {"raw", "lz", "quant", "quant+lz"}
    assert any(s.n_escapes for s in stats if s.mode == "quant")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_input_same_bytes_in_process(name):
    blocks, bounds = catalogue()
    first = compress(blocks, bounds, CONFIGS[name])
    for _ in range(2):
        again = compress([b.clone() for b in blocks], list(bounds), CONFIGS[name])
        assert torch.equal(first, again)
    # and decoding is deterministic too
    a, b = decompress(first), decompress(first.clone())
    assert all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def test_same_bytes_in_a_fresh_process():
    want = {name: payload_digest(name) for name in CONFIGS}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_codec_determinism as t; "
        "print(json.dumps({n: t.payload_digest(n) for n in t.CONFIGS}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(HERE)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == want


def test_auto_backend_is_the_cpu_backend():
    blocks, bounds = catalogue()
    auto = compress(blocks, bounds, CodecConfig(backend="auto"))
    cpu = compress(blocks, bounds, CodecConfig(backend="cpu"))
    assert torch.equal(auto, cpu)


@pytest.mark.parametrize("chunk", [64, 2048])
def test_reference_backend_produces_identical_bytes(chunk):
    blocks, bounds = catalogue()
    cpu, cpu_stats = compress_with_stats(
        blocks, bounds, CodecConfig(backend="cpu", huffman_chunk_symbols=chunk)
    )
    ref, ref_stats = compress_with_stats(
        blocks, bounds, CodecConfig(backend="reference", huffman_chunk_symbols=chunk)
    )
    assert cpu_stats == ref_stats
    assert torch.equal(cpu, ref)


@pytest.mark.parametrize("chunk", [64, 2048])
def test_batched_decode_matches_reference_decode(chunk):
    """The batched CPU reader (one compiled call over all segments) gives the per-block
    reference decoder's bits for every mode, packing, dtype, escape and empty block."""
    blocks, bounds = catalogue()
    payload = compress(blocks, bounds, CodecConfig(huffman_chunk_symbols=chunk))
    cpu = decompress(payload, backend="cpu")
    ref = decompress(payload, backend="reference")
    assert len(cpu) == len(ref) == len(blocks)
    for c, r, b in zip(cpu, ref, blocks, strict=True):
        assert c.dtype == r.dtype == b.dtype and c.shape == r.shape == b.shape
        assert torch.equal(c.view(torch.uint8), r.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_batched_decode_takes_quantized_blocks_of_every_dtype(dtype):
    """No dtype's quantized block leaves the compiled batched reader for the per-block path."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    payload, stats = compress_with_stats([x], [0.01], CodecConfig(backend="cpu"))
    assert stats[0].mode == "quant"
    words = payload.numpy().view(np.uint32)
    batch = host_decompress.decompress_payloads(words, np.array([0, payload.numel()]), 1 << 30)
    assert batch.complete(0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_reference_backend_identical_on_adversarial_values(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(30, 9, generator=g) * 5
    fi = torch.finfo(dtype)
    x.view(-1)[::7] = torch.tensor(
        [math.nan, math.inf, -math.inf, 1e30, float(fi.max), float(fi.tiny) / 4, -0.0, 0.0]
    ).repeat(6)[: x.view(-1)[::7].numel()]
    x = x.to(dtype)
    x = torch.cat([x, x[:10]])
    for bound in (0.0, 1e-3, 0.05, 1.0, 1e30):
        cfg = dict(huffman_chunk_symbols=64)
        cpu = compress([x], [bound], CodecConfig(backend="cpu", **cfg))
        ref = compress([x], [bound], CodecConfig(backend="reference", **cfg))
        assert torch.equal(cpu, ref), bound
        # The batched reader (bfloat16 rounding included) decodes them as the reference does.
        got = decompress(cpu, backend="cpu")[0]
        want = decompress(cpu, backend="reference")[0]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), bound


# ---------------------------------------------------------------------------------------------
# The reference backend's decoder on corrupt payloads (its stages: the kernels' torch twins)


def _decode(payload: torch.Tensor, backend: str) -> list[torch.Tensor] | str:
    try:
        return decompress(payload, backend=backend)
    except CodecError as e:
        return str(e)


def test_reference_backend_fails_like_cpu():
    """Bit flips in the segments (checksum fixed up so decoding is reached) give the same
    blocks or the same CodecError message on the reference backend as on the compiled CPU
    path, Huffman stream errors among them."""
    blocks, bounds = catalogue()
    payload = compress(blocks, bounds, CONFIGS["chunk64"])
    rng = np.random.default_rng(5)
    messages = []
    for _ in range(24):
        _, _, segs = parse(payload.numpy().tobytes())
        off, length = segs[int(rng.integers(len(segs)))]
        if length <= 32:
            continue
        buf = bytearray(payload.numpy().tobytes())
        buf[off + 32 + int(rng.integers(length - 32))] ^= 1 << int(rng.integers(8))
        corrupt = as_tensor(with_checksum(bytes(buf)))
        want, got = _decode(corrupt, "cpu"), _decode(corrupt, "reference")
        if isinstance(want, str):
            assert got == want
            messages.append(want)
        else:
            assert not isinstance(got, str), got
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert any("Huffman stream" in m for m in messages), messages
