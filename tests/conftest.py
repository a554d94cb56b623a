"""Session-wide test set-up.

Triton decides between compiled and interpreted kernels when it is first imported, and TorchRec
imports it on the way (tests/distributed is collected before tests/test_kernels.py). Without a CUDA
device the kernel tests need the interpreter, so it is switched on here, before any test module
is imported.
"""

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def run_without_triton() -> Callable[[str], str]:
    """Runs Python code in a fresh process where ``import triton`` fails; returns its stdout."""

    def run(code: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        res = subprocess.run(
            [sys.executable, "-c", "import sys; sys.modules['triton'] = None\n" + code],
            capture_output=True,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert res.returncode == 0, res.stderr
        return res.stdout

    return run


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module of small tensor ops: on a busy 2-core machine, torch's
    intra-op threads spin against each other and run them ~10x slower than one thread does.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
