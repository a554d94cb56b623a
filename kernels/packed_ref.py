"""Torch twin of the packed format's coded values (docs/format.md, "Packed segments").

The oracle of ``codec/packed.py``'s numba stream (``put_stream`` / ``decode_stream``, the host
path) and the statement a device kernel follows: every step is element-wise or per group of
``PACKED_GROUP`` values, the only cross-group step an exclusive prefix sum of the widths, so
each group's words go to their offset with no sort, no atomics and no worst-case buffer.
"""

from __future__ import annotations

import torch

from torchrec_lossy.codec.format import (
    ESCAPE_SYMBOL,
    PACKED_GROUP,
    unzigzag,
    zigzag,
)

_M32 = 0xFFFFFFFF


def _bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bit lengths of int64 values in [0, 2**24) (exact in float32's log2 there)."""
    return torch.where(x > 0, torch.floor(torch.log2(x.float())).long() + 1, 0)


def pack_codes(symbols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The width bytes and packed code words of one block's sent symbols.

    Args:
        symbols: int64 [n] symbols of the values sent, in order (``ESCAPE_SYMBOL`` where
            escaped: code 0).

    Returns:
        (uint8 [ceil(n / PACKED_GROUP)] widths; int64 [sum of widths] code words, each in
        [0, 2**32)).
    """
    n = symbols.shape[0]
    n_groups = -(-n // PACKED_GROUP)
    codes = torch.where(symbols == ESCAPE_SYMBOL, 0, zigzag(symbols))
    padded = torch.zeros(n_groups * PACKED_GROUP, dtype=torch.int64, device=symbols.device)
    padded[:n] = codes
    widths = _bit_length(padded.view(n_groups, PACKED_GROUP).amax(dim=1))
    first_word = torch.cumsum(widths, 0) - widths  # each group's offset: a prefix sum
    total = int(widths.sum())
    k = torch.arange(n_groups * PACKED_GROUP, device=symbols.device)
    group = k // PACKED_GROUP
    bit = first_word[group] * 32 + (k % PACKED_GROUP) * widths[group]
    word, shift = bit >> 5, bit & 31
    # A code spans at most two words; bits never overlap, so adding is OR-ing.
    words = torch.zeros(total + 1, dtype=torch.int64, device=symbols.device)
    words.index_add_(0, word, (padded << shift) & _M32)
    words.index_add_(0, word + 1, padded >> (32 - shift))
    return widths.to(torch.uint8), words[:total]


def unpack_codes(widths: torch.Tensor, words: torch.Tensor, n: int) -> torch.Tensor:
    """The symbols of ``n`` packed values (the mirror of :func:`pack_codes`; the widths and
    codes are assumed valid: the host decoder is the one that checks).

    Args:
        widths: uint8 [ceil(n / PACKED_GROUP)] widths.
        words: int64 code words (values in [0, 2**32)).
        n: Values.

    Returns:
        int64 [n] symbols (escaped positions decode as ``SYMBOL_OFFSET``, code 0).
    """
    w = widths.to(torch.int64)
    first_word = torch.cumsum(w, 0) - w
    k = torch.arange(n, device=words.device)
    group = k // PACKED_GROUP
    bit = first_word[group] * 32 + (k % PACKED_GROUP) * w[group]
    word, shift = bit >> 5, bit & 31
    padded = torch.cat([words, torch.zeros(1, dtype=torch.int64, device=words.device)])
    pair = padded[word.clamp(max=words.shape[0])] | (
        padded[(word + 1).clamp(max=words.shape[0])] << 32
    )
    return unzigzag((pair >> shift) & ((1 << w[group]) - 1))


def segment_checksum(words: torch.Tensor) -> int:
    """``sum_j w_j * (2 j + 1) mod 2**32`` (``codec/packed.py``'s ``segment_checksum``).

    Args:
        words: int64 words (values in [0, 2**32)).

    Returns:
        The checksum.
    """
    j = torch.arange(words.shape[0], device=words.device)
    return int(((words * (2 * j + 1)) & _M32).sum() & _M32)


__all__ = ["pack_codes", "segment_checksum", "unpack_codes"]
