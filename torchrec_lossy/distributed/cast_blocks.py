"""The fp16 / bf16 casts of the pooled all-to-all's blocks, each admitted on its own data.

A table whose format is ``"fp16"`` or ``"bf16"`` (forced, or chosen by ``comms.format: auto``)
sends each block cast to that dtype when the cast keeps every element within the block's bound,
else exactly (float32): never a block past its bound. The check is a few reductions over the
blocks, no sort and no host read: its per-block flags ride the size exchange (and the payload's
own prefix, for the one-round slot path), so the receiver knows which blocks it got cast.

Round to nearest into a float with ``p`` significant bits (bf16 8, fp16 11) errs by at most half
a unit in the last place: ``2**(floor(log2 |x|) - p)``, at most ``2**-p * |x|``, inside the
dtype's normal range; below it the spacing is that of its smallest normal (fp16: ``2**-25``
absolute below 6.1e-5, so a per-value bound fails there), and past its largest finite value
(fp16: 65504) the cast overflows. A block is cast when, over its finite elements with largest
magnitude ``amax``, ``2**(max(floor(log2 amax), e_min) - p)`` (0 for an all-zero block) is within
its absolute bound (``value``; ``value * (max - min)`` for a relative one, over the block's
finite elements that are not outliers, the codec's rule of ``codec/outliers.py``), or, per
value, when ``value >= 2**-p`` and every nonzero element is a normal of the dtype (a NaN
refuses it); and ``amax`` does not overflow. NaN stays NaN (its payload bits not kept) and
+-Inf stay exact through a cast.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from torchrec_lossy.codec.bounds import finite_span
from torchrec_lossy.codec.outliers import inlier_ranges_kernel, inlier_ranges_torch
from torchrec_lossy.codec.quantize import finite_ranges_kernel
from torchrec_lossy.config import CAST_FORMATS, BoundKind, ErrorBound, LossyCommsConfig

__all__ = [
    "CAST_DTYPES",
    "FLAGS_PER_WORD",
    "admissible",
    "cast_tables",
    "flag_words",
    "max_cast_error",
    "pack_flags",
    "unpack_flags",
    "word_count",
]

CAST_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
assert set(CAST_DTYPES) == CAST_FORMATS
# Flags packed per int64 word of the size exchange: 32, so every word is a uint32 too (the
# exchange hands a peer's words past its size on as uint32, as the codec's skeleton).
FLAGS_PER_WORD = 32


def cast_tables(config: LossyCommsConfig, tables: Iterable[str]) -> dict[str, torch.dtype]:
    """The tables whose blocks travel cast, and their wire dtypes.

    Args:
        config: The comms config (each table's resolved ``format``).
        tables: Table names.

    Returns:
        Table name to ``torch.float16`` / ``torch.bfloat16``, for the cast tables only.
    """
    fmts = {t: config.table(t).format for t in tables}
    return {t: CAST_DTYPES[f] for t, f in fmts.items() if f in CAST_DTYPES}


def _precision(dtype: torch.dtype) -> tuple[int, int]:
    """(significant bits ``p``, exponent of the smallest normal) of a cast dtype."""
    fi = torch.finfo(dtype)
    return 1 - round(math.log2(fi.eps)), round(math.log2(fi.tiny))


def max_cast_error(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Upper bound of the error of casting values of largest finite magnitude ``amax``
    (inside the dtype's finite range) to ``dtype`` and back, round to nearest.

    Args:
        amax: Largest finite magnitude per block (float).
        dtype: ``torch.float16`` or ``torch.bfloat16``.

    Returns:
        float64 bounds, 0 where ``amax`` is 0.
    """
    p, e_min = _precision(dtype)
    return _half_ulp(amax, torch.full_like(amax, p, dtype=torch.int64), e_min)


def _half_ulp(amax: torch.Tensor, p: torch.Tensor, e_min: torch.Tensor | int) -> torch.Tensor:
    """``2**(max(floor(log2 amax), e_min) - p)`` (float64), 0 where ``amax`` is 0."""
    e = torch.frexp(amax.double())[1].long() - 1  # floor(log2 amax) for amax > 0
    one = torch.ones_like(amax, dtype=torch.float64)
    return torch.where(amax > 0, torch.ldexp(one, torch.clamp(e, min=e_min) - p), 0.0)


def admissible(
    blocks: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype],
    bounds: Sequence[ErrorBound],
    host: bool | None = None,
) -> torch.Tensor:
    """Whether each block's cast keeps every element within its bound (module docstring).

    A few reductions over the blocks joined, no host read: on the host (CPU blocks) the codec's
    compiled range kernels, on a device torch ops (the codec's device rule for the inliers).

    Args:
        blocks: 2-D float blocks, on one device.
        dtypes: Per block, its cast dtype.
        bounds: Per block, its bound (the call's: 0 is exact, so only an all-zero block casts).
        host: Take the host kernels (None: for CPU blocks); False on CPU: the device's torch
            ops (the tests compare the two).

    Returns:
        int64 [n] on the blocks' device: 1 where the block travels cast, 0 where exactly.
    """
    n = len(blocks)
    device = blocks[0].device if n else torch.device("cpu")
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    kinds = [BoundKind.of(b.mode) for b in bounds]
    rows = []
    for b, dt, eb, k in zip(blocks, dtypes, bounds, kinds, strict=True):
        p, e_min = _precision(dt)
        fi = torch.finfo(dt)
        rows.append([b.numel(), int(k), eb.value, 2.0**-p, fi.max, fi.tiny, p, e_min])
    params = torch.tensor(rows, dtype=torch.float64).to(device)  # one upload
    numel, kind, value, unit, top, tiny, p, e_min = params.unbind(1)
    relative = [k == BoundKind.RELATIVE for k in kinds]
    if host is None:
        host = device.type == "cpu"
    flat = None if host else torch.cat([b.reshape(-1) for b in blocks]).float()
    if flat is None:
        lo, hi, ilo, ihi = _host_ranges(blocks, relative)
    else:
        lo, hi, ilo, ihi = _device_ranges(flat, [b.numel() for b in blocks], relative)
    amax = torch.where(lo <= hi, torch.maximum(lo.abs(), hi.abs()), 0.0)
    err = _half_ulp(amax, p.long(), e_min.long())
    in_range = amax <= top
    # A relative bound spans the block's finite inliers (codec/outliers.py), as the codec's.
    rel = kind == BoundKind.RELATIVE
    ok = in_range & (err <= torch.where(rel, value * finite_span(ilo.float(), ihi.float()), value))
    if BoundKind.VALUE in kinds:
        mag = (torch.cat([b.reshape(-1) for b in blocks]) if flat is None else flat).float().abs()
        mag.masked_fill_(mag == 0, math.inf)  # zeros cast exactly; NaN stays, refusing the block
        min_nonzero = torch.segment_reduce(
            mag, "min", lengths=numel.long(), unsafe=True, initial=math.inf
        )
        per_value = in_range & (value >= unit) & (min_nonzero.double() >= tiny)
        ok = torch.where(kind == BoundKind.VALUE, per_value, ok)
    return ok.to(torch.int64)


def _host_ranges(
    blocks: Sequence[torch.Tensor], relative: Sequence[bool]
) -> tuple[torch.Tensor, ...]:
    """Each block's finite (lo, hi) and, for the relative ones, its finite inliers' (else the
    same): the host codec's compiled kernels (``quantize.finite_ranges_kernel``,
    ``outliers.inlier_ranges_kernel``) on each block as it lies (no copy of contiguous float32
    blocks), float64, +inf / -inf for a block without a finite element."""
    n = len(blocks)
    out = np.empty((4, n))
    ends = np.zeros(2, dtype=np.int64)
    for b, (blk, rel) in enumerate(zip(blocks, relative, strict=True)):
        x = blk.reshape(-1).float().contiguous().numpy()
        ends[1] = x.shape[0]
        lo, hi = finite_ranges_kernel(x, ends)
        ilo, ihi = inlier_ranges_kernel(x, ends, lo, hi, np.array([rel]))
        out[:, b] = lo[0], hi[0], ilo[0], ihi[0]
    none = np.isnan(out[0])
    out[0::2, none] = math.inf
    out[1::2, none] = -math.inf
    return tuple(torch.from_numpy(row) for row in out)


def _device_ranges(
    flat: torch.Tensor, numels: Sequence[int], relative: Sequence[bool]
) -> tuple[torch.Tensor, ...]:
    """:func:`_host_ranges` in torch ops on the blocks' device (float32; the inliers by
    ``outliers.inlier_ranges_torch``, the device codec's rule)."""
    lengths = torch.tensor(numels, dtype=torch.int64).to(flat.device)
    finite = torch.isfinite(flat)

    def seg(x: torch.Tensor, how: str, initial: float) -> torch.Tensor:
        return torch.segment_reduce(x, how, lengths=lengths, unsafe=True, initial=initial)

    lo = seg(torch.where(finite, flat, math.inf), "min", math.inf)
    hi = seg(torch.where(finite, flat, -math.inf), "max", -math.inf)
    if not any(relative):
        return lo, hi, lo, hi
    blk = torch.arange(len(numels), device=flat.device)
    e_blk = torch.repeat_interleave(blk, lengths, output_size=flat.numel())
    ilo, ihi = inlier_ranges_torch(flat, e_blk, lengths)
    return lo, hi, ilo, ihi


def word_count(n_flags: int) -> int:
    """Words of ``n_flags`` packed flags.

    Args:
        n_flags: Flags.

    Returns:
        ``ceil(n_flags / FLAGS_PER_WORD)``.
    """
    return -(-n_flags // FLAGS_PER_WORD)


def flag_words(flags: torch.Tensor) -> torch.Tensor:
    """Packs 0/1 flags into int64 words, :data:`FLAGS_PER_WORD` a word, low bit first.

    Args:
        flags: int64 [n] of 0 / 1.

    Returns:
        int64 [:func:`word_count` (n)], on the flags' device.
    """
    n = flags.numel()
    padded = torch.zeros(word_count(n) * FLAGS_PER_WORD, dtype=torch.int64, device=flags.device)
    padded[:n] = flags
    shifts = torch.arange(FLAGS_PER_WORD, dtype=torch.int64, device=flags.device)
    return (padded.view(-1, FLAGS_PER_WORD) << shifts).sum(1)


def pack_flags(flags: Sequence[bool]) -> list[int]:
    """:func:`flag_words` on the host (known flags: no torch op).

    Args:
        flags: The flags.

    Returns:
        The words.
    """
    words = [0] * word_count(len(flags))
    for i, f in enumerate(flags):
        if f:
            words[i // FLAGS_PER_WORD] |= 1 << (i % FLAGS_PER_WORD)
    return words


def unpack_flags(words: Sequence[int], n: int) -> list[bool]:
    """The flags :func:`flag_words` packed.

    Args:
        words: The words (host ints).
        n: Flags.

    Returns:
        ``n`` flags.

    Raises:
        ValueError: Fewer words than ``n`` flags need, or a bit set past the ``n``-th.
    """
    if len(words) != word_count(n):
        raise ValueError(f"{len(words)} cast flag words for {n} blocks")
    bits = [(int(w) >> i) & 1 for w in words for i in range(FLAGS_PER_WORD)]
    if any(bits[n:]) or any(int(w) >> FLAGS_PER_WORD for w in words):
        raise ValueError(f"cast flag words {list(words)} set bits past block {n}")
    return [bool(b) for b in bits[:n]]
