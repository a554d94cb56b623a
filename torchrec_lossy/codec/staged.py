"""The per-block decoder: one payload decoded block by block, naming a corrupt payload's error.

Decoding needs only two data-sized stages (:class:`DecodeStages`). :func:`decode_payload` runs
with :class:`CompiledDecodeStages` (the numba kernels) for the payloads the batched compiled
reader (``host_decompress``) refuses, whose exact error it names (the device decoder asks the
host path for the same). The encoders are ``host_compress`` and ``device_compress``.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch

from torchrec_lossy.codec import huffman, quantize, vector_lz
from torchrec_lossy.codec.container import Reader, parse_header
from torchrec_lossy.codec.format import (
    CODE_DTYPES,
    DECODE_ERRORS,
    ESCAPE_SYMBOL,
    MAX_CODE_LENGTH,
    MODE_LZ,
    MODE_QUANT_LZ,
    MODE_RAW,
    MODE_VALUE,
    REFS_FIXED,
    REFS_FLAGGED,
    SEGMENT_HEADER_WORDS,
    CodecError,
    read_segment_header,
    ref_width,
    refs_bits,
    words_for_bits,
)
from torchrec_lossy.codec.quantize import QuantParams

__all__ = ["CompiledDecodeStages", "DecodeStages", "decode_payload"]


class DecodeStages(Protocol):
    """The data-sized stages of decoding; :func:`decode_payload` does the rest."""

    def dequantize(self, symbols: np.ndarray, params: QuantParams) -> np.ndarray:
        """uint16 [n] -> float32 [n]."""
        ...

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
        ...


class CompiledDecodeStages:
    """The compiled (numba) decode stages: the per-block decoder's for the payloads the batched
    compiled reader refuses, so their errors are the compiled decoder's own."""

    def dequantize(self, symbols: np.ndarray, params: QuantParams) -> np.ndarray:
        out = np.empty(symbols.shape[0], dtype=np.float32)
        quantize.dequantize_kernel(
            symbols, np.float32(params.step), params.center, out, params.value
        )
        return out

    def huffman_decode(
        self,
        words: np.ndarray,
        chunk_ends: np.ndarray,
        n: int,
        chunk_symbols: int,
        lengths: np.ndarray,
        escape_positions: np.ndarray,
    ) -> np.ndarray | str:
        out = np.empty(n, dtype=np.uint16)
        status = huffman.decode_kernel(
            words, chunk_ends, chunk_symbols, lengths, escape_positions, out
        )
        return out if status == 0 else DECODE_ERRORS[status]


def _decode_refs(r: Reader, rows: int, n_unique: int, ref_mode: int, width: int) -> np.ndarray:
    if not 1 <= n_unique <= rows or width != ref_width(n_unique):
        raise r.fail(f"{n_unique} distinct vectors with {width}-bit ids for {rows} rows")
    if ref_mode not in (REFS_FIXED, REFS_FLAGGED):
        raise r.fail(f"unknown reference packing {ref_mode}")
    words = r.take(int(words_for_bits(refs_bits(rows, n_unique, ref_mode))), "references")
    ids = np.empty(rows, dtype=np.int32)
    if vector_lz.unpack_refs_kernel(words, rows, n_unique, ref_mode, width, ids) != 0:
        raise r.fail("vector references out of range")
    return ids


def _decode_block(
    seg: np.ndarray,
    rows: int,
    dim: int,
    dtype: torch.dtype,
    mode: int,
    block: int,
    ops: DecodeStages,
) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    bits_dtype = np.int32 if itemsize == 4 else np.int16
    r = Reader(seg, block)

    def to_tensor(raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, dim)).view(dtype)

    if mode == MODE_RAW:
        raw = r.take_bytes(rows * dim * itemsize, "raw values").view(bits_dtype)
        r.done()
        return to_tensor(raw.copy())
    header = read_segment_header(r.take(SEGMENT_HEADER_WORDS, "segment header"), 0)
    step = float(header[0])
    center, n_unique, n_esc, chunk_symbols, n_chunks = (int(v) for v in header[1:6])
    lo, count, esc_len, ref_mode, width = (int(v) for v in header[6:11])
    value = (mode & MODE_VALUE) == MODE_VALUE
    mode &= ~MODE_VALUE
    if mode == MODE_LZ:
        ids = _decode_refs(r, rows, n_unique, ref_mode, width)
        uniq = r.take_bytes(n_unique * dim * itemsize, "distinct vectors").view(bits_dtype)
        r.done()
        return to_tensor(vector_lz.expand_rows_kernel(uniq.reshape(n_unique, dim), ids))

    if value and not (2.0**-23 <= step <= 1.0 and center >= 0):
        raise r.fail(f"per-value grid step {step} / largest code {center} out of range")
    if not (math.isfinite(step) and step > 0 and (value or abs(center) <= quantize.MAX_CENTER)):
        raise r.fail(f"quantization step {step} / center {center} out of range")
    if lo + count > ESCAPE_SYMBOL or esc_len > MAX_CODE_LENGTH:
        raise r.fail(f"codebook range {lo}+{count} / escape length {esc_len} out of range")
    nibbles = r.take_bytes((count + 1) // 2, "codebook")
    lengths = huffman.expand_codebook_kernel(nibbles, lo, count, esc_len)
    ids = None
    if mode == MODE_QUANT_LZ:
        ids = _decode_refs(r, rows, n_unique, ref_mode, width)
    elif n_unique != rows:
        raise r.fail(f"{n_unique} vectors for {rows} rows")
    n_sym = n_unique * dim
    if n_esc > n_sym:
        raise r.fail(f"{n_esc} escapes for {n_sym} elements")
    esc_pos = r.take(n_esc, "escape positions")
    esc_bits = r.take_bytes(n_esc * itemsize, "escaped values").view(bits_dtype)
    if chunk_symbols < 1 or n_chunks != -(-n_sym // chunk_symbols):
        raise r.fail(f"{n_chunks} chunks of {chunk_symbols} symbols for {n_sym} symbols")
    chunk_ends = r.take(n_chunks, "chunk table")
    words = r.take(seg.shape[0] - r.pos, "bitstream")
    symbols = ops.huffman_decode(words, chunk_ends, n_sym, chunk_symbols, lengths, esc_pos)
    if isinstance(symbols, str):
        raise r.fail(f"Huffman stream: {symbols}")
    values = ops.dequantize(
        symbols, QuantParams(step=step, inv_step=0.0, center=center, value=value)
    )
    if itemsize == 4:
        out_bits = values.view(np.int32)
    else:  # the same round-to-nearest-even cast the encoder checked the bound against
        out_bits = torch.from_numpy(values).to(dtype).view(torch.int16).numpy()
    if n_esc:
        out_bits[esc_pos.astype(np.int64)] = esc_bits
    if ids is not None:
        out_bits = vector_lz.expand_rows_kernel(out_bits.reshape(n_unique, dim), ids)
    return to_tensor(out_bits)


def decode_payload(
    buf: np.ndarray,
    max_elements: int,
    ops: DecodeStages,
    decoded: list[torch.Tensor | None] | None,
    device: torch.device,
) -> list[torch.Tensor] | CodecError:
    """One payload's blocks, decoded by ``ops`` where ``decoded`` has none (in block order:
    the first failing block names the error).

    Args:
        buf: The payload's bytes.
        max_elements: Refuse a payload that decodes to more elements than this.
        ops: The stage implementations.
        decoded: Per block, what the batched reader decoded (None: left to ``ops``); None:
            every block left.
        device: Where the blocks go.

    Returns:
        The blocks, or the CodecError the payload raises.
    """
    try:
        body, desc_fields, offsets = parse_header(buf, max_elements)
        return [
            (
                _decode_block(body[offsets[i] : offsets[i + 1]], rows, dim, CODE_DTYPES[code],
                              mode, i, ops).to(device)
                if decoded is None or decoded[i] is None
                else decoded[i]
            )
            for i, (rows, dim, code, mode, *_rest) in enumerate(desc_fields)
        ]  # fmt: skip
    except CodecError as e:
        return e
