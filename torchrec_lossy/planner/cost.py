"""How each table's embedding traffic travels, as the planner prices it.

:class:`WireFormat`: one encoding (ratio, encode/decode throughputs). :class:`TableComms`: a
table's formats per collective and destination class (cross-host, same-host, own block), priced
by :class:`Links`. A :class:`CommsModel` maps tables to them: :class:`FixedCommsModel` (raw,
TorchRec's qcomm) or :class:`LossyCommsModel` (this project's codec). Units follow TorchRec's
planner: bandwidths in bytes/ms, times in ms; config throughputs in GiB/s (2**30 bytes/s).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "CODEC_THROUGHPUT_GIB_S",
    "MX4_RATIO",
    "QCOMM_THROUGHPUT_GIB_S",
    "CommsModel",
    "FixedCommsModel",
    "LinkCost",
    "Links",
    "TableComms",
    "WireFormat",
    "gib_s_to_bytes_per_ms",
    "qcomm_model",
    "raw_model",
]

_GIB = float(1 << 30)

# fbgemm's MX4: per group of 32 values, 32 4-bit codes (16 bytes) and one shared exponent byte.
MX4_RATIO = 32 * 4 / (16 + 1)

# Default throughputs (encode, decode) of this project's codec in GiB/s of raw input.
# cuda: the artifact's Huffman kernels (DESIGN.md section 1: ~200 GiB/s encode, 50-70 decode).
# cpu: the compiled host codec on one thread, one grouped call over 26 tables x 8 destinations
# x 256 rows (docs/benchmarks.md, 2026-11-23: 1.56 / 2.07 GB/s; 2.3 / 2.7 at 1,024-row blocks).
CODEC_THROUGHPUT_GIB_S: dict[str, tuple[float, float]] = {
    "cuda": (200.0, 60.0),
    "cpu": (1.5e9 / _GIB, 2.0e9 / _GIB),
}

# TorchRec qcomm quantize kernels (encode, decode) in GiB/s. cuda: "near 2 TB/s"
# (DESIGN.md section 2); cpu: measured with fbgemm-gpu-cpu 1.8.0 on one thread (same section).
QCOMM_THROUGHPUT_GIB_S: dict[tuple[str, str], tuple[float, float]] = {
    ("cuda", "fp16"): (2.0e12 / _GIB, 2.0e12 / _GIB),
    ("cuda", "bf16"): (2.0e12 / _GIB, 2.0e12 / _GIB),
    ("cuda", "mx4"): (2.0e12 / _GIB, 2.0e12 / _GIB),
    ("cpu", "fp16"): (0.55e9 / _GIB, 1.7e9 / _GIB),
    ("cpu", "bf16"): (0.55e9 / _GIB, 1.7e9 / _GIB),
    ("cpu", "mx4"): (0.05e9 / _GIB, 0.37e9 / _GIB),
}


# The process group backend each compute device's all-to-all runs on (``intra_host: auto``).
BACKENDS: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}


def gib_s_to_bytes_per_ms(gib_s: float) -> float:
    """Converts GiB/s to TorchRec's bandwidth unit, bytes/ms.

    Args:
        gib_s: Throughput in GiB/s.

    Returns:
        Bytes per millisecond.
    """
    return gib_s * _GIB / 1000.0


@dataclass(frozen=True)
class WireFormat:
    """One encoding of one direction of a table's traffic.

    Attributes:
        name: ``"raw"``, ``"fp16"``, ``"bf16"``, ``"mx4"`` or ``"lossy"``.
        ratio: Raw bytes / wire bytes.
        encode_gib_s: Encode throughput in GiB/s of raw input; None: free (no codec).
        decode_gib_s: Decode throughput in GiB/s of raw output; None: free.
    """

    name: str = "raw"
    ratio: float = 1.0
    encode_gib_s: float | None = None
    decode_gib_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.ratio > 0 and math.isfinite(self.ratio)):
            raise ValueError(f"WireFormat {self.name!r}: ratio={self.ratio} must be > 0")
        for key in ("encode_gib_s", "decode_gib_s"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise ValueError(f"WireFormat {self.name!r}: {key}={v} must be > 0 or None")

    def codec_ms(self, raw_bytes: float) -> float:
        """Encode plus decode time of ``raw_bytes`` of raw traffic, in ms.

        Args:
            raw_bytes: Bytes before encoding.

        Returns:
            Milliseconds (0 for a free format).
        """
        t = 0.0
        if self.encode_gib_s is not None:
            t += raw_bytes / gib_s_to_bytes_per_ms(self.encode_gib_s)
        if self.decode_gib_s is not None:
            t += raw_bytes / gib_s_to_bytes_per_ms(self.decode_gib_s)
        return t


RAW = WireFormat()


@dataclass(frozen=True)
class TableComms:
    """How one table's pooled-embedding traffic travels, per collective and destination class.

    Attributes:
        fwd: Format of the forward all-to-all (TW, CW, TWCW; RW if ``row_wise_all_to_all``; the
            cross-host hop of TWRW/grid) for cross-host peers, and for every peer unless
            ``fwd_same_host`` is set.
        bwd: Format of the gradient all-to-all, likewise.
        fwd_rs: Format of the forward reduce-scatter (TorchRec's RW; the intra-host hop of
            TWRW/grid).
        bwd_rs: Format of its gradient all-gather.
        note: Why the table travels this way (shown in the printed plan).
        row_wise_all_to_all: RW partial sums travel by the (coded) all-to-all and a local sum,
            priced with ``fwd``/``bwd``: the same bytes as TorchRec's reduce-scatter, coded.
        fwd_same_host: Forward format for same-host peers; None: ``fwd``.
        bwd_same_host: Gradient format for same-host peers; None: ``bwd``.
        own_block_coded: Whether the rank's own block goes through the codec (TorchRec's qcomm
            quantizes the whole tensor; this project's self block skips the codec).
    """

    fwd: WireFormat = RAW
    bwd: WireFormat = RAW
    fwd_rs: WireFormat = RAW
    bwd_rs: WireFormat = RAW
    note: str = ""
    row_wise_all_to_all: bool = False
    fwd_same_host: WireFormat | None = None
    bwd_same_host: WireFormat | None = None
    own_block_coded: bool = True

    def a2a_formats(self, backward: bool) -> tuple[WireFormat, WireFormat, WireFormat]:
        """The all-to-all formats of one direction per destination class.

        Args:
            backward: The gradient all-to-all instead of the forward one.

        Returns:
            ``(cross_host, same_host, own_block)`` formats.
        """
        cross = self.bwd if backward else self.fwd
        same = (self.bwd_same_host if backward else self.fwd_same_host) or cross
        return cross, same, cross if self.own_block_coded else RAW


@dataclass(frozen=True)
class LinkCost:
    """One shard's all-to-all (one direction) priced per destination class.

    Attributes:
        same_host_bytes: Wire bytes for same-host peers and the rank's own block.
        cross_host_bytes: Wire bytes for peers on other hosts.
        same_host_ms: Their transfer time at the intra-host bandwidth.
        cross_host_ms: Their transfer time at the inter-host bandwidth.
        codec_ms: Encode + decode time of the coded classes.
    """

    same_host_bytes: float = 0.0
    cross_host_bytes: float = 0.0
    same_host_ms: float = 0.0
    cross_host_ms: float = 0.0
    codec_ms: float = 0.0

    @property
    def comms_ms(self) -> float:
        """Transfer time of both classes (the links are priced one after the other)."""
        return self.same_host_ms + self.cross_host_ms

    def __add__(self, other: LinkCost) -> LinkCost:
        return LinkCost(
            *(
                a + b
                for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
            )
        )


@dataclass(frozen=True)
class Links:
    """The topology's two bandwidths, for pricing an all-to-all per destination class.

    Attributes:
        intra_bw: Intra-host bandwidth, bytes/ms.
        inter_bw: Inter-host bandwidth per rank, bytes/ms.
    """

    intra_bw: float
    inter_bw: float

    def all_to_all(
        self,
        raw_bytes: float,
        destinations: int,
        same_host_peers: int,
        formats: tuple[WireFormat, WireFormat, WireFormat],
    ) -> LinkCost:
        """Prices ``raw_bytes`` split evenly over ``destinations`` blocks.

        One block is the rank's own, ``same_host_peers`` go to peers on its host (intra-host
        bandwidth, as the own block), the rest to other hosts (inter-host bandwidth). Each
        class travels in its format: its bytes divided by the ratio, plus its codec time.

        Args:
            raw_bytes: The shard's output bytes of one direction, before encoding.
            destinations: Blocks (the collective's world size, the own block included).
            same_host_peers: Destinations on the rank's host, itself excluded.
            formats: ``(cross_host, same_host, own_block)`` formats.

        Returns:
            The per-class cost.
        """
        cross_fmt, same_fmt, own_fmt = formats
        block = raw_bytes / destinations
        same_raw = block * same_host_peers
        cross_raw = block * (destinations - 1 - same_host_peers)
        local_wire = block / own_fmt.ratio + same_raw / same_fmt.ratio
        cross_wire = cross_raw / cross_fmt.ratio
        return LinkCost(
            same_host_bytes=local_wire,
            cross_host_bytes=cross_wire,
            same_host_ms=local_wire / self.intra_bw,
            cross_host_ms=cross_wire / self.inter_bw,
            codec_ms=own_fmt.codec_ms(block)
            + same_fmt.codec_ms(same_raw)
            + cross_fmt.codec_ms(cross_raw),
        )


@runtime_checkable
class CommsModel(Protocol):
    """Maps tables to the way their traffic travels (one scenario of the preview)."""

    name: str
    description: str
    pays_note: str  # where the codec pays on this topology, said once per plan ("" if moot)

    def for_table(self, table: str) -> TableComms:
        """The table's formats.

        Args:
            table: Table name.

        Returns:
            Its :class:`TableComms`.
        """
        ...


@dataclass(frozen=True)
class FixedCommsModel:
    """The same formats for every table: no compression, or one of TorchRec's qcomm codecs.

    Attributes:
        name: Short scenario name.
        description: One line for the printed plan.
        comms: The formats every table gets.
        pays_note: Nothing to say about a codec's break-even (no codec of ours).
    """

    name: str
    description: str
    comms: TableComms
    pays_note: str = ""

    def for_table(self, table: str) -> TableComms:
        """The formats (the same for every table).

        Args:
            table: Table name (unused).

        Returns:
            :attr:`comms`.
        """
        return self.comms


def raw_model() -> FixedCommsModel:
    """Uncompressed traffic: TorchRec's bytes, each all-to-all priced per link like the others.

    Returns:
        The model.
    """
    return FixedCommsModel("none", "no compression (fp32 all-to-all)", TableComms())


def _qcomm_format(precision: str, device: str) -> WireFormat:
    enc, dec = QCOMM_THROUGHPUT_GIB_S[(device, precision)]
    ratio = MX4_RATIO if precision == "mx4" else 2.0
    return WireFormat(precision, ratio, enc, dec)


def qcomm_model(forward: str, backward: str, device: str) -> FixedCommsModel:
    """TorchRec's quantized comms (``QCommsConfig``) as a fixed-ratio model.

    Mirrors TorchRec: the reduce-scatter has no MX4 forward and falls back to FP16, nor an MX4
    backward and falls back to BF16. For FP16/BF16 it prices exactly what TorchRec's planner
    prices with a qcomm codec registry (fp32 traffic / 2); for MX4 it uses the real ratio of
    128/17 = 7.53x, where TorchRec's planner assumes 4x (it prices a 1-byte dtype).

    Args:
        forward: ``"fp16"``, ``"bf16"`` or ``"mx4"``.
        backward: ``"fp16"``, ``"bf16"`` or ``"mx4"`` (``"none"``: fp32 gradients).
        device: ``"cuda"`` or ``"cpu"`` (selects the kernel throughputs).

    Returns:
        The model.
    """
    fwd = _qcomm_format(forward, device)
    bwd = RAW if backward == "none" else _qcomm_format(backward, device)
    fwd_rs = _qcomm_format("fp16", device) if forward == "mx4" else fwd
    bwd_rs = _qcomm_format("bf16", device) if backward == "mx4" else bwd
    desc = f"TorchRec qcomm: forward {forward.upper()}, backward {backward.upper()}"
    return FixedCommsModel(
        f"qcomm-{forward}", desc, TableComms(fwd=fwd, bwd=bwd, fwd_rs=fwd_rs, bwd_rs=bwd_rs)
    )
