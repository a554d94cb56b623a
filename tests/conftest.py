"""Session-wide test set-up.

Triton decides between compiled and interpreted kernels when it is first imported, and TorchRec
imports it on the way (tests/distributed is collected before tests/test_kernels.py). Without a CUDA
device the kernel tests need the interpreter, so it is switched on here, before any test module
is imported.
"""

import os
import subprocess
import sys
from collections.abc import Callable
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
