"""The TorchRec seam: compressed pooled-embedding all-to-all and the drop-in sharder.

This subpackage is the only part of torchrec_lossy that imports ``torchrec.distributed``. Its
public names load their module on first use (``lazy_exports``): the lossless KJT input codec
does not load the lossy output dists.
"""

from __future__ import annotations

from torchrec_lossy.lazy_exports import lazy_exports

# Each module -> the public names it gives the package (a module may take its ``__all__`` from
# here: the package knows them without importing the module, and TorchRec with it).
EXPORTS: dict[str, list[str]] = {
    "torchrec_lossy.distributed.comm_ops": [
        "alltoall_pooled_lossy",
    ],
    "torchrec_lossy.distributed.comms": [
        "BoundProvider",
        "LossyComms",
        "StaticBounds",
    ],
    "torchrec_lossy.distributed.config_check": [
        "ConfigMismatchError",
        "check_same_config",
    ],
    "torchrec_lossy.distributed.errors": [
        "LossyAllToAllError",
    ],
    "torchrec_lossy.distributed.guard": [
        "BoundGuard",
        "Tightening",
    ],
    "torchrec_lossy.distributed.input_dist": [
        "LossyKJTAllToAll",
        "LossyTwSparseFeaturesDist",
    ],
    "torchrec_lossy.distributed.model_utils": [
        "bounds_state",
        "check_lossy_decodes",
        "guard_state",
        "load_bounds_state",
        "load_guard_state",
        "lossy_modules",
        "lossy_stats",
        "step_lossy_bounds",
    ],
    "torchrec_lossy.distributed.output_dist": [
        "LossyPooledEmbeddingsAllToAll",
        "LossyTwPooledEmbeddingDist",
        "pooled_layout",
    ],
    "torchrec_lossy.distributed.pooled_blocks": [
        "BlockSpec",
        "LossyAll2AllPooledInfo",
    ],
    "torchrec_lossy.distributed.sequence_output_dist": [
        "LossySequenceEmbeddingsAllToAll",
        "LossyTwSequenceEmbeddingDist",
        "alltoall_sequence_lossy",
    ],
    "torchrec_lossy.distributed.sequence_sharder": [
        "LossyEmbeddingCollectionSharder",
        "LossyShardedEmbeddingCollection",
    ],
    "torchrec_lossy.distributed.sequence_sharding": [
        "LossyCwSequenceEmbeddingSharding",
        "LossyTwSequenceEmbeddingSharding",
    ],
    "torchrec_lossy.distributed.sharder": [
        "LossyEmbeddingBagCollectionSharder",
        "LossyShardedEmbeddingBagCollection",
    ],
    "torchrec_lossy.distributed.sharding": [
        "LossyCwPooledEmbeddingSharding",
        "LossyTwCwPooledEmbeddingSharding",
        "LossyTwPooledEmbeddingSharding",
    ],
    "torchrec_lossy.distributed.stats": [
        "LossyCommsStats",
        "TableCommStats",
    ],
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
