"""numba's on-disk cache is keyed by the package's sources (a stale compiled kernel is never
loaded after an edit to a module it inlines)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

import torchrec_lossy

ROOT = Path(__file__).resolve().parent.parent


def test_the_codec_caches_in_the_source_keyed_folder() -> None:
    import numba

    from torchrec_lossy.codec import host_compress  # noqa: F401  (defines cached kernels)

    path = torchrec_lossy.numba_cache_dir()
    assert numba.config.CACHE_DIR == path == os.environ["NUMBA_CACHE_DIR"]
    assert len(Path(path).name) == 16


def test_an_edit_to_any_module_changes_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numba

    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
    # A folder of the user's (or a test's) own is the base, kept apart from the default one.
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    pkg = tmp_path / "pkgcopy"
    (pkg / "codec").mkdir(parents=True)
    shutil.copy(ROOT / "torchrec_lossy" / "__init__.py", pkg / "__init__.py")
    (pkg / "codec" / "size_model.py").write_text("X = 1\n")
    spec = importlib.util.spec_from_file_location("pkgcopy", pkg / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "pkgcopy", module)
    spec.loader.exec_module(module)
    before = module.numba_cache_dir()
    assert os.path.dirname(before) == str(tmp_path / "cache")
    assert before == numba.config.CACHE_DIR == os.environ["NUMBA_CACHE_DIR"]  # set, numba too
    assert module.numba_cache_dir() == before  # a child sees the keyed folder: not nested
    (pkg / "codec" / "size_model.py").write_text("X = 2\n")  # a module a kernel inlines
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    after = module.numba_cache_dir()
    assert after != before and os.path.dirname(after) == str(tmp_path / "cache")


def test_the_key_covers_the_kernels_the_host_kernels_compile() -> None:
    """The modules the host kernels compile (the code lengths of ``codec/codebook.py``, the
    format the per-value grid is written in) key the cache, and so does kernels/, which lives
    beside the package in a checkout."""
    sources = {p.resolve() for p in torchrec_lossy.numba_cache_sources()}
    rels = (
        "torchrec_lossy/codec/codebook.py",
        "kernels/codebook_ref.py",
        "torchrec_lossy/codec/format.py",
        "torchrec_lossy/config.py",
    )
    for rel in rels:
        assert (ROOT / rel).resolve() in sources, rel
