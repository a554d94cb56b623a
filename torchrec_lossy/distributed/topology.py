"""Which peers of an all-to-all share this rank's host, and which of them travel uncoded.

Peers behind NVLink are faster to reach than any codec runs, so on CUDA their blocks travel raw
by default (``LossyCommsConfig.intra_host``); the blocks for other hosts, behind the slow link,
are coded. Hosts are runs of ``local_world_size`` consecutive global ranks, as torchrun lays
them out.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from torchrec_lossy.config import LossyCommsConfig


def local_world_size(config: LossyCommsConfig, world_size: int) -> int:
    """Ranks per host: the config's, else torchrun's ``LOCAL_WORLD_SIZE``, else one host.

    Args:
        config: The comms config (``local_world_size``).
        world_size: Ranks of the default process group.

    Returns:
        Ranks per host (>= 1).

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is set but not a positive integer.
    """
    if config.local_world_size is not None:
        return config.local_world_size
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is None:
        return max(1, world_size)
    if not env.isdigit() or int(env) < 1:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={env!r} is not a positive integer: unset it, or set "
            "LossyCommsConfig.local_world_size (YAML comms.local_world_size)"
        )
    return int(env)


def same_host_peers(global_ranks: list[int], my_index: int, per_host: int) -> frozenset[int]:
    """Indices (in the group) of the other members on this rank's host.

    Args:
        global_ranks: Global rank of each member of the group, in group order.
        my_index: This rank's index in the group.
        per_host: Ranks per host.

    Returns:
        The same-host peers' group indices, this rank excluded.
    """
    host = global_ranks[my_index] // per_host
    return frozenset(
        i for i, r in enumerate(global_ranks) if r // per_host == host and i != my_index
    )


def peer_links(pg: dist.ProcessGroup, config: LossyCommsConfig) -> tuple[frozenset[int], bool]:
    """The same-host peers of ``pg`` and whether their blocks travel raw.

    Args:
        pg: Process group of the all-to-all.
        config: The comms config (``intra_host``, ``local_world_size``).

    Returns:
        ``(same_host, raw)``: the same-host peers' group indices, and True where their blocks
        skip the codec (``intra_host="raw"``, or ``"auto"`` on a NCCL group).
    """
    per_host = local_world_size(config, dist.get_world_size())
    same_host = same_host_peers(dist.get_process_group_ranks(pg), pg.rank(), per_host)
    return same_host, intra_host_raw(config, dist.get_backend(pg))


def intra_host_raw(config: LossyCommsConfig, backend: str) -> bool:
    """Whether same-host peers' blocks skip the codec on a group of ``backend``.

    Args:
        config: The comms config (``intra_host``).
        backend: The process group's backend (``"nccl"``, ``"gloo"``, ...).

    Returns:
        True for ``intra_host="raw"``, and for ``"auto"`` on NCCL (NVLink outruns the codec).
    """
    return config.same_host_raw(backend)
