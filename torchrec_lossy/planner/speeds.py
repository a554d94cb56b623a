"""Measured speeds of the wire formats on this device, for the planner's format choice.

:func:`measure_speeds` times, for one layout's block shapes (one block per table, the rows a
destination gets), the lossy codec's encode and decode in each of its formats (entropy, packed;
one call for all blocks, as the sharder makes it) and the fp16/bf16 casts, on Criteo-like
synthetic traffic; and each codec format's ratio on those blocks. Every figure is the best
of ``reps`` trials taken in interleaved rounds (:func:`interleaved_best`: one trial of every
candidate per round), so a burst of load on the machine hits every candidate alike instead of
all of one candidate's trials; with a process group the ranks start together (a barrier), so
a rank is not timed while its peers still build their data. :func:`agree_speeds` makes every
rank use the slowest rank's figures (one all-reduce), so the choice, made from them, is the same
everywhere; :func:`round_ms` times the collective's fixed cost per round and
:func:`~torchrec_lossy.planner.seam_cost.time_exchange_ms` the seam's per-exchange work beyond
TorchRec's all-to-all. ``planner.encode_gib_s`` / ``decode_gib_s`` pin the codec's speeds
instead. A measurement that fails or is nonsense (a zero time, a broken clock) falls back to the
conservative defaults with one warning.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchrec_lossy.config import (
    CODEC_FORMATS,
    EmbeddingTableConfig,
    ErrorBound,
    LossyCommsConfig,
)
from torchrec_lossy.planner.cost import CODEC_THROUGHPUT_GIB_S, QCOMM_THROUGHPUT_GIB_S
from torchrec_lossy.profile_range import profile_range

__all__ = [
    "SpeedKey",
    "Speeds",
    "agree_speeds",
    "best_seconds",
    "default_speeds",
    "interleaved_best",
    "measure_speeds",
    "round_ms",
]

logger: logging.Logger = logging.getLogger(__name__)

_GIB = float(1 << 30)
# Outside this range a throughput is a broken clock or an empty measurement, not a speed.
_SANE_GIB_S = (1e-4, 1e5)
CASTS: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Packed ratio / entropy ratio where none was measured: the packed format's 23.2x against the
# entropy format's 31.2x on Kaggle-like blocks (docs/benchmarks.md, packed format).
PACKED_RATIO_FACTOR = 0.75
# Measured ratios: the codec formats' and the exact row dedupe's ("dedupe").
RATIO_KEYS: frozenset[str] = CODEC_FORMATS | {"dedupe"}

# The clock every trial reads (a module global, so tests can inject a burst of load).
_clock: Callable[[], float] = time.perf_counter
_K = TypeVar("_K", bound=Hashable)

# (device type, blocks, rows, dims, world size or 0): what a measurement is cached under.
SpeedKey = tuple[str, int, int, tuple[int, ...], int]


@dataclass(frozen=True)
class Speeds:
    """Encode / decode throughputs (GiB/s of raw fp32) per format, and where they came from.

    Attributes:
        formats: Format name (``"entropy"``, ``"packed"``, ``"fp16"``, ``"bf16"``; and
            ``"dedupe"``: the seam's exact row dedupe, reduce / expand) to (encode, decode).
        source: ``"measured on ..."``, ``"pinned ..."`` or ``"defaults ..."`` (and why).
        round_ms: The collective's fixed cost per round (a tiny all-to-all), if measured.
        ratios: Codec format name (or ``"dedupe"``) to its ratio on the measured blocks
            (empty: not measured).
        seam_ms: The seam's fixed cost per step on a rank beyond TorchRec's path (its cut,
            expand, gradient sum and place around the wire, :mod:`.seam_cost`), if measured.
        rows: Rows per rank (the batch) the measurement was made for.
        exchange_ms: The seam's fixed cost per exchange (a forward and its gradient, small
            blocks, every block raw) beyond TorchRec's all-to-all of the same bytes, measured
            on the process group with the one-round slots
            (:func:`~torchrec_lossy.planner.seam_cost.time_exchange_ms`); None: not measured
            (the model then charges two collective rounds instead).
    """

    formats: dict[str, tuple[float, float]] = field(default_factory=dict)
    source: str = ""
    round_ms: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    seam_ms: float | None = None
    rows: int | None = None
    exchange_ms: float | None = None

    def ratio_factor(self, codec_format: str) -> float:
        """A codec format's ratio relative to the entropy format's (which tables' expected
        ratios are).

        Args:
            codec_format: ``"entropy"`` or ``"packed"``.

        Returns:
            Measured ratio / measured entropy ratio, else 1 for entropy and
            :data:`PACKED_RATIO_FACTOR` for packed.
        """
        if codec_format in self.ratios and self.ratios.get("entropy"):
            return self.ratios[codec_format] / self.ratios["entropy"]
        return 1.0 if codec_format == "entropy" else PACKED_RATIO_FACTOR

    def to_dict(self) -> dict[str, object]:
        """The figures as JSON-ready values (a resumed run plans from them: its plan then
        matches its checkpoint's, whatever the machine measures now).

        Returns:
            Every field; ``formats``' pairs as lists.
        """
        d = asdict(self)
        d["formats"] = {n: list(v) for n, v in self.formats.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Speeds:
        """The inverse of :meth:`to_dict`.

        Args:
            d: What :meth:`to_dict` returned (e.g. read back from JSON).

        Returns:
            The same speeds.

        Raises:
            ValueError: A key this class does not have, or a format without two speeds.
        """
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"saved speeds have unknown keys {sorted(unknown)}; re-measure them")
        formats = {str(n): tuple(float(x) for x in v) for n, v in d.get("formats", {}).items()}
        if any(len(v) != 2 for v in formats.values()):
            raise ValueError(f"saved speeds need (encode, decode) per format, got {formats}")
        return cls(**{**d, "formats": formats})

    def describe(self) -> str:
        """One line for the printed plan.

        Returns:
            E.g. ``"entropy 1.4/1.9, fp16 0.5/1.7 GiB/s encode/decode (measured ...)"``.
        """
        parts = ", ".join(f"{n} {e:.3g}/{d:.3g}" for n, (e, d) in self.formats.items())
        rnd = f"; {self.round_ms:.3g} ms per collective round" if self.round_ms else ""
        if self.seam_ms is not None:
            rnd += f"; seam's fixed cost {self.seam_ms:.3g} ms a step at {self.rows} rows"
        if self.exchange_ms is not None:
            rnd += f", {self.exchange_ms:.3g} ms an exchange over TorchRec's"
        ratios = ", ".join(f"{n} {r:.3g}x" for n, r in self.ratios.items())
        ratios = f"; ratios on them {ratios}" if ratios else ""
        return f"{parts} GiB/s encode/decode ({self.source}){ratios}{rnd}"


def default_speeds(device: str, why: str) -> Speeds:
    """The conservative defaults of ``planner/cost.py`` for ``device``.

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        why: Why no measurement is used.

    Returns:
        The speeds.
    """
    # The packed format decodes faster than the entropy one; the entropy's figures bound it.
    formats = {f: CODEC_THROUGHPUT_GIB_S[device] for f in sorted(CODEC_FORMATS)}
    formats.update({c: QCOMM_THROUGHPUT_GIB_S[(device, c)] for c in CASTS})
    return Speeds(formats, f"defaults: {why}")


def interleaved_best(
    fns: Mapping[_K, Callable[[], object]], reps: int, sync: Callable[[], None]
) -> dict[_K, float]:
    """The best wall time of each of ``fns`` over ``reps`` rounds of one trial each.

    A round times every function once, in turn, so load that comes and goes on the machine
    hits every function's trials alike: none has all of its trials in one slow window, and the
    comparisons made from the figures (codec against raw, the seam against TorchRec's path)
    hold under load.

    Args:
        fns: What to time, by name (any hashable key).
        reps: Rounds (trials per function).
        sync: Waits for the device (a no-op on CPU).

    Returns:
        Seconds per name.
    """
    best = dict.fromkeys(fns, math.inf)
    for _ in range(reps):
        for name, fn in fns.items():
            sync()
            t0 = _clock()
            fn()
            sync()
            best[name] = min(best[name], _clock() - t0)
    return best


def best_seconds(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    """The best wall time of ``reps`` calls of ``fn``, each between two ``sync`` calls.

    Args:
        fn: What to time.
        reps: Timed calls.
        sync: Waits for the device (a no-op on CPU).

    Returns:
        Seconds.
    """
    return interleaved_best({"fn": fn}, reps, sync)["fn"]


def _time_formats(
    blocks: Sequence[torch.Tensor], comms: LossyCommsConfig, reps: int
) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """Every format's (encode, decode) GiB/s and the codec formats' and dedupe's ratios, each
    timed in the same interleaved rounds (:func:`interleaved_best`)."""
    from torchrec_lossy.codec import compress, decompress

    device = blocks[0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    raw_gib = sum(b.numel() * 4 for b in blocks) / _GIB
    # The relative bound made absolute per block, as the sharder does.
    bounds = [comms.default_bound.value * float(b.max() - b.min()) for b in blocks]
    fns: dict[tuple[str, int], Callable[[], object]] = {}
    ratios: dict[str, float] = {}
    with profile_range("## lossy_codec calibrate warm-up ##"):
        for name in sorted(CODEC_FORMATS):
            codec = replace(comms.codec, format=name)
            payload = compress(blocks, bounds, codec)  # loads the compiled kernels: not timed
            decompress(payload, backend=codec.backend)  # loads the decoder: not timed
            ratios[name] = raw_gib * _GIB / max(1, payload.numel() * payload.element_size())
            fns[(name, 0)] = lambda c=codec: compress(blocks, bounds, c)
            fns[(name, 1)] = lambda p=payload, c=codec: decompress(p, backend=c.backend)
        for name, dtype in CASTS.items():
            wire = [b.to(dtype) for b in blocks]
            # The seam's cast: each block's admission (distributed/cast_blocks.py), the cast.
            _seam_cast(blocks, dtype)  # loads the range kernels: not timed
            fns[(name, 0)] = lambda d=dtype: _seam_cast(blocks, d)
            fns[(name, 1)] = lambda w=wire: [b.float() for b in w]
        (reduce, expand), ratios["dedupe"] = _dedupe_fns(blocks)
        reduce(), expand()  # first calls load kernels: not timed
        fns[("dedupe", 0)], fns[("dedupe", 1)] = reduce, expand
    with profile_range("## lossy_codec calibrate interleaved ##"):
        secs = interleaved_best(fns, reps, sync)
    names = dict.fromkeys(n for n, _ in fns)

    def gib_s(seconds: float) -> float:  # a zero time is an infinite (nonsense) throughput
        return raw_gib / seconds if seconds > 0 else math.inf

    return {n: (gib_s(secs[(n, 0)]), gib_s(secs[(n, 1)])) for n in names}, ratios


def _seam_cast(blocks: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """What the seam does to a cast table's blocks: their admission, then the cast."""
    from torchrec_lossy.distributed.cast_blocks import admissible

    admissible(blocks, [dtype] * len(blocks), [ErrorBound()] * len(blocks))
    return [b.to(dtype) for b in blocks]


def _dedupe_fns(
    blocks: Sequence[torch.Tensor],
) -> tuple[tuple[Callable[[], None], Callable[[], None]], float]:
    """The exact row dedupe the seam runs on every table, raw ones too: its reduce (the
    gradient's sum into distinct rows) and expand (the forward's expansion back) over
    ``blocks``, and its ratio (rows / distinct rows). A lower bound of the seam's work around
    the codec."""
    inverse = [torch.unique(b, dim=0, return_inverse=True)[1] for b in blocks]
    uniq = [int(i.max()) + 1 if i.numel() else 0 for i in inverse]
    distinct = [b.new_zeros(u, b.shape[1]) for b, u in zip(blocks, uniq, strict=True)]

    def reduce() -> None:
        for d, b, i in zip(distinct, blocks, inverse, strict=True):
            d.zero_().index_add_(0, i, b)

    def expand() -> None:
        torch.cat([d.index_select(0, i) for d, i in zip(distinct, inverse, strict=True)], 1)

    rows = sum(b.shape[0] for b in blocks)
    return (reduce, expand), rows / max(1, sum(uniq))


def measure_speeds(
    tables: Sequence[EmbeddingTableConfig],
    rows: int,
    comms: LossyCommsConfig,
    device: torch.device,
    cache: MutableMapping[SpeedKey, Speeds] | None = None,
    reps: int = 5,
    world_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Speeds:
    """Times each format on one destination's blocks of ``tables`` (``rows`` rows each).

    Args:
        tables: The tables (their dims; their sizes shape the synthetic ids).
        rows: Rows per block (the batch one destination gets).
        comms: The comms config (default bound and codec knobs).
        device: Where the blocks live.
        cache: Measurements by device and shape; a hit is returned as it is.
        reps: Interleaved rounds of trials (the best of each format counts).
        world_size: Ranks of the all-to-all: also time the seam's fixed cost per step
            (:func:`~torchrec_lossy.planner.seam_cost.time_seam_step`, ``rows`` rows per rank);
            None: not timed.
        group: The run's process group (a collective then: every rank calls this alike): the
            ranks start timing together, and the seam's fixed cost per exchange is measured
            on it (:func:`~torchrec_lossy.planner.seam_cost.time_exchange_ms`); None: neither.

    Returns:
        The measured speeds, or the defaults with one warning if the measurement failed or is
        nonsense (the seam's costs are then not timed either: the same clock).
    """
    dims = tuple(t.embedding_dim for t in tables)
    key: SpeedKey = (device.type, len(tables), rows, dims, world_size or 0)
    if cache is not None and key in cache:
        return cache[key]
    collective = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    if collective:  # no rank timed while a peer still builds its data: they run steps together
        dist.barrier(group)
    where = f"measured on {device.type}, {len(tables)} blocks x {rows} rows"
    failed = False
    try:
        from torchrec_lossy.planner.calibrate import synthetic_blocks

        blocks = [b.to(device) for b in synthetic_blocks(tables, rows).values()]
        formats, ratios = _time_formats(blocks, comms, reps)
        bad = {
            n: v
            for n, v in formats.items()
            if not all(math.isfinite(x) and _SANE_GIB_S[0] <= x <= _SANE_GIB_S[1] for x in v)
        }
        if set(bad) == {"dedupe"}:  # optional: only the TorchRec-path choice needs it
            logger.warning("torchrec-lossy: dedupe timing %s GiB/s is nonsense; unused", bad)
            formats.pop("dedupe")
            ratios.pop("dedupe")
        elif bad:
            raise ValueError(f"nonsense throughputs {bad} GiB/s")
        speeds = Speeds(formats, where, ratios=ratios)
    except Exception as e:  # any failure: plan with the conservative figures, say so once
        logger.warning("torchrec-lossy: speed calibration failed (%s); using the defaults", e)
        speeds = default_speeds(device.type, f"calibration failed: {e}")
        failed = True
    if world_size is not None and not failed:
        try:
            seam = _seam_ms(tables, rows, world_size, comms, device, reps)
            speeds = replace(speeds, seam_ms=seam, rows=rows)
        except Exception as e:  # the model then prices the seam by its dedupe throughput only
            logger.warning("torchrec-lossy: timing the seam's fixed cost failed (%s); unused", e)
    if collective and world_size is not None:  # every rank, failed or not: a collective
        from torchrec_lossy.planner.seam_cost import time_exchange_ms

        assert group is not None
        try:
            seam_x, torchrec_x = time_exchange_ms(tables, group, device, reps=reps)
            ok = math.isfinite(seam_x) and math.isfinite(torchrec_x) and seam_x > 0
            if ok and not failed:
                speeds = replace(speeds, exchange_ms=max(0.0, seam_x - torchrec_x))
            elif not failed:
                logger.warning(
                    "torchrec-lossy: nonsense exchange times (seam %s ms, TorchRec's %s ms); "
                    "unused",
                    seam_x,
                    torchrec_x,
                )
        except Exception as e:  # the model then charges two collective rounds instead
            logger.warning("torchrec-lossy: timing the seam's exchange failed (%s); unused", e)
    if cache is not None:
        cache[key] = speeds
    return speeds


def _seam_ms(
    tables: Sequence[EmbeddingTableConfig],
    rows: int,
    world_size: int,
    comms: LossyCommsConfig,
    device: torch.device,
    reps: int,
) -> float:
    """The seam's layout work per step minus TorchRec's (>= 0), in ms."""
    from torchrec_lossy.planner.seam_cost import time_seam_step

    exact = comms.input_dist.dedupe_outputs or comms.input_dist.dedupe_lookups
    seam, torchrec = time_seam_step(tables, rows, world_size, device, exact, reps)
    if not (math.isfinite(seam) and math.isfinite(torchrec) and seam > 0):
        raise ValueError(f"nonsense seam step time {seam} ms (TorchRec's {torchrec} ms)")
    return max(0.0, seam - torchrec)


def round_ms(group: dist.ProcessGroup, device: torch.device, reps: int = 5) -> float:
    """The fixed cost of one collective round: the best time of a tiny all-to-all.

    Args:
        group: The process group.
        device: Where its tensors live.
        reps: Timed rounds.

    Returns:
        Milliseconds.
    """
    n = dist.get_world_size(group)
    send = torch.zeros(n, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    with profile_range("## lossy_a2a calibrate round ##"):
        dist.all_to_all_single(recv, send, group=group)  # warm
        return 1000.0 * best_seconds(
            lambda: dist.all_to_all_single(recv, send, group=group), reps, sync
        )


def agree_speeds(speeds: Speeds, group: dist.ProcessGroup | None, device: torch.device) -> Speeds:
    """Every rank's figures replaced by the slowest rank's, so every rank chooses alike.

    Args:
        speeds: This rank's speeds.
        group: The process group; None or one rank: returned as they are.
        device: Where the group's tensors live.

    Returns:
        The slowest throughputs (and the largest round cost and seam costs) over ranks.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return speeds
    names, codecs = sorted(speeds.formats), sorted(RATIO_KEYS)
    # Seconds per GiB, so MAX is the slowest; wire bytes per raw byte (the least ratio; 0 where
    # a rank did not measure it, so every rank sends as many values) and the round cost likewise.
    secs = [1.0 / v for n in names for v in speeds.formats[n]]
    secs += [1.0 / speeds.ratios[n] if n in speeds.ratios else 0.0 for n in codecs]
    secs.append(speeds.round_ms if speeds.round_ms is not None else round_ms(group, device))
    for fixed in (speeds.seam_ms, speeds.exchange_ms):
        secs.append(fixed if fixed is not None else -1.0)  # -1: not measured
    t = torch.tensor(secs, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    v = t.tolist()
    formats = {n: (1.0 / v[2 * i], 1.0 / v[2 * i + 1]) for i, n in enumerate(names)}
    per_raw = v[2 * len(names) : 2 * len(names) + len(codecs)]
    seam, exchange = (x if x >= 0 else None for x in v[-2:])
    ratios = {n: 1.0 / w for n, w in zip(codecs, per_raw, strict=True) if w > 0}
    return replace(
        speeds,
        formats=formats,
        ratios=ratios,
        source=speeds.source + ", slowest rank",
        round_ms=v[-3],
        seam_ms=seam,
        exchange_ms=exchange,
    )
