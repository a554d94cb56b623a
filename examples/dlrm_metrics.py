"""What the DLRM example measures: held-out quality, all-to-all bytes, step times, curves.

:class:`CommsMeter` reads the lossy sharder's stats (``--comm lossy``) or computes a qcomm
mode's bytes from the plan; :class:`RunLog` is what the training loop records into (step times
and losses, per-table telemetry samples, evaluations) and reduces over ranks into the metrics
dict that :mod:`dlrm_report` prints and saves.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from dlrm_env import DistEnv, gather_objects
from torch import nn

from torchrec_lossy.config import LossyPlanConfig
from torchrec_lossy.distributed import (
    TableCommStats,
    check_lossy_decodes,
    guard_state,
    lossy_modules,
)
from torchrec_lossy.planner.planner import SHORT_NAMES

if TYPE_CHECKING:
    from dlrm_data import DataSource

__all__ = [
    "CommsMeter",
    "History",
    "RunLog",
    "ShardedModel",
    "auroc",
    "evaluate",
    "plan_tables",
]

# Links whose wire bytes the lossy stats count apart (the self block never leaves the rank).
LINKS = ("same_host", "cross_host")


@dataclass
class ShardedModel:
    """The model after ``DistributedModelParallel``, and what the run needs to know of its plan.

    Attributes:
        model: The DMP-wrapped ``DLRMTrain``.
        comm_description: How the embedding all-to-all travels.
        planner_name: Which planner made the plan.
        plan_text: The planner's per-table explanation.
        tables: Per table: ``rows``, ``sharding`` (TW/CW/DP...), ``ranks``, ``col_shards``
            (``(rank, columns)`` of each all-to-all shard; empty for DP).
        lossy: Whether the lossy sharder is in use.
        qcomm_codecs: TorchRec's pooled all-to-all codecs of a qcomm mode (else None).
        recheck: The run's format re-check's arguments (``RuntimeRecheck``'s ``step_ms``:
            the planner's wire and codec ms a step of raw and the codec format, and for a run
            that starts raw ``start``, ``coded_tables``, ``remeasure``) where ``auto`` runs the
            seam; empty: no re-check.
    """

    model: nn.Module
    comm_description: str
    planner_name: str
    plan_text: str
    tables: dict[str, dict[str, Any]]
    lossy: bool
    qcomm_codecs: Any = None
    recheck: dict[str, Any] = field(default_factory=dict)


def plan_tables(
    module_plan: Mapping[str, Any], plan_config: LossyPlanConfig, world_size: int
) -> dict[str, dict[str, Any]]:
    """What the report shows of each table's placement.

    Args:
        module_plan: The EBC's ``ParameterSharding`` by table name (from the sharding plan).
        plan_config: The plan config (for the tables' row counts).
        world_size: Number of ranks.

    Returns:
        Per table: ``rows``, ``sharding`` (TW/CW/DP...), ``ranks`` and ``col_shards``
        (``(rank, columns)`` of each all-to-all shard; empty for DP).
    """
    sizes = {t.name: t.num_embeddings for t in plan_config.embedding_tables}
    tables: dict[str, dict[str, Any]] = {}
    for name, ps in module_plan.items():
        ranks = sorted(set(ps.ranks or [])) or list(range(world_size))
        a2a = ps.sharding_type != "data_parallel" and ps.sharding_spec is not None
        tables[name] = {
            "rows": sizes.get(name, 0),
            "sharding": SHORT_NAMES.get(ps.sharding_type, ps.sharding_type),
            "ranks": ",".join(map(str, ranks)) if len(ranks) <= 3 else f"{len(ranks)}r",
            "col_shards": [
                (int(s.placement.rank()), int(s.shard_sizes[1])) for s in ps.sharding_spec.shards
            ]
            if a2a
            else [],
        }
    return tables


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (NaN when only one class is present).

    Args:
        scores: Scores or logits.
        labels: 0/1 labels.

    Returns:
        The AUC.
    """
    from torchmetrics.functional.classification import binary_auroc

    if labels.numel() == 0 or labels.min() == labels.max():
        return float("nan")
    return float(binary_auroc(scores.float(), labels.long()))


def evaluate(model: nn.Module, batches: Sequence[Any], env: DistEnv) -> dict[str, float]:
    """Held-out AUROC and log loss over all ranks' eval batches.

    Args:
        model: The DMP model (its pipeline detached).
        batches: This rank's held-out batches (same count and size on every rank).
        env: This process's placement.

    Returns:
        ``{"auc", "logloss", "rows"}``.
    """
    was_training = model.training
    model.eval()
    probs, labels = [], []
    with torch.no_grad():
        for b in batches:
            _, (_, logits, y) = model(b.to(env.device))
            probs.append(torch.sigmoid(logits.float()))
            labels.append(y.float())
    check_lossy_decodes(model)  # device path: the last eval decode's status (no-op on CPU)
    model.train(was_training)
    local_p = torch.cat(probs) if probs else torch.zeros(0, device=env.device)
    local_y = torch.cat(labels) if labels else torch.zeros(0, device=env.device)
    gathered_p = [torch.empty_like(local_p) for _ in range(env.world_size)]
    gathered_y = [torch.empty_like(local_y) for _ in range(env.world_size)]
    dist.all_gather(gathered_p, local_p)
    dist.all_gather(gathered_y, local_y)
    p, y = torch.cat(gathered_p).cpu(), torch.cat(gathered_y).cpu()
    if p.numel() == 0:
        return {"auc": float("nan"), "logloss": float("nan"), "rows": 0}
    logloss = float(torch.nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y))
    return {"auc": auroc(p, y), "logloss": logloss, "rows": int(p.numel())}


def _add_error_sample(t: dict[str, Any], e: Mapping[str, Any]) -> None:
    """Folds one rank's sampled forward errors of a table into its summary row: the RMS error
    relative to the RMS value and the share of values snapped to zero (None until sampled)."""
    for key in ("error_count", "error_sq_sum", "value_sq_sum", "snapped_to_zero"):
        t[f"fwd_{key}"] = t.get(f"fwd_{key}", 0) + e[key]
    val_sq, n = t["fwd_value_sq_sum"], t["fwd_error_count"]
    t["fwd_rel_rms_error"] = math.sqrt(t["fwd_error_sq_sum"] / val_sq) if val_sq else None
    t["fwd_snapped_share"] = t["fwd_snapped_to_zero"] / n if n else None
    _add_row_energy(t, e, "fwd")


def _add_row_energy(t: dict[str, Any], e: Mapping[str, Any], direction: str) -> None:
    """Folds one rank's sampled row-relative error energy (the error against each row's own
    scale, ``TableCommStats.row_relative_energy``) and NaN / Inf count into a summary row."""
    for key in ("row_rel_sq_sum", "error_rows", "nonfinite"):
        t[f"{direction}_{key}"] = t.get(f"{direction}_{key}", 0) + e[key]
    rows = t[f"{direction}_error_rows"]
    energy = t[f"{direction}_row_rel_sq_sum"] / rows if rows else None
    t[f"{direction}_row_relative_energy"] = energy


def error_alerts(per_rank: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The error sample's alerts of every rank, by direction and table (issue 32): blocks
    whose row-relative error energy passed ``error_sample.ROW_ENERGY_LEVEL`` or that held NaN /
    Inf, with the steps (calls) where they were seen.

    Args:
        per_rank: Each rank's alerts (``ErrorAlert`` as dicts).

    Returns:
        ``{"level", "count", "by_table": {"dir/table": {"count", "first_step", "last_step",
        "max_row_energy", "nonfinite"}}}``.
    """
    from torchrec_lossy.distributed.error_sample import ROW_ENERGY_LEVEL

    by_table: dict[str, dict[str, Any]] = {}
    for alerts in per_rank:
        for a in alerts:
            key = f"{a['direction']}/{a['table']}"
            t = by_table.setdefault(
                key,
                {"count": 0, "first_step": a["call"], "last_step": a["call"],
                 "max_row_energy": 0.0, "nonfinite": 0},
            )  # fmt: skip
            t["count"] += 1
            t["first_step"] = min(t["first_step"], a["call"])
            t["last_step"] = max(t["last_step"], a["call"])
            t["max_row_energy"] = max(t["max_row_energy"], a["row_energy"])
            t["nonfinite"] += a["nonfinite"]
    count = sum(t["count"] for t in by_table.values())
    return {"level": ROW_ENERGY_LEVEL, "count": count, "by_table": dict(sorted(by_table.items()))}


def guard_seconds(model: nn.Module) -> float:
    """This rank's host seconds in ``comms.guard``'s decisions (its all-reduces included).

    Args:
        model: The DMP model.

    Returns:
        Seconds (0 where no module has the guard on).
    """
    guards = [m.lossy_comms.guard for m in lossy_modules(model).values()]
    return sum(g.seconds for g in guards if g is not None)


def guard_report(model: nn.Module, seconds: float, train_s: float) -> dict[str, Any] | None:
    """What ``comms.guard`` did: every tightening (decided by all ranks together, so this
    rank's record is every rank's; a resumed run's include those before the checkpoint) and
    its cost; None where no module has the guard on.

    Args:
        model: The DMP model.
        seconds: The slowest rank's :func:`guard_seconds`.
        train_s: The slowest rank's training seconds.

    Returns:
        ``{"events": [Tightening as a dict with its module path, ...], "seconds",
        "share_of_train"}``.
    """
    state = guard_state(model)
    if not state:
        return None
    events = [{"module": n, **e} for n, s in state.items() for e in s["events"]]
    share = seconds / train_s if train_s > 0 else None
    return {"events": events, "seconds": seconds, "share_of_train": share}


class CommsMeter:
    """Embedding all-to-all traffic of the training steps, per table.

    ``--comm lossy``: measured by the lossy sharder's stats (``LossyCommsStats`` of each sharded
    module), read and reset at every sample so that the interval's ratio is the counters' ratio,
    and eval traffic is kept apart. Other modes: computed from the plan with TorchRec's own
    ``calc_quantized_size`` of the qcomm codec (what ``All2All_Pooled_Req`` sends). Bytes are
    those handed to the all-to-all, the rank's own chunk included, summed over ranks.

    Args:
        sharded: The sharded model.
        env: This process's placement.
        batch_size: Samples per rank and step.
    """

    def __init__(self, sharded: ShardedModel, env: DistEnv, batch_size: int) -> None:
        self.sharded = sharded
        self.env = env
        self.batch_size = batch_size
        self.totals: dict[str, dict[str, Any]] = {"fwd": {}, "bwd": {}, "input": {}}
        # Training wire bytes per (direction, link): "same_host" / "cross_host" peers.
        self.link_totals: dict[str, int] = {f"{d}_{k}": 0 for d in ("fwd", "bwd") for k in LINKS}
        self._interval_links: dict[str, int] = {}
        self._interval_alerts: list[dict[str, Any]] = []
        self.alerts: list[dict[str, Any]] = []  # the training steps' error-sample alerts
        self.eval_bytes = 0
        self._steady_mark = 0.0

    def _codec_s(self) -> float:
        return sum(e.encode_s + e.decode_s for d in self.totals.values() for e in d.values())

    def mark_steady(self) -> None:
        """Starts the steady-state codec clock (after the warm-up steps)."""
        self._steady_mark = self._codec_s()

    def steady_codec_s(self) -> float:
        """Codec seconds of this rank since :meth:`mark_steady` (training steps only).

        Returns:
            Encode + decode seconds.
        """
        return self._codec_s() - self._steady_mark

    def _read(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {"fwd": {}, "bwd": {}, "input": {}}
        links = dict.fromkeys(self.link_totals, 0)
        alerts: list[dict[str, Any]] = []
        for m in lossy_modules(self.sharded.model).values():
            stats = m.lossy_stats
            alerts += [dataclasses.asdict(a) for a in stats.alerts()]
            for direction in ("fwd", "bwd", "input"):
                for table, entry in stats.tables(direction).items():
                    acc = out[direction].setdefault(table, TableCommStats())
                    acc.merge(entry)
            for key in links:
                direction, link = key.split("_", 1)
                links[key] += stats.link_bytes(direction, link)  # type: ignore[arg-type]
            stats.reset()
        self._interval_links = links
        self._interval_alerts = alerts
        return out

    def sample(self, phase: str = "train") -> dict[str, dict[str, Any]]:
        """Folds the counters since the last sample into the totals (train) or drops them.

        Args:
            phase: ``"train"`` or ``"eval"``.

        Returns:
            The interval's counters of this rank, ``{direction: {table: TableCommStats}}``.
        """
        if not self.sharded.lossy:
            return {"fwd": {}, "bwd": {}, "input": {}}
        interval = self._read()
        if phase == "eval":
            self.eval_bytes += sum(e.wire_bytes for e in interval["fwd"].values())
            return interval
        for direction, tables in interval.items():
            for table, entry in tables.items():
                self.totals[direction].setdefault(table, TableCommStats()).merge(entry)
        for key, n in self._interval_links.items():
            self.link_totals[key] += n
        self.alerts += self._interval_alerts
        return interval

    def bounds(self) -> dict[str, dict[str, Any]]:
        """Effective bound and class of each table this rank sends (lossy mode).

        Returns:
            ``{table: {"bound", "bound_mode", "class"}}``.
        """
        out: dict[str, dict[str, Any]] = {}
        for m in lossy_modules(self.sharded.model).values():
            provider = m.lossy_comms.bounds
            class_of = getattr(provider, "table_class_name", None)
            for table in self.totals["fwd"] or self.sharded.tables:
                if table not in self.sharded.tables or table == "<container>":
                    continue
                b = provider.bound(table)
                out[table] = {
                    "bound": b.value,
                    "bound_mode": b.mode,
                    "class": class_of(table) if class_of else None,
                }
        return out

    def planned_bytes(self) -> dict[str, float]:
        """Per-step all-to-all bytes over all ranks, from the plan (lossy mode: raw only).

        Each sharding type has its own pooled all-to-all. Per (sender, destination) pair it
        carries ``batch_size x`` the sender's columns of that type, in the forward as in the
        backward, each direction sized by its own codec's ``calc_quantized_size``; an MX4
        forward first pads each rank's columns to the MX4 group size, as TorchRec does
        (``padded_size``), while the backward sends the unpadded gradient.

        Returns:
            ``fwd_raw``, ``fwd_wire``, ``bwd_raw``, ``bwd_wire``, ``input_raw``, ``input_wire``
            (TorchRec's KJT all-to-all, which qcomm codecs leave alone: per rank, an int32
            length and an int64 id per sample and column shard of every all-to-all sharded
            table, plus the splits exchange of 3 int64 per destination and sharding type).
        """
        w = self.env.world_size
        cols: dict[str, list[int]] = {}  # sharding type -> columns per rank
        shards = 0
        for t in self.sharded.tables.values():
            shards += len(t["col_shards"])
            for rank, c in t["col_shards"]:
                cols.setdefault(t["sharding"], [0] * w)[rank] += c
        out = {"fwd_raw": 0.0, "fwd_wire": 0.0, "bwd_raw": 0.0, "bwd_wire": 0.0}
        out["input_raw"] = out["input_wire"] = float(
            w * self.batch_size * shards * (4 + 8) + len(cols) * w * w * 3 * 8
        )
        codecs = self.sharded.qcomm_codecs
        fwd, bwd = (codecs.forward, codecs.backward) if codecs else (None, None)
        for per_rank in cols.values():
            padded = per_rank
            if fwd is not None and hasattr(fwd, "padded_size"):
                ctx = fwd.create_context()
                probe = torch.empty((1, per_rank[0]), device="meta")
                fwd.padded_size(probe, per_rank, 0, ctx)
                padded = list(getattr(ctx, "padded_dim_sum_per_rank", None) or per_rank)
            for sender in range(w):
                n = self.batch_size * per_rank[sender]
                out["fwd_raw"] += w * 4 * n
                out["bwd_raw"] += w * 4 * n
                out["fwd_wire"] += w * _wire_bytes(fwd, self.batch_size * padded[sender])
                out["bwd_wire"] += w * _wire_bytes(bwd, n)
        return out


def _wire_bytes(codec: Any, numel: int) -> int:
    """Bytes TorchRec's qcomm ``codec`` sends for ``numel`` fp32 values (None: uncompressed)."""
    if codec is None or numel == 0:
        return 4 * numel
    size = codec.calc_quantized_size(numel, codec.create_context())
    return size * torch.empty((), dtype=codec.quantized_dtype).element_size()


@dataclass
class History:
    """Curves of the run (rank 0 keeps them).

    Attributes:
        train_step: Step numbers of the logged training losses.
        train_loss: Mean loss over ranks of each logged step.
        step_time_s: Slowest rank's wall time of each logged step.
        tables: Per sample: ``{"step", "fwd_ratio", "tables": {name: {...}}}``.
        evals: ``{"step", "auc", "logloss", "rows"}`` per evaluation.
    """

    train_step: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    tables: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)


def _interval_tables(
    interval: dict[str, dict[str, Any]], bounds: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Plain per-table values of one sample of this rank (for gathering)."""
    out: dict[str, dict[str, Any]] = {}
    for table, e in interval["fwd"].items():
        if table == "<container>" or e.raw_bytes == 0:
            continue
        out[table] = {
            "fwd_ratio": e.ratio,
            "raw_bytes": e.raw_bytes,
            "wire_bytes": e.wire_bytes,
            "max_error_over_bound": e.max_error_over_bound,
            **bounds.get(table, {}),
        }
    return out


class RunLog:
    """What the training loop records, and the metrics it adds up to.

    Per step: the loss and wall time (:meth:`record_step`); every ``--log-interval`` steps: the
    steps' losses averaged and times maxed over ranks, and each table's ratio, error and bound
    of the interval (:meth:`sample`); at evaluations: held-out AUC and log loss
    (:meth:`evaluate`). :meth:`metrics` reduces everything over ranks.

    Args:
        sharded: The sharded model.
        env: This process's placement.
        batch_size: Samples per rank and step.

    Attributes:
        warm: Steps left out of the step-time and codec-time statistics (the training loop
            sets it: the first steps include lazy initialisation and the codec's JIT).
    """

    def __init__(self, sharded: ShardedModel, env: DistEnv, batch_size: int) -> None:
        self.sharded = sharded
        self.env = env
        self.meter = CommsMeter(sharded, env, batch_size)
        self.history = History()
        self.warm = 0
        self.step = 0
        self.start_step = 0
        self.resumed_from: str | None = None
        self.step_times: list[float] = []
        self.recent_losses: deque[float] = deque(maxlen=50)
        self.data_wait_s = 0.0
        self.notes: list[str] = []
        self._pending_losses: list[float] = []
        self._pending_times: list[float] = []
        self._pending_steps: list[int] = []
        self._bar: Any = None

    def resumed(self, step: int, path: Path, recent_losses: Sequence[float] = ()) -> None:
        """Notes that training continues from a checkpoint.

        Args:
            step: Steps already done.
            path: The checkpoint.
            recent_losses: This rank's losses of the last steps before it (from the
                checkpoint), so the final train loss averages the same window as an
                uninterrupted run's.
        """
        self.step = self.start_step = step
        self.resumed_from = str(path)
        self.recent_losses.extend(recent_losses)

    def start(self, limit: int | None, total: int | None, label: str, progress_bar: bool) -> None:
        """Starts the training phase: its warm-up length and rank 0's progress bar.

        Step and codec times are reported after the warm-up steps (lazy initialisation, the
        codec's JIT compilation): the first tenth of the steps to run, at least 3.

        Args:
            limit: Steps this run will train (None: until a finite stream ends).
            total: Steps of the whole run, resumed ones included (None: unknown).
            label: The bar's title.
            progress_bar: Whether rank 0 shows a tqdm bar.
        """
        from tqdm import tqdm

        n = limit or 100
        self.warm = min(max(3, n // 10), max(0, n - 1))
        self._bar = tqdm(
            total=total,
            initial=self.step,
            disable=self.env.rank != 0 or not progress_bar,
            dynamic_ncols=True,
            mininterval=1.0,
            desc=label,
            file=sys.stderr,
        )

    def close(self) -> None:
        """Closes the progress bar."""
        if self._bar is not None:
            self._bar.close()

    def record_step(self, loss: float, seconds: float) -> None:
        """Records one finished training step of this rank.

        Args:
            loss: Its training loss.
            seconds: Its wall time.
        """
        self.step += 1
        self.step_times.append(seconds)
        self.recent_losses.append(loss)
        self._pending_losses.append(loss)
        self._pending_times.append(seconds)
        self._pending_steps.append(self.step)
        if len(self.step_times) == self.warm:
            self.meter.sample("train")
            self.meter.mark_steady()
        if self._bar is not None:
            self._bar.update(1)

    def sample(self) -> float:
        """Averages the pending steps' losses and times over ranks and samples the tables.

        A collective: every rank calls it at the same step.

        Returns:
            The interval's forward ratio over all tables (1.0 when nothing was compressed).
        """
        if not self._pending_steps:
            return 1.0
        losses = torch.tensor(self._pending_losses, dtype=torch.float64, device=self.env.device)
        times = torch.tensor(self._pending_times, dtype=torch.float64, device=self.env.device)
        dist.all_reduce(losses)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        interval = self.meter.sample("train")
        local = _interval_tables(interval, self.meter.bounds())
        per_rank = gather_objects(local, self.env)
        merged: dict[str, dict[str, Any]] = {}
        for tables in per_rank:
            for name, t in tables.items():
                if name in merged:  # a column-wise table: shards on several ranks
                    m = merged[name]
                    m["raw_bytes"] += t["raw_bytes"]
                    m["wire_bytes"] += t["wire_bytes"]
                    m["fwd_ratio"] = m["raw_bytes"] / max(1, m["wire_bytes"])
                else:
                    merged[name] = dict(t)
        raw = sum(t["raw_bytes"] for t in merged.values())
        wire = sum(t["wire_bytes"] for t in merged.values())
        ratio = raw / wire if wire else 1.0
        if self.env.rank == 0:
            h = self.history
            h.train_step.extend(self._pending_steps)
            h.train_loss.extend((losses / self.env.world_size).tolist())
            h.step_time_s.extend(times.tolist())
            h.tables.append(
                {"step": self.step, "fwd_ratio": ratio if wire else None, "tables": merged}
            )
        self._pending_losses, self._pending_times, self._pending_steps = [], [], []
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{statistics.fmean(self.recent_losses):.4f}",
                auc=f"{self.history.evals[-1]['auc'] if self.history.evals else math.nan:.4f}",
                ratio=f"{ratio:.1f}x",
            )
        return ratio

    def evaluate(
        self, model: nn.Module, batches: Sequence[Any], pipeline: Any = None
    ) -> dict[str, Any]:
        """Evaluates on the held-out batches, keeping their traffic out of the training bytes.

        Args:
            model: The DMP model.
            batches: This rank's held-out batches.
            pipeline: The ``TrainPipelineSparseDist`` training ``model``, if any: it holds
                batches in flight, so it is detached during the evaluation.

        Returns:
            ``{"step", "auc", "logloss", "rows"}``.
        """
        self.meter.sample("train")
        if pipeline is not None:
            pipeline.detach()
        result = {"step": self.step, **evaluate(model, batches, self.env)}
        if pipeline is not None:
            pipeline.attach(model)
        self.meter.sample("eval")
        self.history.evals.append(result)
        return result

    def metrics(
        self, args: argparse.Namespace, data: DataSource, plan_source: str
    ) -> dict[str, Any]:
        """Everything the run measured, reduced over ranks (a collective).

        Args:
            args: Parsed flags.
            data: The data source (description, hidden-model AUC, parse counters).
            plan_source: Where the planner config came from.

        Returns:
            The metrics dict (meaningful on rank 0).
        """
        env = self.env
        steps_run = len(self.step_times)
        warm = min(self.warm, max(0, steps_run - 1))
        steady = self.step_times[warm:]
        times = torch.tensor(steady or [float("nan")], dtype=torch.float64)
        per_rank = gather_objects(
            {
                "mean": float(times.mean()),
                "median": float(times.median()),
                "wait": self.data_wait_s / max(1, steps_run),
                "train_s": sum(self.step_times),
                "steady_s": sum(steady),
                "steady_codec_s": self.meter.steady_codec_s(),
                "totals": {
                    d: {t: dataclasses.asdict(e) for t, e in tables.items()}
                    for d, tables in self.meter.totals.items()
                },
                "bounds": self.meter.bounds(),
                "links": dict(self.meter.link_totals),
                "parse": data.parse_stats(),
                "losses": list(self.recent_losses),
                "alerts": self.meter.alerts,
                "guard_s": guard_seconds(self.sharded.model),
            },
            env,
        )
        step_mean = max(r["mean"] for r in per_rank)
        step_median = max(r["median"] for r in per_rank)
        global_batch = args.batch_size * env.world_size
        tables = {
            name: {k: v for k, v in t.items() if k != "col_shards"}
            for name, t in self.sharded.tables.items()
        }
        # Where the codec time goes: seconds per all-to-all, summed over ranks.
        codec_s = {d: {"encode": 0.0, "decode": 0.0} for d in ("input", "fwd", "bwd")}
        comms: dict[str, Any]
        if self.sharded.lossy:
            sums = {"fwd": [0, 0], "bwd": [0, 0], "input": [0, 0]}
            fwd_coded = 0  # raw bytes of the rows the codec saw (fewer under output dedupe)
            for r in per_rank:
                for d in ("fwd", "bwd", "input"):
                    for name, e in r["totals"][d].items():
                        raw = e["raw_bytes"]
                        if d == "fwd":
                            fwd_coded += raw
                        if d != "input" and e["rows_sent"]:  # raw = what TorchRec would send
                            raw = raw * e["rows"] // e["rows_sent"]
                        sums[d][0] += raw
                        sums[d][1] += e["wire_bytes"]
                        codec_s[d]["encode"] += e["encode_s"]
                        codec_s[d]["decode"] += e["decode_s"]
                        if d == "bwd" and name in tables:
                            t = tables[name]
                            t["bwd_raw_bytes"] = t.get("bwd_raw_bytes", 0) + raw
                            t["bwd_wire_bytes"] = t.get("bwd_wire_bytes", 0) + e["wire_bytes"]
                            t["bwd_ratio"] = t["bwd_raw_bytes"] / max(1, t["bwd_wire_bytes"])
                            t["bwd_max_error_over_bound"] = _nanmax(
                                t.get("bwd_max_error_over_bound"), e["max_error_over_bound"]
                            )
                            n_err = t.get("bwd_error_count", 0) + e["error_count"]
                            t["bwd_error_sum"] = t.get("bwd_error_sum", 0.0) + e["error_sum"]
                            t["bwd_error_count"] = n_err
                            t["bwd_mean_signed_error"] = (
                                t["bwd_error_sum"] / n_err if n_err else None
                            )
                            _add_row_energy(t, e, "bwd")
                        if d != "fwd" or name not in tables:
                            continue
                        t = tables[name]
                        t["raw_bytes"] = t.get("raw_bytes", 0) + raw
                        t["wire_bytes"] = t.get("wire_bytes", 0) + e["wire_bytes"]
                        t["fwd_ratio"] = t["raw_bytes"] / max(1, t["wire_bytes"])
                        t["max_error_over_bound"] = _nanmax(
                            t.get("max_error_over_bound"), e["max_error_over_bound"]
                        )
                        t["encode_s"] = t.get("encode_s", 0.0) + e["encode_s"]
                        t["decode_s"] = t.get("decode_s", 0.0) + e["decode_s"]
                        _add_error_sample(t, e)
                for name, b in r["bounds"].items():
                    if name in tables and "raw_bytes" in tables[name]:
                        tables[name].update(b)
            n = max(1, steps_run)
            # Raw: what TorchRec hands its all-to-all uncompressed, every rank's own block
            # included (as for the other modes); ours skips the wire, so wire leaves it out.
            planned = self.meter.planned_bytes()
            comms = {
                "source": "measured",
                "fwd_raw_bytes_per_step": planned["fwd_raw"],
                "fwd_wire_bytes_per_step": sums["fwd"][1] / n,
                "fwd_coded_bytes_per_step": fwd_coded / n,
                "bwd_raw_bytes_per_step": planned["bwd_raw"],
                "bwd_wire_bytes_per_step": sums["bwd"][1] / n,
                "input_raw_bytes_per_step": sums["input"][0] / n,
                "input_wire_bytes_per_step": sums["input"][1] / n,
            }
            # Wire bytes by link, all ranks: to peers on the sender's host and on other hosts.
            for key in self.meter.link_totals:
                total = sum(r["links"][key] for r in per_rank)
                comms[f"{key}_bytes_per_step"] = total / n
        else:
            planned = self.meter.planned_bytes()
            comms = {
                "source": "computed from plan",
                "fwd_raw_bytes_per_step": planned["fwd_raw"],
                "fwd_wire_bytes_per_step": planned["fwd_wire"],
                "bwd_raw_bytes_per_step": planned["bwd_raw"],
                "bwd_wire_bytes_per_step": planned["bwd_wire"],
                "input_raw_bytes_per_step": planned["input_raw"],
                "input_wire_bytes_per_step": planned["input_wire"],
            }
            if planned["fwd_wire"]:
                for t in tables.values():
                    if t["sharding"] != "DP":
                        t["fwd_ratio"] = planned["fwd_raw"] / planned["fwd_wire"]
        for d in ("fwd", "bwd", "input"):
            wire = comms[f"{d}_wire_bytes_per_step"]
            comms[f"{d}_ratio"] = comms[f"{d}_raw_bytes_per_step"] / wire if wire else None
        steady_all = sum(r["steady_s"] for r in per_rank)
        steady_codec = sum(r["steady_codec_s"] for r in per_rank)
        parse = [r["parse"] for r in per_rank if r["parse"]]
        examples: list[str] = []
        for p in parse:
            examples.extend(p.get("examples", []))
        losses = [v for r in per_rank for v in r["losses"]]
        final_eval = self.history.evals[-1] if self.history.evals else {}
        counts: dict[str, int] = {}
        for t in tables.values():
            counts[t["sharding"]] = counts.get(t["sharding"], 0) + 1
        notes = list(self.notes)
        if self.resumed_from:
            notes.append(f"resumed from {self.resumed_from} at step {self.start_step}")
        return {
            "run": {
                "dataset": args.dataset,
                "data_path": args.data_path,
                "comm": args.comm,
                "comm_description": self.sharded.comm_description,
                "qcomm_backward": args.qcomm_backward if self.sharded.qcomm_codecs else None,
                "world_size": env.world_size,
                "backend": env.backend,
                "device": str(env.device),
                "batch_size": args.batch_size,
                "global_batch_size": global_batch,
                "embedding_dim": args.embedding_dim,
                "dense_arch": args.dense_arch,
                "over_arch": args.over_arch,
                "lr": args.lr,
                "emb_optimizer": args.emb_optimizer,
                "seed": args.seed,
                "data_seed": args.data_seed,
                "config": plan_source,
                "link_gbit": args.link_gbit,
                "pipeline": not args.no_pipeline,
                "sharding": args.sharding,
                "start_step": self.start_step,
                "steps_done": self.step,
                "steps_run": steps_run,
            },
            "final": {
                "auc": final_eval.get("auc"),
                "logloss": final_eval.get("logloss"),
                "eval_rows": final_eval.get("rows", 0),
                "train_loss": statistics.fmean(losses) if losses else None,
            },
            "evals": self.history.evals,
            "timing": {
                "step_time_s_mean": step_mean,
                "step_time_s_median": step_median,
                "examples_per_s": global_batch / step_mean if step_mean > 0 else None,
                "warmup_steps_excluded": warm,
                "loss_window": self.recent_losses.maxlen,
                "train_s": max(r["train_s"] for r in per_rank),
                "data_wait_s_per_step": max(r["wait"] for r in per_rank),
                "codec_encode_s": sum(c["encode"] for c in codec_s.values()),
                "codec_decode_s": sum(c["decode"] for c in codec_s.values()),
                "codec_s_by_direction": codec_s,
                "codec_time_share": steady_codec / steady_all if steady_all > 0 else 0.0,
            },
            "comms": comms,
            "tables": tables,
            "plan": {
                "planner": self.sharded.planner_name,
                "summary": ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                "text": self.sharded.plan_text,
            },
            "data": {
                "description": data.description,
                "oracle_auc": data.oracle_auc,
                "rows_read": sum(p.get("rows", 0) for p in parse),
                "malformed_rows": sum(p.get("malformed", 0) for p in parse),
                "malformed_examples": examples[:5],
            },
            "history": dataclasses.asdict(self.history),
            "error_alerts": error_alerts([r["alerts"] for r in per_rank]),
            "guard": guard_report(
                self.sharded.model,
                max(r["guard_s"] for r in per_rank),
                max(r["train_s"] for r in per_rank),
            ),
            "notes": notes,
        }


def _nanmax(a: float | None, b: float | None) -> float | None:
    vals = [v for v in (a, b) if v is not None and not math.isnan(v)]
    return max(vals) if vals else None
