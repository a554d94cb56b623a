"""The codec's stages as Triton kernels, numpy in and numpy out: a ``staged.StageOps``.

:class:`TritonOps` runs every data-sized stage (quantize + escapes + histogram, dequantize, row
histogram, vector-LZ dedupe and reference packing, Huffman encode and decode) through the
single-block launchers of tests/triton_launchers.py and gives the arrays ``CpuOps``
(tests/stage_ops.py) gives, so a payload built with it through ``staged.compress_staged`` is
byte-identical. The O(alphabet) table work (code lengths, canonical codes, decode table) stays
on the host, as in ``CpuOps``.

Each call moves its inputs to the device and its outputs back: it is the stage-level oracle of
tests/test_kernels.py, not a production path (CUDA tensors go device-resident:
``device_compress`` / ``device_decompress``). Importing this module does not import triton.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from torchrec_lossy.codec import huffman
from torchrec_lossy.codec.format import DECODE_BAD_CODEBOOK, DECODE_ERRORS, ESCAPE_SYMBOL
from torchrec_lossy.codec.quantize import QuantParams
from torchrec_lossy.codec.triton_loader import load_kernels


class TritonOps:
    """The Triton kernels behind the :class:`StageOps` protocol (numpy in, numpy out).

    Args:
        device: Where the kernels run; None picks ``cuda`` when available, else ``cpu`` (Triton
            interpreter).
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        self._device = torch.device(device) if device is not None else None
        self._launchers: ModuleType | None = None

    @property
    def device(self) -> torch.device:
        """The device the kernels run on."""
        if self._device is None:
            self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return self._device

    def _kernels(self) -> ModuleType:
        """tests/triton_launchers.py, once ``load_kernels`` has checked triton (and switched to
        the interpreter for CPU tensors)."""
        if self._launchers is None:
            load_kernels(self.device)
            import triton_launchers

            self._launchers = triton_launchers
        return self._launchers

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        a = np.ascontiguousarray(a)
        if a.dtype == np.uint16:  # torch has few uint16 ops; the kernels read int16 bits
            a = a.view(np.int16)
        elif a.dtype == np.uint32:
            a = a.view(np.int32)
        return torch.from_numpy(a).to(self.device)

    def quantize(
        self, x: np.ndarray, params: QuantParams, bound: float, dtype_code: int
    ) -> tuple[np.ndarray, np.ndarray, int, float]:
        """float32 [n] -> (uint16 symbols [n], int64 histogram, number of escapes, max error)."""
        k = self._kernels()
        symbols, hist, max_err = k.quantize(
            self._to_device(x.astype(np.float32, copy=False)),
            params.step,
            params.inv_step,
            params.center,
            bound,
            dtype_code,
        )
        hist_np = hist.cpu().numpy().astype(np.int64)
        return (
            symbols.cpu().numpy().view(np.uint16),
            hist_np,
            int(hist_np[ESCAPE_SYMBOL]),
            float(max_err),
        )

    def histogram_rows(self, symbols: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Histogram of the given rows of a uint16 [rows, dim] matrix."""
        k = self._kernels()
        hist = k.histogram_rows(
            self._to_device(symbols), self._to_device(rows.astype(np.int32, copy=False))
        )
        return hist.cpu().numpy().astype(np.int64)

    def dequantize(self, symbols: np.ndarray, params: QuantParams) -> np.ndarray:
        """uint16 [n] -> float32 [n]."""
        k = self._kernels()
        out = k.dequantize(self._to_device(symbols), params.step, params.center)
        return out.cpu().numpy()

    def dedupe(self, symbols: np.ndarray | None, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[rows, dim] -> (int32 ids [rows], int32 first_rows [n_unique])."""
        k = self._kernels()
        ids, first = k.dedupe(
            None if symbols is None else self._to_device(symbols),
            self._to_device(bits.astype(np.int32, copy=False)),
        )
        return ids.cpu().numpy(), first.cpu().numpy()

    def pack_refs(self, ids: np.ndarray, n_unique: int, mode: int) -> np.ndarray:
        """int32 ids -> uint32 words."""
        k = self._kernels()
        words = k.pack_refs(self._to_device(ids.astype(np.int32, copy=False)), n_unique, mode)
        return words.cpu().numpy().view(np.uint32)

    def huffman_encode(
        self, symbols: np.ndarray, rows: np.ndarray, lengths: np.ndarray, chunk_symbols: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The given rows of uint16 [rows, dim] symbols -> (uint32 chunk_ends, uint32 words)."""
        k = self._kernels()
        codes = huffman.canonical_codes_kernel(lengths)  # O(alphabet): host
        ends, words = k.encode(
            self._to_device(symbols),
            self._to_device(rows.astype(np.int32, copy=False)),
            self._to_device(lengths.astype(np.int32)),
            self._to_device(codes.astype(np.int64)),
            chunk_symbols,
        )
        return ends.cpu().numpy().astype(np.uint32), words.cpu().numpy().view(np.uint32)

    def huffman_decode(
        self,
        words: np.ndarray,
        chunk_ends: np.ndarray,
        n: int,
        chunk_symbols: int,
        lengths: np.ndarray,
        escape_positions: np.ndarray,
    ) -> np.ndarray | str:
        """-> uint16 symbols [n], or what is wrong with a corrupt stream.

        The escape symbol must decode exactly at ``escape_positions``.
        """
        k = self._kernels()
        table = huffman.decode_table_kernel(lengths)  # O(alphabet): host
        if table.shape[0] == 0:
            return DECODE_ERRORS[DECODE_BAD_CODEBOOK]
        out, status = k.decode(
            self._to_device(words),
            self._to_device(chunk_ends.astype(np.int64)),
            n,
            chunk_symbols,
            self._to_device(table),
            self._to_device(escape_positions.astype(np.int64)),
        )
        code = int(status)
        if code != 0:
            return DECODE_ERRORS[code]
        return out.cpu().numpy().view(np.uint16)
