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

Both ends lay out each payload alike from the metadata (``_payload``: per feature its fields,
each a section of fixed-width fields). The tensor work then runs on one of two backends
(:data:`KJTBackend`, chosen per call from the tensors' device), with the same words and tensors:

- torch (the device path and the test oracle): vectorized torch ops only (``index_add_`` of
  shifted 32-bit fields into int64 accumulators); nothing is staged through host memory except
  the per-feature statistics and the metadata.
- numba (CPU tensors): :mod:`torchrec_lossy.distributed.kjt_host` does the statistics and
  deduplication sort, the packing and the checksums in a few compiled calls, where tens of
  small torch ops per call would cost more than the work itself.
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
from torchrec_lossy.distributed import kjt_host
from torchrec_lossy.distributed.dedupe import (
    OutputDedupeMode,
    bag_inverse,
    distinct_bags,
    first_bags,
    segment_inverse,
    segment_sort,
)
from torchrec_lossy.distributed.pooled_payload import LossyAllToAllError

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
# The compiled path's array of each field (kjt_host's section tables).
_ARRAYS = {
    "lengths": kjt_host.LENGTHS,
    "ids": kjt_host.IDS,
    "unique": kjt_host.UNIQUE,
    "inverse": kjt_host.INVERSE,
}

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
    if backend not in ("auto", "torch", "numba"):
        raise ValueError(f"KJT codec backend {backend!r}: use 'auto', 'torch' or 'numba'")
    if backend == "numba" and device.type != "cpu":
        raise ValueError(
            f"KJT codec backend 'numba' runs on CPU tensors, these are on {device}; use 'auto'"
        )
    return backend == "numba" or (backend == "auto" and device.type == "cpu")


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


def _bit_length(x: int) -> int:
    return int(x).bit_length()


# ---------------------------------------------------------------------------------------------
# Per-feature format.


@dataclass(frozen=True)
class FeatureMeta:
    """What the receiver needs to unpack one feature from one source.

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

    @property
    def inv_bits(self) -> int:
        """Bits per inverse-index entry."""
        return _bit_length(self.num_unique - 1) if self.num_unique else 0

    def words(self) -> list[int]:
        """The feature's metadata words."""
        mode = (
            self.len_bits
            | (self.id_bits << 8)
            | (int(self.dedupe) << 16)
            | (int(self.lookup) << 17)
            | (self.out_rows << 32)
        )
        return [mode, self.num_ids, self.num_unique]

    @staticmethod
    def from_words(w: Sequence[int]) -> FeatureMeta:
        """Inverse of :meth:`words`."""
        return FeatureMeta(
            w[0] & 0xFF,
            (w[0] >> 8) & 0xFF,
            bool(w[0] >> 16 & 1),
            w[1],
            w[2],
            bool(w[0] >> 17 & 1),
            w[0] >> 32,
        )

    def fields(self, batch: int) -> list[tuple[str, int, int]]:
        """Its packed fields in order: ``(name, count, width)``."""
        if self.lookup:  # lengths are implied (ones, then zeros); the inverse stays home
            return [("unique", self.num_unique, self.id_bits)]
        out = [("lengths", batch, self.len_bits)]
        if self.dedupe:
            out += [
                ("unique", self.num_unique, self.id_bits),
                ("inverse", self.num_ids, self.inv_bits),
            ]
        else:
            out.append(("ids", self.num_ids, self.id_bits))
        return out

    def packed_bits(self, batch: int) -> int:
        """Bits the feature's lengths and ids take."""
        return sum(n * w for _, n, w in self.fields(batch))


def _weight_words(num: int, dtype: torch.dtype) -> int:
    return -(-num * torch.empty(0, dtype=dtype).element_size() // 4)


class _Section(NamedTuple):
    """``count`` fields of ``width`` bits from bit ``bit`` on: one field of a feature, or the low
    or high part (``shift`` 0 or 32) of a field of values over 32 bits."""

    feature: int
    name: str
    count: int
    width: int
    shift: int
    bit: int


class _Payload(NamedTuple):
    """The layout of one payload (sender and receiver build it alike from the metadata).

    Attributes:
        sections: Its packed sections in wire order.
        weights_at: Its first word of weights (the word after the packed bits).
        num_ids: Ids of its features.
        words: Its words: packed bits, weights, checksum.
    """

    sections: list[_Section]
    weights_at: int
    num_ids: int
    words: int


def _payload(
    metas: Sequence[FeatureMeta],
    batch: int,
    word0: int,
    wire_w: torch.dtype | None,
    checksum: bool,
    first_feature: int = 0,
) -> _Payload:
    """Lays out one payload: each feature's fields packed back to back, the weights, the checksum.

    Args:
        metas: The payload's features.
        batch: Its sender's batch size.
        word0: Its first word in the buffer of all payloads.
        wire_w: dtype of its weights on the wire (None: unweighted).
        checksum: It ends with a checksum.
        first_feature: Index the sections give the first feature.

    Returns:
        Its sections, where its weights start, its ids and its words.
    """
    bit = word0 * _WORD_BITS
    sections: list[_Section] = []
    n_ids = 0
    for f, m in enumerate(metas, first_feature):
        n_ids += m.num_ids
        for name, n, w in m.fields(batch):
            if n == 0 or w == 0:
                continue
            if w <= _WORD_BITS:
                sections.append(_Section(f, name, n, w, 0, bit))
            else:  # values over 32 bits travel as a section of low parts, then one of high parts
                high = bit + n * _WORD_BITS
                sections.append(_Section(f, name, n, _WORD_BITS, 0, bit))
                sections.append(_Section(f, name, n, w - _WORD_BITS, _WORD_BITS, high))
            bit += n * w
    weights_at = -(-bit // _WORD_BITS)
    end = weights_at + (_weight_words(n_ids, wire_w) if wire_w is not None else 0)
    return _Payload(sections, weights_at, n_ids, end - word0 + (_CHECK_WORDS if checksum else 0))


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
        features: Per feature (the KJT's key order), its format.
        feature_stats: Per feature, its statistics (length sum, max, min; id max, min;
            distinct ids) as host ints.
        wire_weights: dtype the weights travel in (None: unweighted).
    """

    send: torch.Tensor
    send_words: list[int]
    meta: torch.Tensor
    meta_splits: list[int]
    num_ids_per_dest: list[int]
    expand: list[list[tuple[int, torch.Tensor] | None]]
    features: list[FeatureMeta]
    feature_stats: list[list[int]]
    wire_weights: torch.dtype | None


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
    num_f, batch = len(keys), kjt.stride()
    lengths, values, weights = kjt.lengths(), kjt.values(), kjt.weights_or_none()
    dev = values.device
    host = on_host(dev, backend)
    exact_out = output_dedupe == "exact" and weights is None and batch > 0
    want_dedupe = config.dedupe or output_dedupe is not None
    v = values.to(torch.int64)
    lens = lengths.to(torch.int64)
    with record_function("## lossy_input stats ##"):
        if host:
            hs = kjt_host.feature_stats(lens, v, num_f, batch, want_dedupe)
            stats, fs = hs.stats, None
        else:
            fs = _feature_stats(lens, v, num_f, batch, want_dedupe)
            stats = fs.stats.tolist()  # the host read of the encoder
    for key, st in zip(keys, stats, strict=True):
        if st[2] < 0 or st[4] < 0:
            raise ValueError(
                f"lossy input dist: feature {key!r} has a negative "
                f"{'length' if st[2] < 0 else 'id'}; KJT lengths and ids must be >= 0"
            )
    wire_w = None
    if weights is not None:
        wire_w = _WEIGHT_CASTS.get(config.weights, weights.dtype)

    # Offsets of each feature's ids in the input (not what travels: lookup features send U).
    val_off = list(itertools.accumulate((s[0] for s in stats), initial=0))
    with record_function("## lossy_input encode ##"):
        metas: list[FeatureMeta] = []
        for len_sum, len_max, len_min, id_max, _, uniq in stats:
            id_bits, len_bits = id_max.bit_length(), len_max.bit_length()
            if (
                output_dedupe == "lookup"
                and weights is None
                and batch > 0
                and len_min == len_max == 1
                and uniq < batch
            ):
                # Single-hot with repeats: a bag's pooled vector is its row, so the owner can
                # look up and send back each distinct id once.
                metas.append(FeatureMeta(0, id_bits, True, uniq, uniq, lookup=True))
                continue
            inv_bits = (uniq - 1).bit_length() if uniq else 0
            # Deduplicate only where distinct ids + inverse index take fewer bits.
            dedupe = config.dedupe and uniq * id_bits + len_sum * inv_bits < len_sum * id_bits
            # Bags of at most one unweighted id that repeat: send back each distinct one once.
            # Distinct bags: with one id per bag the ids; with none, one; with a mix of empty
            # and one-id bags, the empty bag then the ids (see bag_inverse and first_bags).
            out_rows = 0
            if exact_out and len_max <= 1:
                bags = uniq if len_min == 1 else uniq + 1 if len_max == 1 else 1
                out_rows = bags if bags < batch else 0
            metas.append(
                FeatureMeta(
                    len_bits, id_bits, dedupe, len_sum, uniq if dedupe else 0, out_rows=out_rows
                )
            )

        inverse = uniques = None
        if host:
            inverse, uniques = hs.inverse, hs.uniques
        elif any(m.dedupe or m.out_rows for m in metas):
            assert fs is not None and fs.ids is not None
            order, new = fs.ids
            inverse = segment_inverse(order, new, fs.seg, fs.stats[:, 5])
            uniques = v[order][new]

        # Where each field's elements start in the sender's arrays (lookup features send the
        # distinct ids, which start where the feature's do in ``uniques``).
        uniq_off = list(itertools.accumulate((s[5] for s in stats), initial=0))
        field_start = {
            "lengths": [f * batch for f in range(num_f)],
            "ids": val_off,
            "unique": uniq_off,
            "inverse": val_off,
        }
        feat_off = list(itertools.accumulate(splits, initial=0))
        sections: list[_Section] = []
        send_words: list[int] = []
        weight_slots: list[tuple[int, int, int]] = []  # (word offset, first id, ids)
        word0 = 0
        for d in range(len(splits)):
            f0, f1 = feat_off[d], feat_off[d + 1]
            p = _payload(metas[f0:f1], batch, word0, wire_w, config.checksum, f0)
            sections += p.sections
            if wire_w is not None:
                weight_slots.append((p.weights_at, val_off[f0], val_off[f1] - val_off[f0]))
            send_words.append(p.words)
            word0 += p.words

        if host:
            assert uniques is not None and inverse is not None
            rows = [
                x
                for s in sections
                for x in (
                    _ARRAYS[s.name],
                    field_start[s.name][s.feature],
                    s.count,
                    s.width,
                    s.shift,
                    s.bit,
                )
            ]
            send = kjt_host.pack(
                rows, word0, lens, v, uniques, inverse,
                weights.to(wire_w) if weights is not None else None, weight_slots, send_words,
                config.checksum,
            )  # fmt: skip
        else:
            sources = {"lengths": lens, "ids": v, "unique": uniques, "inverse": inverse}
            parts: list[torch.Tensor] = []
            for s in sections:
                src = sources[s.name]
                assert src is not None
                a = field_start[s.name][s.feature]
                t = src[a : a + s.count]
                # Values over 32 bits travel as two parts; narrower ones fit as they are.
                parts.append(t >> s.shift if s.shift else t & _MASK32 if s.width == 32 else t)
            layout = _Layout(
                [s.count for s in sections], [s.width for s in sections], [s.bit for s in sections]
            )
            w_t, p_t = layout.positions(dev)
            flat = torch.cat(parts) if parts else v.new_empty(0)
            send = pack_bits(flat, w_t, p_t, word0)
            if weights is not None:
                for at, first, n in weight_slots:
                    ww = _words_of(weights[first : first + n].to(wire_w))
                    send[at : at + ww.numel()] = ww
            if config.checksum:
                _write_checksums(send, send_words)

        codes = (
            _CODES[lengths.dtype]
            | _CODES[values.dtype] << 8
            | _CODES[weights.dtype if weights is not None else None] << 16
            | _CODES[wire_w] << 24
            | (_CHECK_FLAG if config.checksum else 0)
        )
        meta_rows: list[int] = []
        meta_splits: list[int] = []
        for d in range(len(splits)):
            fm = metas[feat_off[d] : feat_off[d + 1]]
            row = [send_words[d], batch, codes] + [w for m in fm for w in m.words()]
            meta_rows += row
            meta_splits.append(len(row))
        meta = torch.from_numpy(np.array(meta_rows, np.int64)).to(dev)

        expand: list[list[tuple[int, torch.Tensor] | None]] = []
        for d in range(len(splits)):
            row: list[tuple[int, torch.Tensor] | None] = []
            for f in range(feat_off[d], feat_off[d + 1]):
                m = metas[f]
                if m.lookup:
                    assert inverse is not None
                    row.append((m.num_unique, inverse[val_off[f] : val_off[f + 1]]))
                elif m.out_rows:
                    bag_inv = bag_inverse(f, stats[f], batch, lens, inverse, val_off)
                    row.append((m.out_rows, bag_inv))
                else:
                    row.append(None)
            expand.append(row)

    return EncodedKJT(
        send=send,
        send_words=send_words,
        meta=meta,
        meta_splits=meta_splits,
        num_ids_per_dest=[
            sum(m.num_ids for m in metas[feat_off[d] : feat_off[d + 1]]) for d in range(len(splits))
        ],
        expand=expand,
        features=metas,
        feature_stats=stats,
        wire_weights=wire_w,
    )


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
    payloads: list[_Payload] = []
    word_offsets = list(itertools.accumulate(recv_words, initial=0))
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

    for src, (metas, batch) in enumerate(zip(metas_per_src, batch_per_src, strict=True)):
        for m in metas:
            if m.lookup and m.num_unique > batch:
                fail(src, f"{m.num_unique} distinct single-hot ids for a batch of {batch}")
            if max(m.len_bits, m.id_bits) > 2 * _WORD_BITS:
                fail(src, f"{max(m.len_bits, m.id_bits)}-bit fields (at most 64)")
        p = _payload(metas, batch, word_offsets[src], wire_w, trailer)
        if p.words != recv_words[src]:
            fail(src, f"{recv_words[src]} words received, {p.words} expected")
        payloads.append(p)
    if trailer and not host:  # the numba path verifies in its one call
        # One host read for all sources; the sizes are known to be right by now.
        ok = payload_checksums(recv, recv_words) == _stored_checksums(recv, recv_words)
        _check_sums(fail, ok.tolist())

    len_dtype = _DTYPES[codes[0] & 0xFF] if codes else torch.int64
    val_dtype = _DTYPES[codes[0] >> 8 & 0xFF] if codes else torch.int64
    w_dtype = _DTYPES[codes[0] >> 16 & 0xFF] if codes else None
    assert len_dtype is not None and val_dtype is not None
    if host:
        lengths, values, selects = _unpack_host(
            recv, recv_words, trailer, payloads, metas_per_src, batch_per_src, fail
        )
    else:
        lengths, values, selects = _unpack_torch(recv, payloads, metas_per_src, batch_per_src, fail)
    out_weights = None
    if w_dtype is not None:
        weights: list[torch.Tensor] = []
        assert wire_w is not None
        esize = torch.empty(0, dtype=wire_w).element_size()
        for p in payloads:
            nw = _weight_words(p.num_ids, wire_w)
            raw = recv[p.weights_at : p.weights_at + nw].view(torch.uint8).clone()  # aligned
            weights.append(raw[: p.num_ids * esize].view(wire_w))
        out_weights = (
            torch.cat(weights).to(w_dtype) if weights else recv.new_empty(0, dtype=w_dtype)
        )
    return DecodedKJT(lengths.to(len_dtype), values.to(val_dtype), out_weights, selects)


class _Fail(Protocol):
    """Raises :func:`decode_kjt`'s error for a source's payload."""

    def __call__(self, src: int, why: str) -> NoReturn: ...


def _check_sums(fail: _Fail, ok: Sequence[bool]) -> None:
    """Fails on the first source whose checksum does not match.

    Args:
        fail: Raises the decode's error.
        ok: Per source, whether its checksum matches.
    """
    for src, good in enumerate(ok):
        if not good:
            fail(src, "its checksum does not match (corrupted in transit)")


def _check_bags(fail: _Fail, src: int, first: torch.Tensor, rows: int) -> torch.Tensor:
    """The first bags of a feature of the exact output dedupe, if one per row sent back.

    Args:
        fail: Raises the decode's error.
        src: The feature's source.
        first: Its first bag of each distinct bag.
        rows: Rows the metadata says go back to the source.

    Returns:
        ``first``.
    """
    if first.numel() != rows:
        fail(src, f"{first.numel()} distinct bags in a deduplicated feature, {rows} sent")
    return first


def _unpack_torch(
    recv: torch.Tensor,
    payloads: Sequence[_Payload],
    metas_per_src: Sequence[Sequence[FeatureMeta]],
    batch_per_src: Sequence[int],
    fail: _Fail,
) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor | None]]]:
    """:func:`decode_kjt`'s lengths, ids and bag selection, by tensor ops on ``recv``'s device.

    Args:
        recv: The payloads' words.
        payloads: Each source's layout.
        metas_per_src: Per source, per feature, its format.
        batch_per_src: Batch size of every source.
        fail: Raises the decode's error for a source.

    Returns:
        int64 lengths and ids of every source's features, and per source, per feature, the
        first bags of the exact output dedupe (None where not deduplicated).
    """
    dev = recv.device
    sections = [s for p in payloads for s in p.sections]
    w_t, p_t = _Layout(
        [s.count for s in sections], [s.width for s in sections], [s.bit for s in sections]
    ).positions(dev)
    flat = unpack_bits(recv, w_t, p_t)
    unpacked = iter(torch.split(flat, [s.count for s in sections]) if sections else [])
    # Per source, per (feature, field): its sections' values.
    fields: list[dict[tuple[int, str], list[torch.Tensor]]] = []
    for p in payloads:
        per_src: dict[tuple[int, str], list[torch.Tensor]] = {}
        for s in p.sections:
            per_src.setdefault((s.feature, s.name), []).append(next(unpacked))
        fields.append(per_src)

    lengths: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    # Exact output dedupe, (source, index in lengths, rows sent back, id bits) of the features
    # the owner sorts, and (the same, inverse index, distinct ids) of those whose ids arrived
    # deduplicated: their distinct bags follow from the inverse index, no sort needed.
    out_segs: list[tuple[int, int, int, int]] = []
    out_inv: list[tuple[int, int, int, torch.Tensor, int]] = []
    for src, (metas, batch) in enumerate(zip(metas_per_src, batch_per_src, strict=True)):
        for f, m in enumerate(metas):

            def field(name: str, n: int, f: int = f, src: int = src) -> torch.Tensor:
                return _join_field(fields[src].get((f, name), []), n, dev)

            if m.lookup:
                ones = torch.ones(m.num_unique, dtype=torch.int64, device=dev)
                lengths.append(torch.cat([ones, ones.new_zeros(batch - m.num_unique)]))
                values.append(field("unique", m.num_unique))
                continue
            lengths.append(field("lengths", batch))
            if m.dedupe:
                inv = field("inverse", m.num_ids)
                values.append(field("unique", m.num_unique)[inv])
            else:
                inv = None if m.num_ids else torch.empty(0, dtype=torch.int64, device=dev)
                values.append(field("ids", m.num_ids))
            if m.out_rows and inv is not None:
                out_inv.append((src, len(lengths) - 1, m.out_rows, inv, m.num_unique))
            elif m.out_rows:
                out_segs.append((src, len(lengths) - 1, m.out_rows, m.id_bits))
    selects: list[list[torch.Tensor | None]] = [[None] * len(m) for m in metas_per_src]
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
    for (src, i, rows), first in zip(segs, firsts, strict=True):
        local = i - sum(len(m) for m in metas_per_src[:src])
        selects[src][local] = _check_bags(fail, src, first, rows)
    empty = recv.new_empty(0, dtype=torch.int64)
    return (
        torch.cat(lengths) if lengths else empty,
        torch.cat(values) if values else empty,
        selects,
    )


def _unpack_host(
    recv: torch.Tensor,
    recv_words: Sequence[int],
    checksum: bool,
    payloads: Sequence[_Payload],
    metas_per_src: Sequence[Sequence[FeatureMeta]],
    batch_per_src: Sequence[int],
    fail: _Fail,
) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor | None]]]:
    """:func:`_unpack_torch` and the checksum check in one compiled call (``kjt_host.decode``).

    Args:
        recv: The payloads' words (CPU).
        recv_words: Words from each source.
        checksum: The payloads end with a checksum to verify.
        payloads: Each source's layout.
        metas_per_src: Per source, per feature, its format.
        batch_per_src: Batch size of every source.
        fail: Raises the decode's error for a source.

    Returns:
        As :func:`_unpack_torch`.
    """
    sections: list[int] = []  # kjt_host's tables, flat
    features: list[int] = []
    segments: list[int] = []
    feature_of: list[tuple[int, int]] = []  # (source, feature) of each feature row
    segment_of: list[tuple[int, int, int]] = []  # (source, feature, rows sent) of each segment
    len_at = val_at = uniq_at = 0
    for src, (p, metas, batch) in enumerate(
        zip(payloads, metas_per_src, batch_per_src, strict=True)
    ):
        # Per feature, its first length and id, and where its distinct ids go (a lookup
        # feature's are its ids); its inverse index goes at its ids.
        starts: list[tuple[int, int, tuple[int, int]]] = []
        for f, m in enumerate(metas):
            kind = kjt_host.LOOKUP if m.lookup else kjt_host.DEDUPED if m.dedupe else kjt_host.PLAIN
            deduped = kind == kjt_host.DEDUPED
            features += (kind, len_at, batch, val_at, m.num_ids, uniq_at, m.num_unique)
            feature_of.append((src, f))
            unique_to = (kjt_host.UNIQUE, uniq_at) if deduped else (kjt_host.IDS, val_at)
            starts.append((len_at, val_at, unique_to))
            if m.out_rows and not m.lookup:
                # As _unpack_torch: a feature without ids has an (empty) inverse index.
                by_inv = m.dedupe or not m.num_ids
                kind = kjt_host.BY_INVERSE if by_inv else kjt_host.BY_SORT
                segments += (kind, len_at, batch, val_at, m.num_ids, m.num_unique)
                segment_of.append((src, f, m.out_rows))
            len_at += batch
            val_at += m.num_ids
            uniq_at += m.num_unique if deduped else 0
        for s in p.sections:
            len_start, val_start, unique_to = starts[s.feature]
            if s.name == "lengths":
                sections += (kjt_host.LENGTHS, len_start)
            elif s.name == "unique":
                sections += unique_to
            else:
                sections += (_ARRAYS[s.name], val_start)
            sections += (s.count, s.width, s.shift, s.bit)
    out = kjt_host.decode(
        recv, recv_words, checksum, sections, features, segments, len_at, val_at, uniq_at
    )
    if out.bad_payload >= 0:
        _check_sums(fail, [src != out.bad_payload for src in range(len(payloads))])
    if out.bad_feature >= 0:
        src, f = feature_of[out.bad_feature]
        why = (
            "its lengths do not sum to its ids"
            if out.why == kjt_host.BAD_LENGTHS
            else "its inverse index points past its distinct ids"
        )
        fail(src, f"feature {f} of the payload: {why}")
    selects: list[list[torch.Tensor | None]] = [[None] * len(m) for m in metas_per_src]
    for (src, f, rows), first in zip(segment_of, out.first_bags, strict=True):
        selects[src][f] = _check_bags(fail, src, first, rows)
    return out.lengths, out.values, selects


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
