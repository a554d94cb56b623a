"""Torch twins of ``kernels/codebook.py``'s launchers (no triton): the test oracle.

Same names, signatures and outputs bit for bit as the Triton launchers, for every call the
device path makes. Code lengths come from ``codec.codebook.huffman_code_lengths``, the one copy
of the construction (``codec.huffman`` compiles it with numba for the CPU path), one histogram
at a time; ``canonical_codes`` is the codec's vectorised canonical codes
(``codec/codebook.py``), re-exported so both kernel sets name it alike; decode tables are built
one wire codebook at a time from the (length, symbol) order.
"""

from __future__ import annotations

import torch

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec.codebook import canonical_codes as canonical_codes
from torchrec_lossy.codec.codebook import huffman_code_lengths
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.format import ALPHABET_SIZE, ESCAPE_SYMBOL, MAX_CODE_LENGTH


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
