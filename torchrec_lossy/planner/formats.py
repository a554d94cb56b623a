"""The wire formats ``comms.format: auto`` picks from, and the pick itself.

Candidates are data (:data:`CANDIDATES`): adding a lossy format is one entry. For one table and
one destination class the pick is the admissible candidate of least estimated time per raw
byte, forward and gradient together (both travel in the table's format):

    ms per raw byte = 1 / (ratio * bandwidth) + 1 / encode + 1 / decode

The collective's fixed cost per round is the same for every candidate of a table (every
exchange has its size and payload rounds today), so it does not change the pick; the summary
prints it. Accuracy first: a candidate whose error can exceed the table's bound is never
admitted; a cast (fp16 / bf16) is admitted where the bound can be met, and the seam checks
each block on its data, sending exactly any block the cast would take past its bound
(``distributed/cast_blocks.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchrec_lossy.config import ErrorBound
from torchrec_lossy.planner.cost import RAW, WireFormat, gib_s_to_bytes_per_ms

__all__ = ["CANDIDATES", "Candidate", "FormatChoice", "admits", "choose_format", "ms_per_byte"]


@dataclass(frozen=True)
class Candidate:
    """One wire format ``auto`` may pick.

    Attributes:
        name: The ``comms.format`` value.
        ratio: Raw bytes / wire bytes when fixed (raw 1, casts 2); None: the table's expected
            or calibrated codec ratio.
        value_error: Relative error per value of a cast (``|x' - x| <= value_error * |x|`` in
            the cast's normal range: round to nearest keeps 11 (fp16) / 8 (bf16) significant
            bits); 0: exact; None: the configured bound (an error-bounded codec meets any
            bound). Outside its normal range (fp16 below 6.1e-5 or past 65504, bf16 on
            float32's subnormals) a cast's per-value error is larger: the seam's check per
            block sends such a block exactly.
    """

    name: str
    ratio: float | None
    value_error: float | None


CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        Candidate("raw", 1.0, 0.0),
        # Round to nearest keeps 10 (fp16) / 7 (bf16) mantissa bits: 2**-11 / 2**-8 relative.
        Candidate("fp16", 2.0, 2.0**-11),
        Candidate("bf16", 2.0, 2.0**-8),
        Candidate("entropy", None, None),
        Candidate("packed", None, None),
    )
}


def admits(candidate: Candidate, bound: ErrorBound) -> bool:
    """Whether ``candidate`` can keep a table's values within ``bound``.

    Exact and error-bounded formats meet every bound. A cast errs by up to ``value_error``
    of each value, so a per-value bound at least that large admits it, and so does a relative
    one (``value * (max - min)`` of a block: a block whose range is at least its largest
    magnitude, as embeddings and gradients around 0 have, keeps its cast within it); an
    absolute bound never (its scale is the data's, unknown here). Where a block's data does
    not meet the bound (a range tiny against its magnitude, values outside the cast's normal
    range) the seam sends that block exactly, so an admitted cast never exceeds the bound.

    Args:
        candidate: The format.
        bound: The table's bound.

    Returns:
        True if admitted.
    """
    if candidate.value_error is None or candidate.value_error == 0.0:
        return True
    return bound.mode in ("value", "relative") and bound.value >= candidate.value_error


def ms_per_byte(fmt: WireFormat, bandwidth: float) -> float:
    """Estimated ms per raw byte of ``fmt`` on a link of ``bandwidth`` bytes/ms.

    Args:
        fmt: The format with its ratio and throughputs.
        bandwidth: Link bandwidth, bytes/ms.

    Returns:
        ``1 / (ratio * bandwidth)`` plus the codec's ms per byte.
    """
    return 1.0 / (fmt.ratio * bandwidth) + fmt.codec_ms(1.0)


@dataclass(frozen=True)
class FormatChoice:
    """The pick for one table and destination class.

    Attributes:
        name: The chosen format.
        estimates: ms per raw byte (forward + gradient) of each admissible candidate.
    """

    name: str
    estimates: dict[str, float]

    def reason(self, bandwidth_gib_s: float) -> str:
        """Why, in a few words: the estimates relative to raw.

        Args:
            bandwidth_gib_s: The link's bandwidth.

        Returns:
            E.g. ``"entropy 0.12x raw's time at 0.116 GiB/s"``.
        """
        raw = self.estimates["raw"]
        others = ", ".join(f"{n} {t / raw:.2f}x" for n, t in self.estimates.items() if n != "raw")
        return f"at {bandwidth_gib_s:.3g} GiB/s, time vs raw: {others or 'no other format'}"


def choose_format(
    formats: Mapping[str, tuple[WireFormat, WireFormat]],
    bound: ErrorBound,
    bandwidth: float,
) -> FormatChoice:
    """The admissible candidate of least estimated forward + gradient time.

    Args:
        formats: Candidate name to its ``(forward, gradient)`` formats with ratios and
            throughputs (candidates absent here are not considered).
        bound: The table's forward bound (admission).
        bandwidth: The destination class's link bandwidth, bytes/ms.

    Returns:
        The choice; raw on a tie (no codec work for nothing), else the more accurate.
    """
    estimates = {
        name: ms_per_byte(fwd, bandwidth) + ms_per_byte(bwd, bandwidth)
        for name, (fwd, bwd) in formats.items()
        if admits(CANDIDATES[name], bound)
    }
    estimates.setdefault("raw", 2 * ms_per_byte(RAW, bandwidth))
    # Ties: raw (no work for nothing), then the smaller error (fp16 before bf16).
    best = min(estimates, key=lambda n: (estimates[n], n != "raw", CANDIDATES[n].value_error or 0))
    return FormatChoice(best, estimates)


def bandwidth_gib_s(bandwidth: float) -> float:
    """bytes/ms back to GiB/s (for messages).

    Args:
        bandwidth: bytes/ms.

    Returns:
        GiB/s.
    """
    return bandwidth / gib_s_to_bytes_per_ms(1.0)
