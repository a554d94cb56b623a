"""The golden payload corpus: today's modes encoded once, checked in, compared on every run.

The codec (pooled blocks, every dtype, mode, reference packing, rounding and bound kind) and the
lossless KJT input codec (every feature case, both backends, every input-dist option) are
encoded here from fixed inputs. ``payloads.npz`` holds what main produced when the corpus was
made; ``tests/test_golden_payloads.py`` fails when today's code writes other bytes or decodes
the stored bytes to other values. Regenerate only for an intended format change:
``python tests/golden/corpus.py`` (then say so in the commit); ``--append`` adds the entries of
new producers and keeps every stored one as it is.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from torchrec_lossy.codec import (
    BoundKind,
    CodecConfig,
    compress,
    compress_groups,
    compress_with_stats,
    decompress,
)
from torchrec_lossy.config import InputDistConfig

PATH = Path(__file__).with_name("payloads.npz")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def codec_blocks() -> tuple[list[torch.Tensor], list[float]]:
    """Blocks reaching every mode, both reference packings, escapes, specials and every dtype."""
    g = torch.Generator().manual_seed(2026)
    gauss = torch.randn(40, 16, generator=g)
    gauss[3, 3], gauss[7, 1], gauss[9, 9], gauss[11, 2] = math.inf, -60.0, 55.0, math.nan
    few = torch.randn(5, 12, generator=g)
    few[2, 3] = math.nan
    ids = torch.randint(0, 5, (70,), generator=g)
    many = torch.randn(60, 8, generator=g)
    skewed = torch.randn(33, 24, generator=g) * torch.logspace(-4, 2, 24)
    bits = torch.randint(-(2**31), 2**31 - 1, (6, 7), generator=g, dtype=torch.int32)
    blocks: list[torch.Tensor] = []
    bounds: list[float] = []
    for dtype in DTYPES:
        blocks += [
            gauss.to(dtype),  # quant with escapes
            few[ids].to(dtype),  # quant+lz, fixed refs
            torch.cat([many, many[:5]]).to(dtype),  # quant+lz, flagged refs
            few[ids].to(dtype),  # lz, fixed refs (bound 0)
            torch.cat([many, many[:5]]).to(dtype),  # lz, flagged refs (bound 0)
            skewed.to(dtype),  # wide dynamic range
            torch.zeros(0, 3, dtype=dtype),
            torch.zeros(2, 0, dtype=dtype),
            torch.ones(1, 5, dtype=dtype),
            torch.zeros(4, 4, dtype=dtype),
        ]
        bounds += [0.01, 0.02, 0.05, 0.0, 0.0, 0.003, 0.1, 0.1, 0.1, 0.1]
    blocks.append(bits.view(torch.float32))  # raw
    bounds.append(0.0)
    return blocks, bounds


CODEC_CONFIGS = {
    "default": CodecConfig(),
    "chunk64": CodecConfig(huffman_chunk_symbols=64),
    "no_lz": CodecConfig(enable_lz=False, huffman_chunk_symbols=96),
    "no_quant": CodecConfig(enable_quantization=False),
    "stochastic": CodecConfig(rounding="stochastic", seed=11),
    "stochastic_seed3": CodecConfig(rounding="stochastic", seed=3, huffman_chunk_symbols=128),
}


def _grouped(config: CodecConfig) -> bytes:
    """Three destinations' payloads in one call, bounds relative to each block's range."""
    blocks, _ = codec_blocks()
    groups = [blocks[0:4], blocks[4:9], blocks[9:21]]
    fractions = [[0.03] * len(g) for g in groups]
    fractions[1][1] = 0.0
    out = compress_groups(groups, fractions, config, kinds=True)
    return out.buffer.cpu().numpy().tobytes()


# The per-value bound (descriptor mode bit 2), appended after the corpus was made.
VALUE_CONFIGS = {
    "default": CodecConfig(),
    "no_lz": CodecConfig(enable_lz=False, huffman_chunk_symbols=96),
}


def value_payload(config: CodecConfig) -> bytes:
    """The codec blocks under per-value bounds (4x each block's bound, at most 0.5)."""
    blocks, bounds = codec_blocks()
    values = [min(4.0 * b, 0.5) for b in bounds]
    kinds = [BoundKind.VALUE] * len(blocks)
    return compress_with_stats(blocks, values, config, kinds)[0].numpy().tobytes()


# The packed format (CodecConfig.format "packed", descriptor mode bit 3), appended after the
# corpus was made: the codec blocks, per-value bounds and the grouped call.
PACKED_CONFIGS = {
    "default": CodecConfig(format="packed"),
    "no_lz": CodecConfig(format="packed", enable_lz=False),
    "stochastic": CodecConfig(format="packed", rounding="stochastic", seed=11),
}


def _packed_entries() -> dict[str, Callable[[], bytes]]:
    """Name -> producer of the packed format's entries."""
    out: dict[str, Callable[[], bytes]] = {}
    for name, config in PACKED_CONFIGS.items():
        out[f"packed/codec/{name}"] = lambda c=config: (
            compress(*codec_blocks(), c).numpy().tobytes()
        )
        out[f"packed/grouped/{name}"] = lambda c=config: _grouped(c)
    out["packed/value/default"] = lambda: value_payload(PACKED_CONFIGS["default"])
    return out


def _value_grouped() -> bytes:
    """Two destinations mixing every bound kind in one call."""
    blocks, _ = codec_blocks()
    groups = [blocks[0:6], blocks[10:16]]
    kinds = [[BoundKind.VALUE, BoundKind.RELATIVE, BoundKind.ABSOLUTE] * 2] * 2
    values = [[0.03, 0.03, 0.01] * 2] * 2
    return compress_groups(groups, values, CodecConfig(), kinds).buffer.numpy().tobytes()


def _kjt_cases() -> Iterator[tuple[str, object, list[int]]]:
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(5)
    keys = ["a", "b", "c", "d", "e"]
    batch = 16
    for case in ("multi_hot", "single_hot", "weighted", "wide", "empty", "int32"):
        lengths = (
            torch.ones(5 * batch, dtype=torch.int64)
            if case == "single_hot"
            else torch.randint(0, 5, (5 * batch,), generator=g)
        )
        if case == "empty":
            lengths[: 2 * batch] = 0
        n = int(lengths.sum())
        values = (torch.rand(n, generator=g) ** 3 * 1000).long()
        if case == "wide":
            values = values * (2**30) + (2**40 - 1) * (torch.rand(n, generator=g) < 0.3)
        weights = torch.randn(n, generator=g) if case == "weighted" else None
        dtype = torch.int32 if case == "int32" else torch.int64
        kjt = KeyedJaggedTensor(
            keys=keys, values=values.to(dtype), lengths=lengths.to(dtype), weights=weights
        )
        yield case, kjt, [2, 3]


KJT_CONFIGS = {
    "default": (InputDistConfig(), None),
    "no_dedupe": (InputDistConfig(dedupe=False, checksum=False), None),
    "fp16_weights": (InputDistConfig(weights="fp16"), None),
    "exact_outputs": (InputDistConfig(), "exact"),
    "lookup": (InputDistConfig(dedupe_lookups=True), "lookup"),
}


def _kjt_words(kjt: object, splits: list[int], name: str, backend: str) -> bytes:
    from torchrec_lossy.distributed.kjt_codec import encode_kjt

    config, output_dedupe = KJT_CONFIGS[name]
    enc = encode_kjt(kjt, splits, config, output_dedupe, backend=backend)  # type: ignore[arg-type]
    meta = enc.meta.to(torch.int64).numpy().tobytes()
    return enc.send.numpy().tobytes() + b"|" + meta + b"|" + enc.formats.tobytes()


def producers() -> dict[str, Callable[[], bytes]]:
    """Name -> the bytes today's code writes for that corpus entry."""
    out: dict[str, Callable[[], bytes]] = {}
    for name, config in CODEC_CONFIGS.items():
        out[f"codec/{name}"] = lambda c=config: compress(*codec_blocks(), c).numpy().tobytes()
        out[f"grouped/{name}"] = lambda c=config: _grouped(c)
    for name, config in VALUE_CONFIGS.items():
        out[f"value/{name}"] = lambda c=config: value_payload(c)
    out["value_grouped/mixed"] = _value_grouped
    out.update(_packed_entries())
    for case, kjt, splits in _kjt_cases():
        for name in KJT_CONFIGS:
            for backend in ("torch", "numba"):
                out[f"kjt/{case}/{name}/{backend}"] = lambda k=kjt, s=splits, n=name, b=backend: (
                    _kjt_words(k, s, n, b)
                )
    return out


def decoded_digest(payload: bytes) -> str:
    """sha256 over the bits of every block the codec decodes from ``payload``."""
    blocks = decompress(torch.from_numpy(np.frombuffer(payload, np.uint8).copy()))
    h = hashlib.sha256()
    for b in blocks:
        h.update(str((tuple(b.shape), b.dtype)).encode())
        h.update(b.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load() -> dict[str, bytes]:
    """The checked-in corpus: name -> bytes (plus ``digest/<codec name>`` of decoded blocks)."""
    with np.load(PATH) as z:
        return {k: z[k].tobytes() for k in z.files}


def main(append: bool = False) -> int:
    """Writes the corpus; ``append``: only the entries missing from it (the rest kept)."""
    entries = load() if append else {}
    for name, make in producers().items():
        if name not in entries:
            entries[name] = make()
    for name in CODEC_CONFIGS:
        entries.setdefault(f"digest/{name}", decoded_digest(entries[f"codec/{name}"]).encode())
    for name in VALUE_CONFIGS:
        entries.setdefault(
            f"digest/value/{name}", decoded_digest(entries[f"value/{name}"]).encode()
        )
    for name in [*(f"codec/{n}" for n in PACKED_CONFIGS), "value/default"]:
        entries.setdefault(
            f"digest/packed/{name}", decoded_digest(entries[f"packed/{name}"]).encode()
        )
    np.savez_compressed(PATH, **{k: np.frombuffer(v, np.uint8) for k, v in entries.items()})
    print(f"wrote {len(entries)} entries to {PATH} ({PATH.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(append="--append" in sys.argv[1:]))
