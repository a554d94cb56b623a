"""The compiled CPU path of the KJT codec: a few numba calls per encode or decode.

:mod:`torchrec_lossy.distributed.kjt_codec` plans every payload (per-feature formats, the bit
layout of its sections, the metadata) and, for CPU tensors, runs the tensor work here instead of
tens of small torch ops, whose dispatch dominates on the input dist's small KJTs. The words and
tensors are those of its torch path (the device path and the test oracle):

- :func:`feature_stats` (sender): per-feature statistics and, for deduplication, each feature's
  distinct ids in ascending order with the inverse index (one radix sort of all ids by
  (feature, id, position), the order of ``dedupe.segment_sort``).
- :func:`pack` (sender): packs the sections, copies the weights' bytes, writes the checksums.
- :func:`decode` (receiver): checks the checksums, unpacks and expands the ids, and finds the
  first bag of each distinct bag of the exact output dedupe (``dedupe.first_bags`` from an
  inverse index, ``dedupe.distinct_bags`` by the sort otherwise).

Sections are rows of an int64 table (:data:`SECTION_COLUMNS`): ``count`` fields of ``width``
bits (1..32) from bit ``bit`` on, each the ``shift``-ed part of an element of one array.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numba
import numpy as np
import torch

from torchrec_lossy.codec.format import checksum_words

# What a section reads (encode) or writes (decode).
LENGTHS = 0  # bag lengths
IDS = 1  # ids, in the order the KJT holds them
UNIQUE = 2  # a deduplicated feature's distinct ids
INVERSE = 3  # per id, the index of its distinct id
SECTION_COLUMNS = ("array", "start", "count", "width", "shift", "bit")
# Per feature of a decode: how its ids are completed after unpacking.
PLAIN = 0  # the ids arrived as they are
DEDUPED = 1  # ids = distinct ids [inverse index]
LOOKUP = 2  # single-hot distinct ids: the first num_unique bags hold one id each
FEATURE_COLUMNS = ("kind", "len_start", "batch", "val_start", "num_ids", "uniq_start", "num_unique")
# Per segment of the exact output dedupe: its distinct bags come from the inverse index or a sort.
BY_INVERSE = 0
BY_SORT = 1
SEGMENT_COLUMNS = ("kind", "len_start", "batch", "val_start", "num_ids", "num_unique")

# Why :func:`decode` refused a feature.
BAD_LENGTHS = 1  # its lengths do not sum to its ids
BAD_INVERSE = 2  # its inverse index points past its distinct ids

_DIGIT_BITS = 11  # radix sort digit: 2048 buckets, two passes for 22-bit (feature, id) keys
_MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Kernels.


@numba.njit(cache=True, nogil=True, inline="always")
def _bit_length(x: np.uint64) -> int:
    """Bits of ``x`` (0 for 0), as ``int.bit_length``."""
    n = 0
    while n < 64 and (x >> np.uint64(n)) != 0:
        n += 1
    return n


@numba.njit(cache=True, nogil=True)
def _segment_order(keys: np.ndarray, seg_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The stable (segment, key) order of keys whose segments are contiguous ranges.

    Where (segment, key - min key, position) packs into 64 bits (ids below about 2**45 in
    practice), one LSD radix sort of the packed records; otherwise a merge sort per segment.

    Args:
        keys: int64 keys.
        seg_start: int64 ``[S + 1]`` first key of each segment, then ``keys.shape[0]``.

    Returns:
        int64 positions in sorted order, and the keys in that order.
    """
    n = keys.shape[0]
    nseg = seg_start.shape[0] - 1
    lo, hi = keys[0], keys[0]
    for i in range(1, n):
        lo, hi = min(lo, keys[i]), max(hi, keys[i])
    key_bits = _bit_length(np.uint64(hi) - np.uint64(lo))  # wraps: exact for any range
    pos_bits = _bit_length(np.uint64(n - 1))
    sort_bits = key_bits + _bit_length(np.uint64(nseg - 1))
    order = np.empty(n, np.int64)
    if sort_bits + pos_bits > 64:
        for s in range(nseg):
            a, b = seg_start[s], seg_start[s + 1]
            order[a:b] = a + np.argsort(keys[a:b], kind="mergesort")
        return order, keys[order]
    # Records are distinct (their positions differ), so sorting by the bits above the
    # position is the full (segment, key, position) order.
    passes = (sort_bits + _DIGIT_BITS - 1) // _DIGIT_BITS
    digit = np.uint64((1 << _DIGIT_BITS) - 1)
    hist = np.zeros((passes, (1 << _DIGIT_BITS) + 1), np.int64)
    rec = np.empty(n, np.uint64)
    for s in range(nseg):
        for i in range(seg_start[s], seg_start[s + 1]):
            k = (np.uint64(s) << np.uint64(key_bits)) | (np.uint64(keys[i]) - np.uint64(lo))
            r = (k << np.uint64(pos_bits)) | np.uint64(i)
            rec[i] = r
            for p in range(passes):
                shift = np.uint64(pos_bits + p * _DIGIT_BITS)
                hist[p, np.int64((r >> shift) & digit) + 1] += 1
    tmp = np.empty(n, np.uint64)
    for p in range(passes):
        h = hist[p]
        for d in range(1 << _DIGIT_BITS):
            h[d + 1] += h[d]
        shift = np.uint64(pos_bits + p * _DIGIT_BITS)
        for j in range(n):
            d = np.int64((rec[j] >> shift) & digit)
            tmp[h[d]] = rec[j]
            h[d] += 1
        rec, tmp = tmp, rec
    pos_mask = np.uint64((1 << pos_bits) - 1)
    key_mask = np.uint64((1 << key_bits) - 1)
    sorted_keys = np.empty(n, np.int64)
    for j in range(n):
        order[j] = np.int64(rec[j] & pos_mask)
        sorted_keys[j] = np.int64(((rec[j] >> np.uint64(pos_bits)) & key_mask) + np.uint64(lo))
    return order, sorted_keys


@numba.njit(cache=True, nogil=True)
def _distinct(
    keys: np.ndarray,
    seg_start: np.ndarray,
    counts: np.ndarray,
    uniques: np.ndarray,
    inverse: np.ndarray,
    first: np.ndarray,
) -> int:
    """Per segment (contiguous ranges of ``keys``), its distinct keys in ascending order.

    Args:
        keys: int64 keys.
        seg_start: int64 ``[S + 1]`` first key of each segment, then ``keys.shape[0]``.
        counts: Out, ``[S]``: distinct keys per segment.
        uniques: Out, ``[>= total distinct]``: every segment's distinct keys in ascending order,
            segments back to back.
        inverse: Out, ``[keys]``: per key, the index of its distinct key within its segment.
        first: Out, like ``uniques``: per distinct key, its first position in its segment.

    Returns:
        Distinct keys of all segments.
    """
    if keys.shape[0] == 0:
        counts[:] = 0
        return 0
    order, sorted_keys = _segment_order(keys, seg_start)
    u = 0
    for s in range(seg_start.shape[0] - 1):
        a = seg_start[s]
        c = 0
        for j in range(a, seg_start[s + 1]):
            if c == 0 or sorted_keys[j] != sorted_keys[j - 1]:
                uniques[u] = sorted_keys[j]
                first[u] = order[j] - a
                u += 1
                c += 1
            inverse[order[j]] = c - 1
        counts[s] = c
    return u


@numba.njit(cache=True, nogil=True)
def _stats_kernel(
    lengths: np.ndarray,
    values: np.ndarray,
    batch: int,
    dedupe: bool,
    stats: np.ndarray,
    uniques: np.ndarray,
    inverse: np.ndarray,
) -> int:
    """Fills ``stats`` ``[F, 6]`` (length sum, max, min; id max, min; distinct ids).

    Args:
        lengths: int64 ``[F * batch]``.
        values: int64 ids.
        batch: Bags per feature.
        dedupe: Also find each feature's distinct ids (:func:`_distinct`).
        stats: Out, zeroed.
        uniques: Out, ``[ids]``: the features' distinct ids, back to back.
        inverse: Out, ``[ids]``: per id, the index of its distinct id in its feature.

    Returns:
        Distinct ids written to ``uniques`` (0 without ``dedupe``, or where a length or an id is
        negative: the caller refuses the KJT), or -1 if the lengths do not sum to the ids.
    """
    num_f = stats.shape[0]
    seg_start = np.zeros(num_f + 1, np.int64)
    negative = False
    for f in range(num_f):
        total, hi, lo = 0, 0, 0
        for b in range(batch):
            x = lengths[f * batch + b]
            total += x
            hi = x if b == 0 else max(hi, x)
            lo = x if b == 0 else min(lo, x)
        stats[f, 0], stats[f, 1], stats[f, 2] = total, hi, lo
        seg_start[f + 1] = seg_start[f] + total
        negative |= lo < 0
    if negative:
        return 0
    if seg_start[num_f] != values.shape[0]:
        return -1
    for f in range(num_f):
        hi, lo = 0, 0
        for i in range(seg_start[f], seg_start[f + 1]):
            x = values[i]
            hi = x if i == seg_start[f] else max(hi, x)
            lo = x if i == seg_start[f] else min(lo, x)
        stats[f, 3], stats[f, 4] = hi, lo
        negative |= lo < 0
    if not dedupe or negative:
        return 0
    counts = np.empty(num_f, np.int64)
    first = np.empty(values.shape[0], np.int64)
    u = _distinct(values, seg_start, counts, uniques, inverse, first)
    stats[:, 5] = counts
    return u


@numba.njit(cache=True, nogil=True, inline="always")
def _sign(words: np.ndarray, ends: np.ndarray, write: bool) -> int:
    """Writes or verifies each payload's trailing checksum (``format.checksum_words`` over its
    words but the last two, then its low and high 32 bits).

    Args:
        words: uint32 words of the payloads, back to back.
        ends: int64 end word of each payload (each of at least two words).
        write: Write the checksums (else compare with the stored ones).

    Returns:
        The first payload whose stored checksum does not match, or -1.
    """
    start = 0
    for p in range(ends.shape[0]):
        end = ends[p]
        acc = checksum_words(words[start : end - 2])
        lo = np.uint32(acc & np.uint64(_MASK32))
        hi = np.uint32(acc >> np.uint64(32))
        if write:
            words[end - 2], words[end - 1] = lo, hi
        elif words[end - 2] != lo or words[end - 1] != hi:
            return p
        start = end
    return -1


@numba.njit(cache=True, nogil=True)
def _pack_kernel(
    out: np.ndarray,
    sections: np.ndarray,
    lengths: np.ndarray,
    values: np.ndarray,
    uniques: np.ndarray,
    inverse: np.ndarray,
    out_bytes: np.ndarray,
    weight_bytes: np.ndarray,
    weight_slots: np.ndarray,
    ends: np.ndarray,
    checksum: bool,
) -> None:
    """Packs every section into the zeroed ``out``, copies the weights, writes the checksums.

    Args:
        out: uint32 words of all payloads, zeroed.
        sections: ``[S, 6]`` (:data:`SECTION_COLUMNS`).
        lengths: int64 bag lengths (array :data:`LENGTHS`).
        values: int64 ids (:data:`IDS`).
        uniques: int64 distinct ids (:data:`UNIQUE`).
        inverse: int64 inverse index (:data:`INVERSE`).
        out_bytes: ``out`` as bytes.
        weight_bytes: The weights' bytes in their wire dtype.
        weight_slots: ``[P, 3]``: per payload with weights, its first weight byte in
            ``out_bytes``, its first byte in ``weight_bytes``, its bytes.
        ends: int64 end word of each payload.
        checksum: Write each payload's checksum into its last two words.
    """
    for s in range(sections.shape[0]):
        array, start, count, width, shift, bit = sections[s]
        src = (lengths, values, uniques, inverse)[array]
        mask = (1 << width) - 1
        word, off = bit >> 5, bit & 31
        acc = np.int64(out[word])  # the previous section's bits below ``off``
        for i in range(start, start + count):
            acc |= ((src[i] >> shift) & mask) << off  # < 2**63: off < 32, field <= 32 bits
            off += width
            if off >= 32:
                out[word] = np.uint32(acc & _MASK32)
                word += 1
                acc >>= 32
                off -= 32
        if off:
            out[word] = np.uint32(acc & _MASK32)
    for k in range(weight_slots.shape[0]):
        at, first, n = weight_slots[k]
        out_bytes[at : at + n] = weight_bytes[first : first + n]
    if checksum:
        _sign(out, ends, True)


@numba.njit(cache=True, nogil=True)
def _unpack_kernel(
    words: np.ndarray,
    sections: np.ndarray,
    features: np.ndarray,
    lengths: np.ndarray,
    values: np.ndarray,
    uniques: np.ndarray,
    inverse: np.ndarray,
) -> tuple[int, int]:
    """Unpacks every section into the zeroed outputs, then completes each feature's ids.

    Args:
        words: uint32 words of the payloads.
        sections: ``[S, 6]`` (:data:`SECTION_COLUMNS`), ``array`` naming the output.
        features: ``[F, 7]`` (:data:`FEATURE_COLUMNS`).
        lengths: Out (:data:`LENGTHS`).
        values: Out (:data:`IDS`).
        uniques: Out, scratch (:data:`UNIQUE`).
        inverse: Out (:data:`INVERSE`, at the ids' positions).

    Returns:
        (-1, 0), or the first feature row whose lengths do not sum to its ids (reason
        :data:`BAD_LENGTHS`) or whose inverse index points past its distinct ids
        (:data:`BAD_INVERSE`).
    """
    outs = (lengths, values, uniques, inverse)  # indexed by LENGTHS, IDS, UNIQUE, INVERSE
    for s in range(sections.shape[0]):
        array, start, count, width, shift, bit = sections[s]
        dst = outs[array]
        mask = (1 << width) - 1
        word = bit >> 5
        acc = np.int64(words[word]) >> (bit & 31)
        have = 32 - (bit & 31)
        word += 1
        for i in range(start, start + count):
            if have < width:  # reads no word past the section's last
                acc |= np.int64(words[word]) << have
                word += 1
                have += 32
            dst[i] |= (acc & mask) << shift
            acc >>= width
            have -= width
    for r in range(features.shape[0]):
        kind, len_start, batch, val_start, num_ids, uniq_start, num_unique = features[r]
        if kind == LOOKUP:
            lengths[len_start : len_start + num_unique] = 1
        elif lengths[len_start : len_start + batch].sum() != num_ids:
            return r, BAD_LENGTHS
        elif kind == DEDUPED:
            for i in range(val_start, val_start + num_ids):
                j = inverse[i]
                if j >= num_unique:
                    return r, BAD_INVERSE
                values[i] = uniques[uniq_start + j]
    return -1, 0


@numba.njit(cache=True, nogil=True)
def _first_bags_kernel(
    segments: np.ndarray, lengths: np.ndarray, values: np.ndarray, inverse: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per segment, the first bag of each distinct bag (see :func:`decode`).

    Every segment's lengths must sum to its ids (:func:`_unpack_kernel` checks it).

    Args:
        segments: ``[G, 6]`` (:data:`SEGMENT_COLUMNS`).
        lengths: int64 bag lengths of every feature.
        values: int64 ids of every feature.
        inverse: int64 inverse index at the ids of deduplicated features.

    Returns:
        Every segment's first bags, back to back, and the number of each segment's.
    """
    nseg = segments.shape[0]
    rows = np.zeros(nseg, np.int64)
    out_start = np.zeros(nseg + 1, np.int64)
    for g in range(nseg):
        kind, _, batch, _, num_ids, num_unique = segments[g]
        if kind == BY_INVERSE:
            rows[g] = (1 if num_ids < batch else 0) + num_unique
        out_start[g + 1] = out_start[g] + max(batch, rows[g])
    first = np.empty(out_start[nseg], np.int64)
    # By inverse (``dedupe.first_bags``): bag b maps to row 0 if empty (the empty bag comes
    # first when there is one), to row ``empty + inverse`` otherwise; unmapped rows hold the
    # total bag count of these segments, as there.
    unmapped = 0
    for g in range(nseg):
        if segments[g, 0] == BY_INVERSE:
            unmapped += segments[g, 2]
    # By sort (``dedupe.distinct_bags``): a bag's key is its id if it holds one, -1 if empty and
    # below -1 (distinct per bag, over all these segments) if longer.
    keys = np.empty(out_start[nseg], np.int64)
    sorted_segs = np.empty(nseg, np.int64)  # the BY_SORT segments, their keys back to back
    sort_start = np.zeros(nseg + 1, np.int64)
    k = 0
    for g in range(nseg):
        kind, len_start, batch, val_start, num_ids, num_unique = segments[g]
        at = val_start
        if kind == BY_INVERSE:
            empty = 1 if num_ids < batch else 0
            out = first[out_start[g] : out_start[g + 1]]
            out[: rows[g]] = unmapped
            for b in range(batch):
                n = lengths[len_start + b]
                row = 0 if n == 0 else empty + inverse[at + n - 1]
                out[row] = min(out[row], b)
                at += n
        else:
            n_sort = sort_start[k]
            for b in range(batch):
                n = lengths[len_start + b]
                keys[n_sort + b] = values[at] if n == 1 else -1 if n == 0 else -2 - (n_sort + b)
                at += n
            sorted_segs[k] = g
            sort_start[k + 1] = n_sort + batch
            k += 1
    if k:
        n_sort = sort_start[k]
        counts = np.empty(k, np.int64)
        firsts = np.empty(n_sort, np.int64)
        scratch = np.empty(n_sort, np.int64)
        _distinct(keys[:n_sort], sort_start[: k + 1], counts, scratch, scratch.copy(), firsts)
        at = 0
        for j in range(k):
            g = sorted_segs[j]
            rows[g] = counts[j]
            first[out_start[g] : out_start[g] + counts[j]] = firsts[at : at + counts[j]]
            at += counts[j]
    at = 0
    for g in range(nseg):  # back to back (a forward copy: ``at <= out_start[g]``)
        for j in range(rows[g]):
            first[at + j] = first[out_start[g] + j]
        at += rows[g]
    return first[:at], rows


@numba.njit(cache=True, nogil=True)
def _decode_kernel(
    words: np.ndarray,
    ends: np.ndarray,
    checksum: bool,
    sections: np.ndarray,
    features: np.ndarray,
    segments: np.ndarray,
    lengths: np.ndarray,
    values: np.ndarray,
    uniques: np.ndarray,
    inverse: np.ndarray,
) -> tuple[int, int, int, np.ndarray, np.ndarray]:
    """Verifies the checksums, unpacks, and finds the exact output dedupe's first bags.

    Args:
        words: uint32 words of the payloads.
        ends: int64 end word of each payload.
        checksum: Verify the payloads' checksums first.
        sections: As :func:`_unpack_kernel`.
        features: As :func:`_unpack_kernel`.
        segments: As :func:`_first_bags_kernel`.
        lengths: Out, zeroed.
        values: Out, zeroed.
        uniques: Scratch, zeroed.
        inverse: Scratch, zeroed.

    Returns:
        The first payload whose checksum does not match (or -1); the first feature row that does
        not match its format (or -1) and why; then, if both are -1, the first bags and their
        counts (:func:`_first_bags_kernel`), else empty arrays.
    """
    none = np.zeros(0, np.int64)
    if checksum:
        bad = _sign(words, ends, False)
        if bad >= 0:
            return bad, -1, 0, none, none
    row, why = _unpack_kernel(words, sections, features, lengths, values, uniques, inverse)
    if row >= 0:
        return -1, row, why, none, none
    first, counts = _first_bags_kernel(segments, lengths, values, inverse)
    return -1, -1, 0, first, counts


# ---------------------------------------------------------------------------------------------
# Wrappers.


class HostStats(NamedTuple):
    """Per-feature statistics of one KJT and its per-feature distinct ids (see
    :func:`feature_stats`).

    Attributes:
        stats: Per feature: length sum, max, min; id max, min; distinct ids (0 without dedupe).
        uniques: int64, every feature's distinct ids in ascending order, features in order.
        inverse: int64, per id, the index of its distinct id within its feature.
    """

    stats: list[list[int]]
    uniques: torch.Tensor
    inverse: torch.Tensor


def feature_stats(
    lengths: torch.Tensor, values: torch.Tensor, num_features: int, batch: int, dedupe: bool
) -> HostStats:
    """Per-feature statistics, and with ``dedupe`` the per-feature distinct ids (CPU tensors).

    Args:
        lengths: The KJT's lengths as int64, ``[F * batch]``.
        values: Its ids as int64.
        num_features: F.
        batch: Its stride.
        dedupe: Also find each feature's distinct ids and the inverse index.

    Returns:
        The statistics and, with ``dedupe``, the distinct ids and inverse index (empty
        otherwise, or when an id or a length is negative: the caller refuses such a KJT).

    Raises:
        ValueError: If the lengths are not ``F * batch`` or do not sum to the number of ids.
    """
    # Contiguous: a strided array would make numba compile another specialization.
    lens, ids = lengths.contiguous().numpy(), values.contiguous().numpy()
    if lens.shape[0] != num_features * batch:
        raise ValueError(
            f"lossy input dist: the KJT has {lens.shape[0]} lengths for {num_features} features "
            f"of stride {batch}; pass a KJT with one length per feature and sample"
        )
    stats = np.zeros((num_features, 6), np.int64)
    uniques = np.empty(ids.shape[0] if dedupe else 0, np.int64)
    inverse = np.zeros(ids.shape[0] if dedupe else 0, np.int64)
    num_unique = _stats_kernel(lens, ids, batch, dedupe, stats, uniques, inverse)
    if num_unique < 0:
        raise ValueError(
            f"lossy input dist: the KJT's lengths sum to {int(stats[:, 0].sum())} but it holds "
            f"{ids.shape[0]} ids; pass a KJT whose lengths match its values"
        )
    return HostStats(
        stats.tolist(), torch.from_numpy(uniques[:num_unique]), torch.from_numpy(inverse)
    )


def pack(
    sections: Sequence[int],
    num_words: int,
    lengths: torch.Tensor,
    values: torch.Tensor,
    uniques: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor | None,
    weight_slots: Sequence[tuple[int, int, int]],
    send_words: Sequence[int],
    checksum: bool,
) -> torch.Tensor:
    """Packs one rank's payloads (``kjt_codec.pack_bits`` of every section, then the weights and
    the checksums) in one compiled call.

    Args:
        sections: Rows of :data:`SECTION_COLUMNS`, flat; ``array`` is :data:`LENGTHS`,
            :data:`IDS`, :data:`UNIQUE` or :data:`INVERSE`, ``start`` an element of it.
        num_words: Words of all payloads.
        lengths: int64 bag lengths of the KJT.
        values: int64 ids.
        uniques: int64 distinct ids (:func:`feature_stats`).
        inverse: int64 inverse index (:func:`feature_stats`).
        weights: The weights, already in their wire dtype (None: unweighted).
        weight_slots: Per payload with weights: (first word, first weight, weights).
        send_words: Words of each payload.
        checksum: The payloads end with their checksum (two words).

    Returns:
        int32 ``[num_words]``.
    """
    out = np.zeros(num_words, np.uint32)
    if weights is None:
        w_bytes = np.zeros(0, np.uint8)
        slots = np.zeros((0, 3), np.int64)
    else:
        w_bytes = weights.contiguous().view(-1).view(torch.uint8).numpy()
        esize = weights.element_size()
        slots = np.array(
            [(4 * at, esize * first, esize * n) for at, first, n in weight_slots], np.int64
        ).reshape(-1, 3)
    _pack_kernel(
        out,
        np.array(sections, np.int64).reshape(-1, len(SECTION_COLUMNS)),
        lengths.contiguous().numpy(),
        values.contiguous().numpy(),
        uniques.numpy(),
        inverse.numpy(),
        out.view(np.uint8),
        w_bytes,
        slots,
        np.cumsum(np.asarray(send_words, np.int64)),
        checksum,
    )
    return torch.from_numpy(out.view(np.int32))


class Decoded(NamedTuple):
    """What :func:`decode` returns.

    Attributes:
        lengths: int64 bag lengths of every feature.
        values: int64 ids of every feature.
        first_bags: Per segment of the exact output dedupe, the first bag of each distinct bag
            (int64, views of one buffer).
        bad_payload: The first payload whose checksum does not match (nothing else was done),
            or -1.
        bad_feature: The first feature row that does not match its format (the outputs are then
            incomplete), or -1.
        why: Then :data:`BAD_LENGTHS` or :data:`BAD_INVERSE`.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    first_bags: list[torch.Tensor]
    bad_payload: int
    bad_feature: int
    why: int


def decode(
    recv: torch.Tensor,
    recv_words: Sequence[int],
    checksum: bool,
    sections: Sequence[int],
    features: Sequence[int],
    segments: Sequence[int],
    num_lengths: int,
    num_ids: int,
    num_unique: int,
) -> Decoded:
    """Decodes the received payloads in one compiled call: verifies the checksums, unpacks every
    section (``kjt_codec.unpack_bits``), completes each feature's ids, and finds the first bag
    of each distinct bag of the exact output dedupe.

    The first bags of :data:`BY_INVERSE` segments (ids deduplicated on the wire) follow
    ``dedupe.first_bags`` (rows from the inverse index), of :data:`BY_SORT` ones
    ``dedupe.distinct_bags`` (the order of the bag keys); both give the empty bag first (if
    any), then the distinct ids ascending.

    Args:
        recv: int32 words of the payloads, back to back.
        recv_words: Words of each payload (each ends with its checksum if ``checksum``).
        checksum: Verify the payloads' checksums first.
        sections: Rows of :data:`SECTION_COLUMNS`, flat: ``array`` is the output
            (:data:`LENGTHS`, :data:`IDS`, :data:`UNIQUE`, :data:`INVERSE`; the inverse index
            lies at its ids' positions), ``start`` an element of it.
        features: Rows of :data:`FEATURE_COLUMNS`, flat (``kind`` :data:`PLAIN`,
            :data:`DEDUPED` or :data:`LOOKUP`).
        segments: Rows of :data:`SEGMENT_COLUMNS`, flat.
        num_lengths: Lengths of all features.
        num_ids: Ids of all features.
        num_unique: Distinct ids of the deduplicated features.

    Returns:
        The lengths, ids and first bags, or where the payloads do not match their metadata.
    """
    lengths = np.zeros(num_lengths, np.int64)
    values = np.zeros(num_ids, np.int64)
    bad_payload, bad_feature, why, first, counts = _decode_kernel(
        recv.contiguous().numpy().view(np.uint32),
        np.cumsum(np.asarray(recv_words, np.int64)),
        checksum,
        np.array(sections, np.int64).reshape(-1, len(SECTION_COLUMNS)),
        np.array(features, np.int64).reshape(-1, len(FEATURE_COLUMNS)),
        np.array(segments, np.int64).reshape(-1, len(SEGMENT_COLUMNS)),
        lengths,
        values,
        np.zeros(num_unique, np.int64),
        np.zeros(num_ids, np.int64),
    )
    firsts = list(torch.from_numpy(first).split(counts.tolist())) if counts.shape[0] else []
    return Decoded(
        torch.from_numpy(lengths), torch.from_numpy(values), firsts, bad_payload, bad_feature, why
    )


__all__ = [
    "BY_INVERSE",
    "BY_SORT",
    "DEDUPED",
    "FEATURE_COLUMNS",
    "IDS",
    "INVERSE",
    "LENGTHS",
    "LOOKUP",
    "PLAIN",
    "SECTION_COLUMNS",
    "SEGMENT_COLUMNS",
    "UNIQUE",
    "Decoded",
    "HostStats",
    "decode",
    "feature_stats",
    "pack",
]
