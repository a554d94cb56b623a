"""The error-bounded lossy codec. Imports torch (and numba), never torchrec.

The names below load on first use (PEP 562), so importing one leaf module of the codec (the
lossless KJT input codec takes ``format`` and ``container``) does not load the lossy codec.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchrec_lossy.codec.bounds import BoundKind
    from torchrec_lossy.codec.container import BlockColumns, checksum, segment_checksums
    from torchrec_lossy.codec.entropy import entropy_bound_bytes
    from torchrec_lossy.codec.format import CodecError
    from torchrec_lossy.codec.grouped import (
        GroupedPayloads,
        GroupStatus,
        PendingGroups,
        check_groups,
        compress_groups,
        contain_failures,
        decompress_groups,
        first_failure,
        start_compress_groups,
        warm_up_host,
    )
    from torchrec_lossy.codec.pipeline import (
        BlockStats,
        compress,
        compress_with_stats,
        decompress,
    )
    from torchrec_lossy.config import CodecConfig

# Each public name -> the module that defines it.
_HOMES = {
    "BlockColumns": "torchrec_lossy.codec.container",
    "BlockStats": "torchrec_lossy.codec.pipeline",
    "BoundKind": "torchrec_lossy.codec.bounds",
    "CodecConfig": "torchrec_lossy.config",
    "CodecError": "torchrec_lossy.codec.format",
    "GroupStatus": "torchrec_lossy.codec.grouped",
    "GroupedPayloads": "torchrec_lossy.codec.grouped",
    "PendingGroups": "torchrec_lossy.codec.grouped",
    "check_groups": "torchrec_lossy.codec.grouped",
    "checksum": "torchrec_lossy.codec.container",
    "compress": "torchrec_lossy.codec.pipeline",
    "compress_groups": "torchrec_lossy.codec.grouped",
    "compress_with_stats": "torchrec_lossy.codec.pipeline",
    "contain_failures": "torchrec_lossy.codec.grouped",
    "decompress": "torchrec_lossy.codec.pipeline",
    "decompress_groups": "torchrec_lossy.codec.grouped",
    "entropy_bound_bytes": "torchrec_lossy.codec.entropy",
    "first_failure": "torchrec_lossy.codec.grouped",
    "segment_checksums": "torchrec_lossy.codec.container",
    "start_compress_groups": "torchrec_lossy.codec.grouped",
    "warm_up_host": "torchrec_lossy.codec.grouped",
}

__all__ = [
    "BlockColumns",
    "BlockStats",
    "BoundKind",
    "CodecConfig",
    "CodecError",
    "GroupStatus",
    "GroupedPayloads",
    "PendingGroups",
    "check_groups",
    "checksum",
    "compress",
    "compress_groups",
    "compress_with_stats",
    "contain_failures",
    "decompress",
    "decompress_groups",
    "entropy_bound_bytes",
    "first_failure",
    "segment_checksums",
    "start_compress_groups",
    "warm_up_host",
]


def __getattr__(name: str) -> Any:
    """Loads a public name's module on first use (PEP 562) and caches the name here.

    Args:
        name: The attribute asked for.

    Returns:
        The public object.

    Raises:
        AttributeError: ``name`` is not one of ``__all__`` (nor a submodule already imported).
    """
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
