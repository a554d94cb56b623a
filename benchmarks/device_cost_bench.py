"""Device cost of the codec's production call, counted on CPU in the Triton interpreter: issue 31's
budget, both formats, both directions.

For ``compress_groups`` / ``decompress_groups`` (the grouped all-to-all call: every destination
in one call; the decode given the announced skeletons, as the all-to-all does) it counts what a
GPU would run: Triton launches, torch ops outside kernels (views excluded) and bytes touched per
input element (every tensor argument of every launch, once per launch, plus the inputs and
outputs of those torch ops), and prints them beside the budget (at most 6 launches, 30 torch ops
and 16 B per element each way). The count is ``../shared/tools/device_cost.py``'s, over the
grouped call. Work the host path does (numba) is invisible to it: the JSON says where a format
still routes a direction there (``host_path``), and such a direction fails the budget.

Examples::

    TRITON_INTERPRET=1 python benchmarks/device_cost_bench.py              # 26 x 2048 x 64 x 8
    TRITON_INTERPRET=1 python benchmarks/device_cost_bench.py --grouped-shape 4x64x64 \\
        --destinations 2 --json out/device_cost.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch
from grouped_call import add_grouped_call_args, check_grouped_call_args, grouped_traffic
from torch.utils._python_dispatch import TorchDispatchMode

# Issue 31's budget, per direction of the grouped call.
BUDGET = {"launches": 6, "torch_ops": 30, "bytes_per_element": 16.0}
# Ops that only make views or read metadata: not counted (device_cost.py's list).
_VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "reshape",
        "alias",
        "slice",
        "select",
        "narrow",
        "expand",
        "as_strided",
        "t",
        "unsqueeze",
        "squeeze",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "permute",
        "transpose",
        "view_as",
        "lift_fresh",
        "_reshape_alias",
        "unflatten",
        "flatten",
        "chunk",
        "set_",
        "result_type",
        "is_nonzero",
        "_local_scalar_dense",
        "sym_size",
        "scalar_tensor",
    ]
)


@dataclass
class Cost:
    """One direction's count.

    Attributes:
        launches: Triton launches.
        torch_ops: Torch ops outside kernels.
        bytes_per_element: Bytes touched per input element.
        host_path: Whether the direction ran the compiled host path (invisible to the count).
        stages: The compress's counts per stage (``stages``): name -> launches, torch_ops,
            bytes_per_element; empty for the decompress.
    """

    launches: int = 0
    torch_ops: int = 0
    bytes_per_element: float = 0.0
    host_path: bool = False
    stages: dict[str, dict[str, float]] = field(default_factory=dict)

    def within_budget(self) -> bool:
        """Whether the count meets the budget (a host-path direction never does).

        Returns:
            True within every limit of :data:`BUDGET`, on the device path.
        """
        return (
            not self.host_path
            and self.launches <= BUDGET["launches"]
            and self.torch_ops <= BUDGET["torch_ops"]
            and self.bytes_per_element <= BUDGET["bytes_per_element"]
        )


def _nbytes(t: object) -> int:
    """Bytes of a tensor's elements, of every tensor in a tuple, list or dict; else 0."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (tuple, list)):
        return sum(_nbytes(x) for x in t)
    if isinstance(t, dict):
        return sum(_nbytes(x) for x in t.values())
    return 0


class _Counter(TorchDispatchMode):
    """Torch ops outside kernels and their bytes; launches through the interpreter's hook."""

    def __init__(self) -> None:
        super().__init__()
        self.in_kernel = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.names: collections.Counter[str] = collections.Counter()  # ops by name
        self.stage = "the rest"  # where counts go (``stages``)
        self.by_stage: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    def add(self, key: str, n: int) -> None:
        """Adds ``n`` to count ``key``, in all and in the current stage."""
        self.counts[key] += n
        self.by_stage[self.stage][key] += n

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """Runs ``func`` and counts it (outside kernels, views excluded)."""
        out = func(*args, **(kwargs or {}))
        if not self.in_kernel and func.overloadpacket.__name__ not in _VIEWS:
            self.add("ops", 1)
            self.names[func.overloadpacket.__name__] += 1
            self.add("bytes", _nbytes((args, kwargs or {}, out)))
        return out


@contextmanager
def counting() -> Iterator[_Counter]:
    """Counts torch ops and Triton launches (the interpreter's ``run`` hooked) inside.

    Yields:
        The counter: ``counts["ops"]``, ``["bytes"]``, ``["launches"]``.
    """
    import triton.runtime.interpreter as interp

    counter = _Counter()
    orig = interp.InterpretedFunction.run

    def run(self, *args: Any, grid: Any, warmup: Any, **kw: Any) -> Any:
        counter.add("launches", 1)
        counter.add("bytes", _nbytes((args, kw)))
        counter.in_kernel += 1
        try:
            return orig(self, *args, grid=grid, warmup=warmup, **kw)
        finally:
            counter.in_kernel -= 1

    interp.InterpretedFunction.run = run
    try:
        with counter:
            yield counter
    finally:
        interp.InterpretedFunction.run = orig


# The modules whose functions are the compress's stages (``stages``), and their entry points.
_STAGE_MODULES = ("device_compress", "device_packed_compress")
_ENTRY_POINTS = frozenset(["compress_device", "start_groups_device", "start_packed_groups"])


@contextmanager
def stages(counter: _Counter) -> Iterator[None]:
    """Attributes the counts to the device compress's stages: every function of
    ``codec/device_compress.py`` and ``codec/device_packed_compress.py`` but the entry points,
    counted where the entry point calls it (a stage's own calls are its own).

    Args:
        counter: The counter (its ``by_stage``).
    """
    import importlib
    import inspect

    patched = []
    for name in _STAGE_MODULES:
        mod = importlib.import_module(f"torchrec_lossy.codec.{name}")
        for attr, fn in list(vars(mod).items()):
            if not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                continue
            if attr in _ENTRY_POINTS:
                continue

            def wrapped(*a: Any, _fn: Callable = fn, _name: str = attr, **kw: Any) -> Any:
                if counter.stage != "the rest":  # inside a stage: its own
                    return _fn(*a, **kw)
                counter.stage = _name
                try:
                    return _fn(*a, **kw)
                finally:
                    counter.stage = "the rest"

            patched.append((mod, attr, fn))
            setattr(mod, attr, wrapped)
    try:
        yield
    finally:
        for mod, attr, fn in patched:
            setattr(mod, attr, fn)


def _host_path(fmt: str, direction: str) -> bool:
    """Whether a format's direction still runs the compiled host path on the device backends
    (none does now: kept so that a future host-routed direction cannot pass for free)."""
    del fmt, direction
    return False


def measure(
    groups: list[list[torch.Tensor]], bounds: list[list[float]], fmt: str,
) -> dict[str, Cost]:  # fmt: skip
    """Counts one grouped compress and decompress (Triton backend, in the interpreter).

    Args:
        groups: Blocks per destination (CPU).
        bounds: Bounds per destination.
        fmt: ``CodecConfig.format``.

    Returns:
        ``{"compress": Cost, "decompress": Cost}``; the payloads are checked against the host
        path's bytes and bits first (AssertionError otherwise).
    """
    from torchrec_lossy.codec import check_groups, compress_groups, decompress_groups
    from torchrec_lossy.config import CodecConfig

    config = CodecConfig(backend="triton", format=fmt)
    n = sum(b.numel() for g in groups for b in g)
    compress_groups(groups[:1], bounds[:1], config)  # warm-up: imports, first-call set-up
    calls: dict[str, Callable[[], Any]] = {}
    sent = compress_groups(groups, bounds, config)
    calls["compress"] = lambda: compress_groups(groups, bounds, config)
    calls["decompress"] = lambda: decompress_groups(
        sent.buffer, sent.sizes, backend="triton", skeletons=sent.skeletons
    )
    host = compress_groups(groups, bounds, CodecConfig(backend="cpu", format=fmt))
    assert torch.equal(sent.buffer, host.buffer), f"{fmt}: device bytes differ from the host's"
    out: dict[str, Cost] = {}
    for direction, call in calls.items():
        with counting() as c, stages(c) if direction == "compress" else nullcontext():
            got = call()
        if direction == "decompress":
            check_groups(got[1])
        k = c.counts
        by_stage = {
            name: {"launches": v["launches"], "torch_ops": v["ops"],
                   "bytes_per_element": v["bytes"] / max(n, 1)}
            for name, v in c.by_stage.items()
        } if direction == "compress" else {}  # fmt: skip
        out[direction] = Cost(
            k["launches"], k["ops"], k["bytes"] / max(n, 1), _host_path(fmt, direction), by_stage
        )
    return out


def _print_stages(by_stage: dict[str, dict[str, float]]) -> None:
    """Prints a compress's counts per stage, most torch ops first."""
    print(f"  {'stage':28s} {'launches':>8s} {'ops':>5s} {'B/elem':>8s}")
    for name, v in sorted(by_stage.items(), key=lambda kv: -kv[1]["torch_ops"]):
        print(f"  {name:28s} {v['launches']:8d} {v['torch_ops']:5d} "
              f"{v['bytes_per_element']:8.1f}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line.

    Args:
        argv: Command-line arguments (None: ``sys.argv``).

    Returns:
        The parsed arguments.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_grouped_call_args(p)
    p.add_argument("--preset", default="criteo_kaggle", choices=["criteo_kaggle", "criteo_1tb"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="out/device_cost_bench.json", help="where to write results")
    p.add_argument("--stages", action="store_true", help="print the compress's counts per stage")
    args = p.parse_args(argv)
    check_grouped_call_args(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the count and prints it beside the budget.

    Args:
        argv: Command-line arguments (None: ``sys.argv``).

    Returns:
        0 (the budget's verdict is printed and written, not the exit status).
    """
    args = parse_args(argv)
    groups, bounds = grouped_traffic(args.grouped_shape, args.destinations, args.preset, args.seed)
    tables, rows, dim = args.grouped_shape
    print(f"grouped call: {args.destinations} destinations x {tables} tables x {rows} rows x "
          f"dim {dim}, Triton interpreter")  # fmt: skip
    budget = f"<= {BUDGET['launches']} / {BUDGET['torch_ops']} / {BUDGET['bytes_per_element']:g}"
    print(f"{'format':8s} {'direction':10s} {'launches':>8s} {'ops':>5s} {'B/elem':>8s}  budget "
          f"{budget}")  # fmt: skip
    rows_out = []
    for fmt in args.formats:
        for direction, c in measure(groups, bounds, fmt).items():
            verdict = "within" if c.within_budget() else "OVER"
            note = " (host path: not counted)" if c.host_path else ""
            print(f"{fmt:8s} {direction:10s} {c.launches:8d} {c.torch_ops:5d} "
                  f"{c.bytes_per_element:8.1f}  {verdict}{note}")  # fmt: skip
            rows_out.append({"format": fmt, "direction": direction, **asdict(c),
                             "within_budget": c.within_budget()})  # fmt: skip
            if args.stages and c.stages:
                _print_stages(c.stages)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"shape": list(args.grouped_shape), "destinations": args.destinations,
              "budget": BUDGET, "rows": rows_out}  # fmt: skip
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
