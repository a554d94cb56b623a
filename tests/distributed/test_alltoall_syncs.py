"""Host reads of the lossy pooled all-to-all on the device-resident codec path.

Two gloo ranks on CPU run one forward + backward of ``alltoall_pooled_lossy`` with the codec's
``"triton"`` backend (the Triton interpreter: the device path, slow, so the blocks are tiny) and
count every device-to-host read of the exchange and the codec (all go through
``torchrec_lossy.codec.host_sync``). Each direction makes one compress call and one decompress
call for all peers, and one host read, so the count does not grow with the number of peers; the
self block skips the codec. A corrupt payload on this path is zeroed on the device and reported
at the next read, naming the direction, the step and the source rank.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the spawned ranks

from harness import run_workers

pytest.importorskip("triton", reason="triton is not installed: the device codec cannot run")

B = 16  # rows per rank


def _device_path_info(world_size: int) -> Any:
    """Two tables (1 and 2 features) per rank, relative 0.01 both ways, the device codec."""
    from torchrec_lossy.codec import CodecConfig
    from torchrec_lossy.config import ErrorBound, LossyCommsConfig
    from torchrec_lossy.distributed import BlockSpec, LossyComms, StaticBounds
    from torchrec_lossy.distributed.call_ledger import CallLedger
    from torchrec_lossy.distributed.pooled_blocks import LossyAll2AllPooledInfo

    config = LossyCommsConfig(
        codec=CodecConfig(backend="triton", huffman_chunk_symbols=64),
        default_bound=ErrorBound("relative", 0.01),
        backward="lossy",
    )
    comms = LossyComms(config=config, bounds=StaticBounds(["a", "b"], config))
    layout = [(BlockSpec("a", 0, 1, 4), BlockSpec("b", 4, 2, 2))] * world_size
    return LossyAll2AllPooledInfo(
        batch_size_per_rank=[B] * world_size,
        layout=layout,
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(["a", "b"]),
    )


def _worker(rank: int, world_size: int) -> dict[str, int]:
    from torchrec_lossy.codec import host_sync
    from torchrec_lossy.distributed.call_ledger import read_checked
    from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy

    info = _device_path_info(world_size)
    comms = info.comms
    torch.manual_seed(rank)
    # Repeated rows (and an all-ones gradient): every block is worth vector-LZ.
    x = torch.randn(1, 8).repeat(B * world_size, 1).requires_grad_()
    counts = {}
    before = host_sync.host_reads()
    out = alltoall_pooled_lossy(x, info).wait()
    counts["fwd"] = host_sync.host_reads() - before
    before = host_sync.host_reads()
    out.sum().backward()
    counts["bwd"] = host_sync.host_reads() - before
    before = host_sync.host_reads()
    read_checked(info.ledger)  # the backward's decode status, still pending: one read
    counts["flush"] = host_sync.host_reads() - before
    before = host_sync.host_reads()
    read_checked(info.ledger)  # nothing pending: no read
    counts["flush_again"] = host_sync.host_reads() - before
    counts["self_fwd"] = comms.stats.self_bytes("fwd")
    assert out.shape == (B, 8 * world_size)
    assert x.grad is not None and x.grad.shape == x.shape
    # The self block is exact: rank r's own columns of its own rows come back bit for bit.
    own = out[:, 8 * rank : 8 * (rank + 1)]
    assert torch.equal(own, x.detach()[B * rank : B * (rank + 1)])
    return counts


@pytest.mark.slow  # about 75 s: two ranks through the Triton interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_one_host_read_per_alltoall_and_direction() -> None:
    for counts in run_workers(_worker, 2, timeout_s=600):
        # Per direction ONE read: the size exchange's (received sizes and skeletons, the
        # compress's sizes and stats, and the decode status of the previous all-to-all, in one
        # copy). decompress_groups reads nothing (the layouts come from the skeletons) and the
        # decode status is not read where it is produced: a failed source's blocks are zeroed
        # on the device, and the status rides the next read (the forward's in the backward's
        # exchange, the backward's in the next one or in check_lossy_decodes). Before: 3 x world
        # + 2 per direction, then 2.
        assert counts["fwd"] == 1, counts
        assert counts["bwd"] == 1, counts
        assert counts["flush"] == 1 and counts["flush_again"] == 0, counts
        assert counts["self_fwd"] == B * 8 * 4, counts


def _worker_corrupt(rank: int, world_size: int) -> dict[str, object]:
    from torchrec_lossy.distributed import LossyAllToAllError
    from torchrec_lossy.distributed.call_ledger import read_checked
    from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy

    info = _device_path_info(world_size)
    comms = info.comms
    peer = 1 - rank

    def flip(direction: str) -> object:
        def hook(d: str, source: int, payload: torch.Tensor) -> torch.Tensor:
            if d != direction:
                return payload
            bad = payload.clone()
            bad[-1] ^= 4  # a body bit: the device checksum finds it
            return bad

        return hook

    torch.manual_seed(rank)
    x = torch.randn(1, 8).repeat(B * world_size, 1).requires_grad_()
    out: dict[str, object] = {}
    # Every rank corrupts what it receives, so all ranks fail at the same collective.
    comms.payload_hook = flip("fwd")
    y = alltoall_pooled_lossy(x, info).wait()  # no error yet: the status is not read here
    out["fwd_peer_zero"] = bool(torch.count_nonzero(y[:, 8 * peer : 8 * (peer + 1)]) == 0)
    out["fwd_own_exact"] = torch.equal(y[:, 8 * rank : 8 * (rank + 1)], x.detach()[:B].clone())
    try:
        y.sum().backward()  # the backward's exchange reads the forward's status and stops
        out["fwd_error"] = "no error"
    except LossyAllToAllError as e:
        out["fwd_error"] = str(e)
    out["grad_untouched"] = x.grad is None

    comms.payload_hook = flip("bwd")
    info.ledger.steps = 7
    x.grad = None
    y = alltoall_pooled_lossy(x, info).wait()
    y.sum().backward()  # completes: the corrupt gradient blocks are zeros
    assert x.grad is not None
    rows = x.grad[B * peer : B * (peer + 1)]  # what the peer sent back for its rows
    out["bwd_peer_grad_zero"] = bool(torch.count_nonzero(rows) == 0)
    own = x.grad[B * rank : B * (rank + 1)]  # the self block: exact (1 / world: TorchRec's
    out["bwd_own_grad_exact"] = bool(torch.all(own == 1 / world_size))  # gradient division)
    try:
        read_checked(info.ledger)  # what check_lossy_decodes does per module
        out["bwd_error"] = "no error"
    except LossyAllToAllError as e:
        out["bwd_error"] = str(e)
    comms.payload_hook = None
    y = alltoall_pooled_lossy(x, info).wait()  # and the dists recover
    out["recovered"] = bool(torch.count_nonzero(y[:, 8 * peer : 8 * (peer + 1)]) > 0)
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_corrupt_payload_on_the_device_path_is_zeroed_then_reported_at_the_next_read() -> None:
    for rank, r in enumerate(run_workers(_worker_corrupt, 2, timeout_s=600)):
        peer = 1 - rank
        assert r["fwd_peer_zero"] and r["fwd_own_exact"], r
        msg = str(r["fwd_error"])
        assert f"(fwd) on rank {rank}: the payload from rank {peer}" in msg, msg
        assert "fwd all-to-all call 0" in msg and "training step unknown" in msg, msg
        assert "checksum mismatch" in msg and "stops the job before" in msg, msg
        assert r["grad_untouched"], r  # the backward stopped before any gradient came back
        assert r["bwd_peer_grad_zero"] and r["bwd_own_grad_exact"], r
        msg = str(r["bwd_error"])
        assert f"(bwd) on rank {rank}: the payload from rank {peer}" in msg, msg
        assert "bwd all-to-all call 1" in msg and "training step 7 (0-based)" in msg, msg
        assert "zero gradient" in msg, msg
        assert r["recovered"], r
