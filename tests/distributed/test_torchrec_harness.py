"""TorchRec's own model-parallel check with the lossy sharders substituted, per sharding type.

``torchrec.distributed.test_utils.test_sharding.sharding_single_rank_test_single_process``
(what TorchRec's ``test_model_parallel`` and ``test_sequence_model_parallel`` run) builds its
``TestSparseNN`` (unweighted, weighted and shared-feature tables, dense and over arches) or
``TestSequenceSparseNN``, shards it with the given sharder, trains a step and compares the
predictions with the unsharded model's. Here the sharder is the lossy one at bound 0 with the
exact backward (lossless), restricted to one sharding type as TorchRec's ``TestEBCSharder``
restricts its own: EBC TW, CW, RW (2 ranks), TWRW and grid (2 hosts x 1 rank; grid with
TorchRec's ``test_sharding_grid`` constraint of a minimum column partition); EC TW, CW, RW. A
lossy bound must make TorchRec's comparison fail: the check sees our dists (also checked for
grid by hand: bound 0.5 fails it).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from harness import EXACT_BACKWARD, run_workers, torchrec_test_sharding

pytestmark = pytest.mark.dist


def _tables(config_cls: Any, dim: Any, rows: Any) -> tuple[list[Any], dict[str, list[str]]]:
    """TorchRec's test tables: 4 of their own features, 2 sharing features 0 and 1; the
    embedding groups that name the shared ones ``feature@table``."""
    # (table index, feature index): tables 4 and 5 share the features of tables 0 and 1.
    slots = [(i, i) for i in range(4)] + [(i + 4, i) for i in range(2)]
    tables = [
        config_cls(
            num_embeddings=rows(f),
            embedding_dim=dim(f),
            name=f"table_{t}",
            feature_names=[f"feature_{f}"],
        )
        for t, f in slots
    ]
    shared = {"feature_0", "feature_1"}
    groups = {
        "group_0": [f"{f}@{t.name}" if f in shared else f for t in tables for f in t.feature_names]
    }
    return tables, groups


def _one_type(base_cls: type, sharding_type: str, bound: float, local_size: int) -> Any:
    """``base_cls`` (a lossy sharder) offering one sharding type and the fused kernel, as
    TorchRec's ``TestEBCSharder`` does with its own, at an absolute ``bound``."""
    from torchrec_lossy.config import ErrorBound, LossyCommsConfig

    class OneTypeSharder(base_cls):  # type: ignore[misc, valid-type]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [sharding_type]

        def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
            return ["fused"]

    config = LossyCommsConfig(
        default_bound=ErrorBound("absolute", bound), local_world_size=local_size, **EXACT_BACKWARD
    )
    return OneTypeSharder(fused_params={"learning_rate": 0.1}, comms_config=config)


def _check(rank: int, world_size: int, **kwargs: Any) -> str:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    torchrec_test_sharding().sharding_single_rank_test_single_process(
        pg=dist.group.WORLD,
        device=torch.device("cpu"),
        rank=rank,
        world_size=world_size,
        optim=EmbOptimType.EXACT_SGD,
        **kwargs,
    )
    return "ok"


def _ebc_worker(
    rank: int, world_size: int, sharding_type: str, local_size: int, bound: float = 0.0
) -> str:
    os.environ["LOCAL_WORLD_SIZE"] = str(local_size)
    from torchrec.distributed.test_utils.test_model import TestSparseNN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    tables, groups = _tables(EmbeddingBagConfig, lambda i: (i + 2) * 8, lambda i: (i + 1) * 10)
    weighted = [
        EmbeddingBagConfig(
            num_embeddings=(i + 1) * 10,
            embedding_dim=(i + 2) * 4,
            name=f"weighted_table_{i}",
            feature_names=[f"weighted_feature_{i}"],
        )
        for i in range(2)
    ]
    sharder = _one_type(LossyEmbeddingBagCollectionSharder, sharding_type, bound, local_size)
    constraints = None
    if sharding_type == "grid_shard":  # column shards of 4, as TorchRec's test_sharding_grid
        from torchrec.distributed.planner.types import ParameterConstraints

        constraints = {
            t.name: ParameterConstraints(min_partition=4, sharding_types=[sharding_type])
            for t in tables + weighted
        }
    return _check(
        rank,
        world_size,
        constraints=constraints,
        model_class=TestSparseNN,
        embedding_groups=groups,
        tables=tables,
        weighted_tables=weighted,
        sharders=[sharder],
        local_size=local_size,
    )


def _ec_worker(rank: int, world_size: int, sharding_type: str) -> str:
    from torchrec.modules.embedding_configs import EmbeddingConfig

    from torchrec_lossy.distributed import LossyEmbeddingCollectionSharder

    torchrec_test_sharding()  # registers the vendored sequence model first
    from torchrec.distributed.tests.test_sequence_model import TestSequenceSparseNN

    tables, groups = _tables(EmbeddingConfig, lambda i: 16, lambda i: (i + 1) * 11)
    sharder = _one_type(LossyEmbeddingCollectionSharder, sharding_type, 0.0, world_size)
    return _check(
        rank,
        world_size,
        model_class=TestSequenceSparseNN,
        embedding_groups=groups,
        tables=tables,
        sharders=[sharder],
        global_constant_batch=True,
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "sharding_type,local_size",
    [
        ("table_wise", 2),
        ("column_wise", 2),
        pytest.param("row_wise", 2, marks=pytest.mark.slow),
        pytest.param("table_row_wise", 1, marks=pytest.mark.slow),
        pytest.param("grid_shard", 1, marks=pytest.mark.slow),
    ],
)
def test_torchrec_model_parallel_check_passes_with_the_lossy_sharder(
    sharding_type: str, local_size: int
) -> None:
    assert run_workers(_ebc_worker, 2, sharding_type, local_size, timeout_s=600) == ["ok"] * 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrec_check_fails_when_the_forward_is_lossy() -> None:
    with pytest.raises(AssertionError, match="not close"):
        run_workers(_ebc_worker, 2, "table_wise", 2, 0.5, timeout_s=600)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise", "row_wise"])
def test_torchrec_sequence_model_check_passes_with_the_lossy_ec_sharder(
    sharding_type: str,
) -> None:
    assert run_workers(_ec_worker, 2, sharding_type, timeout_s=600) == ["ok"] * 2
