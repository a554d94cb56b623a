"""The sender's error sample (telemetry): it decodes a payload of its own and sums each block's
errors over its finite elements (``LossyCommsStats.record_error_samples``), on the host in one
compiled pass (:func:`record_error_samples`) or, on the device path, on the device with no host
read (:func:`start_device_sample`: its sums ride the module's next host read).

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
from dataclasses import dataclass

import numba
import numpy as np
import torch

from torchrec_lossy.codec import check_groups, decompress_groups
from torchrec_lossy.codec.container import upload
from torchrec_lossy.config import Backend
from torchrec_lossy.distributed.stats import Direction, ErrorAlert, ErrorSample, LossyCommsStats
from torchrec_lossy.profile_range import profile_range

# The mean row-relative error energy a sampled block may reach before it is reported: 4e-3,
# the error energy under which docs/accuracy.md's forward study saw no AUC cost. A homogeneous
# block at 0.01 of its range stays near 1e-3 (tests/test_backward_error_models.py); rows a
# hundred times smaller than the block's largest pass it.
ROW_ENERGY_LEVEL = 4e-3
# Sums per block (the columns of the sample's pass): signed error, squared error, squared
# value, values snapped to 0, finite errors, row-relative energy, rows with a value, NaN / Inf.
_SUMS = 8


def record_error_samples(
    stats: LossyCommsStats,
    direction: Direction,
    payload: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    tables: Sequence[str],
    call: int = -1,
    levels: Sequence[int] | None = None,
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
        levels: Each block's guard tightenings when it was encoded (None: 0).
    """
    with profile_range(f"## lossy_a2a {direction} error sample ##"):
        decoded, status = decompress_groups(payload, [payload.numel()])
        check_groups(status)  # our own payload: a failure here is a codec bug
        ends = np.cumsum([b.numel() for b in blocks], dtype=np.int64)
        dims = np.array([_dim(b) for b in blocks], np.int64)
        sums = _error_sums_kernel(_flat_float32(blocks), _flat_float32(decoded[0]), ends, dims)
        _record_sums(stats, direction, sums, tables, call, levels)


def _record_sums(
    stats: LossyCommsStats,
    direction: Direction,
    sums: np.ndarray,
    tables: Sequence[str],
    call: int,
    levels: Sequence[int] | None,
) -> None:
    """Records the blocks' samples and alerts from their sums (float64 [blocks, 8], the
    columns of :func:`_error_sums_kernel`), the host's and the device's alike."""
    samples, alerts = [], []
    levels = levels if levels is not None else [0] * len(tables)
    for table, level, row in zip(tables, levels, sums.tolist(), strict=True):
        err, err_sq, val_sq, snapped, n, row_rel, rows, nonfinite = row
        sample = ErrorSample(
            table, err, int(n), err_sq, val_sq, int(snapped), row_rel, int(rows), int(nonfinite)
        )
        samples.append(sample)
        energy = row_rel / rows if rows else 0.0
        past = direction == "bwd" and energy > ROW_ENERGY_LEVEL
        if past or nonfinite:
            alerts.append(ErrorAlert(direction, table, call, energy, int(nonfinite), past, level))
    stats.record_error_samples(direction, samples, alerts)


def _dim(block: torch.Tensor) -> int:
    """A block's row width (the sample's rows)."""
    return block.shape[1] if block.dim() == 2 else 1


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


@dataclass
class DeviceSample:
    """An error sample taken on the device, its sums not read yet: it is a
    ``call_ledger.UnreadStatus``, read with the module's next host read (the next all-to-all's
    size exchange, or ``check_lossy_decodes``), which records it.

    Attributes:
        flags: int64 on the device: the blocks' float64 sums (:data:`_SUMS` per block) as
            their bits, then the own decode's failure flag per payload.
        stats: Where the sample goes.
        direction: ``"fwd"`` or ``"bwd"``.
        tables: Each block's table.
        call: The call's number in its direction.
        levels: Each block's guard tightenings when it was encoded.
    """

    flags: torch.Tensor
    stats: LossyCommsStats
    direction: Direction
    tables: list[str]
    call: int
    levels: list[int]

    def raise_if_failed(self, flags: Sequence[int]) -> None:
        """Records the sample from its values read back; raises if the sender could not
        decode its own payload (a codec bug: the receivers' decode reports it too).

        Args:
            flags: ``flags`` on the host.

        Raises:
            RuntimeError: The own payload's decode failed on the device.
        """
        n = len(self.tables) * _SUMS
        if any(flags[n:]):
            raise RuntimeError(
                f"lossy all-to-all ({self.direction}) call {self.call}: the sender could not "
                "decode its own payload for the error sample (a codec bug; please report it)"
            )
        sums = np.asarray(flags[:n], np.int64).view(np.float64).reshape(-1, _SUMS)
        _record_sums(self.stats, self.direction, sums, self.tables, self.call, self.levels)


def start_device_sample(
    stats: LossyCommsStats,
    direction: Direction,
    buffer: torch.Tensor,
    sizes: Sequence[int],
    skeletons: Sequence[np.ndarray],
    blocks: Sequence[Sequence[torch.Tensor]],
    tables: Sequence[str],
    call: int,
    levels: Sequence[int],
    backend: Backend,
) -> DeviceSample:
    """Decodes the sender's own device payloads on the device (their skeletons known: no read)
    and sums each block's errors there, as :func:`record_error_samples` does on the host; the
    sums stay on the device until the module's next host read (hand the result to the
    ledger's ``owe_status``).

    Args:
        stats: Where the samples go, once read.
        direction: ``"fwd"`` or ``"bwd"``.
        buffer: The payloads back to back (``GroupedPayloads.buffer``).
        sizes: Bytes of each payload.
        skeletons: Each payload's skeleton words.
        blocks: Per payload, the blocks it was encoded from, in payload order.
        tables: Each block's table, payload after payload.
        call: The call's number in its direction.
        levels: Each block's guard tightenings when it was encoded.
        backend: The codec backend the payloads were encoded with.

    Returns:
        The pending sample.

    Raises:
        RuntimeError: The own payload's layout was rejected (a codec bug).
    """
    with profile_range(f"## lossy_a2a {direction} error sample ##"):
        decoded, status = decompress_groups(buffer, sizes, backend=backend, skeletons=skeletons)
        if status.rejected:
            raise RuntimeError(
                f"lossy all-to-all ({direction}) call {call}: the sender could not decode its "
                f"own payload for the error sample: {status.rejected} (a codec bug)"
            )
        flat_x = [b for group in blocks for b in group]
        flat_y = [b for group in decoded for b in group]
        sums = _device_error_sums(flat_x, flat_y, buffer.device)
        parts = [sums.reshape(-1).view(torch.int64)]
        failed = status.device.failed if status.device is not None else None
        if failed is not None:
            parts.append(failed.to(torch.int64))
        flags = parts[0] if len(parts) == 1 else torch.cat(parts)
    return DeviceSample(flags, stats, direction, list(tables), call, list(levels))


def _device_error_sums(
    x: Sequence[torch.Tensor], y: Sequence[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """:func:`_error_sums_kernel`'s sums on the device, float64 [blocks, 8]: the blocks of
    each row width as one matrix, their per-row sums added into their blocks (a few launches
    per width, no read)."""
    out = torch.zeros(len(x), _SUMS, dtype=torch.float64, device=device)
    by_dim: dict[int, list[int]] = {}
    for i, b in enumerate(x):
        by_dim.setdefault(max(_dim(b), 1), []).append(i)  # as the host pass's rows
    for dim, idx in by_dim.items():
        xs = torch.cat([x[i].detach().reshape(-1, dim) for i in idx]).double()
        ys = torch.cat([y[i].reshape(-1, dim) for i in idx]).double()
        rows = [x[i].numel() // dim for i in idx]
        (block_of_row,) = upload([np.repeat(np.asarray(idx, np.int64), rows)], device)
        err = ys - xs
        fin = err.isfinite()
        err = torch.where(fin, err, 0.0)
        row_err = (err * err).sum(1)
        row_val = torch.where(fin, xs * xs, 0.0).sum(1)
        has = row_val > 0
        per_row = torch.stack(
            [
                err.sum(1),
                row_err,
                row_val,
                (fin & (xs != 0) & (ys == 0)).sum(1).double(),
                fin.sum(1).double(),
                torch.where(has, row_err / torch.where(has, row_val, 1.0), 0.0),
                has.double(),
                (~xs.isfinite()).sum(1).double(),
            ],
            1,
        )
        out.index_add_(0, block_of_row, per_row)
    return out


@functools.cache
def warm_up_host() -> None:
    """Loads the sample's compiled pass now (once per process), so that its first call in a
    process (about 0.1 s from numba's cache) does not land in a training step."""
    x = np.zeros(1, np.float32)
    _error_sums_kernel(x, x, np.ones(1, np.int64), np.ones(1, np.int64))
