"""Multi-process helpers for the dist tests: spawn gloo workers, build models, plans and batches.

Workers are module-level functions ``fn(rank, world_size, *args) -> picklable``; they run in
spawned processes that share one gloo process group (with a timeout, so a stuck collective
fails the test instead of hanging it) and always end with ``destroy_process_group()``.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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


def manual_plan(ebc: Any, sharder: Any, per_table: dict[str, Any], world_size: int) -> Any:
    """A ShardingPlan for ``ebc`` at module path ``""`` from sharding_plan generators."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    module_plan = construct_module_sharding_plan(
        ebc,
        per_table,
        sharder=sharder,
        local_size=world_size,
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
