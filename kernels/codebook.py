"""Huffman codebooks on the device: code lengths and canonical codes for many histograms at once.

:func:`code_lengths` returns, per row of a ``[n, ALPHABET_SIZE]`` histogram, exactly what
``codec.huffman.code_lengths_kernel`` does (two-queue merge, tie-breaking, JPEG Annex K.3
limiting): a torch sort of the leaves by (count, symbol), one sequential program per histogram
(``_code_lengths_kernel``, on one warp), then torch assigns lengths by rank.
:func:`canonical_codes` (torch, from ``codec/codebook.py``) is ``canonical_codes_kernel``'s
twin; :func:`decode_tables` builds the decoder's one-lookup tables. docs/kernels.md, 'The kernels'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec.codebook import canonical_codes as canonical_codes
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.format import ALPHABET_SIZE, MAX_CODE_LENGTH

_ALPHABET: tl.constexpr = tl.constexpr(ALPHABET_SIZE)
_MAX_LEN: tl.constexpr = tl.constexpr(MAX_CODE_LENGTH)
_DEPTH_BLOCK = 1024


@triton.jit
def _pick(w, next_leaf, next_internal, m, n_nodes):
    """The lighter queue head (a leaf on a tie, as the CPU kernel): (node, its weight, the
    advanced queue positions)."""
    wl = tl.load(w + next_leaf, mask=next_leaf < m, other=0)
    wi = tl.load(w + next_internal, mask=next_internal < n_nodes, other=0)
    leaf = (next_leaf < m) & ((next_internal >= n_nodes) | (wl <= wi))
    node = tl.where(leaf, next_leaf, next_internal)
    weight = tl.where(leaf, wl, wi)
    return node, weight, next_leaf + leaf.to(tl.int64), next_internal + 1 - leaf.to(tl.int64)


@triton.jit
def _code_lengths_kernel(
    m_ptr, weight_ptr, parent_ptr, depth_ptr, blc_ptr, out_ptr, BLOCK: tl.constexpr
):
    h = tl.program_id(0).to(tl.int64)
    m = tl.load(m_ptr + h).to(tl.int64)
    w = weight_ptr + h * (2 * _ALPHABET)  # leaves' counts at [0, m) (sorted), internal after
    par = parent_ptr + h * (2 * _ALPHABET)
    dep = depth_ptr + h * (2 * _ALPHABET)
    blc = blc_ptr + h * _ALPHABET
    # The scalar loops below re-read what they stored, and a scalar store is issued by one
    # thread only: a tl.debug_barrier() separates each store from a later load of its address.

    # Two queues: leaves (sorted by count, symbol) and internal nodes (created in weight order).
    next_leaf = tl.zeros([], dtype=tl.int64)
    next_internal = m
    n_nodes = m
    for _ in range(1, m):
        a, wa, next_leaf, next_internal = _pick(w, next_leaf, next_internal, m, n_nodes)
        b, wb, next_leaf, next_internal = _pick(w, next_leaf, next_internal, m, n_nodes)
        tl.store(w + n_nodes, wa + wb)
        tl.store(par + a, n_nodes)
        tl.store(par + b, n_nodes)
        n_nodes += 1
        tl.debug_barrier()
    # Depths, root first: every node's parent was created after it.
    for k in range(3, 2 * m + 1):  # node 2m - 2, the root, keeps depth 0
        node = 2 * m - k
        tl.store(dep + node, tl.load(dep + tl.load(par + node)) + 1)
        tl.debug_barrier()
    # bl_count over the leaves' depths (a single symbol gets length 1).
    counts = tl.zeros([_ALPHABET], dtype=tl.int32)
    max_depth = tl.zeros([], dtype=tl.int64)
    for start in range(0, m, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < m
        d = tl.load(dep + idx, mask=mask, other=0)
        d = tl.where(m == 1, 1, d)
        counts += tl.histogram(d.to(tl.int32), _ALPHABET, mask=mask).to(tl.int32)
        max_depth = tl.maximum(max_depth, tl.max(tl.where(mask, d, 0), axis=0))
    tl.store(blc + tl.arange(0, _ALPHABET), counts)
    tl.debug_barrier()
    # JPEG Annex K.3: move pairs of too-deep leaves up, splitting a shallower leaf each time.
    i = max_depth
    while i > _MAX_LEN:
        ci = tl.load(blc + i)
        if ci > 0:
            j = i - 2
            cj = tl.load(blc + j)
            while cj == 0:
                j -= 1
                cj = tl.load(blc + j)
            tl.store(blc + i, ci - 2)
            tl.debug_barrier()
            tl.store(blc + i - 1, tl.load(blc + i - 1) + 1)
            tl.debug_barrier()
            tl.store(blc + j + 1, tl.load(blc + j + 1) + 2)
            tl.debug_barrier()
            tl.store(blc + j, tl.load(blc + j) - 1)
            tl.debug_barrier()
        i = tl.where(ci > 0, i, i - 1)
    lens = tl.arange(0, 16)
    tl.store(
        out_ptr + h * 16 + lens,
        tl.load(blc + lens, mask=(lens >= 1) & (lens <= _MAX_LEN), other=0),
    )


def code_lengths(hist: torch.Tensor) -> torch.Tensor:
    """Length-limited Huffman code lengths of many histograms, like ``code_lengths_kernel``.

    Args:
        hist: int32 / int64 [n, ALPHABET_SIZE] symbol counts.

    Returns:
        int32 [n, ALPHABET_SIZE] code lengths (0 = unused symbol), on the histograms' device.
        Nothing is synced.
    """
    n = hist.shape[0]
    dev = hist.device
    hist = hist.to(torch.int64)
    used = hist > 0
    symbols = torch.arange(ALPHABET_SIZE, device=dev)
    # (count, symbol) order, the CPU kernel's stable argsort of the used symbols' counts.
    key = torch.where(used, hist * ALPHABET_SIZE + symbols, torch.iinfo(torch.int64).max)
    key, _ = torch.sort(key, dim=1)
    m = used.sum(dim=1)
    leaves = key % ALPHABET_SIZE
    weight = torch.zeros(n, 2 * ALPHABET_SIZE, dtype=torch.int64, device=dev)
    weight[:, :ALPHABET_SIZE] = key // ALPHABET_SIZE
    parent = torch.zeros_like(weight)
    depth = torch.zeros_like(weight)
    scratch = torch.zeros(n, ALPHABET_SIZE, dtype=torch.int32, device=dev)
    bl_count = torch.zeros(n, 16, dtype=torch.int32, device=dev)
    if n:
        _code_lengths_kernel[(n,)](
            m, weight, parent, depth, scratch, bl_count, BLOCK=_DEPTH_BLOCK, num_warps=1
        )
    # Shortest codes to the most frequent leaves: leaf k (ascending count) is the
    # (m - 1 - k)-th most frequent and gets the first length whose cumulative count exceeds that.
    cum = torch.cumsum(bl_count[:, 1 : MAX_CODE_LENGTH + 1].to(torch.int64), dim=1)
    rank = (m[:, None] - 1 - symbols[None, :]).clamp(min=0).contiguous()
    length = 1 + torch.searchsorted(cum, rank, right=True)
    valid = symbols[None, :] < m[:, None]
    out = torch.zeros(n, ALPHABET_SIZE + 1, dtype=torch.int32, device=dev)
    out.scatter_(
        1, torch.where(valid, leaves, ALPHABET_SIZE), torch.where(valid, length, 0).to(torch.int32)
    )
    return out[:, :ALPHABET_SIZE].contiguous()


# ------------------------------------------------------------------------------------------------
# Decode side: one-lookup decode tables straight from the wire codebooks (device decompress).


@triton.jit
def _decode_table_kernel(words_ptr, cols_ptr, stride, sorted_ptr, table_ptr):
    # One program per codebook. Canonical codes ordered by (length, symbol) tile the 12-bit
    # index space in that order, so entry t belongs to the k-th code of the length class whose
    # span holds t: the class is found by comparing t with the 12 class bases, the symbol by
    # its position in (length, symbol) order (scattered to `sorted` first). Field F of block b
    # is at cols_ptr + F * stride + b (``decode_columns``).
    q = tl.program_id(0).to(tl.int64)
    b = tl.load(cols_ptr + dc.QUANT_BLOCKS * stride + q)
    off = tl.load(cols_ptr + dc.CB_OFF * stride + b)
    lo = tl.load(cols_ptr + dc.SYM_LO * stride + b).to(tl.int32)
    count = tl.load(cols_ptr + dc.SYM_COUNT * stride + b).to(tl.int32)
    esc_len = tl.load(cols_ptr + dc.ESC_LEN * stride + b).to(tl.int32)
    s = tl.arange(0, _ALPHABET)
    # Wire codebook: lengths of symbols lo .. lo + count - 1, 4 bits each, low nibble first,
    # i.e. nibble k is bits 4 * (k % 8) of little-endian word k // 8.
    k = s - lo
    in_book = (k >= 0) & (k < count)
    word = tl.load(words_ptr + off + (k >> 3), mask=in_book, other=0)
    length = tl.where(in_book, (word >> (4 * (k & 7))) & 0xF, 0)
    length = tl.where(s == _ALPHABET - 1, esc_len, length)
    pos = tl.zeros([_ALPHABET], dtype=tl.int32)
    before = tl.zeros([], dtype=tl.int32)
    kraft = tl.zeros([], dtype=tl.int32)  # in units of 2**-12
    for n_bits in tl.static_range(1, _MAX_LEN + 1):
        in_class = length == n_bits
        pos = tl.where(in_class, before + tl.cumsum(in_class.to(tl.int32), axis=0) - 1, pos)
        n_codes = tl.sum(in_class.to(tl.int32), axis=0)
        before += n_codes
        kraft += n_codes << (_MAX_LEN - n_bits)
    bad = (tl.max(length, axis=0) > _MAX_LEN) | (kraft > _ALPHABET)
    srt = sorted_ptr + q * _ALPHABET
    tl.store(srt + pos, s, mask=(length > 0) & ~bad)
    tl.debug_barrier()  # the scatter above is read back by other threads below
    cls = tl.zeros([_ALPHABET], dtype=tl.int32)
    cls_base = tl.zeros([_ALPHABET], dtype=tl.int32)
    cls_first = tl.zeros([_ALPHABET], dtype=tl.int32)
    cls_unit = tl.full([_ALPHABET], 1, tl.int32)  # entries per code of the class
    base = tl.zeros([], dtype=tl.int32)
    first = tl.zeros([], dtype=tl.int32)
    for n_bits in tl.static_range(1, _MAX_LEN + 1):
        n_codes = tl.sum((length == n_bits).to(tl.int32), axis=0)
        span = n_codes << (_MAX_LEN - n_bits)
        inside = (s >= base) & (s < base + span)
        cls = tl.where(inside, n_bits, cls)
        cls_base = tl.where(inside, base, cls_base)
        cls_first = tl.where(inside, first, cls_first)
        cls_unit = tl.where(inside, _ALPHABET >> n_bits, cls_unit)
        base += span
        first += n_codes
    valid = (cls > 0) & ~bad
    p = cls_first + (s - cls_base) // cls_unit  # the k-th code of its class
    sym = tl.load(srt + p, mask=valid, other=0)
    tl.store(table_ptr + q * _ALPHABET + s, tl.where(valid, sym | (cls << 16), -1))
    tl.store(cols_ptr + dc.CODEBOOK_BAD * stride + b, bad.to(tl.int64))


def decode_tables(words: torch.Tensor, cols: DecodeColumns) -> torch.Tensor:
    """12-bit one-lookup decode tables of many wire codebooks, in one launch.

    Table ``q`` is ``huffman.decode_table_kernel`` of block ``QUANT_BLOCKS[q]``'s code lengths,
    widened to ``2**MAX_CODE_LENGTH`` entries (each entry of a ``peek``-bit table repeated
    ``2**(12 - peek)`` times): ``symbol | length << 16``, -1 for bit patterns no code starts
    with. Nothing is synced.

    Args:
        words: int32 words holding the codebooks (the payload).
        cols: The blocks' decode record; read: ``QUANT_BLOCKS`` (the block of each table),
            ``CB_OFF`` (word offset of each block's codebook in ``words``), ``SYM_LO`` (first
            value symbol), ``SYM_COUNT`` (value symbols; ``SYM_LO + SYM_COUNT <= 4095``,
            checked by the caller), ``ESC_LEN`` (code length of the escape symbol, <= 12,
            checked by the caller). Written: ``CODEBOOK_BAD``, for the ``QUANT_BLOCKS`` only: 1
            where a length exceeds 12 or the Kraft sum exceeds 1 (``DECODE_BAD_CODEBOOK``; that
            table is all -1), else 0.

    Returns:
        int32 [n_quant, ALPHABET_SIZE] tables on the words' device.
    """
    n = cols.n_quant
    dev = words.device
    tables = torch.empty(n, ALPHABET_SIZE, dtype=torch.int32, device=dev)
    if n:
        scratch = torch.empty(n, ALPHABET_SIZE, dtype=torch.int32, device=dev)
        _decode_table_kernel[(n,)](words, cols.cols, cols.stride, scratch, tables, num_warps=8)
    return tables


# The @triton.jit kernels by name, for the ahead-of-time compile check (``kernels/_aot.py``);
# callers launch them through the functions above.
JIT_KERNELS = {
    "code_lengths_kernel": _code_lengths_kernel,
    "decode_table_kernel": _decode_table_kernel,
}
