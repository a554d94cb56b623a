"""The kernel set the device paths run over, chosen once per call at the codec's boundary.

:class:`KernelSet` holds the Triton launchers of ``torchrec_lossy.kernels`` or their torch twins
``kernels/*_ref.py`` (``"reference"``: the same outputs bit for bit, no triton; the test oracle).
The caller (``pipeline``, ``grouped``) picks it with :func:`load_kernels`; nothing below it holds
one. Importing this module never imports triton; :func:`load_kernels` does (docs/kernels.md, top).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import NamedTuple

import torch


class KernelSet(NamedTuple):
    """The kernel modules of one device-path call (same launcher names in each set).

    Attributes:
        quantize: ``quantize_tiles``, ``decode_outputs``.
        vector_lz: ``representatives``, ``representatives_pair``, ``unpack_refs_blocks``.
        huffman: ``histogram_tiles``, ``encode_chunks``, ``decode_blocks``, ``check_escapes``,
            ``block_status``.
        codebook: ``code_lengths``, ``canonical_codes``, ``decode_tables``.
        packed: ``packed_checksums``, ``packed_widths``, ``unpack_groups`` (the packed
            format's decode).
    """

    quantize: ModuleType
    vector_lz: ModuleType
    huffman: ModuleType
    codebook: ModuleType
    packed: ModuleType


def triton_available() -> bool:
    """Whether the triton package is installed (without importing it).

    Returns:
        True if ``triton`` can be imported.
    """
    return importlib.util.find_spec("triton") is not None


def load_kernels(device: torch.device, reference: bool = False) -> KernelSet:
    """Imports a kernel set: the Triton launchers, or their torch twins.

    Args:
        device: Where the kernels will run (CPU: the Triton interpreter for the Triton set).
        reference: The torch twins (``kernels/*_ref.py``; any device, no triton) instead of
            the Triton launchers.

    Returns:
        The kernel modules.

    Raises:
        RuntimeError: The Triton set was asked for and triton is missing, or was imported
            compiled without a CUDA device.
    """
    if reference:
        from torchrec_lossy.kernels import (
            codebook_ref,
            huffman_ref,
            packed_ref,
            quantize_ref,
            vector_lz_ref,
        )

        return KernelSet(quantize_ref, vector_lz_ref, huffman_ref, codebook_ref, packed_ref)
    if not triton_available():
        raise RuntimeError(
            "the triton backend needs the triton package: pip install triton (with a CUDA GPU), "
            "or use backend 'cpu' (or 'reference', the torch twins of the kernels)"
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
    from torchrec_lossy.kernels import codebook, huffman, packed, quantize, vector_lz

    return KernelSet(quantize, vector_lz, huffman, codebook, packed)


def backend_kernels(device: torch.device, backend: str) -> KernelSet:
    """The kernel set of a device-path call with ``CodecConfig.backend`` ``backend``.

    Args:
        device: The tensors' device.
        backend: A backend ``pipeline.on_device`` sends to the device path.

    Returns:
        The torch twins for ``"reference"``, else the Triton launchers.
    """
    return load_kernels(device, reference=backend == "reference")


__all__ = ["KernelSet", "backend_kernels", "load_kernels", "triton_available"]
