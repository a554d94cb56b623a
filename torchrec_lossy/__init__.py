"""torchrec-lossy: error-bounded lossy compression of TorchRec's embedding all-to-alls.

Importing the package points numba's on-disk cache of the compiled CPU kernels at a folder keyed
by the content of this package's sources (:func:`numba_cache_dir`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

_CACHE_ENV = "TORCHREC_LOSSY_NUMBA_CACHE"


def numba_cache_dir() -> str:
    """The folder numba caches this package's compiled kernels in, keyed by its sources.

    numba keys a cached kernel by the file that defines it, but the compiled passes inline
    functions of other modules (the size model, Huffman, quantize...): after an edit to one of
    those, numba would load a stale kernel, and the host path could disagree with the device
    path. Keying the whole cache by a hash of every source file of the package makes any edit
    start a fresh cache. The base folder is ``$TORCHREC_LOSSY_NUMBA_CACHE`` (default
    ``~/.cache/torchrec_lossy/numba``); this sets ``NUMBA_CACHE_DIR`` for child processes too.

    Returns:
        The folder (created by numba when it first writes).
    """
    root = Path(__file__).resolve().parent
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    base = os.environ.get(_CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "torchrec_lossy", "numba"
    )
    return os.path.join(base, digest.hexdigest()[:16])


def _use_numba_cache_dir() -> None:
    path = numba_cache_dir()
    os.environ["NUMBA_CACHE_DIR"] = path  # read by numba at import, here and in children
    numba = sys.modules.get("numba")
    if numba is not None:  # imported before us: its config already read the environment
        numba.config.CACHE_DIR = path


_use_numba_cache_dir()
