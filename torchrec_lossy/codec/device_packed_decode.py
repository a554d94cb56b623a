"""The packed format's device decode stages (docs/kernels.md, "The packed format on the device").

``device_decompress`` lays out a payload's blocks as for the entropy format (``format.
segment_layout`` knows packed segments: the width bytes where the chunk table is, the codes
where the bitstream is); for packed blocks these stages replace the Huffman ones: three launches
check every block (segment checksums, widths and escape lists, every code) and the output
kernel decodes each element from its code in the payload (``quantize.decode_packed_outputs``:
no symbol stream in between); each block's status comes in the CPU decoder's order.
"""

from __future__ import annotations

import numpy as np
import torch

from torchrec_lossy.codec.container import upload
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.format import (
    MODE_PACKED,
)
from torchrec_lossy.codec.kernel_set import KernelSet

CHECKSUM_TILE = 1024  # words per checksum program


def is_packed(mode: np.ndarray) -> np.ndarray:
    """Per block, whether its descriptor mode is a packed one.

    Args:
        mode: int64 descriptor modes.

    Returns:
        bool array.
    """
    return (mode & MODE_PACKED) != 0


def checksum_tiles(
    start: np.ndarray, end: np.ndarray, tile: int = CHECKSUM_TILE
) -> tuple[np.ndarray, np.ndarray]:
    """The checksum launch's tiles over word ranges (a tile never spans two ranges).

    Args:
        start: int64 [n] first word of each range (a packed segment after its header).
        end: int64 [n] its end.
        tile: Words per tile.

    Returns:
        (int64 [n_tiles, 3]: first word, its index in its range, words; int64 [n_tiles] range
        of each tile).
    """
    n_words = np.maximum(end - start, 0)
    per = -(-n_words // tile)
    owner = np.repeat(np.arange(start.shape[0], dtype=np.int64), per)
    k = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    j0 = k * tile
    n = np.minimum(tile, n_words[owner] - j0)
    return np.stack([start[owner] + j0, j0, n], axis=1), owner


def range_checksums(
    words: torch.Tensor, k: KernelSet, start: np.ndarray, end: np.ndarray
) -> torch.Tensor:
    """``sum_j w_j (2 j + 1)`` over word ranges, wrapping in int64 (a payload's checksum, or a
    packed segment's in its low 32 bits): one launch of tiled partial sums.

    Args:
        words: int32 payload words.
        k: The kernel set.
        start: int64 [n] first word of each range (host).
        end: int64 [n] its end.

    Returns:
        int64 [n] sums on ``words``' device.
    """
    tiles, owner = checksum_tiles(start, end)
    tile_t, owner_t = upload([tiles.reshape(-1), owner], words.device)
    parts = k.packed.packed_checksums(words, tile_t.view(-1, 3), CHECKSUM_TILE)
    sums = torch.zeros(start.shape[0], dtype=torch.int64, device=words.device)
    return sums.index_add_(0, owner_t, parts)


def decode_packed(
    words: torch.Tensor,
    d: DecodeColumns,
    k: KernelSet,
    ids: torch.Tensor,
    layout: tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]],
    extra: tuple[np.ndarray, np.ndarray],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks every packed block and decodes every block's elements (five launches).

    Args:
        words: int32 payload words.
        d: The blocks' decode record (its status rows written).
        k: The kernel set.
        ids: Vector ids of the LZ blocks' rows (a 1-element dummy if none).
        layout: Per block (host int64): the first word after its segment header, its
            segment's end, 1 where it is packed; then (groups of all blocks, the most escapes
            of a block, words of the output, elements of the output).
        extra: (starts, ends) of more word ranges to sum in the same launch (the payloads'
            bodies, whose checksums a skeleton-mode decode checks; empty arrays for none).

    Returns:
        (int32 output words as ``quantize.decode_outputs`` gives them, int32 [n_blocks]
        status codes, int64 sums of the ``extra`` ranges).
    """
    start, end, packed, (n_groups, max_esc, n_out_words, n_elements) = layout
    blocks = np.flatnonzero(packed)
    n_extra = extra[0].shape[0]
    sums = range_checksums(
        words, k, np.concatenate([extra[0], start[blocks]]), np.concatenate([extra[1], end[blocks]])
    )
    block_sums = torch.zeros(d.n_blocks, dtype=torch.int64, device=words.device)
    (blocks_t,) = upload([blocks], words.device)
    block_sums[blocks_t] = sums[n_extra:]
    widths = k.packed.packed_widths(words, d, n_groups)
    ends = torch.cumsum(widths, 0, dtype=torch.int32)  # < 2**31: 12 bits per value at most
    esc_iter = max(int(max_esc).bit_length(), 1)
    k.packed.check_groups(words, d, widths, ends, esc_iter)
    sizes = (n_out_words, n_elements)
    out = k.quantize.decode_packed_outputs(words, d, ids, widths, ends, sizes, esc_iter)
    return out, k.packed.packed_status(d, block_sums), sums[:n_extra]


__all__ = ["CHECKSUM_TILE", "checksum_tiles", "decode_packed", "is_packed", "range_checksums"]
