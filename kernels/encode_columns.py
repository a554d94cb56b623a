"""The compressor's per-block column record: one int64 tensor the compress launchers share (no
triton).

``device_compress`` builds every block's grid and layout fields once, on the device, as
:class:`EncodeColumns`: an int64 ``[max(n_blocks, 1), N_FIELDS]`` tensor whose column ``F`` is
field ``F`` below, the compress side's ``decode_columns``. Every field has one entry per block,
so the record is block-major and a kernel needs no stride: the compress launchers (and their
torch twins) take the record instead of per-field tensors, and a Triton kernel takes one pointer
and reads field ``F`` of block ``b`` at ``cols_ptr + b * N_FIELDS + F`` (the field indices are
module constants, which a kernel reads as ``encode_columns.F``). Float fields are stored as
their bits (float32 sign-extended, float64 as is), so they round-trip exactly.
"""

from __future__ import annotations

from typing import NamedTuple

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
# What a field not given holds: round to nearest, the uniform grid, everything else 0.
_DEFAULTS = {SR_KEY: -1}
# The float fields' dtypes (their bits are stored; any other field is an integer).
_FLOATS = {STEP_BITS: torch.float32, INV_STEP_BITS: torch.float32, BOUND_BITS: torch.float64}


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
    """Stacks per-block tensors into the record, on the device (no sync).

    Args:
        n_blocks: Blocks.
        device: Where the record lives.
        **fields: Per field (by its name in :data:`FIELDS`, ``_bits`` dropped: ``step``,
            ``inv_step``, ``bound``) its [n_blocks] values (floats as float32 / float64, the
            rest integers); a field not given is 0 (``sr_key``: -1).

    Returns:
        The record.
    """
    names = [f.removesuffix("_bits") for f in FIELDS]
    unknown = set(fields) - set(names)
    if unknown:
        raise ValueError(f"unknown encode fields {sorted(unknown)}: use names from {names}")
    for f, want in _FLOATS.items():
        got = fields[names[f]].dtype if names[f] in fields else want
        if got != want:
            raise ValueError(f"encode field {names[f]} is {got}: pass it as {want}")
    if not n_blocks:  # a valid pointer for the kernels, nothing to read
        return EncodeColumns(torch.zeros(1, N_FIELDS, dtype=torch.int64, device=device), 0)
    rows = [
        bits_of(fields[name]).to(device)
        if name in fields
        else torch.full((n_blocks,), _DEFAULTS.get(f, 0), dtype=torch.int64, device=device)
        for f, name in enumerate(names)
    ]
    return EncodeColumns(torch.stack(rows, dim=1), n_blocks)
