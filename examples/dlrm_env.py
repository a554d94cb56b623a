"""Where the DLRM example runs: the process group, and the planner config fitted to it.

Works on CPU (gloo) and on GPUs (NCCL, one GPU per process, ``cuda:LOCAL_RANK``) unchanged, and
survives torchrun's restarts (see :func:`init_distributed`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import socket
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchrec_lossy.config import (
    EmbeddingTableConfig,
    LossyPlanConfig,
    load_yaml,
)

__all__ = [
    "DistEnv",
    "gather_objects",
    "init_distributed",
    "load_plan_config",
    "quiet_torchrec",
]


@dataclass(frozen=True)
class DistEnv:
    """Where this process runs.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks.
        local_rank: Rank on this host.
        local_world_size: Ranks on this host.
        device: ``cuda:LOCAL_RANK`` or ``cpu``.
        backend: ``"nccl"`` or ``"gloo"``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> DistEnv:
    """Initialises the process group from torchrun's environment (or as a single process).

    Returns:
        This process's placement.
    """
    if "RANK" not in os.environ:  # plain `python dlrm_criteo.py`: a world of one
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )  # fmt: skip
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=600)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart != "0":
        # torchrun keeps its store across restarts, and the failed attempt's gloo addresses
        # are still in it: the new workers would connect to dead peers. Key this attempt apart.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            int(os.environ["WORLD_SIZE"]),
            is_master=False,
            timeout=timeout,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"dlrm_criteo_attempt_{restart}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
    world_size = dist.get_world_size()
    return DistEnv(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        device=device,
        backend=backend,
    )


def quiet_torchrec() -> None:
    """Silences TorchRec's per-table planner and DDP chatter (``--verbose`` keeps it)."""
    for name in ("torchrec", "torch.distributed", "torchrec_lossy", "root", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's ``obj``, in rank order (a collective).

    Args:
        obj: A picklable value of this rank.
        env: This process's placement.

    Returns:
        One value per rank.
    """
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def load_plan_config(
    args: argparse.Namespace, env: DistEnv, model: nn.Module
) -> tuple[LossyPlanConfig, str]:
    """The planner config: ``--config`` (or defaults) fitted to this run's model and cluster.

    The ``comms`` and ``planner`` sections are used as written; ``embedding_tables`` become the
    model's tables, the topology gets this run's world size, ranks per host and device, and
    ``--link-gbit`` sets its inter-host bandwidth (on one host: both). Without ``--config``
    the defaults (``comms.format: auto``: the planner picks per table and link the format of
    least estimated time, from speeds measured at start-up; the plan says what it chose).

    Args:
        args: Parsed flags.
        env: This process's placement.
        model: The unsharded model (for its tables).

    Returns:
        ``(LossyPlanConfig, where it came from)``.
    """
    if args.config:
        config, source = load_yaml(LossyPlanConfig, args.config), args.config
    else:
        config, source = LossyPlanConfig(), "defaults (LossyCommsConfig(): format auto)"
    tables = tuple(
        EmbeddingTableConfig(
            name=c.name,
            num_embeddings=c.num_embeddings,
            embedding_dim=c.embedding_dim,
            feature_names=tuple(c.feature_names),
        )
        for c in model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    )
    topo = dataclasses.replace(
        config.topology,
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        compute_device=env.device.type,
    )
    if args.link_gbit is not None:
        gib_s = args.link_gbit * 1e9 / 8 / (1 << 30)
        # Across hosts the link is the one between them (ranks of one host talk locally);
        # on one host every peer is behind it.
        intra = topo.intra_host_bandwidth_gib_s if env.world_size > env.local_world_size else gib_s
        topo = dataclasses.replace(
            topo, intra_host_bandwidth_gib_s=intra, inter_host_bandwidth_gib_s=gib_s
        )
    planner = dataclasses.replace(
        config.planner, global_batch_size=args.batch_size * env.world_size
    )
    return dataclasses.replace(
        config, embedding_tables=tables, topology=topo, planner=planner
    ), source
