"""How the device paths reach the Triton kernels in ``torchrec_lossy.kernels``.

Importing this module never imports triton; :func:`load_kernels` does, and raises a clear error
when triton is missing. On a machine without CUDA the kernels run on CPU tensors in the Triton
interpreter: the first call sets ``TRITON_INTERPRET=1`` for the process before the kernels are
imported (slow; meant for tests).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import torch


def triton_available() -> bool:
    """Whether the triton package is installed (without importing it).

    Returns:
        True if ``triton`` can be imported.
    """
    return importlib.util.find_spec("triton") is not None


def load_kernels(device: torch.device) -> tuple[ModuleType, ModuleType, ModuleType]:
    """Imports the kernel modules, switching to the interpreter for CPU tensors.

    Args:
        device: Where the kernels will run (CPU: the Triton interpreter).

    Returns:
        The kernel modules (quantize, vector_lz, huffman).

    Raises:
        RuntimeError: triton is missing, or was imported compiled without a CUDA device.
    """
    if not triton_available():
        raise RuntimeError(
            "the triton backend needs the triton package: pip install triton (with a CUDA GPU), "
            "or use backend 'cpu'"
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # @triton.jit picks compiled or interpreted at decoration time, triton.language's own
        # helpers included, so the switch must precede the first import of triton.
        if "triton" in sys.modules:
            raise RuntimeError(
                "triton was imported without TRITON_INTERPRET=1 and no CUDA device is "
                "available: set TRITON_INTERPRET=1 before anything imports triton"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    from torchrec_lossy.kernels import huffman as k_huffman
    from torchrec_lossy.kernels import quantize as k_quantize
    from torchrec_lossy.kernels import vector_lz as k_vector_lz

    return k_quantize, k_vector_lz, k_huffman


__all__ = ["load_kernels", "triton_available"]
