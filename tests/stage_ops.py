"""The compiled (numba) CPU kernels as a ``staged.StageOps``, numpy in and numpy out, and
:func:`decompress_staged`, the per-block decoder over any decode stages.

:class:`CpuOps` runs each data-sized stage of the codec through the numba kernels of
``torchrec_lossy.codec`` one block at a time: the stage-level oracle the Triton stages
(tests/triton_stage_ops.py) and the torch stages (``staged.ReferenceOps``) are compared with.
Production encodes every block at once (``host_compress``); its decode stages are the library's
``staged.CompiledDecodeStages``, which the per-block decoder names a corrupt payload's error with.
"""

from __future__ import annotations

import host_kernels
import numpy as np
import torch

from torchrec_lossy.codec import huffman
from torchrec_lossy.codec.container import check_payload
from torchrec_lossy.codec.format import CodecError
from torchrec_lossy.codec.quantize import QuantParams
from torchrec_lossy.codec.staged import CompiledDecodeStages, DecodeStages, decode_payload


def decompress_staged(
    payload: torch.Tensor, max_elements: int, ops: DecodeStages
) -> list[torch.Tensor]:
    """``pipeline.decompress`` block by block over the given decode stages (on the host): the
    per-block decoder with a test's stages (the library runs it over ``ReferenceOps`` for the
    reference backend and over ``CompiledDecodeStages`` for refused payloads).

    Args:
        payload: 1-D uint8 tensor.
        max_elements: Refuse payloads that decode to more elements than this in total.
        ops: The decode stages.

    Returns:
        The blocks, on the payload's device.

    Raises:
        CodecError: The payload is truncated, corrupted or not a torchrec-lossy payload.
    """
    check_payload(payload)
    buf = payload.detach().cpu().contiguous().numpy()
    out = decode_payload(buf, max_elements, ops, None, payload.device)
    if isinstance(out, CodecError):
        raise out
    return out


class CpuOps(CompiledDecodeStages):
    """The compiled CPU kernels, stage by stage: the library's decode stages plus the encode
    stages ``host_compress`` runs batched."""

    def quantize(
        self, x: np.ndarray, params: QuantParams, bound: float, dtype_code: int
    ) -> tuple[np.ndarray, np.ndarray, int, float]:
        """float32 [n] -> (uint16 symbols [n], int64 histogram, number of escapes, max error)."""
        return host_kernels.quantize_block(
            x,
            np.float32(params.step),
            np.float32(params.inv_step),
            params.center,
            bound,
            dtype_code,
            params.sr_key,
            params.value,
        )

    def histogram_rows(self, symbols: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Histogram of the given rows of a uint16 [rows, dim] matrix."""
        return host_kernels.histogram_rows(symbols, rows)

    def dedupe(self, symbols: np.ndarray | None, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[rows, dim] -> (int32 ids [rows], int32 first_rows [n_unique])."""
        return host_kernels.dedupe(symbols, bits)

    def pack_refs(self, ids: np.ndarray, n_unique: int, mode: int) -> np.ndarray:
        """int32 ids -> uint32 words."""
        return host_kernels.pack_refs(ids, n_unique, mode)

    def huffman_encode(
        self, symbols: np.ndarray, rows: np.ndarray, lengths: np.ndarray, chunk_symbols: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The given rows of uint16 [rows, dim] symbols -> (uint32 chunk_ends, uint32 words)."""
        codes = huffman.canonical_codes_kernel(lengths)
        return host_kernels.encode(symbols, rows, lengths, codes, chunk_symbols)
