"""TorchRec's DLRM on Criteo, its embedding all-to-all compressed by torchrec-lossy.

Runs with no data and no arguments, on CPU (gloo) or GPUs (NCCL, one per process)::

    torchrun --standalone --nproc_per_node=2 examples/dlrm_criteo.py

The default trains on an embedded synthetic Criteo-like stream whose labels come from a hidden
model, so the held-out AUC measures learning (its ceiling, the hidden model's own AUC, is
printed beside it). Real data: ``--dataset criteo-kaggle --data-path train.txt``, ``--dataset
criteo-1tb --data-path day_0.gz`` or TorchRec's preprocessed npy files with ``--dataset
criteo-npy --data-path DIR``. ``--comm`` picks the embedding all-to-all: ``lossy`` (this project's
codec, planned by ``LossyShardingPlanner``) or one of TorchRec's qcomm codecs (``fp16``, ``bf16``,
``int8``, ``mx4``; ``--qcomm-backward`` for the gradients) or ``none``. See docs/example.md.

This file is what a TorchRec user reads: arguments, model, sharding (:func:`shard_model`, the
one place torchrec-lossy is wired in) and the training loop. Beside it: data (``dlrm_data``,
``criteo_data``), measurements (``dlrm_metrics``), checkpoints (``dlrm_checkpoint``), process
group and planner config (``dlrm_env``) and the report (``dlrm_report``).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Run as a script (torchrun examples/dlrm_criteo.py): the helpers live beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import criteo_data
import dlrm_report
from dlrm_checkpoint import Checkpointer, simulate_failure
from dlrm_data import DataSource, TrainFeed, build_data
from dlrm_env import DistEnv, init_distributed, load_plan_config, quiet_torchrec
from dlrm_metrics import RunLog, ShardedModel, plan_tables

from torchrec_lossy.config import ConfigError, LossyPlanConfig, load_yaml

COMM_MODES = ("none", "fp16", "bf16", "int8", "mx4", "lossy")
# fp8 is not offered: fbgemm-gpu-cpu 1.8.0's row-wise FP8 raises "fp8 is not supported by CPU"
# and its plain FP8 saturates at 0.9375 (every larger magnitude is clipped) on CPU.
QCOMM_BACKWARD = ("fp32", "fp16", "bf16", "mx4")
DATASETS = ("synthetic", "criteo-kaggle", "criteo-1tb", "criteo-npy")
DEFAULT_PRESET = {"synthetic": "criteo_kaggle", "criteo-kaggle": "criteo_kaggle"}
DEFAULT_SYNTHETIC_STEPS = 1200  # the default run (synthetic, 2 CPU ranks) takes about a minute
EMB_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
EBC_PATH = "model.sparse_arch.embedding_bag_collection"


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
    """Parses the example's command line (docs/example.md lists every flag).

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed flags; ``--steps`` is set for the synthetic stream, ``--preset`` always.
    """
    ap = argparse.ArgumentParser(
        description="DLRM on Criteo with TorchRec and torchrec-lossy (run under torchrun)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # fmt: off
    g = ap.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, default="synthetic")
    g.add_argument("--data-path", help="raw TSV(.gz) file(s), comma-separated, or npy dir")
    g.add_argument("--preset", choices=("criteo_kaggle", "criteo_1tb"), default=None,
                   help="table sizes (default: kaggle for synthetic/criteo-kaggle, 1tb otherwise)")
    g.add_argument("--max-rows", type=int, default=criteo_data.DEFAULT_MAX_ROWS,
                   help="cap on table rows")
    g.add_argument("--holdout-every", type=int, default=16, help="every N-th row of a rank is eval")
    g.add_argument("--data-seed", type=int, default=0, help="synthetic data and hidden model seed")
    g.add_argument("--pregenerate", action="store_true",
                   help="synthetic: build every training batch before step 1 (benchmarks)")
    g = ap.add_argument_group("model and training")
    g.add_argument("--embedding-dim", type=int, default=16)
    g.add_argument("--dense-arch", type=_int_list, default=[64], help="hidden sizes; +emb dim")
    g.add_argument("--over-arch", type=_int_list, default=[128, 64], help="hidden sizes; +1")
    g.add_argument("--batch-size", type=int, default=512, help="samples per rank and step")
    g.add_argument("--steps", type=int, help=f"default {DEFAULT_SYNTHETIC_STEPS} (synthetic)")
    g.add_argument("--epochs", type=int, help="passes over a file dataset (default 1)")
    g.add_argument("--lr", type=float, default=0.05)
    g.add_argument("--emb-optimizer", choices=EMB_OPTIMIZERS, default="rowwise_adagrad")
    g.add_argument("--seed", type=int, default=0, help="model init seed")
    g.add_argument("--no-pipeline", action="store_true", help="no TrainPipelineSparseDist")
    g = ap.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=int, help="steps; default: 4 evals per run")
    g.add_argument("--eval-batches", type=int, default=8, help="held-out batches per rank")
    g = ap.add_argument_group("communication")
    g.add_argument("--comm", choices=COMM_MODES, default="lossy")
    g.add_argument("--qcomm-backward", choices=QCOMM_BACKWARD, default="fp16",
                   help="gradient precision of the qcomm modes (mx4 with --comm mx4: TorchRec's "
                   "MX4 both ways; no fp8: fbgemm-gpu-cpu's FP8 fails or clips on CPU)")
    g.add_argument("--config", help="planner config YAML (configs/*.yaml)")
    g.add_argument("--sharding", choices=("auto", "table_wise"), default="auto",
                   help="auto: the planner decides; table_wise: every table TW")
    g.add_argument("--link-gbit", type=float, help="link the planner prices, Gbit/s")
    g = ap.add_argument_group("outputs")
    for flag in ("--metrics-json", "--tensorboard-dir", "--report-png"):
        g.add_argument(flag)
    g.add_argument("--log-interval", type=int, help="steps between table samples")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    g.add_argument("--verbose", action="store_true", help="keep TorchRec's warnings and logs")
    g = ap.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir")
    g.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: only at the end")
    g.add_argument("--recheck-every", type=int, default=500,
                   help="steps between format re-checks where auto codes a table; 0: off")
    g.add_argument("--simulate-failure-at", type=int,
                   help="testing: the last rank dies after this step on the first attempt")
    # fmt: on
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
    args.preset = args.preset or DEFAULT_PRESET.get(args.dataset, "criteo_1tb")
    if args.dataset == "synthetic" and args.steps is None:
        args.steps = DEFAULT_SYNTHETIC_STEPS
    return args


def build_model(args: argparse.Namespace, sizes: Sequence[int], device: torch.device) -> nn.Module:
    """TorchRec's DLRM in ``DLRMTrain`` (BCE loss), its embedding tables on the meta device.

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
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=criteo_data.NUM_DENSE_FEATURES,
        dense_arch_layer_sizes=[*args.dense_arch, dim],
        over_arch_layer_sizes=[*args.over_arch, 1],
        dense_device=device,
    )
    return DLRMTrain(dlrm)


def fused_params(args: argparse.Namespace) -> dict[str, Any]:
    """TorchRec fused-optimizer params: the embedding update runs inside the backward.

    Args:
        args: Parsed flags.

    Returns:
        ``fused_params`` for the sharder.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    opt = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
           "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[args.emb_optimizer]  # fmt: skip
    params: dict[str, Any] = {"optimizer": opt, "learning_rate": args.lr}
    if args.emb_optimizer != "sgd":
        params["eps"] = 1e-8
    return params


def shard_model(
    args: argparse.Namespace,
    model: nn.Module,
    env: DistEnv,
    plan_config: Any,
    checkpointer: Checkpointer | None = None,
) -> ShardedModel:
    """Plans and shards the model: the one place that wires torchrec-lossy into TorchRec.

    ``--comm lossy``: ``LossyShardingPlanner`` plans with its compression-aware cost model and
    builds the ``LossyEmbeddingBagCollectionSharder`` (adaptive bounds from the config).
    Otherwise TorchRec's ``EmbeddingBagCollectionSharder`` with TorchRec's qcomm codecs (or
    none), planned by the same planner pricing that wire format on the same topology.

    Args:
        args: Parsed flags.
        model: The unsharded model.
        env: This process's placement.
        plan_config: The fitted ``LossyPlanConfig``.
        checkpointer: With ``--checkpoint-dir``: the speeds the plan is made from are the
            first attempt's, so that a resumed run gets its checkpoint's plan.

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

    from torchrec_lossy.planner import LossyShardingPlanner, build_topology, qcomm_model, raw_model

    planner_args: dict[str, Any] = {
        "topology": build_topology(plan_config.topology),
        "batch_size": args.batch_size,
        "stats": [],
    }
    if args.sharding != "auto":
        planner_args["constraints"] = {
            t.name: ParameterConstraints(sharding_types=[args.sharding])
            for t in plan_config.embedding_tables
        }
    codecs = None
    if args.comm == "lossy":

        def measure() -> Any:
            return format_speeds(args, env, plan_config)

        speeds = checkpointer.planned_speeds(measure) if checkpointer else measure()
        planner = LossyShardingPlanner(plan_config, speeds=speeds, **planner_args)
        sharder = planner.sharder(fused_params=fused_params(args))
        c = plan_config.comms
        desc = (f"torchrec-lossy: format {c.format}, forward {c.default_bound.mode} bound "
                f"{c.default_bound.value:g} "
                f"(homogenization {'on' if c.homogenization.enabled else 'off'}, schedule "
                f"{c.schedule.kind}), backward {c.backward}")  # fmt: skip
        if planner.torchrec_path:
            desc += "; auto: no table coded, TorchRec's own all-to-all (see the plan)"
    else:
        registry, bwd = None, args.qcomm_backward
        model_cost, desc = raw_model(), "uncompressed fp32 (TorchRec)"
        if args.comm != "none":
            qcomms = QCommsConfig(forward_precision=CommType(args.comm),
                                  backward_precision=CommType(bwd))  # fmt: skip
            registry = get_qcomm_codecs_registry(qcomms, device=env.device)
            codecs = (registry or {}).get(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name)
            desc = f"TorchRec qcomm: forward {args.comm.upper()}, backward {bwd.upper()}"
            if env.backend == "gloo" and "bf16" in (args.comm, bwd):
                desc += " (BF16 falls back to FP16 on gloo)"
            if args.comm != "int8":  # the planner prices fp16/bf16/mx4; int8 is planned raw
                bwd_priced = "none" if bwd == "fp32" else bwd
                model_cost = qcomm_model(args.comm, bwd_priced, env.device.type)
        sharder = EmbeddingBagCollectionSharder(
            fused_params=fused_params(args), qcomm_codecs_registry=registry
        )
        planner = LossyShardingPlanner(plan_config, comms_model=model_cost, **planner_args)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=env.device, plan=plan, sharders=[sharder])
    return ShardedModel(
        model=dmp,
        comm_description=desc,
        planner_name=f"LossyShardingPlanner ({planner.comms_model.description})",
        plan_text=planner.explain(),
        tables=plan_tables(plan.plan.get(EBC_PATH, {}), plan_config, env.world_size),
        lossy=args.comm == "lossy" and not planner.torchrec_path,
        qcomm_codecs=codecs,
        recheck=recheck_args(planner, env.device) if args.comm == "lossy" else {},
    )


def recheck_args(planner: Any, device: torch.device) -> dict[str, Any]:
    """The run's format re-check (``RuntimeRecheck``'s arguments) where ``comms.format: auto``
    runs the seam: the planner's wire and codec ms a step, raw and coded; the choice it started
    with (raw where every table resolved raw: the codec then timed again at each check, a
    start-up calibration under load may have priced it too slow); else empty (no re-check).

    Args:
        planner: The ``LossyShardingPlanner``.
        device: Where the codec runs.

    Returns:
        ``step_ms``, ``start``, ``coded_tables`` and ``remeasure`` for ``RuntimeRecheck``, or
        ``{}``.
    """
    from torchrec_lossy.planner import LossyCommsModel
    from torchrec_lossy.planner.recheck import codec_remeasure

    model = planner.comms_model
    if planner.torchrec_path or not isinstance(model, LossyCommsModel):
        return {}
    user, comms = planner.config.comms, planner.comms_config
    tables = [t.name for t in planner.config.embedding_tables]
    auto = [t for t in tables if user.table(t).format == "auto"]
    step_ms = model.step_ms()
    if user.format != "auto" or not auto or not step_ms:
        return {}
    if any(comms.table(t).compress for t in tables):
        return {"step_ms": step_ms}
    return {
        "step_ms": step_ms,
        "start": "raw",
        "coded_tables": auto,
        "remeasure": codec_remeasure(model, device),
    }


def format_speeds(args: argparse.Namespace, env: DistEnv, plan_config: Any) -> Any:
    """The wire formats' speeds on this device for this layout, the same on every rank.

    Each rank times the codec and the casts on one destination's blocks (every table,
    ``--batch-size`` rows) and the seam's fixed cost per step; every rank then takes the
    slowest rank's figures, so the planner's format choice (``comms.format: auto``) is the same
    everywhere.

    Args:
        args: Parsed flags.
        env: This process's placement.
        plan_config: The fitted ``LossyPlanConfig``.

    Returns:
        The agreed ``Speeds``.
    """
    from torchrec_lossy.planner import agree_speeds, measure_speeds

    tables = plan_config.embedding_tables
    speeds = measure_speeds(
        tables, args.batch_size, plan_config.comms, env.device, world_size=env.world_size,
        group=dist.GroupMember.WORLD,
    )  # fmt: skip
    return agree_speeds(speeds, dist.GroupMember.WORLD, env.device)


def live_codec_s(model: nn.Module) -> float:
    """This rank's codec seconds so far in the live (not yet sampled) telemetry.

    Args:
        model: The DMP model.

    Returns:
        Encode + decode seconds over every lossy module, direction and table.
    """
    from torchrec_lossy.distributed import lossy_stats

    return sum(e.encode_s + e.decode_s for st in lossy_stats(model).values() for _, _, e in st)


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

    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    return CombinedOptimizer([model.fused_optimizer, KeyedOptimizerWrapper(dense_params, dense)])


def train(
    args: argparse.Namespace, env: DistEnv, data: DataSource, model: nn.Module, optimizer: Any,
    log: RunLog, checkpointer: Checkpointer | None,
    recheck_args: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Trains to the end: TorchRec's pipeline, evaluations, telemetry samples, checkpoints.

    Args:
        args: Parsed flags.
        env: This process's placement.
        data: The data source.
        model: The DMP model.
        optimizer: The combined optimizer.
        log: Where steps, samples and evaluations are recorded.
        checkpointer: Saves (and has resumed) the run, if ``--checkpoint-dir`` is given.
        recheck_args: The re-check's arguments (``ShardedModel.recheck``); empty or None: no
            re-check. Every ``--recheck-every`` steps the ranks agree whether the coded tables
            go raw (or back, or a raw start's auto tables coded), from the measured step and
            codec times; a switch is logged in the run's notes and saved with checkpoints.
    """
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from torchrec_lossy.distributed import step_lossy_bounds

    position = (0, 0)
    recheck = None
    if recheck_args and args.recheck_every > 0:
        from torchrec_lossy.planner.recheck import RecheckConfig, RuntimeRecheck

        recheck = RuntimeRecheck(
            model, config=RecheckConfig(every_steps=args.recheck_every),
            group=dist.GroupMember.WORLD, **recheck_args,
        )  # fmt: skip
        if checkpointer:
            checkpointer.recheck = recheck
    resumed = checkpointer.resume(model, optimizer) if checkpointer else None
    if resumed:
        position = resumed.position
        log.resumed(resumed.step, resumed.path, resumed.recent_losses)
    total = args.steps  # None: until a finite file stream ends
    eval_every = args.eval_interval or (max(1, total // 4) if total else 1000)
    log_every = args.log_interval or (max(10, total // 25) if total else 50)
    limit = None if total is None else max(0, total - log.step)
    log.start(limit, total, f"train {args.comm}", progress_bar=not args.no_progress)
    feed = TrainFeed(data.train(position), limit, sync=not data.endless, device=env.device)
    pipeline = None
    if args.no_pipeline:
        log.notes.append("plain training loop (--no-pipeline)")
    else:
        pipeline = TrainPipelineSparseDist(model, optimizer, env.device, execute_all_batches=True)

    try:
        while True:
            t0 = time.perf_counter()
            codec0 = live_codec_s(model) if recheck else 0.0
            try:
                if pipeline is not None:
                    loss = float(pipeline.progress(feed)[0])
                else:
                    batch = next(feed).to(env.device)
                    optimizer.zero_grad()
                    out, _ = model(batch)
                    out.backward()
                    optimizer.step()
                    loss = float(out.detach())
            except StopIteration:
                break
            step_s = time.perf_counter() - t0
            log.record_step(loss, step_s)
            position = feed.positions.popleft()
            step_lossy_bounds(model)  # drives the adaptive bounds' schedule (no-op otherwise)
            step = log.step
            if recheck is not None:  # collective on check steps: every rank reaches it
                switched = recheck.step(step, step_s, live_codec_s(model) - codec0)
                if switched is not None:
                    log.notes.append(f"format re-check at step {step}: now {switched}")
            if step % log_every == 0:
                log.sample()
            if step % eval_every == 0 and (total is None or step < total):
                log.evaluate(model, data.eval_batches, pipeline)
            if checkpointer and args.checkpoint_every and step % args.checkpoint_every == 0:
                checkpointer.save_step(step, position, model, optimizer, log.recent_losses)
            if step == args.simulate_failure_at:
                simulate_failure(env, step)  # testing: the last rank dies on the first attempt
    finally:
        feed.close()
        log.close()
    log.data_wait_s = feed.wait_s
    log.sample()
    log.evaluate(model, data.eval_batches, pipeline)
    if checkpointer:
        checkpointer.save_step(log.step, position, model, optimizer, log.recent_losses)


def run(args: argparse.Namespace, env: DistEnv) -> dict[str, Any]:
    """The whole example on an initialised process group.

    Args:
        args: Parsed flags.
        env: This process's placement.

    Returns:
        The metrics (complete on rank 0).
    """
    t_start = time.perf_counter()
    if args.config:  # a bad file fails every rank here, before the data is built
        load_yaml(LossyPlanConfig, args.config)
    data = build_data(args, env)
    model = build_model(args, data.sizes, env.device)
    plan_config, plan_source = load_plan_config(args, env, model)
    ckpt = Checkpointer(args.checkpoint_dir, env, args.comm) if args.checkpoint_dir else None
    try:
        sharded = shard_model(args, model, env, plan_config, ckpt)
    except ConfigError:
        raise  # already one line naming the keys (e.g. ranks given different configs)
    except Exception as e:
        raise RuntimeError(f"sharding with --comm {args.comm} failed: {e}") from e
    optimizer = build_optimizer(sharded.model, args)
    if env.rank == 0:
        print(f"data: {data.description}\ncomm: {sharded.comm_description}", flush=True)
        print(f"plan ({plan_source}):\n{sharded.plan_text}", flush=True)
    log = RunLog(sharded, env, args.batch_size)
    try:
        train(args, env, data, sharded.model, optimizer, log, ckpt, sharded.recheck)
    except Exception as e:
        if args.comm == "int8":
            raise RuntimeError(
                f"--comm int8 failed during training on {env.backend}: {type(e).__name__}: {e}. "
                "TorchRec's INT8 qcomm codec does not work with this plan on CPU/gloo "
                "(mixed data-parallel + table-wise sharding); use --comm fp16 or mx4"
            ) from e
        raise
    metrics = log.metrics(args, data, plan_source)
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
        quiet_torchrec()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    env = init_distributed()
    try:
        metrics = run(args, env)
        if env.rank == 0:
            print(dlrm_report.format_summary(metrics), flush=True)
            dlrm_report.write_outputs(
                metrics, args.metrics_json, args.tensorboard_dir, args.report_png
            )
        # Leave together: a rank that tears down while its peer still talks to it (or to the
        # store) can abort at exit.
        dist.barrier()
    except ConfigError as e:  # every rank reads the same file (and checks the config together)
        return config_failure(e, env)
    finally:
        dist.destroy_process_group()
    return 0


def config_failure(error: ConfigError, env: DistEnv) -> int:
    """Reports a config error as one line of this process, without a traceback, and waits for
    the other ranks (which fail alike) so that each prints its line before torchrun stops them.

    Args:
        error: The error; its message names the file or key, the value and the fix.
        env: This process's placement.

    Returns:
        The exit status (2, as argparse's usage errors).
    """
    # One write of the whole line: the ranks share torchrun's stderr.
    os.write(2, f"rank {env.rank}: config error: {error}\n".encode())
    try:  # bounded: a rank that did not fail must not keep this one waiting
        if env.backend == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        else:
            dist.barrier()
    except Exception:  # the error is reported; leaving is all that is left
        pass
    return 2


if __name__ == "__main__":
    code = main()
    # All work is done and the process group destroyed: skip the interpreter's teardown, where a
    # C++ worker thread still joinable at static destruction intermittently aborts the process
    # ("terminate called without an active exception", exit -6) after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
