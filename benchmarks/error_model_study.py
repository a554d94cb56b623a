"""Which property of the forward error costs AUC: paired fake-quantization runs per error model.

Per seed (:mod:`fq_harness`, one process, the example's model, data and order):

1. train one model exactly; evaluate it exactly and, at the same weights, with every
   ``--fixed`` model applied in evaluation (fixed-weight dAUC / dLogLoss: no seed noise), and
   measure the gradient's change at those weights on training batches;
2. train again per ``--train`` model, the error applied in training, and evaluate that model
   both exactly (``train``: the training effect alone) and perturbed (``train+eval``).

Deltas are paired against the exact model of the same seed. A model spec is a
:func:`fake_quant.parse_model` spec, optionally ``@i,j,...`` to perturb only those tables
(0: user, 1: movie on the MovieLens log); a ``--train`` spec ``bwd=MODEL`` applies the model
to the gradient all-to-all instead (every table; the forward exact). Bits per value: order-0
code entropy plus side information on the exact model's training traffic
(:func:`fake_quant.code_entropy_bits`).

    python benchmarks/error_model_study.py --seeds 0-19 --json /tmp/study.json
    python benchmarks/error_model_study.py --seeds 0 --epochs 1 --train block-nearest:0.03

The JSON is rewritten after every run; ``--resume`` skips the runs it already holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fq_harness
import torch
from accuracy_bench import mean_finite, paired_deltas, sem_finite
from fake_quant import code_entropy_bits, error_stats, parse_model
from table_fmt import cell

DATA = next(
    (
        p
        for p in (
            d / "shared" / "data" / "movielens_small_criteo.tsv.gz"
            for d in Path(__file__).resolve().parents
        )
        if p.is_file()
    ),
    Path("movielens_small_criteo.tsv.gz"),
)
FIXED = (
    "fp16", "bf16", "mx4",
    "block-nearest:0.01", "block-nearest:0.03", "block-nearest:0.05",
    "block-stochastic:0.01", "block-stochastic:0.05", "row-stochastic:0.1",
    "block-stochastic:0.03", "block-midrise:0.03", "block-dither:0.03",
    "row-nearest:0.03", "row-stochastic:0.03", "row-nearest:0.1",
    "group-nearest:0.03", "group-stochastic:0.03", "log:0.03",
    "block-nearest:0.03@0,1", "block-nearest:0.03@" + ",".join(map(str, range(2, 26))),
)  # fmt: skip
ID_TABLES = 2  # tables 0 and 1: the user and movie ids of the MovieLens log
BWD = "bwd="  # a --train spec with this prefix perturbs the gradient all-to-all instead
TRAIN = ("block-nearest:0.03", "block-stochastic:0.03", "log:0.03", "block-stochastic:0.01")


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if hi else [int(v) for v in text.split(",")]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The study's flags.

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed flags.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-path", default=str(DATA))
    ap.add_argument("--seeds", type=_seeds, default=list(range(20)), help="0-19 or 0,3,5")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--fixed", default=";".join(FIXED), help="';'-separated specs")
    ap.add_argument("--train", default=";".join(TRAIN), help="';'-separated specs")
    ap.add_argument("--grad-steps", type=int, default=4, help="batches for the gradient change")
    ap.add_argument("--json", default="error_model_study.json")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    args.fixed = [s for s in args.fixed.split(";") if s]
    args.train = [s for s in args.train.split(";") if s]
    return args


def configure(run: fq_harness.Run, spec: str | None, seed: int) -> None:
    """Sets ``spec`` (None: exact) on ``run``, its random source seeded by ``seed``.

    Args:
        run: The run.
        spec: ``MODEL[@tables]`` (the forward's error) or ``bwd=MODEL`` (the gradient's).
        seed: Seed of stochastic rounding and dither.
    """
    fq = run.fq
    fq.gen.manual_seed(10_000 + seed)
    fq.model, fq.bwd_model, fq.tables = None, None, None
    if spec is None:
        return
    if spec.startswith(BWD):  # the gradient's error model, every table
        fq.bwd_model = parse_model(spec.removeprefix(BWD))
        return
    model, _, tables = spec.partition("@")
    fq.model = parse_model(model)
    fq.tables = [int(t) for t in tables.split(",")] if tables else None


def fixed_weight(
    run: fq_harness.Run, data: fq_harness.Data, spec: str, seed: int, steps: int
) -> dict[str, Any]:
    """Evaluation and gradient change of the trained exact ``run`` under ``spec``.

    Args:
        run: The exact model, trained (left exact).
        data: The data.
        spec: Model spec.
        seed: Seed of the random source.
        steps: Batches of the gradient change.

    Returns:
        ``{"auc", "logloss", "dense_cos", ...}``.
    """
    configure(run, spec, seed)
    run.fq.in_eval = True
    out = fq_harness.evaluate(run, data)
    if steps > 0:
        out.update(fq_harness.gradient_change(run, data, run.fq.model, steps))  # type: ignore[arg-type]
    run.fq.in_eval = False
    configure(run, None, seed)
    return out


def trained(data: fq_harness.Data, spec: str, seed: int, epochs: int) -> dict[str, Any]:
    """Trains with ``spec`` in training; evaluates exactly and perturbed.

    Args:
        data: The data.
        spec: Model spec.
        seed: The seed.
        epochs: Passes.

    Returns:
        ``{"train": {auc, logloss}, "train+eval": {...}, "train_loss": mean}``.
    """
    run = fq_harness.build(data, seed)
    configure(run, spec, seed)
    losses = fq_harness.train(run, data, epochs)
    out = {"train_loss": statistics.fmean(losses), "train": fq_harness.evaluate(run, data)}
    run.fq.in_eval = True
    out["train+eval"] = fq_harness.evaluate(run, data)
    return out


def run_seed(
    args: argparse.Namespace, data: fq_harness.Data, seed: int, rec: dict[str, Any], save: Any
) -> None:
    """Every run of one seed not yet in ``rec`` (``save()`` after each).

    Args:
        args: Flags.
        data: The data.
        seed: The seed.
        rec: This seed's record (filled in place).
        save: Writes the JSON.
    """
    if "exact" not in rec:
        t0 = time.perf_counter()
        run = fq_harness.build(data, seed)
        losses = fq_harness.train(run, data, args.epochs)
        rec["trained"] = {}
        rec["exact"] = {"train_loss": statistics.fmean(losses), **fq_harness.evaluate(run, data)}
        rec["fixed"] = {s: fixed_weight(run, data, s, seed, args.grad_steps) for s in args.fixed}
        if seed == args.seeds[0]:  # the codes' statistics barely move with the seed
            blocks = [b for t in fq_harness.pooled_blocks(run, data, 4) for b in t.unbind(0)]
            models = {s: parse_model(s.partition("@")[0]) for s in args.fixed}
            rec["bits"] = {s: code_entropy_bits(m, blocks) for s, m in models.items()}
            n = len(data.sizes)  # blocks run table by table within each (batch, rank)
            split = {
                "id_tables": [b for k, b in enumerate(blocks) if k % n < ID_TABLES],
                "other_tables": [b for k, b in enumerate(blocks) if k % n >= ID_TABLES],
            }
            rec["stats"] = {
                s: {t: error_stats(m, bs) for t, bs in split.items()} for s, m in models.items()
            }
            rec["bits_distinct"] = {
                s: code_entropy_bits(m, blocks, True) for s, m in models.items()
            }
        print(
            f"seed {seed} exact {rec['exact']['auc']:.4f} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        save()
    for spec in args.train:
        if spec not in rec["trained"]:
            t0 = time.perf_counter()
            rec["trained"][spec] = trained(data, spec, seed, args.epochs)
            r = rec["trained"][spec]
            took = time.perf_counter() - t0
            aucs = f"train {r['train']['auc']:.4f} train+eval {r['train+eval']['auc']:.4f}"
            print(f"seed {seed} {spec}: {aucs} ({took:.0f} s)", flush=True)
            save()


def _stat(deltas: dict[int, float]) -> dict[str, Any]:
    vals = list(deltas.values())
    return {"n": len(vals), "mean": mean_finite(vals), "se": sem_finite(vals)}


def summarize(seeds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Mean paired deltas (and standard errors) per model and measure.

    Args:
        seeds: The JSON's per-seed records.

    Returns:
        ``{spec: {"fixed": {...}, "train": {...}, "train+eval": {...}, ...}}``.
    """
    recs = {int(s): r for s, r in seeds.items() if "exact" in r}
    exact = {s: r["exact"] for s, r in recs.items()}
    first = next((r for r in recs.values() if "bits" in r), {})
    bits, bits_distinct = first.get("bits", {}), first.get("bits_distinct", {})
    specs = dict.fromkeys(k for r in recs.values() for k in (*r["fixed"], *r.get("trained", {})))
    out: dict[str, Any] = {}
    for spec in specs:
        s: dict[str, Any] = {"bits": bits.get(spec), "bits_distinct": bits_distinct.get(spec)}
        fixed = {k: r["fixed"][spec] for k, r in recs.items() if spec in r["fixed"]}
        if fixed:
            s["fixed"] = {m: _stat(paired_deltas(fixed, exact, m)) for m in ("auc", "logloss")}
            s["grad"] = {
                g: mean_finite([f.get(g) for f in fixed.values()])
                for g in ("dense_cos", "dense_rel", "emb_cos", "emb_rel")
            }
        for mode in ("train", "train+eval"):
            runs = {k: r["trained"][spec][mode] for k, r in recs.items() if spec in r["trained"]}
            if runs:
                s[mode] = {m: _stat(paired_deltas(runs, exact, m)) for m in ("auc", "logloss")}
        out[spec] = s
    return out


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table (dAUC as mean ± SE, x 1e-4; n seeds).

    Args:
        summary: :func:`summarize`'s output.

    Returns:
        The table.
    """

    def pm(s: dict[str, Any] | None, key: str) -> str:
        if not s:
            return "-"
        mean, se = (None if v is None else 1e4 * v for v in (s[key]["mean"], s[key]["se"]))
        return f"{cell(mean, '+.1f')} ± {cell(se, '.1f')} ({s[key]['n']})"

    lines = [
        "| model | bits/value | deduped | fixed-weight dAUC | fixed dLogLoss | dense grad cos | "
        "emb grad rel err | train-only dAUC | train-only dLogLoss | train+eval dAUC |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for spec, s in summary.items():
        g = s.get("grad") or {}
        lines.append(
            f"| {spec} | {cell(s['bits'], '.2f')} | {cell(s.get('bits_distinct'), '.2f')} | "
            f"{pm(s.get('fixed'), 'auc')} | "
            f"{pm(s.get('fixed'), 'logloss')} | {cell(g.get('dense_cos'), '.4f')} | "
            f"{cell(g.get('emb_rel'), '.3f')} | {pm(s.get('train'), 'auc')} | "
            f"{pm(s.get('train'), 'logloss')} | {pm(s.get('train+eval'), 'auc')} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the study and prints its table.

    Args:
        argv: Arguments.

    Returns:
        Exit status.
    """
    args = parse_args(argv)
    torch.set_num_threads(1)
    path = Path(args.json)
    doc: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "seeds": {}}
    if args.resume and path.is_file():
        doc["seeds"] = json.loads(path.read_text())["seeds"]

    def save() -> None:
        doc["summary"] = summarize(doc["seeds"])
        path.write_text(json.dumps(doc, indent=1))

    data = fq_harness.load_data(args.data_path)
    for seed in args.seeds:
        run_seed(args, data, seed, doc["seeds"].setdefault(str(seed), {}), save)
    save()
    print(format_table(doc["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
