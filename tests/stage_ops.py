"""The compiled (numba) CPU kernels as a ``staged.StageOps``, numpy in and numpy out, and
:func:`decompress_staged`, the per-block decoder over any decode stages.

:class:`CpuOps` runs each data-sized stage of the codec through the numba kernels of
``torchrec_lossy.codec`` one block at a time: the stage-level oracle the Triton stages
(tests/triton_stage_ops.py) and the torch stages (``staged.ReferenceOps``) are compared with.
Production encodes and decodes every block at once (``host_compress``, ``host_decompress``).
"""

from __future__ import annotations

import numpy as np
import torch

from torchrec_lossy.codec import huffman, quantize, vector_lz
from torchrec_lossy.codec.container import check_payload
from torchrec_lossy.codec.format import ALPHABET_SIZE, DECODE_ERRORS, CodecError
from torchrec_lossy.codec.quantize import QuantParams
from torchrec_lossy.codec.staged import DecodeStages, decode_payload


def decompress_staged(
    payload: torch.Tensor, max_elements: int, ops: DecodeStages
) -> list[torch.Tensor]:
    """``pipeline.decompress`` block by block over the given decode stages (on the host): the
    per-block decoder with a test's stages (the library runs it over ``ReferenceOps`` for the
    reference backend).

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


class CpuOps:
    """The compiled CPU kernels, stage by stage (production runs them batched:
    ``host_compress``, ``host_decompress``)."""

    def dequantize(self, symbols: np.ndarray, params: QuantParams) -> np.ndarray:
        """uint16 [n] -> float32 [n]."""
        out = np.empty(symbols.shape[0], dtype=np.float32)
        quantize.dequantize_kernel(
            symbols, np.float32(params.step), params.center, out, params.value
        )
        return out

    def huffman_decode(
        self, words: np.ndarray, chunk_ends: np.ndarray, n: int, chunk_symbols: int,
        lengths: np.ndarray, escape_positions: np.ndarray,
    ) -> np.ndarray | str:  # fmt: skip
        """-> uint16 symbols [n], or what is wrong with a corrupt stream."""
        out = np.empty(n, dtype=np.uint16)
        status = huffman.decode_kernel(
            words, chunk_ends, chunk_symbols, lengths, escape_positions, out
        )
        return out if status == 0 else DECODE_ERRORS[status]

    def quantize(
        self, x: np.ndarray, params: QuantParams, bound: float, dtype_code: int
    ) -> tuple[np.ndarray, np.ndarray, int, float]:
        """float32 [n] -> (uint16 symbols [n], int64 histogram, number of escapes, max error)."""
        symbols = np.empty(x.shape[0], dtype=np.uint16)
        hist = np.zeros(ALPHABET_SIZE, dtype=np.int64)
        n_esc, max_err = quantize.quantize_kernel(
            x,
            np.float32(params.step),
            np.float32(params.inv_step),
            params.center,
            bound,
            dtype_code,
            symbols,
            hist,
            params.sr_key,
            params.value,
        )
        return symbols, hist, int(n_esc), float(max_err)

    def histogram_rows(self, symbols: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Histogram of the given rows of a uint16 [rows, dim] matrix."""
        return huffman.histogram_rows_kernel(symbols, rows)

    def dedupe(self, symbols: np.ndarray | None, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[rows, dim] -> (int32 ids [rows], int32 first_rows [n_unique])."""
        if symbols is None:
            return vector_lz.dedupe_kernel(np.zeros((1, 1), np.uint16), bits, True)
        return vector_lz.dedupe_kernel(symbols, bits, False)

    def pack_refs(self, ids: np.ndarray, n_unique: int, mode: int) -> np.ndarray:
        """int32 ids -> uint32 words."""
        return vector_lz.pack_refs_kernel(ids, n_unique, mode)

    def huffman_encode(
        self, symbols: np.ndarray, rows: np.ndarray, lengths: np.ndarray, chunk_symbols: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The given rows of uint16 [rows, dim] symbols -> (uint32 chunk_ends, uint32 words)."""
        codes = huffman.canonical_codes_kernel(lengths)
        return huffman.encode_kernel(symbols, rows, lengths, codes, chunk_symbols)
