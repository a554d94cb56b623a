"""The KJT codec of the input dist: lossless bit packing of a ``KeyedJaggedTensor``.

No collectives, no telemetry (:mod:`.input_dist` runs the exchange and records the bytes).
:func:`encode_kjt` / :func:`decode_kjt` run where the KJT lives, CPU or CUDA; the decode gives
TorchRec's tensors and dtypes, so the KJT is bit-identical to ``KJTAllToAll``'s. Both ends
plan payloads with :mod:`.kjt_layout`; the backend (:data:`KJTBackend`) is chosen once per call
here: torch (:mod:`.kjt_torch`, the device path and test oracle) or, for CPU tensors, numba
(:mod:`.kjt_host`); both give the same words and tensors. docs/input_dist.md, "Format".
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, NoReturn

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.config import InputDistConfig
from torchrec_lossy.distributed import kjt_host, kjt_layout, kjt_torch
from torchrec_lossy.distributed.dedupe import (
    OutputDedupeMode,
    bag_inverse,
)
from torchrec_lossy.distributed.errors import LossyAllToAllError
from torchrec_lossy.distributed.kjt_layout import (
    DecodeCall,
    EncodeCall,
    FeatureMeta,
)
from torchrec_lossy.distributed.vbe import pad_vbe_lengths

_HEADER = 3  # metadata words per destination: payload words, batch size, dtype codes
_CHECK_FLAG = 1 << 32  # in the dtype-codes word: the payloads end with a checksum
# In the dtype-codes word: the sender's KJT has a batch per feature (VBE). Its lengths travel
# padded with zero lengths to the row's batch word, and the row ends with one word per
# feature: that feature's batch. Rows without it are unchanged.
_VBE_FLAG = 1 << 33
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
# Per-feature format.


def _weight_words(num: int, dtype: torch.dtype) -> int:
    return -(-num * torch.empty(0, dtype=dtype).element_size() // 4)


def meta_words(num_features: int, vbe: bool = False) -> int:
    """Metadata words (int64) of one destination that receives ``num_features`` features.

    Args:
        num_features: Features the destination receives.
        vbe: The sender's KJT has a batch per feature (one more word per feature).

    Returns:
        The word count.
    """
    return _HEADER + (_PER_FEATURE + vbe) * num_features


class SourceMeta(NamedTuple):
    """One source's metadata row as the receiver reads it (see :func:`parse_meta`).

    Attributes:
        payload_words: int32 words of the source's payload.
        batch: The source's batch size (KJT stride; VBE: the batch its lengths are padded to).
        codes: Its dtype codes (pass on to :func:`decode_kjt`).
        features: Per received feature, its format.
        strides: VBE: per received feature, its batch; None otherwise.
    """

    payload_words: int
    batch: int
    codes: int
    features: list[FeatureMeta]
    strides: list[int] | None = None


def parse_meta(row: Sequence[int], num_features: int) -> SourceMeta:
    """Reads one source's metadata row (``meta_words(num_features, vbe)`` int64 words).

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
    end = _HEADER + _PER_FEATURE * num_features
    strides = list(row[end : end + num_features]) if row[2] & _VBE_FLAG else None
    return SourceMeta(row[0], row[1], row[2], features, strides)


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

    A VBE KJT (a batch per feature) travels with its lengths padded to its largest batch by
    zero lengths, its features' batches in the metadata (``SourceMeta.strides``); the output
    dedupe does not apply to it.

    Raises:
        ValueError: If a length or an id is negative, the backend does not fit the KJT, or
            an output dedupe is asked for a VBE KJT.
    """
    lengths, values, weights = kjt.lengths(), kjt.values(), kjt.weights_or_none()
    vbe_strides = kjt.stride_per_key() if kjt.variable_stride_per_key() else None
    batch = kjt.stride()
    if vbe_strides is not None:
        if output_dedupe is not None:
            raise ValueError("lossy input dist: no output dedupe for a VBE KJT; pass None")
        lengths, batch = pad_vbe_lengths(lengths, vbe_strides)
    # The backend, chosen once: both take the same call and give the same words.
    pack = kjt_host.pack if on_host(values.device, backend) else kjt_torch.pack
    wire_w = None if weights is None else _WEIGHT_CASTS.get(config.weights, weights.dtype)
    feat_off, meta_splits = _split_offsets(tuple(splits))
    call = EncodeCall(
        keys=kjt.keys(),
        batch=batch,
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
            codes=_dtype_codes(lengths, values, weights, wire_w, config.checksum)
            | (_VBE_FLAG if vbe_strides is not None else 0),
        ),
    )
    plan, send, _, inverse = pack(call)
    stats_rows = plan.stats.tolist()
    meta = plan.meta
    if vbe_strides is not None:
        meta, meta_splits = _with_strides(meta, feat_off, vbe_strides)
    return EncodedKJT(
        send=send,
        send_words=plan.payloads[:, 2].tolist(),
        meta=torch.from_numpy(meta).to(values.device),
        meta_splits=meta_splits,
        num_ids_per_dest=plan.payloads[:, 1].tolist(),
        expand=_expand_rows(call, plan, stats_rows, inverse),
        formats=plan.formats,
        feature_stats=stats_rows,
        feature_bytes=plan.feature_bytes.tolist(),
        wire_weights=wire_w,
    )


def _with_strides(
    meta: np.ndarray, feat_off: np.ndarray, strides: Sequence[int]
) -> tuple[np.ndarray, list[int]]:
    """The VBE metadata: each destination's row followed by its features' batches.

    Args:
        meta: The rows of the padded KJT, destinations in order.
        feat_off: Each destination's first feature (then F).
        strides: Every feature's batch.

    Returns:
        The rows and each row's words.
    """
    rows, at = [], 0
    offsets = feat_off.tolist()
    for d in range(len(offsets) - 1):
        lo, hi = offsets[d], offsets[d + 1]
        n = meta_words(hi - lo)
        rows += [meta[at : at + n], np.asarray(strides[lo:hi], np.int64)]
        at += n
    splits = [meta_words(hi - lo, vbe=True) for lo, hi in itertools.pairwise(offsets)]
    return np.concatenate(rows) if rows else meta, splits


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
    call: EncodeCall,
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
    offsets = call.feat_off.tolist()
    # Per feature: lookup, distinct ids, exact output dedupe rows.
    kinds = plan.formats[:, [5, 4, 6]].tolist()
    # Each feature's part of the inverse index (empty without output dedupe) in one call, not
    # a slicing dispatch per feature.
    ids_inv = ()
    if inverse is not None and inverse.numel():
        ids_inv = inverse.split_with_sizes([st[0] for st in stats_rows])
    expand: list[list[tuple[int, torch.Tensor] | None]] = []
    for d in range(len(offsets) - 1):
        row: list[tuple[int, torch.Tensor] | None] = []
        for f in range(offsets[d], offsets[d + 1]):
            lookup, num_unique, out_rows = kinds[f]
            if lookup:
                row.append((num_unique, ids_inv[f]))
            elif out_rows:
                row.append(
                    (out_rows, bag_inverse(f, stats_rows[f], call.batch, call.lens, ids_inv[f]))
                )
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
    unpack = kjt_host.unpack if on_host(recv.device, backend) else kjt_torch.unpack
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
    call = DecodeCall(
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
    out = unpack(call)
    selects = call.selects(out.segments, out.first_bags)
    len_dtype, val_dtype = _DTYPES[code & 0xFF], _DTYPES[code >> 8 & 0xFF]
    assert len_dtype is not None and val_dtype is not None
    weights = _decode_weights(recv, out.payloads, _DTYPES[code >> 16 & 0xFF], wire_w)
    return DecodedKJT(out.lengths.to(len_dtype), out.values.to(val_dtype), weights, selects)


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
