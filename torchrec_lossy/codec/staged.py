"""The codec stage by stage, one block at a time: the reference backend and the per-block decoder.

``compress_staged`` runs the encoder over an explicit :class:`StageOps`
(the data-sized stages: quantize, dedupe, histogram, Huffman encode and decode). The library has
one implementation, :class:`ReferenceOps`, the plain torch twins of every stage: the
``"reference"`` backend and the test oracle. Tests plug in the compiled and Triton stages
(tests/stage_ops.py, tests/triton_stage_ops.py) to compare them stage by stage on whole payloads.

Decoding needs only two stages (:class:`DecodeStages`). :func:`decode_payload` is the
per-block decoder of the reference backend (over :class:`ReferenceOps`); it names a corrupt
segment's error with ``container.segment_error``, as the compiled host decoder does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.profiler import record_function

from torchrec_lossy.codec import container, huffman, quantize, vector_lz
from torchrec_lossy.codec import size_model as sm
from torchrec_lossy.codec.bounds import BoundKind
from torchrec_lossy.codec.container import (
    BlockColumns,
    BlockStats,
    Reader,
    host_header,
    parse_header,
    segment_error,
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
    read_segment_header,
    ref_width,
    refs_bits,
    refs_packing,
    words_for_bits,
    words_for_bytes,
)
from torchrec_lossy.codec.quantize import QuantParams
from torchrec_lossy.config import CodecConfig

__all__ = [
    "DecodeStages",
    "ReferenceOps",
    "StageOps",
    "compress_staged",
    "decode_payload",
    "sr_keys",
]


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


class StageOps(DecodeStages, Protocol):
    """Every data-sized stage of the codec: what :func:`compress_staged` runs over."""

    def quantize(
        self, x: np.ndarray, params: QuantParams, bound: float, dtype_code: int
    ) -> tuple[np.ndarray, np.ndarray, int, float]:
        """float32 [n] -> (uint16 symbols [n], int64 histogram, number of escapes, max error)."""
        ...

    def histogram_rows(self, symbols: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Histogram of the given rows of a uint16 [rows, dim] matrix."""
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


class ReferenceOps:
    """The plain torch / Python twins of every stage: the ``"reference"`` backend (slow; the
    test oracle)."""

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
    refs: tuple[np.ndarray, int] | None = None,
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


def _grid(
    x: np.ndarray, bound: float, config: CodecConfig, sr_key: int, value: bool
) -> QuantParams | None:
    """The quantization grid of one block (float32 values ``x``), or None to send it unquantized."""
    if not (config.enable_quantization and bound > 0):
        return None
    if value:
        finite = np.abs(x[np.isfinite(x)])
        step, qmax = quantize.value_params(bound, float(finite.max()) if finite.size else 0.0)
        return QuantParams(step=step, inv_step=0.0, center=int(qmax), value=True)
    stochastic = sr_key != quantize.NEAREST_KEY
    params = quantize.quant_params(quantize.grid_bound(bound, stochastic), x)
    if params is not None and stochastic:
        params = dataclasses.replace(params, sr_key=sr_key)
    return params


@dataclass
class _Quantized:
    """One block on its grid and the words its quantized modes take (size model)."""

    symbols: np.ndarray  # uint16 [rows, dim]
    code: _Code
    n_escapes: int
    max_error: float
    words: int
    ids: np.ndarray | None = None  # vector ids over the symbols (None: dedupe not run)
    first: np.ndarray | None = None  # first row of each distinct vector
    lz_code: _Code | None = None  # the code of the distinct vectors' symbols
    lz_words: int = 0  # 0: quant+lz cannot be sent

    @staticmethod
    def of(
        ops: StageOps,
        x: np.ndarray,
        bits: np.ndarray,
        params: QuantParams,
        bound: float,
        dtype: torch.dtype,
        chunk: int,
        lz_allowed: bool,
    ) -> _Quantized:
        """Quantizes ``x`` (the block's values; ``bits`` its [rows, dim] int32 bits) and sizes
        the quant mode, and the quant+lz mode when ``lz_allowed``."""
        rows, dim = bits.shape
        itemsize = torch.empty(0, dtype=dtype).element_size()
        symbols, hist, n_esc, max_err = ops.quantize(x, params, bound, DTYPE_CODES[dtype])
        code = _Code.plan(hist, chunk)
        q = _Quantized(
            symbols.reshape(rows, dim),
            code,
            n_esc,
            max_err,
            int(sm.quant_words(n_esc, itemsize, code.words)),
        )
        if lz_allowed:
            q.ids, q.first = ops.dedupe(q.symbols, bits)
            n_unique = q.first.shape[0]
            if n_unique < rows:
                q.lz_code = _Code.plan(ops.histogram_rows(q.symbols, q.first), chunk)
                n_esc_u = int(q.lz_code.hist[ESCAPE_SYMBOL])
                q.lz_words = int(
                    sm.quant_lz_words(rows, n_unique, n_esc_u, itemsize, q.lz_code.words)
                )
        return q  # fmt: skip

    @property
    def n_unique(self) -> int:
        """Distinct quantized vectors (a lower bound on the distinct raw ones); 1 if not run."""
        return 1 if self.first is None else self.first.shape[0]


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
    bits = raw_bits.astype(np.int32, copy=False).reshape(rows, dim)
    chunk = config.huffman_chunk_symbols
    lz_allowed = config.enable_lz and rows > 1
    x = block.reshape(-1).float().numpy()
    params = _grid(x, bound, config, sr_key, value)
    q = None
    if params is not None:
        q = _Quantized.of(ops, x, bits, params, bound, block.dtype, chunk, lz_allowed)
    raw_words = words_for_bytes(rows * dim * itemsize)
    lz_ok = q is not None and q.lz_code is not None
    mode, best = sm.choose_lossy(
        raw_words, q is not None, q.words if q else 0, lz_ok, q.lz_words if q else 0
    )
    if sm.lossless_may_win(lz_allowed, rows, dim, itemsize, q.n_unique if q else 1, best):
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
    assert q is not None and params is not None
    if mode == MODE_QUANT:
        every_row = np.arange(rows, dtype=np.int32)
        sections = _quantized_sections(ops, q.symbols, every_row, q.code, raw_bits, params, chunk)
        return _Encoded(MODE_QUANT, sections, q.max_error, rows, q.n_escapes)
    assert q.ids is not None and q.first is not None and q.lz_code is not None
    ref_mode = int(refs_packing(rows, q.n_unique)[0])
    refs = (ops.pack_refs(q.ids, q.n_unique, ref_mode), ref_mode)
    sections = _quantized_sections(
        ops, q.symbols, q.first, q.lz_code, raw_bits, params, chunk, refs
    )
    n_esc_u = int(q.lz_code.hist[ESCAPE_SYMBOL])
    return _Encoded(MODE_QUANT_LZ, sections, q.max_error, q.n_unique, n_esc_u)


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


def compress_staged(
    blocks: Sequence[torch.Tensor],
    bounds: list[float],
    config: CodecConfig,
    ops: StageOps,
    kinds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[BlockStats]]:
    """``pipeline.compress_with_stats`` stage by stage, block by block, over the given stages.

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


# The decode stages name a stream's error (DECODE_ERRORS' text); segment_error takes its code.
_DECODE_CODES = {what: code for code, what in DECODE_ERRORS.items()}


def _decode_refs(r: Reader, rows: int, n_unique: int, ref_mode: int, width: int) -> np.ndarray:
    if not 1 <= n_unique <= rows or width != ref_width(n_unique):
        raise segment_error(container.SEGMENT_BAD_REFS, (n_unique, width, rows, 0), r.block)
    if ref_mode not in (REFS_FIXED, REFS_FLAGGED):
        raise segment_error(container.SEGMENT_BAD_PACKING, (ref_mode, 0, 0, 0), r.block)
    words = r.take(int(words_for_bits(refs_bits(rows, n_unique, ref_mode))), container.SECTION_REFS)
    ids = np.empty(rows, dtype=np.int32)
    if vector_lz.unpack_refs_kernel(words, rows, n_unique, ref_mode, width, ids) != 0:
        raise segment_error(container.SEGMENT_REFS_RANGE, (0, 0, 0, 0), r.block)
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
        raw = r.take_bytes(rows * dim * itemsize, container.SECTION_RAW).view(bits_dtype)
        r.done()
        return to_tensor(raw.copy())
    header = read_segment_header(r.take(SEGMENT_HEADER_WORDS, container.SECTION_HEADER), 0)
    step = float(header[0])
    center, n_unique, n_esc, chunk_symbols, n_chunks = (int(v) for v in header[1:6])
    lo, count, esc_len, ref_mode, width = (int(v) for v in header[6:11])
    value = (mode & MODE_VALUE) == MODE_VALUE
    mode &= ~MODE_VALUE
    if mode == MODE_LZ:
        ids = _decode_refs(r, rows, n_unique, ref_mode, width)
        uniq = r.take_bytes(n_unique * dim * itemsize, container.SECTION_VECTORS).view(bits_dtype)
        r.done()
        return to_tensor(vector_lz.expand_rows_kernel(uniq.reshape(n_unique, dim), ids))

    def fail(status: int, *details: int) -> CodecError:
        return segment_error(status, (*details, 0, 0, 0)[:4], block)

    step_bits = int(np.float32(step).view(np.uint32))
    if value and not (2.0**-23 <= step <= 1.0 and center >= 0):
        raise fail(container.SEGMENT_BAD_VALUE_GRID, step_bits, center)
    if not (math.isfinite(step) and step > 0 and (value or abs(center) <= quantize.MAX_CENTER)):
        raise fail(container.SEGMENT_BAD_GRID, step_bits, center)
    if lo + count > ESCAPE_SYMBOL or esc_len > MAX_CODE_LENGTH:
        raise fail(container.SEGMENT_BAD_CODEBOOK, lo, count, esc_len)
    nibbles = r.take_bytes((count + 1) // 2, container.SECTION_CODEBOOK)
    lengths = huffman.expand_codebook_kernel(nibbles, lo, count, esc_len)
    ids = None
    if mode == MODE_QUANT_LZ:
        ids = _decode_refs(r, rows, n_unique, ref_mode, width)
    elif n_unique != rows:
        raise fail(container.SEGMENT_BAD_VECTORS, n_unique, rows)
    n_sym = n_unique * dim
    if n_esc > n_sym:
        raise fail(container.SEGMENT_BAD_ESCAPES, n_esc, n_sym)
    esc_pos = r.take(n_esc, container.SECTION_ESC_POS)
    esc_bits = r.take_bytes(n_esc * itemsize, container.SECTION_ESC_VALUES).view(bits_dtype)
    if chunk_symbols < 1 or n_chunks != -(-n_sym // chunk_symbols):
        raise fail(container.SEGMENT_BAD_CHUNKS, n_chunks, chunk_symbols, n_sym)
    chunk_ends = r.take(n_chunks, container.SECTION_CHUNKS)
    words = seg[r.pos :]  # the bitstream: the rest
    symbols = ops.huffman_decode(words, chunk_ends, n_sym, chunk_symbols, lengths, esc_pos)
    if isinstance(symbols, str):
        raise fail(container.SEGMENT_BAD_STREAM, _DECODE_CODES[symbols])
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
