"""Explicit per-batch state of the lossy dists, from the input dist to the output dist.

Beside TorchRec's batch size per rank the output dist needs the cross-side dedupe state
(:class:`~.dedupe.OutputDedupe`). It rides the decoded KJT (:class:`DistributedKJT`,
:class:`KJTDistState`), since a pipeline that re-attaches re-runs the input dist into a fresh
context but feeds the forward the first run's tensors; the sharded module builds the
:class:`LossyShardingContext` from the features it looks up (:func:`bind_input_state`), so
context and data belong to one batch. docs/input_dist.md, "Train pipelines".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.distributed.dedupe import OutputDedupe


@dataclass(frozen=True)
class KJTDistState:
    """What the packed input dist learned about one batch, for the output dist.

    Attributes:
        batch_size_per_rank: Batch size of every source rank (TorchRec's ``stride_per_rank``).
        output_dedupe: The batch's cross-side dedupe state; None when nothing is deduplicated.
        source_mask: Row-wise pooled shardings: which of this rank's bags have ids in each
            rank's row shard (:attr:`LossyShardingContext.source_mask`), from the bucketized
            KJT this rank sent; it travels with the batch's decoded features, as TorchRec's own
            per-batch data does with its awaitables. None: every source counts.
    """

    batch_size_per_rank: list[int]
    output_dedupe: OutputDedupe | None = None
    source_mask: torch.Tensor | None = None

    def record_stream(self, stream: torch.Stream) -> None:
        """Marks the state's tensors as used on ``stream`` (as ``Multistreamable``).

        Args:
            stream: The stream the output dist runs on.
        """
        if self.output_dedupe is not None:
            self.output_dedupe.record_stream(stream)
        if self.source_mask is not None and self.source_mask.device.type != "cpu":
            self.source_mask.record_stream(stream)  # type: ignore[arg-type]


class DistributedKJT(KeyedJaggedTensor):
    """A ``KeyedJaggedTensor`` decoded by the packed input dist, with its :class:`KJTDistState`.

    The tensors are those of ``KeyedJaggedTensor.dist_init`` (bit-identical to TorchRec's
    ``KJTAllToAll`` result); only :attr:`dist_state` is added. Build it with :meth:`of`.

    Attributes:
        dist_state: The batch's state; None on KJTs derived from this one by TorchRec's methods.
    """

    dist_state: KJTDistState | None = None

    @classmethod
    def of(cls, kjt: KeyedJaggedTensor, state: KJTDistState) -> DistributedKJT:
        """The same KJT (same tensors and cached per-key lengths and offsets), with ``state``.

        Args:
            kjt: A synced KJT (``dist_init`` returns one).
            state: The batch's state.

        Returns:
            The KJT with its state.
        """
        out = cls(
            keys=kjt.keys(),
            values=kjt.values(),
            weights=kjt.weights_or_none(),
            lengths=kjt.lengths(),
            stride=kjt.stride(),
            length_per_key=kjt.length_per_key(),
            offset_per_key=kjt.offset_per_key(),
        )
        out.dist_state = state
        return out

    def record_stream(self, stream: torch.Stream) -> None:  # type: ignore[override]
        """Marks the tensors and the dist state's tensors as used on ``stream``.

        Args:
            stream: The stream the lookup and output dist run on.
        """
        super().record_stream(stream)  # type: ignore[arg-type]
        if self.dist_state is not None:
            self.dist_state.record_stream(stream)


@dataclass
class LossyShardingContext(EmbeddingShardingContext):
    """TorchRec's sharding context plus the batch's cross-side dedupe state.

    Attributes:
        output_dedupe: The state the lossy output dist sends deduplicated rows by; None: off.
        source_mask: Row-wise shardings: bool ``[world, features, batch]``, whether each of this
            rank's bags has ids in each source rank's row shard (the lengths of TorchRec's
            bucketized KJT, kept by the packed RW input dist); the receiver adds only those
            sources' partial sums and sends each source only those rows' gradients (VBE:
            ``batch`` is the largest batch, each feature's bags padded with False). None: all.
    """

    output_dedupe: OutputDedupe | None = None
    source_mask: torch.Tensor | None = None

    @classmethod
    def from_input(
        cls, base: EmbeddingShardingContext, state: KJTDistState
    ) -> LossyShardingContext:
        """``base`` with the batch sizes and dedupe state of the features it goes with.

        Args:
            base: The sharding context TorchRec's input dist filled (or a fresh one).
            state: The state the features were decoded with.

        Returns:
            A new context; ``base`` is left as it is.
        """
        return cls(
            batch_size_per_rank=list(state.batch_size_per_rank),
            batch_size_per_rank_per_feature=base.batch_size_per_rank_per_feature,
            batch_size_per_feature_pre_a2a=base.batch_size_per_feature_pre_a2a,
            variable_batch_per_feature=base.variable_batch_per_feature,
            output_dedupe=state.output_dedupe,
            source_mask=state.source_mask,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        """Marks the dedupe state's tensors as used on ``stream``.

        Args:
            stream: The stream the output dist runs on.
        """
        if self.output_dedupe is not None:
            self.output_dedupe.record_stream(stream)
        if self.source_mask is not None:
            self.source_mask.record_stream(stream)


def bind_input_state(ctx: EmbeddingBagCollectionContext, features: KJTList) -> None:
    """Puts each sharding's input state into its context, from the features themselves.

    Shardings whose features the packed input dist decoded (a :class:`DistributedKJT`) get a
    :class:`LossyShardingContext`; the others keep TorchRec's context.

    Args:
        ctx: The module's context of this batch (its ``sharding_contexts`` are replaced).
        features: Per sharding, the local features about to be looked up.
    """
    for i, kjt in enumerate(features):
        base = ctx.sharding_contexts[i] if i < len(ctx.sharding_contexts) else None
        if base is not None and isinstance(kjt, DistributedKJT) and kjt.dist_state is not None:
            ctx.sharding_contexts[i] = LossyShardingContext.from_input(base, kjt.dist_state)


@dataclass
class LossySequenceShardingContext(SequenceShardingContext):
    """TorchRec's sequence sharding context plus the ids the owner looks up.

    Attributes:
        lookup_ids: The looked-up KJT's values (the ids of the lookup output's rows), for the
            sequence all-to-all's row dedupe; None: every row travels.
    """

    lookup_ids: torch.Tensor | None = None

    def record_stream(self, stream: torch.Stream) -> None:
        """Marks TorchRec's tensors and the lookup ids as used on ``stream``.

        Args:
            stream: The stream the output dist runs on.
        """
        super().record_stream(stream)
        if self.lookup_ids is not None and self.lookup_ids.device.type != "cpu":
            self.lookup_ids.record_stream(stream)  # type: ignore[arg-type]


def bind_lookup_ids(contexts: list[SequenceShardingContext], features: KJTList) -> None:
    """Replaces each sequence sharding context by one that carries its features' ids.

    Args:
        contexts: The module context's ``sharding_contexts`` (replaced in place).
        features: Per sharding, the local features about to be looked up.
    """
    for i, kjt in enumerate(features):
        if i < len(contexts):
            base = contexts[i]
            fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
            fields.pop("lookup_ids", None)
            contexts[i] = LossySequenceShardingContext(**fields, lookup_ids=kjt.values())


def lookup_ids_of(sharding_ctx: object) -> torch.Tensor | None:
    """The lookup ids a sequence sharding context carries (None for TorchRec's own context).

    Args:
        sharding_ctx: A sharding context.

    Returns:
        The ids, or None.
    """
    if isinstance(sharding_ctx, LossySequenceShardingContext):
        return sharding_ctx.lookup_ids
    return None
