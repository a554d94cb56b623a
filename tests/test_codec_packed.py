"""The packed format (``CodecConfig(format="packed")``, docs/format.md "Packed segments").

Round trip within every bound on adversarial blocks, exact sizes, the torch twin's bytes
(``kernels/packed_ref.py``) equal to the numba stream's, the grouped call, the device backends'
routing, and corrupt payloads named by block.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DTYPES, as_tensor, bound_for, make_block, parse, with_checksum

from torchrec_lossy.codec import (
    CodecConfig,
    CodecError,
    compress,
    compress_groups,
    compress_with_stats,
    decompress,
    decompress_groups,
)
from torchrec_lossy.codec import packed as host_packed
from torchrec_lossy.codec.bounds import BoundKind
from torchrec_lossy.codec.format import (
    ESCAPE_SYMBOL,
    FLAG_PACKED,
    MODE_PACKED,
    SEGMENT_HEADER_WORDS,
    mode_valid,
)
from torchrec_lossy.codec.grouped import check_groups
from torchrec_lossy.kernels import packed_ref

PACKED = CodecConfig(format="packed")
# The decoders of a packed payload: the host path and the device path over both kernel sets.
DECODERS = ["cpu", "reference", "triton"]


def _need(backend: str) -> None:
    """Skips a triton case where triton is not installed."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")


def _check_bound(x: torch.Tensor, y: torch.Tensor, bound: float) -> None:
    """Every finite element within ``bound``; NaN / Inf bit-exact; shapes and dtypes kept."""
    assert y.shape == x.shape and y.dtype == x.dtype
    xd, yd = x.double(), y.double()
    fin = torch.isfinite(xd)
    assert bool(((xd - yd).abs()[fin] <= bound).all()), float((xd - yd).abs()[fin].max())
    bits = torch.int32 if x.dtype == torch.float32 else torch.int16
    assert torch.equal(x[~fin].contiguous().view(bits), y[~fin].contiguous().view(bits))


def test_format_is_validated() -> None:
    with pytest.raises(ValueError, match=r"codec\.format"):
        CodecConfig(format="huffman")  # type: ignore[arg-type]
    assert CodecConfig().format == "entropy"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["adversarial", "mild", "repeat"])
@pytest.mark.parametrize("bound", ["zero", "tiny", "rel0.01", "rel0.05"])
def test_round_trip_within_the_bound(dtype: torch.dtype, kind: str, bound: str) -> None:
    x = make_block(67, 9, dtype, kind, seed=len(kind) + len(bound))
    eb = bound_for(x, bound)
    payload, stats = compress_with_stats([x], [eb], PACKED)
    (y,) = decompress(payload)
    _check_bound(x, y, eb)
    if eb == 0:
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    _, descs, _ = parse(payload.numpy().tobytes())
    quantized = stats[0].mode in ("quant", "quant+lz")
    assert bool(int(descs[0]["mode"]) & MODE_PACKED) == quantized


def test_exact_size_of_a_small_block() -> None:
    """8 distinct rows x 4 of integers in [-3, 3] at bound 0.5: step 1, center 0, one group
    of 32 codes of width 3 (zigzag of 3 is 6): header 32 + descriptor 24 + segment (8 header
    words, 1 width word, 3 code words) = 104 bytes, decoded exactly."""
    values = [[(r * 4 + c) % 7 - 3 for c in range(4)] for r in range(8)]
    x = torch.tensor(values, dtype=torch.float32)
    x[0, 0] = 3.0  # rows distinct, range [-3, 3]
    payload, stats = compress_with_stats([x], [0.5], PACKED)
    assert stats[0].mode == "quant"
    assert payload.numel() == 32 + 24 + 4 * (SEGMENT_HEADER_WORDS + 1 + 3) == 104
    header, descs, _ = parse(payload.numpy().tobytes())
    assert int(header["flags"]) == FLAG_PACKED and int(descs[0]["mode"]) == 2 | MODE_PACKED
    words = payload.numpy().view(np.uint32)[(32 + 24) // 4 :]
    assert words[SEGMENT_HEADER_WORDS] & 0xFF == 3  # the one group's width byte
    assert torch.equal(decompress(payload)[0], x)


def test_repeated_rows_are_sent_once() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(16, 32, generator=g)
    x = base[torch.randint(0, 16, (512,), generator=g)]
    payload, stats = compress_with_stats([x], [0.01], PACKED)
    assert stats[0].mode == "quant+lz" and stats[0].n_unique == 16
    _check_bound(x, decompress(payload)[0], 0.01)
    # 512 rows reference 16 ids (4 bits each, fixed packing) beside 16 x 32 values' codes.
    assert payload.numel() < 32 + 24 + 4 * (8 + 512 * 4 // 32 + 16 + 16 * 32)


def test_packed_is_larger_than_entropy_by_little_on_smooth_data() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1024, 64, generator=g) * 0.05
    packed = compress([x], [0.01 * float(x.max() - x.min())], PACKED).numel()
    entropy = compress([x], [0.01 * float(x.max() - x.min())]).numel()
    assert entropy < packed < 1.35 * entropy


def test_mode_byte_values() -> None:
    assert [bool(mode_valid(m)) for m in range(16)] == [
        True, True, True, True, False, False, True, True,
        False, False, True, True, False, False, True, True,
    ]  # fmt: skip


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 200])
def test_torch_twin_writes_the_numba_stream(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    sym = (2047 + torch.randint(-300, 300, (n,), generator=g) // (1 + torch.arange(n) % 5)).to(
        torch.int64
    )
    if n > 3:
        sym[3] = ESCAPE_SYMBOL
        sym[min(40, n - 1)] = 0  # the widest code
    n_groups = -(-n // 32)
    out = np.zeros(n_groups + 12 * n_groups + 4, np.uint32)
    blk = sym.numpy().astype(np.uint16)
    rows = np.arange(n, dtype=np.int32)
    planned = np.zeros(n_groups + 1, np.uint8)
    n_esc, code_words = host_packed.stream_words(blk, rows, 1, planned)
    words = host_packed.put_stream(out, 0, blk, rows, 1, planned)
    assert n_esc == (n > 3) and words == code_words
    widths, codes = packed_ref.pack_codes(sym)
    w_words = -(-n_groups // 4)
    assert words == w_words + int(widths.sum().item() if n else 0)
    assert out[:w_words].view(np.uint8)[:n_groups].tolist() == widths.tolist()
    assert out[w_words:words].tolist() == codes.tolist()
    back = packed_ref.unpack_codes(widths, codes, n)
    expect = torch.where(sym == ESCAPE_SYMBOL, 2047, sym)
    assert torch.equal(back, expect)
    decoded = np.zeros(n, np.uint16)
    esc = np.array([3] if n > 3 else [], np.uint32)
    seg = np.concatenate([esc, out[:words]]).astype(np.uint32)
    status = host_packed.decode_stream(
        seg, host_packed.segment_checksum(seg), seg[: esc.shape[0]], esc.shape[0],
        esc.shape[0] + w_words, decoded,
    )  # fmt: skip
    assert status == 0 and decoded.tolist() == sym.tolist()
    assert packed_ref.segment_checksum(torch.from_numpy(seg.astype(np.int64))) == int(
        host_packed.segment_checksum(seg)
    )


def test_grouped_payloads_equal_per_group_compress_and_decode() -> None:
    blocks = [make_block(40, 16, torch.float32, k, s) for s, k in enumerate(["mild", "repeat"] * 3)]
    groups = [blocks[0:2], blocks[2:3], [], blocks[3:6]]
    fractions = [[0.02] * len(g) for g in groups]
    out = compress_groups(groups, fractions, PACKED, kinds=True)
    for g, group in enumerate(groups):
        alone = compress_groups([group], [fractions[g]], PACKED, kinds=True).buffer
        assert torch.equal(out.payload(g), alone)
    got, status = decompress_groups(out.buffer, out.sizes)
    assert not status.rejected
    for group, dec, stats in zip(groups, got, out.stats, strict=True):
        for x, y, s in zip(group, dec, stats, strict=True):
            _check_bound(x, y, s.bound)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_every_backend_writes_and_reads_the_same_bytes(backend: str) -> None:
    blocks = [make_block(30, 8, d, "repeat", 1) for d in DTYPES]
    config = CodecConfig(format="packed", backend=backend)
    payload = compress(blocks, [0.01] * 3, config)
    assert torch.equal(payload, compress(blocks, [0.01] * 3, PACKED))
    for y, x in zip(decompress(payload, backend=backend), blocks, strict=True):
        _check_bound(x, y, 0.01)
    grouped = compress_groups([blocks[:1], blocks[1:]], [[0.01], [0.01] * 2], config)
    got, status = decompress_groups(grouped.buffer, grouped.sizes, backend=backend,
                                    skeletons=grouped.skeletons)  # fmt: skip
    assert not status.rejected and len(got[1]) == 2


def _packed_payload() -> bytes:
    x = make_block(64, 16, torch.float32, "mild", 5)
    return compress([torch.ones(2, 2), x], [0.0, 0.01], PACKED).numpy().tobytes()


@pytest.mark.parametrize("backend", DECODERS)
def test_a_corrupt_code_word_is_named_by_block_and_checksum(backend: str) -> None:
    _need(backend)
    buf = bytearray(_packed_payload())
    _, _, segs = parse(bytes(buf))
    at, n = segs[1]
    buf[at + n - 4] ^= 0x10  # a code word of block 1; the payload checksum made to match
    with pytest.raises(CodecError, match="block 1: packed codes: the block's checksum"):
        decompress(as_tensor(with_checksum(buf)), backend=backend)


@pytest.mark.parametrize("backend", DECODERS)
def test_a_bad_width_is_named(backend: str) -> None:
    _need(backend)
    buf = bytearray(_packed_payload())
    _, _, segs = parse(bytes(buf))
    at, n = segs[1]
    header = np.frombuffer(bytes(buf[at : at + 32]), np.uint32).copy()
    n_esc = int(header[3])
    widths_at = at + 32 + 4 * (2 * n_esc)  # float32 escapes: positions, then values
    buf[widths_at] = 13
    seg = np.frombuffer(bytes(buf[at + 32 : at + n]), np.uint32)
    check = int(host_packed.segment_checksum(seg))
    header[6] = check  # sym_lo | sym_count << 16: the block's checksum
    buf[at : at + 32] = header.tobytes()
    with pytest.raises(CodecError, match="block 1: packed codes: a packed group's width"):
        decompress(as_tensor(with_checksum(buf)), backend=backend)


def test_a_truncated_payload_is_refused() -> None:
    buf = _packed_payload()
    with pytest.raises(CodecError):
        decompress(as_tensor(buf[:-8]))
    with pytest.raises(CodecError, match="block 1"):
        # the last segment one word short, lengths made consistent
        b = bytearray(buf[:-4])
        _, descs, _ = parse(bytes(buf))
        descs = descs.copy()
        descs[1]["seg_words"] -= 1
        b[32 : 32 + 48] = descs.tobytes()
        decompress(as_tensor(with_checksum(b)))


def test_the_packed_bit_on_a_raw_block_is_refused() -> None:
    buf = bytearray(_packed_payload())
    buf[32 + 9] = MODE_PACKED  # block 0 is raw
    with pytest.raises(CodecError, match="block 0"):
        decompress(as_tensor(with_checksum(buf)))


def test_nan_and_inf_travel_exactly() -> None:
    x = torch.randn(50, 8)
    x[3, 3], x[4, 4], x[5, 5] = math.nan, math.inf, -math.inf
    (y,) = decompress(compress([x], [0.01], PACKED))
    _check_bound(x, y, 0.01)


def test_a_planner_yaml_selects_the_packed_format(tmp_path: Path) -> None:
    from torchrec_lossy.config import LossyCommsConfig, load_yaml

    path = tmp_path / "plan.yaml"
    path.write_text("comms:\n  codec:\n    format: packed\n")
    assert load_yaml(LossyCommsConfig, path, "comms").codec.format == "packed"
    path.write_text("comms:\n  codec:\n    format: zstd\n")
    with pytest.raises(ValueError, match=r"codec\.format"):
        load_yaml(LossyCommsConfig, path, "comms")


def _rechecked(buf: bytearray, at: int, n: int) -> bytes:
    """``buf`` with its block at byte ``at`` (``n`` bytes) given a matching block checksum and
    the payload a matching checksum: only the data checks can then refuse it."""
    header = np.frombuffer(bytes(buf[at : at + 32]), np.uint32).copy()
    header[6] = int(
        host_packed.segment_checksum(np.frombuffer(bytes(buf[at + 32 : at + n]), np.uint32))
    )
    buf[at : at + 32] = header.tobytes()
    return with_checksum(buf)


@pytest.mark.parametrize("backend", DECODERS)
def test_a_code_outside_the_alphabet_is_named(backend: str) -> None:
    _need(backend)
    x = torch.arange(-2047.0, 2049.0).reshape(64, 64)  # codes up to 4094: 12-bit groups
    buf = bytearray(compress([x], [0.5], PACKED).numpy().tobytes())
    _, _, segs = parse(bytes(buf))
    at, n = segs[0]
    n_esc = int(np.frombuffer(bytes(buf[at : at + 32]), np.uint32)[3])
    codes_at = at + 32 + 4 * (2 * n_esc + 64 * 64 // 32 // 4)  # past escapes and widths
    word = np.frombuffer(bytes(buf[codes_at : codes_at + 4]), np.uint32)[0] | 0xFFF
    buf[codes_at : codes_at + 4] = np.uint32(word).tobytes()
    with pytest.raises(CodecError, match="block 0: packed codes: a code that is no value"):
        decompress(as_tensor(_rechecked(buf, at, n)), backend=backend)


@pytest.mark.parametrize("backend", DECODERS)
def test_escape_positions_out_of_order_are_named(backend: str) -> None:
    _need(backend)
    x = torch.randn(16, 8)
    x[2, 3], x[9, 1] = math.nan, math.inf
    buf = bytearray(compress([x], [0.01], PACKED).numpy().tobytes())
    _, _, segs = parse(bytes(buf))
    at, n = segs[0]
    pos = np.frombuffer(bytes(buf[at + 32 : at + 40]), np.uint32)
    assert pos.tolist() == [2 * 8 + 3, 9 * 8 + 1]
    buf[at + 32 : at + 40] = pos[::-1].copy().tobytes()
    with pytest.raises(CodecError, match="block 0: packed codes: escape positions"):
        decompress(as_tensor(_rechecked(buf, at, n)), backend=backend)


def _adversarial_blocks() -> tuple[list[torch.Tensor], list[float]]:
    """NaN / Inf, a denormal, an outlier row at 3e38, repeated rows, an all-zero block, one row,
    dim not a multiple of 32, a float16 block and an exact (raw) one."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 37, generator=g)
    x[3], x[7] = x[1], x[1]
    x[5, 3], x[6, 0], x[6, 1] = math.nan, math.inf, -math.inf
    x[9], x[10, 2] = 3e38, 1e-40
    one = torch.randn(1, 64, generator=g)
    half = torch.randn(33, 5, generator=g).half()
    blocks = [x, torch.zeros(5, 8), one, half, x[:20].clone(), torch.randn(4, 3, generator=g)]
    return blocks, [0.01, 0.1, 0.05, 0.01, 0.05, 0.0]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_device_decoder_gives_the_host_bits(backend: str) -> None:
    """The device path (triton in the interpreter, or the torch twins) decodes a packed payload
    to the host decoder's bits, alone and grouped from the announced skeletons (no read)."""
    _need(backend)
    blocks, bounds = _adversarial_blocks()
    payload = compress(blocks, bounds, PACKED)
    want = decompress(payload, backend="cpu")
    for y, w, x, eb in zip(decompress(payload, backend=backend), want, blocks, bounds, strict=True):
        assert torch.equal(y.view(torch.uint8), w.view(torch.uint8))
        _check_bound(x, y, eb)
    grouped = compress_groups([blocks[:2], blocks[2:]], [bounds[:2], bounds[2:]], PACKED)
    got, status = decompress_groups(
        grouped.buffer, grouped.sizes, backend=backend, skeletons=grouped.skeletons
    )
    check_groups(status)
    for y, w in zip(got[0] + got[1], want, strict=True):
        assert torch.equal(y.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kind", [BoundKind.ABSOLUTE, BoundKind.RELATIVE, BoundKind.VALUE])
def test_the_device_encoder_writes_the_host_bytes(backend: str, kind: BoundKind) -> None:
    """The device compress (triton in the interpreter, or the torch twins) writes the host
    encoder's bytes and stats on adversarial blocks (NaN / Inf, a denormal, a 3e38 outlier row,
    repeated rows, dim 37, float16 / bfloat16) under every bound kind, grouped; they decode
    within the bound."""
    _need(backend)
    blocks, _ = _adversarial_blocks()
    blocks = [*blocks, blocks[0].bfloat16(), blocks[0].half()]
    eb = {BoundKind.ABSOLUTE: 0.01, BoundKind.RELATIVE: 0.02, BoundKind.VALUE: 0.01}[kind]
    groups = [blocks[:3], [], blocks[3:]]
    bounds = [[eb] * len(g) for g in groups]
    kinds = [[int(kind)] * len(g) for g in groups]
    want = compress_groups(groups, bounds, CodecConfig(format="packed", backend="cpu"), kinds)
    got = compress_groups(groups, bounds, CodecConfig(format="packed", backend=backend), kinds)
    assert got.sizes == want.sizes and torch.equal(got.buffer, want.buffer)
    assert got.stats == want.stats
    out, status = decompress_groups(got.buffer, got.sizes)
    check_groups(status)
    for group, dec, stats in zip(groups, out, got.stats, strict=True):
        for x, y, s in zip(group, dec, stats, strict=True):
            if kind == BoundKind.VALUE:
                fin = torch.isfinite(x)
                err = (x.double() - y.double()).abs()[fin]
                assert bool((err <= eb * x.double().abs()[fin]).all())
            else:
                _check_bound(x, y, s.bound)


def test_the_encode_launches_equal_their_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Triton launch of the packed device compress (``quantize.block_grids``,
    ``packed.stream_plan``, ``put_data``) gives its torch twin's outputs and words (the grid
    fields it writes into the record, ``put_data`` the words' checksum sums), call by call on
    the production inputs (adversarial blocks, every bound kind, raw, lossless lz and repeated
    rows), so the twins
    are each kernel's oracle, not just the payload's."""
    pytest.importorskip("triton", reason="triton is not installed")
    from torchrec_lossy.kernels import packed as k_packed
    from torchrec_lossy.kernels import quantize as k_quantize
    from torchrec_lossy.kernels import quantize_ref

    calls: dict[str, int] = {}

    def spy(mod: object, name: str, twin: object, writes: bool) -> None:
        kernel = getattr(mod, name)

        def call(*args: object) -> object:
            calls[name] = calls.get(name, 0) + 1
            if writes:  # the argument written in place: the payload words, or the record
                at = 1 if name == "block_grids" else 0
                target = args[at]
                mine = target._replace(cols=target.cols.clone()) if at else target.clone()
                want = twin(*args[:at], mine, *args[at + 1 :])
                got = kernel(*args)
                assert torch.equal(target.cols if at else target, mine.cols if at else mine), name
                assert torch.equal(got, want), f"{name}: its outputs"
                return got
            got, want = kernel(*args), twin(*args)
            for g, w in zip(got, want, strict=True):  # floats bit for bit (signed zeros)
                bits = torch.int32 if g.is_floating_point() else g.dtype
                assert torch.equal(g.view(bits), w.view(bits)), name
            return got

        monkeypatch.setattr(mod, name, call)

    spy(k_quantize, "block_grids", quantize_ref.block_grids, True)
    spy(k_packed, "stream_plan", packed_ref.stream_plan, False)
    spy(k_packed, "put_data", packed_ref.put_data, True)
    blocks, _ = _adversarial_blocks()
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn(40, 8, generator=gen)  # incompressible at bound 0: raw
    reps = torch.randn(3, 8, generator=gen)[torch.arange(60) % 3].half()  # lossless lz
    blocks = [*blocks, blocks[0].bfloat16(), noise, reps]
    for kind in (BoundKind.ABSOLUTE, BoundKind.RELATIVE, BoundKind.VALUE):
        bounds = [0.0 if b is noise or b is reps else 0.02 for b in blocks]
        kinds = [int(BoundKind.ABSOLUTE) if e == 0.0 else int(kind) for e in bounds]
        config = CodecConfig(format="packed", backend="triton")
        got = compress_groups([blocks], [bounds], config, [kinds])
        want = compress_groups([blocks], [bounds], CodecConfig(format="packed"), [kinds])
        assert torch.equal(got.buffer, want.buffer)
        modes = {s.mode for s in got.stats[0]}
        assert {"raw", "lz"} <= modes, modes  # raw and lossless lz blocks were written too
    assert calls == {"block_grids": 3, "stream_plan": 3, "put_data": 3}
