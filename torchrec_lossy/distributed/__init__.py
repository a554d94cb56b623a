"""The TorchRec seam: compressed pooled-embedding all-to-all and the drop-in sharder.

This subpackage is the only part of torchrec_lossy that imports ``torchrec.distributed``.
"""

from torchrec_lossy.distributed.comm_ops import alltoall_pooled_lossy
from torchrec_lossy.distributed.comms import BoundProvider, LossyComms, StaticBounds
from torchrec_lossy.distributed.errors import LossyAllToAllError
from torchrec_lossy.distributed.input_dist import (
    LossyKJTAllToAll,
    LossyTwSparseFeaturesDist,
)
from torchrec_lossy.distributed.model_utils import (
    bounds_state,
    check_lossy_decodes,
    load_bounds_state,
    lossy_modules,
    lossy_stats,
    step_lossy_bounds,
)
from torchrec_lossy.distributed.output_dist import (
    LossyPooledEmbeddingsAllToAll,
    LossyTwPooledEmbeddingDist,
    pooled_layout,
)
from torchrec_lossy.distributed.pooled_payload import BlockSpec, LossyAll2AllPooledInfo
from torchrec_lossy.distributed.sequence_output_dist import (
    LossySequenceEmbeddingsAllToAll,
    LossyTwSequenceEmbeddingDist,
    alltoall_sequence_lossy,
)
from torchrec_lossy.distributed.sequence_sharder import (
    LossyEmbeddingCollectionSharder,
    LossyShardedEmbeddingCollection,
)
from torchrec_lossy.distributed.sequence_sharding import (
    LossyCwSequenceEmbeddingSharding,
    LossyTwSequenceEmbeddingSharding,
)
from torchrec_lossy.distributed.sharder import (
    LossyEmbeddingBagCollectionSharder,
    LossyShardedEmbeddingBagCollection,
)
from torchrec_lossy.distributed.sharding import (
    LossyCwPooledEmbeddingSharding,
    LossyTwCwPooledEmbeddingSharding,
    LossyTwPooledEmbeddingSharding,
)
from torchrec_lossy.distributed.stats import LossyCommsStats, TableCommStats

__all__ = [
    "BlockSpec",
    "BoundProvider",
    "LossyAll2AllPooledInfo",
    "LossyAllToAllError",
    "LossyComms",
    "LossyCommsStats",
    "LossyCwPooledEmbeddingSharding",
    "LossyCwSequenceEmbeddingSharding",
    "LossyEmbeddingBagCollectionSharder",
    "LossyEmbeddingCollectionSharder",
    "LossyKJTAllToAll",
    "LossyPooledEmbeddingsAllToAll",
    "LossySequenceEmbeddingsAllToAll",
    "LossyShardedEmbeddingBagCollection",
    "LossyShardedEmbeddingCollection",
    "LossyTwCwPooledEmbeddingSharding",
    "LossyTwPooledEmbeddingDist",
    "LossyTwPooledEmbeddingSharding",
    "LossyTwSequenceEmbeddingDist",
    "LossyTwSequenceEmbeddingSharding",
    "LossyTwSparseFeaturesDist",
    "StaticBounds",
    "TableCommStats",
    "alltoall_pooled_lossy",
    "alltoall_sequence_lossy",
    "bounds_state",
    "check_lossy_decodes",
    "load_bounds_state",
    "lossy_modules",
    "lossy_stats",
    "pooled_layout",
    "step_lossy_bounds",
]
