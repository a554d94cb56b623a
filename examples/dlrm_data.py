"""One rank's data for the DLRM example: the source of its batches and the feed of the loop.

:func:`build_data` turns ``--dataset`` into a :class:`DataSource` (the synthetic stream or a
Criteo file read by :mod:`criteo_data`, split over ranks, with a held-out split);
:class:`TrainFeed` hands its batches to TorchRec's training pipeline from a background thread.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import criteo_data
import numpy as np
import torch
import torch.distributed as dist
from dlrm_env import DistEnv
from dlrm_metrics import auroc

__all__ = ["DataSource", "Position", "TrainFeed", "build_data"]

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
        oracle = auroc(logits, labels)

        cache: list[Any] = []
        if args.pregenerate:  # parse_args sets --steps for the synthetic stream
            cache = [train.batch(k) for k in range(args.steps)]

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
