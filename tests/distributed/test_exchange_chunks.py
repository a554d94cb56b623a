"""The chunked slot exchange (``distributed/exchange_chunks.py``): coding overlapped with the wire.

Units: the ring's rounds pair every send with a receive, the size rule, and the chunked encoder's
payloads are the unchunked encode's bytes. Two and three gloo ranks: a dist sent in chunks and
one sent unchunked, called alternately with the same inputs (a lossy bound with stochastic
rounding, uneven batches, a raw table, a raw peer, noise that overflows the slots), decode the
same bits forward and backward; the chunked call makes one all-to-all per round; a corrupt
chunk's error names its source rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import count_exchange_calls, run_workers

from torchrec_lossy.distributed.exchange_chunks import OVERLAP_MIN_BYTES, chunk_count, ring_rounds


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_ring_rounds_pair_every_send_with_a_receive(world: int, chunks: int) -> None:
    chunks = min(chunks, world - 1)
    rounds = [ring_rounds(world, r, chunks) for r in range(world)]
    for r in range(world):
        assert len(rounds[r]) == chunks
        dests = [d for ds, _ in rounds[r] for d in ds]
        assert sorted(dests) == [p for p in range(world) if p != r]  # every peer once
        for j, (ds, _) in enumerate(rounds[r]):
            for d in ds:  # the destination receives from r in the same round
                assert r in rounds[d][j][1], (r, d, j)


def test_chunk_count_pays_only_across_hosts_with_two_peers_and_enough_bytes() -> None:
    assert chunk_count(None, 2, 1 << 30, True) == 0  # one peer: nothing to overlap
    assert chunk_count(None, 3, OVERLAP_MIN_BYTES - 1, True) == 0
    assert chunk_count(None, 4, OVERLAP_MIN_BYTES, True) == 3
    assert chunk_count(None, 4, 1 << 30, False) == 0  # one host: no wire to hide under
    assert chunk_count(0, 4, 1 << 30, True) == 0
    assert chunk_count(2, 4, 0, False) == 2
    assert chunk_count(5, 3, 0, False) == 2


def _info(world: int, rank: int, bound: float, **kw: Any) -> Any:
    from torchrec_lossy.config import CodecConfig, ErrorBound, LossyCommsConfig, TableCodecConfig
    from torchrec_lossy.distributed import BlockSpec, LossyComms, StaticBounds
    from torchrec_lossy.distributed.call_ledger import CallLedger
    from torchrec_lossy.distributed.pooled_blocks import LossyAll2AllPooledInfo

    eb = ErrorBound("absolute", bound)
    config = LossyCommsConfig(
        default_bound=eb,
        codec=CodecConfig(rounding="stochastic", seed=3),
        backward="lossy",
        backward_bound=eb,
        tables={"c": TableCodecConfig(compress=False)},  # raw blocks: slotted exactly
    )
    comms = LossyComms(config=config, bounds=StaticBounds(["a", "b", "c"], config))
    layout = [(BlockSpec("a", 0, 2, 4), BlockSpec("c", 8, 1, 4), BlockSpec("b", 12, 1, 8))] * world
    return LossyAll2AllPooledInfo(
        batch_size_per_rank=[20 + 5 * p for p in range(world)],  # uneven splits
        layout=layout,
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(["a", "b", "c"]),
        **kw,
    )


def test_call_encoder_gives_the_unchunked_payloads() -> None:
    from torchrec_lossy.distributed.call_ledger import CallRecord
    from torchrec_lossy.distributed.exchange_record import ExchangeRecord
    from torchrec_lossy.distributed.pooled_payload import start_call_encoder, start_encode

    world, rank = 4, 1
    info = _info(world, rank, 0.01, raw_peers=frozenset({3}))
    specs = [info.layout[rank]] * world
    g = torch.Generator().manual_seed(0)
    blocks = [[torch.randn(9 * s.num_features, s.dim, generator=g) for s in ss] for ss in specs]
    record = CallRecord("fwd", 5, None)
    want = start_encode("fwd", blocks, specs, info, torch.device("cpu"), rank, record).read()
    tele = ExchangeRecord("fwd")
    enc = start_call_encoder("fwd", blocks, specs, info, torch.device("cpu"), rank, record, tele)
    got = [torch.empty(0, dtype=torch.uint8)] * world
    for dests in ([2], [0, 3]):
        payloads = enc.encode(dests)
        for p in range(world):
            if p in dests:
                got[p] = payloads[p]
            else:
                assert not payloads[p].numel()
    for p in range(world):
        assert torch.equal(got[p], want[p]), p
    assert tele.blocks is not None and sorted(tele.blocks.tables) == sorted(
        ["a", "c", "b"] * 2 + ["a", "c", "b"]
    )
    assert tele.links == (0, sum(t.numel() for t in want))


ROWS_D = 4 * 2 + 4 + 8  # the layout's columns per rank


def _inputs(rank: int, world: int, step: int, noise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooth rows (they compress well), or noise (a payload far past its slot)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    b_all = sum(20 + 5 * p for p in range(world))
    b_me = 20 + 5 * rank
    if not noise:
        x = torch.full((b_all, ROWS_D), float(torch.randn(1, generator=g)))
        w = torch.full((b_me, ROWS_D * world), float(torch.randn(1, generator=g)))
        return x + 1e-3 * torch.randn(b_all, ROWS_D, generator=g), w
    return 10 * torch.randn(b_all, ROWS_D, generator=g), torch.randn(b_me, ROWS_D * world)


def _worker(rank: int, world: int, corrupt: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy
    from torchrec_lossy.distributed.errors import LossyAllToAllError
    from torchrec_lossy.distributed.exchange_slots import SlotHistory

    calls = count_exchange_calls()
    raw = frozenset({1 - rank}) if rank < 2 and world > 2 else frozenset()  # ranks 0, 1: raw
    infos = {
        mode: _info(world, rank, 0.01, raw_peers=raw, slots=SlotHistory(world, chunks))
        for mode, chunks in (("whole", 0), ("chunked", world - 1))
    }
    out: dict[str, Any] = {"steps": []}
    for step, noise in enumerate([False, False, False, True, False]):
        x, w = _inputs(rank, world, step, noise)
        step_out: dict[str, Any] = {}
        for mode, info in infos.items():
            xr = x.clone().requires_grad_()
            info.comms.stats.reset()
            calls.update(a2a=0, isend=0, bytes=0)
            y = alltoall_pooled_lossy(xr, info).wait()
            fwd = dict(calls)
            calls.update(a2a=0, isend=0, bytes=0)
            (y * w).sum().backward()
            bwd = dict(calls)
            # The wire bytes reported: the bytes handed to the collectives and overflow sends.
            fwd["wire"], bwd["wire"] = (
                info.comms.stats.total(d).wire_bytes for d in ("fwd", "bwd")
            )
            step_out[mode] = {"y": y.detach(), "grad": xr.grad, "fwd": fwd, "bwd": bwd}
        step_out["same"] = torch.equal(step_out["whole"]["y"], step_out["chunked"]["y"]) and (
            torch.equal(step_out["whole"]["grad"], step_out["chunked"]["grad"])
        )
        for mode in infos:
            step_out[mode] = {k: step_out[mode][k] for k in ("fwd", "bwd")}
        out["steps"].append(step_out)
    if corrupt:  # rank 0 flips a byte of the last source's forward payload
        info = infos["chunked"]
        bad = world - 1

        def hook(direction: str, peer: int, payload: torch.Tensor) -> torch.Tensor:
            if rank == 0 and direction == "fwd" and peer == bad and payload.numel() > 40:
                payload = payload.clone()
                payload[-9] ^= 0x5A
            return payload

        info.comms.payload_hook = hook
        x, _ = _inputs(rank, world, 9, False)
        try:
            alltoall_pooled_lossy(x, info).wait()
            out["error"] = None
        except LossyAllToAllError as e:
            out["error"] = str(e)
        dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_chunked_decodes_the_unchunked_bits_and_counts_rounds(world: int) -> None:
    for rank, r in enumerate(run_workers(_worker, world, False)):
        for step, s in enumerate(r["steps"]):
            assert s["same"], (rank, step)
            if step == 0:  # the first call of a kind: the size exchange, then the payloads
                assert s["chunked"]["fwd"]["a2a"] == 2 and s["chunked"]["bwd"]["a2a"] == 2
                continue
            for d in ("fwd", "bwd"):
                for mode in ("whole", "chunked"):
                    assert s[mode][d]["bytes"] == s[mode][d]["wire"], (rank, step, mode, s)
                assert s["whole"][d]["bytes"] == s["chunked"][d]["bytes"], (rank, step, s)
                assert s["whole"][d]["a2a"] == 1, (rank, step, s)
                assert s["chunked"][d]["a2a"] == world - 1, (rank, step, s)  # a round per peer
                # Overflow sends only after the noise (step 3): the same in both modes.
                assert s["chunked"][d]["isend"] == s["whole"][d]["isend"], (rank, step, s)
        # Step 3's noise overflows each coded pair's slot (a raw peer's slot holds its raw
        # bytes exactly: ranks 0 and 1 send each other no overflow).
        noise = r["steps"][3]["chunked"]
        peers_coded = (world - 1) - (1 if world > 2 and rank < 2 else 0)
        assert noise["fwd"]["isend"] == peers_coded, (rank, noise)


@pytest.mark.slow
def test_corrupt_chunk_names_its_source_rank() -> None:
    results = run_workers(_worker, 3, True)
    err = results[0]["error"]
    assert err is not None and "from rank 2" in err and "on rank 0" in err, err
    assert results[1]["error"] is None and results[2]["error"] is None


EBC_TABLES = [(f"t{i}", 60, 64, [f"f{i}"]) for i in range(5)]


def _ebc_plan() -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import table_wise

    # Table-wise only: at this batch a row-wise table's partial sums differ from TorchRec's
    # in their last bits with the unchunked seam too (its sum order), not a chunking matter.
    return {f"t{i}": table_wise(rank=r) for i, r in enumerate([0, 1, 2, 0, 1])}


def _worker_ebc(rank: int, world: int) -> dict[str, Any]:
    from harness import EXACT_BACKWARD, TrainRun, make_batch, make_tables, same_local_pieces
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import torchrec_lossy.distributed.exchange as exchange
    from torchrec_lossy.config import ErrorBound, LossyCommsConfig
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    chunked_calls = [0]
    real = exchange.send_chunked

    def counting(*a: Any, **kw: Any) -> Any:
        chunked_calls[0] += 1
        return real(*a, **kw)

    exchange.send_chunked = counting  # type: ignore[assignment]

    def lossy(overlap: str, **kw: Any) -> Any:
        # One rank per host: the group spans hosts and "auto" chunks (>= 256 KiB a call).
        config = LossyCommsConfig(local_world_size=1, overlap=overlap, **kw)
        return LossyEmbeddingBagCollectionSharder(comms_config=config)

    tables = make_tables(EBC_TABLES)
    batches = [[make_batch(tables, 256, seed=100 * s + r) for r in range(world)] for s in range(3)]
    exact = {"default_bound": ErrorBound("absolute", 0.0), **EXACT_BACKWARD}
    runs = {
        "chunked": TrainRun(tables, lossy("auto"), _ebc_plan(), world),
        "whole": TrainRun(tables, lossy("never"), _ebc_plan(), world),
        "exact_chunked": TrainRun(tables, lossy("auto", **exact), _ebc_plan(), world),
        "torchrec": TrainRun(tables, EmbeddingBagCollectionSharder(), _ebc_plan(), world),
    }
    calls = {}
    for name, run in runs.items():
        before = chunked_calls[0]
        for s, per_rank in enumerate(batches):
            run.step(per_rank[rank], 1000 * s + rank)
        calls[name] = chunked_calls[0] - before

    def same(a: str, b: str) -> bool:
        ra, rb = runs[a], runs[b]
        outs = all(torch.equal(x, y) for x, y in zip(ra.outputs, rb.outputs, strict=True))
        return outs and same_local_pieces(ra.weights(), rb.weights())

    return {
        "calls": calls,
        "lossy_same": same("chunked", "whole"),
        "exact_same": same("exact_chunked", "torchrec"),
        "lossy_differs": not torch.equal(runs["chunked"].outputs[-1], runs["torchrec"].outputs[-1]),
    }


@pytest.mark.slow
def test_ebc_chunked_trains_the_unchunked_bits_and_torchrecs_when_exact() -> None:
    for rank, r in enumerate(run_workers(_worker_ebc, 3, timeout_s=900)):
        assert r["lossy_same"] and r["exact_same"], (rank, r)
        assert r["lossy_differs"], rank  # the lossy runs did code their blocks
        # The dist chunks its calls after the first of each kind (3 steps: 2 forward, 2
        # backward; the exact backward is TorchRec's dense fp32 gradient, not the codec's).
        assert r["calls"]["chunked"] == 4 and r["calls"]["exact_chunked"] == 2, (rank, r)
        assert r["calls"]["whole"] == 0, (rank, r)
