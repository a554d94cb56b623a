"""TorchRec's own sharder for ``comms.format: auto``'s TorchRec path, with the config check.

Where ``auto`` finds that this project's seam cannot pay on the link
(:attr:`~torchrec_lossy.planner.planner.LossyShardingPlanner.torchrec_path`), the planner hands
out TorchRec's ``EmbeddingBagCollectionSharder``. Its ranks must still agree: a rank whose
config differs (or whose ``auto`` resolved to the seam) would otherwise run a different
exchange against its peers. :class:`CheckedEmbeddingBagCollectionSharder` runs the seam's
check (:func:`~torchrec_lossy.distributed.config_check.check_same_config`) at sharding, with
the path among the checked facts, so a mismatch fails on every rank with one error naming the
differing keys and ranks, on either path.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_lossy.config import LossyCommsConfig
from torchrec_lossy.distributed.config_check import check_same_config

__all__ = ["TORCHREC_PATH", "CheckedEmbeddingBagCollectionSharder"]

# The checked fact that says which exchange a rank runs (the seam's sharder checks its own).
TORCHREC_PATH: dict[str, object] = {"path": "TorchRec's own all-to-all"}


class CheckedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder, checking at sharding that every rank runs the same comms config.

    Args:
        comms_config: The comms config this rank resolved (the planner's ``comms_config``).
        fused_params: TorchRec fused params (optimizer etc.).
        qcomm_codecs_registry: TorchRec's qcomm codecs, as for its own sharder.
    """

    def __init__(
        self,
        comms_config: LossyCommsConfig,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._comms_config = comms_config

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingBagCollection:
        """Checks the ranks' configs, then shards as TorchRec does.

        Args:
            module: The module.
            params: Its tables' plan.
            env: Sharding environment (its process group is checked).
            device: Device of the shards.
            module_fqn: Its name in the model.

        Returns:
            TorchRec's sharded module.

        Raises:
            ConfigMismatchError: On every rank, when the ranks' configs (or paths) differ.
        """
        what = module_fqn or type(module).__name__
        check_same_config(self._comms_config, env.process_group, what, TORCHREC_PATH)
        return super().shard(module, params, env, device, module_fqn)

    @property
    def comms_config(self) -> LossyCommsConfig:
        """The checked comms config."""
        return self._comms_config
