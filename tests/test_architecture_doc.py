"""docs/architecture.md against the code: every module is named there, every path it names exists.

Convention (stated at the top of the page): a module is named by its path inside the installed
package, in backticks: ``codec/container.py`` for ``torchrec_lossy/codec/container.py``,
``kernels/common.py`` for the top-level ``kernels/common.py`` (shipped as
``torchrec_lossy.kernels``). Other paths are from the repository root; markdown links are
relative to ``docs/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "torchrec_lossy"
KERNELS = ROOT / "kernels"
# A backticked token that is a path: has a slash, or ends in a file suffix (no spaces).
_CODE = re.compile(r"`([A-Za-z0-9_./-]+)`")
_FILE_SUFFIX = re.compile(r"\.(py|md|ya?ml|toml|txt|json)$")
_LINK = re.compile(r"\]\(([^)#\s]+)\)")


def _modules() -> list[str]:
    """Every module of the package and of kernels/, by its path inside the installed package."""
    out = []
    for base, prefix in ((PACKAGE, ""), (KERNELS, "kernels/")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).as_posix()
            if base == PACKAGE and rel.startswith("kernels/"):
                continue  # a checkout's symlink to ../kernels: walked as kernels/ itself
            if path.name != "__init__.py":
                out.append(prefix + rel)
    return out


def _named_paths(text: str) -> set[str]:
    return {t for t in _CODE.findall(text) if "/" in t or _FILE_SUFFIX.search(t)}


def _exists(token: str) -> bool:
    return any((base / token).exists() for base in (ROOT, PACKAGE))


def test_the_doc_and_the_package_have_modules() -> None:
    assert DOC.is_file(), "docs/architecture.md is missing"
    assert len(_modules()) > 20  # the walk found the package


@pytest.mark.parametrize("module", _modules())
def test_every_module_is_named(module: str) -> None:
    named = _named_paths(DOC.read_text())
    assert module in named, (
        f"module `{module}` is not named in docs/architecture.md: add it, in backticks as "
        f"`{module}`, with one line on what it holds (update docs/architecture.md)"
    )


def test_every_named_path_exists() -> None:
    missing = sorted(t for t in _named_paths(DOC.read_text()) if not _exists(t))
    assert not missing, (
        f"docs/architecture.md names paths that do not exist: {missing} (paths are relative to "
        "torchrec_lossy/ for modules, else to the repository root): update docs/architecture.md"
    )


def test_every_link_resolves() -> None:
    links = [t for t in _LINK.findall(DOC.read_text()) if "://" not in t]
    missing = sorted(t for t in links if not (DOC.parent / t).exists())
    assert not missing, f"docs/architecture.md links to missing files: {missing}: update it"
