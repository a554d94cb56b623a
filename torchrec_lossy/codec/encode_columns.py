"""The compressor's per-block column record: one int64 tensor the compress launchers share (no
triton).

:class:`EncodeColumns` is an int64 ``[max(n_blocks, 1), N_FIELDS]`` tensor, block-major because
every field has one entry per block: a kernel takes one pointer, no stride, and reads field ``F``
of block ``b`` at ``cols_ptr + b * N_FIELDS + F`` (``encode_columns.F``). Float fields are their
bits (float32 sign-extended), so they round-trip exactly. ``device_compress`` lays out the rest
on the host (:func:`host_record`, in its one upload) and writes the grid (:data:`GRID`) on the
device (:meth:`EncodeColumns.set`). docs/kernels.md, 'Device-resident compress'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

# The fields in row order.
FIELDS = (
    "step_bits",  # float32 bits of the quantization step
    "inv_step_bits",  # float32 bits of 1 / step
    "center",  # code of the block's center (qmax on the per-value grid)
    "bound_bits",  # float64 bits of the absolute bound (relative on the per-value grid)
    "dtype",  # dtype code (format.DTYPE_CODES; the reconstruction is rounded to it)
    "sr_key",  # stochastic-rounding key, -1 for round to nearest
    "value",  # 1 for a block on the per-value grid
    "elem_off",  # first element of the block in the flat layout
    "row_off",  # first row of the block in the flat layout
    "dim",  # columns (elements per row)
)
N_FIELDS = len(FIELDS)
(
    STEP_BITS, INV_STEP_BITS, CENTER, BOUND_BITS, DTYPE, SR_KEY, VALUE, ELEM_OFF, ROW_OFF, DIM,
) = range(N_FIELDS)  # fmt: skip
# The fields that depend on the data (the grid), written on the device.
GRID = (STEP_BITS, INV_STEP_BITS, CENTER, BOUND_BITS)
# The grid launch's output columns (``quantize.block_grids``), int64 per block: whether it is
# quantized (and its quantize tiles ran), its finite and inlier ranges (float64 bits: +inf / -inf
# where none), its finite count and its median (float64 bits, 0.0 where the rule does not use it).
GRID_OK, GRID_LO, GRID_HI, GRID_ILO, GRID_IHI, GRID_N_FIN, GRID_MEDIAN = range(7)
GRID_STATS = 7
# The field names a caller passes (``_bits`` dropped: ``step``, ``inv_step``, ``bound``).
_NAMES = tuple(f.removesuffix("_bits") for f in FIELDS)
# The float fields' dtypes (their bits are stored; any other field is an integer).
_FLOATS = {STEP_BITS: torch.float32, INV_STEP_BITS: torch.float32, BOUND_BITS: torch.float64}


class GridRule(NamedTuple):
    """What the grid launch (``quantize.block_grids``) takes besides the data and the record:
    per block (int64 [n_blocks] tensors) the bound as given, and the rule's switches.

    Attributes:
        kind: ``bounds.BoundKind``.
        bound_bits: float64 bits of the bound (relative: the fraction of the range).
        quant_try: 1 where the quantize launch runs (``quantize.grid_before_data``).
        octaves: ``outliers.OUTLIER_OCTAVES``.
        stochastic: Stochastic rounding (``quantize.grid_bound``).
        quantization: ``CodecConfig.enable_quantization``.
        rule: The rule (``codec/quantize.py``'s ``block_bound``, ``uses_median``,
            ``block_grid``), which the torch twin runs over ``[n_blocks]`` tensors and the
            Triton kernel transcribes.
    """

    kind: torch.Tensor
    bound_bits: torch.Tensor
    quant_try: torch.Tensor
    octaves: int
    stochastic: bool
    quantization: bool
    rule: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]


def _indices(names: set[str], allowed: tuple[int, ...]) -> dict[str, int]:
    """Field indices by name, refusing names outside ``allowed``."""
    known = {_NAMES[f]: f for f in allowed}
    unknown = names - set(known)
    if unknown:
        raise ValueError(f"unknown encode fields {sorted(unknown)}: use names from {list(known)}")
    return {name: known[name] for name in names}


def host_record(n_blocks: int, **fields: np.ndarray) -> np.ndarray:
    """The record's host layout: the given fields set, every other field at its default.

    Args:
        n_blocks: Blocks.
        **fields: Per non-grid field (by its name in :data:`FIELDS`) its [n_blocks] integers;
            a field not given is 0 (``sr_key``: -1, round to nearest). The grid fields are 0
            until :meth:`EncodeColumns.set` writes them.

    Returns:
        int64 [max(n_blocks, 1), N_FIELDS] (one row at least: a valid pointer for the kernels).
    """
    static = tuple(f for f in range(N_FIELDS) if f not in GRID)
    out = np.zeros((max(n_blocks, 1), N_FIELDS), np.int64)
    out[:, SR_KEY] = -1
    for name, f in _indices(set(fields), static).items():
        out[:n_blocks, f] = fields[name]
    return out


class EncodeColumns(NamedTuple):
    """Every block's compress fields on the device: one int64 ``[max(n_blocks, 1), N_FIELDS]``
    tensor.

    Attributes:
        cols: int64 [max(n_blocks, 1), N_FIELDS]: row ``b`` is block ``b``, column ``F`` field
            ``F``.
        n_blocks: Blocks.
    """

    cols: torch.Tensor
    n_blocks: int

    def column(self, field: int) -> torch.Tensor:
        """Field ``field`` of every block (a view of its column).

        Args:
            field: A field index (``STEP_BITS``, ``DIM``, ...).

        Returns:
            int64 [n_blocks].
        """
        return self.cols[: self.n_blocks, field]

    def floats(self, field: int) -> torch.Tensor:
        """A float field's values: float32 for ``STEP_BITS`` / ``INV_STEP_BITS``, float64 for
        ``BOUND_BITS``.

        Args:
            field: ``STEP_BITS``, ``INV_STEP_BITS`` or ``BOUND_BITS``.

        Returns:
            [n_blocks] values with exactly the bits stored.
        """
        bits = self.column(field)
        return bits.contiguous().view(torch.float64) if field == BOUND_BITS else float32_of(bits)

    def set(self, **fields: torch.Tensor) -> EncodeColumns:
        """Writes fields of every block in place, on the device (no sync).

        Args:
            **fields: Per field (by its name in :data:`FIELDS`, ``_bits`` dropped: ``step``,
                ``inv_step``, ``bound``) its [n_blocks] values (floats as float32 / float64,
                the rest integers).

        Returns:
            The record (``self``).
        """
        for name, f in _indices(set(fields), tuple(range(N_FIELDS))).items():
            want, got = _FLOATS.get(f, fields[name].dtype), fields[name].dtype
            if got != want:
                raise ValueError(f"encode field {name} is {got}: pass it as {want}")
            if self.n_blocks:
                self.cols[: self.n_blocks, f] = bits_of(fields[name])
        return self


def float32_of(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of sign-extended float32 bits held in int64."""
    return bits.to(torch.int32).view(torch.float32)


def bits_of(v: torch.Tensor) -> torch.Tensor:
    """int64 bits of float32 (sign-extended) or float64 values; integers as int64."""
    if v.dtype == torch.float32:
        return v.contiguous().view(torch.int32).to(torch.int64)
    if v.dtype == torch.float64:
        return v.contiguous().view(torch.int64)
    return v.to(torch.int64)


def encode_columns(n_blocks: int, device: torch.device, **fields: torch.Tensor) -> EncodeColumns:
    """A record with the given fields, every other at its default (:func:`host_record`).

    Args:
        n_blocks: Blocks.
        device: Where the record lives.
        **fields: As :meth:`EncodeColumns.set` takes them.

    Returns:
        The record.
    """
    record = torch.from_numpy(host_record(n_blocks)).to(device)
    return EncodeColumns(record, n_blocks).set(**fields)
