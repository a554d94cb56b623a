"""Compression-aware sharding planner: TorchRec's planner pricing the lossy codec per table.

Imports torchrec (this is part of the TorchRec seam, like ``torchrec_lossy.distributed``).
"""

from torchrec_lossy.planner.calibrate import (
    Calibration,
    calibrate,
    pooled_blocks,
    synthetic_blocks,
)
from torchrec_lossy.planner.cost import (
    CommsModel,
    FixedCommsModel,
    TableComms,
    WireFormat,
    qcomm_model,
    raw_model,
)
from torchrec_lossy.planner.estimator import LossyPerfEstimator, ShardCost
from torchrec_lossy.planner.lossy_model import LossyCommsModel
from torchrec_lossy.planner.planner import (
    LossyEnumerator,
    LossyShardingPlanner,
    PlannedTable,
    StepCost,
    build_module,
    build_topology,
    format_plan,
    per_rank_batch_size,
)
from torchrec_lossy.planner.speeds import Speeds, agree_speeds, measure_speeds

__all__ = [
    "Calibration",
    "CommsModel",
    "FixedCommsModel",
    "LossyCommsModel",
    "LossyEnumerator",
    "LossyPerfEstimator",
    "LossyShardingPlanner",
    "PlannedTable",
    "ShardCost",
    "Speeds",
    "StepCost",
    "TableComms",
    "WireFormat",
    "agree_speeds",
    "build_module",
    "build_topology",
    "calibrate",
    "format_plan",
    "measure_speeds",
    "per_rank_batch_size",
    "pooled_blocks",
    "qcomm_model",
    "raw_model",
    "synthetic_blocks",
]
