"""The torch backend of the KJT codec: vectorized tensor ops on the KJT's device (the device
path and the test oracle).

Same words and tensors as :mod:`.kjt_host`, from :mod:`.kjt_layout`'s plan. :func:`pack` packs
each section with :func:`pack_bits` (``index_add_`` of shifted 32-bit fields into int64
accumulators). Host reads: one for the statistics in :func:`pack`, one for the checksums in
:func:`unpack`; on CUDA the dedupe's boolean select of distinct ids waits for the device too.
docs/input_dist.md, "Format".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from torchrec_lossy.codec.container import segment_checksums, upload
from torchrec_lossy.distributed import kjt_layout
from torchrec_lossy.distributed.dedupe import (
    distinct_bags,
    first_bags,
    segment_inverse,
    segment_sort,
)
from torchrec_lossy.distributed.kjt_layout import DecodeCall, EncodeCall, Packed, Unpacked
from torchrec_lossy.profile_range import profile_range

_WORD_BITS = 32
_MASK32 = (1 << 32) - 1
_CHECK_WORDS = 2  # int32 words of the int64 checksum that ends each payload (if on)


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
    return _as_int32(acc[:num_words])


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


def _words_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as int32 words (zero-padded to a multiple of 4 bytes)."""
    b = t.contiguous().view(-1).view(torch.uint8)
    pad = -b.numel() % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return b.view(torch.int32)


# ---------------------------------------------------------------------------------------------
# Checksum words: the codec's checksum (codec.container.segment_checksums) over each payload;
# _write_checksums and _stored_checksums only place its words.


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


def pack(call: EncodeCall) -> Packed:
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
    call.check_signs(stats.tolist())
    plan = kjt_layout.plan_encode(stats, call.batch, call.feat_off, call.opts)
    inverse = uniques = None
    if plan.formats[:, [2, 6]].any():  # wire or output dedupe (a lookup feature's too)
        assert fs.ids is not None
        order, new = fs.ids
        inverse = segment_inverse(order, new, fs.seg, fs.stats[:, 5])
        uniques = call.ids[order][new]
    return Packed(plan, _pack_words(plan, call, uniques, inverse), uniques, inverse)


def _pack_words(
    plan: kjt_layout.EncodePlan,
    call: EncodeCall,
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


def unpack(call: DecodeCall) -> Unpacked:
    """The torch backend's decode, by tensor ops on the words' device: the plan
    (``kjt_layout.plan_decode``), the checksums (one host read), the unpacking
    (:func:`unpack_bits`), the first bags of the exact output dedupe.

    Args:
        call: The decode's input.

    Returns:
        The lengths, ids, payload layout and first bags.

    Raises:
        LossyAllToAllError: If a payload does not match its metadata or checksum.
    """
    recv, recv_words = call.recv, call.recv_words
    plan = kjt_layout.plan_decode(
        call.formats, call.feat_off, np.array(call.batch_per_src, np.int64),
        np.array(recv_words, np.int64), call.esize, call.trailer,
    )  # fmt: skip
    call.refuse(plan.refusal)
    if call.trailer:
        # One host read for all sources; the sizes are known to be right by now.
        ok = payload_checksums(recv, recv_words) == _stored_checksums(recv, recv_words)
        for src, good in enumerate(ok.tolist()):
            if not good:
                call.refuse(kjt_layout.Refusal(src, kjt_layout.BAD_CHECKSUM, 0, 0))
    lengths, values, inverses = _features(plan, _unpack_fields(recv, plan.sections), recv.device)
    empty = recv.new_empty(0, dtype=torch.int64)
    with profile_range("## lossy_input dedupe select ##"):
        firsts = _first_bags(plan, call.formats, lengths, values, inverses)
    return Unpacked(
        torch.cat(lengths) if lengths else empty,
        torch.cat(values) if values else empty,
        plan.payloads,
        plan.segments,
        firsts,
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


def _features(
    plan: kjt_layout.DecodePlan,
    fields: dict[tuple[int, int], list[torch.Tensor]],
    dev: torch.device,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, torch.Tensor]]:
    """Every received feature's lengths and ids from its unpacked fields, as the plan's feature
    table says (``kjt_layout.FEATURE_COLUMNS``).

    Args:
        plan: The decode's plan.
        fields: Per (feature row, field), its sections' values (:func:`_unpack_fields`).
        dev: The words' device.

    Returns:
        Per feature row its int64 lengths and ids, and the inverse index of the rows whose ids
        arrived deduplicated.
    """
    lengths: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    inverses: dict[int, torch.Tensor] = {}
    for row, (kind, _, batch, _, num_ids, _, num_unique) in enumerate(plan.features.tolist()):

        def get(field: int, n: int, row: int = row) -> torch.Tensor:
            return _join_field(fields.get((row, field), []), n, dev)

        if kind == kjt_layout.LOOKUP:
            ones = torch.ones(num_unique, dtype=torch.int64, device=dev)
            lengths.append(torch.cat([ones, ones.new_zeros(batch - num_unique)]))
            values.append(get(kjt_layout.UNIQUE, num_unique))
            continue
        lengths.append(get(kjt_layout.LENGTHS, batch))
        if kind == kjt_layout.DEDUPED:
            inverses[row] = get(kjt_layout.INVERSE, num_ids)
            values.append(get(kjt_layout.UNIQUE, num_unique)[inverses[row]])
        else:
            values.append(get(kjt_layout.IDS, num_ids))
    return lengths, values, inverses


def _first_bags(
    plan: kjt_layout.DecodePlan,
    formats: np.ndarray,
    lengths: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    inverses: dict[int, torch.Tensor],
) -> list[torch.Tensor]:
    """Per segment of the exact output dedupe (the plan's segment table), the first bag of each
    distinct bag: ``dedupe.first_bags`` from the inverse index, ``dedupe.distinct_bags`` by sort.

    Args:
        plan: The decode's plan.
        formats: Its formats (:data:`kjt_layout.FORMAT_COLUMNS`).
        lengths: Per feature row, its lengths.
        values: Per feature row, its ids.
        inverses: Per feature row whose ids arrived deduplicated, its inverse index.

    Returns:
        The first bags, segments in order.
    """
    segments = plan.segments.tolist()
    by_inverse = [g for g, seg in enumerate(segments) if seg[0] == kjt_layout.BY_INVERSE]
    by_sort = [g for g, seg in enumerate(segments) if seg[0] == kjt_layout.BY_SORT]
    firsts: list[torch.Tensor | None] = [None] * len(segments)
    rows = [seg[1] for seg in segments]
    if by_inverse:
        # A feature without ids has an empty inverse index.
        none = torch.empty(0, dtype=torch.int64, device=lengths[rows[by_inverse[0]]].device)
        found = first_bags(
            [lengths[rows[g]] for g in by_inverse],
            [inverses.get(rows[g], none) for g in by_inverse],
            [int(formats[rows[g], 4]) for g in by_inverse],
        )
        for g, first in zip(by_inverse, found, strict=True):
            firsts[g] = first
    if by_sort:
        found = distinct_bags(
            [lengths[rows[g]] for g in by_sort],
            [values[rows[g]] for g in by_sort],
            max(1 << int(formats[rows[g], 1]) for g in by_sort),
            with_inverse=False,
        )[2]
        for g, first in zip(by_sort, found, strict=True):
            firsts[g] = first
    return [f for f in firsts if f is not None]


__all__ = ["pack", "pack_bits", "payload_checksums", "unpack", "unpack_bits"]
