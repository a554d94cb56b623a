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
finite elements and only where the block has no finite outlier, the codec's rule of
``codec/outliers.py``: an outlier's bound would be the inliers' range), or, per value, when
``value >= 2**-p`` and every nonzero finite element is a normal of the dtype; and ``amax`` does
not overflow. NaN stays NaN and +-Inf stay exact through a cast.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from torchrec_lossy.codec.bounds import finite_span
from torchrec_lossy.codec.outliers import OUTLIER_OCTAVES
from torchrec_lossy.config import CAST_FORMATS, BoundKind, ErrorBound, LossyCommsConfig

__all__ = [
    "CAST_DTYPES",
    "FLAGS_PER_WORD",
    "admissible",
    "cast_tables",
    "flag_words",
    "max_cast_error",
    "unpack_flags",
    "word_count",
]

CAST_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
assert set(CAST_DTYPES) == CAST_FORMATS
# Flags packed per int64 word of the size exchange: 32, so every word is a uint32 too (the
# exchange hands a peer's words past its size on as uint32, as the codec's skeleton).
FLAGS_PER_WORD = 32
_FLOAT32_TINY = torch.finfo(torch.float32).tiny


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
    e = torch.frexp(amax.double())[1] - 1  # floor(log2 amax) for amax > 0
    err = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), e.clamp(min=e_min) - p)
    return torch.where(amax > 0, err, 0.0)


def admissible(
    blocks: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype],
    bounds: Sequence[ErrorBound],
) -> torch.Tensor:
    """Whether each block's cast keeps every element within its bound (module docstring).

    A few reductions over the blocks joined, on their device; no host read.

    Args:
        blocks: 2-D float blocks, on one device.
        dtypes: Per block, its cast dtype.
        bounds: Per block, its bound (the call's: 0 is exact, so only an all-zero block casts).

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
        p = _precision(dt)[0]
        fi = torch.finfo(dt)
        rows.append([b.numel(), int(k), eb.value, 2.0**-p, fi.max, fi.tiny])
    params = torch.tensor(rows, dtype=torch.float64).to(device)  # one upload
    numel, kind, value, unit, top, tiny = params.unbind(1)
    lengths = numel.long()
    flat = torch.cat([b.reshape(-1) for b in blocks]).float()
    finite = torch.isfinite(flat)
    lo = _segments(torch.where(finite, flat, math.inf), "min", lengths, math.inf)
    hi = _segments(torch.where(finite, flat, -math.inf), "max", lengths, -math.inf)
    amax = torch.where(lo <= hi, torch.maximum(lo.abs(), hi.abs()), 0.0)
    # Each block's cast error bound in its own dtype (few dtypes: one pass each over [n]).
    err = torch.zeros(n, dtype=torch.float64, device=device)
    for dt in dict.fromkeys(dtypes):
        mask = torch.tensor([d == dt for d in dtypes], device=device)
        err = torch.where(mask, max_cast_error(amax, dt), err)
    in_range = amax.double() <= top
    relative = kind == BoundKind.RELATIVE
    ok = in_range & (err <= torch.where(relative, value * finite_span(lo, hi), value))
    if BoundKind.RELATIVE in kinds:  # an outlier's bound would be the inliers' range
        ok &= ~(relative & _has_outlier(flat, finite, lengths, amax))
    if BoundKind.VALUE in kinds:
        nonzero = torch.where(finite & (flat != 0), flat.abs(), math.inf)
        min_nonzero = _segments(nonzero, "min", lengths, math.inf).double()
        per_value = in_range & (value >= unit) & (min_nonzero >= tiny)
        ok = torch.where(kind == BoundKind.VALUE, per_value, ok)
    return ok.to(torch.int64)


def _segments(x: torch.Tensor, how: str, lengths: torch.Tensor, initial: float) -> torch.Tensor:
    """``how`` ("min", "max", "sum") of each block's run of ``x`` (an empty block: ``initial``)."""
    return torch.segment_reduce(x, how, lengths=lengths, unsafe=True, initial=initial)


def _has_outlier(
    flat: torch.Tensor, finite: torch.Tensor, lengths: torch.Tensor, amax: torch.Tensor
) -> torch.Tensor:
    """Whether each block has a finite outlier (``codec/outliers.py``: an element at least
    ``2**OUTLIER_OCTAVES`` times the block's median exponent), which holds iff at least half
    of its normal elements lie ``OUTLIER_OCTAVES`` octaves or more below its largest one.

    Args:
        flat: float32 elements of every block, back to back.
        finite: Which are finite.
        lengths: int64 elements per block.
        amax: Largest finite magnitude per block.

    Returns:
        bool [n].
    """
    e_top = torch.frexp(amax)[1] - 1
    below = torch.ldexp(torch.ones_like(amax), e_top - (OUTLIER_OCTAVES - 1))
    below = torch.repeat_interleave(below, lengths, output_size=flat.numel())
    mag = flat.abs()
    normal = finite & (mag >= _FLOAT32_TINY)
    counts = _segments(torch.stack([normal, normal & (mag < below)], 1).double(), "sum",
                       lengths, 0.0)  # fmt: skip
    return (counts[:, 0] > 0) & (2 * counts[:, 1] >= counts[:, 0])


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
