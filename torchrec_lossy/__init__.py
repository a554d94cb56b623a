"""torchrec-lossy: error-bounded lossy compression of TorchRec's embedding all-to-alls.

Importing the package points numba's on-disk cache of the compiled CPU kernels at a folder keyed
by the content of this package's sources (:func:`numba_cache_dir`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path


def numba_cache_sources() -> list[Path]:
    """The source files the numba cache is keyed by: the package's and those of ``kernels/``.

    ``kernels/`` ships as ``torchrec_lossy.kernels`` (package-dir): in a source checkout it lives
    beside the package. The host kernels compile only the package's own modules (the code
    lengths live in ``codec/codebook.py``), but keying by ``kernels/`` too keeps the key one
    rule: every source file the installed package runs.

    Returns:
        Every ``.py`` file, in a fixed order.
    """
    root = Path(__file__).resolve().parent
    spec = importlib.util.find_spec(f"{__name__}.kernels")
    kernels = [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
    bases = [root, *(k for k in kernels if root not in k.parents)]
    return [path for base in bases for path in sorted(base.rglob("*.py"))]


def numba_cache_dir() -> str:
    """The folder numba caches this package's compiled kernels in, keyed by its sources.

    numba keys a cached kernel by the file that defines it, but the compiled passes inline
    functions of other modules (the size model, Huffman, quantize...): after an edit to one of
    those, numba would load a stale kernel, and the host path could disagree with the device
    path. Keying the whole cache by a hash of every source file (:func:`numba_cache_sources`)
    makes any edit start a fresh cache: the folder is ``<base>/<hash>``, the base being
    ``$NUMBA_CACHE_DIR`` when it is set (a folder of the user's or a test's own, kept apart as
    numba would) and ``~/.cache/torchrec_lossy/numba`` otherwise.

    Returns:
        The folder (created by numba when it first writes).
    """
    digest = hashlib.sha1()
    for path in numba_cache_sources():
        digest.update(f"{path.parent.name}/{path.name}".encode())
        digest.update(path.read_bytes())
    key = digest.hexdigest()[:16]
    base = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torchrec_lossy", "numba"
    )
    if os.path.basename(os.path.normpath(base)) == key:  # keyed already (set by a parent)
        return base
    return os.path.join(base, key)


def _use_numba_cache_dir() -> None:
    path = numba_cache_dir()
    os.environ["NUMBA_CACHE_DIR"] = path  # read by numba at import, here and in children
    numba = sys.modules.get("numba")
    if numba is not None:  # imported before us: its config already read the environment
        numba.config.CACHE_DIR = path


_use_numba_cache_dir()
