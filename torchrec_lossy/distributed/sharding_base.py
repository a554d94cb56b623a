"""What every lossy sharding shares: TorchRec's constructor plus the module's comms and ledger.

Mixed in before a TorchRec sharding class (``class LossyX(LossyShardingMixin, XSharding)``): the
comms state and call ledger are set before TorchRec's constructor runs, since TorchRec may build
dists in it.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.types import ShardingEnv

from torchrec_lossy.distributed.call_ledger import CallLedger
from torchrec_lossy.distributed.comms import LossyComms


class LossyShardingMixin:
    """TorchRec's sharding constructor with the sharded module's shared state first.

    Args:
        sharding_infos: Tables of this sharding.
        env: Sharding environment.
        comms: Shared state of the sharded module (config, bounds, telemetry).
        ledger: The sharded module's call ledger (shared by all its dists).
        device: Device of the lookups.
        **kwargs: The TorchRec sharding's other keyword arguments (``qcomm_codecs_registry``,
            ``permute_embeddings`` for column-wise shardings).
    """

    _lossy_comms: LossyComms
    _lossy_ledger: CallLedger

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        comms: LossyComms,
        ledger: CallLedger,
        device: torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        self._lossy_comms = comms
        self._lossy_ledger = ledger
        super().__init__(sharding_infos, env, device, **kwargs)  # type: ignore[call-arg]
