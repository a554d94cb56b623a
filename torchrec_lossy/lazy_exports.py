"""Package exports that load their module on first use (PEP 562).

A package's ``__init__`` that imports every public name eagerly loads all of its modules with
any one of them: the lossless KJT input codec would load the lossy codec and the whole seam.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, homes: Mapping[str, Sequence[str]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__all__``, ``__getattr__`` and ``__dir__`` over modules loaded on demand.

    Args:
        package: The package's ``__name__``.
        homes: Each defining module (full name) -> the public names it gives the package.

    Returns:
        (``__all__``, sorted; ``__getattr__``, which imports a name's module on first use and
        caches the name in the package; ``__dir__``).
    """
    home_of = {name: module for module, names in homes.items() for name in names}
    namespace = importlib.import_module(package).__dict__

    def getattr_(name: str) -> Any:
        home = home_of.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(home_of))

    return sorted(home_of), getattr_, dir_
