"""Formatting shared by the benchmarks' Markdown tables."""

from __future__ import annotations

import math
from typing import Any


def cell(v: Any, spec: str) -> str:
    """One table cell: ``v`` formatted with ``spec``, or ``-`` when missing or not finite.

    Args:
        v: The value (None for missing).
        spec: A ``format`` spec such as ``".4f"``.

    Returns:
        The text.
    """
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)
