"""Helpers over a whole model (e.g. a ``DistributedModelParallel``) with lossy-sharded EBCs.

What a training loop needs from the lossy modules and cannot reach through TorchRec's API: find
them (:func:`lossy_modules`), read their telemetry (:func:`lossy_stats`), step their bound
providers once per iteration (:func:`step_lossy_bounds`), read the device path's pending decode
status (:func:`check_lossy_decodes`), save / restore the per-rank bound-provider state
(:func:`bounds_state`, :func:`load_bounds_state`) and the guard's (:func:`guard_state`,
:func:`load_guard_state`). docs/sharder.md, "Bounds from a provider".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchrec_lossy.distributed import EXPORTS
from torchrec_lossy.distributed.call_ledger import read_checked
from torchrec_lossy.distributed.sequence_sharder import LossyShardedEmbeddingCollection
from torchrec_lossy.distributed.sharder import LossyShardedEmbeddingBagCollection
from torchrec_lossy.distributed.stats import LossyCommsStats
from torchrec_lossy.distributed.torchrec_adapter import module_fqn, module_process_group

__all__ = EXPORTS[__name__]


LossyModule = LossyShardedEmbeddingBagCollection | LossyShardedEmbeddingCollection


def lossy_modules(model: nn.Module) -> dict[str, LossyModule]:
    """The lossy-sharded EmbeddingBagCollections and EmbeddingCollections of a model, by path.

    Args:
        model: Any module, e.g. a DistributedModelParallel.

    Returns:
        Path in ``model.named_modules()`` to the module.
    """
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, (LossyShardedEmbeddingBagCollection, LossyShardedEmbeddingCollection))
    }


def lossy_stats(model: nn.Module) -> dict[str, LossyCommsStats]:
    """Telemetry of every lossy-sharded EmbeddingBagCollection and EmbeddingCollection in ``model``.

    Args:
        model: Any module, e.g. a DistributedModelParallel.

    Returns:
        Module FQN (as the sharder saw it; else the path in ``model.named_modules()``) to its
        stats.
    """
    return {module_fqn(m) or name: m.lossy_stats for name, m in lossy_modules(model).items()}


def step_lossy_bounds(model: nn.Module) -> None:
    """Tells every lossy-sharded module's bound provider and guard that a training iteration
    finished.

    Call it once per iteration (after the optimizer step) when the provider adapts over
    training (e.g. ``AdaptiveBounds``) or ``comms.guard`` is on; with the default static bounds
    and no guard it does nothing. With the guard on it is collective: every rank calls it at
    every step (every ``guard.check_every``-th the ranks decide the tightenings together).

    Args:
        model: Any module, e.g. a DistributedModelParallel.
    """
    for m in lossy_modules(model).values():
        comms = m.lossy_comms
        comms.bounds.step()
        m.lossy_ledger.end_step()  # the module's step count (named by decode errors)
        if comms.guard is not None:
            comms.guard.step(comms.stats, module_process_group(m))


def check_lossy_decodes(model: nn.Module) -> None:
    """Reads the decode status the device path has not read yet, and raises if one failed.

    On the device path (CUDA) a received payload's decode status is read with the next all-to-all
    of the same module, so that each all-to-all costs one host sync; a payload that failed was
    zeroed on the device, never used as garbage. Call this where no all-to-all follows: after
    the last training step, after an evaluation, before a checkpoint. On the host path it
    reads nothing (errors are raised at once there).

    Args:
        model: Any module, e.g. a DistributedModelParallel.

    Raises:
        LossyAllToAllError: A pending decode failed; the message names the direction, the
            training step and the source rank.
    """
    for m in lossy_modules(model).values():
        read_checked(m.lossy_ledger)


def bounds_state(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's bound-provider state of every lossy module (for a per-rank checkpoint file).

    Args:
        model: Any module, e.g. a DistributedModelParallel.

    Returns:
        Module path to a detached copy of its provider's ``state_dict``.
    """
    return {
        name: {k: v.detach().clone() for k, v in m.lossy_comms.bounds.state_dict().items()}
        for name, m in lossy_modules(model).items()
    }


def load_bounds_state(model: nn.Module, saved: dict[str, dict[str, torch.Tensor]]) -> None:
    """Restores what :func:`bounds_state` saved into the same model structure.

    Args:
        model: Any module, e.g. a DistributedModelParallel, sharded as when saved.
        saved: Module path to provider state.

    Raises:
        KeyError: ``saved`` names a module path the model does not have (a checkpoint of
            another model or plan); the message lists both sets of paths.
    """
    modules = lossy_modules(model)
    unknown = sorted(set(saved) - set(modules))
    if unknown:
        raise KeyError(
            f"bounds state for {unknown} but the model's lossy modules are {sorted(modules)}: "
            "load a checkpoint written by the same model and sharding plan"
        )
    for name, state in saved.items():
        modules[name].lossy_comms.bounds.load_state_dict(state)


def guard_state(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The guard's state of every lossy module with ``comms.guard`` on (plain data; the same on
    every rank but for the pairs this rank saw since the last check), for a per-rank checkpoint
    file. Call :func:`check_lossy_decodes` first: it records the device path's pending error
    samples.

    Args:
        model: Any module, e.g. a DistributedModelParallel.

    Returns:
        Module path to its guard's ``state_dict``.
    """
    out = {}
    for name, m in lossy_modules(model).items():
        guard = m.lossy_comms.guard
        if guard is not None:
            guard.take_alerts(m.lossy_comms.stats)  # alerts not taken yet are saved too
            out[name] = guard.state_dict()
    return out


def load_guard_state(model: nn.Module, saved: dict[str, dict[str, Any]]) -> None:
    """Restores what :func:`guard_state` saved: the resumed run encodes with the tightened
    bounds and keeps the guard's step count (so its checks fall on the same steps).

    Args:
        model: Any module, e.g. a DistributedModelParallel, sharded as when saved.
        saved: Module path to guard state.

    Raises:
        KeyError: ``saved`` names a module without a guard (another model, or ``comms.guard``
            turned off since); the message names both sets.
    """
    guarded = {n: m for n, m in lossy_modules(model).items() if m.lossy_comms.guard is not None}
    unknown = sorted(set(saved) - set(guarded))
    if unknown:
        raise KeyError(
            f"guard state for {unknown} but the modules with comms.guard on are "
            f"{sorted(guarded)}: resume with the config the checkpoint was written with "
            "(comms.guard.enabled: true)"
        )
    for name, state in saved.items():
        guarded[name].lossy_comms.guard.load_state_dict(state)  # type: ignore[union-attr]
