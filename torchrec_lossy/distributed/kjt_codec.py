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

Packing uses vectorized torch ops only (``index_add_`` of shifted 32-bit fields into int64
accumulators): nothing is staged through host memory except the per-feature statistics and the
metadata.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

import torch
from torch.autograd.profiler import record_function
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.codec import segment_checksums
from torchrec_lossy.codec.container import upload
from torchrec_lossy.config import InputDistConfig
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


# ---------------------------------------------------------------------------------------------
# Bit packing.


def _field_widths(width: int) -> list[int]:
    """Section widths of a field of ``width``-bit values: none, one, or a low and a high part."""
    if width == 0:
        return []
    return [width] if width <= _WORD_BITS else [_WORD_BITS, width - _WORD_BITS]


def _field_parts(v: torch.Tensor, width: int) -> list[torch.Tensor]:
    """The sections of one field: values of up to 64 bits travel as two <=32-bit parts."""
    if width == 0:
        return []
    return [v] if width <= _WORD_BITS else [v & _MASK32, v >> _WORD_BITS]


def _join_field(parts: Sequence[torch.Tensor], count: int, device: torch.device) -> torch.Tensor:
    """Inverse of :func:`_field_parts`."""
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

    Returns:
        The payloads and metadata.
    """
    keys = kjt.keys()
    num_f, batch = len(keys), kjt.stride()
    lengths, values, weights = kjt.lengths(), kjt.values(), kjt.weights_or_none()
    dev = values.device
    exact_out = output_dedupe == "exact" and weights is None and batch > 0
    with record_function("## lossy_input stats ##"):
        fs = _feature_stats(
            lengths, values, num_f, batch, config.dedupe or output_dedupe is not None
        )
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

    v = values.to(torch.int64)
    lens = lengths.to(torch.int64)
    # Offsets of each feature's ids in the input (not what travels: lookup features send U).
    val_off = list(itertools.accumulate((s[0] for s in stats), initial=0))
    with record_function("## lossy_input encode ##"):
        metas: list[FeatureMeta] = []
        for len_sum, len_max, len_min, id_max, _, uniq in stats:
            id_bits, len_bits = _bit_length(id_max), _bit_length(len_max)
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
            inv_bits = _bit_length(uniq - 1) if uniq else 0
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
        uniq_off = list(itertools.accumulate((s[5] for s in stats), initial=0))
        if any(m.dedupe or m.out_rows for m in metas):
            assert fs.ids is not None
            order, new = fs.ids
            inverse = segment_inverse(order, new, fs.seg, fs.stats[:, 5])
            uniques = v[order][new]

        feat_off = list(itertools.accumulate(splits, initial=0))
        counts: list[int] = []
        widths: list[int] = []
        bit_starts: list[int] = []
        parts: list[torch.Tensor] = []
        send_words: list[int] = []
        weight_slots: list[tuple[int, int, int]] = []  # (word offset, first id, ids)
        word0 = 0
        for d in range(len(splits)):
            f0, f1 = feat_off[d], feat_off[d + 1]
            bit = word0 * _WORD_BITS
            for f in range(f0, f1):
                m = metas[f]
                a, b = val_off[f], val_off[f + 1]
                for name, n, w in m.fields(batch):
                    if n == 0 or w == 0:
                        continue
                    if name == "lengths":
                        t = lens[f * batch : (f + 1) * batch]
                    elif name == "ids":
                        t = v[a:b]
                    elif name == "unique":
                        assert uniques is not None
                        t = uniques[uniq_off[f] : uniq_off[f + 1]]
                    else:
                        assert inverse is not None
                        t = inverse[a:b]
                    for part, pw in zip(_field_parts(t, w), _field_widths(w), strict=True):
                        counts.append(n)
                        widths.append(pw)
                        bit_starts.append(bit)
                        parts.append(part)
                        bit += n * pw
            packed_words = -(-(bit - word0 * _WORD_BITS) // _WORD_BITS)
            n_ids = val_off[f1] - val_off[f0]
            words = packed_words
            if wire_w is not None:
                weight_slots.append((word0 + packed_words, val_off[f0], n_ids))
                words += _weight_words(n_ids, wire_w)
            if config.checksum:
                words += _CHECK_WORDS
            send_words.append(words)
            word0 += words

        layout = _Layout(counts, widths, bit_starts)
        w_t, p_t = layout.positions(dev)
        flat = torch.cat(parts) if parts else v.new_empty(0)
        send = pack_bits(flat, w_t, p_t, word0)
        if weights is not None:
            assert wire_w is not None
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
            fs = metas[feat_off[d] : feat_off[d + 1]]
            row = [send_words[d], batch, codes] + [w for m in fs for w in m.words()]
            meta_rows += row
            meta_splits.append(len(row))
        meta = torch.tensor(meta_rows, dtype=torch.int64, device=dev)

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

    Returns:
        The tensors and the exact output dedupe's bag selection.

    Raises:
        LossyAllToAllError: If the sources' dtypes differ, or a payload does not match its
            metadata or checksum.
    """
    dev = recv.device
    counts: list[int] = []
    widths: list[int] = []
    bit_starts: list[int] = []
    # Per source, per feature, per field: the indices of its sections in the layout.
    index: list[list[dict[str, list[int]]]] = []
    weight_slots: list[tuple[int, int]] = []
    word_offsets = list(itertools.accumulate(recv_words, initial=0))
    wire_w = _DTYPES[codes[0] >> 24 & 0xFF] if codes else None
    trailer = _CHECK_WORDS if codes and codes[0] & _CHECK_FLAG else 0
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
        bit = word_offsets[src] * _WORD_BITS
        per_feature = []
        for m in metas:
            fields: dict[str, list[int]] = {}
            for name, n, w in m.fields(batch):
                fields[name] = []
                if n == 0 or w == 0:
                    continue
                for pw in _field_widths(w):
                    fields[name].append(len(counts))
                    counts.append(n)
                    widths.append(pw)
                    bit_starts.append(bit)
                    bit += n * pw
            per_feature.append(fields)
        index.append(per_feature)
        packed = -(-(bit - word_offsets[src] * _WORD_BITS) // _WORD_BITS)
        n_ids = sum(m.num_ids for m in metas)
        expected = packed + trailer
        if wire_w is not None:
            weight_slots.append((word_offsets[src] + packed, n_ids))
            expected += _weight_words(n_ids, wire_w)
        if expected != recv_words[src]:
            fail(src, f"{recv_words[src]} words received, {expected} expected")
    if trailer:
        # One host read for all sources; the sizes are known to be right by now.
        ok = (payload_checksums(recv, recv_words) == _stored_checksums(recv, recv_words)).tolist()
        for src, good in enumerate(ok):
            if not good:
                fail(src, "its checksum does not match (corrupted in transit)")

    w_t, p_t = _Layout(counts, widths, bit_starts).positions(dev)
    flat = unpack_bits(recv, w_t, p_t)
    sections = list(torch.split(flat, counts)) if counts else []

    len_dtype = _DTYPES[codes[0] & 0xFF] if codes else torch.int64
    val_dtype = _DTYPES[codes[0] >> 8 & 0xFF] if codes else torch.int64
    w_dtype = _DTYPES[codes[0] >> 16 & 0xFF] if codes else None
    lengths: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    # Exact output dedupe, (source, index in lengths, rows sent back, id bits) of the features
    # the owner sorts, and (the same, inverse index, distinct ids) of those whose ids arrived
    # deduplicated: their distinct bags follow from the inverse index, no sort needed.
    out_segs: list[tuple[int, int, int, int]] = []
    out_inv: list[tuple[int, int, int, torch.Tensor, int]] = []
    for src, (metas, batch) in enumerate(zip(metas_per_src, batch_per_src, strict=True)):
        for m, fields in zip(metas, index[src], strict=True):

            def field(name: str, n: int, fields: dict[str, list[int]] = fields) -> torch.Tensor:
                return _join_field([sections[i] for i in fields[name]], n, dev)

            if m.lookup:
                if m.num_unique > batch:
                    fail(src, f"{m.num_unique} distinct single-hot ids for a batch of {batch}")
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
        if wire_w is not None:
            at, n = weight_slots[src]
            nw = _weight_words(n, wire_w)
            raw = recv[at : at + nw].view(torch.uint8).clone()  # aligned for any dtype
            esize = torch.empty(0, dtype=wire_w).element_size()
            weights.append(raw[: n * esize].view(wire_w))
    assert len_dtype is not None and val_dtype is not None
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
        if first.numel() != rows:
            fail(src, f"{first.numel()} distinct bags in a deduplicated feature, {rows} sent")
        selects[src][i - sum(len(m) for m in metas_per_src[:src])] = first
    out_lengths = (
        torch.cat(lengths).to(len_dtype) if lengths else recv.new_empty(0, dtype=len_dtype)
    )
    out_values = torch.cat(values).to(val_dtype) if values else recv.new_empty(0, dtype=val_dtype)
    out_weights = None
    if w_dtype is not None:
        out_weights = (
            torch.cat(weights).to(w_dtype) if weights else recv.new_empty(0, dtype=w_dtype)
        )
    return DecodedKJT(out_lengths, out_values, out_weights, selects)
