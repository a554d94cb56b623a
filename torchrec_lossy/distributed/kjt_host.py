"""The numba backend of the KJT codec: one compiled call per host encode or decode.

For CPU tensors, where a Python loop over features or tens of small torch ops per call would
dominate on the input dist's small KJTs. Same words and tensors as the torch backend
(:mod:`.kjt_torch`, the test oracle), same layout (:mod:`.kjt_layout`, whose planning kernels
compile into these). :func:`pack` sorts all ids once by (feature, id, position), the order of
``dedupe.segment_sort``; :func:`unpack` also finds the output dedupe's first bags.
docs/input_dist.md, "Format".
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from torchrec_lossy.codec.format import checksum_words
from torchrec_lossy.distributed.kjt_layout import (
    BAD_CHECKSUM,
    BAD_INVERSE,
    BAD_LENGTHS,
    BY_INVERSE,
    DEDUPED,
    IDS,
    LENGTHS,
    LOOKUP,
    UNIQUE,
    DecodeCall,
    EncodeCall,
    EncodePlan,
    Packed,
    PlanOptions,
    Refusal,
    Unpacked,
    bit_length,
    plan_decode_kernel,
    plan_encode_kernel,
)

# Why the encode kernel refused a KJT.
BAD_SUM = 1  # its lengths do not sum to its ids
BAD_NEGATIVE = 2  # a length or an id is negative

_DIGIT_BITS = 11  # radix sort digit: 2048 buckets, two passes for 22-bit (feature, id) keys
_MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Kernels.


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
    key_bits = bit_length(np.uint64(hi) - np.uint64(lo))  # wraps: exact for any range
    pos_bits = bit_length(np.uint64(n - 1))
    sort_bits = key_bits + bit_length(np.uint64(nseg - 1))
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
            segments back to back (empty: not asked for).
        inverse: Out, ``[keys]``: per key, the index of its distinct key within its segment
            (empty: not asked for).
        first: Out, like ``uniques``: per distinct key, its first position in its segment
            (empty: not asked for).

    Returns:
        Distinct keys of all segments.
    """
    if keys.shape[0] == 0:
        counts[:] = 0
        return 0
    order, sorted_keys = _segment_order(keys, seg_start)
    with_uniques, with_inverse, with_first = (
        uniques.shape[0] > 0,
        inverse.shape[0] > 0,
        first.shape[0] > 0,
    )
    u = 0
    for s in range(seg_start.shape[0] - 1):
        a = seg_start[s]
        c = 0
        for j in range(a, seg_start[s + 1]):
            if c == 0 or sorted_keys[j] != sorted_keys[j - 1]:
                if with_uniques:
                    uniques[u] = sorted_keys[j]
                if with_first:
                    first[u] = order[j] - a
                u += 1
                c += 1
            if with_inverse:
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
    u = _distinct(values, seg_start, counts, uniques, inverse, np.empty(0, np.int64))
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
    starts: np.ndarray,
    lengths: np.ndarray,
    values: np.ndarray,
    uniques: np.ndarray,
    inverse: np.ndarray,
    weight_bytes: np.ndarray,
    weight_slots: np.ndarray,
    ends: np.ndarray,
    checksum: bool,
) -> None:
    """Packs every section into the zeroed ``out``, copies the weights, writes the checksums.

    Args:
        out: uint32 words of all payloads, zeroed.
        sections: ``[S, 6]`` (``kjt_layout.SECTION_COLUMNS``).
        starts: ``[4, >= F]``: per field (:data:`LENGTHS`, :data:`IDS`, :data:`UNIQUE`,
            :data:`INVERSE`), where each feature's elements start in its array.
        lengths: int64 bag lengths (array :data:`LENGTHS`).
        values: int64 ids (:data:`IDS`).
        uniques: int64 distinct ids (:data:`UNIQUE`).
        inverse: int64 inverse index (:data:`INVERSE`).
        weight_bytes: The weights' bytes in their wire dtype.
        weight_slots: ``[P, 3]``: per payload with weights, its first weight byte in ``out``,
            its first byte in ``weight_bytes``, its bytes.
        ends: int64 end word of each payload.
        checksum: Write each payload's checksum into its last two words.
    """
    for s in range(sections.shape[0]):
        feature, field, count, width, shift, bit = sections[s]
        src = (lengths, values, uniques, inverse)[field]
        start = starts[field, feature]
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
    out_bytes = out.view(np.uint8)
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

    A section of lengths goes to ``lengths`` at its feature's first length, of distinct ids to
    ``uniques`` at its first distinct id (a lookup feature's distinct ids are its ids: to
    ``values``), of ids to ``values`` and of an inverse index to ``inverse`` at its first id.

    Args:
        words: uint32 words of the payloads.
        sections: ``[S, 6]`` (``kjt_layout.SECTION_COLUMNS``), ``feature`` a row of ``features``.
        features: ``[F, 7]`` (``kjt_layout.FEATURE_COLUMNS``).
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
        feature, field, count, width, shift, bit = sections[s]
        kind, len_start, _, val_start, _, uniq_start, _ = features[feature]
        array, start = field, val_start
        if field == LENGTHS:
            start = len_start
        elif field == UNIQUE:
            array, start = (UNIQUE, uniq_start) if kind == DEDUPED else (IDS, val_start)
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
    segments: np.ndarray,
    features: np.ndarray,
    lengths: np.ndarray,
    values: np.ndarray,
    inverse: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per segment, the first bag of each distinct bag (see :func:`unpack`).

    Every segment's lengths must sum to its ids (:func:`_unpack_kernel` checks it).

    Args:
        segments: ``[G, 5]`` (``kjt_layout.SEGMENT_COLUMNS``).
        features: ``[F, 7]`` (``kjt_layout.FEATURE_COLUMNS``).
        lengths: int64 bag lengths of every feature.
        values: int64 ids of every feature.
        inverse: int64 inverse index at the ids of deduplicated features.

    Returns:
        Every segment's first bags, back to back, and the number of each segment's.
    """
    nseg = segments.shape[0]
    rows = np.zeros(nseg, np.int64)
    out_start = np.zeros(nseg + 1, np.int64)
    # By inverse (``dedupe.first_bags``): bag b maps to row 0 if empty (the empty bag comes
    # first when there is one), to row ``empty + inverse`` otherwise; unmapped rows hold the
    # total bag count of these segments, as there.
    unmapped = 0
    for g in range(nseg):
        _, _, batch, _, num_ids, _, num_unique = features[segments[g, 1]]
        if segments[g, 0] == BY_INVERSE:
            rows[g] = (1 if num_ids < batch else 0) + num_unique
            unmapped += batch
        out_start[g + 1] = out_start[g] + max(batch, rows[g])
    first = np.empty(out_start[nseg], np.int64)
    # By sort (``dedupe.distinct_bags``): a bag's key is its id if it holds one, -1 if empty and
    # below -1 (distinct per bag, over all these segments) if longer.
    keys = np.empty(out_start[nseg], np.int64)
    sorted_segs = np.empty(nseg, np.int64)  # the BY_SORT segments, their keys back to back
    sort_start = np.zeros(nseg + 1, np.int64)
    k = 0
    for g in range(nseg):
        _, len_start, batch, val_start, num_ids, _, _ = features[segments[g, 1]]
        at = val_start
        if segments[g, 0] == BY_INVERSE:
            empty = 1 if num_ids < batch else 0
            out = first[out_start[g] : out_start[g + 1]]
            out[: rows[g]] = unmapped
            for b in range(batch):
                n = lengths[len_start + b]
                r = 0 if n == 0 else empty + inverse[at + n - 1]
                out[r] = min(out[r], b)
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
        none = np.empty(0, np.int64)  # neither distinct keys nor an inverse index needed
        _distinct(keys[:n_sort], sort_start[: k + 1], counts, none, none, firsts)
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
def _encode_kernel(
    lengths: np.ndarray,
    values: np.ndarray,
    weight_bytes: np.ndarray,
    batch: int,
    feat_off: np.ndarray,
    want_dedupe: bool,
    opts: PlanOptions,
) -> tuple:
    """:func:`_stats_kernel`, ``kjt_layout.plan_encode_kernel`` and :func:`_pack_kernel` in one
    call (see :func:`pack`).

    Returns:
        A status (0, :data:`BAD_SUM` or :data:`BAD_NEGATIVE`: the rest is then not planned),
        the statistics, the distinct ids and inverse index, then ``plan_encode_kernel``'s
        formats, payloads, feature bytes and metadata, and the packed words.
    """
    num_f, n = feat_off[-1], values.shape[0]
    stats = np.zeros((num_f, 6), np.int64)
    uniques = np.empty(n if want_dedupe else 0, np.int64)
    inverse = np.zeros(n if want_dedupe else 0, np.int64)
    num_unique = _stats_kernel(lengths, values, batch, want_dedupe, stats, uniques, inverse)
    status = BAD_SUM if num_unique < 0 else 0
    for f in range(num_f):
        if stats[f, 2] < 0 or stats[f, 4] < 0:
            status = BAD_NEGATIVE
    if status:
        e2, e1 = np.zeros((0, 0), np.int64), np.zeros(0, np.int64)
        return status, stats, uniques, inverse, e2, e2, e2, e1, e1, e2, np.zeros(0, np.uint32)
    fmt, sections, payloads, feature_bytes, meta, starts = plan_encode_kernel(
        stats, batch, feat_off, opts
    )
    wire_esize = opts.wire_esize
    ends = np.cumsum(payloads[:, 2])
    out = np.zeros(ends[-1] if ends.shape[0] else 0, np.uint32)
    slots = np.empty((payloads.shape[0] if wire_esize > 0 else 0, 3), np.int64)
    for p in range(slots.shape[0]):
        first, last = starts[IDS, feat_off[p]], starts[IDS, feat_off[p + 1]]
        slots[p] = (
            np.int64(4 * payloads[p, 0]),
            np.int64(wire_esize * first),
            np.int64(wire_esize * (last - first)),
        )
    _pack_kernel(
        out, sections, starts, lengths, values, uniques[:num_unique], inverse, weight_bytes,
        slots, ends, opts.checksum,
    )  # fmt: skip
    return (
        status, stats, uniques[:num_unique], inverse, fmt, sections, payloads, feature_bytes,
        meta, starts, out,
    )  # fmt: skip


@numba.njit(cache=True, nogil=True)
def _decode_kernel(
    words: np.ndarray,
    recv_words: np.ndarray,
    checksum: bool,
    fmt: np.ndarray,
    feat_off: np.ndarray,
    batch: np.ndarray,
    wire_esize: int,
) -> tuple:
    """Plans, verifies the checksums, unpacks, and finds the exact output dedupe's first bags
    (see :func:`unpack`).

    Returns:
        The refusal (as ``kjt_layout.plan_decode_kernel``), the payloads, the segment table,
        the lengths, the ids, the first bags and their count per segment.
    """
    none = np.zeros(0, np.int64)
    refusal, sections, payloads, features, segments = plan_decode_kernel(
        fmt, feat_off, batch, recv_words, wire_esize, checksum
    )
    if refusal[0] >= 0:
        return refusal, payloads, segments, none, none, none, none
    if checksum:
        bad = _sign(words, np.cumsum(recv_words), False)
        if bad >= 0:
            refusal[:] = (np.int64(bad), np.int64(BAD_CHECKSUM), np.int64(0), np.int64(0))
            return refusal, payloads, segments, none, none, none, none
    num_uniques = 0
    for r in range(features.shape[0]):
        num_uniques += features[r, 6] if features[r, 0] == DEDUPED else 0
    lengths = np.zeros(features[:, 2].sum(), np.int64)
    values = np.zeros(features[:, 4].sum(), np.int64)
    inverse = np.zeros(values.shape[0], np.int64)
    row, why = _unpack_kernel(
        words, sections, features, lengths, values, np.zeros(num_uniques, np.int64), inverse
    )
    if row >= 0:
        p = np.searchsorted(feat_off, row, side="right") - 1
        refusal[:] = (np.int64(p), np.int64(why), np.int64(row - feat_off[p]), np.int64(0))
        return refusal, payloads, segments, none, none, none, none
    first, counts = _first_bags_kernel(segments, features, lengths, values, inverse)
    return refusal, payloads, segments, lengths, values, first, counts


# ---------------------------------------------------------------------------------------------
# The backend: the same records as ``kjt_torch.pack`` / ``unpack``.


def pack(call: EncodeCall) -> Packed:
    """The numba backend's encode in one compiled call: per-feature statistics and distinct ids
    (one radix sort of all ids by (feature, id, position), ``dedupe.segment_sort``'s order), the
    plan (``kjt_layout.plan_encode``), and the packing (``_pack_kernel``: every section in the
    bit layout of ``kjt_torch.pack_bits``, which it does not call; the weights' bytes, the
    checksums).

    Args:
        call: The encode's input (CPU tensors).

    Returns:
        The plan and the payloads.

    Raises:
        ValueError: If the lengths are not ``F * batch`` or do not sum to the ids, or a length
            or an id is negative.
    """
    # Contiguous: a strided array would make numba compile another specialization.
    lens, ids = call.lens.contiguous().numpy(), call.ids.contiguous().numpy()
    num_f = int(call.feat_off[-1])
    if lens.shape[0] != num_f * call.batch:
        raise ValueError(
            f"lossy input dist: the KJT has {lens.shape[0]} lengths for {num_f} features "
            f"of stride {call.batch}; pass a KJT with one length per feature and sample"
        )
    if call.weights is None:
        w_bytes = np.zeros(0, np.uint8)
    else:
        weights = call.weights.to(call.wire_w).contiguous()
        w_bytes = weights.view(-1).view(torch.uint8).numpy()
    status, stats, uniques, inverse, *plan, out = _encode_kernel(
        lens, ids, w_bytes, call.batch, call.feat_off, call.want_dedupe, call.opts
    )
    if status == BAD_SUM:
        raise ValueError(
            f"lossy input dist: the KJT's lengths sum to {int(stats[:, 0].sum())} but "
            f"it holds {ids.shape[0]} ids; pass a KJT whose lengths match its values"
        )
    if status == BAD_NEGATIVE:
        call.check_signs(stats.tolist())
    return Packed(
        EncodePlan(stats, *plan),
        torch.from_numpy(out.view(np.int32)),
        torch.from_numpy(uniques),
        torch.from_numpy(inverse),
    )


def unpack(call: DecodeCall) -> Unpacked:
    """The numba backend's decode in one compiled call: the plan (``kjt_layout.plan_decode``),
    the checksum check, every section unpacked (``_unpack_kernel``, the bit layout of
    ``kjt_torch.unpack_bits``), each feature's ids
    completed, and the first bag of each distinct bag of the exact output dedupe.

    The first bags of features whose ids arrived deduplicated follow ``dedupe.first_bags`` (rows
    from the inverse index), of the others ``dedupe.distinct_bags`` (the order of the bag keys);
    both give the empty bag first (if any), then the distinct ids ascending.

    Args:
        call: The decode's input (CPU words).

    Returns:
        The lengths, ids, payload layout and first bags.

    Raises:
        LossyAllToAllError: If a payload does not match its metadata or checksum.
    """
    refusal, payloads, segments, lengths, values, first, counts = _decode_kernel(
        call.recv.contiguous().numpy().view(np.uint32), np.array(call.recv_words, np.int64),
        call.trailer, call.formats, call.feat_off, np.array(call.batch_per_src, np.int64),
        call.esize,
    )  # fmt: skip
    call.refuse(Refusal(*refusal.tolist()))
    # split_with_sizes: Tensor.split's Python overload resolution costs more than the views.
    firsts = list(torch.from_numpy(first).split_with_sizes(counts.tolist()))
    return Unpacked(torch.from_numpy(lengths), torch.from_numpy(values), payloads, segments, firsts)


__all__ = ["BAD_NEGATIVE", "BAD_SUM", "pack", "unpack"]
