"""The grouped codec API: every destination in one compress, every source in one decompress.

Each group's payload must equal the per-group ``compress``; the device path must read back
exactly once in compress and leave the decode status for ``check_groups``; a corrupt group is
reported with its index. Without CUDA the device path runs in the Triton interpreter (slow:
small blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import DEVICE, corpus, cuda_syncs_only_in_to_host, make_block, parse, with_checksum

from torchrec_lossy.codec import (
    CodecConfig,
    CodecError,
    GroupedPayloads,
    check_groups,
    compress_groups,
    compress_with_stats,
    contain_failures,
    decompress,
    decompress_groups,
    host_sync,
)
from torchrec_lossy.codec.bounds import absolute_bounds
from torchrec_lossy.codec.container import payload_skeletons, skeleton_index
from torchrec_lossy.codec.format import BITS_DTYPES, DESCRIPTOR, HEADER

HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None
CFG = CodecConfig(huffman_chunk_symbols=64)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(BITS_DTYPES[t.dtype])


def groups_of_blocks() -> list[list[torch.Tensor]]:
    """Three destinations: mixed dtypes and kinds, one empty group, an empty block."""
    kinds = ("adversarial", "repeat", "mild")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    g0 = [make_block(9, 4, dtypes[i], kinds[i], seed=i) for i in range(3)]
    g2 = [make_block(12, 3, torch.float32, "repeat", seed=7), torch.zeros(0, 5)]
    return [g0, [], g2]


def rel_values(groups: list[list[torch.Tensor]]) -> list[list[float]]:
    return [[0.01 * (1 + i) for i, _ in enumerate(g)] for g in groups]


def per_group(groups, bounds, config) -> list[torch.Tensor]:
    return [compress_with_stats(g, b, config)[0] for g, b in zip(groups, bounds, strict=True)]


def test_host_grouped_payloads_equal_per_group_compress_and_decode() -> None:
    groups = groups_of_blocks()
    values = rel_values(groups)
    flat = [b for g in groups for b in g]
    abs_flat = absolute_bounds(flat, [v for g in values for v in g], [True] * len(flat))
    it = iter(abs_flat)
    abs_bounds = [[next(it) for _ in g] for g in groups]
    out = compress_groups(groups, values, CFG, kinds=True)
    want = per_group(groups, abs_bounds, CFG)
    assert out.sizes == [p.numel() for p in want]
    for g, w in enumerate(want):
        assert torch.equal(out.payload(g), w)
        assert [s.bound for s in out.stats[g]] == abs_bounds[g]
    blocks, status = decompress_groups(out.buffer, out.sizes)
    check_groups(status)
    for got_g, want_g in zip(blocks, [decompress(w) for w in want], strict=True):
        assert [bits(a).tolist() for a in got_g] == [bits(b).tolist() for b in want_g]


@pytest.mark.parametrize("misaligned", [False, True])
def test_host_batched_decode_is_the_reference_decoder(misaligned: bool) -> None:
    """The one compiled decode call of every payload (escapes, vector-LZ, every dtype, several
    chunks per block; payloads off word boundaries too) gives the bits of the reference
    backend's decoder (the device orchestration over the kernels' torch twins)."""
    groups = groups_of_blocks()
    groups.append([make_block(200, 8, torch.float32, k, seed=3) for k in ("repeat", "mild")])
    groups.append([make_block(150, 4, torch.bfloat16, "repeat", seed=5)])
    out = compress_groups(groups, [[1e-3] * len(g) for g in groups], CFG)
    buffer = (
        torch.cat([torch.zeros(1, dtype=torch.uint8), out.buffer])[1:]
        if misaligned
        else (out.buffer)
    )
    blocks, status = decompress_groups(buffer, out.sizes, backend="cpu")
    check_groups(status)
    for g, got_g in enumerate(blocks):
        want_g = decompress(out.payload(g), backend="reference")
        assert [(a.dtype, a.shape) for a in got_g] == [(b.dtype, b.shape) for b in want_g]
        assert [bits(a).tolist() for a in got_g] == [bits(b).tolist() for b in want_g]


def test_host_grouped_batch_with_empty_groups_at_both_ends() -> None:
    """Empty groups first, between and last: each payload still equals its group's compress,
    and a corrupt block in one group is that group's error only."""
    g0, _, g2 = groups_of_blocks()
    groups = [[], g0, [], [], g2, []]
    bounds = [[1e-3] * len(g) for g in groups]
    out = compress_groups(groups, bounds, CFG)
    want = per_group(groups, bounds, CFG)
    assert out.sizes == [p.numel() for p in want]
    assert torch.equal(out.buffer, torch.cat(want))
    buf = out.buffer.clone()
    buf[out.offsets[4] + 40] ^= 1
    blocks, status = decompress_groups(buf, out.sizes)
    assert blocks[4] == [] and [len(b) for b in blocks[:4]] == [0, 3, 0, 0]
    for got, w in zip(blocks[1], decompress(want[1]), strict=True):
        assert torch.equal(bits(got), bits(w))
    with pytest.raises(CodecError, match=r"^payload 4: corrupt payload: checksum mismatch"):
        check_groups(status)


def test_host_mixed_relative_flags_resolve_as_absolute_bounds() -> None:
    """Per-block relative flags on the batched host path: the bounds (stats and bytes) are
    ``absolute_bounds``' (NaN / inf / empty blocks included)."""
    groups = groups_of_blocks()
    values = rel_values(groups)
    flags = [[i % 2 == 0 for i, _ in enumerate(g)] for g in groups]
    flat = [b for g in groups for b in g]
    abs_flat = absolute_bounds(flat, [v for g in values for v in g], [f for g in flags for f in g])
    out = compress_groups(groups, values, CFG, kinds=flags)
    assert [s.bound for g in out.stats for s in g] == abs_flat
    it = iter(abs_flat)
    want = per_group(groups, [[next(it) for _ in g] for g in groups], CFG)
    assert torch.equal(out.buffer, torch.cat(want))


def test_host_corrupt_group_is_named() -> None:
    groups = groups_of_blocks()
    out = compress_groups(groups, [[1e-3] * len(g) for g in groups], CFG)
    buf = out.buffer.clone()
    buf[out.offsets[2] + 40] ^= 1  # a body byte of group 2: checksum mismatch
    blocks, status = decompress_groups(buf, out.sizes)
    assert blocks[2] == []
    with pytest.raises(CodecError, match=r"^payload 2: corrupt payload: checksum mismatch"):
        check_groups(status)


def test_host_skeletons_are_skeleton_index_words() -> None:
    """The host path's skeletons (numpy) gather the words :func:`skeleton_index` names, raw
    segments shorter than a segment header (clamped to the payload's last word) included."""
    groups = [*groups_of_blocks(), [torch.ones(1, 1)], [torch.ones(2, 1), torch.zeros(1, 1)]]
    out = compress_groups(groups, [[1e-3] * len(g) for g in groups], CFG)
    for g, group in enumerate(groups):
        words = out.payload(g).numpy().view(np.uint32)
        seg = np.array([(s.wire_bytes - DESCRIPTOR.itemsize) // 4 for s in out.stats[g]], np.int64)
        head = (HEADER.itemsize + DESCRIPTOR.itemsize * len(group)) // 4
        seg_start = torch.from_numpy(head + np.cumsum(seg) - seg)
        idx = skeleton_index(
            torch.zeros(1, dtype=torch.int64),
            torch.tensor([words.shape[0]]),
            [len(group)],
            seg_start,
        )
        assert np.array_equal(out.skeletons[g], words[idx.numpy()])
        assert np.array_equal(payload_skeletons(words, [4 * words.shape[0]])[0], out.skeletons[g])


def test_bad_arguments_name_the_fix() -> None:
    groups = groups_of_blocks()
    with pytest.raises(ValueError, match="one per group"):
        compress_groups(groups, [[0.0]], CFG)
    with pytest.raises(ValueError, match="bound kinds"):
        compress_groups(groups, rel_values(groups), CFG, kinds=[[True]])
    with pytest.raises(CodecError, match="add up to"):
        decompress_groups(torch.zeros(8, dtype=torch.uint8), [4])


triton_only = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def device_payloads() -> tuple[list[list[torch.Tensor]], list[list[float]], GroupedPayloads]:
    """groups_of_blocks on DEVICE, their bounds (1e-3) and the device path's payloads."""
    groups = [[b.to(DEVICE) for b in g] for g in groups_of_blocks()]
    values = [[1e-3] * len(g) for g in groups]
    cfg = CodecConfig(huffman_chunk_symbols=64, backend="triton")
    return groups, values, compress_groups(groups, values, cfg)


@triton_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("relative", [False, True])
def test_device_grouped_compress_is_per_group_compress_with_one_read(relative: bool) -> None:
    groups = [[b.to(DEVICE) for b in g] for g in groups_of_blocks()]
    values = rel_values(groups) if relative else [[1e-3] * len(g) for g in groups]
    cfg = CodecConfig(huffman_chunk_symbols=64, backend="triton")
    compress_groups(groups, values, cfg, kinds=relative)  # warm up
    before = host_sync.host_reads()
    out = compress_groups(groups, values, cfg, kinds=relative)
    assert host_sync.host_reads() - before == 1
    flat = [b.cpu() for g in groups for b in g]
    abs_flat = absolute_bounds(flat, [v for g in values for v in g], [relative] * len(flat))
    it = iter(abs_flat)
    abs_bounds = [[next(it) for _ in g] for g in groups]
    want = per_group([[b.cpu() for b in g] for g in groups], abs_bounds, CFG)
    assert out.sizes == [p.numel() for p in want]
    for g, w in enumerate(want):
        assert torch.equal(out.payload(g).cpu(), w), g
        assert [s.bound for s in out.stats[g]] == abs_bounds[g]


def _corrupt_codebook(payload: bytes) -> bytes:
    """A payload whose first block's codebook nibbles are all 15 (found only by decoding)."""
    buf = bytearray(payload)
    _, _, segs = parse(bytes(buf))
    off = segs[0][0] + 32
    buf[off : off + 4] = b"\xff\xff\xff\xff"
    return with_checksum(bytes(buf))


@triton_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_device_grouped_decompress_defers_status_and_names_the_group() -> None:
    payloads = dict(corpus())
    good = [payloads["quant_lz_flagged"], payloads["multi"], payloads["raw"]]
    bad = _corrupt_codebook(payloads["quant_lz_flagged"])
    parts = [*good, bad]
    buffer = torch.from_numpy(np.frombuffer(b"".join(parts), np.uint8).copy()).to(DEVICE)
    sizes = [len(p) for p in parts]
    decompress_groups(buffer, sizes, backend="triton")  # warm up
    before = host_sync.host_reads()
    blocks, status = decompress_groups(buffer, sizes, backend="triton")
    assert host_sync.host_reads() - before == 1  # the layouts; the status is not read
    for g, p in enumerate(good):
        want = decompress(torch.from_numpy(np.frombuffer(p, np.uint8).copy()))
        assert [bits(a).tolist() for a in blocks[g]] == [bits(b).tolist() for b in want]
    with pytest.raises(CodecError, match=rf"^payload {len(good)}: .*code lengths over the limit"):
        check_groups(status)
    assert host_sync.host_reads() - before == 2  # check_groups read the status


@triton_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_device_grouped_decompress_with_skeletons_reads_nothing() -> None:
    groups, values, out = device_payloads()
    host = compress_groups([[b.cpu() for b in g] for g in groups], values, CFG)
    # The sender's skeletons: the same words on both paths, and the payload's own.
    for g in range(len(groups)):
        assert np.array_equal(out.skeletons[g], host.skeletons[g])
        words = host.payload(g).numpy().view(np.uint32)
        assert np.array_equal(out.skeletons[g], payload_skeletons(words, [4 * words.shape[0]])[0])
    decompress_groups(out.buffer, out.sizes, backend="triton", skeletons=out.skeletons)
    before = host_sync.host_reads()
    blocks, status = decompress_groups(
        out.buffer, out.sizes, backend="triton", skeletons=out.skeletons
    )
    assert host_sync.host_reads() - before == 0
    check_groups(status)
    for got_g, g in zip(blocks, range(len(groups)), strict=True):
        want = decompress(host.payload(g))
        assert [bits(a).tolist() for a in got_g] == [bits(b).tolist() for b in want]
    # A flipped body bit: the device checksum finds it; the message is the CPU path's.
    bad = out.buffer.clone()
    bad[out.offsets[2] + out.sizes[2] - 1] ^= 4
    _, status = decompress_groups(bad, out.sizes, backend="triton", skeletons=out.skeletons)
    with pytest.raises(CodecError, match=r"^payload 2: corrupt payload: checksum mismatch"):
        check_groups(status)
    # A valid payload that is not the one announced (groups 0 and 2 swapped).
    swapped = torch.cat([out.payload(2), out.payload(1), out.payload(0)])
    sizes = [out.sizes[2], out.sizes[1], out.sizes[0]]
    _, status = decompress_groups(swapped, sizes, backend="triton", skeletons=out.skeletons)
    with pytest.raises(CodecError, match=r"^payload 0: .*(announced|corrupt)"):
        check_groups(status)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: sync debug mode")
def test_cuda_grouped_compress_syncs_only_in_to_host(monkeypatch: pytest.MonkeyPatch) -> None:
    groups = [[b.cuda() for b in g] for g in groups_of_blocks()]
    values = rel_values(groups)
    compress_groups(groups, values, CFG, kinds=True)  # compile first
    with cuda_syncs_only_in_to_host(monkeypatch):
        out = compress_groups(groups, values, CFG, kinds=True)
        blocks, status = decompress_groups(out.buffer, out.sizes, skeletons=out.skeletons)
        failed = contain_failures(status)  # the deferred check: no sync either
    assert failed is not None and int(failed.count_nonzero()) == 0
    check_groups(status)
    assert [len(g) for g in blocks] == [len(g) for g in groups]


@triton_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_contain_failures_zeroes_only_the_failed_group_and_reads_nothing() -> None:
    groups, values, out = device_payloads()
    bad = out.buffer.clone()
    bad[out.offsets[0] + out.sizes[0] - 1] ^= 4  # a body bit of group 0: its checksum fails
    blocks, status = decompress_groups(bad, out.sizes, backend="triton", skeletons=out.skeletons)
    before = host_sync.host_reads()
    failed = contain_failures(status)
    assert host_sync.host_reads() == before  # deferred: nothing read back
    assert failed is not None and failed.tolist() == [1, 0, 0]
    # Group 0's blocks (float32, float16 and bfloat16 views of one span) are all zeros.
    assert len(blocks[0]) == 3 and all(torch.count_nonzero(b) == 0 for b in blocks[0])
    # Group 2 is untouched: its block within the bound (and its empty block still empty).
    got, want = blocks[2][0], groups[2][0]
    assert torch.count_nonzero(got) > 0
    torch.testing.assert_close(got, want, atol=1e-3 * (1 + 1e-6), rtol=0, equal_nan=True)
    assert blocks[2][1].shape == (0, 5)
    with pytest.raises(CodecError, match=r"^payload 0: corrupt payload: checksum mismatch"):
        check_groups(status)  # the error is postponed, not dropped
    # A clean decode: all flags zero, nothing zeroed.
    blocks, status = decompress_groups(
        out.buffer, out.sizes, backend="triton", skeletons=out.skeletons
    )
    failed = contain_failures(status)
    assert failed is not None and failed.tolist() == [0, 0, 0]
    # The host path finds its errors at once: nothing to defer.
    host = compress_groups([[b.cpu() for b in g] for g in groups], values, CFG)
    _, status = decompress_groups(host.buffer, host.sizes, backend="cpu")
    assert contain_failures(status) is None


_WARM_UP_CHECK = """
import numba, torch
from torchrec_lossy.codec import grouped, host_compress, host_decompress, warm_up_host
from torchrec_lossy.config import CodecConfig

def signatures():
    return {
        (m.__name__, name): len(v.signatures)
        for m in (host_compress, host_decompress)
        for name, v in vars(m).items()
        if isinstance(v, numba.core.registry.CPUDispatcher)
    }

before = signatures()
warm_up_host()
warm = signatures()
assert warm != before, "the warm-up compiled nothing"
# What the pooled all-to-all then runs: float32 blocks of several sizes in two groups, relative
# and absolute bounds (one of them zero: the exact path), decoded in one call.
torch.manual_seed(0)
blocks = [torch.randn(n, 16) for n in (300, 1, 40)] + [torch.randn(64, 8).round()]
pending = grouped.start_compress_blocks(
    blocks, [0.03, 0.01, 0.0, 0.5], [2, 2], CodecConfig(), [True, False, False, True]
)
payloads = pending.finish([])
_, status = grouped.decompress_groups(payloads.buffer, payloads.sizes, label=False)
grouped.check_groups(status)
assert signatures() == warm, "a kernel compiled after the warm-up"
"""


def test_warm_up_host_compiles_every_kernel_the_all_to_all_calls() -> None:
    """After ``warm_up_host`` (which the CPU all-to-all calls when it is built), a first
    all-to-all's encode and decode compile nothing: in a fresh process, so that kernels compiled
    by other tests cannot hide a miss."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _WARM_UP_CHECK], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
