"""Host-side tables the kernel launchers take, shared with their torch twins (no triton import).

Block sizes, tile tables over back-to-back segments, the vector-LZ row hash's column multipliers
and the no-failure sentinel of the decode status rows: the orchestration (``device_compress`` /
``device_decompress``) builds them the same way whichever kernel set runs.
"""

from __future__ import annotations

import functools

import numpy as np

NO_FAILURE = (1 << 63) - 1  # initial value of the first-failure rows of the decode status
_MASK64 = (1 << 64) - 1


def block_for(n: int, cap: int, floor: int = 16) -> int:
    """A power-of-two block size covering ``n`` elements, between ``floor`` and ``cap``.

    Args:
        n: Elements to cover.
        cap: Largest block wanted (a power of two).
        floor: Smallest block wanted (a power of two).

    Returns:
        The block size.
    """
    return max(floor, min(cap, 1 << (max(n, 1) - 1).bit_length()))


def tile_table(sizes: np.ndarray, block: int) -> np.ndarray:
    """Tiles of at most ``block`` elements over segments laid out back to back (host-side).

    Batched kernels that need one segment per program (a per-block histogram row, per-block
    parameters as scalars) launch one program per tile.

    Args:
        sizes: int64 [n_segments] elements per segment.
        block: Elements per tile.

    Returns:
        int64 [n_tiles, 3] (first element, end element, segment); a tile never straddles two
        segments and empty segments have none.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    n_tiles = (sizes + block - 1) // block
    seg = np.repeat(np.arange(sizes.shape[0], dtype=np.int64), n_tiles)
    k = np.arange(seg.shape[0], dtype=np.int64) - (np.cumsum(n_tiles) - n_tiles)[seg]
    lo = starts[seg] + k * block
    return np.stack([lo, np.minimum(lo + block, ends[seg]), seg], axis=1).reshape(-1, 3)


def column_multipliers(dim: int) -> np.ndarray:
    """The row hash's per-column odd multipliers as int64 bit patterns (host-side, cached).

    Args:
        dim: Number of columns.

    Returns:
        int64 [dim] (the first ``k`` do not depend on ``dim``).
    """
    return _column_multipliers(dim)


@functools.lru_cache(maxsize=64)
def _column_multipliers(dim: int) -> np.ndarray:
    """The per-column odd multipliers of the row hash (the CPU dedupe's,
    ``vector_lz.dedupe_blocks_kernel``), as int64 bit patterns."""
    mults = np.empty(dim, dtype=np.uint64)
    m = 0x9E3779B97F4A7C15
    for j in range(dim):
        mults[j] = m | 1
        m = (m * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    return mults.view(np.int64)
