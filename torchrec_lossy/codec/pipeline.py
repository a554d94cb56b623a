"""The codec: ``compress(blocks, bounds) -> payload`` and ``decompress(payload) -> blocks``.

Per block: quantize under the bound (escaping what it cannot cover), find repeated vectors, then
Huffman-code the symbols of the distinct vectors. Each block is sent in the smallest of four
modes: raw, raw with repeated vectors referenced (lossless), quantized, quantized with repeated
vectors referenced.

The backend is chosen once, here, from ``CodecConfig.backend`` and the tensors' device: the
device-resident Triton path (``device_compress`` / ``device_decompress``), the compiled host path
(``host_compress`` / ``host_decompress``; ``"cpu"``, and ``"auto"`` off the device path), or the
stage-by-stage path below over the plain torch twins of every stage (:class:`ReferenceOps`,
``"reference"``: the oracle). The stage-by-stage path takes its :class:`StageOps` as an argument
(:func:`compress_staged`, :func:`decompress_staged`), so tests and the GPU bench run it over
other stage implementations; all produce the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.profiler import record_function

from torchrec_lossy.codec import host_compress, host_decompress, huffman, quantize, vector_lz
from torchrec_lossy.codec import size_model as sm
from torchrec_lossy.codec.bounds import BoundKind, absolute_bounds
from torchrec_lossy.codec.container import (
    DEFAULT_MAX_ELEMENTS,
    BlockColumns,
    BlockStats,
    Reader,
    check_payload,
    host_header,
    parse_header,
    payload_skeletons,
)
from torchrec_lossy.codec.format import (
    ALPHABET_SIZE,
    BITS_DTYPES,
    CODE_DTYPES,
    DECODE_BAD_CHUNK_TABLE,
    DECODE_BAD_CODEBOOK,
    DECODE_BAD_ESCAPES,
    DECODE_ERRORS,
    DECODE_INVALID_CODE,
    DESCRIPTOR,
    DTYPE_CODES,
    ESCAPE_SYMBOL,
    MAX_CODE_LENGTH,
    MODE_LZ,
    MODE_QUANT,
    MODE_QUANT_LZ,
    MODE_RAW,
    MODE_VALUE,
    REFS_FIXED,
    REFS_FLAGGED,
    SEGMENT_HEADER,
    SEGMENT_HEADER_WORDS,
    CodecError,
    ref_width,
    refs_bits,
    refs_packing,
    words_for_bits,
    words_for_bytes,
)
from torchrec_lossy.codec.quantize import QuantParams
from torchrec_lossy.codec.triton_loader import load_kernels, triton_available
from torchrec_lossy.config import Backend, CodecConfig

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "BlockStats",
    "CpuOps",
    "ReferenceOps",
    "StageOps",
    "check_kinds",
    "compress",
    "compress_host_groups",
    "compress_staged",
    "compress_with_stats",
    "decompress",
    "decompress_host_groups",
    "decompress_staged",
    "on_device",
    "validate_inputs",
]


class StageOps(Protocol):
    """The per-stage operations the pipeline needs; one implementation per backend."""

    def quantize(
        self, x: np.ndarray, params: QuantParams, bound: float, dtype_code: int
    ) -> tuple[np.ndarray, np.ndarray, int, float]:
        """float32 [n] -> (uint16 symbols [n], int64 histogram, number of escapes, max error)."""
        ...

    def histogram_rows(self, symbols: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Histogram of the given rows of a uint16 [rows, dim] matrix."""
        ...

    def dequantize(self, symbols: np.ndarray, params: QuantParams) -> np.ndarray:
        """uint16 [n] -> float32 [n]."""
        ...

    def dedupe(self, symbols: np.ndarray | None, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[rows, dim] -> (int32 ids [rows], int32 first_rows [n_unique])."""
        ...

    def pack_refs(self, ids: np.ndarray, n_unique: int, mode: int) -> np.ndarray:
        """int32 ids -> uint32 words."""
        ...

    def huffman_encode(
        self, symbols: np.ndarray, rows: np.ndarray, lengths: np.ndarray, chunk_symbols: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The given rows of uint16 [rows, dim] symbols -> (uint32 chunk_ends, uint32 words)."""
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


class CpuOps:
    """The compiled (numba) CPU kernels, stage by stage.

    The compiled backend's per-block decoder (:func:`decompress_host_groups` names a corrupt
    payload's error with it); its encode stages are the stage-level oracle of the kernel tests
    (``host_compress`` encodes all blocks at once).
    """

    def quantize(
        self, x: np.ndarray, params: QuantParams, bound: float, dtype_code: int
    ) -> tuple[np.ndarray, np.ndarray, int, float]:
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
        return huffman.histogram_rows_kernel(symbols, rows)

    def dequantize(self, symbols: np.ndarray, params: QuantParams) -> np.ndarray:
        out = np.empty(symbols.shape[0], dtype=np.float32)
        quantize.dequantize_kernel(
            symbols, np.float32(params.step), params.center, out, params.value
        )
        return out

    def dedupe(self, symbols: np.ndarray | None, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if symbols is None:
            return vector_lz.dedupe_kernel(np.zeros((1, 1), np.uint16), bits, True)
        return vector_lz.dedupe_kernel(symbols, bits, False)

    def pack_refs(self, ids: np.ndarray, n_unique: int, mode: int) -> np.ndarray:
        return vector_lz.pack_refs_kernel(ids, n_unique, mode)

    def huffman_encode(
        self, symbols: np.ndarray, rows: np.ndarray, lengths: np.ndarray, chunk_symbols: int
    ) -> tuple[np.ndarray, np.ndarray]:
        codes = huffman.canonical_codes_kernel(lengths)
        return huffman.encode_kernel(symbols, rows, lengths, codes, chunk_symbols)

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


class ReferenceOps:
    """The plain torch / Python twins of every stage (slow; the test oracle)."""

    def quantize(
        self, x: np.ndarray, params: QuantParams, bound: float, dtype_code: int
    ) -> tuple[np.ndarray, np.ndarray, int, float]:
        block = torch.from_numpy(x).to(CODE_DTYPES[dtype_code])
        symbols, max_err = quantize.quantize_reference(block, params, bound, params.sr_key)
        hist = torch.bincount(symbols, minlength=ALPHABET_SIZE)
        n_esc = int(hist[ESCAPE_SYMBOL])
        return symbols.numpy().astype(np.uint16), hist.numpy(), n_esc, max_err

    def histogram_rows(self, symbols: np.ndarray, rows: np.ndarray) -> np.ndarray:
        selected = torch.from_numpy(symbols.astype(np.int64))[torch.from_numpy(rows).long()]
        return torch.bincount(selected.reshape(-1), minlength=ALPHABET_SIZE).numpy()

    def dequantize(self, symbols: np.ndarray, params: QuantParams) -> np.ndarray:
        return quantize.dequantize_reference(
            torch.from_numpy(symbols.astype(np.int64)), params
        ).numpy()

    def dedupe(self, symbols: np.ndarray | None, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sym_t = None if symbols is None else torch.from_numpy(symbols.astype(np.int64))
        keys = vector_lz.element_keys(sym_t, torch.from_numpy(bits))
        ids, first = vector_lz.dedupe_reference(keys)
        return ids.numpy().astype(np.int32), first.numpy().astype(np.int32)

    def pack_refs(self, ids: np.ndarray, n_unique: int, mode: int) -> np.ndarray:
        words = vector_lz.pack_refs_reference(torch.from_numpy(ids), n_unique, mode)
        return words.numpy().astype(np.uint32)

    def huffman_encode(
        self, symbols: np.ndarray, rows: np.ndarray, lengths: np.ndarray, chunk_symbols: int
    ) -> tuple[np.ndarray, np.ndarray]:
        codes = huffman.canonical_codes_kernel.py_func(lengths)
        ends, words = huffman.encode_reference(
            torch.from_numpy(symbols[rows].reshape(-1).astype(np.int64)),
            torch.from_numpy(lengths.astype(np.int64)),
            torch.from_numpy(codes.astype(np.int64)),
            chunk_symbols,
        )
        return np.array(ends, dtype=np.uint32), np.array(words, dtype=np.uint32)

    def huffman_decode(
        self,
        words: np.ndarray,
        chunk_ends: np.ndarray,
        n: int,
        chunk_symbols: int,
        lengths: np.ndarray,
        escape_positions: np.ndarray,
    ) -> np.ndarray | str:
        if huffman.decode_table_kernel(lengths).shape[0] == 0:
            return DECODE_ERRORS[DECODE_BAD_CODEBOOK]
        ends = chunk_ends.astype(np.int64)
        if ends.shape[0] and (np.any(np.diff(ends) < 0) or ends[-1] != words.shape[0]):
            return DECODE_ERRORS[DECODE_BAD_CHUNK_TABLE]
        try:
            syms = huffman.decode_reference(
                words.tolist(),
                ends.tolist(),
                n,
                chunk_symbols,
                torch.from_numpy(lengths.astype(np.int64)),
            )
        except ValueError:
            return DECODE_ERRORS[DECODE_INVALID_CODE]
        out = np.array(syms, dtype=np.uint16)
        if not np.array_equal(np.flatnonzero(out == ESCAPE_SYMBOL), escape_positions):
            return DECODE_ERRORS[DECODE_BAD_ESCAPES]
        return out


def on_device(device: torch.device, backend: str) -> bool:
    """Whether compress / decompress run device-resident (``device_compress`` /
    ``device_decompress``) rather than stage by stage.

    CUDA tensors do with ``"auto"`` (when triton is installed; without it they are staged
    through the host path) and ``"triton"``; CPU tensors only with ``"triton"`` (the Triton
    interpreter: slow, for tests).

    Args:
        device: The tensors' device.
        backend: ``CodecConfig.backend``.

    Returns:
        True for the device-resident path.
    """
    if backend == "triton":
        return True
    return backend == "auto" and device.type == "cuda" and triton_available()


@dataclass
class _Encoded:
    """One block's encoding: descriptor fields, segment sections and stats."""

    mode: int
    sections: list[np.ndarray]
    max_error: float = 0.0
    n_unique: int = 0
    n_escapes: int = 0


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """A section as bytes, zero-padded to a whole number of words."""
    b = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    pad = -b.shape[0] % 4
    return np.concatenate([b, np.zeros(pad, np.uint8)]) if pad else b


@dataclass(frozen=True)
class _Code:
    """A Huffman code for one symbol stream and the words it will take."""

    hist: np.ndarray
    lengths: np.ndarray
    sym_lo: int  # value symbols with a code: sym_lo .. sym_lo + sym_count - 1
    sym_count: int
    words: int  # codebook + chunk table + bitstream (chunk padding estimated as half a word)

    @staticmethod
    def plan(hist: np.ndarray, chunk_symbols: int) -> _Code:
        lengths, bits, n, lo, count = huffman.plan_kernel(hist)
        return _Code(hist, lengths, lo, count, int(sm.code_words(n, bits, count, chunk_symbols)))


def _segment_header(**fields: int | float) -> np.ndarray:
    values = dict.fromkeys(SEGMENT_HEADER.names, 0) | fields  # unnamed fields are 0
    return np.array([tuple(values.values())], dtype=SEGMENT_HEADER)


def _quantized_sections(
    ops: StageOps,
    symbols: np.ndarray,
    rows: np.ndarray,
    code: _Code,
    raw_bits: np.ndarray,
    params: QuantParams,
    chunk_symbols: int,
    refs: tuple[np.ndarray, int] | None,
) -> list[np.ndarray]:
    """Sections of a quantized segment that sends ``rows`` of the [rows, dim] ``symbols``.

    Args:
        ops: Stage implementations.
        symbols: uint16 [rows, dim] symbols of the block.
        rows: The rows to send (the distinct vectors for vector-LZ, else every row).
        code: Huffman code planned for those rows' symbols.
        raw_bits: [rows, dim] raw bits of the block (the escaped elements travel verbatim).
        params: Quantization parameters.
        chunk_symbols: Symbols per Huffman chunk.
        refs: (packed vector ids, packing mode) for vector-LZ, else None.

    Returns:
        The sections, in wire order.
    """
    nibbles = huffman.pack_codebook_kernel(code.lengths, code.sym_lo, code.sym_count)
    n_escapes = int(code.hist[ESCAPE_SYMBOL])
    esc_pos = np.zeros(0, np.uint32)
    esc_bits = raw_bits[:0, 0]
    if n_escapes:
        sent = symbols[rows].reshape(-1)
        esc_pos = np.flatnonzero(sent == ESCAPE_SYMBOL).astype(np.uint32)
        esc_bits = raw_bits[rows].reshape(-1)[esc_pos]
    chunk_ends, words = ops.huffman_encode(symbols, rows, code.lengths, chunk_symbols)
    header = _segment_header(
        step=params.step,
        center=params.center,
        n_unique=rows.shape[0],
        n_escapes=n_escapes,
        chunk_symbols=chunk_symbols,
        n_chunks=chunk_ends.shape[0],
        sym_lo=code.sym_lo,
        sym_count=code.sym_count,
        escape_length=code.lengths[ESCAPE_SYMBOL],
        ref_mode=refs[1] if refs else 0,
        ref_width=int(ref_width(rows.shape[0])),
    )
    sections = [header, nibbles]
    if refs:
        sections.append(refs[0])
    sections += [esc_pos, esc_bits, chunk_ends, words]
    return sections


def _encode_block(
    block: torch.Tensor,
    bound: float,
    config: CodecConfig,
    ops: StageOps,
    sr_key: int = quantize.NEAREST_KEY,
    value: bool = False,
) -> _Encoded:
    """Encodes one block in the smallest of the modes the config and the bound allow.

    Sizes are computed from histograms before anything is encoded; only the winner is built.
    The choice is ``size_model``'s (shared with the device path): on a tie the simpler mode wins
    (raw, quant, quant+lz, lz), and the lossless dedupe runs only when it could still win.
    ``sr_key`` other than ``NEAREST_KEY`` rounds stochastically with that key (grid step
    ``bound``). ``value``: ``bound`` is a per-value bound (the per-value grid, to nearest).
    """
    rows, dim = block.shape
    raw_bits = block.contiguous().view(BITS_DTYPES[block.dtype]).numpy()
    if rows * dim == 0:
        return _Encoded(MODE_RAW, [raw_bits])
    itemsize = block.element_size()
    bits = raw_bits.astype(np.int32, copy=False)
    chunk = config.huffman_chunk_symbols
    lz_allowed = config.enable_lz and rows > 1
    x = block.reshape(-1).float().numpy()
    params = None
    if config.enable_quantization and bound > 0 and value:
        finite = np.abs(x[np.isfinite(x)])
        step, qmax = quantize.value_params(bound, float(finite.max()) if finite.size else 0.0)
        params = QuantParams(step=step, inv_step=0.0, center=int(qmax), value=True)
    elif config.enable_quantization and bound > 0:
        stochastic = sr_key != quantize.NEAREST_KEY
        params = quantize.quant_params(quantize.grid_bound(bound, stochastic), x)
        if params is not None and stochastic:
            params = dataclasses.replace(params, sr_key=sr_key)
    quant_ok = params is not None
    quant_w = quant_lz_w = 0
    quant_lz_ok = False
    n_unique_quantized = 1  # a lower bound on the distinct raw vectors until dedupe says more
    if params is not None:
        symbols, hist, n_esc, max_err = ops.quantize(x, params, bound, DTYPE_CODES[block.dtype])
        sym2d = symbols.reshape(rows, dim)
        code = _Code.plan(hist, chunk)
        quant_w = int(sm.quant_words(n_esc, itemsize, code.words))
        if lz_allowed:
            ids, first = ops.dedupe(sym2d, bits)
            n_unique_quantized = first.shape[0]
            quant_lz_ok = n_unique_quantized < rows
            if quant_lz_ok:
                uniq_code = _Code.plan(ops.histogram_rows(sym2d, first), chunk)
                n_esc_u = int(uniq_code.hist[ESCAPE_SYMBOL])
                quant_lz_w = int(
                    sm.quant_lz_words(rows, n_unique_quantized, n_esc_u, itemsize, uniq_code.words)
                )
    raw_words = words_for_bytes(rows * dim * itemsize)
    mode, best = sm.choose_lossy(raw_words, quant_ok, quant_w, quant_lz_ok, quant_lz_w)
    if sm.lossless_may_win(lz_allowed, rows, dim, itemsize, n_unique_quantized, best):
        raw_ids, raw_first = ops.dedupe(None, bits)
        n_unique = raw_first.shape[0]
        lossless_w = sm.lossless_lz_words(rows, n_unique, dim, itemsize)
        mode = sm.choose_lossless(mode, best, True, lossless_w, rows * dim)
    mode = int(mode)
    if mode == MODE_RAW:
        return _Encoded(MODE_RAW, [raw_bits])
    if mode == MODE_LZ:
        ref_mode, width, _ = refs_packing(rows, n_unique)
        header = _segment_header(n_unique=n_unique, ref_mode=int(ref_mode), ref_width=int(width))
        packed = ops.pack_refs(raw_ids, n_unique, int(ref_mode))
        return _Encoded(MODE_LZ, [header, packed, raw_bits[raw_first]], n_unique=n_unique)
    if mode == MODE_QUANT:
        every_row = np.arange(rows, dtype=np.int32)
        sections = _quantized_sections(ops, sym2d, every_row, code, raw_bits, params, chunk, None)
        return _Encoded(MODE_QUANT, sections, max_err, rows, n_esc)
    ref_mode = int(refs_packing(rows, n_unique_quantized)[0])
    refs = (ops.pack_refs(ids, n_unique_quantized, ref_mode), ref_mode)
    sections = _quantized_sections(ops, sym2d, first, uniq_code, raw_bits, params, chunk, refs)
    return _Encoded(MODE_QUANT_LZ, sections, max_err, n_unique_quantized, n_esc_u)


def sr_keys(config: CodecConfig, n_blocks: int) -> list[int]:
    """Per block of one payload: its stochastic-rounding key, or ``NEAREST_KEY``.

    Args:
        config: Codec knobs (``rounding`` and ``seed``).
        n_blocks: Blocks in the payload.

    Returns:
        One key per block (shared by every backend, so all draw the same rounding).
    """
    local = np.arange(n_blocks, dtype=np.int64)
    return quantize.block_keys(config.rounding == "stochastic", config.seed, local).tolist()


def validate_inputs(
    blocks: Sequence[torch.Tensor], error_bounds: Sequence[float]
) -> tuple[list[float], torch.device]:
    """Checks blocks and bounds as compress needs them.

    Args:
        blocks: What the caller passed as blocks.
        error_bounds: What it passed as bounds.

    Returns:
        (the bounds as floats, the blocks' device).

    Raises:
        ValueError: Naming the bad block or bound and the fix.
    """
    if isinstance(blocks, torch.Tensor):
        raise ValueError(
            "blocks must be a sequence of 2-D tensors, got a single tensor: wrap it as [tensor]"
        )
    blocks = list(blocks)
    bounds = list(error_bounds)
    if len(bounds) != len(blocks):
        raise ValueError(
            f"got {len(blocks)} blocks but {len(bounds)} error bounds: pass one bound per block"
        )
    for i, b in enumerate(blocks):
        if not isinstance(b, torch.Tensor):
            raise ValueError(f"block {i} is a {type(b).__name__}: pass a torch.Tensor")
    device = blocks[0].device if blocks else torch.device("cpu")
    out = []
    for i, (b, eb) in enumerate(zip(blocks, bounds, strict=True)):
        if b.dim() != 2:
            raise ValueError(
                f"block {i} has shape {tuple(b.shape)}: pass 2-D blocks [rows, dim] "
                "(reshape it, e.g. block.reshape(-1, dim))"
            )
        if b.dtype not in DTYPE_CODES:
            raise ValueError(
                f"block {i} has dtype {b.dtype}: pass float32, float16 or bfloat16 "
                "(e.g. block.float())"
            )
        if b.device != device:
            raise ValueError(
                f"block {i} is on {b.device} but block 0 is on {device}: "
                "put all blocks of one payload on one device"
            )
        if b.shape[0] >= 1 << 32 or b.shape[1] >= 1 << 32:
            raise ValueError(f"block {i} has shape {tuple(b.shape)}: each side must be < 2**32")
        try:
            eb_f = float(eb)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(
                f"error bound {i} is {eb!r}: pass a finite float >= 0 (0 means lossless)"
            ) from None
        if not math.isfinite(eb_f) or eb_f < 0:
            raise ValueError(
                f"error bound {i} is {eb_f}: pass a finite bound >= 0 (0 means lossless)"
            )
        out.append(eb_f)
    return out, device


def check_kinds(
    kinds: Sequence[int] | None, bounds: Sequence[float], config: CodecConfig
) -> list[BoundKind]:
    """Checks the bound kinds of a call against its bounds and config.

    Args:
        kinds: Per block, its bound's ``BoundKind``; None: all absolute.
        bounds: The validated bounds.
        config: Codec knobs.

    Returns:
        The kinds, one per block.

    Raises:
        ValueError: A kind per block is missing, a per-value bound is over 0.5 (it would keep no
            mantissa bit), or per-value bounds meet stochastic rounding (the per-value grid
            rounds to nearest only).
    """
    if kinds is None:
        return [BoundKind.ABSOLUTE] * len(bounds)
    out = [BoundKind(int(k)) for k in kinds]
    if len(out) != len(bounds):
        raise ValueError(f"got {len(out)} bound kinds for {len(bounds)} blocks: pass one per block")
    for i, (k, b) in enumerate(zip(out, bounds, strict=True)):
        if k == BoundKind.VALUE and b > 0.5:
            raise ValueError(
                f"per-value bound {i} is {b}: pass a value in (0, 0.5] (0 means lossless)"
            )
        if k == BoundKind.VALUE and b > 0 and config.rounding == "stochastic":
            raise ValueError(
                f"per-value bound {i} ({b}) with rounding='stochastic': the per-value grid "
                "rounds to nearest only; set rounding='nearest' or use a relative bound"
            )
    return out


def compress_with_stats(
    blocks: Sequence[torch.Tensor],
    error_bounds: Sequence[float],
    config: CodecConfig | None = None,
    kinds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[BlockStats]]:
    """Compresses blocks under error bounds and reports what each block became.

    Args:
        blocks: 2-D float32 / float16 / bfloat16 tensors (rows = embedding vectors), one device.
        error_bounds: Bound per block; 0 means lossless for that block.
        config: Codec knobs; None uses the defaults.
        kinds: Per block, its bound's ``BoundKind``; None: all absolute. A ``VALUE`` block
            keeps ``|x' - x| <= bound * |x|`` for every element (``bound <= 0.5``).

    Returns:
        (1-D uint8 payload on the blocks' device, one BlockStats per block).

    Raises:
        ValueError: For a bad block, bound or bound count (the message names it and the fix).
    """
    config = config or CodecConfig()
    bounds, device = validate_inputs(blocks, error_bounds)
    kinds = check_kinds(kinds, bounds, config)
    if BoundKind.RELATIVE in kinds:
        bounds = absolute_bounds(blocks, bounds, kinds)
        kinds = [BoundKind.ABSOLUTE if k == BoundKind.RELATIVE else k for k in kinds]
    if on_device(device, config.backend):
        load_kernels(device)  # raises if triton is missing; picks the interpreter on CPU
        from torchrec_lossy.codec.device_compress import compress_device

        return compress_device(blocks, bounds, config, kinds)
    if config.backend == "reference":
        return compress_staged(blocks, bounds, config, ReferenceOps(), kinds)
    with record_function("## lossy_codec encode ##"):
        enc = host_compress.compress_blocks(blocks, bounds, config, None, kinds)
    return torch.from_numpy(enc.payload).to(device), enc.columns().stats()


def compress_staged(
    blocks: Sequence[torch.Tensor],
    bounds: list[float],
    config: CodecConfig,
    ops: StageOps,
    kinds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[BlockStats]]:
    """:func:`compress_with_stats` stage by stage, block by block, over the given stages.

    Args:
        blocks: Validated 2-D blocks (one device).
        bounds: Validated bound per block: absolute, or per-value where ``kinds`` says so.
        config: Codec knobs (its ``backend`` is not read: ``ops`` are the stages).
        ops: The stage implementations (``ReferenceOps`` for ``backend="reference"``).
        kinds: Per block, ``BoundKind.ABSOLUTE`` or ``BoundKind.VALUE``; None: all absolute.

    Returns:
        (1-D uint8 payload on the blocks' device, one BlockStats per block).
    """
    device = blocks[0].device if blocks else torch.device("cpu")
    with record_function("## lossy_codec encode ##"):
        value = [k == BoundKind.VALUE for k in kinds or [BoundKind.ABSOLUTE] * len(blocks)]
        encoded = [
            _encode_block(b.detach().cpu(), eb, config, ops, key, v)
            for b, eb, key, v in zip(
                blocks, bounds, sr_keys(config, len(blocks)), value, strict=True
            )
        ]
        segments = [[_as_bytes(s) for s in e.sections] for e in encoded]
        desc = np.zeros(len(blocks), DESCRIPTOR)
        seg_words = [sum(s.shape[0] for s in segs) // 4 for segs in segments]
        for i, (b, e) in enumerate(zip(blocks, encoded, strict=True)):
            desc[i] = (
                b.shape[0],
                b.shape[1],
                DTYPE_CODES[b.dtype],
                e.mode | MODE_VALUE
                if value[i] and e.mode in (MODE_QUANT, MODE_QUANT_LZ)
                else e.mode,
                0,
                seg_words[i],
                bounds[i],
            )
        stats = BlockColumns.assemble(
            (
                [b.shape[0] for b in blocks],
                [b.shape[1] for b in blocks],
                [b.element_size() for b in blocks],
            ),
            [e.mode for e in encoded],
            seg_words,
            bounds,
            [e.max_error for e in encoded],
            (
                [
                    e.n_unique if e.mode != MODE_RAW else b.shape[0]
                    for b, e in zip(blocks, encoded, strict=True)
                ],
                [e.n_escapes for e in encoded],
            ),
        ).stats()
        body = np.concatenate([desc.view(np.uint8)] + [s for segs in segments for s in segs])
        payload = torch.from_numpy(np.concatenate([host_header(len(blocks), body), body]))
    return payload.to(device), stats


def compress_host_groups(
    blocks: Sequence[torch.Tensor],
    bounds: list[float],
    group_sizes: Sequence[int],
    config: CodecConfig,
    kinds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[int], list[BlockColumns], list[np.ndarray]]:
    """The host path of several payloads at once: consecutive groups of validated blocks.

    With the compiled backend every stage runs once over all groups' blocks; each payload is
    the bytes :func:`compress_with_stats` gives for its group alone.

    Args:
        blocks: Validated 2-D blocks, group after group (one device).
        bounds: Validated bound per block, of its kind in ``kinds``.
        group_sizes: Blocks per group.
        config: Codec knobs (a host backend: "auto" off the device path, "cpu", "reference").
        kinds: Per block, its bound's ``BoundKind``; None: all absolute.

    Returns:
        (the payloads back to back as one 1-D uint8 tensor on the blocks' device, bytes of
        each payload, per group the columns of its blocks, per group its payload's skeleton
        (``container.payload_skeletons``, uint32 words)).
    """
    device = blocks[0].device if blocks else torch.device("cpu")
    if config.backend != "reference" and group_sizes:
        enc = host_compress.compress_blocks(blocks, bounds, config, group_sizes, kinds)
        flat = enc.columns()
        if len(group_sizes) == 1:  # one destination (2 ranks): nothing to cut
            columns = [flat]
        else:
            ends = itertools.accumulate(group_sizes)
            columns = [flat.slice(e - n, e) for e, n in zip(ends, group_sizes, strict=True)]
        payload = torch.from_numpy(enc.payload)
        # A no-op .to() still costs a dispatch: only a device copy pays for one.
        payload = payload if device.type == "cpu" else payload.to(device)
        return payload, enc.sizes, columns, enc.skeletons
    kinds = list(kinds) if kinds is not None else [BoundKind.ABSOLUTE] * len(blocks)
    payloads, stats = [], []
    at = 0
    for n in group_sizes:
        p, s = compress_with_stats(
            blocks[at : at + n], bounds[at : at + n], config, kinds[at : at + n]
        )
        payloads.append(p)
        stats.append(BlockColumns.of(s))
        at += n
    buffer = torch.cat(payloads) if payloads else torch.zeros(0, dtype=torch.uint8, device=device)
    sizes = [p.numel() for p in payloads]
    skel, ends = payload_skeletons(buffer.cpu().numpy().view(np.uint32), sizes)
    return buffer, sizes, stats, [skel[a:b] for a, b in itertools.pairwise(ends.tolist())]


def compress(
    blocks: Sequence[torch.Tensor],
    error_bounds: Sequence[float],
    config: CodecConfig | None = None,
) -> torch.Tensor:
    """Compresses blocks under absolute error bounds.

    Every finite element decodes within its block's bound; NaN, +-Inf and values the bound cannot
    cover travel exactly.

    Args:
        blocks: 2-D float32 / float16 / bfloat16 tensors (rows = embedding vectors), one device.
        error_bounds: Absolute bound per block; 0 means lossless for that block.
        config: Codec knobs; None uses the defaults.

    Returns:
        The payload: a 1-D torch.uint8 tensor on the blocks' device.

    Raises:
        ValueError: For a bad block, bound or bound count.
    """
    return compress_with_stats(blocks, error_bounds, config)[0]


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
    seg: np.ndarray, rows: int, dim: int, dtype: torch.dtype, mode: int, block: int, ops: StageOps
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
    header = r.take(SEGMENT_HEADER_WORDS, "segment header").view(SEGMENT_HEADER)[0].item()
    step, center, n_unique, n_esc, chunk_symbols, n_chunks = header[:6]
    lo, count, esc_len, ref_mode, width = header[6:11]
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


def decompress(
    payload: torch.Tensor,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    backend: Backend = "auto",
) -> list[torch.Tensor]:
    """Decodes a payload made by :func:`compress`.

    A CUDA payload (backend ``"auto"`` with triton installed, or ``"triton"``) and a CPU payload
    with backend ``"triton"`` are decoded on their device by
    :func:`torchrec_lossy.codec.device_decompress.decompress_device` (all blocks at once, two
    host syncs); everything else by the host path below. Both give the same bits and the same
    errors.

    Args:
        payload: 1-D uint8 tensor.
        max_elements: Refuse payloads that decode to more elements than this in total.
        backend: Stage implementations, as ``CodecConfig.backend``; every backend decodes every
            payload.

    Returns:
        The blocks: same shapes and dtypes as compressed, on the payload's device.

    Raises:
        CodecError: The payload is truncated, corrupted or not a torchrec-lossy payload.
    """
    CodecConfig(backend=backend)  # validates the backend name
    check_payload(payload)
    if on_device(payload.device, backend):
        from torchrec_lossy.codec.device_decompress import decompress_device

        def on_reject(buf: np.ndarray) -> None:
            decompress(torch.from_numpy(buf.copy()), max_elements, backend="cpu")

        return decompress_device(payload, max_elements, on_reject)
    (out,) = decompress_host_groups(payload, [payload.numel()], max_elements, backend)
    if isinstance(out, CodecError):
        raise out
    return out


def decompress_host_groups(
    buffer: torch.Tensor,
    sizes: Sequence[int],
    max_elements: int,
    backend: Backend,
    label: bool = True,
) -> list[list[torch.Tensor] | CodecError]:
    """The host path of :func:`decompress` over several payloads of one buffer at once.

    With the compiled backend one call parses and decodes every block of every payload; the
    payloads it leaves (corrupt ones) go through the header parser and the per-block decoder
    (:class:`CpuOps`), in block order, for the blocks it did not decode, so each payload's
    result or error is what :func:`decompress` gives for it. ``"reference"`` decodes every
    block with :class:`ReferenceOps`.

    Args:
        buffer: 1-D uint8 tensor: the payloads back to back.
        sizes: Bytes of each payload (summing to the buffer's).
        max_elements: Refuse a payload that decodes to more elements than this.
        backend: A host backend, as ``CodecConfig.backend``.
        label: Whether to open the profiler range ``## lossy_codec decode ##`` (False when
            the caller's own range already covers the call: a range costs microseconds).

    Returns:
        Per payload its blocks (on the buffer's device) or the CodecError it raises.
    """
    device = buffer.device
    if device.type == "cpu" and buffer.is_contiguous():
        buf = buffer.numpy()  # uint8 never requires grad: no detach needed
    else:
        buf = buffer.detach().cpu().contiguous().numpy()
    compiled = backend != "reference"
    ops: StageOps = CpuOps() if compiled else ReferenceOps()
    with record_function("## lossy_codec decode ##") if label else contextlib.nullcontext():
        starts = list(itertools.accumulate(sizes, initial=0))
        batch = None
        if compiled and sizes:
            batch = host_decompress.decompress_payloads(*_word_layout(buf, starts), max_elements)
            if device.type != "cpu":
                batch = dataclasses.replace(
                    batch, out32=batch.out32.to(device), out16=batch.out16.to(device)
                )
        results: list[list[torch.Tensor] | CodecError] = []
        for g, n in enumerate(sizes):
            if batch is not None and batch.complete(g):
                results.append(batch.blocks(g))
                continue
            decoded = None  # what the batched reader decoded of an accepted payload
            if batch is not None and batch.accepted[g]:
                decoded = [batch.block(i) for i in range(batch.first[g], batch.first[g + 1])]
            results.append(
                _decode_payload(buf[starts[g] : starts[g] + n], max_elements, ops, decoded, device)
            )
    return results


def decompress_staged(
    payload: torch.Tensor, max_elements: int, ops: StageOps
) -> list[torch.Tensor]:
    """:func:`decompress` block by block over the given stages (on the host).

    Args:
        payload: 1-D uint8 tensor.
        max_elements: Refuse payloads that decode to more elements than this in total.
        ops: The stage implementations.

    Returns:
        The blocks, on the payload's device.

    Raises:
        CodecError: The payload is truncated, corrupted or not a torchrec-lossy payload.
    """
    check_payload(payload)
    buf = payload.detach().cpu().contiguous().numpy()
    out = _decode_payload(buf, max_elements, ops, None, payload.device)
    if isinstance(out, CodecError):
        raise out
    return out


def _decode_payload(
    buf: np.ndarray,
    max_elements: int,
    ops: StageOps,
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


def _word_layout(buf: np.ndarray, starts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The payloads of ``buf`` as words, for ``host_decompress.decompress_payloads``.

    A view when every payload starts on a word (always, for payloads written by
    :func:`compress`); else a copy with each payload padded to a whole word.

    Args:
        buf: uint8 payloads back to back.
        starts: Byte offset of each payload in ``buf``, then the end.

    Returns:
        (uint32 words, int64 [2 * G]: the first word of each payload, then its bytes).
    """
    n_bytes = [b - a for a, b in itertools.pairwise(starts)]
    if not any(a & 3 for a in starts):  # one numpy call: they cost more than the arithmetic
        return buf.view(np.uint32), np.array([a >> 2 for a in starts[:-1]] + n_bytes, np.int64)
    words_at = list(itertools.accumulate((-(-n // 4) for n in n_bytes), initial=0))
    words = np.zeros(4 * words_at[-1], np.uint8)
    for w, s, n in zip(words_at, starts, n_bytes, strict=False):
        words[4 * w : 4 * w + n] = buf[s : s + n]
    return words.view(np.uint32), np.array(words_at[:-1] + n_bytes, np.int64)
