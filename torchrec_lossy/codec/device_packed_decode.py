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

from torchrec_lossy.codec import decode_columns as dc
from torchrec_lossy.codec.container import upload
from torchrec_lossy.codec.decode_columns import DecodeColumns
from torchrec_lossy.codec.format import (
    DECODE_BAD_CHECKSUM,
    DECODE_BAD_PACKED_CODE,
    DECODE_BAD_PACKED_ESCAPES,
    DECODE_BAD_WIDTH,
    MODE_PACKED,
    REFS_OUT_OF_RANGE,
)
from torchrec_lossy.codec.kernel_set import KernelSet
from torchrec_lossy.codec.launch_tables import NO_FAILURE

CHECKSUM_TILE = 1024  # words per checksum program
_MASK32 = 0xFFFFFFFF


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


def decode_packed(
    words: torch.Tensor,
    d: DecodeColumns,
    k: KernelSet,
    ids: torch.Tensor,
    layout: tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks every packed block and decodes every block's elements (four launches).

    Args:
        words: int32 payload words.
        d: The blocks' decode record (its status rows written).
        k: The kernel set.
        ids: Vector ids of the LZ blocks' rows (a 1-element dummy if none).
        layout: Per block (host int64): the first word after its segment header, its
            segment's end, 1 where it is packed; then (groups of all blocks, the most escapes
            of a block, words of the output, elements of the output).

    Returns:
        (int32 output words as ``quantize.decode_outputs`` gives them, int32 [n_blocks]
        status codes).
    """
    start, end, packed, (n_groups, max_esc, n_out_words, n_elements) = layout
    tiles, owner = checksum_tiles(start[packed == 1], end[packed == 1])
    blocks = np.flatnonzero(packed)[owner]
    tile_t, blk_t = upload([tiles.reshape(-1), blocks], words.device)
    parts = k.packed.packed_checksums(words, tile_t.view(-1, 3), CHECKSUM_TILE)
    sums = torch.zeros(d.n_blocks, dtype=torch.int64, device=words.device)
    sums.index_add_(0, blk_t, parts)
    widths = k.packed.packed_widths(words, d, n_groups)
    ends = torch.cumsum(widths, 0, dtype=torch.int32)  # < 2**31: 12 bits per value at most
    esc_iter = max(int(max_esc).bit_length(), 1)
    k.packed.check_groups(words, d, widths, ends, esc_iter)
    sizes = (n_out_words, n_elements)
    out = k.quantize.decode_packed_outputs(words, d, ids, widths, ends, sizes, esc_iter)
    return out, packed_status(d, sums)


def packed_status(d: DecodeColumns, sums: torch.Tensor) -> torch.Tensor:
    """Each packed block's status in the CPU decoder's order: its references, then its
    checksum, its widths, a code, its escapes (``packed.decode_stream``).

    Args:
        d: The decode record after the packed stages (status rows ``REFS_BAD``, ``TABLE_BAD``,
            ``FAIL``, ``ESC_BAD``).
        sums: int64 [n_blocks] checksums of the segments' words (low 32 bits compared with the
            header's ``sym_lo | sym_count << 16``).

    Returns:
        int32 [n_blocks]: 0, ``REFS_OUT_OF_RANGE`` or a packed ``DECODE_*`` code (0 for blocks
        without codes).
    """
    stored = d.column(dc.SYM_LO) | (d.column(dc.SYM_COUNT) << 16)
    code = torch.where(d.column(dc.ESC_BAD) != NO_FAILURE, DECODE_BAD_PACKED_ESCAPES, 0)
    code = torch.where(d.column(dc.FAIL) != NO_FAILURE, DECODE_BAD_PACKED_CODE, code)
    code = torch.where(d.column(dc.TABLE_BAD) != 0, DECODE_BAD_WIDTH, code)
    code = torch.where((sums & _MASK32) != stored, DECODE_BAD_CHECKSUM, code)
    code = torch.where(d.column(dc.HAS_STREAM) != 0, code, 0)
    return torch.where(d.column(dc.REFS_BAD) != 0, REFS_OUT_OF_RANGE, code).to(torch.int32)


__all__ = ["CHECKSUM_TILE", "checksum_tiles", "decode_packed", "is_packed", "packed_status"]
