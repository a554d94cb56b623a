"""Single-process tests of the dist building blocks: blocks, payload framing, bounds, telemetry."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch

from torchrec_lossy.codec import compress_groups, decompress_groups
from torchrec_lossy.config import CodecConfig, ErrorBound, LossyCommsConfig, TableCodecConfig
from torchrec_lossy.distributed import (
    BlockSpec,
    BoundProvider,
    LossyAllToAllError,
    LossyComms,
    LossyCommsStats,
    LossyEmbeddingBagCollectionSharder,
    StaticBounds,
    error_sample,
)
from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.pooled_blocks import (
    LossyAll2AllPooledInfo,
    cut_block,
    cut_blocks,
    expand_block,
    expand_blocks,
    expand_index,
    join_blocks,
    layout_plans,
    place_grad_block,
    place_grad_blocks,
    reduce_grad_block,
    reduce_grad_blocks,
)
from torchrec_lossy.distributed.pooled_decode import decode_payloads
from torchrec_lossy.distributed.pooled_payload import abs_bounds, start_encode, warm_up_host
from torchrec_lossy.distributed.sharder import check_bound_provider
from torchrec_lossy.distributed.stats import CONTAINER, ErrorSample

SPECS = (BlockSpec("a", 0, 2, 4), BlockSpec("b", 8, 1, 6), BlockSpec("c", 14, 3, 2))


def _info(config: LossyCommsConfig, layout: list[tuple[BlockSpec, ...]]) -> LossyAll2AllPooledInfo:
    comms = LossyComms(config=config, bounds=StaticBounds(["a", "b", "c"], config))
    return LossyAll2AllPooledInfo(
        batch_size_per_rank=[0] * len(layout),
        layout=layout,
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(["a", "b", "c"]),
    )


def test_cut_and_join_blocks_roundtrip() -> None:
    x = torch.randn(7, 20)
    blocks = [cut_block(x, 2, 4, 0, s) for s in SPECS]
    assert [tuple(b.shape) for b in blocks] == [(8, 4), (4, 6), (12, 2)]
    # Rows of a block are whole embedding vectors: feature 1 of table a is columns 4..8.
    assert torch.equal(blocks[0][4:8], x[2:6, 4:8])
    assert torch.equal(torch.cat(join_blocks(blocks, SPECS, 4), dim=1), x[2:6])


def _dedupe_feats(rows: int, n: int, gen: torch.Generator) -> list[tuple[int, torch.Tensor]]:
    """``n`` features' (distinct bags, inverse) and (distinct bags, first bag), alternating
    with a feature that is not deduplicated."""
    out = []
    for f in range(n):
        if f % 3 == 1:
            out.append(((rows, None), (rows, None)))
            continue
        uniq, inv = torch.unique(torch.randint(0, 5, (rows,), generator=gen), return_inverse=True)
        first = torch.full((uniq.numel(),), rows).scatter_reduce_(
            0, inv, torch.arange(rows), reduce="amin"
        )
        out.append(((uniq.numel(), inv), (uniq.numel(), first)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("mixed", [False, True])
def test_batched_geometry_is_bit_identical_to_per_block(mixed: bool) -> None:
    """The batched expand / reduce / place (one gather, one index_add_, one index_copy_ where
    every feature has one dim) and the cut's one gather equal the per-block functions bit for
    bit, -0.0 included, whether each call builds its index or reuses the forward's (the
    backward of comm_ops.PooledSteps); mixed dims take the per-block path."""
    gen = torch.Generator().manual_seed(3)
    rows = [6, 9]
    dims = (2, 2, 3) if mixed else (4, 4, 4)
    specs = [BlockSpec("a", 0, 2, dims[0]), BlockSpec("b", 2 * dims[0], 3, dims[1])]
    specs = [*specs, BlockSpec("c", specs[1].col_offset + specs[1].width, 1, dims[2])]
    width = sum(s.width for s in specs)
    feats = [[_dedupe_feats(n, s.num_features, gen) for s in specs] for n in rows]

    def signed(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen)
        return torch.where(t.abs() < 0.3, torch.tensor(-0.0), t)

    # Owner side: cut each peer's distinct bags, place the gradient blocks back.
    x = signed(sum(rows), width)
    cut = [
        [cut_block(x, r0, n, 0, s, [f[1] for f in ff]) for s, ff in zip(specs, fs, strict=True)]
        for r0, n, fs in zip((0, rows[0]), rows, feats, strict=True)
    ]
    for bs, r0, n, fs in zip(cut, (0, rows[0]), rows, feats, strict=True):
        for b, s, ff in zip(bs, specs, fs, strict=True):
            d, c = s.dim, s.col_offset
            cols = [x[r0 : r0 + n, c + f * d : c + (f + 1) * d] for f in range(s.num_features)]
            want = [
                col[:r] if sel is None else col[sel]
                for col, (_, (r, sel)) in zip(cols, ff, strict=True)
            ]
            assert torch.equal(_bits(b), _bits(torch.cat(want)))
    # One destination's blocks at once (one gather where every feature has one dim).
    batched = [
        cut_blocks(x, r0, n, specs, [[f[1] for f in ff] for ff in fs])
        for r0, n, fs in zip((0, rows[0]), rows, feats, strict=True)
    ]
    for (bs, idx), want_bs in zip(batched, cut, strict=True):
        assert (idx is None) == mixed
        assert [_bits(b).tolist() for b in bs] == [_bits(b).tolist() for b in want_bs]
    placed = place_grad_blocks(
        cut, specs, [[[f[1] for f in ff] for ff in fs] for fs in feats], rows
    )
    reused = place_grad_blocks(
        cut, specs, [[[f[1] for f in ff] for ff in fs] for fs in feats], rows,
        [idx for _, idx in batched],
    )  # fmt: skip
    assert torch.equal(_bits(reused), _bits(placed))
    per_block = torch.cat(
        [
            torch.cat(
                [
                    place_grad_block(b, s, n, [f[1] for f in ff])
                    for b, s, ff in zip(bs, specs, fs, strict=True)
                ],
                1,
            )
            for bs, n, fs in zip(cut, rows, feats, strict=True)
        ]
    )
    assert torch.equal(_bits(placed), _bits(per_block))
    # Receiver side (rank 0, batch 6): expand what both owners sent, reduce the gradient.
    layout = [specs, specs]
    inv = [[[f[0] for f in _dedupe_feats(rows[0], s.num_features, gen)] for s in specs]] * 2
    got = [
        [signed(sum(r for r, _ in ff), s.dim) for s, ff in zip(specs, fs, strict=True)]
        for fs in inv
    ]
    per_block = [
        expand_block(b, s, rows[0], ff)
        for bs, fs in zip(got, inv, strict=True)
        for b, s, ff in zip(bs, specs, fs, strict=True)
    ]
    index = None if mixed else expand_index(inv, rows[0], x.device)
    for idx in (None, index):
        expanded = expand_blocks(got, layout, inv, rows[0], idx)
        assert torch.equal(_bits(expanded), _bits(torch.cat(per_block, 1)))
    grad = signed(2 * width, rows[0]).t()  # not contiguous, as autograd may hand it
    for idx in (None, index):
        reduced = reduce_grad_blocks(grad, layout, inv, idx)
        for p, (bs, fs) in enumerate(zip(reduced, inv, strict=True)):
            for b, s, ff in zip(bs, specs, fs, strict=True):
                assert torch.equal(_bits(b), _bits(reduce_grad_block(grad, p * width, s, ff)))


def test_abs_bounds_relative_to_finite_range() -> None:
    b = torch.tensor([[1.0, float("inf")], [float("nan"), 3.0]])
    bounds = [ErrorBound("relative", 0.1), ErrorBound("absolute", 0.5), ErrorBound("relative", 0)]
    got = abs_bounds([b, b, b], bounds)
    assert got == pytest.approx([0.2, 0.5, 0.0])
    empty = torch.empty(0, 3)
    assert abs_bounds([empty], [ErrorBound("relative", 0.1)]) == [0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_payloads_roundtrip_within_bounds(dtype: torch.dtype) -> None:
    config = LossyCommsConfig(
        default_bound=ErrorBound("relative", 0.05),
        tables={
            "b": TableCodecConfig(compress=False),
            "c": TableCodecConfig(bound=ErrorBound("absolute", 0.01)),
        },
    )
    info = _info(config, [SPECS, SPECS])
    info.dtype = dtype
    rows = [5, 3]
    x = torch.randn(sum(rows), 20).to(dtype)
    x[0, 0] = float("nan")
    sent = [[cut_block(x, r0, n, 0, s) for s in SPECS] for r0, n in ((0, 5), (5, 3))]
    payloads = start_encode("fwd", sent, [SPECS, SPECS], info, x.device).read()
    recv = torch.cat(payloads)
    got = decode_payloads("fwd", recv, [p.numel() for p in payloads], [SPECS] * 2, rows, info, 0)
    stats = info.comms.stats
    assert stats.total("fwd").wire_bytes == recv.numel()
    for blocks_in, blocks_out in zip(sent, got, strict=True):
        for s, b_in, b_out in zip(SPECS, blocks_in, blocks_out, strict=True):
            assert b_out.dtype == dtype and b_out.shape == b_in.shape
            assert torch.equal(b_in.isnan(), b_out.isnan())
            err = (b_in.float() - b_out.float()).nan_to_num().abs().max().item()
            fin = b_in.float()[b_in.isfinite()]
            bound = {"a": 0.05 * (fin.max() - fin.min()).item(), "b": 0.0, "c": 0.01}[s.table]
            assert err <= bound * (1 + 1e-6), (s.table, err, bound)
    b = stats.table("b", "fwd")  # raw, each block padded to 16 bytes
    assert b.raw_bytes <= b.wire_bytes < b.raw_bytes + 16 * b.blocks and b.max_error == 0
    assert stats.table("a", "fwd").max_error_over_bound <= 1.0
    assert stats.table(CONTAINER, "fwd").wire_bytes > 0
    # The first call's errors were sampled: table a's RMS error / RMS value and the values
    # snapped to zero, over its finite elements, as the decoded blocks show.
    a_in = torch.cat([blocks[0].float().reshape(-1) for blocks in sent])
    a_out = torch.cat([blocks[0].float().reshape(-1) for blocks in got])
    fin = a_in.isfinite()
    a_in, a_out = a_in[fin].double(), a_out[fin].double()
    a = stats.table("a", "fwd")
    assert a.error_count == a_in.numel()
    rel = ((a_out - a_in).pow(2).sum() / a_in.pow(2).sum()).sqrt().item()
    assert a.relative_rms_error == pytest.approx(rel, rel=1e-9)
    # Every error is within 5% of the block's range (table a's blocks: at most the union's).
    rms = a_in.pow(2).mean().sqrt().item()
    assert 0 < rel <= 0.05 * (a_in.max() - a_in.min()).item() / rms
    assert a.snapped_to_zero == int(((a_in != 0) & (a_out == 0)).sum()) > 0
    assert math.isnan(stats.table("b", "fwd").relative_rms_error)  # raw: not sampled


def test_error_sample_sums_each_block_over_its_finite_errors() -> None:
    """The sender's error sample: per block, its sums over the elements whose error is finite
    (NaN and Inf left out) as the decoded blocks give them, float16 blocks alike; the CPU
    all-to-all's warm-up loads its compiled pass."""
    torch.manual_seed(0)
    a = torch.randn(64, 8)
    a[0, 0], a[1, 1], a[2, :] = float("nan"), float("inf"), 1e-3  # row 2 snaps to 0
    b = (torch.randn(32, 4) * 4).half()
    payloads = compress_groups([[a, b]], [[0.05, 0.01]])
    payload = payloads.buffer[: payloads.sizes[0]]
    stats = LossyCommsStats()
    error_sample.record_error_samples(stats, "fwd", payload, [a, b], ["a", "b"])
    decoded, _ = decompress_groups(payload, [payload.numel()])
    for name, x, y in zip("ab", (a, b), decoded[0], strict=True):
        x, y = x.double().reshape(-1), y.double().reshape(-1)
        fin = (y - x).isfinite()
        x, y = x[fin], y[fin]
        got = stats.table(name, "fwd")
        assert got.error_count == x.numel() == fin.numel() - 2 * (name == "a")
        assert got.error_sum == pytest.approx(float((y - x).sum()), rel=1e-12, abs=1e-12)
        assert got.error_sq_sum == pytest.approx(float((y - x).pow(2).sum()), rel=1e-12)
        assert got.value_sq_sum == pytest.approx(float(x.pow(2).sum()), rel=1e-12)
        assert got.snapped_to_zero == int(((x != 0) & (y == 0)).sum())
    assert stats.table("a", "fwd").snapped_to_zero >= 8
    warm_up_host()
    assert error_sample._error_sums_kernel.signatures  # loaded before any training step


def test_stochastic_forward_draws_afresh_per_call_and_reruns_reproduce() -> None:
    """``codec.rounding: stochastic`` in the forward: each call draws its own rounding (a seed
    fixed across calls would round every position the same way every step), within the bound,
    and a rerun from the same state draws the same; a nearest backward stays nearest."""
    config = LossyCommsConfig(
        default_bound=ErrorBound("relative", 0.05), codec=CodecConfig(rounding="stochastic")
    )
    x = torch.randn(64, 20)
    blocks = [[cut_block(x, 0, 64, 0, s) for s in SPECS]]

    def run(info: LossyAll2AllPooledInfo, direction: str = "fwd") -> torch.Tensor:
        record = info.ledger.start(direction)  # as the exchange draws it
        payloads = start_encode(direction, blocks, [SPECS], info, x.device, record=record).read()
        got = decode_payloads(direction, payloads[0], [payloads[0].numel()], [SPECS], [64], info, 0)
        return got[0][0]

    info = _info(config, [SPECS])
    first, second = run(info), run(info)
    assert not torch.equal(first, second)  # another call, other draws
    assert torch.equal(run(_info(config, [SPECS])), first)  # a rerun draws the same
    a = blocks[0][0]
    assert float((first - a).abs().max()) <= 0.05 * float(a.max() - a.min()) * (1 + 1e-6)
    # The backward (nearest by default) is deterministic: two calls decode alike.
    assert torch.equal(run(info, "bwd"), run(info, "bwd"))


def test_a_call_encodes_from_its_own_record() -> None:
    """Each call draws an immutable record from the module's ledger (its number per direction,
    the step); the encode reads the seed and the exactness from the record alone: the same
    record encodes the same bytes, an exact record travels lossless."""
    from torchrec_lossy.distributed.call_ledger import CallRecord

    ledger = CallLedger()
    assert ledger.start("fwd") == CallRecord("fwd", 0, None)
    ledger.end_step()
    assert (ledger.start("fwd").call, ledger.start("bwd").call, ledger.start("fwd").step) == (
        1,
        0,
        1,
    )
    with pytest.raises(AttributeError):
        CallRecord("fwd", 0, None).call = 1  # type: ignore[misc]
    config = LossyCommsConfig(
        default_bound=ErrorBound("relative", 0.05), codec=CodecConfig(rounding="stochastic")
    )
    x = torch.randn(64, 20)
    blocks = [[cut_block(x, 0, 64, 0, s) for s in SPECS]]
    info = _info(config, [SPECS])

    def encode(record: CallRecord) -> torch.Tensor:
        return start_encode("fwd", blocks, [SPECS], info, x.device, record=record).read()[0]

    record = CallRecord("fwd", 3, None)
    assert torch.equal(encode(record), encode(record))
    assert not torch.equal(encode(record), encode(CallRecord("fwd", 4, None)))
    exact = encode(CallRecord("fwd", 3, None, exact=True))
    got = decode_payloads("fwd", exact, [exact.numel()], [SPECS], [64], info, 0)
    assert all(torch.equal(g, b) for g, b in zip(got[0], blocks[0], strict=True))
    assert info.ledger.start("fwd").call == 0  # records passed in draw nothing


def test_each_direction_picks_its_wire_and_a_cast_wire_gives_blocks_back() -> None:
    """The forward always travels through the codec, the backward through
    ``LossyCommsConfig.backward``'s wire; a cast wire's receive splits the elements of every
    source into its blocks and casts them back to the call's dtype."""
    from torchrec_lossy.distributed.exchange import LOSSY_WIRE, CastWire, Geometry, wire_for
    from torchrec_lossy.distributed.exchange_record import ExchangeRecord

    for backward in ("lossy", "fp16", "bf16", "none"):
        config = LossyCommsConfig(backward=backward)
        assert wire_for("fwd", config, torch.float32, "t") is LOSSY_WIRE
    pick = {b: wire_for("bwd", LossyCommsConfig(backward=b), torch.float32, "t") for b in
            ("lossy", "fp16", "bf16", "none")}  # fmt: skip
    assert pick["lossy"] is LOSSY_WIRE
    assert pick["fp16"] == CastWire(torch.float16, True, "t")
    assert pick["bf16"] == CastWire(torch.bfloat16, True, "t")
    assert pick["none"] == CastWire(torch.float32, False, "t")
    info = _info(LossyCommsConfig(backward="fp16"), [SPECS, SPECS])
    rows = [[3, 2, 1], [0, 4, 2]]
    want = [[torch.randn(r, s.dim) for r, s in zip(rs, SPECS, strict=True)] for rs in rows]
    recv = torch.cat([b.reshape(-1) for bs in want for b in bs]).half()
    telemetry = ExchangeRecord("bwd")
    got = pick["fp16"].receive(
        "bwd", recv, Geometry([SPECS] * 2, [SPECS] * 2, rows, rows), info, None, 0, telemetry
    )  # type: ignore[arg-type]
    for gs, ws in zip(got, want, strict=True):
        for g, w in zip(gs, ws, strict=True):
            assert g.dtype == torch.float32 and torch.equal(g, w.half().float())
    # The wire fills the call's record (wire bytes per table) and writes no telemetry itself.
    assert telemetry.decode_shares == {"a": (3 + 0) * 4 * 2, "b": (2 + 4) * 6 * 2, "c": 3 * 2 * 2}
    assert info.comms.stats.total("bwd").decode_s == 0.0
    telemetry.write(info.comms.stats)
    assert telemetry.decode_s > 0.0
    assert info.comms.stats.total("bwd").decode_s == pytest.approx(telemetry.decode_s)


def test_backward_payloads_stochastic_bad_input_and_exact_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The stochastic backward: within the bound, unbiased in sum, seeded per call (so two calls
    differ and a rerun does not), NaN / Inf exactly, a block whose bound cannot be met exactly
    and logged once per table; the sampled signed error is recorded."""
    assert LossyCommsConfig().backward == "lossy"  # the default backward is the codec
    # Stochastic rounding needs a relative or absolute bound (the per-value default refuses it).
    config = LossyCommsConfig(
        tables={"c": TableCodecConfig(compress=False)},
        backward_bound=ErrorBound("relative", 0.01),
        backward_rounding="stochastic",
    )
    specs = (BlockSpec("a", 0, 1, 16), BlockSpec("b", 16, 1, 16), BlockSpec("c", 32, 1, 4))
    g = torch.randn(256, 36) * 1e-3
    g[0, 0], g[1, 1], g[2, 2] = float("nan"), float("inf"), -float("inf")
    g[:, 16:32] *= 1e-42  # table b: subnormal gradients, the relative bound is below any step

    def run(info: LossyAll2AllPooledInfo) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        blocks = [[cut_block(g, 0, 256, 0, s) for s in specs]]
        record = info.ledger.start("bwd")  # as the exchange draws it
        payloads = start_encode("bwd", blocks, [specs], info, g.device, record=record).read()
        got = decode_payloads("bwd", payloads[0], [payloads[0].numel()], [specs], [256], info, 0)
        return blocks[0], got[0]

    info = _info(config, [specs])
    with caplog.at_level("WARNING", logger="torchrec_lossy"):
        sent, first = run(info)
        _, second = run(info)
    a_in, a_out = sent[0], first[0]
    assert torch.equal(a_in.isnan(), a_out.isnan())
    fin = a_in.isfinite()
    assert torch.equal(a_in[a_in.isinf()], a_out[a_in.isinf()])
    span = float(a_in[fin].max() - a_in[fin].min())
    assert float((a_out[fin] - a_in[fin]).abs().max()) <= 0.01 * span * (1 + 1e-6)
    assert not torch.equal(first[0][fin], second[0][fin])  # another call, other draws
    assert torch.equal(first[1], sent[1]) and torch.equal(first[2], sent[2])  # b exact, c raw
    warned = [r.getMessage() for r in caplog.records if "travelled exactly" in r.getMessage()]
    assert len(warned) == 1 and "table b" in warned[0], warned
    stats = info.comms.stats
    a = stats.table("a", "bwd")
    assert 0 < a.max_error_over_bound <= 1.0 and a.error_count == fin.sum()  # first call sampled
    assert abs(a.mean_signed_error) < 0.01 * span / 4  # unbiased: far below the bound
    assert a.error_sq_sum == pytest.approx(float((a_out[fin] - a_in[fin]).double().pow(2).sum()))
    # A rerun from the same state draws the same bits.
    assert torch.equal(run(_info(config, [specs]))[1][0].nan_to_num(), a_out.nan_to_num())


def test_corrupt_payload_error_names_rank_and_tables() -> None:
    info = _info(LossyCommsConfig(), [SPECS])
    x = torch.randn(4, 20)
    payload = start_encode(
        "fwd", [[cut_block(x, 0, 4, 0, s) for s in SPECS]], [SPECS], info, x.device
    ).read()[0]
    bad = payload.clone()
    bad[-3] ^= 0x5A
    with pytest.raises(
        LossyAllToAllError, match=r"on rank 2: the payload from rank 0 \(tables: a, b, c\)"
    ):
        decode_payloads("fwd", bad, [bad.numel()], [SPECS], [4], info, 2)
    with pytest.raises(LossyAllToAllError, match="truncated"):
        decode_payloads("fwd", payload[:0], [0], [SPECS], [4], info, 2)
    raw_only = _info(LossyCommsConfig(tables={"*": TableCodecConfig(compress=False)}), [SPECS])
    raw = start_encode(
        "fwd", [[cut_block(x, 0, 4, 0, s) for s in SPECS]], [SPECS], raw_only, x.device
    ).read()[0]
    with pytest.raises(
        LossyAllToAllError, match="304 bytes received, expected exactly 320 bytes of raw blocks"
    ):
        decode_payloads("fwd", raw[:-16], [raw.numel() - 16], [SPECS], [4], raw_only, 1)


@pytest.mark.parametrize("rows", [3, 4])
def test_raw_payload_is_the_blocks_padded_back_to_back(rows: int) -> None:
    """A call with every block raw (no codec call): each block's bytes padded to 16, back to
    back (runs of blocks that need no padding copied at once: the same bytes), decoded exactly.
    Rows 3: table a's block ends on 16 bytes, b's and c's are padded; rows 4: none is."""
    info = _info(LossyCommsConfig(tables={"*": TableCodecConfig(compress=False)}), [SPECS])
    x = torch.randn(rows, 20)
    blocks = [cut_block(x, 0, rows, 0, s) for s in SPECS]
    payload = start_encode("fwd", [blocks], [SPECS], info, x.device).read()[0]
    want = []
    for b in blocks:
        raw = b.contiguous().view(-1).view(torch.uint8)
        want += [raw, torch.zeros(-raw.numel() % 16, dtype=torch.uint8)]
    assert torch.equal(payload, torch.cat(want))
    got = decode_payloads("fwd", payload, [payload.numel()], [SPECS], [rows], info, 1)[0]
    assert all(torch.equal(g, b) for g, b in zip(got, blocks, strict=True))


def test_self_block_skips_codec_and_wire() -> None:
    info = _info(LossyCommsConfig(default_bound=ErrorBound("relative", 0.05)), [SPECS, SPECS])
    x = torch.randn(8, 20)
    sent = [[cut_block(x, r0, 4, 0, s) for s in SPECS] for r0 in (0, 4)]
    payloads = start_encode("fwd", sent, [SPECS, SPECS], info, x.device, my_rank=1).read()
    assert payloads[1].numel() == 0 and payloads[0].numel() > 0
    stats = info.comms.stats
    nbytes = [sum(b.numel() * b.element_size() for b in bs) for bs in sent]
    assert stats.self_bytes("fwd") == nbytes[1]
    assert stats.total("fwd").raw_bytes == nbytes[0]  # the self block is reported apart
    assert stats.total("fwd").wire_bytes == payloads[0].numel()
    assert "(self, not sent)" in stats.summary()
    got = decode_payloads(
        "fwd", torch.cat(payloads), [p.numel() for p in payloads], [SPECS] * 2, [4, 4], info, 1,
        sent[1],
    )  # fmt: skip
    assert all(a is b for a, b in zip(got[1], sent[1], strict=True))  # exact, untouched
    assert [tuple(b.shape) for b in got[0]] == [tuple(b.shape) for b in sent[0]]


def test_the_dist_plans_its_layout_once_and_each_call_encodes_with_that_plan() -> None:
    """A dist builds its layout's two encode plans when it is built (the forward sends its own
    shards to every peer, the gradient every peer's shards back); a call with those specs
    uses them and writes the same bytes as a call that plans itself; other specs get no plan."""
    config = LossyCommsConfig(
        default_bound=ErrorBound("relative", 0.05), tables={"b": TableCodecConfig(compress=False)}
    )
    other = (BlockSpec("a", 0, 1, 4),)
    layout = [SPECS, other]
    info = _info(config, layout)
    plans = layout_plans(layout, info.compress, 0)
    assert plans.plan_for([SPECS, SPECS], 0) is plans.send_own
    assert plans.plan_for([SPECS, other], 0) is plans.send_back
    assert plans.plan_for([other, other], 0) is None  # another layout
    assert plans.plan_for([SPECS, SPECS], 1) is None  # another rank
    assert plans.send_own.peers == (1,) and plans.send_own.tables == ("a", "c")
    assert [s.table for _, _, s in plans.send_own.raw] == ["b"]
    assert plans.send_back.tables == ("a",)  # peer 1's one shard
    x = torch.randn(8, 20)
    sent = [[cut_block(x, r0, 4, 0, s) for s in SPECS] for r0 in (0, 4)]
    planned = copy.copy(info)
    planned.plans = plans
    want = start_encode("fwd", sent, [SPECS, SPECS], info, x.device, my_rank=0).read()
    got = start_encode("fwd", sent, [SPECS, SPECS], planned, x.device, my_rank=0).read()
    assert [torch.equal(a, b) for a, b in zip(got, want, strict=True)] == [True, True]
    assert want[1].numel() > 0


def test_one_decode_call_names_the_corrupt_source_rank() -> None:
    info = _info(LossyCommsConfig(), [SPECS] * 3)
    x = torch.randn(12, 20)
    sent = [[cut_block(x, r0, 4, 0, s) for s in SPECS] for r0 in (0, 4, 8)]
    payloads = start_encode("fwd", sent, [SPECS] * 3, info, x.device).read()
    bad = [p.clone() for p in payloads]
    bad[1][-3] ^= 0x5A
    sizes = [p.numel() for p in bad]
    with pytest.raises(LossyAllToAllError, match=r"on rank 0: the payload from rank 1 \("):
        decode_payloads("fwd", torch.cat(bad), sizes, [SPECS] * 3, [4] * 3, info, 0)


def test_stats_batched_records_match_one_by_one() -> None:
    one, many = LossyCommsStats(), LossyCommsStats()
    rows = [("a", 1000, 100, 0.01, 0.02), ("b", 500, 520, 0.0, 0.0), ("a", 7, 9, 0.5, None)]
    for row in rows:
        one.record_block("fwd", *row)
    many.record_blocks("fwd", *(list(c) for c in zip(*rows, strict=True)))
    one.record_block("input", "f", 40, 12, 0.0, 0.0)
    many.record_blocks("input", ["f"], [40], [12])  # errors and bounds default to exact
    for table, error_sum, count in (("a", 0.25, 10), ("b", -1.5, 3), ("a", 0.125, 4)):
        one.record_signed_error("bwd", table, error_sum, count)
    many.record_error_samples(
        "bwd", [ErrorSample("a", 0.25, 10), ErrorSample("b", -1.5, 3), ErrorSample("a", 0.125, 4)]
    )
    one.record_ids("input", "f", 9, 2)
    one.record_ids("input", "g", 5, 0)
    many.record_id_counts("input", ["f", "g"], [9, 5], [2, 0])
    for d in ("fwd", "bwd", "input"):
        a, b = one.tables(d), many.tables(d)
        assert a.keys() == b.keys()
        for t in a:  # NaN ratios compare by repr
            assert repr(a[t]) == repr(b[t])


def test_stats_totals_time_shares_and_reset() -> None:
    stats = LossyCommsStats()
    stats.record_block("fwd", "a", 1000, 100, 0.01, 0.02)
    stats.record_block("fwd", "a", 1000, 150, 0.03, 0.02)
    stats.record_block("fwd", "b", 500, 500, 0.0, 0.0)
    stats.record_container("fwd", 32)
    stats.record_time("fwd", "encode", {"a": 3, "b": 1}, 4.0)
    stats.record_max_error_lazy("bwd", "a", torch.tensor(0.5))
    stats.record_max_error_lazy("bwd", "a", torch.tensor(0.25))
    a = stats.table("a", "fwd")
    assert (a.blocks, a.raw_bytes, a.wire_bytes) == (2, 2000, 250)
    assert a.max_error == 0.03 and a.max_error_over_bound == pytest.approx(1.5)
    assert a.encode_s == pytest.approx(3.0) and stats.table("b", "fwd").encode_s == 1.0
    total = stats.total("fwd")
    assert total.wire_bytes == 250 + 500 + 32 and total.raw_bytes == 2500
    bwd = stats.table("a", "bwd")
    assert bwd.max_error == 0.5 and math.isnan(bwd.max_error_over_bound)
    assert "TOTAL" in stats.summary()
    clone = copy.deepcopy(stats)  # sharded modules may be deep-copied (e.g. for EMA models)
    assert clone.total("fwd") == stats.total("fwd")
    assert [(d, t) for d, t, _ in stats] == [
        ("fwd", CONTAINER),
        ("fwd", "a"),
        ("fwd", "b"),
        ("bwd", "a"),
    ]
    stats.reset()
    assert stats.total("fwd").wire_bytes == 0 and not stats.tables("bwd")


def _providers() -> list[type]:
    found: list[type] = [StaticBounds]
    try:
        from torchrec_lossy.adaptive import AdaptiveBounds
    except ImportError:
        pass
    else:
        found.append(AdaptiveBounds)
    return found


@pytest.mark.parametrize("cls", _providers(), ids=lambda c: c.__name__)
def test_bound_providers_conform(cls: type) -> None:
    config = LossyCommsConfig(tables={"t1": TableCodecConfig(bound=ErrorBound("absolute", 0.5))})
    provider = cls(["t0", "t1"], config)
    assert isinstance(provider, torch.nn.Module) and isinstance(provider, BoundProvider)
    check_bound_provider(provider)
    provider.eval()
    assert provider.bound("t1") == ErrorBound("absolute", 0.5)
    assert provider.bound("t0") == config.default_bound
    provider.observe("t0", torch.randn(4, 8), 0.1)
    provider.step()


def test_bad_bound_provider_is_rejected() -> None:
    with pytest.raises(TypeError, match="bound provider"):
        check_bound_provider(object())


def test_sharder_is_a_drop_in() -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    base = inspect.signature(EmbeddingBagCollectionSharder.__init__).parameters
    ours = inspect.signature(LossyEmbeddingBagCollectionSharder.__init__).parameters
    assert list(base) == list(ours)[: len(base)]
    sharder = LossyEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})
    assert isinstance(sharder, EmbeddingBagCollectionSharder)
    assert sharder.comms_config == LossyCommsConfig()
    assert sharder.sharding_types("cpu") == EmbeddingBagCollectionSharder().sharding_types("cpu")
    assert sharder.stats() == {}


def test_decoded_kjt_carries_its_state_into_a_lossy_sharding_context() -> None:
    """The per-batch state travels explicitly: the decoded KJT keeps TorchRec's tensors and
    cached per-key lengths, and ``bind_input_state`` builds the output dist's context from it
    (only for the shardings the packed input dist decoded)."""
    from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
    from torchrec.distributed.embedding_types import KJTList
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lossy.distributed.context import (
        DistributedKJT,
        KJTDistState,
        LossyShardingContext,
        bind_input_state,
    )
    from torchrec_lossy.distributed.dedupe import OutputDedupe

    plain = KeyedJaggedTensor(
        keys=["f", "g"],
        values=torch.tensor([3, 1, 4, 1, 5]),
        lengths=torch.tensor([1, 2, 0, 2]),
        stride=2,
    ).sync()
    dedupe = OutputDedupe([[1, None]], [[None, None]], sum_grads=False)
    kjt = DistributedKJT.of(plain, KJTDistState([1, 1], dedupe))
    assert kjt.keys() == plain.keys() and kjt.stride() == plain.stride()
    assert torch.equal(kjt.values(), plain.values()) and torch.equal(kjt.offsets(), plain.offsets())
    assert kjt.length_per_key() == [3, 2] and kjt.offset_per_key() == [0, 3, 5]

    ctx = EmbeddingBagCollectionContext(
        sharding_contexts=[
            EmbeddingShardingContext(batch_size_per_feature_pre_a2a=[2, 2]),
            EmbeddingShardingContext(batch_size_per_rank=[7]),
        ]
    )
    untouched = ctx.sharding_contexts[1]
    bind_input_state(ctx, KJTList([kjt, plain]))
    bound = ctx.sharding_contexts[0]
    assert isinstance(bound, LossyShardingContext)
    assert bound.batch_size_per_rank == [1, 1] and bound.output_dedupe is dedupe
    assert bound.batch_size_per_feature_pre_a2a == [2, 2]
    assert ctx.sharding_contexts[1] is untouched  # TorchRec's input dist: its own context
