"""Records the kernel launchers' calls made by a device-path compress / decompress, for replay.

A torch twin (``kernels/<module>_ref.py``) must give what its Triton launcher gives for the calls
the orchestration really makes: :func:`recorded_calls` wraps launchers of a kernel module, keeps
a copy of each call's arguments before and after the launch (launchers may write into buffers
they are given) and of its result; :func:`replay` calls another implementation on fresh copies
of the same arguments and returns what to compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch


def snapshot(value: Any) -> Any:
    """A deep copy of the tensors and arrays in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuple
        return type(value)(*(snapshot(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    return value


@dataclasses.dataclass
class Call:
    """One launcher call: its name, arguments before and after, and its result."""

    name: str
    args: tuple
    kwargs: dict
    args_after: tuple
    kwargs_after: dict
    result: Any


@contextlib.contextmanager
def recorded_calls(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, names: Sequence[str]
) -> Iterator[list[Call]]:
    """Records every call of ``module.<name>`` for ``names`` while the context is open.

    Args:
        monkeypatch: The test's monkeypatch (undoes the wrapping).
        module: A kernel module (e.g. ``torchrec_lossy.kernels.huffman``).
        names: The launchers to record.

    Yields:
        The list the calls are appended to, in call order.
    """
    calls: list[Call] = []

    def wrap(name: str, launcher: Callable) -> Callable:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            before, kw_before = snapshot(args), snapshot(kwargs)
            result = launcher(*args, **kwargs)
            calls.append(Call(name, before, kw_before, snapshot(args), snapshot(kwargs),
                              snapshot(result)))  # fmt: skip
            return result

        return recorded

    for name in names:
        monkeypatch.setattr(module, name, wrap(name, getattr(module, name)))
    yield calls


def replay(call: Call, implementation: Callable) -> tuple[Any, tuple, dict]:
    """Calls ``implementation`` on fresh copies of ``call``'s arguments.

    Args:
        call: A recorded call.
        implementation: What to call instead (e.g. the torch twin).

    Returns:
        (its result, the arguments after the call, the keyword arguments after the call), to
        compare with ``call.result``, ``call.args_after`` and ``call.kwargs_after``.
    """
    args, kwargs = snapshot(call.args), snapshot(call.kwargs)
    return implementation(*args, **kwargs), args, kwargs


def assert_same(actual: Any, expected: Any, where: str = "result") -> None:
    """Asserts two results are equal bit for bit (tensors: dtype, shape and values).

    Args:
        actual: What the implementation gave.
        expected: What the launcher gave.
        where: A path naming the compared part, for the failure message.
    """
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}, not a tensor"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        a, e = actual.cpu(), expected.cpu()
        if a.is_floating_point():  # compare bits: NaN payloads and -0.0 count
            width = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
            a, e = a.view(width), e.view(width)
        diff = (a != e).nonzero()
        assert diff.numel() == 0, f"{where}: {diff.shape[0]} elements differ, first at {diff[0]}"
    elif isinstance(expected, np.ndarray):
        assert_same(torch.from_numpy(np.asarray(actual)), torch.from_numpy(expected), where)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), f"{where}: {len(actual)} items != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: keys differ"
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}[{k!r}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
