"""The production grouped call the device benchmarks run: its flags and its traffic."""

from __future__ import annotations

import argparse

import torch

from torchrec_lossy.traffic import TrafficSpec, paper_traffic

PRESET_TABLES = 26  # both traffic presets (criteo_kaggle, criteo_1tb) have 26 tables


def grouped_shape(text: str) -> tuple[int, int, int]:
    """``TABLESxROWSxDIM`` as three positive ints (an argparse ``type``).

    Args:
        text: The flag's value, e.g. ``26x2048x64``.

    Returns:
        (tables, rows, dim).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not three positive ints joined by ``x``.
    """
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give TABLESxROWSxDIM, e.g. 26x2048x64")
    tables, rows, dim = (int(p) for p in parts)
    return tables, rows, dim


def add_grouped_call_args(p: argparse.ArgumentParser) -> None:
    """Adds the grouped call's flags: ``--formats``, ``--grouped-shape``, ``--destinations``.

    Args:
        p: The benchmark's parser.
    """
    p.add_argument(
        "--formats", nargs="+", choices=["entropy", "packed"], default=["entropy", "packed"],
        help="the codec's wire formats of the grouped call (CodecConfig.format)",
    )  # fmt: skip
    p.add_argument(
        "--grouped-shape", type=grouped_shape, default=(26, 2048, 64), metavar="TABLESxROWSxDIM",
        help="blocks per destination of the grouped call",
    )  # fmt: skip
    p.add_argument("--destinations", type=int, default=8, help="destinations of the grouped call")


def check_grouped_call_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Ends the run with the parser's error where the grouped call's flags cannot be run.

    Args:
        p: The benchmark's parser.
        args: Its parsed arguments.
    """
    if args.destinations < 1:
        p.error(f"--destinations {args.destinations}: give 1 or more")
    if args.grouped_shape[0] > PRESET_TABLES:
        p.error(f"--grouped-shape {args.grouped_shape[0]} tables: the presets have 26")


def grouped_traffic(
    shape: tuple[int, int, int], destinations: int, preset: str = "criteo_kaggle", seed: int = 0,
    device: torch.device | None = None,
) -> tuple[list[list[torch.Tensor]], list[list[float]]]:  # fmt: skip
    """The production grouped call's blocks: per destination, one batch of paper traffic.

    Args:
        shape: (tables, rows, dim) of every destination's blocks.
        destinations: Destinations (groups).
        preset: ``TrafficSpec`` preset.
        seed: Traffic seed.
        device: Where the blocks go (None: CPU).

    Returns:
        (blocks per destination, bounds per destination).
    """
    tables, rows, dim = shape
    groups, bounds = [], []
    for d in range(destinations):
        spec = TrafficSpec(preset=preset, dim=dim, batch_rows=rows, seed=seed, batch=d)
        blocks, eb = paper_traffic(spec)
        groups.append([b.to(device or torch.device("cpu")) for b in blocks[:tables]])
        bounds.append(eb[:tables])
    return groups, bounds
