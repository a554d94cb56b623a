"""Command-line argument types shared by the benchmarks."""

from __future__ import annotations

import argparse


def grouped_shape(text: str) -> tuple[int, int, int]:
    """``TABLESxROWSxDIM`` as three positive ints (an argparse ``type``).

    Args:
        text: The flag's value, e.g. ``26x2048x64``.

    Returns:
        (tables, rows, dim).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not three positive ints joined by ``x``.
    """
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give TABLESxROWSxDIM, e.g. 26x2048x64")
    tables, rows, dim = (int(p) for p in parts)
    return tables, rows, dim
