"""Session-wide test set-up.

Triton decides between compiled and interpreted kernels when it is first imported, and TorchRec
imports it on the way (tests/dist is collected before tests/test_kernels.py). Without a CUDA
device the kernel tests need the interpreter, so it is switched on here, before any test module
is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
