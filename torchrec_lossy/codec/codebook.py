"""Huffman code construction the codec owns: length-limited code lengths and canonical codes.

:func:`huffman_code_lengths` is the one copy of the length-limited construction: the CPU path
compiles it with numba (``codec.huffman.code_lengths_kernel``) and the device path's torch twin
(``kernels/codebook_ref.py``) runs it one histogram at a time; the Triton launcher
(``kernels/codebook.py``) is tested against it. :func:`canonical_codes` gives the canonical codes
of many code-length tables at once in torch (both kernel sets' ``canonical_codes``).
No triton and no numba here: ``kernels/`` imports this module.
"""

from __future__ import annotations

import numpy as np
import torch

from torchrec_lossy.codec.format import ALPHABET_SIZE, MAX_CODE_LENGTH


def huffman_code_lengths(hist: np.ndarray) -> np.ndarray:
    """Length-limited Huffman code lengths (``codec.huffman.code_lengths_kernel`` compiles it).

    Args:
        hist: int64 [ALPHABET_SIZE] symbol counts.

    Returns:
        uint8 [ALPHABET_SIZE] code lengths (0 = unused symbol), all <= MAX_CODE_LENGTH, forming
        a complete prefix code when two or more symbols occur.
    """
    lengths = np.zeros(hist.shape[0], dtype=np.uint8)
    used = np.nonzero(hist)[0]
    m = used.shape[0]
    if m == 0:
        return lengths
    if m == 1:
        lengths[used[0]] = 1
        return lengths
    leaves = used[np.argsort(hist[used], kind="mergesort")]  # by (count, symbol)
    weight = np.empty(2 * m - 1, dtype=np.int64)
    parent = np.empty(2 * m - 1, dtype=np.int64)
    weight[:m] = hist[leaves]
    next_leaf = 0
    next_internal = m
    n_nodes = m
    for _ in range(m - 1):
        for t in range(2):  # the two lightest nodes (scalars: no array per merge)
            take_leaf = next_leaf < m and (
                next_internal >= n_nodes or weight[next_leaf] <= weight[next_internal]
            )
            if take_leaf:
                node = next_leaf
                next_leaf += 1
            else:
                node = next_internal
                next_internal += 1
            parent[node] = n_nodes
            if t == 0:
                weight[n_nodes] = weight[node]
            else:
                weight[n_nodes] += weight[node]
        n_nodes += 1
    depth = np.zeros(2 * m - 1, dtype=np.int64)
    for node in range(2 * m - 3, -1, -1):
        depth[node] = depth[parent[node]] + 1
    max_depth = depth[:m].max()
    bl_count = np.zeros(max(max_depth, MAX_CODE_LENGTH) + 1, dtype=np.int64)
    for i in range(m):
        bl_count[depth[i]] += 1
    # JPEG Annex K.3: move pairs of too-deep leaves up, splitting a shallower leaf each time.
    for i in range(max_depth, MAX_CODE_LENGTH, -1):
        while bl_count[i] > 0:
            j = i - 2
            while bl_count[j] == 0:
                j -= 1
            bl_count[i] -= 2
            bl_count[i - 1] += 1
            bl_count[j + 1] += 2
            bl_count[j] -= 1
    # Shortest codes to the most frequent symbols (leaves are sorted by ascending count).
    k = m - 1
    for length in range(1, MAX_CODE_LENGTH + 1):
        for _ in range(bl_count[length]):
            lengths[leaves[k]] = length
            k -= 1
    return lengths


def canonical_codes(lengths: torch.Tensor) -> torch.Tensor:
    """Canonical codes of many code-length tables, like ``canonical_codes_kernel``.

    Args:
        lengths: int32 [n, ALPHABET_SIZE] code lengths (<= MAX_CODE_LENGTH).

    Returns:
        int64 [n, ALPHABET_SIZE] codes, right-aligned in ``lengths`` bits (0 where unused).
    """
    n = lengths.shape[0]
    dev = lengths.device
    lengths = lengths.to(torch.int64)
    n_len = MAX_CODE_LENGTH + 1
    bl_count = torch.zeros(n, n_len, dtype=torch.int64, device=dev)
    bl_count.scatter_add_(1, lengths, torch.ones_like(lengths))
    bl_count[:, 0] = 0
    # next_code[L] = (next_code[L-1] + bl_count[L-1]) << 1 = sum_{l < L} bl_count[l] << (L - l).
    ls = torch.arange(n_len, device=dev)
    weights = torch.where(
        ls[:, None] < ls[None, :], 1 << (ls[None, :] - ls[:, None]).clamp(min=0), 0
    )
    first_code = (bl_count[:, :, None] * weights[None]).sum(dim=1)
    # Position of each symbol in (length, symbol) order, minus where its length starts.
    symbols = torch.arange(ALPHABET_SIZE, device=dev)
    order = torch.argsort(lengths * ALPHABET_SIZE + symbols, dim=1)
    starts = torch.cumsum(bl_count, dim=1) - bl_count + (lengths == 0).sum(dim=1, keepdim=True)
    starts[:, 0] = 0
    pos = torch.empty_like(order)
    pos.scatter_(1, order, symbols.expand(n, -1).contiguous())
    codes = first_code.gather(1, lengths) + pos - starts.gather(1, lengths)
    return torch.where(lengths > 0, codes, 0)
