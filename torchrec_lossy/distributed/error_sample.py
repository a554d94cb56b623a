"""The sender's error sample (telemetry): it decodes a payload of its own and sums each block's
errors over its finite elements in one compiled pass (``LossyCommsStats.record_error_samples``).

Beside the block's error energy it measures the error against each row's own scale (issue 32:
a bound relative to a block's range is loose for its small rows, which is what costs a
gradient's accuracy): a row's relative error energy is ``sum (x' - x)**2 / sum x**2`` over its
finite elements (rows with ``sum x**2 = 0`` left out), and a sampled gradient block whose mean
over rows passes :data:`ROW_ENERGY_LEVEL`, or a block of either direction that holds a NaN or
Inf, is recorded as an ``ErrorAlert`` with its table and call (the step, for a module called
once a step). The forward's row energy is reported, not alerted on: its block bounds pass the
level too (0.1-0.5 in the example), and docs/accuracy.md found no training cost from them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numba
import numpy as np
import torch

from torchrec_lossy.codec import check_groups, decompress_groups
from torchrec_lossy.distributed.stats import Direction, ErrorAlert, ErrorSample, LossyCommsStats
from torchrec_lossy.profile_range import profile_range

# The mean row-relative error energy a sampled block may reach before it is reported: 4e-3,
# the error energy under which docs/accuracy.md's forward study saw no AUC cost. A homogeneous
# block at 0.01 of its range stays near 1e-3 (tests/test_backward_error_models.py); rows a
# hundred times smaller than the block's largest pass it.
ROW_ENERGY_LEVEL = 4e-3


def record_error_samples(
    stats: LossyCommsStats,
    direction: Direction,
    payload: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    tables: Sequence[str],
    call: int = -1,
) -> None:
    """Decodes a host codec payload on its sender and records each block's
    :class:`ErrorSample`: the signed and squared error sums, the squared value sum, the values
    snapped to zero and the row-relative error energy, over the block's finite elements, and
    an :class:`ErrorAlert` for a gradient block past :data:`ROW_ENERGY_LEVEL` or a block
    holding NaN / Inf.

    Args:
        stats: Where the samples go.
        direction: ``"fwd"`` or ``"bwd"``.
        payload: The codec payload of ``blocks``.
        blocks: The blocks it was encoded from, in payload order.
        tables: Each block's table.
        call: The call's number in its direction (the alerts' step; -1: unknown).
    """
    with profile_range(f"## lossy_a2a {direction} error sample ##"):
        decoded, status = decompress_groups(payload, [payload.numel()])
        check_groups(status)  # our own payload: a failure here is a codec bug
        ends = np.cumsum([b.numel() for b in blocks], dtype=np.int64)
        dims = np.array([b.shape[1] if b.dim() == 2 else 1 for b in blocks], np.int64)
        sums = _error_sums_kernel(_flat_float32(blocks), _flat_float32(decoded[0]), ends, dims)
        samples, alerts = [], []
        for table, row in zip(tables, sums.tolist(), strict=True):
            err, err_sq, val_sq, snapped, n, row_rel, rows, nonfinite = row
            sample = ErrorSample(
                table, err, int(n), err_sq, val_sq, int(snapped), row_rel, int(rows), int(nonfinite)
            )
            samples.append(sample)
            energy = row_rel / rows if rows else 0.0
            past = direction == "bwd" and energy > ROW_ENERGY_LEVEL
            if past or nonfinite:
                alerts.append(ErrorAlert(direction, table, call, energy, int(nonfinite), past))
        stats.record_error_samples(direction, samples, alerts)


def _flat_float32(blocks: Sequence[torch.Tensor]) -> np.ndarray:
    """The blocks' values back to back as float32 (exact for every codec dtype)."""
    return torch.cat([b.detach().reshape(-1).float() for b in blocks]).numpy()


@numba.njit(cache=True, nogil=True)
def _error_sums_kernel(
    x: np.ndarray, y: np.ndarray, ends: np.ndarray, dims: np.ndarray
) -> np.ndarray:
    """Per block (block ``b``: elements up to ``ends[b]``, rows of ``dims[b]``), over its
    elements whose error ``y - x`` is finite: the sums of the error, of its square and of
    ``x**2``, how many ``x != 0`` decoded to 0, how many there are; the sum over rows with
    ``sum x**2 > 0`` of ``sum (y - x)**2 / sum x**2``, those rows, and how many ``x`` are NaN
    or Inf; float64 [blocks, 8]."""
    out = np.zeros((ends.shape[0], 8))
    start = 0
    for b in range(ends.shape[0]):
        dim = max(dims[b], 1)
        for r0 in range(start, ends[b], dim):
            row_err, row_val = 0.0, 0.0
            for i in range(r0, min(r0 + dim, ends[b])):
                xv, yv = np.float64(x[i]), np.float64(y[i])
                err = yv - xv
                out[b, 7] += not np.isfinite(xv)
                if np.isfinite(err):
                    out[b, 0] += err
                    row_err += err * err
                    row_val += xv * xv
                    out[b, 3] += xv != 0.0 and yv == 0.0
                    out[b, 4] += 1.0
            out[b, 1] += row_err
            out[b, 2] += row_val
            if row_val > 0.0:
                out[b, 5] += row_err / row_val
                out[b, 6] += 1.0
        start = ends[b]
    return out


@functools.cache
def warm_up_host() -> None:
    """Loads the sample's compiled pass now (once per process), so that its first call in a
    process (about 0.1 s from numba's cache) does not land in a training step."""
    x = np.zeros(1, np.float32)
    _error_sums_kernel(x, x, np.ones(1, np.int64), np.ones(1, np.int64))
