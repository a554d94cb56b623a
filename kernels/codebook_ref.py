"""Torch twins of ``kernels/codebook.py``'s launchers (no triton): the test oracle.

Same names, signatures and outputs bit for bit as the Triton launchers, for every call the
device path makes. Code lengths come from :func:`huffman_code_lengths`, the one copy of the
construction (``codec.huffman`` compiles it with numba for the CPU path), one histogram at a
time; :func:`canonical_codes` is the one copy of the vectorised canonical codes
(``kernels/codebook.py`` imports it from here);
decode tables are built one wire codebook at a time from the (length, symbol) order.
"""

from __future__ import annotations

import numpy as np
import torch

from torchrec_lossy.codec.format import ALPHABET_SIZE, ESCAPE_SYMBOL, MAX_CODE_LENGTH
from torchrec_lossy.kernels import decode_columns as dc
from torchrec_lossy.kernels.decode_columns import DecodeColumns


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


def code_lengths(hist: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.codebook.code_lengths`` (its docstring has the full contract).

    Args:
        hist: Per histogram, its symbol counts.

    Returns:
        int32 code lengths of every symbol of every histogram (0: unused), on its device.
    """
    rows = hist.detach().to(torch.int64).cpu().numpy()
    out = torch.zeros(hist.shape[0], ALPHABET_SIZE, dtype=torch.int32)
    for h in range(rows.shape[0]):
        out[h] = torch.from_numpy(huffman_code_lengths(rows[h]).astype("int32"))
    return out.to(hist.device)


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


def _wire_lengths(words: torch.Tensor, off: int, lo: int, count: int, esc_len: int) -> torch.Tensor:
    """A wire codebook's code lengths over the whole alphabet: symbols ``lo .. lo + count - 1``
    from 4-bit nibbles at word ``off`` (nibble ``k`` is bits ``4 * (k % 8)`` of word
    ``k // 8``), the escape's length last."""
    k = torch.arange(count, device=words.device)
    nibbles = (words[off + (k >> 3)].to(torch.int64) >> (4 * (k & 7))) & 0xF
    lengths = torch.zeros(ALPHABET_SIZE, dtype=torch.int64, device=words.device)
    lengths[lo : lo + count] = nibbles
    lengths[ESCAPE_SYMBOL] = esc_len
    return lengths


def _table(lengths: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The 12-bit one-lookup table of one code (all -1 when the code is bad), and whether it is
    bad (a length over ``MAX_CODE_LENGTH`` or a Kraft sum over 1).

    Canonical codes in (length, symbol) order tile the index space from 0: the code of length
    ``L`` owns ``2**(MAX_CODE_LENGTH - L)`` consecutive entries, ``symbol | L << 16``."""
    table = torch.full((ALPHABET_SIZE,), -1, dtype=torch.int32, device=lengths.device)
    used = torch.nonzero((lengths > 0) & (lengths <= MAX_CODE_LENGTH)).reshape(-1)
    spans = 1 << (MAX_CODE_LENGTH - lengths[used])
    if int(lengths.max()) > MAX_CODE_LENGTH or int(spans.sum()) > ALPHABET_SIZE:
        return table, True
    order = torch.argsort(lengths[used] * ALPHABET_SIZE + used)
    used, spans = used[order], spans[order]
    entries = torch.repeat_interleave(used | (lengths[used] << 16), spans)
    table[: entries.shape[0]] = entries.to(torch.int32)
    return table, False


def decode_tables(words: torch.Tensor, cols: DecodeColumns) -> torch.Tensor:
    """Twin of ``kernels.codebook.decode_tables`` (its docstring has the full contract).

    Args:
        words: The payload as int32 words.
        cols: The blocks' decode record (``decode_columns``); read: the block of each table and
            per block the word where its codebook starts, its first value symbol, its value
            symbols and the escape symbol's code length; written for the tables' blocks only:
            ``CODEBOOK_BAD``, 1 where the code is bad (a length over ``MAX_CODE_LENGTH`` or a
            Kraft sum over 1; that table is all -1), else 0.

    Returns:
        int32 one-lookup tables (``symbol | length << 16``, -1 where no code starts).
    """
    fields = (dc.CB_OFF, dc.SYM_LO, dc.SYM_COUNT, dc.ESC_LEN)
    per_block = [cols.column(f).tolist() for f in fields]
    bad = cols.column(dc.CODEBOOK_BAD)
    blocks = cols.column(dc.QUANT_BLOCKS).tolist()
    tables = torch.empty(len(blocks), ALPHABET_SIZE, dtype=torch.int32, device=words.device)
    for q, b in enumerate(blocks):
        lengths = _wire_lengths(words, *(column[b] for column in per_block))
        tables[q], is_bad = _table(lengths)
        bad[b] = int(is_bad)
    return tables
