"""The codec: ``compress(blocks, bounds) -> payload`` and ``decompress(payload) -> blocks``.

Per block: quantize under the bound (escaping what it cannot cover), reference repeated vectors,
Huffman-code the distinct ones, and send the smallest of four modes (docs/codec.md, "Pipeline,
per block"). This module holds the public calls, their input checks and the one backend choice,
from ``CodecConfig.backend`` and the tensors' device: the device orchestration over a
``kernel_set.KernelSet`` or the compiled host path, which write the same bytes and decode every
payload alike (docs/codec.md, "Backends").
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from torchrec_lossy.codec import host_compress, host_decompress
from torchrec_lossy.codec.bounds import BoundKind, absolute_bounds
from torchrec_lossy.codec.container import (
    DEFAULT_MAX_ELEMENTS,
    BlockColumns,
    BlockStats,
    check_payload,
)
from torchrec_lossy.codec.format import DTYPE_CODES, CodecError
from torchrec_lossy.codec.kernel_set import backend_kernels, triton_available
from torchrec_lossy.config import Backend, CodecConfig
from torchrec_lossy.profile_range import profile_range

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "BlockStats",
    "check_kinds",
    "compress",
    "compress_host_groups",
    "compress_with_stats",
    "decompress",
    "decompress_host_groups",
    "host_error",
    "on_device",
    "validate_inputs",
]


def on_device(device: torch.device, backend: str) -> bool:
    """Whether compress / decompress run the device orchestration (``device_compress`` /
    ``device_decompress``) rather than the compiled host path.

    Tensors on any device do with ``"triton"`` (CPU tensors: the Triton interpreter, slow, for
    tests) and ``"reference"`` (the kernels' torch twins); CUDA tensors also with ``"auto"``
    when triton is installed (without it they are staged through the host path).

    Args:
        device: The tensors' device.
        backend: ``CodecConfig.backend``.

    Returns:
        True for the device-resident path.
    """
    if backend in ("triton", "reference"):
        return True
    return backend == "auto" and device.type == "cuda" and triton_available()


def validate_inputs(
    blocks: Sequence[torch.Tensor], error_bounds: Sequence[float]
) -> tuple[list[float], torch.device]:
    """Checks blocks and bounds as compress needs them.

    Args:
        blocks: What the caller passed as blocks.
        error_bounds: What it passed as bounds.

    Returns:
        (the bounds as floats, the blocks' device).

    Raises:
        ValueError: Naming the bad block or bound and the fix.
    """
    if isinstance(blocks, torch.Tensor):
        raise ValueError(
            "blocks must be a sequence of 2-D tensors, got a single tensor: wrap it as [tensor]"
        )
    blocks = list(blocks)
    bounds = list(error_bounds)
    if len(bounds) != len(blocks):
        raise ValueError(
            f"got {len(blocks)} blocks but {len(bounds)} error bounds: pass one bound per block"
        )
    for i, b in enumerate(blocks):
        if not isinstance(b, torch.Tensor):
            raise ValueError(f"block {i} is a {type(b).__name__}: pass a torch.Tensor")
    device = blocks[0].device if blocks else torch.device("cpu")
    out = []
    for i, (b, eb) in enumerate(zip(blocks, bounds, strict=True)):
        if b.dim() != 2:
            raise ValueError(
                f"block {i} has shape {tuple(b.shape)}: pass 2-D blocks [rows, dim] "
                "(reshape it, e.g. block.reshape(-1, dim))"
            )
        if b.dtype not in DTYPE_CODES:
            raise ValueError(
                f"block {i} has dtype {b.dtype}: pass float32, float16 or bfloat16 "
                "(e.g. block.float())"
            )
        if b.device != device:
            raise ValueError(
                f"block {i} is on {b.device} but block 0 is on {device}: "
                "put all blocks of one payload on one device"
            )
        if b.shape[0] >= 1 << 32 or b.shape[1] >= 1 << 32:
            raise ValueError(f"block {i} has shape {tuple(b.shape)}: each side must be < 2**32")
        try:
            eb_f = float(eb)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(
                f"error bound {i} is {eb!r}: pass a finite float >= 0 (0 means lossless)"
            ) from None
        if not math.isfinite(eb_f) or eb_f < 0:
            raise ValueError(
                f"error bound {i} is {eb_f}: pass a finite bound >= 0 (0 means lossless)"
            )
        out.append(eb_f)
    return out, device


def check_kinds(
    kinds: Sequence[int] | None, bounds: Sequence[float], config: CodecConfig
) -> list[BoundKind]:
    """Checks the bound kinds of a call against its bounds and config.

    Args:
        kinds: Per block, its bound's ``BoundKind``; None: all absolute.
        bounds: The validated bounds.
        config: Codec knobs.

    Returns:
        The kinds, one per block.

    Raises:
        ValueError: A kind per block is missing, a per-value bound is over 0.5 (it would keep no
            mantissa bit), or per-value bounds meet stochastic rounding (the per-value grid
            rounds to nearest only).
    """
    if kinds is None:
        return [BoundKind.ABSOLUTE] * len(bounds)
    out = [BoundKind(int(k)) for k in kinds]
    if len(out) != len(bounds):
        raise ValueError(f"got {len(out)} bound kinds for {len(bounds)} blocks: pass one per block")
    for i, (k, b) in enumerate(zip(out, bounds, strict=True)):
        if b > k.max_value:
            raise ValueError(
                f"{k.label} bound {i} is {b}: pass a value in (0, {k.max_value:g}] (0 means "
                "lossless)"
            )
        if k.nearest_only and b > 0 and config.rounding == "stochastic":
            raise ValueError(
                f"{k.label} bound {i} ({b}) with rounding='stochastic': its grid rounds to "
                "nearest only; set rounding='nearest' or use a relative bound"
            )
    return out


def compress_with_stats(
    blocks: Sequence[torch.Tensor],
    error_bounds: Sequence[float],
    config: CodecConfig | None = None,
    kinds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[BlockStats]]:
    """Compresses blocks under error bounds and reports what each block became.

    Args:
        blocks: 2-D float32 / float16 / bfloat16 tensors (rows = embedding vectors), one device.
        error_bounds: Bound per block; 0 means lossless for that block.
        config: Codec knobs; None uses the defaults.
        kinds: Per block, its bound's ``BoundKind``; None: all absolute. A ``VALUE`` block
            keeps ``|x' - x| <= bound * |x|`` for every element (``bound <= 0.5``).

    Returns:
        (1-D uint8 payload on the blocks' device, one BlockStats per block).

    Raises:
        ValueError: For a bad block, bound or bound count (the message names it and the fix).
    """
    config = config or CodecConfig()
    bounds, device = validate_inputs(blocks, error_bounds)
    kinds = check_kinds(kinds, bounds, config)
    if BoundKind.RELATIVE in kinds:
        bounds = absolute_bounds(blocks, bounds, kinds)
        kinds = [BoundKind.ABSOLUTE if k == BoundKind.RELATIVE else k for k in kinds]
    if on_device(device, config.backend):
        # Raises if triton is missing; picks the interpreter on CPU (not for the torch twins).
        kernels = backend_kernels(device, config.backend)
        from torchrec_lossy.codec.device_compress import compress_device

        return compress_device(blocks, bounds, config, kinds, kernels)
    with profile_range("## lossy_codec encode ##"):
        enc = host_compress.compress_blocks(blocks, bounds, config, None, kinds)
    return torch.from_numpy(enc.payload).to(device), enc.columns[0].stats()


def compress_host_groups(
    blocks: Sequence[torch.Tensor],
    bounds: list[float],
    group_sizes: Sequence[int],
    config: CodecConfig,
    kinds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[int], list[BlockColumns], list[np.ndarray]]:
    """The host path of several payloads at once: consecutive groups of validated blocks.

    Every stage runs once over all groups' blocks; each payload is the bytes
    :func:`compress_with_stats` gives for its group alone.

    Args:
        blocks: Validated 2-D blocks, group after group (one device).
        bounds: Validated bound per block, of its kind in ``kinds``.
        group_sizes: Blocks per group.
        config: Codec knobs (a host backend: "auto" off the device path, or "cpu").
        kinds: Per block, its bound's ``BoundKind``; None: all absolute.

    Returns:
        (the payloads back to back as one 1-D uint8 tensor on the blocks' device, bytes of
        each payload, per group the columns of its blocks, per group its payload's skeleton
        (``container.payload_skeletons``, uint32 words)).
    """
    device = blocks[0].device if blocks else torch.device("cpu")
    if not group_sizes:
        return torch.zeros(0, dtype=torch.uint8, device=device), [], [], []
    enc = host_compress.compress_blocks(blocks, bounds, config, group_sizes, kinds)
    payload = torch.from_numpy(enc.payload)
    # A no-op .to() still costs a dispatch: only a device copy pays for one.
    payload = payload if device.type == "cpu" else payload.to(device)
    return payload, enc.sizes, enc.columns, enc.skeletons


def compress(
    blocks: Sequence[torch.Tensor],
    error_bounds: Sequence[float],
    config: CodecConfig | None = None,
) -> torch.Tensor:
    """Compresses blocks under absolute error bounds.

    Every finite element decodes within its block's bound; NaN, +-Inf and values the bound cannot
    cover travel exactly.

    Args:
        blocks: 2-D float32 / float16 / bfloat16 tensors (rows = embedding vectors), one device.
        error_bounds: Absolute bound per block; 0 means lossless for that block.
        config: Codec knobs; None uses the defaults.

    Returns:
        The payload: a 1-D torch.uint8 tensor on the blocks' device.

    Raises:
        ValueError: For a bad block, bound or bound count.
    """
    return compress_with_stats(blocks, error_bounds, config)[0]


def decompress(
    payload: torch.Tensor,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    backend: Backend = "auto",
) -> list[torch.Tensor]:
    """Decodes a payload made by :func:`compress`.

    A CUDA payload (backend ``"auto"`` with triton installed, or ``"triton"``) and a CPU payload
    with backend ``"triton"`` or ``"reference"`` are decoded on their device by
    :func:`torchrec_lossy.codec.device_decompress.decompress_device` (all blocks at once, two
    host syncs; over the Triton launchers, or their torch twins for ``"reference"``);
    everything else by the host path below. Both give the same bits and the same errors (a
    payload the device decoder rejects is decoded again by the host path, which names it).

    Args:
        payload: 1-D uint8 tensor.
        max_elements: Refuse payloads that decode to more elements than this in total.
        backend: Stage implementations, as ``CodecConfig.backend``; every backend decodes every
            payload.

    Returns:
        The blocks: same shapes and dtypes as compressed, on the payload's device.

    Raises:
        CodecError: The payload is truncated, corrupted or not a torchrec-lossy payload.
    """
    CodecConfig(backend=backend)  # validates the backend name
    check_payload(payload)
    if on_device(payload.device, backend):
        from torchrec_lossy.codec.device_decompress import decompress_device

        def on_reject(buf: np.ndarray) -> None:
            error = host_error(buf, max_elements)
            if error is not None:
                raise error

        kernels = backend_kernels(payload.device, backend)
        return decompress_device(payload, max_elements, on_reject, kernels)
    (out,) = decompress_host_groups(payload, [payload.numel()], max_elements)
    if isinstance(out, CodecError):
        raise out
    return out


def decompress_host_groups(
    buffer: torch.Tensor,
    sizes: Sequence[int],
    max_elements: int,
    label: bool = True,
) -> list[list[torch.Tensor] | CodecError]:
    """The host path of :func:`decompress` over several payloads of one buffer at once.

    One compiled call parses and decodes every block of every payload, and names the first
    check each rejected payload fails (``host_decompress.BatchDecoded.error``), so each
    payload's result or error is what :func:`decompress` gives for it.

    Args:
        buffer: 1-D uint8 tensor: the payloads back to back.
        sizes: Bytes of each payload (summing to the buffer's).
        max_elements: Refuse a payload that decodes to more elements than this.
        label: Whether to open the profiler range ``## lossy_codec decode ##`` (False when
            the caller's own range already covers the call: a range costs microseconds).

    Returns:
        Per payload its blocks (on the buffer's device) or the CodecError it raises.
    """
    device = buffer.device
    if device.type == "cpu" and buffer.is_contiguous():
        buf = buffer.numpy()  # uint8 never requires grad: no detach needed
    else:
        buf = buffer.detach().cpu().contiguous().numpy()
    starts = list(itertools.accumulate(sizes, initial=0))
    results: list[list[torch.Tensor] | CodecError] = []
    with profile_range("## lossy_codec decode ##") if label else contextlib.nullcontext():
        if not sizes:
            return results
        batch = host_decompress.decompress_payloads(*_word_layout(buf, starts), max_elements)
        if device.type != "cpu":
            batch = dataclasses.replace(
                batch, out32=batch.out32.to(device), out16=batch.out16.to(device)
            )
        for g, n in enumerate(sizes):
            if batch.complete(g):
                results.append(batch.blocks(g))
            else:
                results.append(batch.error(g, buf[starts[g] : starts[g] + n], max_elements))
    return results


def host_error(buf: np.ndarray, max_elements: int) -> CodecError | None:
    """The host path's error for a payload the device path rejected (the first check it
    fails), or None where it decodes.

    Args:
        buf: The payload's bytes (1-D uint8, on the host).
        max_elements: The limit it was decoded under.

    Returns:
        The CodecError (the caller raises it), or None.
    """
    payload = torch.from_numpy(buf.copy())
    (got,) = decompress_host_groups(payload, [buf.shape[0]], max_elements, label=False)
    return got if isinstance(got, CodecError) else None


def _word_layout(buf: np.ndarray, starts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The payloads of ``buf`` as words, for ``host_decompress.decompress_payloads``.

    A view when every payload starts on a word (always, for payloads written by
    :func:`compress`); else a copy with each payload padded to a whole word.

    Args:
        buf: uint8 payloads back to back.
        starts: Byte offset of each payload in ``buf``, then the end.

    Returns:
        (uint32 words, int64 [2 * G]: the first word of each payload, then its bytes).
    """
    n_bytes = [b - a for a, b in itertools.pairwise(starts)]
    if not any(a & 3 for a in starts):  # one numpy call: they cost more than the arithmetic
        return buf.view(np.uint32), np.array([a >> 2 for a in starts[:-1]] + n_bytes, np.int64)
    words_at = list(itertools.accumulate((-(-n // 4) for n in n_bytes), initial=0))
    words = np.zeros(4 * words_at[-1], np.uint8)
    for w, s, n in zip(words_at, starts, n_bytes, strict=False):
        words[4 * w : 4 * w + n] = buf[s : s + n]
    return words.view(np.uint32), np.array(words_at[:-1] + n_bytes, np.int64)
