"""tests/README.md's map against the code: every module has a row naming its tests, and every
test file a row names exists.

A row's first cell names modules in backticks: a path (``torchrec_lossy/codec/format.py``,
``kernels/quantize.py``, ``torchrec_lossy/planner/*.py``) sets the folder, and a bare file name
after it (``host_decompress.py``) is in that folder. Its second cell names test files
(``test_*.py``) by their path under ``tests/``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "tests" / "README.md"
_CODE = re.compile(r"`([A-Za-z0-9_./*-]+)`")


def modules() -> set[str]:
    """Every module of the package and of kernels/, by its path from the repository root."""
    out = set()
    for base in (ROOT / "torchrec_lossy", ROOT / "kernels"):
        for path in base.rglob("*.py"):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("torchrec_lossy", "kernels") or path.name == "__init__.py":
                continue  # a checkout's symlink to ../kernels, walked as kernels/ itself
            out.add(rel.as_posix())
    return out


def mapped(text: str) -> tuple[set[str], set[str]]:
    """(modules, test files) the README's table rows name.

    Args:
        text: The README.

    Returns:
        The modules (globs expanded) of every row's first cell, and the ``tests/`` paths of
        their second cells.
    """
    found: set[str] = set()
    tests: set[str] = set()
    for line in text.splitlines():
        cells = line.split("|")
        if not line.startswith("| `") or len(cells) < 4:
            continue
        folder = ""
        for token in _CODE.findall(cells[1]):
            if "/" in token:
                folder = token.rsplit("/", 1)[0]
                name = token
            else:
                name = f"{folder}/{token}" if folder else token
            found |= {p.relative_to(ROOT).as_posix() for p in ROOT.glob(name)}
        tests |= {
            f"tests/{t}"
            for t in _CODE.findall(cells[2])
            if t.rsplit("/", 1)[-1].startswith("test_") and t.endswith(".py")
        }
    return found, tests


def test_every_module_has_a_row() -> None:
    found, _ = mapped(README.read_text())
    missing = sorted(modules() - found)
    assert not missing, f"tests/README.md names no tests for: {missing}"


def test_every_test_file_a_row_names_exists() -> None:
    _, tests = mapped(README.read_text())
    assert len(tests) > 20, "the scan found almost no test files: is it reading the table?"
    gone = sorted(t for t in tests if not (ROOT / t).exists())
    assert not gone, f"tests/README.md names test files that do not exist: {gone}"


def test_the_map_reads_folders_globs_and_bare_names() -> None:
    """The parser is not vacuous: a path sets the folder for bare names after it, and a glob
    expands."""
    text = (
        "| `torchrec_lossy/codec/host_compress.py`, `host_decompress.py` | `test_x.py` |\n"
        "| `torchrec_lossy/planner/*.py` | `test_planner.py` |\n"
        "| `kernels/quantize.py` | none |\n"
    )
    found, tests = mapped(text)
    assert {
        "torchrec_lossy/codec/host_compress.py",
        "torchrec_lossy/codec/host_decompress.py",
        "torchrec_lossy/planner/planner.py",
        "kernels/quantize.py",
    } <= found
    assert "torchrec_lossy/codec/format.py" not in found
    assert tests == {"tests/test_x.py", "tests/test_planner.py"}
