"""Wire format and exact sizes: header, descriptors, segment headers, byte counts, mode choice."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
import torch

from torchrec_lossy.codec import CodecConfig, compress, compress_with_stats, decompress
from torchrec_lossy.codec.container import checksum
from torchrec_lossy.codec.format import (
    DESCRIPTOR,
    DESCRIPTOR_WORDS,
    DTYPE_CODES,
    HEADER,
    MAGIC,
    MODE_LZ,
    MODE_NAMES,
    MODE_QUANT,
    MODE_QUANT_LZ,
    MODE_RAW,
    REFS_FIXED,
    REFS_FLAGGED,
    SEGMENT_BAD_STREAM,
    SEGMENT_HEADER,
    SEGMENT_HEADER_WORDS,
    SEGMENT_REFS_RANGE,
    VERSION,
    checksum_words,
    read_segment_header,
    ref_width,
    refs_bits,
    refs_packing,
    segment_checks,
    segment_header_fields,
    segment_header_words,
    segment_layout,
    write_segment_header,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAME_TO_MODE = {v: k for k, v in MODE_NAMES.items()}
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def parse(payload: torch.Tensor):
    """(header, descriptors, segments as uint8 arrays, segment headers or None)."""
    buf = payload.numpy().tobytes()
    header = np.frombuffer(buf[:32], HEADER)[0]
    n = int(header["n_blocks"])
    descs = np.frombuffer(buf[32 : 32 + 24 * n], DESCRIPTOR)
    segs, seg_headers, pos = [], [], 32 + 24 * n
    for d in descs:
        seg = np.frombuffer(buf[pos : pos + 4 * int(d["seg_words"])], np.uint8)
        segs.append(seg)
        seg_headers.append(
            np.frombuffer(seg[:32].tobytes(), SEGMENT_HEADER)[0] if d["mode"] else None
        )
        pos += 4 * int(d["seg_words"])
    assert pos == len(buf)
    return header, descs, segs, seg_headers


def raw_wire_bytes(rows: int, dim: int, itemsize: int) -> int:
    return 24 + 4 * math.ceil(rows * dim * itemsize / 4)


def random_bits(rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of random bit patterns (distinct with overwhelming probability)."""
    width = 8 * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 1 << width, (rows, dim), generator=gen(seed), dtype=torch.int64)
    raw = raw - (1 << width) * (raw >= 1 << (width - 1))
    int_dtype = torch.int32 if width == 32 else torch.int16
    return raw.to(int_dtype).view(dtype)


def mixed_blocks() -> tuple[list[torch.Tensor], list[float]]:
    g = gen(0)
    few = torch.randn(5, 16, generator=g)
    blocks = [
        torch.randn(100, 24, generator=g),
        few[torch.randint(0, 5, (300,), generator=g)].half(),
        random_bits(9, 7, torch.bfloat16, 1),
        torch.randn(1, 16, generator=g).repeat(40, 1),
        torch.zeros(0, 8),
        torch.zeros(4, 0, dtype=torch.float16),
        torch.randn(3, 5, generator=g).bfloat16(),
    ]
    bounds = [0.01, 0.02, 0.0, 0.0, 0.1, 0.1, 0.5]
    return blocks, bounds


# ---------------------------------------------------------------------------------------------
# Header and descriptors


def test_header_fields():
    blocks, bounds = mixed_blocks()
    payload = compress(blocks, bounds)
    header, _, _, _ = parse(payload)
    assert int(header["magic"]) == MAGIC == 0x434C5254
    assert payload[:4].numpy().tobytes() == b"TRLC"
    assert int(header["version"]) == VERSION == 1
    assert int(header["flags"]) == 0 and int(header["reserved"]) == 0
    assert int(header["n_blocks"]) == len(blocks)
    assert payload.numel() == 32 + 4 * int(header["body_words"])
    body = payload[32:].numpy().view(np.uint32)
    assert int(header["checksum"]) == int(checksum_words(body))
    assert int(header["checksum"]) == int(checksum(torch.from_numpy(body.view(np.int32)))) & (
        2**64 - 1
    )


def test_descriptor_fields_match_the_blocks_and_stats():
    blocks, bounds = mixed_blocks()
    payload, stats = compress_with_stats(blocks, bounds)
    _, descs, segs, _ = parse(payload)
    for x, b, d, s, seg in zip(blocks, bounds, descs, stats, segs, strict=True):
        assert (int(d["rows"]), int(d["dim"])) == tuple(x.shape) == (s.rows, s.dim)
        assert int(d["dtype"]) == DTYPE_CODES[x.dtype]
        assert int(d["mode"]) == NAME_TO_MODE[s.mode]
        assert int(d["reserved"]) == 0
        assert float(d["bound"]) == b == s.bound
        assert s.wire_bytes == 24 + seg.shape[0] == 24 + 4 * int(d["seg_words"])
        assert s.raw_bytes == x.numel() * x.element_size()


def test_payload_length_is_header_plus_wire_bytes():
    blocks, bounds = mixed_blocks()
    for cfg in (
        CodecConfig(),
        CodecConfig(huffman_chunk_symbols=64),
        CodecConfig(enable_lz=False),
        CodecConfig(enable_quantization=False),
    ):
        payload, stats = compress_with_stats(blocks, bounds, cfg)
        assert payload.numel() == 32 + sum(s.wire_bytes for s in stats)
        assert payload.numel() % 4 == 0


def test_empty_payload_is_just_a_header():
    payload = compress([], [])
    header, *_ = parse(payload)
    assert payload.numel() == 32 and int(header["body_words"]) == 0
    assert int(header["checksum"]) == 0


# ---------------------------------------------------------------------------------------------
# Raw blocks


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 3), (5, 7), (2, 33), (1, 1001), (0, 5), (5, 0)])
def test_raw_block_wire_bytes(dtype, shape):
    rows, dim = shape
    x = random_bits(rows, dim, dtype, seed=rows * 100 + dim)
    itemsize = x.element_size()
    for cfg, bound in (
        (CodecConfig(enable_quantization=False, enable_lz=False), 0.5),
        (CodecConfig(), 0.0),  # distinct random rows at bound 0: raw is the only sensible mode
    ):
        payload, stats = compress_with_stats([x], [bound], cfg)
        assert stats[0].mode == "raw"
        assert stats[0].wire_bytes == raw_wire_bytes(rows, dim, itemsize)
        assert stats[0].n_unique == rows and stats[0].n_escapes == 0
        assert stats[0].max_error == 0.0
        _, _, segs, _ = parse(payload)
        n = rows * dim * itemsize
        assert segs[0][:n].tobytes() == x.contiguous().view(torch.uint8).numpy().tobytes()
        assert not segs[0][n:].any(), "padding must be zero bytes"
        assert torch.equal(decompress(payload)[0].view(torch.uint8), x.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# Lossless vector-LZ


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("rows", "dim"), [(2, 64), (50, 7), (1000, 3), (40, 1)])
def test_identical_rows_at_bound_zero_use_lz(dtype, rows, dim):
    x = random_bits(1, dim, dtype, seed=dim).repeat(rows, 1)
    payload, stats = compress_with_stats([x], [0.0])
    s = stats[0]
    assert s.mode == "lz" and s.n_unique == 1 and s.max_error == 0.0
    # descriptor + segment header + 0-bit references + one vector
    assert s.wire_bytes == 24 + 32 + 4 * math.ceil(dim * x.element_size() / 4)
    _, _, _, (sh,) = parse(payload)
    assert int(sh["n_unique"]) == 1
    assert int(sh["ref_mode"]) == REFS_FIXED and int(sh["ref_width"]) == 0
    assert torch.equal(decompress(payload)[0].view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize(
    ("distinct", "rows"), [(2, 64), (3, 64), (40, 45), (100, 130), (200, 210)], ids=str
)
def test_lz_wire_bytes_and_packing(distinct, rows):
    base = random_bits(distinct, 6, torch.float16, seed=distinct)
    ids = torch.cat([torch.arange(distinct), torch.randint(0, distinct, (rows - distinct,))])
    ids = ids[torch.randperm(rows, generator=gen(rows))]
    x = base[ids]
    payload, stats = compress_with_stats([x], [0.0])
    s = stats[0]
    assert s.mode == "lz" and s.n_unique == distinct
    mode = int(refs_packing(rows, distinct)[0])
    assert s.wire_bytes == 24 + 32 + 4 * math.ceil(refs_bits(rows, distinct, mode) / 32) + 4 * (
        math.ceil(distinct * 6 * 2 / 4)
    )
    _, _, _, (sh,) = parse(payload)
    assert (int(sh["ref_mode"]), int(sh["ref_width"])) == (mode, ref_width(distinct))
    assert torch.equal(decompress(payload)[0].view(torch.int16), x.view(torch.int16))


def test_both_reference_packings_are_chosen():
    assert int(refs_packing(64, 2)[0]) == REFS_FIXED
    assert int(refs_packing(210, 200)[0]) == REFS_FLAGGED
    # FIXED wins ties
    assert refs_bits(2, 2, REFS_FIXED) == 2 and refs_bits(2, 2, REFS_FLAGGED) == 2
    assert int(refs_packing(2, 2)[0]) == REFS_FIXED


# ---------------------------------------------------------------------------------------------
# Quantized modes


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_heavy_repetition_uses_quant_lz(dtype):
    g = gen(5)
    base = torch.randn(7, 32, generator=g)
    x = base[torch.randint(0, 7, (600,), generator=g)].to(dtype)
    distinct = torch.unique(x.float(), dim=0).shape[0]
    assert distinct == 7
    payload, stats = compress_with_stats([x], [0.01])
    s = stats[0]
    assert s.mode == "quant+lz"
    assert s.n_unique == distinct
    _, _, _, (sh,) = parse(payload)
    assert int(sh["n_unique"]) == distinct
    assert 0 < float(sh["step"]) <= 0.02
    out = decompress(payload)[0]
    assert float((out.double() - x.double()).abs().max()) <= 0.01


def test_quant_lz_counts_vectors_equal_after_quantization():
    """Rows that differ by less than the step collapse to one distinct quantized vector."""
    base = torch.randn(4, 16, generator=gen(1))
    x = base.repeat(50, 1) + 1e-6 * torch.randn(200, 16, generator=gen(2))
    assert torch.unique(x, dim=0).shape[0] == 200
    _, stats = compress_with_stats([x], [0.05])
    assert stats[0].mode == "quant+lz"
    assert 4 <= stats[0].n_unique <= 8  # a few rows may straddle a rounding boundary


@pytest.mark.parametrize("chunk", [64, 96, 2048, 4096])
def test_distinct_gaussian_rows_use_quant(chunk):
    x = torch.randn(256, 32, generator=gen(9))
    bound = 0.05
    payload, stats = compress_with_stats([x], [bound], CodecConfig(huffman_chunk_symbols=chunk))
    s = stats[0]
    assert s.mode == "quant" and s.n_unique == 256 and s.n_escapes == 0
    *_, (sh,) = parse(payload)
    assert 0 < float(sh["step"]) <= 2 * bound
    assert int(sh["n_unique"]) == 256 and int(sh["n_escapes"]) == 0
    assert int(sh["chunk_symbols"]) == chunk
    assert int(sh["n_chunks"]) == math.ceil(256 * 32 / chunk)
    assert int(sh["sym_lo"]) + int(sh["sym_count"]) <= 4095
    assert int(sh["escape_length"]) == 0
    assert 0 < s.max_error <= bound
    # A 12-bit-limited code over ~30 values: well under 8 bits per element.
    assert s.wire_bytes < 256 * 32


def test_escapes_are_counted_and_sent_verbatim():
    x = torch.randn(64, 16, generator=gen(3))
    specials = [math.nan, math.inf, -math.inf, 50.0, -50.0, 45.0]  # +-50: out of the alphabet
    positions = [(1, 1), (5, 3), (9, 9), (20, 0), (33, 15), (63, 7)]
    for (i, j), v in zip(positions, specials, strict=True):
        x[i, j] = v
    payload, stats = compress_with_stats([x], [0.01])
    assert stats[0].mode == "quant"
    assert stats[0].n_escapes == len(specials)
    _, _, _, (sh,) = parse(payload)
    assert int(sh["n_escapes"]) == len(specials) and int(sh["escape_length"]) > 0
    out = decompress(payload)[0]
    for i, j in positions:
        assert out[i, j].view(torch.int32) == x[i, j].view(torch.int32)


def test_config_switches():
    blocks, bounds = mixed_blocks()
    _, stats = compress_with_stats(blocks, bounds, CodecConfig(enable_quantization=False))
    assert {s.mode for s in stats} <= {"raw", "lz"}
    out = decompress(compress(blocks, bounds, CodecConfig(enable_quantization=False)))
    for x, y in zip(blocks, out, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    _, stats = compress_with_stats(blocks, bounds, CodecConfig(enable_lz=False))
    assert {s.mode for s in stats} <= {"raw", "quant"}
    _, stats = compress_with_stats(
        blocks, bounds, CodecConfig(enable_lz=False, enable_quantization=False)
    )
    assert {s.mode for s in stats} == {"raw"}


@pytest.mark.parametrize("chunk", [0, 32, 63, 100, 1 << 21])
def test_bad_chunk_size_is_rejected(chunk):
    with pytest.raises(ValueError, match="huffman_chunk_symbols"):
        CodecConfig(huffman_chunk_symbols=chunk)


# ---------------------------------------------------------------------------------------------
# Mode choice


def _random_block(k: int) -> tuple[torch.Tensor, float, CodecConfig]:
    g = gen(1000 + k)
    dtype = DTYPES[k % 3]
    rows = int(torch.randint(1, 60, (1,), generator=g))
    dim = int(torch.randint(1, 40, (1,), generator=g))
    distinct = int(torch.randint(1, rows + 1, (1,), generator=g))
    base = torch.randn(distinct, dim, generator=g) * float(torch.rand(1, generator=g) * 10)
    x = base[torch.randint(0, distinct, (rows,), generator=g)].to(dtype)
    bound = float(torch.rand(1, generator=g)) ** 4 * 3
    return x, bound, CodecConfig(huffman_chunk_symbols=[64, 96, 2048][k % 3])


def _wire(x: torch.Tensor, bound: float, cfg: CodecConfig, **kw) -> tuple[int, str]:
    cfg = CodecConfig(huffman_chunk_symbols=cfg.huffman_chunk_symbols, **kw)
    s = compress_with_stats([x], [bound], cfg)[1][0]
    return s.wire_bytes, s.mode


def test_a_block_never_costs_more_than_raw_or_than_quant_alone():
    for k in range(200):
        x, bound, cfg = _random_block(k)
        full, mode = _wire(x, bound, cfg)
        assert full <= raw_wire_bytes(*x.shape, x.element_size()), (k, mode)
        no_lz, _ = _wire(x, bound, cfg, enable_lz=False)
        assert full <= no_lz, (k, mode, full, no_lz)


@pytest.mark.parametrize(
    ("x", "bound"),
    [
        (torch.tensor([[1.0, 2.0]]).repeat(8, 1), 1e-3),  # raw 88 B, lz 64 B
        (torch.randn(1, 32, generator=gen(0)).repeat(64, 1), 1e-7),  # quant+lz 320 B, lz 184 B
        (torch.randn(4, 16, generator=gen(1)).repeat(16, 1), 1e-6),  # quant+lz 596 B, lz 328 B
    ],
    ids=["raw_instead_of_lz", "quant_lz_all_escaped", "quant_lz_mostly_escaped"],
)
def test_mode_is_the_smallest_of_the_four(x, bound):
    """docs/codec.md: "the block is sent in the smallest of raw, lz, quant and quant+lz"."""
    chosen = compress_with_stats([x], [bound])[1][0]
    lossless = compress_with_stats([x], [bound], CodecConfig(enable_quantization=False))[1][0]
    assert lossless.mode == "lz"
    assert chosen.wire_bytes <= lossless.wire_bytes, (chosen.mode, chosen.wire_bytes)


@pytest.mark.parametrize("outlier", [5e3, 1e30])
def test_one_outlier_does_not_make_the_block_raw(outlier):
    """One outlier is escaped; the rest still quantizes around the median."""
    x = torch.randn(64, 16, generator=gen(3))
    x[20, 0] = outlier
    s = compress_with_stats([x], [0.01])[1][0]
    assert s.mode == "quant" and s.n_escapes == 1, (s.mode, s.wire_bytes, s.n_escapes)


# ---------------------------------------------------------------------------------------------
# Checksum


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000])
def test_checksum_kernel_matches_its_reference(n):
    rng = np.random.default_rng(n)
    words = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    if n:
        words[0] = 0xFFFFFFFF
    want = sum(int(w) * (2 * i + 1) for i, w in enumerate(words)) % 2**64
    assert int(checksum_words(words)) == want
    assert int(checksum(torch.from_numpy(words.view(np.int32)))) & (2**64 - 1) == want


def test_checksum_sees_every_single_bit_flip_and_word_swaps():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, 40, dtype=np.uint64).astype(np.uint32)
    base = int(checksum_words(words))
    for i in range(40):
        for bit in range(32):
            w = words.copy()
            w[i] ^= np.uint32(1 << bit)
            assert int(checksum_words(w)) != base
    for i, j in [(0, 1), (3, 17), (38, 39)]:
        w = words.copy()
        w[i], w[j] = words[j], words[i]
        assert int(checksum_words(w)) != base


# ---------------------------------------------------------------------------------------------
# The format's shared rules give one answer on every backend


@numba.njit(cache=False)
def _refs_rules_compiled(rows: int, n_unique: int) -> tuple[int, int, int, int, int]:
    mode, _, bits = refs_packing(rows, n_unique)
    return (
        ref_width(n_unique),
        refs_bits(rows, n_unique, 0),
        refs_bits(rows, n_unique, 1),
        mode,
        bits,
    )


def test_reference_rules_agree_on_python_numpy_torch_and_numba():
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 5000, 200)
    n_unique = np.minimum(rows, rng.integers(1, 5000, 200))
    want = np.array(
        [_refs_rules_compiled(int(r), int(u)) for r, u in zip(rows, n_unique, strict=True)]
    ).T
    for kind in (np.asarray, torch.from_numpy):
        r, u = kind(rows), kind(n_unique)
        mode, _, bits = refs_packing(r, u)
        got = [ref_width(u), refs_bits(r, u, 0), refs_bits(r, u, 1), mode, bits]
        assert all(np.array_equal(np.asarray(g), w) for g, w in zip(got, want, strict=True))
    for r, u, w in zip(rows.tolist(), n_unique.tolist(), want.T, strict=True):
        assert int(ref_width(u)) == w[0] == max(u - 1, 0).bit_length()
        assert (
            int(refs_bits(r, u, REFS_FIXED)) == w[1] and int(refs_bits(r, u, REFS_FLAGGED)) == w[2]
        )


def test_segment_layout_accepts_what_compress_writes_and_rejects_short_segments():
    torch.manual_seed(0)
    blocks = [torch.randn(64, 8), torch.randn(4, 8).repeat(8, 1), torch.randn(3, 5)]
    blocks.append(torch.randn(8, 64).repeat(16, 1))
    payload = compress(blocks, [0.01, 0.0, 0.0, 0.01], CodecConfig()).numpy()
    body = payload[HEADER.itemsize :].view(np.uint32)
    descs = body[: DESCRIPTOR_WORDS * len(blocks)].view(DESCRIPTOR)
    start = DESCRIPTOR_WORDS * len(blocks)
    assert sorted(descs["mode"].tolist()) == [MODE_RAW, MODE_LZ, MODE_QUANT, MODE_QUANT_LZ]
    for d in descs:
        seg = int(d["seg_words"])
        head = body[start : start + SEGMENT_HEADER_WORDS]
        fields = (0.0, *([0] * 10))
        if d["mode"] != 0:
            h = head.view(SEGMENT_HEADER)[0]
            fields = (h["step"], *(int(h[n]) for n in SEGMENT_HEADER.names[1:11]))
        desc = (int(d["mode"]), int(d["rows"]), int(d["dim"]), 4, seg)
        ok, *_, bs_off = segment_layout(desc, fields)
        # Raw and lz segments have an exact size; a quantized one needs room for its sections.
        short = int(bs_off) - 1 if d["mode"] & 2 else seg - 1
        assert bool(ok) and not bool(segment_layout((*desc[:4], short), fields)[0])
        start += seg


_EDGES = {"step": [0.0, -1.0, 2.0, 2.0**-24, math.nan, math.inf], "mode": [0, 1, 2, 3, 6, 7]}


def _mutated_segments(rng: np.random.Generator) -> list[tuple[tuple, tuple]]:
    """(descriptor, segment header) fields of a payload's blocks, and copies with one field
    moved near a check's edge (the mode and step: to values that change the checks)."""
    torch.manual_seed(1)
    blocks = [torch.randn(64, 8), torch.randn(4, 8).repeat(8, 1), torch.randn(3, 5)]
    blocks += [torch.randn(8, 64).repeat(16, 1), torch.randn(30, 9)]
    payload = compress(blocks, [0.01, 0.0, 0.0, 0.01, 1e-3], CodecConfig()).numpy()
    body = payload[HEADER.itemsize :].view(np.uint32)
    start = DESCRIPTOR_WORDS * len(blocks)
    out = []
    for d in body[:start].view(DESCRIPTOR):
        mode, seg = int(d["mode"]), int(d["seg_words"])
        head = read_segment_header(body, start) if mode else (0.0, *[0] * 10)
        start += seg
        fields = [mode, int(d["rows"]), int(d["dim"]), 4, seg, float(head[0])]
        fields += [int(v) for v in head[1:]]
        out.append(fields)
        for k in (0, 1, 2, 4, 5, *range(6, len(fields))):  # not the element size
            for _ in range(6):
                f = list(fields)
                if k in (0, 5):
                    f[k] = rng.choice(_EDGES["mode" if k == 0 else "step"]).item()
                else:
                    f[k] = max(0, f[k] + int(rng.integers(-3, 4) * rng.choice([1, 7, 2**20])))
                out.append(f)
    return [(tuple(f[:5]), (np.float32(f[5]), *f[6:])) for f in out]


@numba.njit
def _checks_compiled(desc: tuple, header: tuple) -> tuple:
    return segment_checks(desc, header)


def _at(value: object, i: int) -> int:
    """Block ``i``'s value of a check's entry: a scalar, or a numpy / torch column."""
    a = np.asarray(value)
    return int(a.reshape(-1)[i]) if a.ndim else int(a)


def test_segment_checks_agree_on_every_backend():
    """The one statement of a segment's checks and sections (``segment_checks``) gives the
    same verdicts and offsets on Python scalars, numba scalars, numpy arrays and torch
    tensors, and every field check fails for some block (so the agreement covers each)."""
    cases = _mutated_segments(np.random.default_rng(3))
    desc_cols = [np.array(c, np.int64) for c in zip(*(d for d, _ in cases), strict=True)]
    head_cols = list(zip(*(h for _, h in cases), strict=True))
    head_cols = [
        np.array(head_cols[0], np.float32),
        *(np.array(c, np.int64) for c in head_cols[1:]),
    ]
    by_array = segment_checks(tuple(desc_cols), tuple(head_cols))
    as_tensors = [tuple(torch.from_numpy(c) for c in cols) for cols in (desc_cols, head_cols)]
    by_tensor = segment_checks(*as_tensors)
    failed = set()
    for i, (desc, header) in enumerate(cases):
        checks, sections = segment_checks(desc, header)
        want = [[int(v) for v in c] for c in checks] + [[int(v) for v in sections]]
        compiled = _checks_compiled(
            tuple(np.int64(v) for v in desc), (header[0], *(np.int64(v) for v in header[1:]))
        )
        for got, j in ((compiled, 0), (by_array, i), (by_tensor, i)):
            got_i = [[_at(v, j) for v in c] for c in (*got[0], got[1])]
            assert got_i == want, (i, desc, header)
        failed |= {k for k, c in enumerate(checks) if not c[0]}
    data = {k for k, c in enumerate(checks) if c[1] in (SEGMENT_REFS_RANGE, SEGMENT_BAD_STREAM)}
    assert failed == set(range(len(checks))) - data


def _header_fields(rng: np.random.Generator) -> tuple:
    """Random segment-header fields, each over its field's whole range."""
    wide = [int(rng.integers(0, 2**32)) for _ in range(4)]
    short = [int(rng.integers(0, 2**16)) for _ in range(2)]
    byte = [int(rng.integers(0, 256)) for _ in range(3)]
    step = np.float32(rng.standard_normal() * 10.0 ** rng.integers(-30, 30))
    return (step, int(rng.integers(-(2**31), 2**31)), *wide, *short, *byte)


def test_segment_header_words_are_the_records_and_read_back_on_every_backend():
    """The one writer (``segment_header_words``: numba scalars through ``write_segment_header``,
    Python ints, torch tensors) gives the bytes of a numpy ``SEGMENT_HEADER`` record, and the
    reader gives the fields back."""
    rng = np.random.default_rng(0)
    fields = [_header_fields(rng) for _ in range(64)]
    records = np.zeros(len(fields), SEGMENT_HEADER)
    for name, column in zip(SEGMENT_HEADER.names[:11], zip(*fields, strict=True), strict=True):
        records[name] = column
    want = records.view(np.uint32).reshape(len(fields), SEGMENT_HEADER_WORDS)
    columns = [torch.tensor(np.asarray(c)) for c in zip(*fields, strict=True)]
    by_tensor = torch.stack(segment_header_words(tuple(columns)), dim=1)
    assert np.array_equal(by_tensor.numpy(), want)
    words = np.zeros(SEGMENT_HEADER_WORDS * len(fields) + 1, np.uint32)
    for i, f in enumerate(fields):
        assert [int(w) for w in segment_header_words(f)] == want[i].tolist()
        assert write_segment_header(words, 1 + 8 * i, f) == 9 + 8 * i
        back = read_segment_header(words, 1 + 8 * i)
        assert back[0] == f[0] and [int(v) for v in back[1:]] == list(f[1:])
    assert np.array_equal(words[1:].reshape(-1, SEGMENT_HEADER_WORDS), want)
    back = segment_header_fields(tuple(torch.from_numpy(want.astype(np.int64)).unbind(1)))
    assert torch.equal(back[0], columns[0].float())
    assert all(torch.equal(b, c) for b, c in zip(back[1:], columns[1:], strict=True))
