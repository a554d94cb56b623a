"""The wire formats ``comms.format: auto`` picks from, and the pick itself.

Candidates are data (:data:`CANDIDATES`): adding a lossy format is one entry. For one table and
one destination class the pick is the admissible candidate of least estimated time per raw
byte, forward and gradient together (both travel in the table's format):

    ms per raw byte = 1 / (ratio * bandwidth) + 1 / encode + 1 / decode

The collective's fixed cost per round is the same for every candidate of a table (every
exchange has its size and payload rounds today), so it does not change the pick; the summary
prints it. Accuracy first: a candidate whose error can exceed the table's bound is never
admitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchrec_lossy.config import NOT_YET_SENT, ErrorBound
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
            the cast's normal range); 0: exact; None: the configured bound (an error-bounded
            codec meets any bound).
        full_range: Whether ``value_error`` holds for every finite float32: fp16 flushes
            values below 6.1e-5 to subnormals or zero (up to 100% error) and overflows above
            65504; bf16 loses float32's subnormals (below 1.2e-38). Neither holds it.
        sendable: Whether the sharder can send the forward in it (``NOT_YET_SENT``).
    """

    name: str
    ratio: float | None
    value_error: float | None
    full_range: bool = True

    @property
    def sendable(self) -> bool:
        """Whether the sharder sends the forward in this format today."""
        return self.name not in NOT_YET_SENT


CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        Candidate("raw", 1.0, 0.0),
        # Round to nearest keeps 10 (fp16) / 7 (bf16) mantissa bits: 2**-11 / 2**-8 relative.
        Candidate("fp16", 2.0, 2.0**-11, full_range=False),
        Candidate("bf16", 2.0, 2.0**-8, full_range=False),
        Candidate("entropy", None, None),
        Candidate("packed", None, None),
    )
}


def admits(candidate: Candidate, bound: ErrorBound) -> bool:
    """Whether ``candidate`` keeps every value within ``bound``.

    A cast's error is relative to each value, so only a per-value bound at least that large
    admits it (a range-relative or absolute bound can be smaller than a large value's cast
    error), and only if that holds over all of float32's range, which neither fp16 nor bf16
    does (so today no bound admits them: they are priced for comparison only); exact and
    error-bounded formats meet every bound.

    Args:
        candidate: The format.
        bound: The table's bound.

    Returns:
        True if admitted.
    """
    if candidate.value_error is None or candidate.value_error == 0.0:
        return True
    return candidate.full_range and bound.mode == "value" and bound.value >= candidate.value_error


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
        estimates: ms per raw byte (forward + gradient) of each admissible sendable candidate.
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
    """The admissible, sendable candidate of least estimated forward + gradient time.

    Args:
        formats: Candidate name to its ``(forward, gradient)`` formats with ratios and
            throughputs (candidates absent here are not considered).
        bound: The table's forward bound (admission).
        bandwidth: The destination class's link bandwidth, bytes/ms.

    Returns:
        The choice; raw on a tie (no codec work for nothing).
    """
    estimates = {
        name: ms_per_byte(fwd, bandwidth) + ms_per_byte(bwd, bandwidth)
        for name, (fwd, bwd) in formats.items()
        if CANDIDATES[name].sendable and admits(CANDIDATES[name], bound)
    }
    estimates.setdefault("raw", 2 * ms_per_byte(RAW, bandwidth))
    best = min(estimates, key=lambda n: (estimates[n], n != "raw"))
    return FormatChoice(best, estimates)


def bandwidth_gib_s(bandwidth: float) -> float:
    """bytes/ms back to GiB/s (for messages).

    Args:
        bandwidth: bytes/ms.

    Returns:
        GiB/s.
    """
    return bandwidth / gib_s_to_bytes_per_ms(1.0)
