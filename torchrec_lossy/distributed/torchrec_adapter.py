"""Every access to TorchRec's private attributes, in one place.

Where TorchRec offers a public seam (a sharding's ``create_input_dist`` /
``create_output_dist``, a dist's constructor and ``forward``), the seam uses it. Two dists leave
none: ``RwSparseFeaturesDist`` builds its KJT all-to-all as ``_dist`` inside ``__init__`` (and
train pipelines look for it there), and the two-hop dists (``TwRwPooledEmbeddingDist``,
``GridPooledEmbeddingDist``) create their cross-host all-to-all lazily as ``_cross_dist`` (TWRW's
VBE hop: ``_variable_cross_dist``) in their first ``forward``. This module reads and replaces
exactly those, checking before each write that TorchRec still holds what it replaces there, so a
TorchRec upgrade fails here with a message naming the attribute instead of running TorchRec's
own collective silently. A sharded module's process group and FQN have no public accessor
either: they are read here too (:func:`module_process_group`, :func:`module_fqn`), checked the
same way. ``tests/distributed/test_torchrec_adapter.py`` runs every check on the
installed TorchRec and scans the package for private writes outside this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchrec.distributed.dist_data import (
    KJTAllToAll,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
    VariableBatchPooledEmbeddingsAllToAll,
)
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.sharding.grid_sharding import GridPooledEmbeddingDist
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist
from torchrec.distributed.types import ShardingEnv

TwoHopDist = TwRwPooledEmbeddingDist | GridPooledEmbeddingDist


class TorchRecLayoutError(RuntimeError):
    """TorchRec no longer holds what the seam replaces where the adapter expects it."""


def expect_attribute(owner: object, name: str, kind: type | tuple[type, ...]) -> Any:
    """Reads TorchRec's private attribute ``name`` of ``owner``, checking its kind.

    Args:
        owner: The TorchRec object.
        name: The private attribute.
        kind: The type(s) TorchRec keeps there (``type(None)`` where it may not exist yet).

    Returns:
        The attribute's value.

    Raises:
        TorchRecLayoutError: If the attribute is missing or of another kind, naming both.
    """
    cls = type(owner)
    torchrec_cls = next((c for c in cls.__mro__ if c.__module__.startswith("torchrec.")), cls)
    if not hasattr(owner, name):
        raise TorchRecLayoutError(
            f"{torchrec_cls.__module__}.{torchrec_cls.__qualname__} has no attribute {name!r}: "
            "the installed TorchRec changed where it keeps the collective torchrec_lossy "
            "replaces (distributed/torchrec_adapter.py); pin TorchRec 1.8 or update the adapter"
        )
    value = getattr(owner, name)
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise TorchRecLayoutError(
            f"{torchrec_cls.__module__}.{torchrec_cls.__qualname__}.{name} is a "
            f"{type(value).__name__}, expected {' or '.join(k.__name__ for k in kinds)}: the "
            "installed TorchRec changed the collective torchrec_lossy replaces "
            "(distributed/torchrec_adapter.py); pin TorchRec 1.8 or update the adapter"
        )
    return value


def replace_kjt_all_to_all(sparse_dist: RwSparseFeaturesDist, a2a: KJTAllToAll) -> None:
    """Puts ``a2a`` where ``RwSparseFeaturesDist`` keeps the KJT all-to-all it built.

    Args:
        sparse_dist: The row-wise input dist, after ``RwSparseFeaturesDist.__init__``.
        a2a: The replacement (a ``KJTAllToAll``, so train pipelines that look for one there
            still find it).

    Raises:
        TorchRecLayoutError: If TorchRec no longer keeps a ``KJTAllToAll`` in ``_dist``.
    """
    expect_attribute(sparse_dist, "_dist", KJTAllToAll)
    sparse_dist._dist = a2a


def kjt_all_to_all(sparse_dist: RwSparseFeaturesDist) -> KJTAllToAll:
    """The KJT all-to-all ``RwSparseFeaturesDist`` calls (:func:`replace_kjt_all_to_all`'s).

    Args:
        sparse_dist: The row-wise input dist.

    Returns:
        The all-to-all.
    """
    return expect_attribute(sparse_dist, "_dist", KJTAllToAll)


def cross_host_callbacks(
    two_hop: TwoHopDist,
) -> list[Callable[[torch.Tensor], torch.Tensor]] | None:
    """The callbacks TorchRec hands a two-hop dist's cross-host all-to-all: the grid's column
    permute (``GridPooledEmbeddingDist``'s ``callbacks`` argument); TWRW has none.

    Args:
        two_hop: TorchRec's TWRW or grid output dist.

    Returns:
        The callbacks, or None.
    """
    if not isinstance(two_hop, GridPooledEmbeddingDist):
        return None
    return expect_attribute(two_hop, "_callbacks", (list, type(None)))


def install_cross_host_dists(
    two_hop: TwoHopDist,
    sharding_ctx: EmbeddingShardingContext | None,
    cross: Callable[[], nn.Module],
    variable_cross: Callable[[nn.Module], nn.Module],
) -> None:
    """Creates a two-hop dist's collectives as its ``forward`` would, once, then puts the
    lossy cross-host all-to-all in place of TorchRec's.

    TorchRec creates them on the first ``forward`` (``sharding_ctx`` decides whether TWRW's VBE
    hop exists) and only while one is missing: after this call its ``forward`` runs the lossy
    one. Call it at the top of the dist's ``forward``.

    Args:
        two_hop: TorchRec's TWRW or grid output dist.
        sharding_ctx: The batch's sharding context (as TorchRec's ``forward`` gets it).
        cross: Builds the lossy cross-host all-to-all.
        variable_cross: Wraps it where TorchRec holds a VBE all-to-all.

    Raises:
        TorchRecLayoutError: If TorchRec no longer creates them where the adapter looks.
    """
    intra = expect_attribute(two_hop, "_intra_dist", (PooledEmbeddingsReduceScatter, type(None)))
    current = expect_attribute(two_hop, "_cross_dist", (nn.Module, type(None)))
    if intra is not None and current is not None:
        return
    two_hop._create_output_dist_modules(sharding_ctx)
    expect_attribute(two_hop, "_cross_dist", PooledEmbeddingsAllToAll)
    lossy = cross()
    two_hop._cross_dist = lossy  # type: ignore[assignment]
    variable = getattr(two_hop, "_variable_cross_dist", None)
    if variable is not None:  # TWRW's VBE hop
        expect_attribute(two_hop, "_variable_cross_dist", VariableBatchPooledEmbeddingsAllToAll)
        two_hop._variable_cross_dist = variable_cross(lossy)  # type: ignore[union-attr]


def forget_search_space(enumerator: EmbeddingEnumerator) -> None:
    """Drops the search space TorchRec's enumerator caches per module, so the next plan
    estimates every option again (after the planner's ratios changed).

    Args:
        enumerator: TorchRec's enumerator.

    Raises:
        TorchRecLayoutError: If it no longer caches the module there.
    """
    expect_attribute(enumerator, "_last_stored_module", (nn.Module, type(None)))
    enumerator._last_stored_module = None


def cross_host_group(two_hop: TwoHopDist) -> tuple[Any, torch.device | None]:
    """The cross-host process group and the device a two-hop dist was built with.

    Args:
        two_hop: TorchRec's TWRW or grid output dist.

    Returns:
        ``(cross_pg, device)``.
    """
    return expect_attribute(two_hop, "_cross_pg", object), expect_attribute(
        two_hop, "_device", (torch.device, type(None))
    )


def module_process_group(sharded: nn.Module) -> Any:
    """The process group a sharded module (``ShardedEmbeddingBagCollection`` or
    ``ShardedEmbeddingCollection``) was built with: its ``ShardingEnv``'s, which TorchRec keeps
    as ``_env`` and offers no public accessor for.

    Args:
        sharded: The sharded module.

    Returns:
        Its process group (None where the env has none).

    Raises:
        TorchRecLayoutError: If TorchRec no longer keeps a ``ShardingEnv`` in ``_env``.
    """
    return expect_attribute(sharded, "_env", ShardingEnv).process_group


def module_fqn(sharded: nn.Module) -> str | None:
    """The fully qualified name the sharder gave a sharded module (TorchRec's ``_module_fqn``).

    Args:
        sharded: The sharded module.

    Returns:
        Its FQN, or None where the sharder was given none.

    Raises:
        TorchRecLayoutError: If TorchRec no longer keeps it in ``_module_fqn``.
    """
    return expect_attribute(sharded, "_module_fqn", (str, type(None)))


__all__ = [
    "TorchRecLayoutError",
    "TwoHopDist",
    "cross_host_callbacks",
    "cross_host_group",
    "expect_attribute",
    "forget_search_space",
    "install_cross_host_dists",
    "kjt_all_to_all",
    "module_fqn",
    "module_process_group",
    "replace_kjt_all_to_all",
]
