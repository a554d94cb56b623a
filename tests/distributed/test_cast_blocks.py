"""The fp16 / bf16 casts of the pooled all-to-all (distributed/cast_blocks.py): each block's
admission on its own data against its bound (never a block past it), the flags, and the
payload through the encoder and the decoder: exact byte counts, cast blocks within their bound,
refused ones bit-exact, on the host path and on the device path's orchestration."""

from __future__ import annotations

import math

import pytest
import torch

from torchrec_lossy.config import (
    CodecConfig,
    ConfigError,
    ErrorBound,
    LossyCommsConfig,
    TableCodecConfig,
)
from torchrec_lossy.distributed import BlockSpec, LossyComms, StaticBounds
from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.cast_blocks import (
    admissible,
    cast_tables,
    flag_words,
    max_cast_error,
    pack_flags,
    unpack_flags,
)
from torchrec_lossy.distributed.pooled_blocks import (
    LossyAll2AllPooledInfo,
    cut_block,
    layout_plans,
    size_entry_words,
)
from torchrec_lossy.distributed.pooled_decode import decode_payloads
from torchrec_lossy.distributed.pooled_payload import padded_size, start_encode

FP16, BF16 = torch.float16, torch.bfloat16
REL, VALUE, ABS = (
    ErrorBound("relative", 0.01),
    ErrorBound("value", 0.03125),
    ErrorBound("absolute", 1e-3),
)


def _true_error_ok(b: torch.Tensor, dt: torch.dtype, eb: ErrorBound) -> bool:
    """Whether the cast of ``b`` really is within ``eb`` (float64, every finite element)."""
    return _within(b, b.to(dt), eb)


def _within(b: torch.Tensor, got: torch.Tensor, eb: ErrorBound) -> bool:
    """Whether ``got`` is within ``eb`` of ``b`` (float64, every finite element)."""
    x = b.double()
    err = (got.double() - x).abs()
    fin = torch.isfinite(x)
    if not fin.any():
        return True
    err, x = err[fin], x[fin]
    if eb.mode == "value":
        return bool((err <= eb.value * x.abs()).all())
    bound = eb.value
    if eb.mode == "relative":
        bound = eb.value * float(x.max() - x.min())
    return bool((err <= bound).all())


@pytest.mark.parametrize("dt", [FP16, BF16])
def test_admitted_blocks_are_within_their_bound(dt: torch.dtype) -> None:
    """Over varied blocks, every admitted cast is truly within its bound, and the plain
    embedding-like ones are admitted (the check is not vacuous)."""
    gen = torch.Generator().manual_seed(0)
    blocks, bounds = [], []
    for scale in (1e-6, 1e-3, 0.05, 1.0, 300.0, 7e4, 1e6):
        for shift in (0.0, 10.0 * scale):
            b = torch.randn(32, 8, generator=gen) * scale + shift
            for eb in (REL, VALUE, ABS, ErrorBound("relative", 0.001)):
                blocks.append(b)
                bounds.append(eb)
    flags = admissible(blocks, [dt] * len(blocks), bounds).tolist()
    # The device's torch ops decide as the host's compiled kernels do.
    assert admissible(blocks, [dt] * len(blocks), bounds, host=False).tolist() == flags
    for b, eb, f in zip(blocks, bounds, flags, strict=True):
        if f:
            assert _true_error_ok(b, dt, eb), (dt, eb, float(b.abs().max()))
    plain = [
        f
        for b, eb, f in zip(blocks, bounds, flags, strict=True)
        if eb in (REL, VALUE) and 0.04 < float(b.abs().max()) < 10 and b.mean().abs() < 1
    ]
    assert plain and all(plain)


def test_refused_blocks() -> None:
    """fp16 overflow and flush, a range tiny against the magnitude, an outlier under a
    relative bound, a lossless bound: each refused; an all-zero block casts (exactly)."""
    x = torch.randn(64, 4)
    tiny = x.clone()
    tiny[0, 0] = 1e-6  # fp16 subnormal: per value it would err by ~3%
    outlier = x.clone()
    outlier[0, 0] = 1e5  # the codec's rule: an outlier's bound is the inliers' range
    cases = [
        (x * 1e5, FP16, VALUE, 0),  # overflows fp16
        (x * 1e5, BF16, VALUE, 1),  # bf16 has float32's range
        (tiny, FP16, VALUE, 0),
        (tiny, FP16, REL, 1),  # its absolute error is 2**-25 at most: within 1% of the range
        (x + 1000.0, BF16, REL, 0),  # range ~8 vs 1000: 4 > 0.08
        (x + 1000.0, BF16, VALUE, 1),
        (outlier, BF16, ErrorBound("relative", 0.5), 0),
        (x, FP16, ErrorBound("relative", 0.0), 0),
        (torch.zeros(8, 4), FP16, ErrorBound("relative", 0.0), 1),
        (x, BF16, ErrorBound("value", 2.0**-9), 0),  # bf16 errs up to 2**-8 of a value
        (x, FP16, ErrorBound("value", 2.0**-9), 1),
    ]
    for host in (True, False):
        got = admissible([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases], host)
        assert got.tolist() == [c[3] for c in cases], host


def test_nan_inf_do_not_hide_a_bound() -> None:
    """Non-finite elements stay what they are through a cast; the finite ones decide (per value,
    a NaN sends its block exactly)."""
    x = torch.randn(16, 4)
    x[0, 0], x[1, 1], x[2, 2] = math.nan, math.inf, -math.inf
    big = x.clone()
    big[3, 3] = 7e4  # finite past fp16's range
    for host in (True, False):
        # A relative bound over the finite elements; per value a NaN refuses the block.
        got = admissible([x, big, x, big], [FP16] * 4, [REL, REL, VALUE, VALUE], host)
        assert got.tolist() == [1, 0, 0, 0], host
        fin = x.clone()
        fin[0, 0] = 0.0
        assert admissible([fin], [FP16], [VALUE], host).tolist() == [1], host
    back = x.to(FP16).float()
    assert math.isnan(back[0, 0]) and back[1, 1] == math.inf and back[2, 2] == -math.inf


def test_max_cast_error_is_half_an_ulp() -> None:
    amax = torch.tensor([0.0, 1.0, 1.5, 3e-7, 65504.0])
    assert max_cast_error(amax, FP16).tolist() == [0.0, 2.0**-11, 2.0**-11, 2.0**-25, 16.0]
    assert max_cast_error(amax, BF16).tolist()[1:3] == [2.0**-8, 2.0**-8]


def test_flag_words_roundtrip() -> None:
    flags = torch.tensor([1, 0, 1] + [0] * 30 + [1])
    words = flag_words(flags)
    assert words.tolist() == [5, 2] == pack_flags([bool(f) for f in flags.tolist()])
    assert unpack_flags(words.tolist(), 34) == [bool(f) for f in flags.tolist()]
    with pytest.raises(ValueError, match="past block"):
        unpack_flags([1 << 5], 3)
    with pytest.raises(ValueError, match="flag words"):
        unpack_flags([1], 40)


SPECS = (BlockSpec("a", 0, 2, 4), BlockSpec("b", 8, 1, 6), BlockSpec("c", 14, 3, 2))


def _info(config: LossyCommsConfig, n_peers: int) -> LossyAll2AllPooledInfo:
    tables = ["a", "b", "c"]
    comms = LossyComms(config=config, bounds=StaticBounds(tables, config))
    return LossyAll2AllPooledInfo(
        batch_size_per_rank=[0] * n_peers,
        layout=[SPECS] * n_peers,
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(tables),
        casts=cast_tables(config, tables),
    )


def _config(backend: str = "cpu") -> LossyCommsConfig:
    return LossyCommsConfig(
        format="entropy",
        codec=CodecConfig(backend=backend),  # type: ignore[arg-type]
        default_bound=ErrorBound("relative", 0.01),
        tables={"a": TableCodecConfig(format="fp16"), "c": TableCodecConfig(format="bf16")},
        error_sample_every=1,
    )


def test_config_resolves_cast_tables() -> None:
    config = _config()
    assert cast_tables(config, ["a", "b", "c"]) == {"a": FP16, "c": BF16}
    assert [config.table(t).compress for t in "abc"] == [False, True, False]
    assert LossyCommsConfig(format="bf16").table("x").format == "bf16"
    with pytest.raises(ConfigError, match="format"):
        LossyCommsConfig(format="fp8")  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_payload_roundtrip_exact_bytes(backend: str) -> None:
    """Cast blocks travel in half the bytes and within their bound, a refused one exactly, the
    codec's blocks as ever; the flags in the size entry and in the payload agree; the device
    path's orchestration (flags read with the exchange's one read) sends the same bytes."""
    info = _info(_config(backend), 2)
    rows = [5, 3]
    x = torch.randn(sum(rows), 20)
    x[5:, 0:8] += 1000.0  # peer 1's block of table a: its range is tiny against 1000
    sent = [[cut_block(x, r0, n, 0, s) for s in SPECS] for r0, n in ((0, 5), (5, 3))]
    pending = start_encode("fwd", sent, [SPECS, SPECS], info, x.device)
    payloads = pending.read()
    meta = pending.meta.tolist()
    assert pending.meta_splits == [size_entry_words(SPECS, info, p, -1) for p in range(2)]
    # Peer 0: a cast (fp16, 10x4 values) and c cast (bf16, 15x2); peer 1: a refused (6x4 fp32).
    a0, c0 = padded_size(10 * 4 * 2), padded_size(15 * 2 * 2)
    a1, c1 = padded_size(6 * 4 * 4), padded_size(9 * 2 * 2)
    prefix = 16  # one flag word, padded
    codec = [
        p.numel() - n for p, n in zip(payloads, (prefix + a0 + c0, prefix + a1 + c1), strict=True)
    ]
    assert all(c > 0 for c in codec)  # table b went through the codec
    at = [0, pending.meta_splits[0]]
    assert [meta[a] for a in at] == [p.numel() for p in payloads]
    assert [meta[a + 1] for a in at] == [0b11, 0b10]  # bit k: the k-th cast block cast
    assert [int(p[:8].view(torch.int64)) for p in payloads] == [0b11, 0b10]
    stats = info.comms.stats.tables("fwd")
    assert stats["a"].wire_bytes == a0 + a1 and stats["c"].wire_bytes == c0 + c1
    recv = torch.cat(payloads)
    got = decode_payloads("fwd", recv, [p.numel() for p in payloads], [SPECS] * 2, rows, info, 0)
    for blocks_in, blocks_out in zip(sent, got, strict=True):
        for s, b_in, b_out in zip(SPECS, blocks_in, blocks_out, strict=True):
            assert b_out.dtype == torch.float32 and b_out.shape == b_in.shape
            if s.table in ("a", "c"):
                assert _within(b_in, b_out, REL)
    assert torch.equal(got[1][0], sent[1][0])  # refused: bit-exact
    assert torch.equal(got[0][0], sent[0][0].to(FP16).float())
    assert torch.equal(got[0][2], sent[0][2].to(BF16).float())
    assert 0 < info.comms.stats.tables("fwd")["a"].max_error < 2.0**-11 * 3


def test_exact_call_sends_no_cast() -> None:
    """An exact forward (evaluation) sends every block of a cast table exactly."""
    info = _info(_config(), 1)
    info.exact_forward = True
    x = torch.randn(4, 20)
    blocks = [[cut_block(x, 0, 4, 0, s) for s in SPECS]]
    record = info.ledger.start("fwd", True)
    payload = start_encode("fwd", blocks, [SPECS], info, x.device, record=record).read()[0]
    assert int(payload[:8].view(torch.int64)) == 0
    got = decode_payloads("fwd", payload, [payload.numel()], [SPECS], [4], info, 0)
    assert all(torch.equal(a, b) for a, b in zip(got[0], blocks[0], strict=True))


def test_layout_plans_count_the_flag_words() -> None:
    info = _info(_config(), 3)
    info.raw_peers = frozenset({2})
    plans = layout_plans([SPECS] * 3, info.compress, 0, info.raw_peers, info.casts)
    # Peer 1: size, a flag word, b's skeleton; peer 2 (a raw peer): its size only.
    want = tuple(size_entry_words(SPECS, info, p, 0) for p in range(3))
    assert plans.send_own.meta_splits == want and want[2] == 1 and want[1] > 2
    assert plans.send_own.casts == (FP16, BF16, None, None, None)  # peer 1: a, c; peer 2 raw


def test_chunked_encode_casts_as_the_unchunked() -> None:
    """The chunked exchange's encoder (pooled_payload.CallEncoder) admits and casts each
    chunk's blocks of cast tables as the whole call's encode does: the same payloads."""
    from torchrec_lossy.distributed.call_ledger import CallRecord
    from torchrec_lossy.distributed.exchange_record import ExchangeRecord
    from torchrec_lossy.distributed.pooled_payload import start_call_encoder

    world, rank = 4, 1
    info = _info(_config(), world)
    info.raw_peers = frozenset({3})
    specs = [SPECS] * world
    g = torch.Generator().manual_seed(0)
    blocks = [[torch.randn(9 * s.num_features, s.dim, generator=g) for s in SPECS] for _ in specs]
    blocks[2][0] += 1000.0  # peer 2's block of table a: refused, sent exactly
    record = CallRecord("fwd", 5, None)
    want = start_encode("fwd", blocks, specs, info, torch.device("cpu"), rank, record).read()
    tele = ExchangeRecord("fwd")
    enc = start_call_encoder("fwd", blocks, specs, info, torch.device("cpu"), rank, record, tele)
    got = [torch.empty(0, dtype=torch.uint8)] * world
    for dests in ([2], [0, 3]):
        payloads = enc.encode(dests)
        for p in dests:
            got[p] = payloads[p]
    for p in range(world):
        assert torch.equal(got[p], want[p]), p
    assert [int(want[p][:8].view(torch.int64)) for p in (0, 2)] == [0b11, 0b10]
