"""Element-wise primitives for rules written once for every backend.

The size model (``size_model``), the relative-bound rule (``bounds.finite_span``), the segment
header's words (``format.segment_header_words``) and the quantization grid (``quantize``) are
plain arithmetic on top of these few primitives, so one definition serves Python scalars, numpy
arrays, torch tensors on any device (no sync) and numba-compiled code: here each primitive
dispatches on its arguments' kind, and a numba overload gives its scalar form, so a rule
decorated with :func:`jitable` compiles into the host codec's kernels unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from numba import types
from numba.extending import overload, register_jitable

# An int, a float, a numpy array or a torch tensor: every function below maps like to like.
N = TypeVar("N", int, float, np.ndarray, torch.Tensor)
F = TypeVar("F", bound=Callable[..., object])
_MASK32 = 0xFFFFFFFF


def jitable(fn: F) -> F:
    """Makes a rule written with these primitives callable from numba-compiled code.

    Args:
        fn: The rule (its Python behaviour is unchanged).

    Returns:
        ``fn`` itself.
    """
    return register_jitable(fn)


def _torch_operand(v: object) -> bool:
    """Whether ``torch.where`` takes ``v`` as it is with the dtype a 0-d tensor of it would
    give (a tensor or a Python number; not numpy's, whose float64 subclasses float)."""
    return isinstance(v, (torch.Tensor, bool, int, float)) and not isinstance(v, np.generic)


def where(cond: object, a: object, b: object) -> N:
    """``torch.where`` when any argument is a tensor, else ``np.where``.

    Args:
        cond: Condition (bool, array or tensor).
        a: Value where true.
        b: Value where false.

    Returns:
        The selection (a tensor, or a numpy array).
    """
    if any(isinstance(v, torch.Tensor) for v in (cond, a, b)):
        if isinstance(cond, torch.Tensor) and all(_torch_operand(v) for v in (a, b)):
            return torch.where(cond, a, b)  # Python numbers as they are: no host-to-device copy
        ref = next(v for v in (cond, a, b) if isinstance(v, torch.Tensor))

        def t(v: object) -> torch.Tensor:
            return v if isinstance(v, torch.Tensor) else torch.as_tensor(v, device=ref.device)

        return torch.where(t(cond), t(a), t(b))
    return np.where(cond, a, b)


def clamp_min(x: N, lo: int) -> N:
    """``max(x, lo)`` element-wise.

    Args:
        x: Values.
        lo: The floor.

    Returns:
        The clamped values (same kind as ``x``).
    """
    if isinstance(x, torch.Tensor):
        return x.clamp(min=lo)
    if isinstance(x, np.ndarray):
        return np.maximum(x, lo)
    return max(x, lo)


def bit_length(x: N) -> N:
    """``int.bit_length`` of non-negative values below 2**48, element-wise.

    Args:
        x: Non-negative ints.

    Returns:
        Their bit lengths (same kind as ``x``).
    """
    if isinstance(x, torch.Tensor):
        k = torch.arange(48, device=x.device)
        return ((x[..., None] >> k) > 0).sum(dim=-1)
    if isinstance(x, np.ndarray):
        return np.frexp(x.astype(np.float64))[1].astype(np.int64)  # exact below 2**53
    return int(x).bit_length()


def isfinite(x: N) -> N:
    """Whether each value is finite.

    Args:
        x: Floats.

    Returns:
        Bools (same kind as ``x``).
    """
    if isinstance(x, torch.Tensor):
        return torch.isfinite(x)
    if isinstance(x, np.ndarray):
        return np.isfinite(x)
    return math.isfinite(x)


def binary_exponent(x: N) -> N:
    """``frexp``'s exponent ``e`` of floats, ``x = f * 2**e`` with ``|f|`` in [0.5, 1) (0 for
    0, infinities and NaN).

    Args:
        x: Floats.

    Returns:
        Ints (int64 arrays or tensors, or an int).
    """
    if isinstance(x, torch.Tensor):
        return torch.frexp(x).exponent.to(torch.int64)
    if isinstance(x, np.ndarray):
        return np.frexp(x)[1].astype(np.int64)
    return math.frexp(x)[1]


def as_float64(x: N) -> N:
    """The values in float64 (exact from float32).

    Args:
        x: Floats.

    Returns:
        float64 values (same kind as ``x``).
    """
    if isinstance(x, torch.Tensor):
        return x.double()
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return float(x)


def as_float32(x: N) -> N:
    """The values rounded to float32 (to nearest even, as every backend's cast).

    Args:
        x: Floats.

    Returns:
        float32 values (a numpy float32 scalar for a Python number).
    """
    if isinstance(x, torch.Tensor):
        return x.float()
    if isinstance(x, np.ndarray):
        return x.astype(np.float32)
    return np.float32(x)


def floor(x: N) -> N:
    """``floor`` of floats, kept float (infinities and NaN pass through).

    Args:
        x: Floats.

    Returns:
        Floats of the same kind and precision.
    """
    if isinstance(x, torch.Tensor):
        return torch.floor(x)
    return np.floor(x)


def float32_bits(x: N) -> N:
    """The bits of float32 values, as non-negative ints below 2**32.

    Args:
        x: float32 values (others are rounded to float32 first).

    Returns:
        int64 tensors or arrays, or an int.
    """
    if isinstance(x, torch.Tensor):
        return x.float().view(torch.int32).to(torch.int64) & _MASK32
    if isinstance(x, np.ndarray):
        return x.astype(np.float32).view(np.uint32).astype(np.int64)
    return int(np.float32(x).view(np.uint32))


def float32_from_bits(bits: N) -> N:
    """float32 values from their bits (the inverse of :func:`float32_bits`).

    Args:
        bits: Ints; their low 32 bits are the float's.

    Returns:
        float32 values (a numpy float32 scalar for an int).
    """
    if isinstance(bits, torch.Tensor):
        low = bits.to(torch.int64) & _MASK32
        return (low - ((low >> 31) << 32)).to(torch.int32).view(torch.float32)
    if isinstance(bits, np.ndarray):
        return (bits.astype(np.int64) & _MASK32).astype(np.uint32).view(np.float32)
    return np.uint32(int(bits) & _MASK32).view(np.float32)


# Scalar forms inside numba-compiled code (arrays and tensors never reach them there). numba
# wants each implementation's signature to equal its typing function's, annotations included.


def _scalar_only(*args: types.Type) -> bool:
    return not any(isinstance(a, types.Array) for a in args)


@overload(where, jit_options={"nogil": True})
def _where_nb(cond: types.Type, a: types.Type, b: types.Type) -> Callable | None:
    if not _scalar_only(cond, a, b):
        return None

    def impl(cond: types.Type, a: types.Type, b: types.Type) -> Callable | None:
        return a if cond else b

    return impl


@overload(clamp_min, jit_options={"nogil": True})
def _clamp_min_nb(x: types.Type, lo: types.Type) -> Callable | None:
    if not _scalar_only(x, lo):
        return None

    def impl(x: types.Type, lo: types.Type) -> Callable | None:
        return x if x > lo else lo

    return impl


def _scalar_form(fn: Callable, kinds: tuple[type, ...], impl: Callable) -> None:
    """Registers ``impl`` as the one-argument primitive ``fn``'s form on numba scalars of
    ``kinds`` (other kinds: no form, numba's error)."""

    def typer(x):  # unannotated, as the impls: numba wants the two signatures equal
        return impl if isinstance(x, kinds) else None

    overload(fn, jit_options={"nogil": True})(typer)


def _bit_length_scalar(x):  # unannotated: see _scalar_form
    n = 0
    while (x >> n) > 0:
        n += 1
    return n


_NUMBERS = (types.Float, types.Integer)
_scalar_form(bit_length, (types.Integer,), _bit_length_scalar)
_scalar_form(isfinite, (types.Float,), lambda x: np.isfinite(x))
_scalar_form(binary_exponent, (types.Float,), lambda x: math.frexp(x)[1])
_scalar_form(as_float64, _NUMBERS, lambda x: np.float64(x))
_scalar_form(as_float32, _NUMBERS, lambda x: np.float32(x))
_scalar_form(floor, (types.Float,), lambda x: np.floor(x))
_scalar_form(float32_bits, _NUMBERS, lambda x: np.int64(np.float32(x).view(np.uint32)))
_scalar_form(
    float32_from_bits, (types.Integer,), lambda x: np.uint32(np.int64(x) & _MASK32).view(np.float32)
)


__all__ = [
    "as_float32",
    "as_float64",
    "binary_exponent",
    "bit_length",
    "clamp_min",
    "float32_bits",
    "float32_from_bits",
    "floor",
    "isfinite",
    "jitable",
    "where",
]
