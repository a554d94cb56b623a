"""Profiler ranges that cost nothing while no profiler records.

``record_function`` dispatches an op on entry and on exit whether a profiler records or not:
tens of microseconds a range inside a training step, whose model work has just evicted the
caches (docs/benchmarks.md, "The example's codec time share"). :func:`profile_range` opens the
same range while a profiler records and nothing otherwise, as torch's compiled code does.
"""

from __future__ import annotations

import contextlib

import torch.autograd.profiler as autograd_profiler
from torch.profiler import record_function

_NO_RANGE = contextlib.nullcontext()


def profile_range(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a torch profiler records, else a no-op context.

    Args:
        name: The range's name (``"## ... ##"``).

    Returns:
        A context manager.
    """
    # torch sets this flag when a profiler starts and clears it when it stops; dynamo and
    # inductor skip their own ranges by it. A torch without it: always record.
    if getattr(autograd_profiler, "_is_profiler_enabled", True):
        return record_function(name)
    return _NO_RANGE
