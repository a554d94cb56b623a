"""The KJT codec's layout, shared by both backends: each feature's format, the bit layout of
every payload, the metadata rows, and the records a call hands a backend.

:func:`plan_encode` (sender, from the statistics) and :func:`plan_decode` (receiver, from the
metadata, checked against what arrived: :class:`Refusal`) give :mod:`.kjt_torch` and
:mod:`.kjt_host` the same layout; :mod:`.kjt_codec` builds the records once per call
(:class:`EncodeCall` / :class:`Packed`, :class:`DecodeCall` / :class:`Unpacked`). The planning
works on host ints and is compiled (the host kernels inline it), so that a host encode or
decode stays one numba call. docs/input_dist.md, "Format".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, NoReturn, Protocol

import numba
import numpy as np
import torch

# A section's field: what it reads (encode) or writes (decode).
LENGTHS = 0  # bag lengths
IDS = 1  # ids, in the order the KJT holds them
UNIQUE = 2  # a deduplicated feature's distinct ids
INVERSE = 3  # per id, the index of its distinct id
# A section (one row of an int64 table): ``count`` fields of ``width`` bits (1..32) from bit
# ``bit`` on, each the ``shift``-ed part of an element of one feature's ``field``.
SECTION_COLUMNS = ("feature", "field", "count", "width", "shift", "bit")
# A feature's format (kjt_codec.FeatureMeta's fields, in its order).
FORMAT_COLUMNS = ("len_bits", "id_bits", "dedupe", "num_ids", "num_unique", "lookup", "out_rows")
# Per payload of a layout: its first word of weights, its ids, its words.
PAYLOAD_COLUMNS = ("weights_at", "num_ids", "words")
# Cross-side output dedupe mode of an encode (kjt_codec's OutputDedupeMode).
OUT_NONE = 0
OUT_EXACT = 1
OUT_LOOKUP = 2
# Per received feature (a row of a decode's feature table, :data:`FEATURE_COLUMNS`): how its ids
# are completed after unpacking, and where its outputs start.
PLAIN = 0  # the ids arrived as they are
DEDUPED = 1  # ids = distinct ids [inverse index]
LOOKUP = 2  # single-hot distinct ids: the first num_unique bags hold one id each
FEATURE_COLUMNS = ("kind", "len_start", "batch", "val_start", "num_ids", "uniq_start", "num_unique")
# Per feature of the exact output dedupe (a row of a decode's segment table,
# :data:`SEGMENT_COLUMNS`): its distinct bags come from the inverse index or from a sort.
BY_INVERSE = 0
BY_SORT = 1
SEGMENT_COLUMNS = ("by", "row", "source", "feature", "out_rows")

# Why a decode refused a payload (:class:`Refusal`): the layout's checks, then the decoder's.
BAD_LENGTHS = 1  # a feature's lengths do not sum to its ids
BAD_INVERSE = 2  # a feature's inverse index points past its distinct ids
BAD_LOOKUP = 3  # a lookup feature has more distinct ids than bags
BAD_BITS = 4  # a field is wider than 64 bits
BAD_COUNT = 5  # a negative id count
BAD_WORDS = 6  # the payload's size is not its layout's
BAD_CHECKSUM = 7  # its checksum does not match
BAD_ROWS = 8  # an output-deduplicated feature's distinct bags are not its rows sent back


class PlanOptions(NamedTuple):
    """What an encode's plan depends on besides the KJT's statistics: one record, which the
    compiled kernels take whole (numba types a named tuple of ints and bools).

    Attributes:
        dedupe: Wire dedupe (``InputDistConfig.dedupe``).
        mode: Output dedupe: :data:`OUT_NONE`, :data:`OUT_EXACT` or :data:`OUT_LOOKUP`.
        wire_esize: Bytes of a weight on the wire (0: unweighted).
        checksum: The payloads end with a checksum.
        codes: The dtype codes word of the metadata.
    """

    dedupe: bool
    mode: int
    wire_esize: int
    checksum: bool
    codes: int


# ---------------------------------------------------------------------------------------------
# Kernels (host ints, compiled: the host codec's kernels inline them).


@numba.njit(cache=True, nogil=True)
def _formats(
    stats: np.ndarray, batch: int, dedupe: bool, mode: int, weighted: bool, fmt: np.ndarray
) -> None:
    """Each feature's format (``kjt_codec.FeatureMeta``) from its statistics.

    Args:
        stats: ``[F, 6]`` (``kjt_host``'s statistics), no length or id negative.
        batch: Bags per feature.
        dedupe: Wire dedupe (``InputDistConfig.dedupe``).
        mode: Output dedupe: :data:`OUT_NONE`, :data:`OUT_EXACT` or :data:`OUT_LOOKUP`.
        weighted: The KJT has weights.
        fmt: Out, ``[F, 7]`` (:data:`FORMAT_COLUMNS`).
    """
    for f in range(stats.shape[0]):
        len_sum, len_max, len_min, id_max, _, uniq = stats[f]
        id_bits = bit_length(np.uint64(id_max))
        lookup = mode == OUT_LOOKUP and not weighted and batch > 0 and len_min == len_max == 1
        if lookup and uniq < batch:
            # Single-hot with repeats: a bag's pooled vector is its row, so the owner can look
            # up and send back each distinct id once.
            fmt[f] = (
                np.int64(0),
                np.int64(id_bits),
                np.int64(1),
                np.int64(uniq),
                np.int64(uniq),
                np.int64(1),
                np.int64(0),
            )
            continue
        inv_bits = bit_length(np.uint64(uniq - 1)) if uniq else 0
        # Deduplicate only where distinct ids + inverse index take fewer bits.
        wire_dedupe = dedupe and uniq * id_bits + len_sum * inv_bits < len_sum * id_bits
        # Bags of at most one unweighted id that repeat: send back each distinct one once.
        # Distinct bags: with one id per bag the ids; with none, one; with a mix of empty and
        # one-id bags, the empty bag then the ids (see dedupe.bag_inverse and first_bags).
        out_rows = 0
        if mode == OUT_EXACT and not weighted and batch > 0 and len_max <= 1:
            bags = uniq if len_min == 1 else uniq + 1 if len_max == 1 else 1
            out_rows = bags if bags < batch else 0
        len_bits = bit_length(np.uint64(len_max))
        fmt[f] = (
            np.int64(len_bits),
            np.int64(id_bits),
            np.int64(wire_dedupe),
            np.int64(len_sum),
            np.int64(uniq if wire_dedupe else 0),
            np.int64(0),
            np.int64(out_rows),
        )


@numba.njit(cache=True, nogil=True, inline="always")
def _add_field(
    sections: np.ndarray, s: int, feature: int, field: int, count: int, width: int, bit: int
) -> int:
    """Appends one field's sections at bit ``bit``: values over 32 bits as a section of low
    parts, then one of high parts; none for an empty field.

    Returns:
        The next section row.
    """
    if count == 0 or width == 0:
        return s
    sections[s] = (
        np.int64(feature),
        np.int64(field),
        np.int64(count),
        np.int64(min(width, 32)),
        np.int64(0),
        np.int64(bit),
    )
    if width <= 32:
        return s + 1
    sections[s + 1] = (
        np.int64(feature),
        np.int64(field),
        np.int64(count),
        np.int64(width - 32),
        np.int64(32),
        np.int64(bit + count * 32),
    )
    return s + 2


@numba.njit(cache=True, nogil=True)
def _layout_payload(
    fmt: np.ndarray,
    f0: int,
    f1: int,
    batch: int,
    word0: int,
    wire_esize: int,
    checksum: bool,
    sections: np.ndarray,
    s: int,
    feature_bits: np.ndarray,
) -> tuple[int, int, int, int]:
    """Lays out one payload: each feature's fields packed back to back, the weights, the checksum.

    A lookup feature sends its distinct ids (its lengths are implied, its inverse index stays
    with the sender); another its lengths, then its distinct ids and inverse index if
    deduplicated, else its ids.

    Args:
        fmt: ``[F, 7]`` formats (:data:`FORMAT_COLUMNS`); the payload's are rows ``f0:f1``.
        f0: Its first feature.
        f1: The feature after its last.
        batch: Its sender's batch size.
        word0: Its first word in the buffer of all payloads.
        wire_esize: Bytes of a weight on the wire (0: unweighted).
        checksum: It ends with a checksum (two words).
        sections: Out: its sections from row ``s`` on (:data:`SECTION_COLUMNS`).
        s: Its first section row.
        feature_bits: Out: its features' packed bits.

    Returns:
        The next section row, its first word of weights, its ids and its words.
    """
    bit = word0 * 32
    num_ids = 0
    for f in range(f0, f1):
        len_bits, id_bits, dedupe, n_ids, n_unique, lookup, _ = fmt[f]
        num_ids += n_ids
        start = bit
        if lookup:
            s = _add_field(sections, s, f, UNIQUE, n_unique, id_bits, bit)
            bit += n_unique * id_bits
        else:
            s = _add_field(sections, s, f, LENGTHS, batch, len_bits, bit)
            bit += batch * len_bits
            if dedupe:
                s = _add_field(sections, s, f, UNIQUE, n_unique, id_bits, bit)
                bit += n_unique * id_bits
                inv_bits = bit_length(np.uint64(n_unique - 1)) if n_unique else 0
                s = _add_field(sections, s, f, INVERSE, n_ids, inv_bits, bit)
                bit += n_ids * inv_bits
            else:
                s = _add_field(sections, s, f, IDS, n_ids, id_bits, bit)
                bit += n_ids * id_bits
        feature_bits[f] = bit - start
    weights_at = (bit + 31) // 32
    end = weights_at + (num_ids * wire_esize + 3) // 4
    return s, weights_at, num_ids, end - word0 + (2 if checksum else 0)


@numba.njit(cache=True, nogil=True)
def plan_encode_kernel(
    stats: np.ndarray, batch: int, feat_off: np.ndarray, opts: PlanOptions
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Plans one rank's payloads from its KJT's statistics (see :func:`plan_encode`).

    Returns:
        The formats ``[F, 7]``, the sections ``[S, 6]``, the payloads ``[P, 3]``
        (:data:`PAYLOAD_COLUMNS`), each feature's wire bytes, the metadata rows and the field
        starts ``[4, F + 1]`` (lengths, ids, distinct ids, inverse index of each feature in the
        sender's arrays, then their ends).
    """
    num_f = stats.shape[0]
    fmt = np.zeros((num_f, len(FORMAT_COLUMNS)), np.int64)
    wire_esize, checksum, codes = opts.wire_esize, opts.checksum, opts.codes
    _formats(stats, batch, opts.dedupe, opts.mode, wire_esize > 0, fmt)
    starts = np.zeros((4, num_f + 1), np.int64)
    for f in range(num_f):
        starts[LENGTHS, f + 1] = starts[LENGTHS, f] + batch
        starts[IDS, f + 1] = starts[IDS, f] + stats[f, 0]
        starts[UNIQUE, f + 1] = starts[UNIQUE, f] + stats[f, 5]
    starts[INVERSE] = starts[IDS]
    num_p = feat_off.shape[0] - 1
    sections = np.empty((6 * num_f, 6), np.int64)
    payloads = np.empty((num_p, 3), np.int64)
    feature_bits = np.zeros(num_f, np.int64)
    meta = np.empty(3 * num_p + 3 * num_f, np.int64)
    s, word0, m = 0, 0, 0
    for p in range(num_p):
        s, weights_at, num_ids, words = _layout_payload(
            fmt, feat_off[p], feat_off[p + 1], batch, word0, wire_esize, checksum,
            sections, s, feature_bits,
        )  # fmt: skip
        payloads[p] = (np.int64(weights_at), np.int64(num_ids), np.int64(words))
        word0 += words
        meta[m : m + 3] = (np.int64(words), np.int64(batch), np.int64(codes))
        m += 3
        # Each feature's three words (read back by kjt_codec.FeatureMeta.from_words).
        for f in range(feat_off[p], feat_off[p + 1]):
            len_bits, id_bits, wire_dedupe, num_ids, num_unique, lookup, out_rows = fmt[f]
            meta[m] = len_bits | id_bits << 8 | wire_dedupe << 16 | lookup << 17 | out_rows << 32
            meta[m + 1], meta[m + 2] = num_ids, num_unique
            m += 3
    feature_bytes = feature_bits // 8 + fmt[:, 3] * wire_esize
    return fmt, sections[:s], payloads, feature_bytes, meta, starts


@numba.njit(cache=True, nogil=True)
def _check_format(fmt: np.ndarray, batch: int, refusal: np.ndarray, p: int) -> bool:
    """Checks one received feature's format against its source's batch size.

    Args:
        fmt: Its format (a row of :data:`FORMAT_COLUMNS`).
        batch: Its source's batch size.
        refusal: Out: why it is refused (:class:`Refusal`'s fields), if it is.
        p: Its source.

    Returns:
        Whether it is refused.
    """
    len_bits, id_bits, _, num_ids, num_unique, lookup, _ = fmt
    if lookup and num_unique > batch:
        refusal[:] = (np.int64(p), np.int64(BAD_LOOKUP), np.int64(num_unique), np.int64(batch))
    elif max(len_bits, id_bits) > 64:
        bits = np.int64(max(len_bits, id_bits))
        refusal[:] = (np.int64(p), np.int64(BAD_BITS), bits, np.int64(0))
    elif min(num_ids, num_unique, batch) < 0:
        refusal[:] = (np.int64(p), np.int64(BAD_COUNT), np.int64(0), np.int64(0))
    return refusal[0] >= 0


@numba.njit(cache=True, nogil=True)
def _output_tables(
    fmt: np.ndarray, feat_off: np.ndarray, batch: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Where each received feature's outputs start, and how the exact output dedupe's features
    find their distinct bags.

    Args:
        fmt: ``[F, 7]`` formats (:data:`FORMAT_COLUMNS`), sources in order.
        feat_off: int64 ``[P + 1]``: each source's first feature, then F.
        batch: int64 ``[P]``: each source's batch size.

    Returns:
        The feature table ``[F, 7]`` (:data:`FEATURE_COLUMNS`: its kind, first length, bags,
        first id, ids, first distinct id, distinct ids) and the segment table ``[G, 5]``
        (:data:`SEGMENT_COLUMNS`: by the inverse index where its ids arrived deduplicated or it
        has none, else by sort; its feature row, source, feature there and rows sent back).
    """
    num_f = fmt.shape[0]
    features = np.empty((num_f, len(FEATURE_COLUMNS)), np.int64)
    segments = np.empty((num_f, len(SEGMENT_COLUMNS)), np.int64)
    len_at, val_at, uniq_at, g = 0, 0, 0, 0
    for p in range(feat_off.shape[0] - 1):
        b = batch[p]
        for f in range(feat_off[p], feat_off[p + 1]):
            _, _, dedupe, num_ids, num_unique, lookup, out_rows = fmt[f]
            kind = LOOKUP if lookup else DEDUPED if dedupe else PLAIN
            features[f, 0], features[f, 1], features[f, 2] = kind, len_at, b
            features[f, 3], features[f, 4] = val_at, num_ids
            features[f, 5], features[f, 6] = uniq_at, num_unique
            if out_rows and not lookup:
                by = BY_INVERSE if dedupe or not num_ids else BY_SORT
                segments[g, 0], segments[g, 1], segments[g, 2] = by, f, p
                segments[g, 3], segments[g, 4] = f - feat_off[p], out_rows
                g += 1
            len_at += b
            val_at += num_ids
            uniq_at += num_unique if kind == DEDUPED else 0
    return features, segments[:g]


@numba.njit(cache=True, nogil=True)
def plan_decode_kernel(
    fmt: np.ndarray,
    feat_off: np.ndarray,
    batch: np.ndarray,
    recv_words: np.ndarray,
    wire_esize: int,
    checksum: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Checks every source's formats and size, and lays out its payload (see :func:`plan_decode`).

    Returns:
        The refusal (:class:`Refusal`'s fields: source, why, a, b; source -1 if none), the
        sections, the payloads ``[P, 3]`` (:data:`PAYLOAD_COLUMNS`), the feature table and the
        segment table (:func:`_output_tables`; empty if refused).
    """
    num_p = feat_off.shape[0] - 1
    sections = np.empty((6 * fmt.shape[0], 6), np.int64)
    payloads = np.zeros((num_p, 3), np.int64)
    feature_bits = np.empty(fmt.shape[0], np.int64)
    refusal = np.full(4, -1, np.int64)
    none = np.zeros((0, len(FEATURE_COLUMNS)), np.int64)
    no_segments = np.zeros((0, len(SEGMENT_COLUMNS)), np.int64)
    s, word0 = 0, 0
    for p in range(num_p):
        for f in range(feat_off[p], feat_off[p + 1]):
            if _check_format(fmt[f], batch[p], refusal, p):
                return refusal, sections[:0], payloads, none, no_segments
        s, weights_at, num_ids, words = _layout_payload(
            fmt, feat_off[p], feat_off[p + 1], batch[p], word0, wire_esize, checksum,
            sections, s, feature_bits,
        )  # fmt: skip
        if words != recv_words[p]:
            refusal[:] = (np.int64(p), np.int64(BAD_WORDS), recv_words[p], np.int64(words))
            return refusal, sections[:0], payloads, none, no_segments
        payloads[p] = (np.int64(weights_at), np.int64(num_ids), np.int64(words))
        word0 += words
    features, segments = _output_tables(fmt, feat_off, batch)
    return refusal, sections[:s], payloads, features, segments


@numba.njit(cache=True, nogil=True, inline="always")
def bit_length(x: np.uint64) -> int:
    """Bits of ``x`` (0 for 0), as ``int.bit_length``."""
    n = 0
    while n < 64 and (x >> np.uint64(n)) != 0:
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# Wrappers.


class EncodePlan(NamedTuple):
    """One rank's payloads as planned from its KJT's statistics (see :func:`plan_encode`).

    Attributes:
        stats: ``[F, 6]`` per feature: length sum, max, min; id max, min; distinct ids.
        formats: ``[F, 7]`` per feature its format (:data:`FORMAT_COLUMNS`).
        sections: ``[S, 6]`` (:data:`SECTION_COLUMNS`), every payload's in wire order.
        payloads: ``[P, 3]`` (:data:`PAYLOAD_COLUMNS`).
        feature_bytes: Per feature, its wire bytes (packed bits rounded down to bytes, plus its
            weights): the telemetry's.
        meta: The metadata rows (int64, destinations in order).
        starts: ``[4, F + 1]``: per field (:data:`LENGTHS`, :data:`IDS`, :data:`UNIQUE`,
            :data:`INVERSE`), where each feature's elements start in the sender's arrays, then
            where the last one ends.
    """

    stats: np.ndarray
    formats: np.ndarray
    sections: np.ndarray
    payloads: np.ndarray
    feature_bytes: np.ndarray
    meta: np.ndarray
    starts: np.ndarray


def plan_encode(
    stats: np.ndarray, batch: int, feat_off: np.ndarray, opts: PlanOptions
) -> EncodePlan:
    """Plans one rank's payloads from its KJT's statistics: each feature's format (wire dedupe
    where it saves bits, the output dedupe's rows), the bit layout and the metadata rows.

    Args:
        stats: int64 ``[F, 6]`` (length sum, max, min; id max, min; distinct ids), no length or
            id negative.
        batch: The KJT's stride.
        feat_off: int64 ``[P + 1]``: each destination's first feature, then F.
        opts: Wire and output dedupe, weights, checksum and dtype codes.

    Returns:
        The plan.
    """
    plan = plan_encode_kernel(stats, batch, feat_off, opts)
    return EncodePlan(stats, *plan)


class Refusal(NamedTuple):
    """Why a decode refused the received payloads (see :func:`plan_decode`).

    Attributes:
        source: The first source refused, or -1 (accepted).
        why: :data:`BAD_LOOKUP` (``a`` distinct ids, ``b`` bags), :data:`BAD_BITS` (``a``-bit
            fields), :data:`BAD_COUNT`, :data:`BAD_WORDS` (``a`` words received, ``b``
            expected), :data:`BAD_CHECKSUM`, :data:`BAD_LENGTHS` or :data:`BAD_INVERSE`
            (``a``: the feature, in the source's order) or :data:`BAD_ROWS` (``a`` distinct
            bags, ``b`` rows sent).
        a: See ``why``.
        b: See ``why``.
    """

    source: int
    why: int
    a: int
    b: int

    def message(self) -> str:
        """What is wrong with the refused payload, in words (for the decode's error).

        Returns:
            The reason, with ``a`` and ``b`` filled in.
        """
        return _WHY[self.why].format(a=self.a, b=self.b)


# Why a payload was refused (Refusal's reasons), given its ``a`` and ``b``.
_WHY: dict[int, str] = {
    BAD_LOOKUP: "{a} distinct single-hot ids for a batch of {b}",
    BAD_BITS: "{a}-bit fields (at most 64)",
    BAD_COUNT: "a negative batch size or id count",
    BAD_WORDS: "{a} words received, {b} expected",
    BAD_CHECKSUM: "its checksum does not match (corrupted in transit)",
    BAD_LENGTHS: "feature {a} of the payload: its lengths do not sum to its ids",
    BAD_INVERSE: ("feature {a} of the payload: its inverse index points past its distinct ids"),
    BAD_ROWS: "{a} distinct bags in a deduplicated feature, {b} sent",
}


class DecodePlan(NamedTuple):
    """The received payloads' layout (see :func:`plan_decode`).

    Attributes:
        refusal: Why they do not match their metadata (``source`` -1 if they do).
        sections: ``[S, 6]`` (:data:`SECTION_COLUMNS`), ``feature`` a row of the formats.
        payloads: ``[P, 3]`` (:data:`PAYLOAD_COLUMNS`).
        features: ``[F, 7]`` (:data:`FEATURE_COLUMNS`): per feature row, how its ids are
            completed and where its outputs start.
        segments: ``[G, 5]`` (:data:`SEGMENT_COLUMNS`): the exact output dedupe's features.
    """

    refusal: Refusal
    sections: np.ndarray
    payloads: np.ndarray
    features: np.ndarray
    segments: np.ndarray


def plan_decode(
    formats: np.ndarray,
    feat_off: np.ndarray,
    batch: np.ndarray,
    recv_words: np.ndarray,
    wire_esize: int,
    checksum: bool,
) -> DecodePlan:
    """Checks every source's metadata and payload size, and lays out its payload as its sender
    did (:func:`plan_encode`).

    Args:
        formats: int64 ``[F, 7]``: every source's features' formats (:data:`FORMAT_COLUMNS`),
            sources in order.
        feat_off: int64 ``[P + 1]``: each source's first feature, then F.
        batch: int64 ``[P]``: each source's batch size.
        recv_words: int64 ``[P]``: words received from each source.
        wire_esize: Bytes of a weight on the wire (0: unweighted).
        checksum: The payloads end with a checksum.

    Returns:
        The layout and the output tables, or the first source whose metadata or size is wrong
        (:data:`BAD_LOOKUP`, :data:`BAD_BITS`, :data:`BAD_COUNT`, :data:`BAD_WORDS`).
    """
    refusal, *plan = plan_decode_kernel(formats, feat_off, batch, recv_words, wire_esize, checksum)
    return DecodePlan(Refusal(*refusal.tolist()), *plan)


# ---------------------------------------------------------------------------------------------
# The records both backends share: a feature's format, an encode's and a decode's call.


class FeatureMeta(NamedTuple):
    """What the receiver needs to unpack one feature from one source.

    A named tuple (its fields are :data:`FORMAT_COLUMNS`): the codec passes every
    feature's format to its compiled planner as one array, ``np.array`` of these tuples.

    Attributes:
        len_bits: Bits per length.
        id_bits: Bits per id (of the distinct ids when deduplicated).
        dedupe: Ids travel as distinct ids plus an inverse index.
        num_ids: Ids (values) of the feature as the receiver gets them.
        num_unique: Distinct ids (0 when not deduplicated).
        lookup: Cross-side dedupe of a single-hot feature: only the distinct ids travel (the
            inverse index stays with the sender) and the receiver gets ``num_unique`` bags of
            one id followed by empty bags (see ``dedupe.OutputDedupe``).
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
        """A feature's format from its three metadata words (as :func:`plan_encode_kernel`
        writes them: widths and flags, ids, distinct ids)."""
        return FeatureMeta(
            w[0] & 0xFF,
            (w[0] >> 8) & 0xFF,
            bool(w[0] >> 16 & 1),
            w[1],
            w[2],
            bool(w[0] >> 17 & 1),
            w[0] >> 32,
        )


@dataclass(frozen=True)
class EncodeCall:
    """One ``kjt_codec.encode_kjt`` call's input, as either backend takes it.

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
    opts: PlanOptions

    def check_signs(self, stats: Sequence[Sequence[int]]) -> None:
        """Raises for the first feature with a negative length or id.

        Args:
            stats: Per feature its statistics (length sum, max, min; id max, min; ...).

        Raises:
            ValueError: If a length or an id is negative.
        """
        for key, st in zip(self.keys, stats, strict=True):
            if st[2] < 0 or st[4] < 0:
                raise ValueError(
                    f"lossy input dist: feature {key!r} has a negative "
                    f"{'length' if st[2] < 0 else 'id'}; KJT lengths and ids must be >= 0"
                )


class Packed(NamedTuple):
    """What a backend's encode gives ``kjt_codec.encode_kjt``.

    Attributes:
        plan: The payloads' plan (:func:`plan_encode`).
        send: int32 words of all payloads.
        uniques: Every feature's distinct ids (None if no feature needed them).
        inverse: Per id, the index of its distinct id in its feature (idem).
    """

    plan: EncodePlan
    send: torch.Tensor
    uniques: torch.Tensor | None
    inverse: torch.Tensor | None


class Fail(Protocol):
    """Raises ``kjt_codec.decode_kjt``'s error for a source's payload."""

    def __call__(self, src: int, why: str) -> NoReturn: ...


@dataclass(frozen=True)
class DecodeCall:
    """One ``kjt_codec.decode_kjt`` call's input, as either backend takes it.

    Attributes:
        recv: int32 words: every source's payload, back to back in source order.
        recv_words: Words from each source.
        metas_per_src: Per source, per received feature, its format.
        batch_per_src: Batch size of every source.
        formats: int64 ``[F, 7]``: the same formats, sources in order
            (:data:`FORMAT_COLUMNS`).
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
    fail: Fail

    def selects(
        self, segments: np.ndarray, first_bags: Sequence[torch.Tensor]
    ) -> list[list[torch.Tensor | None]]:
        """The exact output dedupe's bag selection, checked against the rows each feature
        sends back.

        Args:
            segments: The decode plan's segment table (:data:`SEGMENT_COLUMNS`).
            first_bags: Per segment, the first bag of each of its distinct bags.

        Returns:
            Per source, per feature, its first bags (None where not deduplicated).

        Raises:
            LossyAllToAllError: If a feature's distinct bags are not the rows it sends back.
        """
        selects: list[list[torch.Tensor | None]] = [[None] * len(m) for m in self.metas_per_src]
        for (_, _, src, f, out_rows), first in zip(segments.tolist(), first_bags, strict=True):
            if first.numel() != out_rows:
                self.refuse(Refusal(src, BAD_ROWS, first.numel(), out_rows))
            selects[src][f] = first
        return selects

    def refuse(self, refusal: Refusal) -> None:
        """Raises the decode's error for a refused payload (nothing if none was).

        Args:
            refusal: The planner's or a backend's verdict.
        """
        if refusal.source >= 0:
            self.fail(refusal.source, refusal.message())


class Unpacked(NamedTuple):
    """What a backend's decode gives ``kjt_codec.decode_kjt``.

    Attributes:
        lengths: int64 bag lengths of every source's features.
        values: int64 ids of them.
        payloads: ``[P, 3]`` (:data:`PAYLOAD_COLUMNS`).
        segments: The plan's segment table (:data:`SEGMENT_COLUMNS`): the exact output
            dedupe's features.
        first_bags: Per segment, the first bag of each of its distinct bags (unchecked:
            :meth:`DecodeCall.selects` checks and places them).
    """

    lengths: torch.Tensor
    values: torch.Tensor
    payloads: np.ndarray
    segments: np.ndarray
    first_bags: list[torch.Tensor]


__all__ = [
    "BAD_BITS",
    "BAD_CHECKSUM",
    "BAD_COUNT",
    "BAD_INVERSE",
    "BAD_LENGTHS",
    "BAD_LOOKUP",
    "BAD_ROWS",
    "BAD_WORDS",
    "BY_INVERSE",
    "BY_SORT",
    "DEDUPED",
    "FEATURE_COLUMNS",
    "FORMAT_COLUMNS",
    "IDS",
    "INVERSE",
    "LENGTHS",
    "LOOKUP",
    "OUT_EXACT",
    "OUT_LOOKUP",
    "OUT_NONE",
    "PAYLOAD_COLUMNS",
    "PLAIN",
    "SECTION_COLUMNS",
    "SEGMENT_COLUMNS",
    "UNIQUE",
    "DecodeCall",
    "DecodePlan",
    "EncodeCall",
    "EncodePlan",
    "Fail",
    "FeatureMeta",
    "Packed",
    "PlanOptions",
    "Refusal",
    "Unpacked",
    "bit_length",
    "plan_decode",
    "plan_decode_kernel",
    "plan_encode",
    "plan_encode_kernel",
]
