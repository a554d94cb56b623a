"""Table-wise, column-wise and row-wise sequence shardings whose embedding all-to-all is compressed.

TorchRec's sequence shardings with the input dist replaced by the packed KJT all-to-all
(:mod:`.input_dist` without its bag dedupe; RW: :mod:`.rw_sharding`'s bucketized one) and the
output dist by :mod:`.sequence_output_dist` (row dedupe: :mod:`.sequence_dedupe`). Data-parallel
stays TorchRec's (``LossyShardedEmbeddingCollection.create_embedding_sharding``).
"""

from __future__ import annotations

import torch
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingSharding,
)
from torchrec.distributed.sharding.cw_sequence_sharding import CwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.distributed.input_dist import LossyTwSparseFeaturesDist
from torchrec_lossy.distributed.output_dist import pooled_layout
from torchrec_lossy.distributed.rw_sharding import packed_rw_input_dist
from torchrec_lossy.distributed.sequence_output_dist import (
    LossyRwSequenceEmbeddingDist,
    LossyTwSequenceEmbeddingDist,
)
from torchrec_lossy.distributed.sharding_base import LossyShardingMixin

SequenceSharding = EmbeddingSharding[
    SequenceShardingContext, KeyedJaggedTensor, torch.Tensor, torch.Tensor
]


class LossyTwSequenceEmbeddingSharding(LossyShardingMixin, TwSequenceEmbeddingSharding):
    """Table-wise sequence sharding with the packed input dist and a compressed output dist
    (constructor: ``LossyShardingMixin``)."""

    def create_input_dist(
        self, device: torch.device | None = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        """The packed lossless KJT all-to-all, or TorchRec's if ``input_dist.enabled`` is off.

        Args:
            device: Unused (as TorchRec's).

        Returns:
            The input dist.
        """
        if not self._lossy_comms.config.input_dist.enabled:
            return super().create_input_dist(device)
        assert self._pg is not None
        # Without the input dist's bag dedupe: the sequence output dist finds distinct ids itself.
        return LossyTwSparseFeaturesDist(self._pg, self.features_per_rank(), self._lossy_comms)

    def create_output_dist(
        self, device: torch.device | None = None
    ) -> BaseEmbeddingDist[SequenceShardingContext, torch.Tensor, torch.Tensor]:
        """The compressed sequence-embedding all-to-all.

        Args:
            device: Unused (buffers follow the embeddings).

        Returns:
            The output dist.
        """
        assert self._pg is not None
        return LossyTwSequenceEmbeddingDist(
            self._pg,
            pooled_layout(self._grouped_embedding_configs_per_rank),
            self._lossy_comms,
            self._lossy_ledger,
        )


class LossyCwSequenceEmbeddingSharding(
    LossyTwSequenceEmbeddingSharding, CwSequenceEmbeddingSharding
):
    """Column-wise sequence sharding: TorchRec's is its table-wise one over column shards (each
    shard a feature of its own, merged by the sharded module), so the lossy one is likewise."""


class LossyRwSequenceEmbeddingSharding(LossyShardingMixin, RwSequenceEmbeddingSharding):
    """Row-wise sequence sharding: the bucketized KJT all-to-all packed, the rows of each
    rank's ids coded per (destination, table) (constructor: ``LossyShardingMixin``)."""

    def create_input_dist(
        self, device: torch.device | None = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        """The packed bucketized KJT all-to-all, or TorchRec's if ``input_dist.enabled`` is off.

        Args:
            device: Device of TorchRec's bucketization buffers.

        Returns:
            The input dist.
        """
        return packed_rw_input_dist(self, super().create_input_dist(device), device, True)

    def create_output_dist(
        self, device: torch.device | None = None
    ) -> BaseEmbeddingDist[SequenceShardingContext, torch.Tensor, torch.Tensor]:
        """The compressed row-wise sequence-embedding all-to-all.

        Args:
            device: Unused (buffers follow the embeddings).

        Returns:
            The output dist.
        """
        assert self._pg is not None
        world = self._pg.size()
        blocks = [(h + world - 1) // world for h in self._get_feature_hash_sizes()]
        (specs,) = pooled_layout([self._grouped_embedding_configs])
        return LossyRwSequenceEmbeddingDist(
            self._pg, specs, blocks, self._lossy_comms, self._lossy_ledger
        )


# Sequence sharding types whose embeddings travel by all-to-all: compressed here.
LOSSY_SEQUENCE_SHARDING_TYPES: dict[str, type] = {
    ShardingType.TABLE_WISE.value: LossyTwSequenceEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: LossyCwSequenceEmbeddingSharding,
    ShardingType.ROW_WISE.value: LossyRwSequenceEmbeddingSharding,
}
