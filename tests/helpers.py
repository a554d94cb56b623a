"""Helpers shared by several codec test modules (plain functions: some feed ``parametrize``).

- Valid payloads and their layout: :func:`corpus`, :func:`parse`, :func:`with_checksum`,
  :func:`as_tensor`; edits of a payload for the fuzz tests: :func:`field_positions`,
  :func:`interesting_values`, :func:`set_field`, :func:`apply_mutation`.
- Test blocks: :func:`make_block` (adversarial, mild or repeated data in any dtype),
  :func:`bound_for` (an absolute bound of a named kind), ``DTYPES``, ``SPECIALS``.
- The kernel tests' device and warnings: ``DEVICE``, ``INTERPRETER_WARNINGS``.
- CUDA sync checks: :func:`cuda_syncs_only_in_to_host`.

Fixtures live in ``conftest.py``; test modules import from here, never from each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import numpy as np
import pytest
import torch

from torchrec_lossy.codec import CodecConfig, compress_with_stats, host_sync
from torchrec_lossy.codec.format import (
    DESCRIPTOR,
    HEADER,
    MODE_RAW,
    SEGMENT_HEADER,
    checksum_words,
)

# ---------------------------------------------------------------------------------------------
# Payloads


def repeated_rows(base: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return base[torch.randint(0, base.shape[0], (rows,), generator=g)]


@cache
def corpus() -> tuple[tuple[str, bytes], ...]:
    """Valid payloads; every mode, both reference packings, escapes, several chunks."""
    g = torch.Generator().manual_seed(7)
    cfg = CodecConfig(huffman_chunk_symbols=64)
    gauss = torch.randn(48, 12, generator=g)
    outliers = gauss.clone()
    outliers[3, 4], outliers[10, 0], outliers[40, 11] = math.nan, 1e30, -math.inf
    few = torch.randn(4, 10, generator=g)
    few[1, 2] = math.nan
    many = torch.randn(90, 8, generator=g)
    flagged = torch.cat([many, many[:6]])  # mostly distinct rows: flagged references
    raw = torch.randint(-(2**31), 2**31 - 1, (6, 5), generator=g, dtype=torch.int32)
    raw = raw.view(torch.float32)
    specs = {
        "quant": ([gauss], [0.02]),
        "quant_escapes": ([outliers], [0.02]),
        "quant_lz_fixed": ([repeated_rows(few, 60, 1)], [0.01]),
        "quant_lz_flagged": ([flagged], [0.05]),
        "lz_fixed": ([repeated_rows(few.half(), 40, 2)], [0.0]),
        "lz_flagged": ([flagged.bfloat16()], [0.0]),
        "raw": ([raw], [0.0]),
        "fp16_quant": ([gauss.half()], [0.01]),
        "bf16_quant_lz": ([repeated_rows(few.bfloat16(), 50, 3)], [0.02]),
        "degenerate": ([torch.zeros(0, 4), torch.zeros(3, 0), torch.ones(1, 1)], [0.1, 0.1, 0.1]),
        "multi": (
            [
                gauss[:20].half(),
                repeated_rows(few, 30, 4),
                raw,
                repeated_rows(few.bfloat16(), 25, 5),
                outliers[:16],
            ],
            [0.01, 0.02, 0.0, 0.0, 0.05],
        ),
    }
    out = []
    for name, (blocks, bounds) in specs.items():
        payload, _ = compress_with_stats(blocks, bounds, cfg)
        out.append((name, payload.numpy().tobytes()))
    return tuple(out)


def parse(buf: bytes) -> tuple[np.void, np.ndarray, list[tuple[int, int]]]:
    """(header, descriptors, (byte offset, byte length) of each segment) of a valid layout."""
    header = np.frombuffer(buf[:32], HEADER)[0]
    n = int(header["n_blocks"])
    descs = np.frombuffer(buf[32 : 32 + 24 * n], DESCRIPTOR)
    segs, pos = [], 32 + 24 * n
    for d in descs:
        segs.append((pos, 4 * int(d["seg_words"])))
        pos += 4 * int(d["seg_words"])
    return header, descs, segs


def with_checksum(buf: bytearray | bytes, fix_length: bool = True) -> bytes:
    """``buf`` with body_words (if asked) and the checksum rewritten to match its body."""
    b = bytearray(buf)
    body_len = len(b) - 32
    assert body_len % 4 == 0
    header = np.frombuffer(bytes(b[:32]), HEADER).copy()
    if fix_length:
        header["body_words"] = body_len // 4
    header["checksum"] = checksum_words(np.frombuffer(bytes(b[32:]), np.uint32))
    b[:32] = header.tobytes()
    return bytes(b)


def as_tensor(buf: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(buf, np.uint8).copy())


INTERESTING_U32 = [0, 1, 2, 3, 7, 31, 32, 33, 63, 64, 65, 255, 4094, 4095, 4096, 65535, 65536,
                    2**24, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]  # fmt: skip


def field_positions(buf: bytes) -> list[tuple[int, str, np.dtype]]:
    """(byte offset, field name, field dtype) of every descriptor and segment header field."""
    _, descs, segs = parse(buf)
    out = []
    for i, d in enumerate(descs):
        base = 32 + 24 * i
        for name in DESCRIPTOR.names:
            dt, off = DESCRIPTOR.fields[name][:2]
            out.append((base + off, f"desc.{name}", dt))
        if int(d["mode"]) != MODE_RAW and segs[i][1] >= 32:
            for name in SEGMENT_HEADER.names:
                dt, off = SEGMENT_HEADER.fields[name][:2]
                out.append((segs[i][0] + off, f"seg.{name}", dt))
    return out


def interesting_values(dt: np.dtype, current: int | float) -> list[int | float]:
    if dt.kind == "f":
        return [0.0, -0.0, -1.0, 1e-45, 1e-40, 1.0, 3.4e38, math.inf, -math.inf, math.nan]
    bits = 8 * dt.itemsize
    vals = {v % (1 << bits) for v in INTERESTING_U32}
    vals |= {(int(current) + d) % (1 << bits) for d in (-2, -1, 1, 2)}
    if dt.kind == "i":
        vals = {v - (1 << bits) if v >= 1 << (bits - 1) else v for v in vals}
    return sorted(vals)


def set_field(buf: bytes, off: int, dt: np.dtype, value: int | float) -> bytes:
    b = bytearray(buf)
    b[off : off + dt.itemsize] = np.array(value, dtype=dt).tobytes()
    return bytes(b)


def apply_mutation(buf: bytes, mutation: tuple[str, int, int]) -> bytes:
    """One edit of the body (bytes 32..), keeping it a whole number of words."""
    kind, a, b = mutation
    head, body = bytearray(buf[:32]), bytearray(buf[32:])
    n_words = len(body) // 4
    if n_words == 0:
        return bytes(head + body + b"\x01\x00\x00\x00")
    if kind == "flip":
        body[a % len(body)] ^= 1 << b
    elif kind == "byte":
        body[a % len(body)] = b
    elif kind == "word":
        w = a % n_words
        body[4 * w : 4 * w + 4] = b.to_bytes(4, "little")
    elif kind == "delete":
        w = a % n_words
        del body[4 * w : 4 * (w + b)]
    elif kind == "insert":
        w = a % (n_words + 1)
        body[4 * w : 4 * w] = (a & 0xFFFFFFFF).to_bytes(4, "little") * b
    elif kind == "swap":
        i, j = a % n_words, b % n_words
        wi, wj = body[4 * i : 4 * i + 4], body[4 * j : 4 * j + 4]
        body[4 * i : 4 * i + 4], body[4 * j : 4 * j + 4] = wj, wi
    else:  # zero_tail
        w = a % n_words
        body[4 * w :] = bytes(len(body) - 4 * w)
    return bytes(head + body)


# ---------------------------------------------------------------------------------------------
# Blocks

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAN_PAYLOAD = np.array([0x7FC01234], dtype=np.uint32).view(np.float32)[0]
SPECIALS = [
    float("nan"),
    float(NAN_PAYLOAD),
    float("inf"),
    float("-inf"),
    1e30,
    -3e38,
    65504.0,
    65519.0,
    65520.0,
    -0.0,
    1e-45,
    3e-8,
    6.1e-5,
]


def make_block(rows: int, dim: int, dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    """Test data: ``"adversarial"`` (specials, outliers, subnormals on 1/6 of the elements),
    ``"mild"`` (the same on 1/40) or ``"repeat"``.

    ``"repeat"`` has few distinct rows repeated many times, some with escaped elements whose raw
    bits differ between otherwise identical rows (same symbols, different keys).
    """
    gen = torch.Generator().manual_seed(seed)
    if kind in ("adversarial", "mild"):
        x = torch.randn(rows, dim, generator=gen) * 0.05 + 0.3
        flat = x.view(-1)
        if flat.numel():
            share = 6 if kind == "adversarial" else 40
            # "mild": no huge finite outliers, which would stretch the range past quantizing
            specials = [v for v in SPECIALS if kind == "adversarial" or not abs(v) >= 1]
            pos = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // share)]
            for k, p in enumerate(pos.tolist()):
                flat[p] = specials[k % len(specials)]
    else:
        n_base = max(1, rows // 8)
        base = torch.randn(n_base, dim, generator=gen) * 0.05
        base[0, -1] = float("nan")
        x = base[torch.randint(0, n_base, (rows,), generator=gen)].clone()
        if rows > 3:  # copies of row 0, one whose NaN carries other bits: same symbols only
            x[0] = x[1] = x[rows // 2] = base[0]
            x[rows // 2, -1] = float(NAN_PAYLOAD)
    return x.to(dtype)


def bound_for(block: torch.Tensor, kind: str) -> float:
    """An absolute bound of the given kind for a block."""
    x = block.double()
    fin = x[torch.isfinite(x)]
    span = float(fin.max() - fin.min()) if fin.numel() else 0.0
    span = span if 0 < span < 1e30 else 1.0
    return {
        "zero": 0.0,
        "tiny": 1e-6 * span,
        "rel0.01": 0.01 * span,
        "rel0.05": 0.05 * span,
        "huge": 1e30,
    }[kind]


# ---------------------------------------------------------------------------------------------
# Kernel tests

# Where the device path runs: the GPU, else CPU tensors in the Triton interpreter (conftest.py
# switches it on before any test module imports triton).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# The interpreter evaluates float casts of lanes the kernels then mask away (inf - inf, NaN)
# with numpy, which warns: kernel test modules set ``pytestmark = INTERPRETER_WARNINGS``.
INTERPRETER_WARNINGS = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# ---------------------------------------------------------------------------------------------
# CUDA sync checks


@contextmanager
def cuda_syncs_only_in_to_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Runs the block under CUDA sync debug mode "error", allowing syncs only inside
    :func:`torchrec_lossy.codec.host_sync.to_host` (the codec's one device-to-host read).

    Args:
        monkeypatch: The test's monkeypatch fixture (it restores ``to_host`` after the test).
    """
    real = host_sync.to_host

    def allowed(*args: object, **kwargs: object) -> np.ndarray:
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(host_sync, "to_host", allowed)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
