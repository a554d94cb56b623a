"""Exceptions of the distributed seam.

A leaf module (it imports nothing of the package), so that the lossless KJT codec, the pooled
payload codec and the dist modules can all raise the same error without importing each other.
"""

from __future__ import annotations


class LossyAllToAllError(RuntimeError):
    """A received payload could not be decoded into what the sharding layout expects.

    Raised on the receiving rank by the compressed pooled all-to-all (forward and backward) and
    by the packed KJT input dist; the message names the direction, the source rank and the
    tables or features of the payload.
    """
