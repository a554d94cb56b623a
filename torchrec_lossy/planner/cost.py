"""How each table's embedding traffic travels, as the planner prices it.

A :class:`WireFormat` is one encoding of one direction of traffic: a ratio (raw bytes / wire
bytes) and the encode/decode throughputs that the codec time follows from. A :class:`TableComms`
gives a table its formats for the all-to-all (TW, CW, TWCW; and RW where the row-wise partial
sums travel by all-to-all, as this project sends them) and for TorchRec's reduce-scatter path
(RW, and TWRW/grid, whose cross-host hop this project codes but which are priced as TorchRec's:
the estimate has no split between the hops). A :class:`CommsModel` maps table names to their
:class:`TableComms`: :class:`FixedCommsModel` for uncompressed traffic and TorchRec's qcomm
codecs, :class:`LossyCommsModel` for this project's codec.

Units follow TorchRec's planner: bandwidths in bytes/ms, times in ms; throughputs in the configs
are GiB/s (2**30 bytes/s), as TorchRec's bandwidth constants are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torchrec_lossy.config import LossyPlanConfig

__all__ = [
    "CODEC_THROUGHPUT_GIB_S",
    "MX4_RATIO",
    "QCOMM_THROUGHPUT_GIB_S",
    "CommsModel",
    "FixedCommsModel",
    "LossyCommsModel",
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
    """How one table's pooled-embedding traffic travels, per collective.

    Attributes:
        fwd: Format of the forward all-to-all (TW, CW, TWCW; RW if ``row_wise_all_to_all``).
        bwd: Format of the gradient all-to-all.
        fwd_rs: Format of the forward reduce-scatter path (TorchRec's RW; TWRW, grid).
        bwd_rs: Format of its gradient all-gather.
        note: Why the table travels this way (shown in the printed plan).
        row_wise_all_to_all: RW partial sums travel by the (coded) all-to-all and a local sum,
            priced with ``fwd``/``bwd``: the same bytes as TorchRec's reduce-scatter, coded.
    """

    fwd: WireFormat = RAW
    bwd: WireFormat = RAW
    fwd_rs: WireFormat = RAW
    bwd_rs: WireFormat = RAW
    note: str = ""
    row_wise_all_to_all: bool = False


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
    """Uncompressed traffic: TorchRec's own cost model, unchanged.

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


class LossyCommsModel:
    """This project's codec: per-table ratio and codec throughput.

    A compressed table's forward travels in the lossy format at its expected ratio (calibrated,
    else ``planner.table_ratios``, else ``planner.expected_ratio``), row-wise too (its partial
    sums by the coded all-to-all); TWRW and grid are priced as TorchRec's raw two-hop path (their
    coded cross-host hop is not credited: a conservative price). With
    ``planner.drop_unprofitable`` a table whose codec costs more than it
    saves on the topology's all-to-all bandwidth ``bw`` (``1/R + bw/enc + bw/dec >= 1``) travels
    raw instead.

    The backward is priced the same way when ``comms.backward`` is ``"lossy"``: each table's
    gradient at its expected backward ratio (calibrated, else ``planner.backward_ratio``, against
    TorchRec's dense fp32 gradient) with the codec's throughput, and, with
    ``planner.drop_unprofitable``, raw where the codec would not pay.

    Args:
        config: The plan config.
        a2a_bandwidth: All-to-all bandwidth of the topology in bytes/ms (the break-even test).
        ratios: Calibrated forward ratios by table name (take precedence over the config).
        backward_ratios: Calibrated backward ratios by table name (likewise).
    """

    name = "lossy"

    def __init__(
        self,
        config: LossyPlanConfig,
        a2a_bandwidth: float,
        ratios: Mapping[str, float] | None = None,
        backward_ratios: Mapping[str, float] | None = None,
    ) -> None:
        self.config = config
        self.a2a_bandwidth = a2a_bandwidth
        self.ratios: dict[str, float] = dict(ratios or {})
        self.backward_ratios: dict[str, float] = dict(backward_ratios or {})
        device = config.topology.compute_device
        enc, dec = CODEC_THROUGHPUT_GIB_S[device]
        p = config.planner
        self.encode_gib_s = p.encode_gib_s if p.encode_gib_s is not None else enc
        self.decode_gib_s = p.decode_gib_s if p.decode_gib_s is not None else dec
        comms = config.comms
        bwd_kind = comms.backward
        if bwd_kind == "lossy":
            self._bwd: WireFormat = WireFormat(
                "lossy", p.backward_ratio, self.encode_gib_s, self.decode_gib_s
            )
        elif bwd_kind in ("fp16", "bf16"):
            enc_q, dec_q = QCOMM_THROUGHPUT_GIB_S[(device, bwd_kind)]
            self._bwd = WireFormat(bwd_kind, 2.0, enc_q, dec_q)
        else:
            self._bwd = RAW
        self.description = (
            f"torchrec-lossy: forward lossy ({comms.default_bound.mode} "
            f"{comms.default_bound.value:g} default), backward {bwd_kind}; codec "
            f"{self.encode_gib_s:.3g}/{self.decode_gib_s:.3g} GiB/s encode/decode"
        )
        self.pays_note = self._pays_note()

    def _pays_note(self) -> str:
        """Where the codec pays on this topology, said once for the whole plan."""
        codec_share = self.break_even(math.inf)  # bw/enc + bw/dec
        drop = self.config.planner.drop_unprofitable
        fate = "those tables are sent raw" if drop else "planner.drop_unprofitable is off"
        if codec_share >= 1.0:
            return (
                f"the codec does not pay on this all-to-all: its time alone is {codec_share:.2f} "
                f"of the raw transfer's at any ratio; {fate}"
            )
        return (
            f"the codec pays on this all-to-all for ratios above {1 / (1 - codec_share):.2f}x "
            f"(1/R + bw/enc + bw/dec < 1)" + ("" if drop else f"; {fate} for the others")
        )

    def ratio(self, table: str) -> float:
        """The table's expected forward ratio.

        Args:
            table: Table name.

        Returns:
            Calibrated ratio if any, else the config's.
        """
        return self.ratios.get(table, self.config.planner.ratio(table))

    def backward_format(self, table: str) -> WireFormat:
        """The table's gradient wire format: the codec at its expected backward ratio (raw
        where ``planner.drop_unprofitable`` finds it does not pay), or the configured cast.

        Args:
            table: Table name.

        Returns:
            Its backward :class:`WireFormat`.
        """
        if self._bwd.name != "lossy" or not self.config.comms.table(table).compress:
            return self._bwd if self._bwd.name != "lossy" else RAW
        r = self.backward_ratios.get(table, self.config.planner.backward_ratio)
        if self.config.planner.drop_unprofitable and self.break_even(r) >= 1.0:
            return RAW
        return WireFormat("lossy", r, self.encode_gib_s, self.decode_gib_s)

    def break_even(self, ratio: float) -> float:
        """``1/R + bw/enc + bw/dec``: the codec pays on the all-to-all iff this is below 1.

        Args:
            ratio: Compression ratio ``R``.

        Returns:
            The compressed transfer time as a fraction of the raw one.
        """
        bw = self.a2a_bandwidth
        return (
            1.0 / ratio
            + bw / gib_s_to_bytes_per_ms(self.encode_gib_s)
            + bw / gib_s_to_bytes_per_ms(self.decode_gib_s)
        )

    def for_table(self, table: str) -> TableComms:
        """The table's formats under the config (see the class docstring).

        Args:
            table: Table name.

        Returns:
            Its :class:`TableComms`.
        """
        bwd = self.backward_format(table)
        if not self.config.comms.table(table).compress:
            return TableComms(RAW, bwd, note="compress: false in the config")
        r = self.ratio(table)
        cost = self.break_even(r)
        source = "calibrated" if table in self.ratios else "configured"
        # Whether the codec pays is said once (pays_note); each table gives its own numbers.
        if cost >= 1.0 and self.config.planner.drop_unprofitable:
            note = f"sent raw: ratio {r:.1f}x ({source}) would take {cost:.2f} of raw time"
            return TableComms(RAW, bwd, note=note, row_wise_all_to_all=True)
        note = f"ratio {r:.1f}x ({source}), all-to-all at {cost:.2f} of raw time"
        fwd = WireFormat("lossy", r, self.encode_gib_s, self.decode_gib_s)
        return TableComms(fwd, bwd, note=note, row_wise_all_to_all=True)
