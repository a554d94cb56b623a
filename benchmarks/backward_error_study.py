"""The backward all-to-all's error models side by side (issue 32): guarantee, adversarial
gradients, bytes on real gradient traffic.

A fake-quantization study (the models of :mod:`fake_quant`, plain torch), not codec modes: only
``value:V`` is the codec's own grid (``ErrorBound(mode="value")``, the backward default at
1/32). The candidates, each with its guarantee on every finite element (NaN / Inf carried
exactly):

- ``value:V`` per value: ``|g' - g| <= V |g|`` (the codec keeps ``m`` mantissa bits with
  ``2**-(m + 1) <= V``; values far below the block's largest are escaped, i.e. exact).
- ``rowexp-nearest:V`` per row, one shared 8-bit exponent per row: ``|g' - g| <= V s`` with
  ``s = 2**ceil(log2 max|row|)`` (``< 2 V max|row|``); an all-zero row stays 0.
- ``groupexp-nearest:V`` MX-like, one shared 8-bit exponent per 32 consecutive values of the
  block, integer codes entropy-coded (not MX4's fixed 4 bits): ``|g' - g| <= V s``, ``s`` the
  group's ``2**ceil(log2 max|g|)``.
- ``block-nearest:0.01``: 0.01 of the block's range (the backward default before issue 32).
- ``mx4``: fbgemm's MX4 (TorchRec's backward qcomm; no stated bound).

Error feedback is not among them: the pooled gradient's rows are the samples of one step, and
no row of the next step is the same sample, so a sender has nowhere to add its residual; it
would have to live per table row on the owner, which only ever sees the decoded gradient.

Measures:

1. **Adversarial gradient blocks** (256 x 16): row scales spread over ten decades with zero
   rows, one huge finite row (1e30; one element at 3e38), half the rows zero, an all-zero block,
   NaN / +-Inf, denormals. Per model: the largest error over its stated bound (must be <= 1 up
   to the one float32 rounding), whether non-finite values come back bit-exact, the
   row-relative error energy (mean over non-zero rows of ``sum (g' - g)^2 / sum g^2``, the
   statistic of docs/accuracy.md) and the share of non-zero rows decoded as all zeros.
2. **Real gradient traffic**: the MovieLens harness (:mod:`fq_harness`), a model trained
   exactly for ``--epochs``, the gradient of ``--steps`` training batches per (source rank,
   table) block, rows summed per distinct bag as the codec's gradient dedupe sums them. Per
   model: bits per value (order-0 code entropy plus side information, per value of the
   per-sample gradient, i.e. after the dedupe), the row-relative energy, the block-wide
   relative energy. MX4 sends every per-sample value at 4.25 bits (TorchRec has no dedupe).

    python benchmarks/backward_error_study.py --json /tmp/bwd_study.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fq_harness
import torch
from error_model_study import DATA
from fake_quant import ErrorModel, code_entropy_bits, parse_model, stated_bound
from table_fmt import cell

MODELS = (
    "value:0.03125", "value:0.0625",
    "rowexp-nearest:0.015625", "rowexp-nearest:0.0078125",
    "groupexp-nearest:0.015625", "groupexp-nearest:0.0078125",
    "block-nearest:0.01", "mx4",
)  # fmt: skip


def adversarial_gradients() -> dict[str, torch.Tensor]:
    """Gradient blocks ``[256, 16]`` built to break a bound (see the module docstring)."""
    g = torch.Generator().manual_seed(32)
    base = torch.randn(256, 16, generator=g)
    decades = base * 10 ** (-10 * torch.rand(256, 1, generator=g))
    decades[::17] = 0.0
    huge = base.clone()
    huge[5] *= 1e30
    huge[9, 3] = 3e38
    half_zero = base.clone()
    half_zero[::2] = 0.0
    nonfinite = decades.clone()
    nonfinite[3, 5], nonfinite[4, 0], nonfinite[8, 8] = math.nan, math.inf, -math.inf
    return {
        "ten decades": decades,
        "one huge row": huge,
        "half rows zero": half_zero,
        "all zero": torch.zeros(256, 16),
        "NaN / Inf": nonfinite,
        "denormals": base * 1e-40,
    }


def row_energy(x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over non-zero rows of ``sum (y - x)^2 / sum x^2``, finite elements only (NaN if no
    row is non-zero)."""
    x, y = x.double(), y.double()
    fin = torch.isfinite(x)
    x, y = torch.where(fin, x, 0.0), torch.where(fin, y, 0.0)
    val = x.pow(2).sum(-1)
    keep = val > 0
    return float(((y - x).pow(2).sum(-1)[keep] / val[keep]).mean()) if keep.any() else math.nan


def adversarial_check(model: ErrorModel, x: torch.Tensor) -> dict[str, Any]:
    """One model on one adversarial block.

    Args:
        model: The model.
        x: The block.

    Returns:
        ``over_bound`` (largest error / stated bound beyond one float32 rounding; None for a
        model without a bound), ``nonfinite_exact``, ``row_energy``, ``rows_zeroed``.
    """
    y = model(x, torch.Generator().manual_seed(1))
    fin = torch.isfinite(x)
    exact = bool(torch.equal(y[~fin].view(torch.int32), x[~fin].view(torch.int32)))
    over = None
    if model.scale not in ("mx4", "fp16", "bf16"):
        err = (y.double() - x.double()).abs()[fin]
        ulp = (torch.nextafter(y, torch.full_like(y, math.inf)) - y).abs().double()[fin]
        bound = stated_bound(model, x)[fin]
        slack = (err - ulp).clamp_min(0)
        over = float((slack / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
    nz = (torch.where(fin, x, 0.0) != 0).any(-1)
    zeroed = ((y == 0) | ~fin).all(-1) & nz
    return {
        "over_bound": over,
        "nonfinite_exact": exact,
        "row_energy": row_energy(x, y),
        "rows_zeroed": float(zeroed.sum() / nz.sum().clamp_min(1)),
    }


def gradient_blocks(
    run: fq_harness.Run, data: fq_harness.Data, steps: int
) -> tuple[list[torch.Tensor], int]:
    """The backward's traffic of ``steps`` training batches, as the codec gets it.

    Args:
        run: A trained run (left unchanged).
        data: The data.
        steps: Batches.

    Returns:
        The gradient blocks ``[distinct rows, dim]`` per (batch, source rank, table), rows
        summed per distinct bag (the pooled rows that are equal), and the per-sample value
        count they stand for.
    """
    run.model.train()
    n_tables = len(data.sizes)
    blocks, values = [], 0
    for k in range(min(steps, data.steps_per_epoch)):
        batch = data.train_batch(k)
        pooled = run.fq.ebc(batch.sparse_features).values().detach().requires_grad_(True)

        def swap(_m: Any, _i: Any, out: Any, pooled: torch.Tensor = pooled) -> Any:
            from torchrec.sparse.jagged_tensor import KeyedTensor

            return KeyedTensor(out.keys(), out.length_per_key(), pooled)

        handle = run.fq.register_forward_hook(swap)
        loss, _ = run.model(batch)
        handle.remove()
        grad = torch.autograd.grad(loss, pooled)[0] * run.fq.grad_scale
        dim = pooled.shape[1] // n_tables
        cut = (data.world, -1, n_tables, dim)
        for v, g in zip(
            pooled.detach()
            .view(cut)
            .transpose(1, 2)
            .reshape(-1, pooled.shape[0] // data.world, dim),
            grad.view(cut).transpose(1, 2).reshape(-1, pooled.shape[0] // data.world, dim),
            strict=True,
        ):
            uniq, inv = torch.unique(v, dim=0, return_inverse=True)
            blocks.append(torch.zeros(uniq.shape[0], dim).index_add_(0, inv, g))
            values += g.numel()
    run.dense_opt.zero_grad()
    return blocks, values


def traffic_stats(
    model: ErrorModel, blocks: list[torch.Tensor], values: int
) -> dict[str, float | None]:
    """Bits per per-sample value and error energies of ``model`` on the gradient blocks."""
    sent = sum(b.numel() for b in blocks)
    bits = code_entropy_bits(model, blocks)
    # MX4: TorchRec sends every per-sample value; the others send the summed rows.
    per_value = bits if model.scale == "mx4" or bits is None else bits * sent / values
    gen = torch.Generator().manual_seed(0)
    decoded = [model(b, gen) for b in blocks]
    err2 = sum(
        float((y.double() - x.double()).pow(2).sum()) for x, y in zip(blocks, decoded, strict=True)
    )
    sig2 = sum(float(x.double().pow(2).sum()) for x in blocks)
    energies = [row_energy(x, y) for x, y in zip(blocks, decoded, strict=True)]
    return {
        "bits_per_value": per_value,
        "row_energy": sum(energies) / len(energies),
        "row_energy_max": max(energies),
        "block_energy": err2 / max(sig2, 1e-300),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Models, traffic and output of the backward study.

    Args:
        argv: Command line (``sys.argv[1:]`` when None).

    Returns:
        The flags, ``models`` split into specs.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=";".join(MODELS), help="';'-separated specs")
    ap.add_argument("--data-path", default=str(DATA), help="the log of the gradient traffic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1, help="exact training before the capture")
    ap.add_argument("--steps", type=int, default=8, help="training batches captured")
    ap.add_argument("--json", default="backward_error_study.json")
    args = ap.parse_args(argv)
    args.models = [s for s in args.models.split(";") if s]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Measures every model on the adversarial blocks and on the captured gradients, writes the
    JSON and prints both tables.

    Args:
        argv: Command line (``sys.argv[1:]`` when None).

    Returns:
        0.
    """
    torch.set_num_threads(1)
    args = parse_args(argv)
    models = {s: parse_model(s) for s in args.models}
    adv = adversarial_gradients()
    out: dict[str, Any] = {"args": vars(args), "adversarial": {}, "traffic": {}}
    for spec, m in models.items():
        out["adversarial"][spec] = {name: adversarial_check(m, x) for name, x in adv.items()}
    t0 = time.perf_counter()
    data = fq_harness.load_data(args.data_path)
    run = fq_harness.build(data, args.seed)
    fq_harness.train(run, data, args.epochs)
    blocks, values = gradient_blocks(run, data, args.steps)
    out["traffic_blocks"] = {"blocks": len(blocks), "rows": sum(b.shape[0] for b in blocks),
                             "per_sample_values": values}  # fmt: skip
    for spec, m in models.items():
        out["traffic"][spec] = traffic_stats(m, blocks, values)
    out["seconds"] = time.perf_counter() - t0
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(format_tables(out))
    return 0


def format_tables(out: dict[str, Any]) -> str:
    """The study's two Markdown tables.

    Args:
        out: :func:`main`'s record.

    Returns:
        The tables.
    """
    names = list(next(iter(out["adversarial"].values())))
    lines = [
        "Adversarial gradient blocks: largest error / stated bound (<= 1: met), row-relative "
        "energy, share of non-zero rows decoded as zero; NaN/Inf bit-exact: "
        + ", ".join(
            f"{spec} {all(c['nonfinite_exact'] for c in r.values())}"
            for spec, r in out["adversarial"].items()
        ),
        "",
        "| model | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for spec, row in out["adversarial"].items():
        cells = [
            f"{cell(c['over_bound'], '.3f')} / {cell(c['row_energy'], '.1e')} / "
            f"{cell(c['rows_zeroed'], '.2f')}"
            for c in row.values()
        ]
        lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    tb = out["traffic_blocks"]
    lines += [
        "",
        f"Real gradient traffic ({tb['blocks']} blocks, {tb['rows']} distinct rows, "
        f"{tb['per_sample_values']} per-sample values):",
        "",
        "| model | bits per value | fewer than fp32 | row-relative energy mean / max "
        "| block energy |",
        "|---|---:|---:|---:|---:|",
    ]
    for spec, s in out["traffic"].items():
        b = s["bits_per_value"]
        lines.append(
            f"| `{spec}` | {cell(b, '.3f')} | {cell(None if not b else 32 / b, '.1f')}x | "
            f"{cell(s['row_energy'], '.1e')} / {cell(s['row_energy_max'], '.1e')} | "
            f"{cell(s['block_energy'], '.1e')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
