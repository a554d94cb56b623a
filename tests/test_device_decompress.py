"""The device-resident, batched decompress against the CPU path: same bits, same errors, two syncs.

Without a CUDA device the kernels run on CPU tensors in the Triton interpreter (tests/conftest.py
switches it on for the session), so the payloads here are small; bigger ones are marked slow.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the device decoder cannot run")

import host_kernels
from helpers import (
    DEVICE,
    INTERPRETER_WARNINGS,
    as_tensor,
    corpus,
    cuda_syncs_only_in_to_host,
    parse,
    with_checksum,
)

from torchrec_lossy.codec import CodecConfig, CodecError, host_sync, huffman, pipeline
from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec import device_decompress as dd
from torchrec_lossy.codec import format as wire
from torchrec_lossy.codec.decode_columns import stack_columns
from torchrec_lossy.codec.format import (
    BITS_DTYPES,
    DESCRIPTOR,
    HEADER,
    HEADER_WORDS,
    MAX_CODE_LENGTH,
    SEGMENT_HEADER,
)
from torchrec_lossy.kernels import codebook as k_codebook

pytestmark = INTERPRETER_WARNINGS

REPO = Path(__file__).resolve().parent.parent
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A block's raw bits (NaN payloads and -0.0 compare exactly)."""
    return t.detach().cpu().contiguous().view(BITS_DTYPES[t.dtype])


def cpu_decode(payload: torch.Tensor, max_elements: int = 1 << 28) -> list[torch.Tensor] | str:
    try:
        return pipeline.decompress(payload.cpu(), max_elements, backend="cpu")
    except CodecError as e:
        return str(e)


def device_decode(payload: torch.Tensor, max_elements: int = 1 << 28) -> list[torch.Tensor] | str:
    try:
        out = dd.decompress_device(
            payload.to(DEVICE),
            max_elements,
            lambda buf: pipeline.decompress(torch.from_numpy(buf.copy()), max_elements, "cpu"),
        )
    except CodecError as e:
        return str(e)
    assert all(t.device == DEVICE for t in out)
    return out


def assert_same(payload: torch.Tensor, max_elements: int = 1 << 28) -> str | None:
    """Device and CPU decode alike: the same blocks bit for bit, or the same CodecError message.

    Returns:
        The message, or None when the payload decoded.
    """
    want = cpu_decode(payload, max_elements)
    got = device_decode(payload, max_elements)
    if isinstance(want, str) or isinstance(got, str):
        assert got == want
        return want
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        assert torch.equal(bits(g), bits(w)), f"block {i} decodes differently"
    return None


def mixed_blocks(dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], list[float]]:
    """Blocks that land in every mode, with NaN / Inf / outliers, and empty shapes."""
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(24, 8, generator=g)
    special = gauss.clone()
    special[1, 2], special[5, 0], special[7, 7] = math.nan, math.inf, -math.inf
    special[9, 3], special[11, 4] = 3e4, -6e4  # outliers (finite in every dtype)
    few = torch.randn(4, 10, generator=g)
    repeated = few[torch.randint(0, 4, (60,), generator=g)]
    many = torch.randn(90, 8, generator=g)
    flagged = torch.cat([many, many[:6]])
    raw = torch.randint(-(2**15), 2**15 - 1, (5, 3), generator=g, dtype=torch.int16)
    raw_block = raw.view(torch.float16).to(dtype) if dtype != torch.float32 else raw.float()
    blocks = [
        gauss,
        special,
        repeated,  # quant+lz, fixed references
        flagged,  # quant+lz, flagged references
        repeated,  # lossless lz (bound 0)
        raw_block,  # raw (random bits, bound 0)
        torch.zeros(0, 4),
        torch.zeros(3, 0),
        torch.ones(1, 1),
    ]
    bounds = [0.01, 0.02, 0.01, 0.05, 0.0, 0.0, 0.1, 0.1, 0.1]
    return [b.to(dtype) for b in blocks], bounds


CONFIG = CodecConfig(huffman_chunk_symbols=64)


# ------------------------------------------------------------------------------------------------
# Valid payloads


@pytest.mark.parametrize("name", [name for name, _ in corpus()])
def test_fuzz_corpus_decodes_like_cpu(name: str) -> None:
    buf = dict(corpus())[name]
    assert assert_same(as_tensor(buf)) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_every_mode_and_dtype_decodes_like_cpu(dtype: torch.dtype) -> None:
    blocks, bounds = mixed_blocks(dtype)
    payload, stats = pipeline.compress_with_stats(blocks, bounds, CONFIG)
    assert {s.mode for s in stats} == {"raw", "lz", "quant", "quant+lz"}
    assert assert_same(payload) is None
    out = dd.decompress_device(payload.to(DEVICE))
    for b, o, eb in zip(blocks, out, bounds, strict=True):  # and the bound holds, NaN exactly
        finite = torch.isfinite(b)
        assert torch.equal(bits(o)[~finite], bits(b)[~finite])
        err = (o.cpu().double() - b.double())[finite].abs()
        assert err.numel() == 0 or float(err.max()) <= eb


def test_payload_views_at_an_odd_offset_and_strided() -> None:
    blocks, bounds = mixed_blocks(torch.float32)
    payload = pipeline.compress(blocks, bounds, CONFIG).to(DEVICE)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8, device=DEVICE), payload])[1:]
    assert shifted.storage_offset() % 4 != 0
    strided = torch.stack([payload, torch.zeros_like(payload)], 1).reshape(-1)[::2]
    assert not strided.is_contiguous()
    want = pipeline.decompress(payload.cpu())
    for view in (shifted, strided):
        for a, b in zip(dd.decompress_device(view), want, strict=True):
            assert torch.equal(bits(a), bits(b))


def test_no_blocks() -> None:
    payload = pipeline.compress([], [])
    assert dd.decompress_device(payload.to(DEVICE)) == []


# ------------------------------------------------------------------------------------------------
# Host syncs


def _payload_of(n_blocks: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n_blocks)
    blocks, bounds = [], []
    for i in range(n_blocks):
        x = torch.randn(20 + i % 3, 8, generator=g)
        if kind == "raw":
            blocks.append(x[:3])
            bounds.append(0.0)
        else:  # quantized, LZ and raw blocks: every device stage runs
            if i % 4 in (1, 2):
                x = x[torch.randint(0, 4, (40,), generator=g)]
            blocks.append(x.to(DTYPES[i % 3]))
            bounds.append([0.05, 0.01, 0.0, 0.0][i % 4])
    return pipeline.compress(blocks, bounds, CONFIG).to(DEVICE)


@pytest.mark.parametrize("n_blocks", [1, 4, 13])
def test_two_syncs_whatever_the_block_count(n_blocks: int) -> None:
    """Exactly two device-to-host copies per payload (the payload, the status), for 1 to 13
    blocks; one when no block has references or a Huffman stream (nothing to check)."""
    payload = _payload_of(n_blocks, "mixed")
    before = host_sync.host_reads("decompress")
    out = dd.decompress_device(payload)
    assert host_sync.host_reads("decompress") - before == 2
    assert len(out) == n_blocks
    before = host_sync.host_reads("decompress")
    dd.decompress_device(_payload_of(n_blocks, "raw"))
    assert host_sync.host_reads("decompress") - before == 1


def test_errors_found_on_the_device_cost_the_same_two_syncs() -> None:
    buf = bytearray(dict(corpus())["quant_lz_flagged"])
    _, _, segs = parse(bytes(buf))
    off = segs[0][0] + 32 + 4 * 0  # first codebook word: nibbles of 15 are over the limit
    buf[off : off + 4] = b"\xff\xff\xff\xff"
    before = host_sync.host_reads("decompress")
    with pytest.raises(CodecError, match="code lengths over the limit"):
        dd.decompress_device(as_tensor(with_checksum(bytes(buf))).to(DEVICE))
    assert host_sync.host_reads("decompress") - before == 2


_SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_no_other_device_to_host_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tensor method that reads device memory on the host is called from the decoder or the
    kernel launchers: they read only through ``host_sync.to_host`` (so the two counted copies
    are all there is)."""
    watched = {
        str(Path(dd.__file__).resolve()),
        *(str(p.resolve()) for p in (REPO / "kernels").glob("*.py")),
    }
    calls: list[str] = []

    def spy(name: str, original):
        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename in watched:
                calls.append(f"{name} at {frame.f_code.co_name}:{frame.f_lineno}")
            return original(self, *args, **kwargs)

        return wrapper

    for name in _SYNCING:
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = original_to(self, *args, **kwargs)
        frame = sys._getframe(1)
        leaves = out.device != self.device and out.device.type == "cpu"
        if frame.f_code.co_filename in watched and leaves:
            calls.append(f"to(cpu) at {frame.f_code.co_name}:{frame.f_lineno}")
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    before = host_sync.host_reads("decompress")
    dd.decompress_device(_payload_of(8, "mixed"))
    assert host_sync.host_reads("decompress") - before == 2
    assert calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sync debug mode needs a GPU")
def test_no_hidden_cuda_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA's sync debugging set to error, only the two ``host_sync.to_host`` copies may
    synchronize."""
    payload = _payload_of(8, "mixed")
    dd.decompress_device(payload)  # compile the kernels first
    with cuda_syncs_only_in_to_host(monkeypatch):
        dd.decompress_device(payload)


# ------------------------------------------------------------------------------------------------
# Corrupt payloads: the CPU path's messages


def _section_offsets(buf: bytes, block: int) -> dict[str, int]:
    """Byte offsets of a quantized block's sections (after a valid layout)."""
    _, descs, segs = parse(buf)
    off = segs[block][0]
    sh = np.frombuffer(buf[off : off + 32], SEGMENT_HEADER)[0]
    d = descs[block]
    rows, mode = int(d["rows"]), int(d["mode"])
    itemsize = 4 if int(d["dtype"]) == 1 else 2

    def words(n_bytes: int) -> int:  # bytes of the whole words that hold n_bytes
        return 4 * ((n_bytes + 3) // 4)

    n_unique, n_esc = int(sh["n_unique"]), int(sh["n_escapes"])
    at = {"codebook": off + 32}
    pos = off + 32 + words((int(sh["sym_count"]) + 1) // 2)
    if mode & 1:
        from torchrec_lossy.codec.format import refs_bits

        at["refs"] = pos
        pos += words((refs_bits(rows, n_unique, int(sh["ref_mode"])) + 7) // 8)
    at["esc_pos"] = pos
    pos += 4 * n_esc
    pos += words(n_esc * itemsize)
    at["chunks"] = pos
    at["stream"] = pos + 4 * int(sh["n_chunks"])
    at["n_chunks"] = int(sh["n_chunks"])
    at["n_unique"] = n_unique
    return at


def _put_u32(buf: bytearray, at: int, value: int) -> None:
    buf[at : at + 4] = int(value % 2**32).to_bytes(4, "little")


def _u32(buf: bytes | bytearray, at: int) -> int:
    return int.from_bytes(buf[at : at + 4], "little")


def _crafted_corruptions() -> dict[str, bytes]:
    """One payload per error that only decoding finds (and one structural error after one)."""
    c = dict(corpus())
    out = {}
    # Code lengths over the limit (a nibble of 15) and a Kraft sum over 1 (every length 1).
    for name, fill in (("codebook_too_long", 0xFF), ("codebook_kraft", 0x11)):
        buf = bytearray(c["quant"])
        at = _section_offsets(c["quant"], 0)["codebook"]
        buf[at : at + 4] = bytes([fill] * 4)
        out[name] = bytes(buf)
    # Chunk table: decreasing, past the end; chunk 0 one word short (out of bits / bad code).
    at = _section_offsets(c["quant"], 0)
    for name, k, delta in (("table_decreasing", 1, -10**6), ("table_past_end", -1, 1),
                           ("chunk_short", 0, -1)):  # fmt: skip
        buf = bytearray(c["quant"])
        k = k % at["n_chunks"]
        pos = at["chunks"] + 4 * k
        _put_u32(buf, pos, max(_u32(buf, pos) + delta, 0))
        out[name] = bytes(buf)
    # An incomplete code (one length raised: Kraft sum < 1) leaves the all-ones patterns unused.
    buf = bytearray(c["quant"])
    book = at["codebook"]
    k = next(i for i in range(book, at["chunks"]) if 0 < buf[i] & 0xF < MAX_CODE_LENGTH)
    buf[k] += 1
    _put_u32(buf, at["stream"], 2**32 - 1)
    out["invalid_code"] = bytes(buf)
    # Escapes: moved, and one listed escape replaced by a value symbol's position.
    for name, delta in (("escape_moved", 1), ("escape_not_there", -1)):
        buf = bytearray(c["quant_escapes"])
        pos = _section_offsets(c["quant_escapes"], 0)["esc_pos"]
        _put_u32(buf, pos, _u32(buf, pos) + delta)
        out[name] = bytes(buf)
    # Flagged references all 1: every row a first occurrence, too many vectors.
    buf = bytearray(c["quant_lz_flagged"])
    at = _section_offsets(c["quant_lz_flagged"], 0)
    buf[at["refs"] : at["esc_pos"]] = b"\xff" * (at["esc_pos"] - at["refs"])
    out["refs_flagged"] = bytes(buf)
    # Fixed references of 3 distinct vectors (2-bit ids): id 3 is out of range.
    g = torch.Generator().manual_seed(3)
    few = torch.randn(3, 10, generator=g)
    block = few[torch.randint(0, 3, (60,), generator=g)]
    raw = torch.randint(-(2**31), 2**31 - 1, (4, 3), generator=g, dtype=torch.int32)
    payload, stats = pipeline.compress_with_stats(
        [torch.randn(24, 8, generator=g), block, raw.view(torch.float32)], [0.05, 0.01, 0.0], CONFIG
    )
    assert [s.mode for s in stats] == ["quant", "quant+lz", "raw"] and stats[1].n_unique == 3
    buf = bytearray(payload.numpy().tobytes())
    pos = _section_offsets(bytes(buf), 1)["refs"]
    buf[pos : pos + 4] = b"\xff" * 4
    out["refs_fixed"] = bytes(buf)
    # ... and block 2 one row longer than its segment: the CPU path reports block 1's data error
    # first, which only decoding finds (the device path replays the CPU decoder here).
    d_off = 32 + 24 * 2 + DESCRIPTOR.fields["rows"][1]
    _put_u32(buf, d_off, _u32(buf, d_off) + 1)
    out["data_error_before_structural"] = bytes(buf)
    return {k: with_checksum(v) for k, v in out.items()}


def test_crafted_corruptions_fail_like_cpu() -> None:
    messages = {}
    for name, buf in _crafted_corruptions().items():
        messages[name] = assert_same(as_tensor(buf))
        assert messages[name] is not None, f"{name} decoded"
    # Every error decoding an entropy-format payload can find, with the CPU path's wording (the
    # packed format's are test_codec_packed.py's: the device path decodes it on the host).
    joined = " | ".join(messages.values())
    huffman = [m for c, m in wire.DECODE_ERRORS.items() if c not in wire.PACKED_DECODE_ERRORS]
    for what in ("vector references out of range", *huffman):
        assert what in joined, (what, messages)
    assert messages["data_error_before_structural"].startswith("corrupt payload: block 1: vector")


def test_bit_flips_in_segments_fail_or_decode_like_cpu() -> None:
    """Random bit flips in quantized / LZ segments (checksum fixed so decoding is reached)."""
    rng = np.random.default_rng(11)
    payloads = [(n, b) for n, b in corpus() if n not in ("raw", "degenerate")]
    outcomes = {"decoded": 0, "error": 0}
    for _ in range(40):
        _, buf = payloads[rng.integers(len(payloads))]
        _, _, segs = parse(buf)
        off, length = segs[int(rng.integers(len(segs)))]
        if length <= 32:
            continue
        b = bytearray(buf)
        pos = off + 32 + int(rng.integers(length - 32))
        b[pos] ^= 1 << int(rng.integers(8))
        msg = assert_same(as_tensor(with_checksum(bytes(b))), 1 << 22)
        outcomes["decoded" if msg is None else "error"] += 1
    assert outcomes["error"] >= 5 and outcomes["decoded"] >= 5, outcomes


def _field_edits() -> list[bytes]:
    """test_codec_fuzz's deterministic sweep: every descriptor and segment header field of every
    corpus payload set to edge values, checksum fixed."""
    from helpers import field_positions, interesting_values, set_field

    out = []
    for _, buf in corpus():
        for off, _name, dt in field_positions(buf):
            current = np.frombuffer(buf[off : off + dt.itemsize], dt)[0]
            out += [
                with_checksum(set_field(buf, off, dt, v)) for v in interesting_values(dt, current)
            ]
    return out


@pytest.mark.slow  # about 25 s under the Triton interpreter
def test_field_edits_fail_or_decode_like_cpu() -> None:
    """A sample of the sweep: the vectorised layout checks accept exactly what the CPU path
    accepts (a disagreement shows as a different message, or as one side decoding)."""
    edits = _field_edits()
    rng = np.random.default_rng(0)
    for k in rng.choice(len(edits), size=120, replace=False):
        assert_same(as_tensor(edits[k]), 1 << 22)


@pytest.mark.slow
def test_field_edits_large_sample_like_cpu() -> None:
    """A larger sample (the whole sweep, ~4,900 edits, agreed when run by hand: ~25 min here)."""
    edits = _field_edits()
    rng = np.random.default_rng(1)
    for k in rng.choice(len(edits), size=800, replace=False):
        assert_same(as_tensor(edits[k]), 1 << 22)


def test_header_and_structure_errors_like_cpu() -> None:
    buf = dict(corpus())["multi"]
    cases = [buf[:n] for n in (0, 5, 31, 32, 100, len(buf) - 4)]
    cases.append(with_checksum(buf[:-4]))  # segments do not add up
    b = bytearray(buf)
    b[40] ^= 1
    cases.append(bytes(b))  # checksum
    _, _, segs = parse(buf)
    for k, (off, _) in enumerate(segs):  # every segment header field set to an odd value
        if k in (0, 1, 3, 4):
            for field in ("n_unique", "n_escapes", "chunk_symbols", "n_chunks", "sym_count"):
                b = bytearray(buf)
                fo = off + SEGMENT_HEADER.fields[field][1]
                width = SEGMENT_HEADER.fields[field][0].itemsize
                b[fo : fo + width] = b"\xfe" * width
                cases.append(with_checksum(bytes(b)))
    errors = [assert_same(as_tensor(case), 1 << 22) for case in cases]
    assert sum(e is not None for e in errors) >= len(cases) // 2  # some fields go unused


def test_max_elements_like_cpu() -> None:
    payload = pipeline.compress([torch.randn(10, 10)], [0.1])
    assert assert_same(payload, max_elements=100) is None
    assert "max_elements" in assert_same(payload, max_elements=99)


def test_non_payloads_are_rejected() -> None:
    with pytest.raises(CodecError, match=r"1-D torch\.uint8"):
        dd.decompress_device(torch.zeros(8, 8, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------------
# Decode tables


def _wire_codebook(lengths: np.ndarray) -> tuple[np.ndarray, int, int, int]:
    lo, count = host_kernels.symbol_range_kernel(lengths)
    nib = huffman.pack_codebook_kernel(lengths, lo, count)
    nib = np.concatenate([nib, np.zeros(-nib.shape[0] % 4, np.uint8)])
    return nib.view(np.int32), lo, count, int(lengths[-1])


def test_decode_tables_match_cpu() -> None:
    rng = np.random.default_rng(4)
    cases = []
    for spread in (0.5, 4.0, 60.0, 900.0):
        sym = np.clip(rng.normal(2047, spread, 5000), 0, 4095).astype(np.int64)
        hist = np.bincount(sym, minlength=4096).astype(np.int64)
        cases.append(huffman.code_lengths_kernel(hist))
    one = np.zeros(4096, np.uint8)
    one[7] = 1
    cases.append(one)  # a single symbol
    cases.append(np.zeros(4096, np.uint8))  # no symbol at all
    incomplete = cases[1].copy()
    incomplete[np.flatnonzero(incomplete)[0]] += 1  # Kraft sum < 1
    cases.append(incomplete)
    over = cases[1].copy()
    over[np.flatnonzero(over)[:3]] = 1  # Kraft sum > 1
    cases.append(over)
    books = [_wire_codebook(lengths) for lengths in cases]
    # A length of 13 (only the wire's 4-bit nibbles can say that) is over the limit.
    books.append((np.array([0xD], np.int32), 100, 1, 0))
    starts = np.cumsum([0] + [w.shape[0] for w, *_ in books])[:-1]
    words = torch.from_numpy(np.concatenate([w for w, *_ in books])).to(DEVICE)
    n = len(books)
    meta = np.array([(s, lo, c, e) for s, (_, lo, c, e) in zip(starts, books, strict=True)])
    fields = dict(zip(("cb_off", "sym_lo", "sym_count", "esc_len"), meta.T, strict=True))
    fields["quant_blocks"] = np.arange(n)
    host = stack_columns(lambda name: np.asarray(fields.get(name, ()), np.int64), n)
    cols = dc.DecodeColumns(torch.from_numpy(host).to(DEVICE), n, 0, 0, n)
    tables = k_codebook.decode_tables(words, cols)
    bad = cols.column(dc.CODEBOOK_BAD)
    tables, bad = tables.cpu().numpy(), bad.cpu().numpy()
    for i, lengths in enumerate([*cases, None]):
        if lengths is None:
            assert bad[i] == 1
            continue
        want = huffman.decode_table_kernel(lengths)
        if want.shape[0] == 0:
            assert bad[i] == 1, i
            assert (tables[i] == -1).all()
            continue
        assert bad[i] == 0, i
        widened = np.repeat(want, (1 << MAX_CODE_LENGTH) // want.shape[0])
        np.testing.assert_array_equal(tables[i], widened, err_msg=str(i))


# ------------------------------------------------------------------------------------------------
# Wiring


def test_decompress_dispatch() -> None:
    payload = _payload_of(3, "mixed").cpu()
    want = pipeline.decompress(payload, backend="cpu")
    before = host_sync.host_reads("decompress")
    got = pipeline.decompress(payload, backend="triton")  # CPU payload, triton: device path
    assert host_sync.host_reads("decompress") - before == 2
    for a, b in zip(got, want, strict=True):
        assert torch.equal(bits(a), bits(b))
    before = host_sync.host_reads("decompress")
    pipeline.decompress(payload)  # CPU payload, auto: the host path
    pipeline.decompress(payload, backend="cpu")
    assert host_sync.host_reads("decompress") == before
    if torch.cuda.is_available():
        pipeline.decompress(payload.cuda())  # CUDA payload, auto: the device path
        assert host_sync.host_reads("decompress") - before == 2


def test_codec_imports_and_decodes_without_triton(run_without_triton: Callable[[str], str]) -> None:
    """Without triton the codec still imports and runs on CPU; backend "triton" says what is
    missing, for compress and decompress alike."""
    out = run_without_triton(
        "import torch\n"
        "from torchrec_lossy.codec import CodecConfig, compress, decompress\n"
        "p = compress([torch.randn(8, 4)], [0.01])\n"
        "print('OK', decompress(p)[0].shape)\n"
        "triton = CodecConfig(backend='triton')\n"
        "for call in (lambda: decompress(p, backend='triton'),\n"
        "             lambda: compress([torch.ones(4, 3)], [0.1], triton)):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        print('ERR', e)\n"
    )
    assert "OK torch.Size([8, 4])" in out
    assert out.count("ERR the triton backend needs the triton package") == 2, out


# ------------------------------------------------------------------------------------------------
# Bigger cases


@pytest.mark.slow
def test_realistic_traffic_decodes_like_cpu() -> None:
    from torchrec_lossy.traffic import TrafficSpec, paper_traffic

    spec = TrafficSpec(batch_rows=128)
    blocks, bounds = paper_traffic(spec)
    payload = pipeline.compress(blocks, bounds)
    before = host_sync.host_reads("decompress")
    assert assert_same(payload) is None
    assert host_sync.host_reads("decompress") - before == 2


@pytest.mark.slow
def test_mutation_campaign_like_cpu() -> None:
    """Random body mutations (as test_codec_fuzz), checksum fixed: same message or same bits."""
    from helpers import INTERESTING_U32, apply_mutation

    rng = np.random.default_rng(2024)
    kinds = ["flip", "byte", "word", "delete", "insert", "swap", "zero_tail"]
    payloads = corpus()
    decoded = 0
    for _ in range(300):
        buf = payloads[rng.integers(len(payloads))][1]
        for _ in range(rng.integers(1, 3)):
            kind = kinds[rng.integers(len(kinds))]
            a = int(rng.integers(2**31))
            b = int(
                rng.integers({"flip": 8, "byte": 256, "delete": 9, "insert": 9}.get(kind, 2**31))
            )
            if kind == "word":
                b = INTERESTING_U32[b % len(INTERESTING_U32)]
            if kind in ("delete", "insert"):
                b = max(b, 1)
            buf = apply_mutation(buf, (kind, a, b))
        decoded += assert_same(as_tensor(with_checksum(buf)), 1 << 22) is None
    assert decoded > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_larger_blocks_decode_like_cpu(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(300, 64, generator=g)
    blocks = [
        base.to(dtype),
        base[torch.randint(0, 300, (1000,), generator=g)].to(dtype),
        (torch.randn(129, 33, generator=g) * 1e3).to(dtype),
    ]
    payload = pipeline.compress(blocks, [0.01, 0.02, 1e-3])
    assert assert_same(payload) is None


def test_header_view_is_the_header() -> None:
    """The decoder reads the header the format module defines (a guard for the layout)."""
    assert HEADER.itemsize == 32 and dd.HEADER_WORDS == HEADER_WORDS == 8


@pytest.mark.slow
def test_gpu_benchmark_runs_and_checks_identity(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/gpu_codec_bench.py's measuring function end to end on CPU in the interpreter
    (tiny traffic, every entry called once): it must build its table and find the device-resident
    and host-orchestrated payloads byte-identical, as it will on a GPU."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_codec_bench", REPO / "benchmarks" / "gpu_codec_bench.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiny = ["--dim", "4", "--batch-rows", "8", "--chunk-symbols", "64", "--rep-ms", "1"]
    args = bench.parse_args([*tiny, "--grouped-shape", "2x8x4", "--destinations", "2"])
    calls: list[str] = []

    def once(fn: Callable[[], object]) -> float:
        fn()
        calls.append("x")
        return 1.0

    out = bench.run(args, torch.device("cpu"), once)
    assert out["payload_identical_to_cpu"] is True
    assert out["grouped_identical_to_cpu"] is True  # both formats of the grouped call
    names = {r["name"] for r in out["rows"]}
    assert {"compress, device-resident", "decompress, device-resident"} <= names
    assert len(calls) == len(out["rows"]) + len(out["grouped"])  # every entry timed once
    assert "device-to-device copy" in capsys.readouterr().out
