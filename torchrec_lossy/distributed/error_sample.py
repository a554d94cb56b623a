"""The sender's error sample (telemetry): it decodes a payload of its own and sums each block's
errors over its finite elements in one compiled pass (``LossyCommsStats.record_error_samples``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numba
import numpy as np
import torch

from torchrec_lossy.codec import check_groups, decompress_groups
from torchrec_lossy.distributed.stats import Direction, ErrorSample, LossyCommsStats
from torchrec_lossy.profile_range import profile_range


def record_error_samples(
    stats: LossyCommsStats,
    direction: Direction,
    payload: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    tables: Sequence[str],
) -> None:
    """Decodes a host codec payload on its sender and records each block's
    :class:`ErrorSample`: the signed and squared error sums, the squared value sum and the
    values snapped to zero, over the block's finite elements.

    Args:
        stats: Where the samples go.
        direction: ``"fwd"`` or ``"bwd"``.
        payload: The codec payload of ``blocks``.
        blocks: The blocks it was encoded from, in payload order.
        tables: Each block's table.
    """
    with profile_range(f"## lossy_a2a {direction} error sample ##"):
        decoded, status = decompress_groups(payload, [payload.numel()])
        check_groups(status)  # our own payload: a failure here is a codec bug
        ends = np.cumsum([b.numel() for b in blocks], dtype=np.int64)
        sums = _error_sums_kernel(_flat_float32(blocks), _flat_float32(decoded[0]), ends)
        stats.record_error_samples(
            direction,
            [
                ErrorSample(table, err, int(n), err_sq, val_sq, int(snapped))
                for table, (err, err_sq, val_sq, snapped, n) in zip(
                    tables, sums.tolist(), strict=True
                )
            ],
        )


def _flat_float32(blocks: Sequence[torch.Tensor]) -> np.ndarray:
    """The blocks' values back to back as float32 (exact for every codec dtype)."""
    return torch.cat([b.detach().reshape(-1).float() for b in blocks]).numpy()


@numba.njit(cache=True, nogil=True)
def _error_sums_kernel(x: np.ndarray, y: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per block (block ``b``: elements up to ``ends[b]``), over its elements whose error
    ``y - x`` is finite: the sums of the error, of its square and of ``x**2``, how many ``x != 0``
    decoded to 0, and how many there are; float64 [blocks, 5]."""
    out = np.zeros((ends.shape[0], 5))
    start = 0
    for b in range(ends.shape[0]):
        for i in range(start, ends[b]):
            xv, yv = np.float64(x[i]), np.float64(y[i])
            err = yv - xv
            if np.isfinite(err):
                out[b, 0] += err
                out[b, 1] += err * err
                out[b, 2] += xv * xv
                out[b, 3] += xv != 0.0 and yv == 0.0
                out[b, 4] += 1.0
        start = ends[b]
    return out


@functools.cache
def warm_up_host() -> None:
    """Loads the sample's compiled pass now (once per process), so that its first call in a
    process (about 0.1 s from numba's cache) does not land in a training step."""
    x = np.zeros(1, np.float32)
    _error_sums_kernel(x, x, np.ones(1, np.int64))
