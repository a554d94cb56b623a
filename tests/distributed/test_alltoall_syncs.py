"""Host reads of the lossy pooled all-to-all on the device-resident codec path.

Two gloo ranks on CPU run one forward + backward of ``alltoall_pooled_lossy`` with the codec's
``"triton"`` backend (the Triton interpreter: the device path, slow, so the blocks are tiny) and
count every device-to-host read of the exchange and the codec (all go through
``torchrec_lossy.codec.host_sync``). Each direction makes one compress call and one decompress
call for all peers, so the count does not grow with the number of peers; the self block skips
the codec.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the spawned ranks

from _harness import run_workers

pytest.importorskip("triton", reason="triton is not installed: the device codec cannot run")

B = 16  # rows per rank


def _worker(rank: int, world_size: int) -> dict[str, int]:
    from torchrec_lossy.codec import CodecConfig, host_sync
    from torchrec_lossy.config import ErrorBound, LossyCommsConfig
    from torchrec_lossy.distributed import BlockSpec, LossyComms, StaticBounds
    from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy
    from torchrec_lossy.distributed.pooled_payload import LossyAll2AllPooledInfo

    config = LossyCommsConfig(
        codec=CodecConfig(backend="triton", huffman_chunk_symbols=64),
        default_bound=ErrorBound("relative", 0.01),
        backward="lossy",
    )
    comms = LossyComms(config=config, bounds=StaticBounds(["a", "b"], config))
    layout = [(BlockSpec("a", 0, 1, 4), BlockSpec("b", 4, 2, 2))] * world_size
    info = LossyAll2AllPooledInfo(
        batch_size_per_rank=[B] * world_size,
        layout=layout,
        comms=comms,
        compress=comms.compress_flags(["a", "b"]),
    )
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
    counts["self_fwd"] = comms.stats.self_bytes("fwd")
    assert out.shape == (B, 8 * world_size)
    assert x.grad is not None and x.grad.shape == x.shape
    # The self block is exact: rank r's own columns of its own rows come back bit for bit.
    own = out[:, 8 * rank : 8 * (rank + 1)]
    assert torch.equal(own, x.detach()[B * rank : B * (rank + 1)])
    return counts


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_codec_host_reads_per_alltoall_do_not_grow_with_peers() -> None:
    for counts in run_workers(_worker, 2, timeout_s=600):
        # Per direction: the size exchange (1: received sizes and skeletons, with the
        # compress's sizes and stats in the same copy), decompress_groups (0: the layouts come
        # from the skeletons) and the status check before the blocks are used (1; a payload of
        # raw blocks only cannot fail on the device and skips it: the repeated rows here make
        # every block vector-LZ, so the check runs). Before: 3 x world + 2 (one compress per
        # destination, two reads per decompress, the exchange's and one for the relative
        # bounds).
        assert counts["fwd"] == 2, counts
        assert counts["bwd"] == 2, counts
        assert counts["self_fwd"] == B * 8 * 4, counts
