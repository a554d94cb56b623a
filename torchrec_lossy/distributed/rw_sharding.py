"""Row-wise sharding whose pooled output travels compressed: an all-to-all plus a local sum.

TorchRec's reduce-scatter adds what ranks send on the wire, which a variable-size lossy payload
cannot be: here each rank codes its partial sums per destination like a table-wise block (the
part it keeps is exact) and the receiver adds the decoded parts in fp32, in rank order, so a
pooled value is within the sum of the other ``world - 1`` senders' bounds. The backward is the
adjoint (TorchRec's all-gather, compressed); VBE uses :mod:`.vbe`'s dense layout.
docs/sharder.md, "Row-wise" (VBE: "How the all-to-all works").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
    bucketize_kjt_before_all2all,
)
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import (
    RwPooledEmbeddingDist,
    RwPooledEmbeddingSharding,
    RwSparseFeaturesDist,
)
from torchrec.distributed.types import Awaitable, QuantizedCommCodecs
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.comms import LossyComms
from torchrec_lossy.distributed.context import LossyShardingContext
from torchrec_lossy.distributed.input_dist import LossyKJTAllToAll
from torchrec_lossy.distributed.output_dist import LossyPooledEmbeddingsAllToAll, pooled_layout
from torchrec_lossy.distributed.pooled_blocks import BlockSpec
from torchrec_lossy.distributed.sharding_base import LossyShardingMixin
from torchrec_lossy.distributed.torchrec_adapter import kjt_all_to_all, replace_kjt_all_to_all
from torchrec_lossy.distributed.vbe import pad_vbe_input, pad_vbe_lengths, unpad_vbe_output

logger: logging.Logger = logging.getLogger(__name__)


class PartialSums:
    """The receiver's reduction: ``[B, world * D]`` (one part per source) -> ``[B, D]``.

    Adds the parts in fp32 in source order (TorchRec's reduce-scatter, done locally). With a
    source mask, a source's part of a bag without ids in its row shard is left out: it is zero
    before coding, so the sum is unchanged but for the coding error it would add, and autograd
    hands that source a zero gradient row there (its lookup has nothing to update), which the
    backward codec sends as a repeated row.

    Args:
        parts: Sources (the group size).
        column_mask: Bool ``[B, parts, D]``: which parts' columns count; None: all.
    """

    def __init__(self, parts: int, column_mask: torch.Tensor | None = None) -> None:
        self.parts = parts
        self.column_mask = column_mask

    def __call__(self, received: torch.Tensor) -> torch.Tensor:
        """Sums the parts.

        Args:
            received: ``[B, parts * D]``, source ``s``'s part at columns ``s*D:(s+1)*D``.

        Returns:
            ``[B, D]`` in ``received``'s dtype.
        """
        parts = received.unflatten(1, (self.parts, -1))
        if self.column_mask is not None:
            parts = parts.masked_fill(~self.column_mask, 0.0)
        return parts.sum(dim=1, dtype=torch.float32).to(received.dtype)


def column_mask(source_mask: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """A source mask per feature widened to the features' output columns.

    Args:
        source_mask: Bool ``[world, F, B]`` (see ``LossyShardingContext.source_mask``).
        dims: Output columns of each of the ``F`` features, in column order.

    Returns:
        Bool ``[B, world, sum(dims)]``.
    """
    widths = torch.tensor(list(dims), device=source_mask.device)
    return source_mask.permute(2, 0, 1).repeat_interleave(widths, dim=2)


class LossyRwPooledEmbeddingDist(RwPooledEmbeddingDist):
    """``RwPooledEmbeddingDist`` whose reduce-scatter is a compressed all-to-all and a local sum.

    Args:
        pg: Process group of the row shards.
        embedding_dims: Output columns of each feature (TorchRec's argument).
        specs: The local lookup's table shards in column order (the same on every rank: each
            holds a row shard of every table).
        comms: Shared state of the sharded module.
        ledger: The sharded module's call ledger.
        device: Device of the embeddings.
        qcomm_codecs_registry: TorchRec qcomm codecs (kept for TorchRec's bookkeeping; the
            lossy all-to-all replaces its reduce-scatter codec).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        embedding_dims: list[int],
        specs: tuple[BlockSpec, ...],
        comms: LossyComms,
        ledger: CallLedger,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(pg, embedding_dims, qcomm_codecs_registry=qcomm_codecs_registry)
        if sum(s.width for s in specs) != sum(embedding_dims):
            raise ValueError(
                f"table shards span {sum(s.width for s in specs)} columns, the features "
                f"{sum(embedding_dims)}"
            )
        self._parts = pg.size()  # one part of every bag's sum per rank
        self._a2a_rank = pg.rank()
        self._feature_dims = list(embedding_dims)
        self._a2a = LossyPooledEmbeddingsAllToAll(pg, [specs] * self._parts, comms, ledger, device)

    def forward(
        self,
        local_embs: torch.Tensor,
        sharding_ctx: EmbeddingShardingContext | None = None,
    ) -> Awaitable[torch.Tensor]:
        """Sends each rank its rows of the partial sums, compressed; the receiver adds them.

        Args:
            local_embs: ``[B_global, D]`` partial pooled sums of the local row shards (VBE:
                TorchRec's flat layout, per destination, per feature, its bags).
            sharding_ctx: Context of the input dist (batch size per rank, or per rank and
                feature for VBE).

        Returns:
            Awaitable of ``[B_local, D]``, the pooled embeddings (VBE: TorchRec's flat output,
            per feature, this rank's bags).
        """
        vbe = sharding_ctx is not None and sharding_ctx.variable_batch_per_feature
        batches = sharding_ctx.batch_size_per_rank_per_feature if sharding_ctx else []
        rows = [max(b, default=0) for b in batches] if vbe else None
        if rows is not None:
            local_embs = pad_vbe_input(local_embs, batches, self._feature_dims, rows)
        batch_size_per_rank = rows or (sharding_ctx.batch_size_per_rank if sharding_ctx else None)
        awaitable = self._a2a(local_embs, batch_size_per_rank=batch_size_per_rank)
        mask = sharding_ctx.source_mask if isinstance(sharding_ctx, LossyShardingContext) else None
        columns = column_mask(mask, self._feature_dims) if mask is not None else None
        awaitable.callbacks.append(PartialSums(self._parts, columns))
        if rows is not None:
            mine = batches[self._a2a_rank]
            unpad = functools.partial(
                unpad_vbe_output, batch_size_per_feature_pre_a2a=mine, dims=self._feature_dims
            )
            awaitable.callbacks.append(unpad)
        return awaitable


class LossyRwSparseFeaturesDist(RwSparseFeaturesDist):
    """``RwSparseFeaturesDist`` whose bucketized KJT all-to-all is packed losslessly.

    TorchRec bucketizes the ids by row shard and sends bucket ``r`` to rank ``r`` through the
    ``KJTAllToAll`` its constructor builds (which train pipelines look for there); with no
    public hook to build another, :mod:`.torchrec_adapter` puts :class:`LossyKJTAllToAll` in
    its place, and :meth:`forward` calls its ``packed`` (so a pipeline's override of the
    all-to-all's ``forward`` does not bypass it). ``tests/distributed/test_torchrec_adapter.py``
    fails when TorchRec's dist changes what this relies on.

    Args:
        comms: Shared state of the sharded module.
        **kwargs: ``RwSparseFeaturesDist``'s arguments.
    """

    def __init__(self, comms: LossyComms, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        pg = kwargs["pg"]
        assert isinstance(pg, dist.ProcessGroup)
        replace_kjt_all_to_all(
            self, LossyKJTAllToAll(pg, [self._num_features] * self._world_size, comms)
        )

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Bucketizes the ids by row shard (as TorchRec does), then the packed all-to-all.

        Args:
            sparse_features: This rank's features.

        Returns:
            Awaitable of an awaitable of the local KJT.
        """
        bucketized, self.unbucketize_permute_tensor = bucketize_kjt_before_all2all(
            sparse_features,
            num_buckets=self._world_size,
            block_sizes=self._feature_block_sizes_tensor,
            total_num_blocks=(
                self._feature_total_num_blocks_tensor
                if self._has_multiple_blocks_per_shard
                else None
            ),
            output_permute=self._is_sequence,
            bucketize_pos=(
                self._has_feature_processor
                if sparse_features.weights_or_none() is None
                else self._need_pos
            ),
            keep_original_indices=self._keep_original_indices,
            block_bucketize_row_pos=self.zch_bucketize_row_pos,
        )
        a2a = kjt_all_to_all(self)
        assert isinstance(a2a, LossyKJTAllToAll)
        mask = (
            None
            if self._is_sequence
            else source_mask(bucketized, sparse_features, self._world_size, self._num_features)
        )
        # The mask travels with this batch's decoded features (their KJTDistState), to the
        # sharding context the output dist reads (context.bind_input_state).
        return a2a.packed(bucketized, mask)


def source_mask(
    bucketized: KeyedJaggedTensor, features: KeyedJaggedTensor, world: int, num_features: int
) -> torch.Tensor:
    """Which of this rank's bags have ids in each rank's row shard, for the output dist.

    Args:
        bucketized: The KJT bucketized by row shard (bucket ``r``'s features first for rank
            ``r``).
        features: This rank's features before bucketizing.
        world: Ranks (buckets).
        num_features: Features per bucket.

    Returns:
        Bool ``[world, features, batch]`` (VBE: each feature's bags padded to the largest
        batch with False, as the output dist lays them).
    """
    lengths = bucketized.lengths()
    if features.variable_stride_per_key():
        lengths = pad_vbe_lengths(lengths, features.stride_per_key() * world)[0]
    return lengths.view(world, num_features, -1) > 0


def packed_rw_input_dist(
    sharding: RwPooledEmbeddingSharding | RwSequenceEmbeddingSharding,
    base: BaseSparseFeaturesDist[KeyedJaggedTensor],
    device: torch.device | None,
    is_sequence: bool,
) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
    """A row-wise sharding's input dist: :class:`LossyRwSparseFeaturesDist` with TorchRec's
    arguments, or TorchRec's own (``base``) if ``input_dist.enabled`` is off or TorchRec built
    another kind.

    Args:
        sharding: The lossy row-wise sharding (pooled or sequence; carries ``_lossy_comms``).
        base: The input dist TorchRec's sharding created.
        device: Device of the bucketization buffers.
        is_sequence: Whether the sharding is a sequence (``EmbeddingCollection``) one.

    Returns:
        The input dist.
    """
    comms: LossyComms = sharding._lossy_comms  # type: ignore[union-attr]
    if not comms.config.input_dist.enabled or type(base) is not RwSparseFeaturesDist:
        return base
    assert sharding._pg is not None
    return LossyRwSparseFeaturesDist(
        comms,
        pg=sharding._pg,
        num_features=sharding._get_num_features(),
        feature_hash_sizes=sharding._get_feature_hash_sizes(),
        device=device if device is not None else sharding._device,
        is_sequence=is_sequence,
        has_feature_processor=sharding._has_feature_processor,
        virtual_table_feature_num_buckets=sharding._get_virtual_table_feature_num_buckets(),
        need_pos=False if is_sequence else sharding._need_pos,
    )


class LossyRwPooledEmbeddingSharding(LossyShardingMixin, RwPooledEmbeddingSharding):
    """Row-wise sharding with a compressed output dist and a packed input dist (constructor:
    ``LossyShardingMixin``)."""

    def create_input_dist(
        self, device: torch.device | None = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return packed_rw_input_dist(self, super().create_input_dist(device), device, False)

    def create_output_dist(
        self, device: torch.device | None = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        assert self._pg is not None
        (specs,) = pooled_layout([self._grouped_embedding_configs])
        return LossyRwPooledEmbeddingDist(
            self._pg,
            embedding_dims=self.embedding_dims(),
            specs=specs,
            comms=self._lossy_comms,
            ledger=self._lossy_ledger,
            device=device if device is not None else self._device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
        )
