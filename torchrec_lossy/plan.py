"""Preview a compression-aware sharding plan without starting any process.

``python -m torchrec_lossy.plan --config configs/criteo_1tb.yaml --world-size 16
--local-world-size 8 --batch-size 65536`` (the global batch) builds the tables on the meta device,
plans them with :class:`~torchrec_lossy.planner.LossyShardingPlanner` on a simulated topology,
prints each table's choice and reason, and compares the estimated embedding communication per
step with no compression and TorchRec's FP16 and MX4 (both ways) qcomm. See ``docs/config.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchrec_lossy.config import ConfigError, LossyPlanConfig, load_yaml

__all__ = ["ScenarioResult", "main", "preview"]


@dataclass(frozen=True)
class ScenarioResult:
    """One planning scenario of the preview.

    Attributes:
        label: Scenario name.
        description: What its wire formats are.
        shardings: Tables per sharding type, e.g. ``"TW 16, DP 10"``.
        cost: Estimated per-step costs (``StepCost``).
        explanation: The explained plan.
    """

    label: str
    description: str
    shardings: str
    cost: Any
    explanation: str


def _apply_overrides(config: LossyPlanConfig, args: argparse.Namespace) -> LossyPlanConfig:
    topo = config.topology
    changes: dict[str, Any] = {}
    if args.world_size is not None:
        changes["world_size"] = args.world_size
    if args.local_world_size is not None:
        changes["local_world_size"] = args.local_world_size
    if args.compute_device is not None:
        changes["compute_device"] = args.compute_device
    if changes:
        if "world_size" in changes and "local_world_size" not in changes:
            lw = topo.local_world_size
            if lw is not None and changes["world_size"] % lw:
                changes["local_world_size"] = None
        topo = dataclasses.replace(topo, **changes)
    planner = config.planner
    if args.batch_size is not None:
        planner = dataclasses.replace(planner, global_batch_size=args.batch_size)
    return dataclasses.replace(config, topology=topo, planner=planner)


def preview(
    config: LossyPlanConfig, calibrate_rows: int = 0, out: Any = None, speeds: Any = None
) -> list[ScenarioResult]:
    """Plans the config's model in four scenarios and prints the comparison.

    Args:
        config: The plan config (with its tables).
        calibrate_rows: If > 0, measure each table's ratio with the real codec on this many
            rows of Criteo-like synthetic traffic before planning ours.
        out: Text stream to print to; default stdout.
        speeds: The formats' speeds ours is planned with (``planner.speeds.Speeds``, e.g.
            from :func:`measured_speeds`); None: the device defaults.

    Returns:
        The scenarios, ours last.
    """
    from torchrec_lossy.planner import build_module, qcomm_model, raw_model

    out = out or sys.stdout
    _print_model(config, out)
    module = build_module(config.embedding_tables)
    device = config.topology.compute_device
    scenarios = [
        ("no compression", raw_model()),
        ("TorchRec FP16", qcomm_model("fp16", "fp16", device)),
        ("TorchRec MX4", qcomm_model("mx4", "mx4", device)),
        ("torchrec-lossy", None),
    ]
    # TorchRec's uncompressed estimates are the same in every scenario: compute them once.
    base_cache: dict[Any, Any] = {}
    results = [
        _plan_scenario(label, model, config, module, base_cache, calibrate_rows, out, speeds)
        for label, model in scenarios
    ]
    print(f"\nplan ({results[-1].description}):", file=out)
    print(results[-1].explanation.split("\n", 1)[1], file=out)
    _print_comparison(results, out)
    return results


def _print_model(config: LossyPlanConfig, out: Any) -> None:
    """Prints the model's size, the topology and the batch."""
    from torchrec_lossy.planner import per_rank_batch_size

    topo = config.topology
    rows = sum(t.num_embeddings for t in config.embedding_tables)
    params = sum(t.num_embeddings * t.embedding_dim for t in config.embedding_tables)
    batch = per_rank_batch_size(config)
    print(
        f"{len(config.embedding_tables)} tables, {rows:,} rows, {params * 4 / 2**30:.1f} GiB "
        f"fp32; {topo.world_size} ranks, {topo.local_world_size or topo.world_size} per host, "
        f"{topo.compute_device} cost model; batch {batch:,} per rank "
        f"({batch * topo.world_size:,} global)",
        file=out,
    )


def _plan_scenario(
    label: str,
    model: Any,
    config: LossyPlanConfig,
    module: Any,
    base_cache: dict[Any, Any],
    calibrate_rows: int,
    out: Any,
    speeds: Any = None,
) -> ScenarioResult:
    """Plans the model with one comms model (None: ours, with the lossy sharder).

    Args:
        label: The scenario's name.
        model: Its comms model; None: torchrec-lossy's (calibrated first if
            ``calibrate_rows``).
        config: The plan config.
        module: The model's EmbeddingBagCollection (meta device).
        base_cache: TorchRec's uncompressed estimates, shared among the scenarios.
        calibrate_rows: Rows of synthetic traffic to calibrate ours on; 0: none.
        out: Text stream to print the calibration to.
        speeds: Format speeds for ours; None: the device defaults.

    Returns:
        The scenario's shardings, costs and explained plan.
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.storage_reservations import (
        FixedPercentageStorageReservation,
    )

    from torchrec_lossy.planner import LossyShardingPlanner
    from torchrec_lossy.planner.planner import SHORT_NAMES

    planner = LossyShardingPlanner(
        config,
        comms_model=model,
        stats=[],
        debug=False,
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15),
        base_cache=base_cache,
        speeds=speeds if model is None else None,
    )
    sharders = [EmbeddingBagCollectionSharder()]
    if model is None:
        if calibrate_rows > 0:
            _calibrate(planner, config, calibrate_rows, out)
        sharders = [_lossy_sharder(planner, out)]
    planner.plan(module, sharders)
    counts: dict[str, int] = {}
    for t in planner.planned_tables:
        short = SHORT_NAMES.get(t.sharding_type, t.sharding_type)
        counts[short] = counts.get(short, 0) + 1
    return ScenarioResult(
        label=label,
        description=planner.comms_model.description,
        shardings=", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
        cost=planner.step_cost(),
        explanation=planner.explain(),
    )


def _calibrate(planner: Any, config: LossyPlanConfig, calibrate_rows: int, out: Any) -> None:
    """Measures each table's ratio on synthetic traffic (into the planner) and prints it."""
    from torchrec_lossy.planner import synthetic_blocks

    cal = planner.calibrate(synthetic_blocks(config.embedding_tables, calibrate_rows))
    print(f"\ncalibration on {calibrate_rows} rows of Criteo-like traffic:", file=out)
    for c in cal.values():
        index = "-" if c.index is None else f"{c.index:.3f}"
        print(
            f"  {c.table:<12} class {c.table_class:<10} index {index:<6} "
            f"{c.bound.mode} {c.bound.value:g}  ratio {c.ratio:.1f}x",
            file=out,
        )


_COMPARISON_HEADER = (
    "scenario",
    "shardings",
    "fwd comms",
    "bwd comms",
    "codec",
    "same-host a2a",
    "cross-host a2a",
    "comms total",
    "fwd wire MiB",
    "fwd cross-host MiB",
    "planner step",
)


def _print_comparison(results: list[ScenarioResult], out: Any) -> None:
    """Prints the scenarios' estimated communication per step as a table, then its legend."""
    print("\nestimated embedding communication per training step (slowest rank, ms):", file=out)
    lines = [_COMPARISON_HEADER]
    for r in results:
        c = r.cost
        lines.append(
            (
                r.label,
                r.shardings,
                f"{c.fwd_comms_ms:.3f}",
                f"{c.bwd_comms_ms:.3f}",
                f"{c.codec_ms:.3f}",
                f"{c.same_host_ms:.3f}",
                f"{c.cross_host_ms:.3f}",
                f"{c.comms_ms:.3f}",
                f"{c.fwd_wire_bytes / 2**20:.1f}",
                f"{c.fwd_cross_host_bytes / 2**20:.1f}",
                f"{c.planner_ms:.3f}",
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(_COMPARISON_HEADER))]
    for row in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)), file=out)
    print(
        "\nfwd comms: pooled all-to-all (TorchRec: reduce-scatter for RW; TWRW/grid: both); "
        "bwd comms: gradient all-to-all, all-gather and DP all-reduce; codec: encode + decode; "
        "same-/cross-host a2a: the all-to-alls' time on each link (fwd + bwd; part of fwd/bwd "
        "comms: a rank's own block and its same-host peers' at the intra-host bandwidth, other "
        "hosts' at the inter-host bandwidth, every scenario alike); "
        "planner step: TorchRec's perf rating incl. embedding compute. Formats:",
        file=out,
    )
    for r in results:
        print(f"  {r.label}: {r.description}", file=out)


def _lossy_sharder(planner: Any, out: Any) -> Any:
    """The planner's lossy sharder; TorchRec's sharder if the dist package cannot load."""
    try:
        return planner.sharder()
    except ImportError as e:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        print(
            f"(planning with TorchRec's sharder: the lossy sharder did not import: {e})", file=out
        )
        return EmbeddingBagCollectionSharder()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torchrec_lossy.plan",
        description="Preview the compression-aware sharding plan of a planner config.",
    )
    parser.add_argument("--config", required=True, help="planner config YAML (configs/*.yaml)")
    parser.add_argument("--world-size", type=int, help="ranks (overrides topology.world_size)")
    parser.add_argument("--local-world-size", type=int, help="ranks per host")
    parser.add_argument("--batch-size", type=int, help="global batch size, all ranks together")
    parser.add_argument("--compute-device", choices=("cuda", "cpu"), help="cost model device")
    parser.add_argument(
        "--calibrate",
        type=int,
        default=0,
        metavar="ROWS",
        help="measure ratios with the real codec on ROWS rows of Criteo-like traffic per table",
    )
    parser.add_argument(
        "--measure-speeds",
        action="store_true",
        help="time the formats on this machine's device for the config's blocks (as the example "
        "does at start-up) instead of the device defaults",
    )
    return parser.parse_args(argv)


def measured_speeds(config: LossyPlanConfig) -> Any:
    """The formats' speeds on this machine for the config's blocks (one destination's rows).

    Args:
        config: The plan config.

    Returns:
        ``planner.speeds.Speeds``: measured on the compute device if this machine has one,
        else the device defaults (saying so).
    """
    import torch

    from torchrec_lossy.planner import measure_speeds, per_rank_batch_size
    from torchrec_lossy.planner.speeds import default_speeds

    device = config.topology.compute_device
    if device == "cuda" and not torch.cuda.is_available():
        return default_speeds(device, "no CUDA device on this machine to measure")
    rows = per_rank_batch_size(config)
    world = config.topology.world_size
    return measure_speeds(
        config.embedding_tables, rows, config.comms, torch.device(device), world_size=world
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    args = _parse(argv)
    try:
        config = _apply_overrides(load_yaml(LossyPlanConfig, args.config), args)
        if not config.embedding_tables:
            raise ConfigError(
                f"{args.config}: embedding_tables is empty: list the tables to plan (name, "
                "num_embeddings, embedding_dim; see configs/criteo_kaggle.yaml)"
            )
    except ConfigError as e:  # one line, no traceback: the message names the file and the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The preview plans a meta-device model without a process group; TorchRec's warnings about
    # dry runs and missing sharding specs (data-parallel tables) are expected here.
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        print(f"torchrec-lossy plan preview: {args.config}")
        speeds = measured_speeds(config) if args.measure_speeds else None
        preview(config, calibrate_rows=args.calibrate, speeds=speeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
