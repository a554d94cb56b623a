"""Every rank of a sharded module runs the same comms config, checked once at sharding.

The dists of two ranks read each other's bytes by the config (bounds, backward codec, which
tables are coded, the input dist's layout, the dedupes): a rank whose config differs decodes
garbage or waits for a collective its peer never starts. :func:`check_same_config` all-gathers a
digest of the config's shared keys once, when the sharded module is built; on a mismatch every
rank gathers the keys themselves and raises the same :class:`ConfigMismatchError`, naming each
differing key with its value per rank.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from torchrec_lossy.config import ConfigError, LossyCommsConfig, to_dict
from torchrec_lossy.profile_range import profile_range

__all__ = [
    "RANK_LOCAL_KEYS",
    "ConfigMismatchError",
    "check_same_config",
    "config_items",
    "mismatch_message",
]

# Keys each rank may set for itself: the sender decodes its own payloads for statistics, and
# every codec backend writes the same bytes.
RANK_LOCAL_KEYS: frozenset[str] = frozenset({"error_sample_every", "codec.backend"})

_DIGEST_WORDS = 4  # sha256 as 4 int64 words


class ConfigMismatchError(ConfigError):
    """The ranks of one process group were given different comms configs."""


def config_items(
    config: LossyCommsConfig, extra: Mapping[str, object] | None = None
) -> dict[str, str]:
    """The config's keys that must match across ranks, flattened to dotted keys.

    Args:
        config: The comms config.
        extra: More facts that must match (e.g. the bound provider's class), by key.

    Returns:
        Dotted key to the value's ``repr``; ``tables`` also gives the pattern order (the first
        match wins, so order matters).
    """
    flat: dict[str, str] = {"tables": repr(list(config.tables))}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif prefix not in RANK_LOCAL_KEYS:
            flat[prefix] = repr(value)

    walk("", to_dict(config))
    flat.update({k: repr(v) for k, v in (extra or {}).items()})
    return flat


def _digest(items: Mapping[str, str], device: torch.device) -> torch.Tensor:
    raw = hashlib.sha256(json.dumps(items, sort_keys=True).encode()).digest()
    words = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]
    return torch.tensor(words, dtype=torch.int64, device=device)


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's collectives take their tensors (NCCL: the current CUDA device)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mismatch_message(per_rank: Sequence[Mapping[str, str]], what: str) -> str:
    """One message naming every key whose value differs between ranks.

    Args:
        per_rank: Each rank's :func:`config_items`, by rank.
        what: What was checked (the module's name), for the message.

    Returns:
        The message.
    """
    keys = sorted(set().union(*per_rank))
    parts = []
    for key in keys:
        values = [items.get(key, "<unset>") for items in per_rank]
        if len(set(values)) == 1:
            continue
        by_value: dict[str, list[int]] = {}
        for rank, v in enumerate(values):
            by_value.setdefault(v, []).append(rank)
        spread = "; ".join(
            f"{v} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
            for v, r in by_value.items()
        )
        parts.append(f"{key}: {spread}")
    return (
        f"{what}: the comms config differs across the {len(per_rank)} ranks ({' | '.join(parts)}); "
        "give every rank the same LossyCommsConfig (the same YAML file and flags)"
    )


def check_same_config(
    config: LossyCommsConfig,
    group: dist.ProcessGroup | None,
    what: str,
    extra: Mapping[str, object] | None = None,
) -> None:
    """Raises the same :class:`ConfigMismatchError` on every rank unless all configs match.

    One all-gather of a 32-byte digest; only on a mismatch a second one of the keys, so every
    rank raises the same message (no rank is left waiting in a later collective).

    Args:
        config: This rank's comms config.
        group: The sharded module's process group; None or one rank: nothing to check.
        what: The module's name, for the message.
        extra: More facts that must match (see :func:`config_items`).

    Raises:
        ConfigMismatchError: Naming each differing key, its values and the ranks holding them.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return
    items = config_items(config, extra)
    size = dist.get_world_size(group)
    with profile_range("## lossy config check ##"):
        mine = _digest(items, _collective_device(group))
        gathered = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(gathered, mine, group=group)
        if all(torch.equal(g, gathered[0]) for g in gathered):
            return
        per_rank: list[dict[str, str]] = [{} for _ in range(size)]
        dist.all_gather_object(per_rank, items, group=group)
    raise ConfigMismatchError(mismatch_message(per_rank, what))
