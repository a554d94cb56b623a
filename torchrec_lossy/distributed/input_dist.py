"""Lossless, bit-packed KJT all-to-all for the TW, CW and TWCW input dist: the dist modules.

:class:`LossyKJTAllToAll` does ``KJTAllToAll``'s exchange in TorchRec's two steps (int64 metadata
read on the first ``wait()``, then one int32 payload all-to-all) and decodes a bit-identical
KJT, a :class:`~.context.DistributedKJT` that carries the batch sizes and output-dedupe state.
Only collectives, awaitables and telemetry live here (codec: :mod:`.kjt_codec`; dedupe:
:mod:`.dedupe`). Train pipelines override ``KJTAllToAll.forward``; the packed path stays on
because :class:`LossyTwSparseFeaturesDist` calls :meth:`LossyKJTAllToAll.packed` instead.
docs/input_dist.md ("Train pipelines", "Protocol"; CUDA host syncs under "Format").
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll, _get_recat
from torchrec.distributed.embedding_sharding import BaseSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.context import DistributedKJT, KJTDistState
from torchrec_lossy.distributed.dedupe import OutputDedupe, OutputDedupeMode
from torchrec_lossy.distributed.errors import LossyAllToAllError
from torchrec_lossy.distributed.kjt_codec import (
    EncodedKJT,
    FeatureMeta,
    decode_kjt,
    encode_kjt,
    meta_words,
    parse_meta,
    warm_up_host,
)
from torchrec_lossy.distributed.stats import LossyCommsStats
from torchrec_lossy.distributed.vbe import vbe_lengths_mask
from torchrec_lossy.profile_range import profile_range

# Pseudo-feature that holds the metadata exchange's bytes (raw: TorchRec's splits exchange).
SPLITS = "<splits>"


# ---------------------------------------------------------------------------------------------
# Encode with telemetry.


def encode_with_telemetry(
    kjt: KeyedJaggedTensor,
    splits: Sequence[int],
    comms: LossyComms,
    output_dedupe: OutputDedupeMode = None,
) -> EncodedKJT:
    """Encodes one rank's KJT (``kjt_codec.encode_kjt``) with the config and telemetry of ``comms``.

    Args:
        kjt: This rank's KJT, features ordered by destination.
        splits: Features per destination.
        comms: Config (``config.input_dist``) and telemetry (bytes and encode time).
        output_dedupe: Cross-side dedupe mode (see :class:`LossyKJTAllToAll`).

    Returns:
        The payloads and metadata.
    """
    start = time.perf_counter()
    with profile_range("## lossy_input encode ##"):
        enc = encode_kjt(kjt, splits, comms.config.input_dist, output_dedupe)
    record_encode(comms.stats, kjt, enc, splits, comms.config.input_dist.dedupe)
    len_e, val_e = kjt.lengths().element_size(), kjt.values().element_size()
    shares = {
        k: b * len_e + st[0] * val_e
        for k, b, st in zip(kjt.keys(), kjt.stride_per_key(), enc.feature_stats, strict=True)
    }
    comms.stats.record_time("input", "encode", shares, time.perf_counter() - start)
    return enc


def record_encode(
    s: LossyCommsStats,
    kjt: KeyedJaggedTensor,
    enc: EncodedKJT,
    splits: Sequence[int],
    dedupe: bool,
) -> None:
    """Telemetry: raw (TorchRec's tensors) vs wire bytes per feature, padding, metadata, repeats.

    Args:
        s: Where to record (direction ``"input"``).
        kjt: The encoded KJT.
        enc: Its encoding.
        splits: Features per destination.
        dedupe: Wire dedupe was on (``InputDistConfig.dedupe``): record repeated ids.
    """
    keys, send_words = kjt.keys(), enc.send_words
    stats = enc.feature_stats
    weights = kjt.weights_or_none()
    len_e, val_e = kjt.lengths().element_size(), kjt.values().element_size()
    w_e = weights.element_size() if weights is not None else 0
    strides = kjt.stride_per_key()
    raw = [b * len_e + st[0] * (val_e + w_e) for b, st in zip(strides, stats, strict=True)]
    wire = enc.feature_bytes
    feature_wire = sum(wire)
    # Metadata exchange vs TorchRec's splits exchange (lengths, values, [weights], stride or,
    # for VBE, strides), plus its all-to-all of the per-feature batches for VBE (int64).
    torchrec_rows = 3 + (weights is not None)
    vbe_raw = 8 * len(keys) if kjt.variable_stride_per_key() else 0
    s.record_blocks(
        "input",
        [*keys, SPLITS],
        [*raw, 8 * torchrec_rows * len(splits) + vbe_raw],
        [*wire, 8 * sum(enc.meta_splits)],
    )
    # Repeats are counted where ids may be deduplicated: wire dedupe on, or lookup features.
    counted = range(len(keys)) if dedupe else enc.formats[:, 5].nonzero()[0].tolist()
    if counted:
        s.record_id_counts(
            "input",
            [keys[i] for i in counted],
            [stats[i][0] for i in counted],
            [stats[i][0] - stats[i][5] for i in counted],
        )
    # Word padding of the payloads belongs to no feature.
    s.record_container("input", 4 * sum(send_words) - feature_wire)


# ---------------------------------------------------------------------------------------------
# Awaitables and modules.


def torchrec_recat(
    splits: list[int], rank: int, device: torch.device, stride_per_rank: list[int]
) -> torch.Tensor | None:
    """The recat TorchRec's ``KJTAllToAllTensorsAwaitable`` gives its KJT (stagger 1).

    The one adapter to TorchRec's private ``_get_recat`` (TorchRec has no public way to build
    it, and the lossy KJT must carry TorchRec's recat exactly). ``tests/distributed/
    test_input_dist.py`` pins its signature, TorchRec's own use of it and its values, so a
    TorchRec change fails there rather than in training.

    Args:
        splits: Features per destination rank (TorchRec's ``splits``).
        rank: This rank.
        device: Where the recat lives.
        stride_per_rank: Batch size of every source rank.

    Returns:
        The int32 permutation from source-major to feature-major order, or None when there is
        nothing to permute.
    """
    return _get_recat(
        local_split=splits[rank],
        num_splits=len(splits),
        stagger=1,
        device=device,
        batch_size_per_rank=stride_per_rank,
    )


@dataclass
class PayloadExchange:
    """The packed payload all-to-all in flight.

    Attributes:
        recv: Receive buffer (int32 words).
        recv_words: Words from each source.
        work: The collective; None once waited (or for a synchronous one).
    """

    recv: torch.Tensor
    recv_words: list[int]
    work: dist.Work | None

    def wait(self) -> tuple[torch.Tensor, list[int]]:
        """Waits for the exchange.

        Returns:
            The received words and the words from each source.
        """
        if self.work is not None:
            with profile_range("## lossy_input payload wait ##"):
                self.work.wait()
            self.work = None
        return self.recv, self.recv_words


class LossyKJTAllToAllTensorsAwaitable(Awaitable[KeyedJaggedTensor]):
    """Second step: waits for the packed payloads and decodes them into the local KJT.

    The KJT is a :class:`~torchrec_lossy.distributed.context.DistributedKJT` carrying the
    batch sizes per rank and the cross-side dedupe state, which the lossy sharded module puts
    into the sharding context before its output dist (TorchRec's own awaitable passes the batch
    sizes through private fields that only its constructor, which launches TorchRec's
    collectives, sets).

    Args:
        pg: Process group.
        splits: Features per destination rank.
        keys: Local keys after the all-to-all.
        exchange: The payload exchange in flight.
        metas_per_src: Per source, per local feature, its format.
        stride_per_rank: Batch size of every source.
        codes: Per source, its dtype codes.
        comms: Shared state (telemetry).
        output_dedupe: The call's cross-side dedupe state; the decode adds the owner's bag
            selection of the exact mode.
        vbe_strides: VBE: per source, per local feature, its batch (``stride_per_rank`` is
            then the batch each source padded its lengths to); the result is TorchRec's VBE
            KJT, a plain ``KeyedJaggedTensor`` (no state to carry: no output dedupe, and
            TorchRec's context takes the batches from its ``stride_per_key_per_rank``).
        source_mask: The batch's row-wise source mask, handed on in the decoded KJT's
            :class:`KJTDistState` (None: not a row-wise pooled input dist).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        splits: list[int],
        keys: list[str],
        exchange: PayloadExchange,
        metas_per_src: list[list[FeatureMeta]],
        stride_per_rank: list[int],
        codes: list[int],
        comms: LossyComms,
        output_dedupe: OutputDedupe | None = None,
        vbe_strides: list[list[int]] | None = None,
        source_mask: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._keys = keys
        self._vbe_strides = vbe_strides
        recat_strides = stride_per_rank if vbe_strides is None else None  # as TorchRec's VBE
        self._recat = torchrec_recat(splits, pg.rank(), exchange.recv.device, recat_strides)
        self._exchange = exchange
        self._metas_per_src = metas_per_src
        self._stride_per_rank = stride_per_rank
        self._codes = codes
        self._comms = comms
        self._output_dedupe = output_dedupe
        self._source_mask = source_mask

    def _wait_impl(self) -> KeyedJaggedTensor:
        recv, recv_words = self._exchange.wait()
        start = time.perf_counter()
        hook = self._comms.payload_hook
        if hook is not None:  # sees each source's payload, as on the output side
            parts = [
                hook("input", src, p) for src, p in enumerate(torch.split(recv, list(recv_words)))
            ]
            recv_words = [int(p.numel()) for p in parts]
            recv = torch.cat(parts) if parts else recv
        with profile_range("## lossy_input decode ##"):
            lengths, values, weights, selects = decode_kjt(
                recv,
                recv_words,
                self._metas_per_src,
                self._stride_per_rank,
                self._codes,
                self._keys,
                self._pg.rank(),
            )
        dedupe = self._output_dedupe
        if dedupe is not None and not dedupe.sum_grads:
            dedupe = dataclasses.replace(dedupe, select=selects)
        shares = {k: 1 for k in self._keys}
        self._comms.stats.record_time("input", "decode", shares, time.perf_counter() - start)
        if self._vbe_strides is not None:
            return self._vbe_kjt(lengths, values, weights)
        features = KeyedJaggedTensor.dist_init(
            keys=self._keys,
            tensors=[lengths, values] + ([weights] if weights is not None else []),
            variable_stride_per_key=False,
            num_workers=self._pg.size(),
            recat=self._recat,
            stride_per_rank=self._stride_per_rank,
            stagger=1,
        )
        state = KJTDistState(self._stride_per_rank, dedupe, self._source_mask)
        return DistributedKJT.of(features, state)

    def _vbe_kjt(
        self, lengths: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None
    ) -> KeyedJaggedTensor:
        """TorchRec's VBE KJT from the padded lengths: the real lengths, and the per-feature
        batches as the int64 tensor TorchRec's all-to-all delivers."""
        assert self._vbe_strides is not None
        device = lengths.device
        lengths = lengths[vbe_lengths_mask(self._vbe_strides, self._stride_per_rank, device)]
        flat = [b for per_src in self._vbe_strides for b in per_src]
        strides = torch.tensor(flat, dtype=torch.int64, device=device)
        return KeyedJaggedTensor.dist_init(
            keys=self._keys,
            tensors=[lengths, values, strides] + ([weights] if weights is not None else []),
            variable_stride_per_key=True,
            num_workers=self._pg.size(),
            recat=self._recat,
            stride_per_rank=None,
            stagger=1,
        )


class LossyKJTAllToAllSplitsAwaitable(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """First step: encodes and exchanges the metadata; its wait launches the payload exchange.

    Args:
        pg: Process group.
        input: This rank's KJT, features ordered by destination.
        splits: Features per destination rank.
        keys: Local keys after the all-to-all.
        comms: Shared config and telemetry.
        output_dedupe: Cross-side deduplication mode (see :class:`OutputDedupe`; the output
            dist must be the lossy one, which reads it from the sharding context).
        source_mask: The batch's row-wise source mask (see
            :class:`LossyKJTAllToAllTensorsAwaitable`), or None.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        input: KeyedJaggedTensor,
        splits: list[int],
        keys: list[str],
        comms: LossyComms,
        output_dedupe: OutputDedupeMode = None,
        source_mask: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._input = input  # alive until the exchange it feeds is launched
        self._splits = splits
        self._keys = keys
        self._comms = comms
        self._output_dedupe = output_dedupe
        self._source_mask = source_mask
        self._vbe = input.variable_stride_per_key()  # every rank's, as TorchRec assumes
        self._enc = encode_with_telemetry(
            input, splits, comms, None if self._vbe else output_dedupe
        )
        world = pg.size()
        self._recv_meta_splits = [meta_words(len(keys), self._vbe)] * world
        self._recv_meta = torch.empty(
            sum(self._recv_meta_splits), dtype=torch.int64, device=self._enc.meta.device
        )
        with profile_range("## lossy_input splits ##"):
            self._meta_work = dist.all_to_all_single(
                self._recv_meta,
                self._enc.meta,
                self._recv_meta_splits,
                self._enc.meta_splits,
                group=pg,
                async_op=True,
            )

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        with profile_range("## lossy_input splits ##"):
            self._meta_work.wait()
            meta = self._recv_meta.tolist()  # the host read of the splits exchange
        n = self._recv_meta_splits[0] if self._recv_meta_splits else 0
        recv_words, strides, codes, metas_per_src, vbe_strides = [], [], [], [], []
        for src in range(self._pg.size()):
            row = parse_meta(meta[src * n : (src + 1) * n], len(self._keys))
            if (row.strides is not None) != self._vbe:
                raise LossyAllToAllError(
                    f"lossy input dist on rank {self._pg.rank()}: rank {src} sent a "
                    f"{'VBE' if row.strides is not None else 'fixed-batch'} KJT, this rank a "
                    f"{'VBE' if self._vbe else 'fixed-batch'} one; every rank must feed KJTs "
                    "of the same kind (as TorchRec's KJTAllToAll assumes)"
                )
            recv_words.append(row.payload_words)
            strides.append(row.batch)
            codes.append(row.codes)
            metas_per_src.append(row.features)
            vbe_strides.append(row.strides or [])
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
        send = self._enc.send
        recv = torch.empty(sum(recv_words), dtype=torch.int32, device=send.device)
        with profile_range("## lossy_input payload ##"):
            work = dist.all_to_all_single(
                recv, send, recv_words, self._enc.send_words, group=self._pg, async_op=True
            )
        return LossyKJTAllToAllTensorsAwaitable(
            pg=self._pg,
            splits=self._splits,
            keys=self._keys,
            exchange=PayloadExchange(recv, recv_words, work),
            metas_per_src=metas_per_src,
            stride_per_rank=strides,
            codes=codes,
            comms=self._comms,
            output_dedupe=dedupe,
            vbe_strides=vbe_strides if self._vbe else None,
            source_mask=self._source_mask,
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
        if dist.get_backend(pg) == "gloo":  # CPU tensors: the codec's compiled path, load it now
            warm_up_host()

    def forward(self, input: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Sends each rank its features, packed (see :meth:`packed`).

        Args:
            input: KJT whose keys are ordered by destination rank.

        Returns:
            Awaitable of an awaitable of the local KJT (as ``KJTAllToAll``).
        """
        return self.packed(input)

    def packed(
        self, input: KeyedJaggedTensor, source_mask: torch.Tensor | None = None
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Sends each rank its features, packed; TorchRec's path for the inputs it cannot pack.

        Not ``forward``, so that a train pipeline's override of ``forward`` does not bypass it.

        Args:
            input: KJT whose keys are ordered by destination rank.
            source_mask: Row-wise pooled input dists: the batch's source mask, carried to the
                output dist in the decoded KJT's state (TorchRec's fallback path drops it:
                every source then counts, which changes no lossless result).

        Returns:
            Awaitable of an awaitable of the local KJT (as ``KJTAllToAll``).
        """
        weights = input.weights_or_none()
        if self._pg.size() == 1 or (weights is not None and weights.dim() != 1):
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
                self._pg, input, self._splits, keys, self._comms, self._output_dedupe, source_mask
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
