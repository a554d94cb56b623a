"""Multi-process helpers for the dist tests: spawn gloo workers, build models, plans and batches.

Workers are module-level functions ``fn(rank, world_size, *args) -> picklable``; they run in
spawned processes that share one gloo process group (with a timeout, so a stuck collective
fails the test instead of hanging it) and always end with ``destroy_process_group()``.

The tables, plans, batches and training runs that several dist test modules share live here
too: test modules import from this module, never from each other.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT_S = 120


def free_port() -> int:
    """A free localhost TCP port for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gloo_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """The default gloo process group of one rank (with a timeout), destroyed on exit.

    Args:
        rank: This rank.
        world_size: Number of ranks.
        port: Rendezvous port on localhost (the same on every rank).
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    try:
        with gloo_group(rank, world_size, port):
            results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: A module-level function (spawned processes import it by name).
        world_size: Number of ranks.
        *args: Picklable arguments.
        timeout_s: Wall-clock limit for all ranks together.

    Returns:
        The ranks' return values, by rank.

    Raises:
        AssertionError: If a rank raised (its traceback is in the message) or timed out.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, tuple[bool, Any]] = {}
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        while len(out) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(out))} timed out")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                if dead and results.empty():
                    raise AssertionError(f"ranks {dead} died without a result") from None
                continue
            out[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(out.items()) if not ok]
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r][1] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# Models, plans and batches (used inside workers).


def count_exchange_calls() -> dict[str, int]:
    """Patches this process's ``dist.all_to_all_single`` and ``dist.isend`` to count their calls
    and the uint8 bytes they hand over (the lossy wire's payloads, slots and overflows).

    Returns:
        The live counts: ``a2a``, ``isend``, ``bytes`` (reset them between calls).
    """
    calls = {"a2a": 0, "isend": 0, "bytes": 0}
    a2a, isend = dist.all_to_all_single, dist.isend

    def counting_a2a(output: torch.Tensor, input: torch.Tensor, *a: Any, **kw: Any) -> Any:
        calls["a2a"] += 1
        calls["bytes"] += input.numel() if input.dtype == torch.uint8 else 0
        return a2a(output, input, *a, **kw)

    def counting_isend(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
        calls["isend"] += 1
        calls["bytes"] += tensor.numel()
        return isend(tensor, *a, **kw)

    dist.all_to_all_single = counting_a2a  # type: ignore[assignment]
    dist.isend = counting_isend  # type: ignore[assignment]
    return calls


def make_tables(specs: Sequence[tuple[str, int, int, Sequence[str]]]) -> list:
    """EmbeddingBagConfigs from ``(name, rows, dim, feature_names)`` tuples (sum pooling)."""
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=d, feature_names=list(fs))
        for n, rows, d, fs in specs
    ]


def make_ebc(tables: list, seed: int = 0, device: str = "cpu") -> Any:
    """An EmbeddingBagCollection with weights drawn from ``seed`` (same on every rank)."""
    from torchrec import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(tables=tables, device=torch.device(device))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ebc.parameters():
            p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
    return ebc


def make_batch(
    tables: list,
    batch_size: int,
    seed: int,
    max_len: int = 3,
    empty_features: Sequence[str] = (),
) -> Any:
    """A KeyedJaggedTensor over all features of ``tables`` (ids skewed toward low rows)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for t in tables:
        for f in t.feature_names:
            n = torch.randint(0, max_len + 1, (batch_size,), generator=g)
            if f in empty_features:
                n = torch.zeros_like(n)
            ids = (torch.rand(int(n.sum()), generator=g) ** 2 * t.num_embeddings).long()
            keys.append(f)
            lengths.append(n)
            values.append(ids)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )


# LossyCommsConfig keys of the exact backward (TorchRec's dense fp32 gradient): for tests that
# assert bit-identical training (the default backward is the stochastically rounded codec,
# with the gradient dedupe, which sums in another order).
EXACT_BACKWARD: dict[str, Any] = {"backward": "none", "backward_dedupe": False}


def sgd_fused_params(lr: float) -> dict[str, Any]:
    """Fused exact SGD (the optimizer runs inside the embedding backward)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr}


def manual_plan(
    ebc: Any, sharder: Any, per_table: dict[str, Any], world_size: int, local_size: int = 0
) -> Any:
    """A ShardingPlan for ``ebc`` at module path ``""`` from sharding_plan generators
    (``local_size`` ranks per host; 0: one host)."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    module_plan = construct_module_sharding_plan(
        ebc,
        per_table,
        sharder=sharder,
        local_size=local_size or world_size,
        world_size=world_size,
        device_type="cpu",
    )
    return ShardingPlan({"": module_plan})


def local_weights(sharded_state: dict[str, Any]) -> dict[str, list[tuple[Any, torch.Tensor]]]:
    """Per weight key, this rank's pieces as ``(offsets, tensor)``; offsets None: whole tensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    out: dict[str, list[tuple[Any, torch.Tensor]]] = {}
    for key, value in sharded_state.items():
        if isinstance(value, ShardedTensor):
            out[key] = [
                (tuple(s.metadata.shard_offsets), s.tensor.detach().clone())
                for s in value.local_shards()
            ]
        elif isinstance(value, DTensor):
            raise NotImplementedError("DTensor state is not used by these tests")
        elif isinstance(value, torch.Tensor):
            out[key] = [(None, value.detach().clone())]
    return out


def same_local_pieces(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two sharded state dicts hold bit-equal local pieces at the same offsets."""
    la, lb = local_weights(a), local_weights(b)
    return la.keys() == lb.keys() and all(
        oa == ob and torch.equal(ta, tb)
        for key, pieces in la.items()
        for (oa, ta), (ob, tb) in zip(pieces, lb[key], strict=True)
    )


def load_full_weights(sharded_state: dict[str, Any], full_state: dict[str, torch.Tensor]) -> None:
    """Copies full (unsharded) weights into a sharded model's state, in place.

    TorchRec re-initialises shards of a CPU module instead of copying its weights, so tests that
    compare against an unsharded model copy them explicitly.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with torch.no_grad():
        for key, value in sharded_state.items():
            full = full_state[key.removeprefix("module.")]
            if isinstance(value, ShardedTensor):
                for s in value.local_shards():
                    r0, c0 = s.metadata.shard_offsets
                    rows, cols = s.tensor.shape
                    s.tensor.copy_(full[r0 : r0 + rows, c0 : c0 + cols])
            elif isinstance(value, torch.Tensor):
                value.copy_(full)


def compare_weights(
    sharded_state: dict[str, Any], reference_state: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Max abs difference between this rank's weight pieces and the full reference weights."""
    diffs: dict[str, float] = {}
    for key, pieces in local_weights(sharded_state).items():
        ref_key = key.removeprefix("module.")
        ref = reference_state[ref_key]
        worst = 0.0
        for offsets, t in pieces:
            if offsets is None:
                expected = ref
            else:
                r0, c0 = offsets
                expected = ref[r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]]
            worst = max(worst, (t - expected).abs().max().item() if t.numel() else 0.0)
        diffs[ref_key] = worst
    return diffs


def train_step(
    model: Any, opt: torch.optim.Optimizer, kjt: Any, step: int, rank: int
) -> torch.Tensor:
    """One SGD step of a sharded EBC against a seeded random target.

    Args:
        model: The DistributedModelParallel-wrapped EBC.
        opt: Its optimizer.
        kjt: This rank's batch.
        step: Step number (seeds the target).
        rank: This rank (seeds the target).

    Returns:
        The forward outputs, features concatenated in the KJT's key order (detached).
    """
    per_key = model(kjt).wait().to_dict()
    values = torch.cat([per_key[k] for k in kjt.keys()], dim=1)  # noqa: SIM118 (a KJT)
    opt.zero_grad()
    g = torch.Generator().manual_seed(100 * step + rank)
    ((values - torch.rand(values.shape, generator=g)) ** 2).mean().backward()
    opt.step()
    return values.detach().clone()


def max_row_count(per_rank_batches: Sequence[Any]) -> int:
    """Most times one id occurs in one feature over all ranks' batches of one step."""
    counts: dict[str, torch.Tensor] = {}
    for kjt in per_rank_batches:
        for key, jt in kjt.to_dict().items():
            c = torch.bincount(jt.values())
            prev = counts.get(key)
            if prev is not None:
                n = max(len(prev), len(c))
                c = torch.nn.functional.pad(c, (0, n - len(c))) + torch.nn.functional.pad(
                    prev, (0, n - len(prev))
                )
            counts[key] = c
    return int(max((c.max() for c in counts.values() if len(c)), default=0))


# ---------------------------------------------------------------------------------------------
# Tables, plans, batches and training runs shared by several dist test modules.

CPU = torch.device("cpu")

SHARDER_TABLES = [
    ("t0", 64, 8, ["f0"]),
    ("t1", 1000, 8, ["f1", "f1b"]),
    ("t2", 257, 8, ["f2"]),
    ("t3", 30, 4, ["f3"]),
]


def sharder_plan() -> dict[str, Any]:
    """SHARDER_TABLES on 2 ranks: t0 and t1 / t3 table-wise, t2 column-wise."""
    from torchrec.distributed.sharding_plan import column_wise, table_wise

    return {
        "t0": table_wise(rank=0),
        "t1": table_wise(rank=1),
        "t2": column_wise(ranks=[0, 1]),
        "t3": table_wise(rank=1),
    }


def skewed_batch(tables: list, batch: int, seed: int) -> Any:
    """Single-hot batches of a handful of hot ids per feature, up to the last row: many repeats."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    keys = [f for t in tables for f in t.feature_names]
    ids = [
        t.num_embeddings - 1 - (torch.rand(batch, generator=g) ** 4 * 4).long()
        for t in tables
        for _ in t.feature_names
    ]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(ids), lengths=torch.ones(len(keys) * batch, dtype=torch.int64)
    )


def mixed_batch(tables: list, batch: int, seed: int) -> Any:
    """Skewed single-hot features, except f1b and f3 multi-hot (from make_batch)."""
    from torchrec import KeyedJaggedTensor

    single = skewed_batch(tables, batch, seed).to_dict()
    multi = make_batch(tables, batch, seed=seed + 1).to_dict()
    keys = [f for t in tables for f in t.feature_names]
    jts = [(multi if k in ("f1b", "f3") else single)[k] for k in keys]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat([j.values() for j in jts]),
        lengths=torch.cat([j.lengths() for j in jts]),
    )


def holey_batch(tables: list, batch: int, seed: int) -> Any:
    """Skewed single-hot features with about a third of the bags empty."""
    from torchrec import KeyedJaggedTensor

    kjt = skewed_batch(tables, batch, seed)
    keep = torch.rand(kjt.values().numel(), generator=torch.Generator().manual_seed(seed)) > 0.35
    return KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=kjt.values()[keep], lengths=keep.to(torch.int64)
    )


LR = 0.5  # SGD learning rate of TrainRun and reference_training


def random_targets(out: torch.Tensor, seed: int) -> torch.Tensor:
    """Regression targets in [-1, 1) shaped like ``out``, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(out.shape, generator=g) * 2 - 1


def mse_loss(values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return ((values - target) ** 2).mean()


class TrainRun:
    """One sharded model trained for a few steps; keeps outputs and final weights."""

    def __init__(
        self, tables: list, sharder: Any, per_table: dict, world_size: int, local_size: int = 0
    ) -> None:
        from torchrec.distributed.model_parallel import DistributedModelParallel

        ebc = make_ebc(tables, seed=0)
        plan = manual_plan(ebc, sharder, per_table, world_size, local_size)
        self.model = DistributedModelParallel(ebc, device=CPU, plan=plan, sharders=[sharder])
        load_full_weights(self.model.state_dict(), ebc.state_dict())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.outputs: list[torch.Tensor] = []

    def step(self, kjt: Any, target_seed: int) -> torch.Tensor:
        # Sharded outputs are ordered by sharding type: reorder to the unsharded key order.
        per_key = self.model(kjt).wait().to_dict()
        keys: list[str] = kjt.keys()  # a KJT, not a dict
        values = torch.cat([per_key[k] for k in keys], dim=1)
        self.outputs.append(values.detach().clone())
        self.opt.zero_grad()
        # Each rank's own loss: DDP and TorchRec's gradient division average over ranks.
        mse_loss(values, random_targets(values, target_seed)).backward()
        self.opt.step()
        return values

    def weights(self) -> dict[str, Any]:
        return self.model.state_dict()


def reference_training(tables: list, batches: list[list[Any]], world_size: int, rank: int) -> tuple:
    """Unsharded training on all ranks' batches; returns this rank's outputs and final weights."""
    ebc = make_ebc(tables, seed=0)
    opt = torch.optim.SGD(ebc.parameters(), lr=LR)
    outs = []
    for step, per_rank in enumerate(batches):
        opt.zero_grad()
        loss = 0.0
        for r, kjt in enumerate(per_rank):
            values = ebc(kjt).values()
            if r == rank:
                outs.append(values.detach().clone())
            loss = loss + mse_loss(values, random_targets(values, 1000 * step + r)) / world_size
        loss.backward()
        opt.step()
    return outs, {k: v.detach().clone() for k, v in ebc.state_dict().items()}


def column_slices(tables: list) -> dict[str, list[slice]]:
    """Output columns of each table in the KeyedTensor (features in table order)."""
    out: dict[str, list[slice]] = {}
    col = 0
    for t in tables:
        for _ in t.feature_names:
            out.setdefault(t.name, []).append(slice(col, col + t.embedding_dim))
            col += t.embedding_dim
    return out


BOUNDED_TABLES = [
    ("t0", 60, 16, ["f0"]),
    ("t1", 40, 8, ["f1", "f1b"]),
    ("t2", 50, 16, ["f2"]),
    ("t3", 30, 8, ["f3"]),
    ("t4", 20, 8, ["f4"]),
]


def bounded_config() -> Any:
    from torchrec_lossy.config import ErrorBound, LossyCommsConfig, TableCodecConfig

    return LossyCommsConfig(
        default_bound=ErrorBound("relative", 0.03),
        tables={
            "t0": TableCodecConfig(bound=ErrorBound("relative", 0.02)),
            "t1": TableCodecConfig(bound=ErrorBound("absolute", 0.01)),
            "t2*": TableCodecConfig(bound=ErrorBound("relative", 0.05)),
            "t3": TableCodecConfig(compress=False),
        },
        **EXACT_BACKWARD,  # the forward's error alone (the backward's: test_bound0_...)
    )


def bounded_plan() -> dict[str, Any]:
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, table_wise

    return {
        "t0": table_wise(rank=0),
        "t1": table_wise(rank=1),
        "t2": column_wise(ranks=[0, 1]),
        "t3": table_wise(rank=0),
        "t4": data_parallel(),
    }


def abs_bound_upper(config: Any, table: str, ref_cols: torch.Tensor) -> float:
    """An upper bound of the absolute bound any block of ``table`` got on its way here."""
    eb = config.table(table).bound
    if not config.table(table).compress:
        return 0.0
    if eb.mode == "absolute":
        return eb.value
    # A block is a subset of these columns (a column shard at most), so its range is no larger.
    return eb.value * (ref_cols.max() - ref_cols.min()).item()


class DLRMish(torch.nn.Module):
    """The EBC's pooled output through a linear head into a BCE loss (for train pipelines)."""

    def __init__(self, ebc: Any, dim_sum: int) -> None:
        super().__init__()
        self.ebc = ebc
        self.head = torch.nn.Linear(dim_sum, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.ebc(batch.sparse_features).values()).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def torchrec_test_sharding() -> Any:
    """TorchRec's ``test_utils.test_sharding`` module, importable from the wheel.

    It imports ``torchrec.distributed.tests.test_sequence_model``, which the wheel lacks: the
    vendored copy (``tests/third_party/torchrec/sequence_model.py``) is registered under that
    name first.

    Returns:
        The module.
    """
    import importlib.util
    import sys
    import types

    name = "torchrec.distributed.tests.test_sequence_model"
    if name not in sys.modules:
        path = (
            Path(__file__).resolve().parents[1] / "third_party" / "torchrec" / "sequence_model.py"
        )
        sys.modules.setdefault(
            "torchrec.distributed.tests", types.ModuleType("torchrec.distributed.tests")
        )
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return importlib.import_module("torchrec.distributed.test_utils.test_sharding")


def vbe_batch(tables: list, batch_size: int, seed: int, max_len: int = 3) -> Any:
    """A VBE KJT: each feature a random number of distinct bags, expanded to ``batch_size``.

    Args:
        tables: The tables whose features the batch holds.
        batch_size: Rows of the expanded output (``inverse_indices`` width).
        seed: Seed of the draw.
        max_len: Most ids per bag.

    Returns:
        A KeyedJaggedTensor with ``stride_per_key_per_rank`` and ``inverse_indices``.
    """
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    keys, lengths, values, strides, inverse = [], [], [], [], []
    for t in tables:
        for f in t.feature_names:
            stride = int(torch.randint(1, batch_size + 1, (1,), generator=g))
            n = torch.randint(0, max_len + 1, (stride,), generator=g)
            keys.append(f)
            lengths.append(n)
            values.append((torch.rand(int(n.sum()), generator=g) * t.num_embeddings).long())
            strides.append([stride])
            inverse.append(torch.randint(0, stride, (batch_size,), generator=g))
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=strides,
        inverse_indices=(keys, torch.stack(inverse)),
    )
