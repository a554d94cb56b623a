"""TorchRec's DLRM on Criteo, its embedding all-to-all compressed by torchrec-lossy.

Runs with no data and no arguments, on CPU (gloo) or GPUs (NCCL, one per process)::

    torchrun --standalone --nproc_per_node=2 examples/dlrm_criteo.py

The default trains on an embedded synthetic Criteo-like stream whose labels come from a hidden
model, so the held-out AUC measures learning (its ceiling, the hidden model's own AUC, is
printed beside it). Real data: ``--dataset criteo-kaggle --data-path train.txt``, ``--dataset
criteo-1tb --data-path day_0.gz`` or TorchRec's preprocessed npy files with ``--dataset
criteo-npy --data-path DIR``. ``--comm`` picks the embedding all-to-all: ``lossy`` (this project's
codec, planned by ``LossyShardingPlanner``) or one of TorchRec's qcomm codecs (``fp16``, ``bf16``,
``int8``, ``mx4``) or ``none``. See docs/example.md for every flag and for reading the report.

The model is TorchRec's ``DLRM`` in ``DLRMTrain``, sharded by ``DistributedModelParallel`` with
a fused embedding optimizer, trained by ``TrainPipelineSparseDist``. The only code that touches
torchrec-lossy is :func:`shard_model` (planner + sharder) and :class:`CommsMeter` (its stats).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import os
import queue
import shutil
import socket
import statistics
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

# Run as a script (torchrun examples/dlrm_criteo.py): the helpers live beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import criteo_data
import dlrm_report

COMM_MODES = ("none", "fp16", "bf16", "int8", "mx4", "lossy")
DATASETS = ("synthetic", "criteo-kaggle", "criteo-1tb", "criteo-npy")
DEFAULT_PRESET = {
    "synthetic": "criteo_kaggle",
    "criteo-kaggle": "criteo_kaggle",
    "criteo-1tb": "criteo_1tb",
    "criteo-npy": "criteo_1tb",
}
# The default run (synthetic, 2 CPU ranks) takes about a minute at this length.
DEFAULT_SYNTHETIC_STEPS = 1200
EMB_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
EBC_PATH = "model.sparse_arch.embedding_bag_collection"


# ------------------------------------------------------------------------------------------------
# Command line and process group
# ------------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints"
        ) from None
    if any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"{text!r}: layer sizes must be >= 1")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the example's command line.

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed flags.
    """
    ap = argparse.ArgumentParser(
        description="DLRM on Criteo with TorchRec and torchrec-lossy (run under torchrun)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = ap.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, default="synthetic")
    g.add_argument(
        "--data-path", default=None, help="raw TSV(.gz) file(s), comma-separated, or npy dir"
    )
    g.add_argument(
        "--preset",
        choices=("criteo_kaggle", "criteo_1tb"),
        default=None,
        help="table sizes (default: kaggle for synthetic/criteo-kaggle, 1tb otherwise)",
    )
    g.add_argument(
        "--max-rows", type=int, default=criteo_data.DEFAULT_MAX_ROWS, help="cap on table rows"
    )
    g.add_argument("--holdout-every", type=int, default=16, help="every N-th row of a rank is eval")
    g.add_argument("--data-seed", type=int, default=0, help="synthetic data and hidden model seed")
    g.add_argument(
        "--pregenerate",
        action="store_true",
        help="synthetic: build every training batch before step 1 (keeps data out of step time)",
    )
    g = ap.add_argument_group("model and training")
    g.add_argument("--embedding-dim", type=int, default=16)
    g.add_argument(
        "--dense-arch", type=_int_list, default=[64], help="hidden sizes; +embedding dim"
    )
    g.add_argument("--over-arch", type=_int_list, default=[128, 64], help="hidden sizes; +1")
    g.add_argument("--batch-size", type=int, default=512, help="samples per rank and step")
    g.add_argument(
        "--steps", type=int, default=None, help=f"default {DEFAULT_SYNTHETIC_STEPS} (synthetic)"
    )
    g.add_argument(
        "--epochs", type=int, default=None, help="passes over a file dataset (default 1)"
    )
    g.add_argument("--lr", type=float, default=0.05)
    g.add_argument("--emb-optimizer", choices=EMB_OPTIMIZERS, default="rowwise_adagrad")
    g.add_argument("--seed", type=int, default=0, help="model init seed")
    g.add_argument(
        "--no-pipeline", action="store_true", help="plain loop, no TrainPipelineSparseDist"
    )
    g = ap.add_argument_group("evaluation")
    g.add_argument(
        "--eval-interval", type=int, default=None, help="steps; default: 4 evals per run"
    )
    g.add_argument("--eval-batches", type=int, default=8, help="held-out batches per rank")
    g = ap.add_argument_group("communication")
    g.add_argument("--comm", choices=COMM_MODES, default="lossy")
    g.add_argument(
        "--qcomm-backward",
        choices=("fp32", "fp16", "bf16", "mx4"),
        default="fp16",
        help="gradient precision of the qcomm modes (mx4: TorchRec's MX4 both ways baseline)",
    )
    g.add_argument("--config", default=None, help="planner config YAML (configs/*.yaml)")
    g.add_argument(
        "--sharding",
        choices=("auto", "table_wise"),
        default="auto",
        help="auto: the planner decides; table_wise: every table TW (one plan for all modes)",
    )
    g.add_argument("--link-gbit", type=float, default=None, help="link the planner prices, Gbit/s")
    g = ap.add_argument_group("outputs")
    g.add_argument("--metrics-json", default=None)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--report-png", default=None)
    g.add_argument("--log-interval", type=int, default=None, help="steps between table samples")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    g.add_argument("--verbose", action="store_true", help="keep TorchRec's warnings and logs")
    g = ap.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None)
    g.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: only at the end")
    g.add_argument(
        "--simulate-failure-at",
        type=int,
        default=None,
        help="testing: the last rank dies after this step on the first attempt",
    )
    args = ap.parse_args(argv)
    if args.dataset != "synthetic" and not args.data_path:
        ap.error(f"--dataset {args.dataset} needs --data-path")
    if args.dataset == "synthetic" and args.epochs is not None:
        ap.error("the synthetic stream is endless: use --steps instead of --epochs")
    if args.pregenerate and args.dataset != "synthetic":
        ap.error("--pregenerate applies to --dataset synthetic only")
    for name in ("batch_size", "embedding_dim", "eval_batches", "max_rows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if (args.steps is not None and args.steps < 1) or (args.epochs is not None and args.epochs < 1):
        ap.error("--steps and --epochs must be >= 1")
    if args.preset is None:
        args.preset = DEFAULT_PRESET[args.dataset]
    return args


@dataclass(frozen=True)
class DistEnv:
    """Where this process runs.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks.
        local_rank: Rank on this host.
        local_world_size: Ranks on this host.
        device: ``cuda:LOCAL_RANK`` or ``cpu``.
        backend: ``"nccl"`` or ``"gloo"``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> DistEnv:
    """Initialises the process group from torchrun's environment (or as a single process).

    Returns:
        This process's placement.
    """
    if "RANK" not in os.environ:  # plain `python dlrm_criteo.py`: a world of one
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )  # fmt: skip
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=600)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart != "0":
        # torchrun keeps its store across restarts, and the failed attempt's gloo addresses
        # are still in it: the new workers would connect to dead peers. Key this attempt apart.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            int(os.environ["WORLD_SIZE"]),
            is_master=False,
            timeout=timeout,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"dlrm_criteo_attempt_{restart}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
    world_size = dist.get_world_size()
    return DistEnv(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        device=device,
        backend=backend,
    )


def _quiet_torchrec() -> None:
    """Silences TorchRec's per-table planner and DDP chatter (``--verbose`` keeps it)."""
    for name in ("torchrec", "torch.distributed", "torchrec_lossy", "root", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------

Position = tuple[int, int]  # (epoch, batch within the epoch) of a rank's stream


@dataclass
class DataSource:
    """One rank's view of the data set.

    Attributes:
        description: One line for the log.
        sizes: Rows per table.
        endless: Whether the training stream never ends (synthetic, or files with ``--steps``).
        train: ``train(start)`` yields ``(position after the batch, batch)`` from ``start`` on.
        eval_batches: The held-out batches of this rank (same count and size on every rank).
        oracle_auc: AUC of the hidden model on the held-out rows (synthetic only).
        parse_stats: Malformed-row counts of this rank so far.
    """

    description: str
    sizes: list[int]
    endless: bool
    train: Callable[[Position], Iterator[tuple[Position, Any]]]
    eval_batches: list[Any]
    oracle_auc: float | None = None
    parse_stats: Callable[[], dict[str, Any]] = dict


def _common_eval_batches(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray], batch_size: int, batches: int, env: DistEnv
) -> list[Any]:
    """Cuts held-out rows into batches of one size and count on every rank (collectives)."""
    n = torch.tensor([arrays[2].shape[0]], dtype=torch.int64, device=env.device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    rows = int(n.item())
    size = min(batch_size, rows)
    count = min(batches, rows // size) if size else 0
    dense, ids, labels = (torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
    return [
        criteo_data.make_batch(
            dense[k * size : (k + 1) * size],
            ids[k * size : (k + 1) * size],
            labels[k * size : (k + 1) * size],
        )
        for k in range(count)
    ]


def build_data(args: argparse.Namespace, env: DistEnv) -> DataSource:
    """The data source of this rank for the chosen ``--dataset``.

    Args:
        args: Parsed flags.
        env: This process's placement.

    Returns:
        The source.
    """
    sizes = criteo_data.table_sizes(args.preset, args.max_rows)
    b = args.batch_size
    if args.dataset == "synthetic":
        train = criteo_data.SyntheticCriteo(sizes, b, env.rank, env.world_size, args.data_seed)
        held = criteo_data.SyntheticCriteo(
            sizes, b, env.rank, env.world_size, args.data_seed, split="eval"
        )
        eval_batches = [held.batch(k) for k in range(args.eval_batches)]
        # The hidden model's AUC on all ranks' held-out rows: the ceiling for the trained model.
        rows = [held.global_rows(k) for k in range(args.eval_batches)]
        logits = torch.from_numpy(np.concatenate([r[3] for r in rows]))
        labels = torch.from_numpy(np.concatenate([r[2] for r in rows])).long()
        oracle = _auroc(logits, labels)

        cache: list[Any] = []
        if args.pregenerate:
            total = args.steps or DEFAULT_SYNTHETIC_STEPS
            cache = [train.batch(k) for k in range(total)]

        def synthetic_train(start: Position) -> Iterator[tuple[Position, Any]]:
            if cache:
                for k in range(start[1], len(cache)):
                    yield (0, k + 1), cache[k]
                return
            for k, batch in enumerate(train.batches(start[1]), start[1]):
                yield (0, k + 1), batch

        return DataSource(
            description=(
                f"synthetic Criteo-like stream (seed {args.data_seed}, {args.preset} sizes capped "
                f"at {args.max_rows:,} rows, Zipf ids, labels from a hidden logistic model)"
            ),
            sizes=sizes,
            endless=True,
            train=synthetic_train,
            eval_batches=eval_batches,
            oracle_auc=oracle,
        )

    paths = [p for p in str(args.data_path).split(",") if p]
    reader: criteo_data.RawCriteoReader | criteo_data.NpyCriteoReader
    if args.dataset == "criteo-npy":
        reader = criteo_data.NpyCriteoReader(
            paths[0], sizes, env.rank, env.world_size, args.holdout_every
        )
    else:
        reader = criteo_data.RawCriteoReader(
            paths, sizes, env.rank, env.world_size, args.holdout_every
        )
    eval_batches = _common_eval_batches(
        reader.arrays("eval", args.eval_batches * b), b, args.eval_batches, env
    )
    epochs = None if args.steps is not None and args.epochs is None else (args.epochs or 1)

    def file_train(start: Position) -> Iterator[tuple[Position, Any]]:
        epoch, skip = start
        while epochs is None or epoch < epochs:
            produced = 0
            for k, batch in enumerate(reader.batches("train", b, skip=skip), skip):
                produced += 1
                yield (epoch, k + 1), batch
            if produced == 0 and skip == 0:
                raise RuntimeError(
                    f"rank {env.rank} has fewer than --batch-size={b} training rows in "
                    f"{args.data_path}: use a smaller --batch-size or more data"
                )
            epoch, skip = epoch + 1, 0

    def parse_stats() -> dict[str, Any]:
        if isinstance(reader, criteo_data.RawCriteoReader):
            st = [reader.stats["train"], reader.stats["eval"]]
            return {
                "rows": sum(s.rows for s in st),
                "malformed": sum(s.skipped for s in st),
                "reasons": dict(sum((s.malformed for s in st), start=type(st[0].malformed)())),
                "examples": [e for s in st for e in s.examples][:5],
            }
        return {}

    return DataSource(
        description=f"{args.dataset} {', '.join(paths)} ({args.preset} sizes capped at "
        f"{args.max_rows:,} rows; every {args.holdout_every}th row of a rank held out)",
        sizes=sizes,
        endless=epochs is None,
        train=file_train,
        eval_batches=eval_batches,
        parse_stats=parse_stats,
    )


class TrainFeed:
    """The iterator the training pipeline pulls batches from.

    A background thread builds the next batches while the current step computes and
    communicates (data loading is not what this example measures). The feed stops after
    ``limit`` batches, remembers each batch's stream position (the pipeline prefetches, so the
    loop pops the position of each batch as it is trained), times the waits for data, and for a
    finite stream agrees with the other ranks on when to stop, so that no rank enters a
    collective its peers never join.

    Args:
        stream: ``(position, batch)`` pairs.
        limit: Batches to hand out at most (None: all).
        sync: Agree across ranks on each batch's availability (one tiny all-reduce per batch).
        device: Device of the agreement tensor.
        depth: Batches built ahead.
    """

    _END = object()

    def __init__(
        self,
        stream: Iterator[tuple[Position, Any]],
        limit: int | None,
        sync: bool,
        device: torch.device,
        depth: int = 3,
    ) -> None:
        self._sync = sync
        self._device = device
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self.positions: deque[Position] = deque()
        self.wait_s = 0.0
        self._thread = threading.Thread(
            target=self._produce, args=(stream, limit), name="train-feed", daemon=True
        )
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, stream: Iterator[tuple[Position, Any]], limit: int | None) -> None:
        try:
            for n, item in enumerate(stream):
                if limit is not None and n >= limit:
                    break
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:  # re-raised in the training thread
            self._put(e)

    def close(self) -> None:
        """Stops the background thread."""
        self._stop.set()
        self._thread.join(timeout=5)

    def __iter__(self) -> TrainFeed:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        item = self._END if self._done else self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item is self._END:
            self._done = True
        if self._sync:
            have = torch.tensor([0 if item is self._END else 1], device=self._device)
            dist.all_reduce(have, op=dist.ReduceOp.MIN)
            if int(have.item()) == 0:
                item = self._END
        self.wait_s += time.perf_counter() - start
        if item is self._END:
            raise StopIteration
        self.positions.append(item[0])
        return item[1]


# ------------------------------------------------------------------------------------------------
# Model, sharding (the torchrec-lossy seam), optimizer
# ------------------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, sizes: Sequence[int], device: torch.device) -> nn.Module:
    """TorchRec's DLRM in ``DLRMTrain``, its embedding tables on the meta device.

    Args:
        args: Parsed flags.
        sizes: Rows per table.
        device: Device of the dense part.

    Returns:
        The unsharded model.
    """
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain

    dim = args.embedding_dim
    tables = [
        EmbeddingBagConfig(name=t, embedding_dim=dim, num_embeddings=n, feature_names=[f])
        for t, f, n in zip(criteo_data.TABLE_NAMES, criteo_data.FEATURE_NAMES, sizes, strict=True)
    ]
    torch.manual_seed(args.seed)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=criteo_data.NUM_DENSE_FEATURES,
        dense_arch_layer_sizes=[*args.dense_arch, dim],
        over_arch_layer_sizes=[*args.over_arch, 1],
        dense_device=device,
    )
    return DLRMTrain(dlrm)


def load_plan_config(args: argparse.Namespace, env: DistEnv, model: nn.Module) -> tuple[Any, str]:
    """The planner config: ``--config`` (or defaults) fitted to this run's model and cluster.

    The config's ``comms`` and ``planner`` sections are used as written. Its ``embedding_tables``
    are replaced by the example's tables (their sizes come from the data), and its topology's
    world size, ranks per host and device by the facts of this run; ``--link-gbit`` overrides
    the bandwidths. Without ``--config`` the comms section is ``LossyCommsConfig()`` and the
    planner keeps every table compressed (``drop_unprofitable: false``): the example's job is
    to show the codec at work on any link.

    Args:
        args: Parsed flags.
        env: This process's placement.
        model: The unsharded model (for its tables).

    Returns:
        ``(LossyPlanConfig, description)``.
    """
    from torchrec_lossy.config import (
        EmbeddingTableConfig,
        LossyPlanConfig,
        PlannerConfig,
        load_yaml,
    )

    if args.config:
        config = load_yaml(LossyPlanConfig, args.config)
        source = args.config
    else:
        config = LossyPlanConfig(planner=PlannerConfig(drop_unprofitable=False))
        source = "defaults (LossyCommsConfig(), drop_unprofitable=false)"
    ebc = model.model.sparse_arch.embedding_bag_collection
    tables = tuple(
        EmbeddingTableConfig(
            name=c.name,
            num_embeddings=c.num_embeddings,
            embedding_dim=c.embedding_dim,
            feature_names=tuple(c.feature_names),
        )
        for c in ebc.embedding_bag_configs()
    )
    topo = dataclasses.replace(
        config.topology,
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        compute_device=env.device.type,
    )
    if args.link_gbit is not None:
        gib_s = args.link_gbit * 1e9 / 8 / (1 << 30)
        topo = dataclasses.replace(
            topo, intra_host_bandwidth_gib_s=gib_s, inter_host_bandwidth_gib_s=gib_s
        )
    planner = dataclasses.replace(
        config.planner, global_batch_size=args.batch_size * env.world_size
    )
    return (
        dataclasses.replace(config, embedding_tables=tables, topology=topo, planner=planner),
        source,
    )


def _topology(config: Any) -> Any:
    """TorchRec ``Topology`` of the config, bandwidths included (bytes/ms as TorchRec wants)."""
    from torchrec.distributed.planner.types import Topology

    t = config.topology
    kwargs: dict[str, Any] = {}
    for key, value in (
        ("intra_host_bw", t.intra_host_bandwidth_gib_s),
        ("inter_host_bw", t.inter_host_bandwidth_gib_s),
    ):
        if value is not None:
            kwargs[key] = value * (1 << 30) / 1000.0
    for key, value in (("hbm_cap", t.hbm_cap_gib), ("ddr_cap", t.ddr_cap_gib)):
        if value is not None:
            kwargs[key] = int(value * (1 << 30))
    return Topology(
        world_size=t.world_size,
        compute_device=t.compute_device,
        local_world_size=t.local_world_size or t.world_size,
        **kwargs,
    )


def fused_params(args: argparse.Namespace) -> dict[str, Any]:
    """TorchRec fused-optimizer params: the embedding update runs inside the backward.

    Args:
        args: Parsed flags.

    Returns:
        ``fused_params`` for the sharder.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    opt = {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }[args.emb_optimizer]
    params: dict[str, Any] = {"optimizer": opt, "learning_rate": args.lr}
    if args.emb_optimizer != "sgd":
        params["eps"] = 1e-8
    return params


@dataclass
class ShardedModel:
    """The model after ``DistributedModelParallel``, and what the run needs to know of its plan.

    Attributes:
        model: The DMP-wrapped ``DLRMTrain``.
        comm_description: How the embedding all-to-all travels.
        planner_name: Which planner made the plan.
        plan_text: The planner's per-table explanation.
        tables: Per table: ``rows``, ``sharding`` (TW/CW/DP...), ``ranks``.
        lossy: Whether the lossy sharder is in use.
        qcomm_codecs: TorchRec's pooled all-to-all codecs of a qcomm mode (else None).
    """

    model: nn.Module
    comm_description: str
    planner_name: str
    plan_text: str
    tables: dict[str, dict[str, Any]]
    lossy: bool
    qcomm_codecs: Any = None


_SHORT = {
    "data_parallel": "DP",
    "table_wise": "TW",
    "column_wise": "CW",
    "table_column_wise": "TWCW",
    "row_wise": "RW",
    "table_row_wise": "TWRW",
}


def shard_model(
    args: argparse.Namespace, model: nn.Module, env: DistEnv, plan_config: Any
) -> ShardedModel:
    """Plans and shards the model: the one place that wires torchrec-lossy into TorchRec.

    ``--comm lossy``: ``LossyShardingPlanner`` plans with its compression-aware cost model and
    builds the ``LossyEmbeddingBagCollectionSharder`` (adaptive bounds from the config).
    Otherwise TorchRec's ``EmbeddingBagCollectionSharder`` with TorchRec's qcomm codecs (or
    none), planned by the same planner pricing that wire format, so all modes share one
    planner and topology.

    Args:
        args: Parsed flags.
        model: The unsharded model.
        env: This process's placement.
        plan_config: The fitted ``LossyPlanConfig``.

    Returns:
        The sharded model and its plan.
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CommOp

    from torchrec_lossy.planner import LossyShardingPlanner, qcomm_model, raw_model

    topology = _topology(plan_config)
    batch = args.batch_size
    fused = fused_params(args)
    constraints = None
    if args.sharding != "auto":
        constraints = {
            t.name: ParameterConstraints(sharding_types=[args.sharding])
            for t in plan_config.embedding_tables
        }
    codecs = None
    if args.comm == "lossy":
        planner = LossyShardingPlanner(
            plan_config, topology=topology, batch_size=batch, constraints=constraints, stats=[]
        )
        sharder = planner.sharder(fused_params=fused)
        comms = plan_config.comms
        desc = (
            f"torchrec-lossy: forward {comms.default_bound.mode} bound "
            f"{comms.default_bound.value:g} (homogenization "
            f"{'on' if comms.homogenization.enabled else 'off'}, schedule "
            f"{comms.schedule.kind}), backward {comms.backward}"
        )
    else:
        registry = None
        bwd = args.qcomm_backward
        if args.comm != "none":
            fwd_type = CommType(args.comm)
            bwd_type = CommType(bwd)
            registry = get_qcomm_codecs_registry(
                QCommsConfig(forward_precision=fwd_type, backward_precision=bwd_type),
                device=env.device,
            )
            codecs = (registry or {}).get(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name)
        if args.comm == "none":
            model_cost = raw_model()
            desc = "uncompressed fp32 (TorchRec)"
        else:
            # The planner prices fp16/bf16/mx4; int8 is planned as raw traffic.
            priced = args.comm if args.comm in ("fp16", "bf16", "mx4") else None
            bwd_priced = "none" if bwd == "fp32" else bwd
            model_cost = qcomm_model(priced, bwd_priced, env.device.type) if priced else raw_model()
            desc = f"TorchRec qcomm: forward {args.comm.upper()}, backward {bwd.upper()}"
            if env.backend == "gloo" and "bf16" in (args.comm, bwd):
                desc += " (BF16 falls back to FP16 on gloo)"
        sharder = EmbeddingBagCollectionSharder(fused_params=fused, qcomm_codecs_registry=registry)
        planner = LossyShardingPlanner(
            plan_config,
            topology=topology,
            batch_size=batch,
            comms_model=model_cost,
            constraints=constraints,
            stats=[],
        )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=env.device, plan=plan, sharders=[sharder])
    sizes = {t.name: t.num_embeddings for t in plan_config.embedding_tables}
    tables: dict[str, dict[str, Any]] = {}
    for name, ps in plan.plan.get(EBC_PATH, {}).items():  # type: ignore[union-attr]
        ranks = sorted(set(ps.ranks or [])) or list(range(env.world_size))
        tables[name] = {
            "rows": sizes.get(name, 0),
            "sharding": _SHORT.get(ps.sharding_type, ps.sharding_type),
            "ranks": ",".join(map(str, ranks)) if len(ranks) <= 3 else f"{len(ranks)}r",
            "col_shards": _column_shards(ps),
        }
    return ShardedModel(
        model=dmp,
        comm_description=desc,
        planner_name=f"LossyShardingPlanner ({planner.comms_model.description})",
        plan_text=planner.explain(),
        tables=tables,
        lossy=args.comm == "lossy",
        qcomm_codecs=codecs,
    )


def _column_shards(ps: Any) -> list[tuple[int, int]]:
    """``(rank, columns)`` of each shard of an all-to-all sharded table (empty for DP)."""
    if ps.sharding_type == "data_parallel" or ps.sharding_spec is None:
        return []
    return [
        (int(s.placement.rank()), int(s.shard_sizes[1]))
        for s in ps.sharding_spec.shards  # type: ignore[union-attr]
    ]


def lossy_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The lossy-sharded EmbeddingBagCollections of a model, by module path.

    Args:
        model: The DMP model.

    Returns:
        Path to module.
    """
    from torchrec_lossy.distributed import LossyShardedEmbeddingBagCollection

    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, LossyShardedEmbeddingBagCollection)
    }


def end_of_training_step(model: nn.Module) -> None:
    """Tells the lossy modules' bound providers that an iteration finished (drives the decay).

    Args:
        model: The DMP model.
    """
    from torchrec_lossy.distributed import step_lossy_bounds

    step_lossy_bounds(model)


def bounds_state(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's bound-provider state of every lossy module (for its checkpoint file).

    Args:
        model: The DMP model.

    Returns:
        Module path to the provider's ``state_dict``.
    """
    return {
        name: {k: v.detach().clone() for k, v in m.lossy_comms.bounds.state_dict().items()}
        for name, m in lossy_modules(model).items()
    }


def load_bounds_state(model: nn.Module, saved: dict[str, dict[str, torch.Tensor]]) -> None:
    """Restores what :func:`bounds_state` saved.

    Args:
        model: The DMP model.
        saved: Module path to provider state.
    """
    for name, m in lossy_modules(model).items():
        if name in saved:
            m.lossy_comms.bounds.load_state_dict(saved[name])


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> Any:
    """The fused embedding optimizer combined with a dense optimizer for everything else.

    Args:
        model: The DMP model.
        args: Parsed flags.

    Returns:
        A TorchRec ``CombinedOptimizer`` (a ``KeyedOptimizer``).
    """
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    def dense(params: Any) -> torch.optim.Optimizer:
        if args.emb_optimizer == "sgd":
            return torch.optim.SGD(params, lr=args.lr)
        return torch.optim.Adagrad(params, lr=args.lr)

    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), dense
    )
    return CombinedOptimizer([model.fused_optimizer, dense_opt])


# ------------------------------------------------------------------------------------------------
# Communication telemetry
# ------------------------------------------------------------------------------------------------


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
        dim: Embedding dimension.
    """

    def __init__(self, sharded: ShardedModel, env: DistEnv, batch_size: int, dim: int) -> None:
        from torchrec_lossy.distributed import TableCommStats

        self.sharded = sharded
        self.env = env
        self.batch_size = batch_size
        self.dim = dim
        self._stats_cls = TableCommStats
        self.totals: dict[str, dict[str, Any]] = {"fwd": {}, "bwd": {}, "input": {}}
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
        for m in lossy_modules(self.sharded.model).values():
            stats = m.lossy_stats
            for direction in ("fwd", "bwd", "input"):
                for table, entry in stats.tables(direction).items():
                    acc = out[direction].setdefault(table, self._stats_cls())
                    acc.merge(entry)
            stats.reset()
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
                self.totals[direction].setdefault(table, self._stats_cls()).merge(entry)
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
        """Per-step all-to-all bytes over all ranks, from the plan (non-lossy modes).

        Returns:
            ``fwd_raw``, ``fwd_wire``, ``bwd_raw``, ``bwd_wire``, ``input_raw``, ``input_wire``
            (TorchRec's KJT all-to-all, which qcomm codecs leave alone: per rank, an int32
            length and an int64 id per sample and column shard of every all-to-all sharded
            table, plus the splits exchange of 3 int64 per destination and sharding type).
        """
        w = self.env.world_size
        cols = [0] * w
        shards = 0
        for t in self.sharded.tables.values():
            shards += len(t["col_shards"])
            for rank, c in t["col_shards"]:
                cols[rank] += c
        out = {"fwd_raw": 0.0, "fwd_wire": 0.0, "bwd_raw": 0.0, "bwd_wire": 0.0}
        types = {t["sharding"] for t in self.sharded.tables.values() if t["col_shards"]}
        out["input_raw"] = out["input_wire"] = float(
            w * self.batch_size * shards * (4 + 8) + len(types) * w * w * 3 * 8
        )
        codecs = self.sharded.qcomm_codecs
        for sender in range(w):
            n = self.batch_size * cols[sender]
            if n == 0:
                continue
            for _dest in range(w):
                out["fwd_raw"] += 4 * n
                out["bwd_raw"] += 4 * n
                for key, codec in (
                    ("fwd_wire", codecs.forward if codecs else None),
                    ("bwd_wire", codecs.backward if codecs else None),
                ):
                    if codec is None:
                        out[key] += 4 * n
                    else:
                        size = codec.calc_quantized_size(n, codec.create_context())
                        out[key] += size * _dtype_bytes(codec.quantized_dtype)
        return out


# ------------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------------


def _auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
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
    return {"auc": _auroc(p, y), "logloss": logloss, "rows": int(p.numel())}


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores the run: model and optimizer through ``torch.distributed.checkpoint``
    (sharded tensors stay sharded), plus one small file per rank with the step counter, the data
    position and the bound providers' state (each rank's adaptive state is its own, so it is not
    left to DCP, which keeps one copy of a replicated buffer).

    A checkpoint ``step_NNNNNNNN/`` counts once its ``COMPLETE`` marker exists; the two newest
    are kept.

    Args:
        root: Checkpoint folder.
        env: This process's placement.
        comm: The ``--comm`` mode (a checkpoint only resumes the same mode).
    """

    KEEP = 2

    def __init__(self, root: str | Path, env: DistEnv, comm: str) -> None:
        self.root = Path(root)
        self.env = env
        self.comm = comm

    def _complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(
            p for p in self.root.glob("step_*") if p.is_dir() and (p / "COMPLETE").is_file()
        )

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        done = self._complete()
        return done[-1] if done else None

    def save(self, step: int, model: nn.Module, optimizer: Any, extra: dict[str, Any]) -> Path:
        """Writes a checkpoint (collective: every rank calls it).

        Args:
            step: Training steps done.
            model: The DMP model.
            optimizer: The combined optimizer.
            extra: This rank's small state (positions, bound providers, ...).

        Returns:
            The checkpoint folder.
        """
        import torch.distributed.checkpoint as dcp

        path = self.root / f"step_{step:08d}"
        if self.env.rank == 0 and path.exists():
            shutil.rmtree(path)  # a partial one from a run that died while writing it
        dist.barrier()
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=path)
        torch.save(extra, path / f"rank{self.env.rank}.pt")
        dist.barrier()
        if self.env.rank == 0:
            meta = f"step={step}\nworld_size={self.env.world_size}\ncomm={self.comm}\n"
            (path / "COMPLETE").write_text(meta)
            for old in self._complete()[: -self.KEEP]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return path

    def load(self, path: Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """Restores model, optimizer and this rank's extra state from a checkpoint.

        Args:
            path: A complete checkpoint folder.
            model: The DMP model (same plan and world size as when saved).
            optimizer: The combined optimizer.

        Returns:
            This rank's extra state.
        """
        import torch.distributed.checkpoint as dcp

        meta = dict(
            line.split("=", 1) for line in (path / "COMPLETE").read_text().split() if "=" in line
        )
        if int(meta.get("world_size", -1)) != self.env.world_size or meta.get("comm") != self.comm:
            raise RuntimeError(
                f"checkpoint {path} was written with world_size={meta.get('world_size')} and "
                f"--comm {meta.get('comm')}; this run has world_size={self.env.world_size} and "
                f"--comm {self.comm}. Resume with the same settings or use another "
                "--checkpoint-dir"
            )
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        extra = torch.load(path / f"rank{self.env.rank}.pt", weights_only=True)
        load_bounds_state(model, extra.get("bounds", {}))
        return extra


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


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


def _gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


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


class Trainer:
    """The training loop: pipeline, evals, telemetry samples, checkpoints, progress bar.

    Args:
        args: Parsed flags.
        env: This process's placement.
        data: The data source.
        sharded: The sharded model.
        optimizer: The combined optimizer.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        env: DistEnv,
        data: DataSource,
        sharded: ShardedModel,
        optimizer: Any,
    ) -> None:
        self.args = args
        self.env = env
        self.data = data
        self.sharded = sharded
        self.model = sharded.model
        self.optimizer = optimizer
        self.meter = CommsMeter(sharded, env, args.batch_size, args.embedding_dim)
        self.history = History()
        self.step = 0
        self.start_step = 0
        self.position: Position = (0, 0)
        self.step_times: list[float] = []
        self.recent_losses: deque[float] = deque(maxlen=50)
        self.warm = 0
        self.data_wait_s = 0.0
        self.notes: list[str] = []
        self.checkpointer = (
            Checkpointer(args.checkpoint_dir, env, args.comm) if args.checkpoint_dir else None
        )
        self.resumed_from: str | None = None
        self._pending_losses: list[float] = []
        self._pending_times: list[float] = []
        self._pending_steps: list[int] = []

    # -- checkpoints ---------------------------------------------------------------------------

    def maybe_resume(self) -> None:
        """Restores the newest checkpoint of ``--checkpoint-dir``, if any."""
        if self.checkpointer is None:
            return
        path = self.checkpointer.latest()
        if path is None:
            return
        extra = self.checkpointer.load(path, self.model, self.optimizer)
        self.step = self.start_step = int(extra["step"])
        self.position = (int(extra["position"][0]), int(extra["position"][1]))
        self.resumed_from = str(path)
        if self.env.rank == 0:
            print(f"resumed from {path} at step {self.step}", flush=True)

    def save_checkpoint(self) -> None:
        """Writes a checkpoint of the current step."""
        if self.checkpointer is None:
            return
        extra = {
            "step": self.step,
            "position": list(self.position),
            "bounds": bounds_state(self.model),
        }
        self.checkpointer.save(self.step, self.model, self.optimizer, extra)

    # -- the loop ------------------------------------------------------------------------------

    def total_steps(self) -> int | None:
        """Steps the run trains in total (None: until a finite stream ends)."""
        if self.args.steps is not None:
            return self.args.steps
        if self.args.dataset == "synthetic":
            return DEFAULT_SYNTHETIC_STEPS
        return None

    def run(self) -> None:
        """Trains to the end, evaluating, sampling telemetry and checkpointing on the way."""
        from tqdm import tqdm

        args, env = self.args, self.env
        total = self.total_steps()
        eval_every = args.eval_interval or (max(1, total // 4) if total else 1000)
        log_every = args.log_interval or (max(10, total // 25) if total else 50)
        limit = None if total is None else max(0, total - self.step)
        # The first steps include lazy initialisation and the codec's JIT compilation: step
        # times and codec times are reported from the steady state after them.
        self.warm = min(max(3, (limit or 100) // 10), max(0, (limit or 100) - 1))
        feed = TrainFeed(
            self.data.train(self.position),
            limit=limit,
            sync=not self.data.endless,
            device=env.device,
        )
        pipeline = self._make_pipeline()
        bar = tqdm(
            total=total,
            initial=self.step,
            disable=env.rank != 0 or args.no_progress,
            dynamic_ncols=True,
            mininterval=1.0,
            desc=f"train {args.comm}",
            file=sys.stderr,
        )
        fail_at = args.simulate_failure_at
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        last_rank = env.rank == env.world_size - 1
        last_auc = float("nan")
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    loss = self._train_step(pipeline, feed)
                except StopIteration:
                    break
                dt = time.perf_counter() - t0
                self.step += 1
                self.position = feed.positions.popleft()
                end_of_training_step(self.model)
                self.step_times.append(dt)
                self.recent_losses.append(loss)
                self._pending_losses.append(loss)
                self._pending_times.append(dt)
                self._pending_steps.append(self.step)
                bar.update(1)
                if len(self.step_times) == self.warm:
                    self.meter.sample("train")
                    self.meter.mark_steady()
                if self.step % log_every == 0:
                    ratio = self._log_sample()
                    bar.set_postfix(loss=f"{statistics.fmean(self.recent_losses):.4f}",
                                    auc=f"{last_auc:.4f}", ratio=f"{ratio:.1f}x")  # fmt: skip
                if self.step % eval_every == 0 and (total is None or self.step < total):
                    last_auc = self._eval(pipeline)["auc"]
                if args.checkpoint_every and self.step % args.checkpoint_every == 0:
                    self.save_checkpoint()
                if fail_at is not None and self.step == fail_at and first_attempt and last_rank:
                    print(f"rank {env.rank}: simulated failure after step {self.step}", flush=True)
                    os._exit(17)
        finally:
            feed.close()
            bar.close()
        self.data_wait_s = feed.wait_s
        if self._pending_steps:
            self._log_sample()
        self._eval(pipeline)
        if self.checkpointer:
            self.save_checkpoint()

    def _make_pipeline(self) -> Any:
        if self.args.no_pipeline:
            self.notes.append("plain training loop (--no-pipeline)")
            return None
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        return TrainPipelineSparseDist(
            self.model, self.optimizer, self.env.device, execute_all_batches=True
        )

    def _train_step(self, pipeline: Any, feed: TrainFeed) -> float:
        if pipeline is not None:
            loss, _, _ = pipeline.progress(feed)
            return float(loss)
        batch = next(feed).to(self.env.device)
        self.optimizer.zero_grad()
        loss, _ = self.model(batch)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def _log_sample(self) -> float:
        """Averages the pending per-step losses and times over ranks and samples the tables."""
        losses = torch.tensor(self._pending_losses, dtype=torch.float64, device=self.env.device)
        times = torch.tensor(self._pending_times, dtype=torch.float64, device=self.env.device)
        dist.all_reduce(losses)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        interval = self.meter.sample("train")
        local = _interval_tables(interval, self.meter.bounds())
        per_rank = _gather_objects(local, self.env)
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
        return ratio

    def _eval(self, pipeline: Any) -> dict[str, float]:
        self.meter.sample("train")
        if pipeline is not None:
            pipeline.detach()
        result = evaluate(self.model, self.data.eval_batches, self.env)
        if pipeline is not None:
            pipeline.attach(self.model)
        self.meter.sample("eval")
        result = {"step": self.step, **result}
        self.history.evals.append(result)
        return result

    # -- results -------------------------------------------------------------------------------

    def metrics(self, plan_source: str) -> dict[str, Any]:
        """Everything the run measured, reduced over ranks (a collective).

        Args:
            plan_source: Where the planner config came from.

        Returns:
            The metrics dict (meaningful on rank 0).
        """
        args, env = self.args, self.env
        steps_run = len(self.step_times)
        warm = min(getattr(self, "warm", 0), max(0, steps_run - 1))
        steady = self.step_times[warm:]
        times = torch.tensor(steady or [float("nan")], dtype=torch.float64)
        per_rank = _gather_objects(
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
                "parse": self.data.parse_stats(),
                "losses": list(self.recent_losses),
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
        enc = dec = 0.0
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
                            if e["rows_sent"]:  # raw = what TorchRec would have sent
                                raw = raw * e["rows"] // e["rows_sent"]
                        sums[d][0] += raw
                        sums[d][1] += e["wire_bytes"]
                        enc += e["encode_s"]
                        dec += e["decode_s"]
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
                for name, b in r["bounds"].items():
                    if name in tables and "raw_bytes" in tables[name]:
                        tables[name].update(b)
            n = max(1, steps_run)
            comms = {
                "source": "measured",
                "fwd_raw_bytes_per_step": sums["fwd"][0] / n,
                "fwd_wire_bytes_per_step": sums["fwd"][1] / n,
                "fwd_coded_bytes_per_step": fwd_coded / n,
                "bwd_raw_bytes_per_step": sums["bwd"][0] / n,
                "bwd_wire_bytes_per_step": sums["bwd"][1] / n,
                "input_raw_bytes_per_step": sums["input"][0] / n,
                "input_wire_bytes_per_step": sums["input"][1] / n,
            }
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
                "codec_encode_s": enc,
                "codec_decode_s": dec,
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
                "description": self.data.description,
                "oracle_auc": self.data.oracle_auc,
                "rows_read": sum(p.get("rows", 0) for p in parse),
                "malformed_rows": sum(p.get("malformed", 0) for p in parse),
                "malformed_examples": examples[:5],
            },
            "history": dataclasses.asdict(self.history),
            "notes": notes,
        }


def _nanmax(a: float | None, b: float | None) -> float | None:
    vals = [v for v in (a, b) if v is not None and not math.isnan(v)]
    return max(vals) if vals else None


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, env: DistEnv) -> dict[str, Any]:
    """The whole example on an initialised process group.

    Args:
        args: Parsed flags.
        env: This process's placement.

    Returns:
        The metrics (complete on rank 0).
    """
    t_start = time.perf_counter()
    data = build_data(args, env)
    model = build_model(args, data.sizes, env.device)
    plan_config, plan_source = load_plan_config(args, env, model)
    try:
        sharded = shard_model(args, model, env, plan_config)
    except Exception as e:
        raise RuntimeError(f"sharding with --comm {args.comm} failed: {e}") from e
    optimizer = build_optimizer(sharded.model, args)
    if env.rank == 0:
        print(f"data: {data.description}", flush=True)
        print(f"comm: {sharded.comm_description}", flush=True)
        print(f"plan ({plan_source}):\n{sharded.plan_text}", flush=True)
    trainer = Trainer(args, env, data, sharded, optimizer)
    trainer.maybe_resume()
    try:
        trainer.run()
    except Exception as e:
        if args.comm == "int8":
            raise RuntimeError(
                f"--comm int8 failed during training on {env.backend}: {type(e).__name__}: {e}. "
                "TorchRec's INT8 qcomm codec does not work with this plan on CPU/gloo "
                "(mixed data-parallel + table-wise sharding); use --comm fp16 or mx4"
            ) from e
        raise
    metrics = trainer.metrics(plan_source)
    metrics["timing"]["total_wall_s"] = time.perf_counter() - t_start
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (one process per rank under torchrun).

    Args:
        argv: Command line (default ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    args = parse_args(argv)
    if not args.verbose:
        _quiet_torchrec()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    env = init_distributed()
    try:
        metrics = run(args, env)
        if env.rank == 0:
            print(dlrm_report.format_summary(metrics), flush=True)
            if args.metrics_json:
                dlrm_report.write_json(metrics, args.metrics_json)
            if args.tensorboard_dir:
                dlrm_report.write_tensorboard(metrics, args.tensorboard_dir)
            if args.report_png:
                dlrm_report.write_png(metrics, args.report_png)
            for flag, path in (
                ("metrics", args.metrics_json),
                ("tensorboard", args.tensorboard_dir),
                ("report", args.report_png),
            ):
                if path:
                    print(f"{flag}: {path}", flush=True)
        # Leave together: a rank that tears down while its peer still talks to it (or to the
        # store) can abort at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
