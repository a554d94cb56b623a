"""The rules of a quantization symbol that the codec's host path and the kernels' torch twins share.

The per-value grid's symbol mapping (encode and decode) and the stochastic-rounding draw's
constants, written once: ``codec.quantize`` compiles them into its numba kernels and reuses them
over numpy arrays and torch tensors, ``kernels/quantize_ref.py`` runs them on torch tensors, and
``kernels/quantize.py`` has their Triton twins. A leaf: it takes from the codec only the wire
format's constants and the element-wise primitives (``elementwise``) the format is written with.
"""

from __future__ import annotations

from torchrec_lossy.codec.elementwise import N, binary_exponent, jitable, where
from torchrec_lossy.codec.format import ESCAPE_SYMBOL, SYMBOL_OFFSET

NEAREST_KEY = -1  # the ``sr_key`` of round-to-nearest; stochastic keys are in [0, 2**32)
# Stochastic rounding draws u = (hash >> 8) * 2**-24: 24 bits, exact in float32.
U_SCALE = 2.0**-24


# The per-value relative grid (``ErrorBound(mode="value")``), integer-only so that every backend
# writes the same bytes: keep m mantissa bits of |x|'s float32, rounded to nearest (the carry into
# the exponent is the right rounding), so |x' - x| <= 2**-(m + 1) |x| for normal values; what
# that misses (denormals, overflow, the cast to fp16 / bf16) fails the float64 check and is
# escaped. Symbol of x: SYMBOL_OFFSET + sign(x) (qmax - q + 1), counted down from the block's
# largest code qmax, so the large values, which every block has, sit next to the symbol of +0.0
# (SYMBOL_OFFSET) and the codebook spans the block's octaves, not the whole alphabet; codes
# SYMBOL_OFFSET or more below qmax are escaped.


@jitable
def value_code(mag_bits: N, shift: N) -> N:
    """Codes of magnitudes: float32 bits of ``|x|`` rounded to nearest to a multiple of
    ``2**shift`` and divided by it (``shift = 23 - m``). Integers: ints, arrays, tensors.

    Args:
        mag_bits: float32 bits of ``|x|`` (non-negative, < 2**31).
        shift: ``23 - m``.

    Returns:
        The codes q.
    """
    return (mag_bits + ((1 << shift) >> 1)) >> shift


@jitable
def value_symbol(bits: N, shift: N, qmax: N) -> tuple[N, N]:
    """Symbols of float32 values on the per-value grid, and their reconstructions' bits.

    Args:
        bits: float32 bits of the values as non-negative ints (< 2**32).
        shift: ``23 - m``.
        qmax: The block's largest code (of its largest finite ``|x|``).

    Returns:
        (symbol, ``ESCAPE_SYMBOL`` where a code does not fit (``-0.0`` included: it would
        decode as ``+0.0``); float32 bits of the reconstruction ``sign * (q << shift)``, as
        non-negative ints). The caller still escapes what fails the float64 check.
    """
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    q = value_code(mag, shift)
    d = qmax - q  # < 0 only for non-finite values
    fits = where(mag == 0, sign == 0, (d >= 0) & (d < SYMBOL_OFFSET))
    sym = SYMBOL_OFFSET + where(mag == 0, 0, where(sign == 0, d + 1, -d - 1))
    return where(fits, sym, ESCAPE_SYMBOL), ((q << shift) & 0x7FFFFFFF) | sign


@jitable
def value_decode_bits(symbols: N, shift: N, qmax: N) -> N:
    """float32 bits of the values of per-value-grid symbols (the decoder's half of
    :func:`value_symbol`; any symbol maps to some bits, so a corrupt stream cannot crash it).

    Args:
        symbols: Symbols (ints, arrays or tensors).
        shift: ``23 - m``.
        qmax: The block's largest code.

    Returns:
        float32 bits as non-negative ints.
    """
    s = symbols - SYMBOL_OFFSET
    q = qmax + 1 - where(s < 0, -s, s)
    mag = where((s == 0) | (q < 0), 0, (q << shift) & 0x7FFFFFFF)
    return mag | where(s < 0, 0x80000000, 0)


@jitable
def value_shift(step: float) -> int:
    """``23 - m`` from a segment header's step ``2**-m`` (its binary exponent; any step a
    decoder accepts, in [2**-23, 1], gives a shift in 0..23).

    Args:
        step: The segment header's step.

    Returns:
        The shift.
    """
    return 22 + binary_exponent(step)  # step = 0.5 * 2**(1 - m) exactly


__all__ = [
    "NEAREST_KEY",
    "U_SCALE",
    "value_code",
    "value_decode_bits",
    "value_shift",
    "value_symbol",
]
