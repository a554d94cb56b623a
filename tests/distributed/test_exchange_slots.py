"""The lossy wire's one-round slot exchange (``distributed/exchange_slots.py``).

Units: the slot sizes both sides derive, when a call may take the slot path, the slots' bytes.
Three gloo ranks: the first call of a kind exchanges its sizes (two all-to-alls), the next ones
make ONE all-to-all per direction; a payload past its slot (noise after smooth rows) sends its
rest point-to-point and still decodes bit-exactly (bound 0), both ways; the wire bytes reported
are the bytes handed to the collectives, slots' headers and slack included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import count_exchange_calls, run_workers

from torchrec_lossy.distributed.exchange_slots import (
    CALM_CALLS,
    HEADER,
    MIN_SLACK,
    SlotHistory,
    SlotKey,
    capacity,
    fill_slots,
)

KEY = SlotKey("fwd", False, frozenset({"a"}))


def test_capacity_has_headroom_and_alignment() -> None:
    assert capacity(0, 3) == MIN_SLACK
    assert capacity(8000, 3) == 9008  # 1/8 headroom, rounded up to 16
    assert capacity(8000, 0) == 16000  # after three overflows: 100 %
    assert all(capacity(n, 3) % 16 == 0 and capacity(n, 3) >= n for n in range(300))


def test_history_takes_slots_only_after_a_received_call_with_none_in_flight() -> None:
    h = SlotHistory(3)
    # Rank 0: nothing to itself; rank 1 gets 32 raw bytes and a codec part, rank 2 raw only.
    send = [None, (32, True), (48, False)]
    recv = [None, (0, True), (16, True)]
    first = h.launch(KEY, send, recv)
    assert first.send_caps is None and first.recv_caps is None  # first call: the size exchange
    h.sent(first, [0, 132, 48])
    second = h.launch(KEY, send, recv)
    assert second.send_caps is None  # the first is still in flight
    h.sent(second, [0, 132, 48])
    h.received(first, [0, 200, 56])
    h.received(second, [0, 200, 56])
    call = h.launch(KEY, send, recv)
    # Raw bytes exactly, the codec part from the last call (100, 200, 40 bytes) with headroom.
    assert call.send_caps == [0, HEADER + 32 + capacity(100, 3), HEADER + 48]
    assert call.recv_caps == [0, HEADER + capacity(200, 3), HEADER + 16 + capacity(40, 3)]
    # An overflow (rank 1's payload past its slot) widens that pair's headroom.
    h.sent(call, [0, 32 + 900, 48])
    h.received(call, [0, 200, 56])
    call = h.launch(KEY, send, recv)
    assert call.send_caps is not None and call.send_caps[1] == HEADER + 32 + capacity(900, 2)
    assert call.recv_caps is not None and call.recv_caps[1] == HEADER + capacity(200, 3)
    # CALM_CALLS calls within their slots give the headroom back, one step at a time.
    for _ in range(CALM_CALLS):
        h.sent(call, [0, 32 + 900, 48])
        h.received(call, [0, 200, 56])
        call = h.launch(KEY, send, recv)
    assert call.send_caps is not None and call.send_caps[1] == HEADER + 32 + capacity(900, 3)
    # Another kind of call (the exact forward) keeps a history of its own.
    assert h.launch(SlotKey("fwd", True, frozenset({"a"})), send, recv).send_caps is None


def test_slots_carry_size_tag_and_bytes_and_cut_an_overflow() -> None:
    payloads = [torch.empty(0, dtype=torch.uint8), torch.arange(40, dtype=torch.uint8)]
    payloads.append(torch.arange(200, dtype=torch.uint8))
    caps = [0, 80, 64]  # the last one overflows: 48 bytes of room
    slotted = fill_slots(payloads, caps, tag=7)
    assert slotted.send.numel() == 144
    heads = [slotted.send[a : a + HEADER].view(torch.int64).tolist() for a in (0, 80)]
    assert heads == [[40, 7], [200, 7]]
    assert torch.equal(slotted.send[16:56], payloads[1])
    assert not slotted.send[56:80].any()  # zeroed slack
    assert torch.equal(slotted.send[96:144], payloads[2][:48])
    ((dest, rest),) = slotted.overflow
    assert dest == 2 and torch.equal(rest, payloads[2][48:])


B = 12  # rows per rank
DIM = 8


def _inputs(rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s pooled input and its loss weights at ``step``: smooth rows first (they
    compress well), noise at step 3 (a payload far past the slot its history gives)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    if step < 3:
        x = torch.randn(1, DIM, generator=g).repeat(B * world, 1)
        w = torch.randn(1, DIM * world, generator=g).repeat(B, 1)
    else:
        x = torch.randn(B * world, DIM, generator=g)
        w = torch.randn(B, DIM * world, generator=g)
    return x, w


def _worker(rank: int, world: int) -> dict[str, Any]:

    from torchrec_lossy.config import ErrorBound, LossyCommsConfig, TableCodecConfig
    from torchrec_lossy.distributed import BlockSpec, LossyComms, StaticBounds
    from torchrec_lossy.distributed.call_ledger import CallLedger
    from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy
    from torchrec_lossy.distributed.pooled_blocks import LossyAll2AllPooledInfo

    calls = count_exchange_calls()
    exact = ErrorBound("absolute", 0.0)
    config = LossyCommsConfig(
        default_bound=exact,
        backward="lossy",
        backward_bound=exact,
        tables={"c": TableCodecConfig(compress=False)},  # raw blocks: slotted exactly
    )
    comms = LossyComms(config=config, bounds=StaticBounds(["a", "b", "c"], config))
    layout = [(BlockSpec("a", 0, 1, 2), BlockSpec("c", 2, 1, 2), BlockSpec("b", 4, 1, 4))] * world
    info = LossyAll2AllPooledInfo(
        batch_size_per_rank=[B] * world,
        layout=layout,
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(["a", "b", "c"]),
        slots=SlotHistory(world),
    )
    out: dict[str, Any] = {"steps": []}
    for step in range(4):
        x, w = _inputs(rank, world, step)
        x.requires_grad_()
        comms.stats.reset()
        calls.update(a2a=0, isend=0, bytes=0)
        got = alltoall_pooled_lossy(x, info).wait()
        fwd = dict(calls)
        calls.update(a2a=0, isend=0, bytes=0)
        (got * w).sum().backward()
        bwd = dict(calls)
        # Expected, bit for bit: every source's rows of this rank's batch; the gradient of each
        # destination's rows is its weights' columns of this rank (over the world: TorchRec's
        # gradient division).
        want = torch.cat(
            [_inputs(p, world, step)[0][B * rank : B * (rank + 1)] for p in range(world)], dim=1
        )
        want_grad = (
            torch.cat(
                [_inputs(p, world, step)[1][:, DIM * rank : DIM * (rank + 1)] for p in range(world)]
            )
            / world
        )
        stats = comms.stats
        out["steps"].append(
            {
                "fwd": fwd,
                "bwd": bwd,
                "out_exact": torch.equal(got.detach(), want),
                "grad_exact": x.grad is not None and torch.equal(x.grad, want_grad),
                "fwd_wire": stats.total("fwd").wire_bytes,
                "bwd_wire": stats.total("bwd").wire_bytes,
                "fwd_links": stats.link_bytes("fwd", "same_host")
                + stats.link_bytes("fwd", "cross_host"),
            }
        )
    return out


def test_one_round_after_the_first_call_and_overflow_decodes_exactly() -> None:
    for rank, r in enumerate(run_workers(_worker, 3)):
        for step, s in enumerate(r["steps"]):
            assert s["out_exact"] and s["grad_exact"], (rank, step)
            # Wire bytes reported == bytes handed to the all-to-alls and overflow sends.
            assert s["fwd"]["bytes"] == s["fwd_wire"] == s["fwd_links"], (rank, step, s)
            assert s["bwd"]["bytes"] == s["bwd_wire"], (rank, step, s)
        first, smooth, _, noise = r["steps"]
        # First call of each direction: the size exchange, then the payloads.
        assert first["fwd"]["a2a"] == first["bwd"]["a2a"] == 2, first
        # Later calls: one all-to-all per direction, no overflow while the sizes hold.
        assert smooth["fwd"] == {**smooth["fwd"], "a2a": 1, "isend": 0}, smooth
        assert smooth["bwd"]["a2a"] == 1 and smooth["bwd"]["isend"] == 0, smooth
        # Noise after smooth rows: each peer's payload overflows its slot and sends the rest
        # point-to-point (to the two peers), still one all-to-all.
        assert noise["fwd"]["a2a"] == 1 and noise["fwd"]["isend"] == 2, noise
        assert noise["bwd"]["a2a"] == 1 and noise["bwd"]["isend"] == 2, noise


def test_receive_slots_reads_payloads_and_names_a_corrupt_headers_source_and_tables() -> None:
    """What both the one-round and the chunked exchange receive through: a slot's payload, and
    for a corrupt header the named error (the chunked path once passed block specs where the
    message joins table names, and raised a TypeError instead)."""
    import torch

    from torchrec_lossy.distributed.errors import LossyAllToAllError
    from torchrec_lossy.distributed.exchange_slots import HEADER, fill_slots, receive_slots

    payloads = [torch.empty(0, dtype=torch.uint8), torch.arange(5, dtype=torch.uint8)]
    caps = [0, HEADER + 8]
    slots = fill_slots(payloads, caps, tag=3).send
    got = receive_slots("fwd", slots, caps, None, 0, [[], ["a"]])  # type: ignore[arg-type]
    assert list(got) == [1] and torch.equal(torch.cat(got[1]), payloads[1])
    corrupt = torch.cat([slots, torch.full((HEADER + 8,), 255, dtype=torch.uint8)])
    with pytest.raises(
        LossyAllToAllError, match=r"on rank 0: the slot from rank 2 \(tables: b, c\)"
    ):
        receive_slots("fwd", corrupt, [*caps, HEADER + 8], None, 0, [[], ["a"], ["c", "b", "c"]])  # type: ignore[arg-type]
