"""Helpers shared by the codec's Triton kernels: block sizes and a multi-block integer scan.

The scan is the only cross-program dependency the codec's kernels have (chunk offsets of the
Huffman stream, first-occurrence ranks of vector-LZ, hash-run starts). It runs in three phases
(per-block reduce, one program scanning the block totals, per-block scan plus the total of the
blocks before), so its result does not depend on the block size or on the order programs run
in: integer sums and maxima are exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_lossy.codec.launch_tables import block_for

SCAN_SUM = 0
SCAN_MAX = 1
# Block of the scan kernels: a few thousand rows or chunks take one program.
_SCAN_BLOCK = 4096
_IDENTITY = {
    (SCAN_SUM, torch.int32): 0,
    (SCAN_SUM, torch.int64): 0,
    (SCAN_MAX, torch.int32): -(1 << 31),
    (SCAN_MAX, torch.int64): -(1 << 63),
}


@triton.jit
def max_combine(a, b):
    """Combine function of a max-scan."""
    return tl.maximum(a, b)


@triton.jit
def _scan_block(x, OP: tl.constexpr):
    if OP == 0:
        return tl.cumsum(x, axis=0)
    else:
        return tl.associative_scan(x, 0, max_combine)


@triton.jit
def _reduce_block(x, OP: tl.constexpr):
    if OP == 0:
        return tl.sum(x, axis=0)
    else:
        return tl.max(x, axis=0)


@triton.jit
def scan_reduce_kernel(x_ptr, part_ptr, n, identity, OP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=identity)
    tl.store(part_ptr + pid, _reduce_block(x, OP))


@triton.jit
def scan_partials_kernel(part_ptr, n_parts, OP: tl.constexpr, BLOCK: tl.constexpr):
    # One program: inclusive scan of the block totals, in place (there are few of them).
    carry = tl.load(part_ptr)  # part[0]: its own inclusive prefix, and a neutral carry
    for start in range(0, n_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_parts
        p = tl.load(part_ptr + offs, mask=mask, other=0)
        if OP == 0:
            incl = tl.cumsum(p, axis=0) + tl.where(start == 0, 0, carry)
        else:
            incl = tl.maximum(tl.associative_scan(p, 0, max_combine), carry)
        tl.store(part_ptr + offs, incl, mask=mask)
        # The last valid lane holds the running total.
        last = tl.minimum(n_parts - start, BLOCK) - 1
        carry = tl.sum(tl.where(tl.arange(0, BLOCK) == last, incl, 0), axis=0)


@triton.jit
def scan_apply_kernel(x_ptr, part_ptr, out_ptr, n, identity, OP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=identity)
    incl = _scan_block(x, OP)
    if pid > 0:  # fold in the inclusive total of the blocks before this one
        prefix = tl.load(part_ptr + pid - 1)
        incl = incl + prefix if OP == 0 else tl.maximum(incl, prefix)
    tl.store(out_ptr + offs, incl, mask=mask)


def inclusive_scan(x: torch.Tensor, op: int = SCAN_SUM, block: int = _SCAN_BLOCK) -> torch.Tensor:
    """Inclusive prefix sum or prefix max of a 1-D int32 / int64 tensor, on its device.

    Args:
        x: 1-D int32 or int64 tensor (sums wrap like the dtype).
        op: :data:`SCAN_SUM` or :data:`SCAN_MAX`.
        block: Elements per program (a power of two).

    Returns:
        A tensor of the same dtype and device.
    """
    x = x.contiguous()
    n = x.shape[0]
    out = torch.empty_like(x)
    if n == 0:
        return out
    identity = _IDENTITY[(op, x.dtype)]
    block = block_for(n, block)
    n_blocks = triton.cdiv(n, block)
    parts = torch.empty(n_blocks, dtype=x.dtype, device=x.device)
    if n_blocks > 1:
        scan_reduce_kernel[(n_blocks,)](x, parts, n, identity, OP=op, BLOCK=block)
        scan_partials_kernel[(1,)](
            parts, n_blocks, OP=op, BLOCK=block_for(n_blocks, 1024), num_warps=4
        )
    scan_apply_kernel[(n_blocks,)](x, parts, out, n, identity, OP=op, BLOCK=block)
    return out


@triton.jit
def find_segment(bases_ptr, idx, n_segments, n_iter):
    """The segment holding flat index ``idx``, by binary search (lanes or a scalar).

    Batched kernels launch over a flat index space that concatenates many segments (blocks);
    ``bases`` (int64, ``n_segments + 1`` entries, non-decreasing, ``bases[0] == 0``) holds each
    segment's first index. Returns the ``s`` with ``bases[s] <= idx < bases[s + 1]`` (the last
    such ``s`` when empty segments repeat a base; ``n_segments - 1`` when ``idx`` is past the
    end, so masked lanes still load in bounds). ``n_iter >= bit_length(n_segments)``.
    """
    lo = idx * 0
    hi = lo + n_segments
    for _ in range(n_iter):
        active = hi - lo > 1
        mid = (lo + hi) // 2
        first = tl.load(bases_ptr + mid, mask=active, other=0)
        right = first <= idx
        lo = tl.where(active & right, mid, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo
