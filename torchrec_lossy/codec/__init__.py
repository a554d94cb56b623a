"""The error-bounded lossy codec. Imports torch (and numba), never torchrec."""

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
