"""The KJT codec of the input dist: lossless bit packing of a ``KeyedJaggedTensor``, pure tensors.

No collectives and no telemetry here (:mod:`torchrec_lossy.distributed.input_dist` runs the
exchange and records the bytes); every function runs where the KJT lives, CPU or CUDA.

- :func:`encode_kjt` (sender): one pass of per-feature reductions (length sum / max / min, id
  max / min and, with deduplication, the distinct-id count) read on the host in one
  ``tolist()``. Each feature's lengths are packed to the bits of its largest length, its ids to
  the bits of its largest id. With ``dedupe`` a feature sends its distinct ids once plus an
  inverse index wherever that is fewer bits. Weights follow raw (or cast to fp16/bf16 only if
  asked). It returns, per destination, a payload of int32 words and a metadata row.
- Metadata (:func:`meta_words`, :func:`parse_meta`): per destination, a few int64 words
  (payload size, batch size, dtype codes, per feature its :class:`FeatureMeta`), what the
  receiver needs to size and unpack the payload.
- :func:`decode_kjt` (receiver): unpacks every source's payload into TorchRec's
  (lengths, values, weights) tensors, with the same dtypes, so the KJT built from them is
  bit-identical to ``KJTAllToAll``'s.
- Checksum words (:func:`payload_checksums`): each payload ends with a position-weighted int64
  checksum the receiver verifies (``InputDistConfig.checksum``).

Both ends plan each payload alike with the compiled planner of
:mod:`~torchrec_lossy.distributed.kjt_layout` (``plan_encode`` / ``plan_decode``: per feature its
format and fields, each a section of fixed-width fields; host ints, where a Python loop over
features and fields cost more than the packing). The tensor work then runs on one of two backends
(:data:`KJTBackend`, chosen per call from the tensors' device), with the same words and tensors:

- torch (the device path and the test oracle): vectorized torch ops only (``index_add_`` of
  shifted 32-bit fields into int64 accumulators); nothing is staged through host memory except
  the per-feature statistics and the metadata.
- numba (CPU tensors): :mod:`torchrec_lossy.distributed.kjt_host` does the statistics and
  deduplication sort, the plan, the packing and the checksums in one compiled call per encode
  (and the decode in one), where tens of small torch ops per call would cost more than the work
  itself.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, NoReturn, Protocol

import numpy as np
import torch
from torch.autograd.profiler import record_function
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.codec.container import segment_checksums, upload
from torchrec_lossy.config import InputDistConfig
from torchrec_lossy.distributed import kjt_host, kjt_layout
from torchrec_lossy.distributed.dedupe import (
    OutputDedupeMode,
    bag_inverse,
    distinct_bags,
    first_bags,
    segment_inverse,
    segment_sort,
)
from torchrec_lossy.distributed.errors import LossyAllToAllError

_WORD_BITS = 32
_MASK32 = (1 << 32) - 1
_HEADER = 3  # metadata words per destination: payload words, batch size, dtype codes
_CHECK_WORDS = 2  # int32 words of the int64 checksum that ends each payload (if on)
_CHECK_FLAG = 1 << 32  # in the dtype-codes word: the payloads end with a checksum
_PER_FEATURE = 3  # metadata words per feature: widths and mode, value count, distinct count
_DTYPES: tuple[torch.dtype | None, ...] = (
    None,
    torch.int32,
    torch.int64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
)
_CODES: dict[torch.dtype | None, int] = {d: i for i, d in enumerate(_DTYPES)}
_WEIGHT_CASTS: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
KJTBackend = Literal["auto", "torch", "numba"]
"""Who does the KJT codec's tensor work: ``"torch"`` (tensor ops on the KJT's device: the device
path and the test oracle), ``"numba"`` (the compiled CPU path of
:mod:`~torchrec_lossy.distributed.kjt_host`, CPU tensors only) or ``"auto"`` (numba for CPU
tensors, torch otherwise). The words and tensors are the same either way."""


def on_host(device: torch.device, backend: KJTBackend) -> bool:
    """Whether the KJT codec runs compiled on the host for tensors on ``device``.

    Args:
        device: Where the KJT (encode) or the received words (decode) live.
        backend: See :data:`KJTBackend`.

    Returns:
        True for the numba path.

    Raises:
        ValueError: If ``backend`` is unknown, or ``"numba"`` for tensors off the CPU.
    """
    if backend == "auto":  # the common case first: this runs on every encode and decode
        return device.type == "cpu"
    if backend not in ("torch", "numba"):
        raise ValueError(f"KJT codec backend {backend!r}: use 'auto', 'torch' or 'numba'")
    if backend == "numba" and device.type != "cpu":
        raise ValueError(
            f"KJT codec backend 'numba' runs on CPU tensors, these are on {device}; use 'auto'"
        )
    return backend == "numba"


# ---------------------------------------------------------------------------------------------
# Bit packing.


def _join_field(parts: Sequence[torch.Tensor], count: int, device: torch.device) -> torch.Tensor:
    """Joins a field's sections (low part, then the high part of values over 32 bits)."""
    if not parts:
        return torch.zeros(count, dtype=torch.int64, device=device)
    if len(parts) == 1:
        return parts[0]
    return parts[0] | (parts[1] << _WORD_BITS)


@dataclass
class _Layout:
    """Bit positions of a sequence of packed sections (host lists, built identically on both ends).

    Attributes:
        counts: Elements per section.
        widths: Bits per element of each section (1..32).
        starts: First bit of each section in the whole buffer.
    """

    counts: list[int]
    widths: list[int]
    starts: list[int]

    def positions(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per element, its width and its first bit (int64 tensors on ``device``)."""
        total = sum(self.counts)
        # Element i of a section starting at element e0 and bit b0 sits at bit
        # b0 + (i - e0) * width: one per-section (width, b0 - e0 * width) pair, repeated.
        firsts = list(itertools.accumulate(self.counts, initial=0))[:-1]
        offsets = [b - e * w for b, e, w in zip(self.starts, firsts, self.widths, strict=True)]
        per_sec = torch.tensor([self.widths, offsets], dtype=torch.int64).view(2, -1)
        counts = torch.tensor(self.counts, dtype=torch.int64)
        w, off = torch.repeat_interleave(per_sec, counts, dim=1, output_size=total)
        return w.to(device), (torch.arange(total) * w + off).to(device)


def pack_bits(
    values: torch.Tensor, widths: torch.Tensor, positions: torch.Tensor, num_words: int
) -> torch.Tensor:
    """Packs each value into ``widths[i]`` bits at bit ``positions[i]`` of an int32 word buffer.

    Fields must not overlap and each value must fit its width (at most 32 bits). Bits are
    little-endian within a word; a field may straddle two words.

    Args:
        values: int64 values in ``[0, 2**widths)``.
        widths: int64 widths, 1..32.
        positions: int64 first bit of each field.
        num_words: Words of the output.

    Returns:
        int32 tensor ``[num_words]`` on the values' device.
    """
    acc = torch.zeros(num_words + 1, dtype=torch.int64, device=values.device)
    if values.numel():
        word = positions >> 5
        off = positions & 31
        # Fields do not overlap, so adding the shifted pieces is the same as OR-ing them.
        acc.index_add_(0, word, (values << off) & _MASK32)
        acc.index_add_(0, word + 1, values >> (_WORD_BITS - off))
    acc = acc[:num_words]
    return torch.where(acc >= 1 << 31, acc - (1 << 32), acc).to(torch.int32)


def unpack_bits(words: torch.Tensor, widths: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bits`.

    Args:
        words: int32 word buffer.
        widths: int64 widths, 1..32.
        positions: int64 first bit of each field.

    Returns:
        int64 values.
    """
    u = torch.cat([words.to(torch.int64) & _MASK32, words.new_zeros(1, dtype=torch.int64)])
    word = positions >> 5
    off = positions & 31
    lo = u[word] >> off
    # Only the next word's low ``off`` bits belong to the field: masking first avoids overflow.
    hi = (u[word + 1] & ((1 << off) - 1)) << (_WORD_BITS - off)
    return (lo | hi) & ((1 << widths) - 1)


# ---------------------------------------------------------------------------------------------
# Per-feature format.


class FeatureMeta(NamedTuple):
    """What the receiver needs to unpack one feature from one source.

    A named tuple (its fields are ``kjt_layout.FORMAT_COLUMNS``): the codec passes every
    feature's format to its compiled planner as one array, ``np.array`` of these tuples.

    Attributes:
        len_bits: Bits per length.
        id_bits: Bits per id (of the distinct ids when deduplicated).
        dedupe: Ids travel as distinct ids plus an inverse index.
        num_ids: Ids (values) of the feature as the receiver gets them.
        num_unique: Distinct ids (0 when not deduplicated).
        lookup: Cross-side dedupe of a single-hot feature: only the distinct ids travel (the
            inverse index stays with the sender) and the receiver gets ``num_unique`` bags of
            one id followed by empty bags (see :class:`OutputDedupe`).
        out_rows: Exact output dedupe (0: off): the feature's bags hold at most one id and no
            weights, and the owner sends back only the first bag of each of these many distinct
            bags (ids, and one empty bag if any); the KJT itself travels whole.
    """

    len_bits: int
    id_bits: int
    dedupe: bool
    num_ids: int
    num_unique: int
    lookup: bool = False
    out_rows: int = 0

    @staticmethod
    def from_words(w: Sequence[int]) -> FeatureMeta:
        """A feature's format from its three metadata words (as ``kjt_layout`` writes them:
        widths and flags, ids, distinct ids)."""
        return FeatureMeta(
            w[0] & 0xFF,
            (w[0] >> 8) & 0xFF,
            bool(w[0] >> 16 & 1),
            w[1],
            w[2],
            bool(w[0] >> 17 & 1),
            w[0] >> 32,
        )


def _weight_words(num: int, dtype: torch.dtype) -> int:
    return -(-num * torch.empty(0, dtype=dtype).element_size() // 4)


def _words_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as int32 words (zero-padded to a multiple of 4 bytes)."""
    b = t.contiguous().view(-1).view(torch.uint8)
    pad = -b.numel() % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return b.view(torch.int32)


def meta_words(num_features: int) -> int:
    """Metadata words (int64) of one destination that receives ``num_features`` features."""
    return _HEADER + _PER_FEATURE * num_features


class SourceMeta(NamedTuple):
    """One source's metadata row as the receiver reads it (see :func:`parse_meta`).

    Attributes:
        payload_words: int32 words of the source's payload.
        batch: The source's batch size (KJT stride).
        codes: Its dtype codes (pass on to :func:`decode_kjt`).
        features: Per received feature, its format.
    """

    payload_words: int
    batch: int
    codes: int
    features: list[FeatureMeta]


def parse_meta(row: Sequence[int], num_features: int) -> SourceMeta:
    """Reads one source's metadata row (``meta_words(num_features)`` int64 words).

    Args:
        row: The row, as host ints.
        num_features: Features the receiver gets from the source.

    Returns:
        The row's fields.
    """
    features = [
        FeatureMeta.from_words(row[_HEADER + i * _PER_FEATURE : _HEADER + (i + 1) * _PER_FEATURE])
        for i in range(num_features)
    ]
    return SourceMeta(row[0], row[1], row[2], features)


# ---------------------------------------------------------------------------------------------
# Checksum words: the codec's checksum (torchrec_lossy.codec.segment_checksums) over each
# payload; _write_checksums and _stored_checksums only place its words.


def payload_checksums(words: torch.Tensor, seg_words: Sequence[int]) -> torch.Tensor:
    """The codec's checksum (``torchrec_lossy.codec.segment_checksums``) of each payload, its
    last ``_CHECK_WORDS`` words left out.

    Args:
        words: int32 buffer holding the payloads back to back.
        seg_words: Words of each payload (checksum words included).

    Returns:
        int64 checksum per payload.
    """
    if not seg_words:
        return torch.zeros(0, dtype=torch.int64, device=words.device)
    starts = list(itertools.accumulate(seg_words, initial=0))[:-1]
    lengths = [max(n - _CHECK_WORDS, 0) for n in seg_words]
    starts_t, lengths_t = upload([starts, lengths], words.device)
    return segment_checksums(words, starts_t, lengths_t)


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 values as int32 (two's complement)."""
    x = x & _MASK32
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _write_checksums(send: torch.Tensor, send_words: Sequence[int]) -> None:
    """Fills the last two words of every payload with its checksum (low, high part)."""
    if not send_words:
        return
    sums = payload_checksums(send, send_words)
    ends = torch.tensor(list(itertools.accumulate(send_words)), device=send.device)
    send[ends - 2] = _as_int32(sums)
    send[ends - 1] = _as_int32(sums >> _WORD_BITS)


def _stored_checksums(recv: torch.Tensor, recv_words: Sequence[int]) -> torch.Tensor:
    """The checksums at the end of each received payload (inverse of :func:`_write_checksums`)."""
    ends = torch.tensor(list(itertools.accumulate(recv_words)), device=recv.device)
    lo = recv[ends - 2].to(torch.int64) & _MASK32
    return lo | (recv[ends - 1].to(torch.int64) << _WORD_BITS)


# ---------------------------------------------------------------------------------------------
# Encode.


@dataclass
class EncodedKJT:
    """One rank's KJT packed for every destination (the result of :func:`encode_kjt`).

    Attributes:
        send: int32 words, the payloads in destination order.
        send_words: Words of each destination's payload.
        meta: int64 metadata rows, destinations in order (see :func:`parse_meta`).
        meta_splits: Words of each destination's metadata row.
        num_ids_per_dest: Ids sent to each destination (TorchRec's ``values`` splits).
        expand: Per destination, per feature sent there: (rows the owner sends back, inverse
            index mapping this rank's bags to them) of output-deduplicated features, None for
            the others.
        formats: int64 ``[F, 7]``: per feature (the KJT's key order), its format
            (``kjt_layout.FORMAT_COLUMNS``; :attr:`features` as :class:`FeatureMeta`).
        feature_stats: Per feature, its statistics (length sum, max, min; id max, min;
            distinct ids) as host ints.
        feature_bytes: Per feature, its wire bytes (its packed bits rounded down to bytes, plus
            its weights), as the telemetry counts them.
        wire_weights: dtype the weights travel in (None: unweighted).
    """

    send: torch.Tensor
    send_words: list[int]
    meta: torch.Tensor
    meta_splits: list[int]
    num_ids_per_dest: list[int]
    expand: list[list[tuple[int, torch.Tensor] | None]]
    formats: np.ndarray
    feature_stats: list[list[int]]
    feature_bytes: list[int]
    wire_weights: torch.dtype | None

    @property
    def features(self) -> list[FeatureMeta]:
        """Per feature (the KJT's key order), its format (built on demand from :attr:`formats`:
        the input dist itself reads the array)."""
        return [
            FeatureMeta(a, b, bool(c), d, e, bool(f), g)
            for a, b, c, d, e, f, g in self.formats.tolist()
        ]


@dataclass
class _FeatureStats:
    """Per-feature statistics of one KJT and the sort its id deduplications need.

    Attributes:
        stats: ``[F, 6]`` (length sum, max, min; id max, min; distinct ids), read once on the
            host.
        seg: Feature of every id.
        ids: (order, first-occurrence mask) of the (feature, id) sort, if asked for.
    """

    stats: torch.Tensor
    seg: torch.Tensor
    ids: tuple[torch.Tensor, torch.Tensor] | None


def _feature_stats(
    lengths: torch.Tensor, values: torch.Tensor, num_features: int, batch: int, dedupe: bool
) -> _FeatureStats:
    """Per-feature statistics in one tensor (read once on the host), plus the dedupe sort.

    Args:
        lengths: The KJT's lengths, ``[F * batch]``.
        values: Its ids.
        num_features: F.
        batch: Its stride.
        dedupe: Also count distinct ids and keep the sort that found them.

    Returns:
        The statistics (zero distinct counts without ``dedupe``).
    """
    dev = values.device
    lens = lengths.to(torch.int64).view(num_features, batch)
    zeros = torch.zeros(num_features, dtype=torch.int64, device=dev)
    if batch:
        len_sum, len_max, len_min = lens.sum(1), lens.amax(1), lens.amin(1)
    else:
        len_sum, len_max, len_min = zeros, zeros, zeros
    v = values.to(torch.int64)
    seg = torch.repeat_interleave(
        torch.arange(num_features, device=dev), len_sum, output_size=v.numel()
    )
    id_max = zeros.scatter_reduce(0, seg, v, "amax", include_self=False)
    id_min = zeros.scatter_reduce(0, seg, v, "amin", include_self=False)
    num_unique = zeros
    ids = None
    if dedupe:
        # On the host the bound of the keys costs nothing (on a GPU it would be one more sync).
        bound = None
        if dev.type == "cpu" and v.numel():
            lo, hi = torch.aminmax(v)
            bound = int(hi) + 1 if int(lo) >= 0 else None
        order, new = segment_sort(v, seg, bound, num_features)
        num_unique = zeros.scatter_add(0, seg[order], new.to(torch.int64))
        ids = (order, new)
    stats = torch.stack([len_sum, len_max, len_min, id_max, id_min, num_unique], dim=1)
    return _FeatureStats(stats, seg, ids)


@dataclass(frozen=True)
class _EncodeCall:
    """One :func:`encode_kjt` call's input, as either backend takes it.

    Attributes:
        keys: The KJT's keys.
        batch: Its stride.
        lens: Its lengths as int64.
        ids: Its ids as int64.
        weights: Its weights (None: unweighted).
        wire_w: Their dtype on the wire (None: unweighted).
        feat_off: int64 ``[P + 1]``: each destination's first feature, then F.
        want_dedupe: Find each feature's distinct ids (wire or output dedupe).
        opts: The plan's options (wire and output dedupe, weights, checksum, dtype codes).
    """

    keys: Sequence[str]
    batch: int
    lens: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor | None
    wire_w: torch.dtype | None
    feat_off: np.ndarray
    want_dedupe: bool
    opts: kjt_layout.PlanOptions


class _Packed(NamedTuple):
    """What a backend's encode gives :func:`encode_kjt`.

    Attributes:
        plan: The payloads' plan (``kjt_layout.plan_encode``).
        send: int32 words of all payloads.
        uniques: Every feature's distinct ids (None if no feature needed them).
        inverse: Per id, the index of its distinct id in its feature (idem).
    """

    plan: kjt_layout.EncodePlan
    send: torch.Tensor
    uniques: torch.Tensor | None
    inverse: torch.Tensor | None


def encode_kjt(
    kjt: KeyedJaggedTensor,
    splits: Sequence[int],
    config: InputDistConfig,
    output_dedupe: OutputDedupeMode = None,
    backend: KJTBackend = "auto",
) -> EncodedKJT:
    """Packs one rank's KJT for every destination (features ordered by destination).

    Args:
        kjt: This rank's KJT.
        splits: Features per destination.
        config: The input dist's config (wire dedupe, weight cast, checksum).
        output_dedupe: Cross-side dedupe of features whose bags hold at most one id and no
            weights, where some bags repeat (see ``dedupe.OutputDedupe``): ``"exact"`` keeps the
            KJT whole and marks the feature's distinct bags (``FeatureMeta.out_rows``);
            ``"lookup"`` sends only the distinct ids of single-hot features
            (``FeatureMeta.lookup``). Either way the inverse index stays in the result.
        backend: Who does the tensor work (see :data:`KJTBackend`); the words are the same.

    Returns:
        The payloads and metadata.

    Raises:
        ValueError: If a length or an id is negative, or the backend does not fit the KJT.
    """
    lengths, values, weights = kjt.lengths(), kjt.values(), kjt.weights_or_none()
    # The backend, chosen once: both take the same call and give the same words.
    pack = _pack_numba if on_host(values.device, backend) else _pack_torch
    wire_w = None if weights is None else _WEIGHT_CASTS.get(config.weights, weights.dtype)
    feat_off, meta_splits = _split_offsets(tuple(splits))
    call = _EncodeCall(
        keys=kjt.keys(),
        batch=kjt.stride(),
        lens=lengths.to(torch.int64),
        ids=values.to(torch.int64),
        weights=weights,
        wire_w=wire_w,
        feat_off=feat_off,
        want_dedupe=config.dedupe or output_dedupe is not None,
        opts=kjt_layout.PlanOptions(
            dedupe=config.dedupe,
            mode=_OUT_MODES[output_dedupe],
            wire_esize=wire_w.itemsize if wire_w is not None else 0,
            checksum=config.checksum,
            codes=_dtype_codes(lengths, values, weights, wire_w, config.checksum),
        ),
    )
    plan, send, _, inverse = pack(call)
    stats_rows = plan.stats.tolist()
    return EncodedKJT(
        send=send,
        send_words=plan.payloads[:, 2].tolist(),
        meta=torch.from_numpy(plan.meta).to(values.device),
        meta_splits=meta_splits,
        num_ids_per_dest=plan.payloads[:, 1].tolist(),
        expand=_expand_rows(call, plan, stats_rows, inverse),
        formats=plan.formats,
        feature_stats=stats_rows,
        feature_bytes=plan.feature_bytes.tolist(),
        wire_weights=wire_w,
    )


def _dtype_codes(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    wire_w: torch.dtype | None,
    checksum: bool,
) -> int:
    """The metadata's dtype codes word: the KJT's dtypes, the weights' wire dtype, the checksum.

    Args:
        lengths: The KJT's lengths.
        values: Its ids.
        weights: Its weights (None: unweighted).
        wire_w: Their dtype on the wire.
        checksum: The payloads end with a checksum.

    Returns:
        The word.
    """
    return (
        _CODES[lengths.dtype]
        | _CODES[values.dtype] << 8
        | _CODES[weights.dtype if weights is not None else None] << 16
        | _CODES[wire_w] << 24
        | (_CHECK_FLAG if checksum else 0)
    )


def _expand_rows(
    call: _EncodeCall,
    plan: kjt_layout.EncodePlan,
    stats_rows: Sequence[Sequence[int]],
    inverse: torch.Tensor | None,
) -> list[list[tuple[int, torch.Tensor] | None]]:
    """:attr:`EncodedKJT.expand`: per destination, per feature, (rows the owner sends back,
    inverse index of this rank's bags into them) of output-deduplicated features, else None.

    Args:
        call: The encode's input.
        plan: Its plan.
        stats_rows: Per feature its statistics, as host ints.
        inverse: Per id, the index of its distinct id in its feature (None if not found).

    Returns:
        The rows.
    """
    val_off = plan.starts[kjt_layout.IDS].tolist()
    offsets = call.feat_off.tolist()
    # Per feature: lookup, distinct ids, exact output dedupe rows.
    kinds = plan.formats[:, [5, 4, 6]].tolist()
    expand: list[list[tuple[int, torch.Tensor] | None]] = []
    for d in range(len(offsets) - 1):
        row: list[tuple[int, torch.Tensor] | None] = []
        for f in range(offsets[d], offsets[d + 1]):
            lookup, num_unique, out_rows = kinds[f]
            if lookup:
                assert inverse is not None
                row.append((num_unique, inverse[val_off[f] : val_off[f + 1]]))
            elif out_rows:
                bag_inv = bag_inverse(f, stats_rows[f], call.batch, call.lens, inverse, val_off)
                row.append((out_rows, bag_inv))
            else:
                row.append(None)
        expand.append(row)
    return expand


_OUT_MODES: dict[OutputDedupeMode, int] = {
    None: kjt_layout.OUT_NONE,
    "exact": kjt_layout.OUT_EXACT,
    "lookup": kjt_layout.OUT_LOOKUP,
}


@functools.lru_cache(maxsize=64)
def _split_offsets(splits: tuple[int, ...]) -> tuple[np.ndarray, list[int]]:
    """Each destination's (or source's) first feature (then F) and its metadata words (cached:
    the splits of an input dist do not change)."""
    offsets = np.array(list(itertools.accumulate(splits, initial=0)), np.int64)
    offsets.flags.writeable = False  # shared by every call with these splits
    return offsets, [meta_words(n) for n in splits]


def _refuse_negative(keys: Sequence[str], stats: Sequence[Sequence[int]]) -> None:
    """Raises for the first feature with a negative length or id.

    Args:
        keys: The KJT's keys.
        stats: Per feature its statistics (length sum, max, min; id max, min; ...).

    Raises:
        ValueError: If a length or an id is negative.
    """
    for key, st in zip(keys, stats, strict=True):
        if st[2] < 0 or st[4] < 0:
            raise ValueError(
                f"lossy input dist: feature {key!r} has a negative "
                f"{'length' if st[2] < 0 else 'id'}; KJT lengths and ids must be >= 0"
            )


def _pack_numba(call: _EncodeCall) -> _Packed:
    """The numba backend's encode: statistics, plan and packing in one compiled call
    (``kjt_host.encode``).

    Args:
        call: The encode's input (CPU tensors).

    Returns:
        The plan and the payloads.

    Raises:
        ValueError: If the lengths do not sum to the ids, or a length or an id is negative.
    """
    weights = call.weights.to(call.wire_w) if call.weights is not None else None
    out = kjt_host.encode(
        call.lens, call.ids, weights, call.batch, call.feat_off, call.want_dedupe, call.opts
    )
    if not isinstance(out, kjt_host.HostEncoded):
        why, stats = out
        if why == kjt_host.BAD_SUM:
            raise ValueError(
                f"lossy input dist: the KJT's lengths sum to {int(stats[:, 0].sum())} but "
                f"it holds {call.ids.numel()} ids; pass a KJT whose lengths match its values"
            )
        _refuse_negative(call.keys, stats.tolist())
    return _Packed(*out)


def _pack_torch(call: _EncodeCall) -> _Packed:
    """The torch backend's encode, by tensor ops on the KJT's device: the statistics (one host
    read), the plan (``kjt_layout.plan_encode``), the distinct ids, the packing.

    Args:
        call: The encode's input.

    Returns:
        The plan and the payloads.

    Raises:
        ValueError: If a length or an id is negative.
    """
    fs = _feature_stats(call.lens, call.ids, len(call.keys), call.batch, call.want_dedupe)
    stats = fs.stats.cpu().numpy()  # the host read of the encoder
    _refuse_negative(call.keys, stats.tolist())
    plan = kjt_layout.plan_encode(stats, call.batch, call.feat_off, call.opts)
    inverse = uniques = None
    if plan.formats[:, [2, 6]].any():  # wire or output dedupe (a lookup feature's too)
        assert fs.ids is not None
        order, new = fs.ids
        inverse = segment_inverse(order, new, fs.seg, fs.stats[:, 5])
        uniques = call.ids[order][new]
    return _Packed(plan, _pack_words(plan, call, uniques, inverse), uniques, inverse)


def _pack_words(
    plan: kjt_layout.EncodePlan,
    call: _EncodeCall,
    uniques: torch.Tensor | None,
    inverse: torch.Tensor | None,
) -> torch.Tensor:
    """The torch backend's payloads: every section packed (:func:`pack_bits`), the weights'
    bytes, the checksums (what ``kjt_host.encode`` packs on the host).

    Args:
        plan: The payloads' plan.
        call: The encode's input.
        uniques: Every feature's distinct ids (None if no feature is deduplicated).
        inverse: Per id, the index of its distinct id in its feature (idem).

    Returns:
        int32 words of all payloads.
    """
    # Indexed by kjt_layout.LENGTHS, IDS, UNIQUE, INVERSE.
    sources = (call.lens, call.ids, uniques, inverse)
    starts = plan.starts.tolist()
    sections = plan.sections.tolist()
    parts: list[torch.Tensor] = []
    for feature, field, count, width, shift, _ in sections:
        src = sources[field]
        assert src is not None
        a = starts[field][feature]
        t = src[a : a + count]
        # Values over 32 bits travel as two parts; narrower ones fit as they are.
        parts.append(t >> shift if shift else t & _MASK32 if width == 32 else t)
    layout = _Layout([s[2] for s in sections], [s[3] for s in sections], [s[5] for s in sections])
    w_t, p_t = layout.positions(call.ids.device)
    flat = torch.cat(parts) if parts else call.ids.new_empty(0)
    send_words = plan.payloads[:, 2].tolist()
    send = pack_bits(flat, w_t, p_t, sum(send_words))
    if call.weights is not None:
        val_off = starts[kjt_layout.IDS]
        feat_off = call.feat_off.tolist()
        for (at, _, _), f0, f1 in zip(plan.payloads.tolist(), feat_off, feat_off[1:], strict=False):
            ww = _words_of(call.weights[val_off[f0] : val_off[f1]].to(call.wire_w))
            send[at : at + ww.numel()] = ww
    if call.opts.checksum:
        _write_checksums(send, send_words)
    return send


# ---------------------------------------------------------------------------------------------
# Decode.


class DecodedKJT(NamedTuple):
    """The receiver's tensors (the result of :func:`decode_kjt`).

    Attributes:
        lengths: TorchRec's lengths of the local KJT (sources then features, as ``dist_init``).
        values: Its ids.
        weights: Its weights (None if unweighted).
        selects: Per source, per feature, the bags whose pooled rows the exact output dedupe
            sends back (None where not deduplicated).
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    selects: list[list[torch.Tensor | None]]


def decode_kjt(
    recv: torch.Tensor,
    recv_words: Sequence[int],
    metas_per_src: Sequence[Sequence[FeatureMeta]],
    batch_per_src: Sequence[int],
    codes: Sequence[int],
    keys: Sequence[str],
    my_rank: int,
    backend: KJTBackend = "auto",
) -> DecodedKJT:
    """Unpacks every source's payload into TorchRec's (lengths, values, weights) output tensors.

    Args:
        recv: int32 words: every source's payload, back to back in source order.
        recv_words: Words from each source.
        metas_per_src: Per source, per received feature, its format (:func:`parse_meta`).
        batch_per_src: Batch size of every source.
        codes: Per source, its dtype codes (all equal).
        keys: The received features' keys (for error messages).
        my_rank: This rank (for error messages).
        backend: Who does the tensor work (see :data:`KJTBackend`); the tensors are the same.

    Returns:
        The tensors and the exact output dedupe's bag selection.

    Raises:
        LossyAllToAllError: If the sources' dtypes differ, or a payload does not match its
            metadata or checksum.
    """
    # The backend, chosen once: both take the same call and give the same tensors.
    unpack = _unpack_numba if on_host(recv.device, backend) else _unpack_torch
    if any(c != codes[0] for c in codes):
        raise LossyAllToAllError(
            f"lossy input dist on rank {my_rank}: source ranks sent KJTs of different dtypes "
            f"(codes {codes}); every rank must feed the same lengths/values/weights dtypes"
        )
    code = codes[0] if codes else _CODES[torch.int64] | _CODES[torch.int64] << 8

    def fail(src: int, why: str) -> NoReturn:
        raise LossyAllToAllError(
            f"lossy input dist on rank {my_rank}: the KJT payload from rank {src} (features: "
            f"{', '.join(keys) or 'none'}) does not match its metadata: {why}. The ranks run "
            "different torchrec_lossy versions or sharding plans, or the bytes were corrupted."
        )

    wire_w = _DTYPES[code >> 24 & 0xFF]
    call = _DecodeCall(
        recv=recv,
        recv_words=recv_words,
        metas_per_src=metas_per_src,
        batch_per_src=batch_per_src,
        # Every source's formats in one array for the compiled planner (FeatureMeta is a tuple).
        formats=np.array([m for metas in metas_per_src for m in metas], np.int64).reshape(
            -1, len(kjt_layout.FORMAT_COLUMNS)
        ),
        feat_off=_split_offsets(tuple(map(len, metas_per_src)))[0],
        esize=wire_w.itemsize if wire_w is not None else 0,
        trailer=bool(code & _CHECK_FLAG),
        fail=fail,
    )
    lengths, values, payloads, selects = unpack(call)
    len_dtype, val_dtype = _DTYPES[code & 0xFF], _DTYPES[code >> 8 & 0xFF]
    assert len_dtype is not None and val_dtype is not None
    weights = _decode_weights(recv, payloads, _DTYPES[code >> 16 & 0xFF], wire_w)
    return DecodedKJT(lengths.to(len_dtype), values.to(val_dtype), weights, selects)


class _Fail(Protocol):
    """Raises :func:`decode_kjt`'s error for a source's payload."""

    def __call__(self, src: int, why: str) -> NoReturn: ...


@dataclass(frozen=True)
class _DecodeCall:
    """One :func:`decode_kjt` call's input, as either backend takes it.

    Attributes:
        recv: int32 words: every source's payload, back to back in source order.
        recv_words: Words from each source.
        metas_per_src: Per source, per received feature, its format.
        batch_per_src: Batch size of every source.
        formats: int64 ``[F, 7]``: the same formats, sources in order
            (``kjt_layout.FORMAT_COLUMNS``).
        feat_off: int64 ``[P + 1]``: each source's first feature, then F.
        esize: Bytes of a weight on the wire (0: unweighted).
        trailer: The payloads end with a checksum.
        fail: Raises the decode's error for a source.
    """

    recv: torch.Tensor
    recv_words: Sequence[int]
    metas_per_src: Sequence[Sequence[FeatureMeta]]
    batch_per_src: Sequence[int]
    formats: np.ndarray
    feat_off: np.ndarray
    esize: int
    trailer: bool
    fail: _Fail

    def no_selects(self) -> list[list[torch.Tensor | None]]:
        """Per source, per feature, None: the bag selection before the output dedupe's."""
        return [[None] * len(m) for m in self.metas_per_src]


class _Unpacked(NamedTuple):
    """What a backend's decode gives :func:`decode_kjt`.

    Attributes:
        lengths: int64 bag lengths of every source's features.
        values: int64 ids of them.
        payloads: ``[P, 3]`` (``kjt_layout.PAYLOAD_COLUMNS``).
        selects: Per source, per feature, the first bags of the exact output dedupe (None
            where not deduplicated).
    """

    lengths: torch.Tensor
    values: torch.Tensor
    payloads: np.ndarray
    selects: list[list[torch.Tensor | None]]


def _decode_weights(
    recv: torch.Tensor,
    payloads: np.ndarray,
    w_dtype: torch.dtype | None,
    wire_w: torch.dtype | None,
) -> torch.Tensor | None:
    """The received weights of every source, in the senders' dtype.

    Args:
        recv: The payloads' words.
        payloads: ``[P, 3]`` (``kjt_layout.PAYLOAD_COLUMNS``).
        w_dtype: The senders' weights dtype (None: unweighted).
        wire_w: Their dtype on the wire.

    Returns:
        The weights, or None if unweighted.
    """
    if w_dtype is None:
        return None
    assert wire_w is not None
    weights: list[torch.Tensor] = []
    for weights_at, num_ids, _ in payloads.tolist():
        nw = _weight_words(num_ids, wire_w)
        raw = recv[weights_at : weights_at + nw].view(torch.uint8).clone()  # aligned
        weights.append(raw[: num_ids * wire_w.itemsize].view(wire_w))
    return torch.cat(weights).to(w_dtype) if weights else recv.new_empty(0, dtype=w_dtype)


def _unpack_numba(call: _DecodeCall) -> _Unpacked:
    """The numba backend's decode: plan, checksums, unpacking and first bags in one compiled
    call (``kjt_host.decode``).

    Args:
        call: The decode's input (CPU words).

    Returns:
        The lengths, ids, payload layout and bag selection.

    Raises:
        LossyAllToAllError: If a payload does not match its metadata or checksum.
    """
    out = kjt_host.decode(
        call.recv, np.array(call.recv_words, np.int64), call.trailer, call.formats,
        call.feat_off, np.array(call.batch_per_src, np.int64), call.esize,
    )  # fmt: skip
    _refuse(call.fail, out.refusal)
    selects = call.no_selects()
    for (src, f), first in zip(out.segments, out.first_bags, strict=True):
        selects[src][f] = first
    return _Unpacked(out.lengths, out.values, out.payloads, selects)


# Why a payload was refused (kjt_layout.Refusal's reasons), given its ``a`` and ``b``.
_WHY = {
    kjt_layout.BAD_LOOKUP: "{a} distinct single-hot ids for a batch of {b}",
    kjt_layout.BAD_BITS: "{a}-bit fields (at most 64)",
    kjt_layout.BAD_COUNT: "a negative batch size or id count",
    kjt_layout.BAD_WORDS: "{a} words received, {b} expected",
    kjt_layout.BAD_CHECKSUM: "its checksum does not match (corrupted in transit)",
    kjt_layout.BAD_LENGTHS: "feature {a} of the payload: its lengths do not sum to its ids",
    kjt_layout.BAD_INVERSE: (
        "feature {a} of the payload: its inverse index points past its distinct ids"
    ),
    kjt_layout.BAD_ROWS: "{a} distinct bags in a deduplicated feature, {b} sent",
}


def _refuse(fail: _Fail, refusal: kjt_layout.Refusal) -> None:
    """Raises the decode's error for a refused payload (nothing if none was).

    Args:
        fail: Raises the decode's error.
        refusal: The planner's or the compiled decode's verdict.
    """
    if refusal.source >= 0:
        fail(refusal.source, _WHY[refusal.why].format(a=refusal.a, b=refusal.b))


def _check_sums(fail: _Fail, ok: Sequence[bool]) -> None:
    """Fails on the first source whose checksum does not match.

    Args:
        fail: Raises the decode's error.
        ok: Per source, whether its checksum matches.
    """
    for src, good in enumerate(ok):
        if not good:
            _refuse(fail, kjt_layout.Refusal(src, kjt_layout.BAD_CHECKSUM, 0, 0))


def _unpack_torch(call: _DecodeCall) -> _Unpacked:
    """The torch backend's decode, by tensor ops on the words' device: the plan
    (``kjt_layout.plan_decode``), the checksums (one host read), the unpacking
    (:func:`unpack_bits`), the first bags of the exact output dedupe.

    Args:
        call: The decode's input.

    Returns:
        The lengths, ids, payload layout and bag selection.

    Raises:
        LossyAllToAllError: If a payload does not match its metadata or checksum.
    """
    recv, recv_words = call.recv, call.recv_words
    plan = kjt_layout.plan_decode(
        call.formats, call.feat_off, np.array(call.batch_per_src, np.int64),
        np.array(recv_words, np.int64), call.esize, call.trailer,
    )  # fmt: skip
    _refuse(call.fail, plan.refusal)
    if call.trailer:
        # One host read for all sources; the sizes are known to be right by now.
        ok = payload_checksums(recv, recv_words) == _stored_checksums(recv, recv_words)
        _check_sums(call.fail, ok.tolist())
    features = _Features.unpack(call, _unpack_fields(recv, plan.sections))
    empty = recv.new_empty(0, dtype=torch.int64)
    return _Unpacked(
        torch.cat(features.lengths) if features.lengths else empty,
        torch.cat(features.values) if features.values else empty,
        plan.payloads,
        features.selects(call),
    )


def _unpack_fields(
    recv: torch.Tensor, sections: np.ndarray
) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Every section of the payloads, unpacked (:func:`unpack_bits`).

    Args:
        recv: The payloads' words.
        sections: Their sections (``kjt_layout.plan_decode``).

    Returns:
        Per (feature row, field), its sections' int64 values (low part, then high part).
    """
    rows = sections.tolist()
    layout = _Layout([r[2] for r in rows], [r[3] for r in rows], [r[5] for r in rows])
    flat = unpack_bits(recv, *layout.positions(recv.device))
    unpacked = torch.split(flat, [r[2] for r in rows]) if rows else []
    fields: dict[tuple[int, int], list[torch.Tensor]] = {}
    for (feature, field, *_), part in zip(rows, unpacked, strict=True):
        fields.setdefault((feature, field), []).append(part)
    return fields


@dataclass
class _Features:
    """The torch backend's decoded features, and those the exact output dedupe selects bags of.

    Attributes:
        lengths: Per feature row (over all sources), its int64 lengths.
        values: Per feature row, its int64 ids.
        by_inverse: (source, row, rows sent back, inverse index, distinct ids) of the
            output-deduplicated features whose ids arrived deduplicated: their distinct bags
            follow from the inverse index, no sort needed.
        by_sort: (source, row, rows sent back, id bits) of the other output-deduplicated
            features (the receiver sorts their bags).
    """

    lengths: list[torch.Tensor] = dataclasses.field(default_factory=list)
    values: list[torch.Tensor] = dataclasses.field(default_factory=list)
    by_inverse: list[tuple[int, int, int, torch.Tensor, int]] = dataclasses.field(
        default_factory=list
    )
    by_sort: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)

    @staticmethod
    def unpack(call: _DecodeCall, fields: dict[tuple[int, int], list[torch.Tensor]]) -> _Features:
        """Every source's features from their unpacked fields.

        Args:
            call: The decode's input.
            fields: Per (feature row, field), its sections' values (:func:`_unpack_fields`).

        Returns:
            The features.
        """
        out = _Features()
        dev = call.recv.device
        for src, (metas, batch) in enumerate(
            zip(call.metas_per_src, call.batch_per_src, strict=True)
        ):
            for m in metas:
                row = len(out.lengths)  # the feature's row, over all sources

                def get(name: int, n: int, row: int = row) -> torch.Tensor:
                    return _join_field(fields.get((row, name), []), n, dev)

                if m.lookup:
                    ones = torch.ones(m.num_unique, dtype=torch.int64, device=dev)
                    out.lengths.append(torch.cat([ones, ones.new_zeros(batch - m.num_unique)]))
                    out.values.append(get(kjt_layout.UNIQUE, m.num_unique))
                    continue
                out.lengths.append(get(kjt_layout.LENGTHS, batch))
                if m.dedupe:
                    inv = get(kjt_layout.INVERSE, m.num_ids)
                    out.values.append(get(kjt_layout.UNIQUE, m.num_unique)[inv])
                else:
                    inv = None if m.num_ids else torch.empty(0, dtype=torch.int64, device=dev)
                    out.values.append(get(kjt_layout.IDS, m.num_ids))
                if m.out_rows and inv is not None:
                    out.by_inverse.append((src, row, m.out_rows, inv, m.num_unique))
                elif m.out_rows:
                    out.by_sort.append((src, row, m.out_rows, m.id_bits))
        return out

    def selects(self, call: _DecodeCall) -> list[list[torch.Tensor | None]]:
        """The exact output dedupe's bag selection: per source, per feature, the first bag of
        each distinct bag (None where not deduplicated).

        Args:
            call: The decode's input.

        Returns:
            The selection.

        Raises:
            LossyAllToAllError: If a feature's distinct bags are not the rows it sends back.
        """
        firsts: list[torch.Tensor] = []
        with record_function("## lossy_input dedupe select ##"):
            if self.by_inverse:
                firsts += first_bags(
                    [self.lengths[i] for _, i, _, _, _ in self.by_inverse],
                    [inv for _, _, _, inv, _ in self.by_inverse],
                    [u for _, _, _, _, u in self.by_inverse],
                )
            if self.by_sort:
                firsts += distinct_bags(
                    [self.lengths[i] for _, i, _, _ in self.by_sort],
                    [self.values[i] for _, i, _, _ in self.by_sort],
                    max(1 << b for *_, b in self.by_sort),
                    with_inverse=False,
                )[2]
        selects = call.no_selects()
        segs = [x[:3] for x in self.by_inverse] + [x[:3] for x in self.by_sort]
        for (src, i, rows_sent), first in zip(segs, firsts, strict=True):
            local = i - sum(len(m) for m in call.metas_per_src[:src])
            if first.numel() != rows_sent:
                why = kjt_layout.Refusal(src, kjt_layout.BAD_ROWS, first.numel(), rows_sent)
                _refuse(call.fail, why)
            selects[src][local] = first
        return selects


@functools.cache
def warm_up_host() -> None:
    """Loads the numba path's kernels now (once per process) by encoding and decoding a tiny KJT.

    Numba's first call in a process costs about 0.1 s even from its on-disk cache (and compiles
    the kernels on the first run after an install or an edit); the input dist calls this when
    it is built, so that the cost is not paid by the first training step.
    """
    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([3, 1, 3]), lengths=torch.tensor([1, 1, 1])
    )
    # Single-hot with a repeat: the deduplication sort, packing, checksums, the first bags.
    enc = encode_kjt(kjt, [1], InputDistConfig(), "exact", backend="numba")
    row = parse_meta(enc.meta.tolist(), 1)
    decode_kjt(
        enc.send, enc.send_words, [row.features], [row.batch], [row.codes], ["f"], 0, "numba"
    )
