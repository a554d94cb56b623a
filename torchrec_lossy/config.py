"""Validated configuration dataclasses, loaded from and saved to YAML.

Every dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError` naming the
key, the bad value and the allowed range. :func:`from_dict` builds any of them from plain
dicts (YAML), rejecting unknown keys and wrong types with the dotted key path in the message.

This module imports neither torch nor torchrec, so the codec, the planner and the example can all
share it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

T = TypeVar("T")

Backend = Literal["auto", "cpu", "triton", "reference"]


class BoundKind(IntEnum):
    """What a block's bound value means, carried per block to the codec; ``ErrorBound.mode``
    names it in lower case, so a new kind is named here only.

    Attributes:
        ABSOLUTE: ``|x' - x| <= value``.
        RELATIVE: ``|x' - x| <= value * (max - min)`` of the block's finite elements.
        VALUE: ``|x' - x| <= value * |x|`` for every element (the per-value grid).
    """

    ABSOLUTE = 0
    RELATIVE = 1
    VALUE = 2

    @classmethod
    def of(cls, mode: str) -> BoundKind:
        """The kind of an ``ErrorBound.mode`` name.

        Args:
            mode: ``"absolute"``, ``"relative"`` or ``"value"``.

        Returns:
            The kind.
        """
        return cls[mode.upper()]

    @property
    def max_value(self) -> float:
        """The largest bound value of this kind (:data:`_MAX_BOUND_VALUES`)."""
        return _MAX_BOUND_VALUES.get(self, float("inf"))

    @property
    def nearest_only(self) -> bool:
        """True for a grid without stochastic rounding (the per-value grid)."""
        return self == BoundKind.VALUE

    @property
    def label(self) -> str:
        """The kind as messages name it."""
        return "per-value" if self == BoundKind.VALUE else self.name.lower()


# A relative bound spans at most the block's range, a per-value bound keeps at least one
# mantissa bit; an absolute bound has no limit.
_MAX_BOUND_VALUES = {BoundKind.RELATIVE: 1.0, BoundKind.VALUE: 0.5}
BoundMode = Literal[tuple(kind.name.lower() for kind in BoundKind)]  # ErrorBound.mode's names
EvaluationMode = Literal["exact", "lossy"]
IntraHost = Literal["auto", "coded", "raw"]
OverlapMode = Literal["never", "auto"]
BackwardCodec = Literal["none", "fp16", "bf16", "lossy"]
Rounding = Literal["nearest", "stochastic"]
CodecFormat = Literal["entropy", "packed"]
ScheduleKind = Literal["step", "linear", "log", "constant"]
WeightsCast = Literal["none", "fp16", "bf16"]
# The forward's wire format: "auto" lets the planner pick per table and link class
# (torchrec_lossy/planner/formats.py); "entropy" / "packed" are the lossy codec in that
# CodecConfig.format.
CommsFormat = Literal["auto", "raw", "fp16", "bf16", "entropy", "packed"]
# The formats that cast each block to fp16 / bf16 where its bound admits the cast (else the
# block travels exactly): distributed/cast_blocks.py.
CAST_FORMATS: frozenset[str] = frozenset({"fp16", "bf16"})
# The comms formats that are the codec, by its CodecConfig.format.
CODEC_FORMATS: frozenset[str] = frozenset(get_args(CodecFormat))


def _check_format(key: str, value: object) -> None:
    _check_literal(key, value, CommsFormat)


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range."""


def _require(ok: bool, key: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: allowed {allowed}")


def _check_literal(key: str, value: object, literal: object) -> None:
    options = get_args(literal)
    _require(value in options, key, value, "one of " + ", ".join(repr(o) for o in options))


@dataclass(frozen=True)
class CodecConfig:
    """Knobs of the lossy codec itself (not of the error bounds).

    Attributes:
        huffman_chunk_symbols: Symbols per independently decodable Huffman chunk. Smaller chunks
            decode with more parallelism on a GPU at the cost of 4 bytes of offset per chunk.
        enable_quantization: Allow the quantize stage. Off: blocks travel raw (or deduplicated
            raw), i.e. losslessly.
        enable_lz: Allow the vector-LZ stage (whole repeated vectors sent once).
        backend: ``"auto"``: CUDA tensors run device-resident through the Triton kernels
            (all blocks at once, one host sync per compress; docs/kernels.md) when triton is
            installed, CPU tensors through the compiled (numba) CPU path. ``"cpu"``: always the
            CPU path (CUDA tensors staged through host memory). ``"triton"``: always the
            device-resident Triton path (on CPU tensors under ``TRITON_INTERPRET=1``: slow, for
            tests). ``"reference"``: the same device orchestration over the Triton kernels'
            plain torch twins (``kernels/*_ref.py``) on any device, without triton (the test
            oracle; slow). All produce byte-identical payloads and decode every payload.
        rounding: ``"nearest"``: codes round to nearest on a grid of step ``2 * bound``.
            ``"stochastic"``: unbiased stochastic rounding on a grid of step ``bound``
            (``E[x'] = x``; still ``|x - x'| <= bound``), drawn from a counter-based hash of
            (``seed``, block index, element index): deterministic, the same on every backend.
        seed: Base seed of stochastic rounding (any integer). The sharder draws each
            all-to-all afresh from (seed, call, sending rank); a direct codec call uses it as
            given (vary it per call, e.g. per step).
        format: How quantized values are coded (docs/format.md). ``"entropy"``: one
            canonical Huffman code per block (the smallest payloads; slow links).
            ``"packed"``: fixed-width zigzag codes per group of 32 values, one width byte per
            group (every group encodes and decodes on its own: fast on CPU and GPU, ~17%
            larger). Same quantization, dedupe, escapes and guarantee; every decoder reads
            both. The device backends write packed payloads through the compiled host path
            for now (no Triton kernel yet).
    """

    huffman_chunk_symbols: int = 2048
    enable_quantization: bool = True
    enable_lz: bool = True
    backend: Backend = "auto"
    rounding: Rounding = "nearest"
    seed: int = 0
    format: CodecFormat = "entropy"

    def __post_init__(self) -> None:
        n = self.huffman_chunk_symbols
        _require(
            isinstance(n, int) and 64 <= n <= 1 << 20 and n % 32 == 0,
            "codec.huffman_chunk_symbols",
            n,
            "a multiple of 32 in [64, 1048576]",
        )
        _check_literal("codec.backend", self.backend, Backend)
        _check_literal("codec.rounding", self.rounding, Rounding)
        _check_literal("codec.format", self.format, CodecFormat)
        _require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool),
            "codec.seed",
            self.seed,
            "an integer",
        )


@dataclass(frozen=True)
class ErrorBound:
    """An error bound for one table's embedding traffic.

    Attributes:
        mode: ``"relative"``: the absolute bound of each block is ``value * (max - min)`` of that
            block (the paper's definition); ``"absolute"``: ``value`` itself; ``"value"``: per
            value, ``|x' - x| <= value * |x|`` for every finite element (checked in float64;
            zeros, NaN and Inf exact), on a grid keeping m mantissa bits of each float32, the
            least m with ``2**-(m + 1) <= value``: the effective bound is ``2**-(m + 1)``
            (0.0156 for 0.03). Rounds to nearest only (``codec.rounding: stochastic`` is
            refused with it).
        value: The bound; 0 means lossless.
    """

    mode: BoundMode = "relative"
    value: float = 0.01

    def __post_init__(self) -> None:
        _check_literal("bound.mode", self.mode, BoundMode)
        v = self.value
        _require(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v < float("inf"),
            "bound.value",
            v,
            "a finite number >= 0",
        )
        kind = BoundKind.of(self.mode)
        _require(
            v <= kind.max_value,
            "bound.value",
            v,
            f"<= {kind.max_value:g} for a {kind.label} bound (0: lossless)",
        )


@dataclass(frozen=True)
class TableCodecConfig:
    """Per-table override, matched by table name or glob in :class:`LossyCommsConfig`.

    Attributes:
        bound: Error bound of this table's forward traffic; None keeps the default.
        compress: False sends this table uncompressed (as ``format: raw``).
        format: This table's wire format; None keeps ``LossyCommsConfig.format``.
    """

    bound: ErrorBound | None = None
    compress: bool = True
    format: CommsFormat | None = None

    def __post_init__(self) -> None:
        if self.format is not None:
            _check_format("tables.format", self.format)


# The gradient all-to-all's default error model (issue 32, chosen by the paired runs of
# docs/accuracy.md): per value, |x' - x| <= |x| / 32 for every element, so a gradient row is
# bounded by its own scale, not by the largest row of its block (the old default, relative
# 0.01 of each block's range, left a tail of damaged seeds).
DEFAULT_BACKWARD_BOUND = ErrorBound("value", 0.03125)


@dataclass(frozen=True)
class ErrorBoundSchedule:
    """Iteration-wise decay: the bound is multiplied by a factor from ``start_factor`` down to 1.

    Attributes:
        kind: ``"step"`` (``steps`` equal steps), ``"linear"``, ``"log"`` or ``"constant"``
            (factor 1 throughout).
        start_factor: C, the factor at iteration 0.
        decay_iterations: E, the iteration at which the factor reaches 1 and stays there.
        steps: Number of equal steps for ``kind="step"``.
    """

    kind: ScheduleKind = "step"
    start_factor: float = 2.0
    decay_iterations: int = 65536
    steps: int = 10

    def __post_init__(self) -> None:
        _check_literal("schedule.kind", self.kind, ScheduleKind)
        _require(
            1.0 <= self.start_factor <= 1000.0,
            "schedule.start_factor",
            self.start_factor,
            "[1, 1000]",
        )
        _require(
            isinstance(self.decay_iterations, int) and self.decay_iterations >= 1,
            "schedule.decay_iterations",
            self.decay_iterations,
            "an integer >= 1",
        )
        _require(
            isinstance(self.steps, int) and 1 <= self.steps <= self.decay_iterations,
            "schedule.steps",
            self.steps,
            "an integer in [1, decay_iterations]",
        )


@dataclass(frozen=True)
class HomogenizationConfig:
    """Table-wise bound classes from the homogenization index (see torchrec_lossy.adaptive).

    Attributes:
        enabled: Assign bounds by class; off: every table uses its configured bound.
        class_bounds: Relative bounds of the classes tight, base and loose.
        thresholds: Index thresholds (low, high): index < low is tight, index >= high is loose.
            The defaults are calibrated on Criteo-like traffic (docs/adaptive.md).
        hysteresis: A table changes class only once the index passes a threshold by this margin.
        update_period: Iterations between index updates.
        sample_rows: Rows per index window; the index depends on the window size, so it is
            measured on a fixed number of rows (strided from larger blocks, gathered over
            consecutive iterations from smaller ones).
        smoothing: Weight of the newest window in the index's running average (1: no memory).
        warmup_windows: Windows averaged with equal weight before the running average turns
            exponential; until then a table's class is provisional (set without hysteresis),
            so that the noise of the first windows cannot lock it into the wrong class.
    """

    enabled: bool = False
    class_bounds: tuple[float, float, float] = (0.01, 0.03, 0.05)
    thresholds: tuple[float, float] = (0.425, 0.715)
    hysteresis: float = 0.05
    update_period: int = 100
    sample_rows: int = 1024
    smoothing: float = 0.25
    warmup_windows: int = 16

    def __post_init__(self) -> None:
        cb = tuple(self.class_bounds)
        _require(
            len(cb) == 3 and all(0.0 < b <= 1.0 for b in cb) and cb[0] <= cb[1] <= cb[2],
            "homogenization.class_bounds",
            cb,
            "three increasing relative bounds in (0, 1]",
        )
        th = tuple(self.thresholds)
        _require(
            len(th) == 2 and 0.0 <= th[0] < th[1] <= 1.0,
            "homogenization.thresholds",
            th,
            "(low, high) with 0 <= low < high <= 1",
        )
        _require(
            0.0 <= self.hysteresis < 0.5, "homogenization.hysteresis", self.hysteresis, "[0, 0.5)"
        )
        _require(
            isinstance(self.update_period, int) and self.update_period >= 1,
            "homogenization.update_period",
            self.update_period,
            "an integer >= 1",
        )
        _require(
            isinstance(self.sample_rows, int) and 16 <= self.sample_rows <= 1 << 20,
            "homogenization.sample_rows",
            self.sample_rows,
            "an integer in [16, 1048576]",
        )
        _require(0.0 < self.smoothing <= 1.0, "homogenization.smoothing", self.smoothing, "(0, 1]")
        _require(
            isinstance(self.warmup_windows, int) and 1 <= self.warmup_windows <= 1 << 20,
            "homogenization.warmup_windows",
            self.warmup_windows,
            "an integer in [1, 1048576]",
        )
        object.__setattr__(self, "class_bounds", cb)
        object.__setattr__(self, "thresholds", th)


@dataclass(frozen=True)
class InputDistConfig:
    """The lossless codec of the KJT (ids, lengths, weights) input all-to-all.

    Attributes:
        enabled: Pack the table-, column- and table-column-wise input dists (ids and lengths
            bit-packed, bit-exact on the receiver); off: TorchRec's ``KJTAllToAll``.
        dedupe: Per feature and destination, send each distinct id once plus an inverse index
            whenever that is smaller; exact (the receiver rebuilds the same KJT).
        weights: Per-id weights travel as they are (``"none"``) or cast to fp16/bf16 on the
            wire (lossy: only when asked).
        dedupe_outputs: Exact cross-side deduplication (see docs/input_dist.md): for features
            whose bags hold at most one id and no weights, the output dist sends the pooled row
            of each distinct id (and of the empty bag) once per destination and the receiver
            expands it with the inverse index it built when it sent the ids; lookups and the
            backward are TorchRec's, so training is bit-identical. Needs ``enabled``. For an
            ``EmbeddingCollection`` (either input dist): the sequence all-to-all sends one row
            per distinct id per (destination, table), the gradient per ``backward_dedupe``.
        dedupe_lookups: The variant that also cuts lookup work, for unweighted single-hot
            features: only distinct ids travel and the owner looks up each once per source;
            gradients are summed per distinct id first (equal within float rounding, not
            bit-identical). Takes precedence over ``dedupe_outputs``.
        checksum: End every payload with a 64-bit checksum that the receiver verifies
            (``LossyAllToAllError`` naming the source on a mismatch); 8 bytes per
            (source, destination) and, on CUDA, one more host read per call.
    """

    enabled: bool = True
    dedupe: bool = True
    weights: WeightsCast = "none"
    dedupe_outputs: bool = True
    dedupe_lookups: bool = False
    checksum: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.enabled, bool), "input_dist.enabled", self.enabled, "a bool")
        _require(isinstance(self.dedupe, bool), "input_dist.dedupe", self.dedupe, "a bool")
        _check_literal("input_dist.weights", self.weights, WeightsCast)
        _require(isinstance(self.checksum, bool), "input_dist.checksum", self.checksum, "a bool")
        _require(
            isinstance(self.dedupe_outputs, bool),
            "input_dist.dedupe_outputs",
            self.dedupe_outputs,
            "a bool",
        )
        _require(
            isinstance(self.dedupe_lookups, bool),
            "input_dist.dedupe_lookups",
            self.dedupe_lookups,
            "a bool",
        )


@dataclass(frozen=True)
class GuardConfig:
    """The guard (issue 32): it tightens a table's bound in one direction when the error
    sample finds that table's error past the level (``error_sample.ROW_ENERGY_LEVEL``), the
    same on every rank (docs/accuracy.md, "The guard").

    Rule: every ``check_every`` training steps (``step_lossy_bounds``) the ranks start an
    all-reduce of which (direction, table) pairs any of them saw past the level since the last
    check; at the end of the next step each such pair takes one tightening on every rank: its
    ``k``-th multiplies the bound's value by
    ``factor ** k`` (same mode, so never looser than the bound set), and its
    ``max_tightenings``-th makes it exact (value 0). Only the backward is alerted on energy
    (the forward's block bounds pass the level harmlessly), and NaN / Inf alerts are
    reported, not acted on (they travel exactly).

    Attributes:
        enabled: Tighten on alerts (off, the default: alerts are only reported).
        factor: What each tightening multiplies the bound's value by, in (0, 1).
        max_tightenings: The tightening that makes the pair exact (>= 1; 1: exact at once).
        check_every: Training steps between the collective decisions (>= 1).
    """

    enabled: bool = False
    factor: float = 0.5
    max_tightenings: int = 4
    check_every: int = 16

    def __post_init__(self) -> None:
        _require(isinstance(self.enabled, bool), "guard.enabled", self.enabled, "true or false")
        f = self.factor
        _require(
            isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 < f < 1.0,
            "guard.factor",
            f,
            "a number in (0, 1) (0.5 halves the bound at each tightening)",
        )
        for key, n in (
            ("guard.max_tightenings", self.max_tightenings),
            ("guard.check_every", self.check_every),
        ):
            _require(
                isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1 << 20,
                key,
                n,
                "an integer in [1, 1048576]",
            )


@dataclass(frozen=True)
class LossyCommsConfig:
    """Everything the lossy sharder needs: codec knobs, bounds, backward codec, adaptivity.

    Attributes:
        codec: Codec knobs.
        default_bound: Forward bound of every table without an override.
        tables: Overrides keyed by table name or glob (``fnmatch``), first match wins.
        backward: Codec of the gradient all-to-all: ``"lossy"`` (the codec with
            ``backward_bound`` and ``backward_rounding``, the default), ``"none"`` (exact),
            ``"fp16"``/``"bf16"`` (casts).
        backward_bound: Bound of the gradient traffic when ``backward="lossy"`` (relative: to
            each (source, table) block's value range).
        backward_rounding: Rounding of the gradient codec: ``"nearest"`` (grid step 2 x bound;
            the default: in the paired accuracy runs it kept AUC and cost 25-30% fewer bytes
            than stochastic rounding, docs/benchmarks.md) or ``"stochastic"`` (unbiased, so the
            optimizer's expected update is exact; grid step = bound).
        backward_seed: Base seed of the stochastic rounding (each call draws from
            (seed, call, sending rank); blocks by their index in their payload).
        backward_dedupe: Under the exact output dedupe, send the gradient one row per distinct
            bag (summed over its copies; an ``EmbeddingCollection``: per distinct id); exact up
            to float summation order. The lookup dedupe always does.
        error_sample_every: Every this many calls of each direction (forward, backward), the
            sender decodes its own lossy payloads to record error statistics
            (``TableCommStats.mean_signed_error``, ``relative_rms_error``, ``snapped_share``;
            on the device path decoded and summed on the device, recorded at the module's
            next host read: no read of its own); 0: never.
        evaluation: The forward all-to-all while the sharded module is in ``eval()`` mode:
            ``"exact"`` (the default: lossless, so an evaluation measures the model, not the
            codec; the exact output dedupe and the lossless input codec still apply) or
            ``"lossy"`` (each table's training bound, as in training).
        intra_host: Blocks for peers on the same host: ``"auto"`` (raw on a NCCL group, where
            NVLink outruns any codec; coded on gloo), ``"raw"`` or ``"coded"`` (forced). Blocks
            for other hosts are always coded.
        local_world_size: Ranks per host (consecutive global ranks); None: torchrun's
            ``LOCAL_WORLD_SIZE``, else all ranks on one host.
        overlap: Coding overlapped with the wire on the host path (``distributed/
            exchange_chunks.py``): ``"never"`` (the default: one all-to-all of slots per coded
            exchange) or ``"auto"`` (a ring of rounds, one per peer, where the group spans hosts,
            has at least two peers per rank and at least 256 KiB nominal per rank; measured
            faster on a 200 Mbit/s link, slower at 1 Gbit/s on a loaded machine:
            docs/benchmarks.md). Decoded bits are the same either way.
        schedule: Iteration-wise decay of the forward bounds.
        homogenization: Table-wise bound classes.
        input_dist: Lossless codec of the KJT input all-to-all.
        format: Wire format of every table without its own: ``"auto"`` (the default: the
            planner picks per table and link class the format of least estimated time among
            those within the table's bound, docs/config.md; a sharder built without the planner
            sends ``"entropy"``), ``"raw"`` (fp32, as TorchRec), ``"fp16"`` / ``"bf16"``
            (each block cast where its bound admits the cast, else exact:
            distributed/cast_blocks.py), ``"entropy"`` (the lossy codec) or ``"packed"`` (the
            codec in its packed format: ``codec.format`` follows; one codec format per run).
            Applies to the gradient too (with ``backward: lossy``): a raw table's gradient
            travels raw, a cast table's cast where ``backward_bound`` admits it.
    """

    codec: CodecConfig = field(default_factory=CodecConfig)
    default_bound: ErrorBound = field(default_factory=ErrorBound)
    tables: dict[str, TableCodecConfig] = field(default_factory=dict)
    backward: BackwardCodec = "lossy"
    backward_bound: ErrorBound = field(default_factory=lambda: DEFAULT_BACKWARD_BOUND)
    backward_rounding: Rounding = "nearest"
    backward_seed: int = 0
    backward_dedupe: bool = True
    error_sample_every: int = 16
    evaluation: EvaluationMode = "exact"
    intra_host: IntraHost = "auto"
    local_world_size: int | None = None
    overlap: OverlapMode = "never"
    schedule: ErrorBoundSchedule = field(
        default_factory=lambda: ErrorBoundSchedule(kind="constant")
    )
    homogenization: HomogenizationConfig = field(default_factory=HomogenizationConfig)
    input_dist: InputDistConfig = field(default_factory=InputDistConfig)
    format: CommsFormat = "auto"
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        _check_format("format", self.format)
        self._resolve_codec_format()
        _check_literal("backward", self.backward, BackwardCodec)
        self._check_value_rounding()
        _check_literal("backward_rounding", self.backward_rounding, Rounding)
        _check_literal("evaluation", self.evaluation, EvaluationMode)
        _check_literal("intra_host", self.intra_host, IntraHost)
        _check_literal("overlap", self.overlap, OverlapMode)
        lws = self.local_world_size
        _require(
            lws is None or (isinstance(lws, int) and not isinstance(lws, bool) and lws >= 1),
            "local_world_size",
            lws,
            "null or an integer >= 1",
        )
        _require(
            isinstance(self.backward_seed, int) and not isinstance(self.backward_seed, bool),
            "backward_seed",
            self.backward_seed,
            "an integer",
        )
        _require(
            isinstance(self.backward_dedupe, bool),
            "backward_dedupe",
            self.backward_dedupe,
            "true or false",
        )
        n = self.error_sample_every
        _require(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0,
            "error_sample_every",
            n,
            "an integer >= 0 (0: never)",
        )
        _require(
            not (self.guard.enabled and n == 0),
            "error_sample_every",
            n,
            "an integer >= 1 with guard.enabled (the guard acts on the error sample), or "
            "guard.enabled: false",
        )

    def same_host_raw(self, backend: str) -> bool:
        """Whether blocks for same-host peers skip the codec on a group of ``backend``.

        Args:
            backend: The process group's backend (``"nccl"``, ``"gloo"``, ...).

        Returns:
            True for ``intra_host="raw"``, and for ``"auto"`` on NCCL (NVLink outruns the codec).
        """
        mode = self.intra_host
        return mode == "raw" or (mode == "auto" and backend == "nccl")

    def _resolve_codec_format(self) -> None:
        """The codec format named by ``format`` (or a table's) and ``codec.format`` agree.

        ``format: packed`` runs the codec in its packed format, so ``codec.format`` (default
        ``entropy``) follows it; naming ``entropy`` and ``packed`` together, or ``format:
        entropy`` with ``codec.format: packed``, is refused: the codec's format is per call, and
        one call carries every coded table of a destination.
        """
        named = {self.format} | {t.format for t in self.tables.values() if t.format is not None}
        coded = sorted(named & CODEC_FORMATS)
        _require(
            len(coded) <= 1,
            "format",
            "/".join(coded),
            "one codec format per run: 'entropy' or 'packed' for every coded table (the "
            "codec's format is per call, which carries every table of a destination)",
        )
        if not coded or coded[0] == self.codec.format:
            return
        _require(
            coded[0] == "packed",
            "format",
            coded[0],
            "'packed' or 'auto' with codec.format 'packed' (or drop codec.format)",
        )
        object.__setattr__(self, "codec", dataclasses.replace(self.codec, format="packed"))

    def _check_value_rounding(self) -> None:
        """Refuses per-value bounds with stochastic rounding (the per-value grid rounds to
        nearest only), naming the bound and the fix."""
        rounding = ("codec.rounding", self.codec.rounding)
        checks = [("default_bound", self.default_bound, *rounding)]
        checks += [
            (f"tables.{k}.bound", t.bound, *rounding)
            for k, t in self.tables.items()
            if t.bound is not None
        ]
        checks.append(
            ("backward_bound", self.backward_bound, "backward_rounding", self.backward_rounding)
        )
        for key, eb, rounding_key, rounds in checks:
            _require(
                not (BoundKind.of(eb.mode).nearest_only and rounds == "stochastic"),
                key,
                f"{eb.mode}:{eb.value}",
                f"a relative or absolute bound with {rounding_key} 'stochastic' (the per-value "
                f"grid rounds to nearest only), or {rounding_key} 'nearest'",
            )

    def table(self, name: str) -> TableCodecConfig:
        """The effective settings of one table (its first matching override, else defaults).

        Args:
            name: Table name.

        Returns:
            The table's config with ``bound`` and ``format`` always set; ``compress`` (through
            the codec) is False where the format is ``"raw"``, ``"fp16"`` or ``"bf16"``, and
            ``format`` is ``"raw"`` where the config's ``compress`` is False (the seam reads
            ``compress`` and the cast formats, the planner ``format``).
        """
        for pattern, override in self.tables.items():
            if fnmatch.fnmatchcase(name, pattern):
                bound = override.bound if override.bound is not None else self.default_bound
                fmt = override.format if override.format is not None else self.format
                return _resolved_table(bound, override.compress, fmt)
        return _resolved_table(self.default_bound, True, self.format)


def _resolved_table(bound: ErrorBound, compress: bool, fmt: str) -> TableCodecConfig:
    raw = not compress or fmt == "raw"
    coded = not raw and fmt not in CAST_FORMATS  # a cast table's blocks skip the codec
    return TableCodecConfig(bound=bound, compress=coded, format="raw" if raw else fmt)  # type: ignore[arg-type]


def _type_name(tp: object) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Converts a plain YAML value to ``tp``, raising ConfigError with the key path on mismatch."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        _require(isinstance(value, Mapping), key, value, f"a mapping for {_type_name(tp)}")
        return from_dict(tp, value, key)
    if origin is Literal:
        _check_literal(key, value, tp)
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if origin is dict:
        _require(isinstance(value, Mapping), key, value, "a mapping")
        kt, vt = get_args(tp)
        return {
            _convert(k, kt, f"{key}.{k}"): _convert(v, vt, f"{key}.{k}") for k, v in value.items()
        }
    if origin is tuple:
        args = get_args(tp)
        _require(isinstance(value, (list, tuple)), key, value, f"a list of {len(args)} values")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        _require(len(value) == len(args), key, value, f"exactly {len(args)} values")
        return tuple(
            _convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if origin is list:
        (et,) = get_args(tp)
        _require(isinstance(value, (list, tuple)), key, value, "a list")
        return [_convert(v, et, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _require(ok, key, value, "a number")
        return float(value)
    if tp is int:
        _require(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        return value
    if tp is bool:
        _require(isinstance(value, bool), key, value, "true or false")
        return value
    if tp is str:
        _require(isinstance(value, str), key, value, "a string")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


# Keys of older configs, and what replaced them (the message of a config that still has one).
REPLACED_KEYS: dict[str, str] = {
    "planner.drop_unprofitable": (
        "remove it; comms.format decides (auto, the default: per table and link the fastest "
        "format within the bound, raw where the codec does not pay; entropy: always the codec, "
        "as drop_unprofitable: false did)"
    ),
}


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Builds a config dataclass from a plain mapping, validating keys, types and ranges.

    Args:
        cls: The dataclass type.
        data: Plain values, e.g. parsed YAML.
        prefix: Dotted key path of ``data`` (for error messages).

    Returns:
        The validated instance.

    Raises:
        ConfigError: On an unknown key, a wrong type or an out-of-range value.
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        for k in unknown:
            if f"{where}{k}" in REPLACED_KEYS:
                raise ConfigError(f"{where}{k} was replaced: {REPLACED_KEYS[where + str(k)]}")
        raise ConfigError(
            f"unknown key(s) {', '.join(where + str(k) for k in unknown)}: "
            f"allowed keys are {', '.join(sorted(names))}"
        )
    kwargs = {
        name: _convert(value, hints[name], f"{prefix}.{name}" if prefix else name)
        for name, value in data.items()
    }
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{prefix}: {e}" if prefix else str(e)) from None


def to_dict(config: object) -> dict[str, Any]:
    """Plain-value form of a config dataclass (tuples as lists), ready for YAML.

    Args:
        config: A config dataclass instance.

    Returns:
        Nested dicts, lists and scalars.
    """

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(config)


def load_yaml(cls: type[T], path: str | Path, section: str | None = None) -> T:
    """Loads a config dataclass from a YAML file (optionally one top-level section of it).

    Args:
        cls: The dataclass type.
        path: YAML file.
        section: Top-level key to read; None reads the whole file.

    Returns:
        The validated instance.

    Raises:
        ConfigError: The file cannot be read, is not YAML, or holds a bad value; the message
            names the file, where and the fix.
    """
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(
            f"{path}: cannot read it ({e.strerror}): pass an existing YAML file"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {_yaml_problem(e)}: fix the YAML syntax") from None
    if section is not None:
        data = data.get(section, {}) or {}
    _require(isinstance(data, Mapping), str(path), type(data).__name__, "a mapping at top level")
    try:
        return from_dict(cls, data, section or "")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML parse error in one line: where and what (PyYAML's own text spans several)."""
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
    problem = getattr(error, "problem", None) or type(error).__name__
    context = getattr(error, "context", None)
    return f"not valid YAML at {where}: {problem}" + (f" ({context})" if context else "")


def save_yaml(config: object, path: str | Path) -> None:
    """Writes a config dataclass to YAML.

    Args:
        config: A config dataclass instance.
        path: Destination file.
    """
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(config), f, sort_keys=False)


# ------------------------------------------------------------------------------------------------
# Planner config: the one file a user edits (configs/*.yaml, documented in docs/config.md)
# ------------------------------------------------------------------------------------------------

ComputeDevice = Literal["cuda", "cpu"]


def _positive_or_none(key: str, value: float | None, upper: float) -> None:
    if value is None:
        return
    _require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= upper,
        key,
        value,
        f"a number in (0, {upper:g}] or null for TorchRec's default",
    )


@dataclass(frozen=True)
class TopologyConfig:
    """Cluster facts for the planner; null fields keep TorchRec's defaults.

    Attributes:
        world_size: Ranks (GPUs or CPU processes).
        local_world_size: Ranks per host; null: all ranks on one host.
        compute_device: ``"cuda"`` or ``"cpu"``: TorchRec's cost model and memory kind (HBM or
            DDR). Planning needs no such device.
        hbm_cap_gib: HBM per rank in GiB (TorchRec default 32).
        ddr_cap_gib: Host memory per rank in GiB (TorchRec default 128).
        intra_host_bandwidth_gib_s: Bandwidth within a host, GiB/s (TorchRec default 600).
        inter_host_bandwidth_gib_s: Bandwidth across hosts per rank, GiB/s (TorchRec default
            12.5).
    """

    world_size: int = 2
    local_world_size: int | None = None
    compute_device: ComputeDevice = "cuda"
    hbm_cap_gib: float | None = None
    ddr_cap_gib: float | None = None
    intra_host_bandwidth_gib_s: float | None = None
    inter_host_bandwidth_gib_s: float | None = None

    def __post_init__(self) -> None:
        w = self.world_size
        _require(
            isinstance(w, int) and 1 <= w <= 65536,
            "topology.world_size",
            w,
            "an integer in [1, 65536]",
        )
        lw = self.local_world_size
        _require(
            lw is None or (isinstance(lw, int) and 1 <= lw <= w and w % lw == 0),
            "topology.local_world_size",
            lw,
            f"null or a divisor of world_size={w}",
        )
        _check_literal("topology.compute_device", self.compute_device, ComputeDevice)
        _positive_or_none("topology.hbm_cap_gib", self.hbm_cap_gib, 1 << 20)
        _positive_or_none("topology.ddr_cap_gib", self.ddr_cap_gib, 1 << 20)
        _positive_or_none(
            "topology.intra_host_bandwidth_gib_s", self.intra_host_bandwidth_gib_s, 1e6
        )
        _positive_or_none(
            "topology.inter_host_bandwidth_gib_s", self.inter_host_bandwidth_gib_s, 1e6
        )


@dataclass(frozen=True)
class PlannerConfig:
    """How the compression-aware planner prices the lossy codec.

    Attributes:
        global_batch_size: Samples per step over all ranks; null: TorchRec's default of 512 per
            rank.
        expected_ratio: Forward compression ratio (raw bytes / wire bytes) assumed for a table
            without a calibrated or per-table ratio.
        table_ratios: Per-table expected ratios by table name or glob (first match wins).
        backward_ratio: Ratio (TorchRec's dense fp32 gradient bytes / wire bytes) assumed for a
            table's gradient traffic without a calibrated one when ``comms.backward`` is
            ``"lossy"`` (gradient dedupe + the codec). Measured 37.6x in the example's default run
            (dim 16, 2 ranks, docs/example.md) and 35x in ``benchmarks/input_dist_bench.py``;
            10 is conservative.
        encode_gib_s: Codec encode throughput in GiB/s of raw input; null: the device default
            (cuda 200, the paper's Huffman encoder; cpu 1.4, the compiled host encoder).
        decode_gib_s: Codec decode throughput; null: the device default (cuda 60; cpu 1.86).
        data_parallel: Let the planner replicate tables (TorchRec's data-parallel sharding) where
            the gradient all-reduce is cheaper than any all-to-all.
    """

    global_batch_size: int | None = None
    expected_ratio: float = 10.0
    table_ratios: dict[str, float] = field(default_factory=dict)
    backward_ratio: float = 10.0
    encode_gib_s: float | None = None
    decode_gib_s: float | None = None
    data_parallel: bool = True

    def __post_init__(self) -> None:
        b = self.global_batch_size
        _require(
            b is None or (isinstance(b, int) and 1 <= b <= 1 << 30),
            "planner.global_batch_size",
            b,
            "null or an integer in [1, 1073741824]",
        )
        for key, r in [
            ("planner.expected_ratio", self.expected_ratio),
            ("planner.backward_ratio", self.backward_ratio),
            *((f"planner.table_ratios.{k}", v) for k, v in self.table_ratios.items()),
        ]:
            _require(isinstance(r, (int, float)) and 0.5 <= r <= 10000.0, key, r, "[0.5, 10000]")
        _positive_or_none("planner.encode_gib_s", self.encode_gib_s, 1e6)
        _positive_or_none("planner.decode_gib_s", self.decode_gib_s, 1e6)

    def ratio(self, table: str) -> float:
        """The expected forward ratio of a table (first matching ``table_ratios`` glob).

        Args:
            table: Table name.

        Returns:
            The ratio.
        """
        for pattern, r in self.table_ratios.items():
            if fnmatch.fnmatchcase(table, pattern):
                return r
        return self.expected_ratio


@dataclass(frozen=True)
class EmbeddingTableConfig:
    """One embedding table of the model to plan (an ``EmbeddingBagConfig`` in TorchRec).

    Attributes:
        name: Table name (the key of per-table overrides).
        num_embeddings: Rows.
        embedding_dim: Columns.
        feature_names: Features looked up in the table; empty: one feature named like the table.
        pooling_factor: Mean ids per sample and feature (1 for Criteo's single-hot features).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = ()
    pooling_factor: float = 1.0

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name != "", "table.name", self.name, "a name")
        where = f"table {self.name!r}: "
        _require(
            isinstance(self.num_embeddings, int) and 1 <= self.num_embeddings <= 1 << 40,
            where + "num_embeddings",
            self.num_embeddings,
            "an integer in [1, 2**40]",
        )
        _require(
            isinstance(self.embedding_dim, int) and 1 <= self.embedding_dim <= 65536,
            where + "embedding_dim",
            self.embedding_dim,
            "an integer in [1, 65536]",
        )
        _require(
            0.0 < self.pooling_factor <= 1e6,
            where + "pooling_factor",
            self.pooling_factor,
            "(0, 1e6]",
        )
        object.__setattr__(self, "feature_names", tuple(self.feature_names))


@dataclass(frozen=True)
class LossyPlanConfig:
    """The whole planner config file: comms settings, planner pricing, topology and tables.

    Attributes:
        comms: What the lossy sharder does (codec, bounds, overrides, adaptivity).
        planner: How the planner prices the codec.
        topology: Cluster facts.
        embedding_tables: The tables to plan (the shipped Criteo configs list real sizes).
    """

    comms: LossyCommsConfig = field(default_factory=LossyCommsConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    embedding_tables: tuple[EmbeddingTableConfig, ...] = ()

    def __post_init__(self) -> None:
        tables = tuple(self.embedding_tables)
        names = [t.name for t in tables]
        dupes = sorted({n for n in names if names.count(n) > 1})
        _require(not dupes, "embedding_tables", dupes, "unique table names")
        object.__setattr__(self, "embedding_tables", tables)
