"""``QuantParams``: one block's quantization parameters, as the segment header carries them.

The codec owns them (``codec.quantize.quant_params`` / ``value_params`` derive them); the
kernels' torch twins (``kernels/quantize_ref.py``) take them per block. No numba, no triton.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantParams:
    """Per-block quantization parameters (also written to the segment header).

    Attributes:
        step: Quantization step, float32-representable, at most ``2 * bound``.
        inv_step: float32 reciprocal of ``step`` used by the encoder.
        center: Code of the block's midpoint; symbols are ``q - center + SYMBOL_OFFSET``.
        value: The per-value relative grid (``MODE_VALUE``): ``step`` is ``2**-m``, ``center``
            the block's largest code ``qmax`` and ``inv_step`` unused
            (``codec.quantize.value_params``).
    """

    step: float
    inv_step: float
    center: int
    value: bool = False
