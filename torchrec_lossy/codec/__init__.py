"""The error-bounded lossy codec. Imports torch (and numba), never torchrec."""

from torchrec_lossy.codec.format import CodecError
from torchrec_lossy.codec.pipeline import (
    BlockStats,
    compress,
    compress_with_stats,
    decompress,
)
from torchrec_lossy.config import CodecConfig

__all__ = [
    "BlockStats",
    "CodecConfig",
    "CodecError",
    "compress",
    "compress_with_stats",
    "decompress",
]
