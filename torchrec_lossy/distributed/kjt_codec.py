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

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, NoReturn, Protocol

import numpy as np
import torch
from torch.autograd.profiler import record_function
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.codec import segment_checksums
from torchrec_lossy.codec.container import upload
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
    keys = kjt.keys()
    batch = kjt.stride()
    lengths, values, weights = kjt.lengths(), kjt.values(), kjt.weights_or_none()
    dev = values.device
    host = on_host(dev, backend)
    want_dedupe = config.dedupe or output_dedupe is not None
    wire_w = None
    if weights is not None:
        wire_w = _WEIGHT_CASTS.get(config.weights, weights.dtype)
    codes = (
        _CODES[lengths.dtype]
        | _CODES[values.dtype] << 8
        | _CODES[weights.dtype if weights is not None else None] << 16
        | _CODES[wire_w] << 24
        | (_CHECK_FLAG if config.checksum else 0)
    )
    feat_off, meta_splits = _split_offsets(tuple(splits))
    mode = _OUT_MODES[output_dedupe]
    v = values.to(torch.int64)
    lens = lengths.to(torch.int64)
    if host:
        out = kjt_host.encode(
            lens, v, weights.to(wire_w) if weights is not None else None, batch, feat_off,
            want_dedupe, config.dedupe, mode, config.checksum, codes,
        )  # fmt: skip
        if not isinstance(out, kjt_host.HostEncoded):
            why, stats = out
            if why == kjt_host.BAD_SUM:
                raise ValueError(
                    f"lossy input dist: the KJT's lengths sum to {int(stats[:, 0].sum())} but "
                    f"it holds {v.numel()} ids; pass a KJT whose lengths match its values"
                )
            _refuse_negative(keys, stats.tolist())
        plan, send, uniques, inverse = out
    else:
        fs = _feature_stats(lens, v, len(keys), batch, want_dedupe)
        stats = fs.stats.cpu().numpy()  # the host read of the encoder
        _refuse_negative(keys, stats.tolist())
        esize = wire_w.itemsize if wire_w is not None else 0
        plan = kjt_layout.plan_encode(
            stats, batch, feat_off, config.dedupe, mode, esize, config.checksum, codes
        )
        inverse = uniques = None
        if plan.formats[:, [2, 6]].any():  # wire or output dedupe (a lookup feature's too)
            assert fs.ids is not None
            order, new = fs.ids
            inverse = segment_inverse(order, new, fs.seg, fs.stats[:, 5])
            uniques = v[order][new]
        send = _pack_torch(
            plan, lens, v, uniques, inverse, weights, wire_w, config.checksum, feat_off.tolist()
        )

    stats_rows = plan.stats.tolist()
    val_off = plan.starts[kjt_layout.IDS].tolist()
    expand: list[list[tuple[int, torch.Tensor] | None]] = []
    offsets = feat_off.tolist()
    # Per feature: lookup, distinct ids, exact output dedupe rows.
    kinds = plan.formats[:, [5, 4, 6]].tolist()
    for d in range(len(splits)):
        row: list[tuple[int, torch.Tensor] | None] = []
        for f in range(offsets[d], offsets[d + 1]):
            lookup, num_unique, out_rows = kinds[f]
            if lookup:
                assert inverse is not None
                row.append((num_unique, inverse[val_off[f] : val_off[f + 1]]))
            elif out_rows:
                bag_inv = bag_inverse(f, stats_rows[f], batch, lens, inverse, val_off)
                row.append((out_rows, bag_inv))
            else:
                row.append(None)
        expand.append(row)

    return EncodedKJT(
        send=send,
        send_words=plan.payloads[:, 2].tolist(),
        meta=torch.from_numpy(plan.meta).to(dev),
        meta_splits=meta_splits,
        num_ids_per_dest=plan.payloads[:, 1].tolist(),
        expand=expand,
        formats=plan.formats,
        feature_stats=stats_rows,
        feature_bytes=plan.feature_bytes.tolist(),
        wire_weights=wire_w,
    )


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


def _pack_torch(
    plan: kjt_layout.EncodePlan,
    lens: torch.Tensor,
    v: torch.Tensor,
    uniques: torch.Tensor | None,
    inverse: torch.Tensor | None,
    weights: torch.Tensor | None,
    wire_w: torch.dtype | None,
    checksum: bool,
    feat_off: Sequence[int],
) -> torch.Tensor:
    """:func:`encode_kjt`'s payloads by tensor ops on the KJT's device (what ``kjt_host.encode``
    packs on the host).

    Args:
        plan: The payloads' plan.
        lens: The KJT's int64 lengths.
        v: Its int64 ids.
        uniques: Every feature's distinct ids (None if no feature is deduplicated).
        inverse: Per id, the index of its distinct id in its feature (idem).
        weights: Its weights (None: unweighted).
        wire_w: Their dtype on the wire.
        checksum: End every payload with its checksum.
        feat_off: Each destination's first feature, then F.

    Returns:
        int32 words of all payloads.
    """
    sources = (lens, v, uniques, inverse)  # indexed by kjt_layout.LENGTHS, IDS, UNIQUE, INVERSE
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
    w_t, p_t = layout.positions(v.device)
    flat = torch.cat(parts) if parts else v.new_empty(0)
    send_words = plan.payloads[:, 2].tolist()
    send = pack_bits(flat, w_t, p_t, sum(send_words))
    if weights is not None:
        val_off = starts[kjt_layout.IDS]
        for (at, _, _), f0, f1 in zip(plan.payloads.tolist(), feat_off, feat_off[1:], strict=False):
            ww = _words_of(weights[val_off[f0] : val_off[f1]].to(wire_w))
            send[at : at + ww.numel()] = ww
    if checksum:
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
    dev = recv.device
    host = on_host(dev, backend)
    wire_w = _DTYPES[codes[0] >> 24 & 0xFF] if codes else None
    trailer = bool(codes) and bool(codes[0] & _CHECK_FLAG)
    if any(c != codes[0] for c in codes):
        raise LossyAllToAllError(
            f"lossy input dist on rank {my_rank}: source ranks sent KJTs of different dtypes "
            f"(codes {codes}); every rank must feed the same lengths/values/weights dtypes"
        )

    def fail(src: int, why: str) -> NoReturn:
        raise LossyAllToAllError(
            f"lossy input dist on rank {my_rank}: the KJT payload from rank {src} (features: "
            f"{', '.join(keys) or 'none'}) does not match its metadata: {why}. The ranks run "
            "different torchrec_lossy versions or sharding plans, or the bytes were corrupted."
        )

    # Every source's formats in one array for the compiled planner (FeatureMeta is a tuple).
    formats = np.array([m for metas in metas_per_src for m in metas], np.int64).reshape(
        -1, len(kjt_layout.FORMAT_COLUMNS)
    )
    feat_off = _split_offsets(tuple(map(len, metas_per_src)))[0]
    batch = np.array(batch_per_src, np.int64)
    words = np.array(recv_words, np.int64)
    esize = wire_w.itemsize if wire_w is not None else 0
    selects: list[list[torch.Tensor | None]] = [[None] * len(m) for m in metas_per_src]
    if host:
        out = kjt_host.decode(recv, words, trailer, formats, feat_off, batch, esize)
        _refuse(fail, out.refusal)
        lengths, values, payloads = out.lengths, out.values, out.payloads
        for (src, f), first in zip(out.segments, out.first_bags, strict=True):
            selects[src][f] = first
    else:
        plan = kjt_layout.plan_decode(formats, feat_off, batch, words, esize, trailer)
        _refuse(fail, plan.refusal)
        if trailer:
            # One host read for all sources; the sizes are known to be right by now.
            ok = payload_checksums(recv, recv_words) == _stored_checksums(recv, recv_words)
            _check_sums(fail, ok.tolist())
        payloads = plan.payloads
        lengths, values = _unpack_torch(
            recv, plan.sections, metas_per_src, batch_per_src, fail, selects
        )

    len_dtype = _DTYPES[codes[0] & 0xFF] if codes else torch.int64
    val_dtype = _DTYPES[codes[0] >> 8 & 0xFF] if codes else torch.int64
    w_dtype = _DTYPES[codes[0] >> 16 & 0xFF] if codes else None
    assert len_dtype is not None and val_dtype is not None
    out_weights = None
    if w_dtype is not None:
        weights: list[torch.Tensor] = []
        assert wire_w is not None
        for weights_at, num_ids, _ in payloads.tolist():
            nw = _weight_words(num_ids, wire_w)
            raw = recv[weights_at : weights_at + nw].view(torch.uint8).clone()  # aligned
            weights.append(raw[: num_ids * esize].view(wire_w))
        out_weights = (
            torch.cat(weights).to(w_dtype) if weights else recv.new_empty(0, dtype=w_dtype)
        )
    return DecodedKJT(lengths.to(len_dtype), values.to(val_dtype), out_weights, selects)


class _Fail(Protocol):
    """Raises :func:`decode_kjt`'s error for a source's payload."""

    def __call__(self, src: int, why: str) -> NoReturn: ...


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


def _unpack_torch(
    recv: torch.Tensor,
    sections: np.ndarray,
    metas_per_src: Sequence[Sequence[FeatureMeta]],
    batch_per_src: Sequence[int],
    fail: _Fail,
    selects: list[list[torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_kjt`'s lengths, ids and bag selection, by tensor ops on ``recv``'s device.

    Args:
        recv: The payloads' words.
        sections: Their sections (``kjt_layout.plan_decode``).
        metas_per_src: Per source, per feature, its format.
        batch_per_src: Batch size of every source.
        fail: Raises the decode's error for a source.
        selects: Out: per source, per feature, the first bags of the exact output dedupe (None
            where not deduplicated).

    Returns:
        int64 lengths and ids of every source's features.
    """
    dev = recv.device
    rows = sections.tolist()
    w_t, p_t = _Layout([r[2] for r in rows], [r[3] for r in rows], [r[5] for r in rows]).positions(
        dev
    )
    flat = unpack_bits(recv, w_t, p_t)
    unpacked = torch.split(flat, [r[2] for r in rows]) if rows else []
    # Per (feature row, field): its sections' values.
    fields: dict[tuple[int, int], list[torch.Tensor]] = {}
    for (feature, field, *_), part in zip(rows, unpacked, strict=True):
        fields.setdefault((feature, field), []).append(part)

    lengths: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    # Exact output dedupe, (source, index in lengths, rows sent back, id bits) of the features
    # the owner sorts, and (the same, inverse index, distinct ids) of those whose ids arrived
    # deduplicated: their distinct bags follow from the inverse index, no sort needed.
    out_segs: list[tuple[int, int, int, int]] = []
    out_inv: list[tuple[int, int, int, torch.Tensor, int]] = []
    for src, (metas, batch) in enumerate(zip(metas_per_src, batch_per_src, strict=True)):
        for m in metas:
            row = len(lengths)  # the feature's row, over all sources

            def field(name: int, n: int, row: int = row) -> torch.Tensor:
                return _join_field(fields.get((row, name), []), n, dev)

            if m.lookup:
                ones = torch.ones(m.num_unique, dtype=torch.int64, device=dev)
                lengths.append(torch.cat([ones, ones.new_zeros(batch - m.num_unique)]))
                values.append(field(kjt_layout.UNIQUE, m.num_unique))
                continue
            lengths.append(field(kjt_layout.LENGTHS, batch))
            if m.dedupe:
                inv = field(kjt_layout.INVERSE, m.num_ids)
                values.append(field(kjt_layout.UNIQUE, m.num_unique)[inv])
            else:
                inv = None if m.num_ids else torch.empty(0, dtype=torch.int64, device=dev)
                values.append(field(kjt_layout.IDS, m.num_ids))
            if m.out_rows and inv is not None:
                out_inv.append((src, row, m.out_rows, inv, m.num_unique))
            elif m.out_rows:
                out_segs.append((src, row, m.out_rows, m.id_bits))
    firsts: list[torch.Tensor] = []
    with record_function("## lossy_input dedupe select ##"):
        if out_inv:
            firsts += first_bags(
                [lengths[i] for _, i, _, _, _ in out_inv],
                [inv for _, _, _, inv, _ in out_inv],
                [u for _, _, _, _, u in out_inv],
            )
        if out_segs:
            firsts += distinct_bags(
                [lengths[i] for _, i, _, _ in out_segs],
                [values[i] for _, i, _, _ in out_segs],
                max(1 << b for *_, b in out_segs),
                with_inverse=False,
            )[2]
    segs = [x[:3] for x in out_inv] + [x[:3] for x in out_segs]
    for (src, i, rows_sent), first in zip(segs, firsts, strict=True):
        local = i - sum(len(m) for m in metas_per_src[:src])
        if first.numel() != rows_sent:
            _refuse(fail, kjt_layout.Refusal(src, kjt_layout.BAD_ROWS, first.numel(), rows_sent))
        selects[src][local] = first
    empty = recv.new_empty(0, dtype=torch.int64)
    return (
        torch.cat(lengths) if lengths else empty,
        torch.cat(values) if values else empty,
    )


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
