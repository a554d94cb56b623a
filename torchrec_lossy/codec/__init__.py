"""The error-bounded lossy codec. Imports torch (and numba), never torchrec.

The names below load on first use (PEP 562), so importing one leaf module of the codec (the
lossless KJT input codec takes ``format`` and ``container``) does not load the lossy codec.
"""

from __future__ import annotations

from torchrec_lossy.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "torchrec_lossy.codec.bounds": ["BoundKind"],
        "torchrec_lossy.codec.container": ["BlockColumns", "checksum", "segment_checksums"],
        "torchrec_lossy.codec.entropy": ["entropy_bound_bytes"],
        "torchrec_lossy.codec.format": ["CodecError"],
        "torchrec_lossy.codec.grouped": [
            "GroupedPayloads",
            "GroupStatus",
            "PendingGroups",
            "check_groups",
            "compress_groups",
            "contain_failures",
            "decompress_groups",
            "first_failure",
            "start_compress_groups",
            "warm_up_host",
        ],
        "torchrec_lossy.codec.pipeline": [
            "BlockStats",
            "compress",
            "compress_with_stats",
            "decompress",
        ],
        "torchrec_lossy.config": ["CodecConfig"],
    },
)
