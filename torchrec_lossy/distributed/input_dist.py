"""Lossless, bit-packed KJT all-to-all for the TW, CW and TWCW input dist.

TorchRec's ``KJTAllToAll`` sends every rank's ``KeyedJaggedTensor`` (lengths, ids, optional
weights) to the owners of the features' tables as int64/int32 tensors, after a splits exchange.
:class:`LossyKJTAllToAll` does the same exchange in the same two steps, on packed words:

1. Encode (sender, at ``forward``): one pass of per-feature reductions (length sum / max / min,
   id max / min and, with deduplication, the distinct-id count) read on the host in one
   ``tolist()`` (TorchRec's ``dist_splits`` reads ``length_per_key`` at the same point). Each
   feature's lengths are packed to the bits of its largest length, its ids to the bits of its
   largest id (never more than its table needs). With ``dedupe`` a feature sends its distinct
   ids once plus an inverse index wherever that is fewer bits. Weights follow raw (or cast to
   fp16/bf16 only if asked).
2. Splits exchange: per destination, a few int64 words of metadata (payload size, batch size,
   dtypes, per feature: bit widths, value count, distinct count) in one ``all_to_all_single``,
   read on the host on the first ``wait()``, as TorchRec's ``SplitsAllToAllAwaitable``.
3. Payload exchange: one ``all_to_all_single`` of int32 words with uneven splits, async.
4. Decode (receiver, on the second ``wait()``): unpack, expand deduplicated ids and build the
   KJT with ``KeyedJaggedTensor.dist_init`` from the same tensors, recat and strides TorchRec's
   ``KJTAllToAllTensorsAwaitable`` uses, so the result is bit-identical.

Packing uses vectorized torch ops only (``index_add_`` of shifted 32-bit fields into int64
accumulators), so it runs where the KJT lives, CPU or CUDA; nothing is staged through host
memory except the small per-feature statistics and the metadata. On CUDA ``torch.unique``-like
steps of the deduplication (masked selects) wait for the device once more; set
``InputDistConfig.dedupe=False`` for exactly TorchRec's host syncs.

Each payload ends with a checksum the receiver verifies (``InputDistConfig.checksum``), and
``LossyComms.payload_hook`` sees every received payload as ``hook("input", source, words)``.

The input dist also carries the state of the cross-side output dedupe (:class:`OutputDedupe`) to
the output dist, on the sharding context's ``batch_size_per_rank``.

Variable batch per feature (VBE) inputs, 2-D weights and single-rank groups fall back to
TorchRec's ``KJTAllToAll``. Under TorchRec's train pipelines, which replace the ``forward`` of
each ``KJTAllToAll`` by their fused-splits ``KJTAllToAllForward``, the packed path stays active:
:class:`LossyTwSparseFeaturesDist` calls :meth:`LossyKJTAllToAll.packed`, not ``forward``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.dist_data import KJTAllToAll, KJTAllToAllTensorsAwaitable, _get_recat
from torchrec.distributed.embedding_sharding import BaseSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.codec import segment_checksums
from torchrec_lossy.codec.container import upload
from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.pooled_payload import LossyAllToAllError

# Pseudo-feature that holds the metadata exchange's bytes (raw: TorchRec's splits exchange).
SPLITS = "<splits>"

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
class _FeatureMeta:
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
    def from_words(w: Sequence[int]) -> _FeatureMeta:
        """Inverse of :meth:`words`."""
        return _FeatureMeta(
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


def _payload_words(metas: Sequence[_FeatureMeta], batch: int, weights: torch.dtype | None) -> int:
    bits = sum(m.packed_bits(batch) for m in metas)
    packed = -(-bits // _WORD_BITS)
    n = sum(m.num_ids for m in metas)
    return packed + (_weight_words(n, weights) if weights is not None else 0)


def _checksums(words: torch.Tensor, seg_words: Sequence[int]) -> torch.Tensor:
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
    sums = _checksums(send, send_words)
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


OutputDedupeMode = Literal["exact", "lookup"] | None


@dataclass
class _Encoded:
    send: torch.Tensor  # int32 words, the payloads in destination order
    send_words: list[int]
    meta: torch.Tensor  # int64 metadata, destinations in order
    meta_splits: list[int]
    num_ids_per_dest: list[int]
    # Per destination, per feature sent there: (rows the owner sends back, inverse index mapping
    # this rank's bags to them) of output-deduplicated features, None for the others.
    expand: list[list[tuple[int, torch.Tensor] | None]]


@dataclass
class OutputDedupe:
    """Cross-side deduplication state of one input-dist call, for the output dist.

    Two modes share it. **Exact** (``InputDistConfig.dedupe_outputs``, the default): for features
    whose bags hold at most one id and no weights, the owner gets the whole KJT and looks up every
    bag as TorchRec does, but the output dist sends back only the first bag of each distinct bag
    (distinct id, or empty) per (feature, destination); every bag of a distinct id pools to the
    same vector, so the receiver's expansion by its inverse index is exact, and the backward is
    TorchRec's dense one. **Lookup** (``InputDistConfig.dedupe_lookups``): only the distinct ids
    travel, the owner looks up ``U`` bags of one id (then ``B - U`` empty bags) and the gradient
    is summed per distinct id before it goes back (``sum_grads``).

    Attributes:
        recv_rows: Per source rank, per local feature (this rank's lookup order): rows sent back
            to that source, None where the feature is not deduplicated.
        send: Per owner rank, per feature sent to it: ``(rows, inverse)`` (the inverse index maps
            this rank's bags to the owner's rows), None where not deduplicated.
        sum_grads: Lookup mode: the owner's pooled rows past ``recv_rows`` are empty bags and
            gradients travel summed per distinct id.
        select: Exact mode, set when the owner decodes the KJT: per source, per local feature,
            the bags whose pooled rows are sent (first bag of each distinct bag, in the order of
            the sender's inverse index), None where not deduplicated.
    """

    recv_rows: list[list[int | None]]
    send: list[list[tuple[int, torch.Tensor] | None]]
    sum_grads: bool
    select: list[list[torch.Tensor | None]] | None = None


class _Strides(list):
    """``stride_per_rank`` that also carries the call's :class:`OutputDedupe`.

    TorchRec copies the tensors awaitable's ``_stride_per_rank`` into the sharding context's
    ``batch_size_per_rank`` (``_set_sharding_context_intra_a2a``, also under the train
    pipelines), which reaches the output dist; riding on it keeps the state with its own batch
    (no module-level queue) and makes any input dist that is not ours fall back by itself.
    """

    output_dedupe: OutputDedupe | None = None


def output_dedupe_of(batch_size_per_rank: object) -> OutputDedupe | None:
    """The cross-side dedupe state riding on a sharding context's ``batch_size_per_rank``.

    Args:
        batch_size_per_rank: ``EmbeddingShardingContext.batch_size_per_rank``.

    Returns:
        The state, or None when the input dist deduplicated no output rows.
    """
    return getattr(batch_size_per_rank, "output_dedupe", None)


def _segment_sort(
    keys: torch.Tensor, seg: torch.Tensor, bound: int | None = None, num_segments: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lexicographic (segment, key) order by stable sorts (no hashing).

    Args:
        keys: int64 keys.
        seg: Segment of each key.
        bound: If known, every key is in ``[0, bound)``: when ``num_segments * bound`` fits in
            62 bits, one stable sort of ``seg * bound + key`` gives the same order as the two
            stable sorts (by key, then by segment) used otherwise.
        num_segments: Segments (with ``bound``).

    Returns:
        The order, and the mask of the first occurrence of each (segment, key) in that order
        (stable: it is the key's earliest position in its segment).
    """
    if bound is not None and max(num_segments, 1) * max(bound, 1) < 1 << 62:
        combined = seg * bound + keys
        order = torch.sort(combined, stable=True).indices
        sc = combined[order]
        new = torch.ones_like(sc, dtype=torch.bool)
        new[1:] = sc[1:] != sc[:-1]
        return order, new
    order = torch.sort(keys, stable=True).indices
    order = order[torch.sort(seg[order], stable=True).indices]
    sk, ss = keys[order], seg[order]
    new = torch.ones_like(sk, dtype=torch.bool)
    new[1:] = (sk[1:] != sk[:-1]) | (ss[1:] != ss[:-1])
    return order, new


def _segment_inverse(
    order: torch.Tensor, new: torch.Tensor, seg: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Per key, the index of its distinct value within its segment (ascending key order).

    Args:
        order: From :func:`_segment_sort`.
        new: From :func:`_segment_sort`.
        seg: Segment of each key.
        counts: Distinct keys per segment.

    Returns:
        int64 inverse index.
    """
    rank_sorted = torch.cumsum(new.to(torch.int64), 0) - 1
    inverse = torch.empty_like(rank_sorted)
    inverse[order] = rank_sorted
    return inverse - (torch.cumsum(counts, 0) - counts)[seg]


def _bag_keys(lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A key per bag that is equal exactly for bags that pool to the same vector.

    Args:
        lengths: int64 bag lengths.
        values: int64 ids, ``sum(lengths)`` of them.

    Returns:
        The id of a one-id bag, -1 for an empty bag, a distinct value below -1 for longer bags
        (never equal to another: they are not deduplicated).
    """
    n = lengths.numel()
    first = torch.cumsum(lengths, 0) - lengths
    # An empty feature has no ids to gather (every bag is then empty).
    ids = values[first.clamp(max=values.numel() - 1)] if values.numel() else lengths.new_zeros(n)
    keys = torch.where(lengths == 1, ids, torch.full_like(ids, -1))
    return torch.where(lengths > 1, -2 - torch.arange(n, device=lengths.device), keys)


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
        order, new = _segment_sort(v, seg, bound, num_features)
        num_unique = zeros.scatter_add(0, seg[order], new.to(torch.int64))
        ids = (order, new)
    stats = torch.stack([len_sum, len_max, len_min, id_max, id_min, num_unique], dim=1)
    return _FeatureStats(stats, seg, ids)


def _distinct_bags(
    lengths: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    id_bound: int | None = None,
    with_inverse: bool = True,
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Per segment (one feature of one batch), its distinct bags (:func:`_bag_keys`).

    Used by the owner of the exact output dedupe (first bags) for the segments whose ids did not
    arrive wire-deduplicated (the others take :func:`_first_bags`). It orders the distinct bags
    as the sender's :func:`_bag_inverse` does: ascending key (the empty bag first).

    Args:
        lengths: Bag lengths of each segment.
        values: Ids of each segment.
        id_bound: If known, every id is in ``[0, id_bound)`` (one sort instead of two).
        with_inverse: Also compute the inverse index (else an empty list).

    Returns:
        Per segment: the number of distinct bags (read on the host, once for all), the inverse
        index of every bag, and the first bag of each distinct one.
    """
    counts = [int(t.numel()) for t in lengths]
    lens = torch.cat(list(lengths)).to(torch.int64)
    dev = lens.device
    sizes = torch.tensor(counts, dtype=torch.int64, device=dev)
    seg = torch.repeat_interleave(
        torch.arange(len(counts), device=dev), sizes, output_size=lens.numel()
    )
    keys = _bag_keys(lens, torch.cat(list(values)).to(torch.int64))
    bound = None
    if id_bound is not None:  # shift the keys (>= -1 - lens.numel()) to be >= 0
        keys = keys + (lens.numel() + 1)
        bound = id_bound + lens.numel() + 1
    order, new = _segment_sort(keys, seg, bound, len(counts))
    num = torch.zeros(len(counts), dtype=torch.int64, device=dev)
    num.scatter_add_(0, seg[order], new.to(torch.int64))
    inverse = _segment_inverse(order, new, seg, num).split(counts) if with_inverse else []
    first = order[new]
    first = first - (torch.cumsum(sizes, 0) - sizes)[seg[first]]
    num_host = num.tolist()
    return num_host, list(inverse), list(first.split(num_host))


def _first_bags(
    lengths: Sequence[torch.Tensor], inverses: Sequence[torch.Tensor], num_unique: Sequence[int]
) -> list[torch.Tensor]:
    """The owner's :func:`_distinct_bags` first bags, from the sender's inverse index.

    For segments (one feature of one source) whose bags hold at most one id and whose ids
    arrived as distinct ids plus an inverse index: the sender orders the distinct bags the empty
    one first (if any), then the distinct ids in the order of that same inverse index (its
    ascending (feature, id) sort, see :func:`_bag_inverse`), so the first bag of each distinct
    bag is a segmented minimum over the inverse index, no sort.

    Args:
        lengths: Bag lengths (0 or 1) of each segment.
        inverses: Per segment, the inverse index of its ids over its distinct ids (empty for a
            segment without ids).
        num_unique: Distinct ids of each segment.

    Returns:
        Per segment, the first bag of each distinct bag (``[empty + num_unique]``).
    """
    dev = lengths[0].device
    sizes = [int(t.numel()) for t in lengths]
    n_ids = [int(t.numel()) for t in inverses]
    empty = [int(n < b) for n, b in zip(n_ids, sizes, strict=True)]
    rows = [e + u for e, u in zip(empty, num_unique, strict=True)]
    row_off = list(itertools.accumulate(rows, initial=0))
    bag_off = list(itertools.accumulate(sizes, initial=0))
    total = bag_off[-1]
    # Per segment: its first bag, its first row (the empty bag's) and the row of distinct id 0.
    per_seg = torch.tensor(
        [bag_off[:-1], row_off[:-1], [r + e for r, e in zip(row_off, empty, strict=False)]],
        dtype=torch.int64,
        device=dev,
    )
    bag0, row0 = torch.repeat_interleave(
        per_seg[:2], torch.tensor(sizes, device=dev), dim=1, output_size=total
    )
    local = torch.arange(total, device=dev) - bag0
    target = row0.clone()  # every empty bag is its segment's first row
    id_row = torch.cat(list(inverses)).to(torch.int64) + torch.repeat_interleave(
        per_seg[2], torch.tensor(n_ids, device=dev), output_size=sum(n_ids)
    )
    lens = torch.cat(list(lengths)).to(torch.int64)
    target[torch.repeat_interleave(local + bag0, lens, output_size=sum(n_ids))] = id_row
    first = torch.full((row_off[-1],), total, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, target, local, "amin")
    return list(first.split(rows))


def _encode(
    kjt: KeyedJaggedTensor,
    splits: Sequence[int],
    comms: LossyComms,
    output_dedupe: OutputDedupeMode = None,
) -> _Encoded:
    """Packs one rank's KJT for every destination (features ordered by destination).

    Args:
        kjt: This rank's KJT.
        splits: Features per destination.
        comms: Config (``input_dist``) and telemetry.
        output_dedupe: Cross-side dedupe of features whose bags hold at most one id and no
            weights, where some bags repeat (see :class:`OutputDedupe`): ``"exact"`` keeps the
            KJT whole and marks the feature's distinct bags (``_FeatureMeta.out_rows``);
            ``"lookup"`` sends only the distinct ids of single-hot features
            (``_FeatureMeta.lookup``). Either way the inverse index stays in the result.

    Returns:
        The payloads and metadata.
    """
    config = comms.config.input_dist
    stats_obj = comms.stats
    keys = kjt.keys()
    num_f, batch = len(keys), kjt.stride()
    lengths, values, weights = kjt.lengths(), kjt.values(), kjt.weights_or_none()
    dev = values.device
    start = time.perf_counter()
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
        metas: list[_FeatureMeta] = []
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
                metas.append(_FeatureMeta(0, id_bits, True, uniq, uniq, lookup=True))
                continue
            inv_bits = _bit_length(uniq - 1) if uniq else 0
            # Deduplicate only where distinct ids + inverse index take fewer bits.
            dedupe = config.dedupe and uniq * id_bits + len_sum * inv_bits < len_sum * id_bits
            # Bags of at most one unweighted id that repeat: send back each distinct one once.
            # Distinct bags: with one id per bag the ids; with none, one; with a mix of empty
            # and one-id bags, the empty bag then the ids (see _bag_inverse and _first_bags).
            out_rows = 0
            if exact_out and len_max <= 1:
                bags = uniq if len_min == 1 else uniq + 1 if len_max == 1 else 1
                out_rows = bags if bags < batch else 0
            metas.append(
                _FeatureMeta(
                    len_bits, id_bits, dedupe, len_sum, uniq if dedupe else 0, out_rows=out_rows
                )
            )

        inverse = uniques = None
        uniq_off = list(itertools.accumulate((s[5] for s in stats), initial=0))
        if any(m.dedupe or m.out_rows for m in metas):
            assert fs.ids is not None
            order, new = fs.ids
            inverse = _segment_inverse(order, new, fs.seg, fs.stats[:, 5])
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
                    bag_inv = _bag_inverse(f, stats[f], batch, lens, inverse, val_off)
                    row.append((m.out_rows, bag_inv))
                else:
                    row.append(None)
            expand.append(row)

    _record_encode(kjt, metas, batch, splits, send_words, wire_w, stats, config.dedupe, comms)
    shares = {
        k: batch * lengths.element_size() + st[0] * values.element_size()
        for k, st in zip(keys, stats, strict=True)
    }
    stats_obj.record_time("input", "encode", shares, time.perf_counter() - start)
    return _Encoded(
        send=send,
        send_words=send_words,
        meta=meta,
        meta_splits=meta_splits,
        num_ids_per_dest=[
            sum(m.num_ids for m in metas[feat_off[d] : feat_off[d + 1]]) for d in range(len(splits))
        ],
        expand=expand,
    )


def _bag_inverse(
    f: int,
    st: Sequence[int],
    batch: int,
    lens: torch.Tensor,
    inverse: torch.Tensor | None,
    val_off: Sequence[int],
) -> torch.Tensor:
    """Inverse index of feature ``f``'s bags over its distinct bags (exact output dedupe).

    The distinct bags are the empty bag (if any) then the feature's distinct ids, in the order
    of ``inverse`` (ascending id), as :func:`_first_bags` and :func:`_distinct_bags` order them.

    Args:
        f: Feature.
        st: Its statistics row (length sum, max, min, ...).
        batch: Bags of the feature.
        lens: Bag lengths of every feature (int64).
        inverse: Inverse index of every id over its feature's distinct ids.
        val_off: Offset of each feature's ids.

    Returns:
        int64 ``[batch]``.
    """
    assert inverse is not None
    ids_inv = inverse[val_off[f] : val_off[f + 1]]
    if st[2] == 1:  # one id per bag: bags are ids, in the same ascending order
        return ids_inv
    out = inverse.new_zeros(batch)  # every bag empty: one distinct bag
    if st[1] == 1:  # empty (row 0) and one-id bags
        bag_lens = lens[f * batch : (f + 1) * batch]
        bags = torch.repeat_interleave(
            torch.arange(batch, device=lens.device), bag_lens, output_size=ids_inv.numel()
        )
        out[bags] = ids_inv + 1
    return out


def _record_encode(
    kjt: KeyedJaggedTensor,
    metas: Sequence[_FeatureMeta],
    batch: int,
    splits: Sequence[int],
    send_words: Sequence[int],
    wire_w: torch.dtype | None,
    stats: Sequence[Sequence[int]],
    dedupe: bool,
    comms: LossyComms,
) -> None:
    """Telemetry: raw (TorchRec's tensors) vs wire bytes per feature, padding, metadata, repeats."""
    s = comms.stats
    keys = kjt.keys()
    weights = kjt.weights_or_none()
    len_e, val_e = kjt.lengths().element_size(), kjt.values().element_size()
    w_e = weights.element_size() if weights is not None else 0
    wire_e = torch.empty(0, dtype=wire_w).element_size() if wire_w is not None else 0
    feature_wire = 0
    for key, m, st in zip(keys, metas, stats, strict=True):
        raw = batch * len_e + st[0] * (val_e + w_e)
        wire = m.packed_bits(batch) // 8 + m.num_ids * wire_e
        feature_wire += wire
        s.record_block("input", key, raw, wire, 0.0, 0.0)
        if dedupe or m.lookup:
            s.record_ids("input", key, st[0], st[0] - st[5])
    # Word padding of the payloads belongs to no feature.
    s.record_container("input", 4 * sum(send_words) - feature_wire)
    # Metadata exchange vs TorchRec's splits exchange (lengths, values, [weights], stride).
    torchrec_rows = 3 + (weights is not None)
    meta_rows = sum(_HEADER + _PER_FEATURE * n for n in splits)
    s.record_block("input", SPLITS, 8 * torchrec_rows * len(splits), 8 * meta_rows, 0.0, 0.0)


# ---------------------------------------------------------------------------------------------
# Decode.


def _decode(
    recv: torch.Tensor,
    recv_words: Sequence[int],
    metas_per_src: Sequence[Sequence[_FeatureMeta]],
    batch_per_src: Sequence[int],
    codes: Sequence[int],
    keys: Sequence[str],
    my_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[list[torch.Tensor | None]]]:
    """Unpacks every source's payload into TorchRec's (lengths, values, weights) output tensors.

    Returns:
        lengths, values, weights (None if unweighted), and per source, per feature, the bags
        whose pooled rows the exact output dedupe sends back (None where not deduplicated).
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
        ok = (_checksums(recv, recv_words) == _stored_checksums(recv, recv_words)).tolist()
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
            firsts += _first_bags(
                [lengths[i] for _, i, _, _, _ in out_inv],
                [inv for _, _, _, inv, _ in out_inv],
                [u for _, _, _, _, u in out_inv],
            )
        if out_segs:
            firsts += _distinct_bags(
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
    return out_lengths, out_values, out_weights, selects


# ---------------------------------------------------------------------------------------------
# Awaitables and modules.


class LossyKJTAllToAllTensorsAwaitable(KJTAllToAllTensorsAwaitable):
    """Second step: waits for the packed payloads and decodes them into the local KJT.

    A ``KJTAllToAllTensorsAwaitable`` (TorchRec's sharding contexts read its ``_stride_per_rank``
    and ``_recat``), but its collectives were launched by :class:`LossyKJTAllToAllSplitsAwaitable`.

    Args:
        pg: Process group.
        input: The sender's KJT.
        splits: Features per destination rank.
        keys: Local keys after the all-to-all.
        recv: Receive buffer (int32 words) of the payload exchange.
        recv_words: Words from each source.
        work: The payload exchange.
        metas_per_src: Per source, per local feature, its format.
        stride_per_rank: Batch size of every source.
        codes: Per source, its dtype codes.
        input_splits: Ids sent to each rank (TorchRec's ``values`` splits).
        output_splits: Ids received from each rank.
        comms: Shared state (telemetry).
        output_dedupe: The call's cross-side dedupe state; the decode fills in the owner's
            bag selection of the exact mode.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        input: KeyedJaggedTensor,
        splits: list[int],
        keys: list[str],
        recv: torch.Tensor,
        recv_words: list[int],
        work: dist.Work | None,
        metas_per_src: list[list[_FeatureMeta]],
        stride_per_rank: list[int],
        codes: list[int],
        input_splits: list[int],
        output_splits: list[int],
        comms: LossyComms,
        output_dedupe: OutputDedupe | None = None,
    ) -> None:
        Awaitable.__init__(self)  # no TorchRec collectives: only its attributes
        self._workers = pg.size()
        self._pg = pg
        self._device = recv.device
        self._input = input
        self._splits = splits
        self._keys = keys
        self._stagger = 1
        self._stride_per_rank = stride_per_rank
        self._input_splits = {"values": input_splits}
        self._output_splits = {"values": output_splits}
        self._recat = _get_recat(
            local_split=splits[pg.rank()],
            num_splits=len(splits),
            stagger=1,
            device=recv.device,
            batch_size_per_rank=stride_per_rank,
        )
        self._recv = recv
        self._recv_words = recv_words
        self._work = work
        self._metas_per_src = metas_per_src
        self._codes = codes
        self._comms = comms
        self._output_dedupe = output_dedupe

    def clear_inputs(self) -> int:
        """Waits for the exchange; the sender's packed words are already the only copy.

        Returns:
            0: the input KJT's storage is left to its owner.
        """
        if self._work is not None:
            self._work.wait()
        return 0

    def _wait_impl(self) -> KeyedJaggedTensor:
        if self._work is not None:
            with record_function("## lossy_input payload wait ##"):
                self._work.wait()
        start = time.perf_counter()
        recv, recv_words = self._recv, self._recv_words
        hook = self._comms.payload_hook
        if hook is not None:  # sees each source's payload, as on the output side
            parts = [
                hook("input", src, p) for src, p in enumerate(torch.split(recv, list(recv_words)))
            ]
            recv_words = [int(p.numel()) for p in parts]
            recv = torch.cat(parts) if parts else recv
        with record_function("## lossy_input decode ##"):
            tensors = _decode(
                recv,
                recv_words,
                self._metas_per_src,
                self._stride_per_rank,
                self._codes,
                self._keys,
                self._pg.rank(),
            )
        lengths, values, weights, selects = tensors
        if self._output_dedupe is not None and not self._output_dedupe.sum_grads:
            self._output_dedupe.select = selects
        shares = {k: 1 for k in self._keys}
        self._comms.stats.record_time("input", "decode", shares, time.perf_counter() - start)
        return KeyedJaggedTensor.dist_init(
            keys=self._keys,
            tensors=[lengths, values] + ([weights] if weights is not None else []),
            variable_stride_per_key=False,
            num_workers=self._workers,
            recat=self._recat,
            stride_per_rank=self._stride_per_rank,
            stagger=1,
        )


class LossyKJTAllToAllSplitsAwaitable(Awaitable[KJTAllToAllTensorsAwaitable]):
    """First step: encodes and exchanges the metadata; its wait launches the payload exchange.

    Args:
        pg: Process group.
        input: This rank's KJT, features ordered by destination.
        splits: Features per destination rank.
        keys: Local keys after the all-to-all.
        comms: Shared config and telemetry.
        output_dedupe: Cross-side deduplication mode (see :class:`OutputDedupe`; the output
            dist must be the lossy one, which reads it from the sharding context).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        input: KeyedJaggedTensor,
        splits: list[int],
        keys: list[str],
        comms: LossyComms,
        output_dedupe: OutputDedupeMode = None,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._input = input
        self._splits = splits
        self._keys = keys
        self._comms = comms
        self._output_dedupe = output_dedupe
        self._enc = _encode(input, splits, comms, output_dedupe)
        world = pg.size()
        self._recv_meta_splits = [_HEADER + _PER_FEATURE * len(keys)] * world
        self._recv_meta = torch.empty(
            sum(self._recv_meta_splits), dtype=torch.int64, device=self._enc.meta.device
        )
        with record_function("## lossy_input splits ##"):
            self._meta_work = dist.all_to_all_single(
                self._recv_meta,
                self._enc.meta,
                self._recv_meta_splits,
                self._enc.meta_splits,
                group=pg,
                async_op=True,
            )

    def _wait_impl(self) -> KJTAllToAllTensorsAwaitable:
        with record_function("## lossy_input splits ##"):
            self._meta_work.wait()
            meta = self._recv_meta.tolist()  # the host read of the splits exchange
        n = _HEADER + _PER_FEATURE * len(self._keys)
        recv_words, strides, codes, metas_per_src, output_splits = [], [], [], [], []
        for src in range(self._pg.size()):
            row = meta[src * n : (src + 1) * n]
            recv_words.append(row[0])
            strides.append(row[1])
            codes.append(row[2])
            fm = [
                _FeatureMeta.from_words(
                    row[_HEADER + i * _PER_FEATURE : _HEADER + (i + 1) * _PER_FEATURE]
                )
                for i in range(len(self._keys))
            ]
            metas_per_src.append(fm)
            output_splits.append(sum(m.num_ids for m in fm))
        stride_per_rank = _Strides(strides)
        recv_rows = [
            [m.num_unique if m.lookup else (m.out_rows or None) for m in fm] for fm in metas_per_src
        ]
        dedupe = None
        if any(r is not None for rows in recv_rows for r in rows) or any(
            x is not None for row in self._enc.expand for x in row
        ):
            dedupe = OutputDedupe(
                recv_rows, self._enc.expand, sum_grads=self._output_dedupe == "lookup"
            )
            stride_per_rank.output_dedupe = dedupe
        send = self._enc.send
        recv = torch.empty(sum(recv_words), dtype=torch.int32, device=send.device)
        with record_function("## lossy_input payload ##"):
            work = dist.all_to_all_single(
                recv, send, recv_words, self._enc.send_words, group=self._pg, async_op=True
            )
        return LossyKJTAllToAllTensorsAwaitable(
            pg=self._pg,
            input=self._input,
            splits=self._splits,
            keys=self._keys,
            recv=recv,
            recv_words=recv_words,
            work=work,
            metas_per_src=metas_per_src,
            stride_per_rank=stride_per_rank,
            codes=codes,
            input_splits=self._enc.num_ids_per_dest,
            output_splits=output_splits,
            comms=self._comms,
            output_dedupe=dedupe,
        )


class LossyKJTAllToAll(KJTAllToAll):
    """Drop-in for TorchRec's ``KJTAllToAll`` with bit-packed, optionally deduplicated ids.

    A ``KJTAllToAll`` subclass. TorchRec's train pipelines (``TrainPipelineSparseDist`` and the
    pipelines built on ``_override_input_dist_forwards``) replace each input dist's
    ``_dist.forward`` with their fused-splits ``KJTAllToAllForward``; the lossy input dist calls
    :meth:`packed` instead of ``forward``, so it stays packed under them (its splits exchange is
    then simply not fused with TorchRec's, which the pipeline supports for any awaitable that is
    not a ``KJTSplitsAllToAllMeta``).

    Args:
        pg: Process group.
        splits: Features sent to each rank (the input KJT is ordered by destination).
        comms: Shared config (``config.input_dist``) and telemetry.
        output_dedupe: Cross-side deduplication (see :class:`OutputDedupe`): ``"exact"`` leaves
            the KJT bit-identical; ``"lookup"`` makes deduplicated features hold distinct ids,
            then empty bags. Either way the result must feed the lossy output dist, which reads
            the state from the sharding context. None: off.

    Example::

        a2a = LossyKJTAllToAll(pg, splits=[2, 1], comms=comms)
        kjt = a2a(local_kjt).wait().wait()  # bit-identical to KJTAllToAll's result
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        splits: list[int],
        comms: LossyComms,
        output_dedupe: OutputDedupeMode = None,
    ) -> None:
        if len(splits) != pg.size():
            raise ValueError(f"{len(splits)} splits for a process group of {pg.size()} ranks")
        super().__init__(pg, list(splits))
        self._comms = comms
        self._output_dedupe: OutputDedupeMode = output_dedupe

    def forward(self, input: KeyedJaggedTensor) -> Awaitable[KJTAllToAllTensorsAwaitable]:
        """Sends each rank its features, packed (see :meth:`packed`).

        Args:
            input: KJT whose keys are ordered by destination rank.

        Returns:
            Awaitable of an awaitable of the local KJT (as ``KJTAllToAll``).
        """
        return self.packed(input)

    def packed(self, input: KeyedJaggedTensor) -> Awaitable[KJTAllToAllTensorsAwaitable]:
        """Sends each rank its features, packed; TorchRec's path for the inputs it cannot pack.

        Not ``forward``, so that a train pipeline's override of ``forward`` does not bypass it.

        Args:
            input: KJT whose keys are ordered by destination rank.

        Returns:
            Awaitable of an awaitable of the local KJT (as ``KJTAllToAll``).
        """
        weights = input.weights_or_none()
        if (
            self._pg.size() == 1
            or input.variable_stride_per_key()
            or (weights is not None and weights.dim() != 1)
        ):
            return KJTAllToAll.forward(self, input)
        with torch.no_grad():
            if len(input.keys()) != self._splits_cumsum[-1]:
                raise ValueError(
                    f"KJT has {len(input.keys())} keys, the splits {self._splits} "
                    f"{self._splits_cumsum[-1]}"
                )
            rank = self._pg.rank()
            keys = input.keys()[self._splits_cumsum[rank] : self._splits_cumsum[rank + 1]]
            return LossyKJTAllToAllSplitsAwaitable(
                self._pg, input, self._splits, keys, self._comms, self._output_dedupe
            )


class LossyTwSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """``TwSparseFeaturesDist`` (also used by CW and TWCW) over :class:`LossyKJTAllToAll`.

    Args:
        pg: Process group.
        features_per_rank: Features sent to each rank.
        comms: Shared state of the sharded module.
        output_dedupe: Cross-side deduplication mode (see :class:`LossyKJTAllToAll`).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        features_per_rank: list[int],
        comms: LossyComms,
        output_dedupe: OutputDedupeMode = None,
    ) -> None:
        super().__init__()
        self._dist = LossyKJTAllToAll(pg, features_per_rank, comms, output_dedupe)

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Packed all-to-all of the sparse features (also under TorchRec's train pipelines).

        Args:
            sparse_features: Features ordered by destination rank.

        Returns:
            Awaitable of an awaitable of the local KJT.
        """
        return self._dist.packed(sparse_features)
