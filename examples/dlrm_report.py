"""Outputs of the DLRM example: the summary table, the JSON metrics, TensorBoard and the PNG report.

Everything here works on plain Python values (the ``metrics`` dict the example builds), so the
report can be re-drawn from a saved JSON file::

    python examples/dlrm_report.py metrics.json --png report.png
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["format_summary", "write_json", "write_outputs", "write_png", "write_tensorboard"]


def _fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt(v: Any, spec: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def _codec_split(timing: Mapping[str, Any]) -> str:
    """``"; encode / decode s: input a / b, fwd c / d, bwd e / f"``, or "" without codec time."""
    split = timing.get("codec_s_by_direction")
    if not split or not any(s for phases in split.values() for s in phases.values()):
        return ""
    parts = [f"{d} {c['encode']:.2f} / {c['decode']:.2f}" for d, c in split.items()]
    return "; encode / decode s: " + ", ".join(parts)


def _natural(name: str) -> tuple[str, int]:
    head = name.rstrip("0123456789")
    tail = name[len(head) :]
    return head, int(tail) if tail else -1


def format_summary(metrics: Mapping[str, Any]) -> str:
    """The end-of-run summary as plain text.

    Args:
        metrics: The example's metrics dict (the JSON written by ``--metrics-json``).

    Returns:
        A multi-line table: run facts, quality, speed, traffic, then one line per table.
    """
    run = metrics["run"]
    final = metrics["final"]
    timing = metrics["timing"]
    comms = metrics["comms"]
    lines = [
        f"== DLRM / {run['dataset']} / comm={run['comm']} "
        f"({run['world_size']} ranks, {run['backend']}, batch {run['batch_size']}/rank, "
        f"dim {run['embedding_dim']}, {run['steps_done']} steps) ==",
        f"comm: {run['comm_description']}",
        f"sharding: {metrics['plan']['summary']}   planner: {metrics['plan']['planner']}",
        f"AUC       {_fmt(final.get('auc'))}   log loss {_fmt(final.get('logloss'))}"
        f"   (eval rows {final.get('eval_rows', 0)}"
        + (
            f", hidden-model AUC {_fmt(metrics['data'].get('oracle_auc'))})"
            if metrics["data"].get("oracle_auc") is not None
            else ")"
        ),
        f"train loss (last {timing.get('loss_window', 0)} steps) {_fmt(final.get('train_loss'))}",
        f"step time {_fmt(1e3 * timing['step_time_s_mean'], '.1f')} ms mean, "
        f"{_fmt(1e3 * timing['step_time_s_median'], '.1f')} ms median   "
        f"examples/s {_fmt(timing['examples_per_s'], ',.0f')}   "
        f"data wait {_fmt(1e3 * timing['data_wait_s_per_step'], '.1f')} ms/step",
        f"a2a bytes/step (all ranks, {comms['source']}; raw = TorchRec's uncompressed bytes): "
        f"input {_fmt_bytes(comms['input_wire_bytes_per_step'])} "
        f"(raw {_fmt_bytes(comms['input_raw_bytes_per_step'])}, "
        f"{_fmt(comms['input_ratio'], '.2f')}x)   "
        f"fwd {_fmt_bytes(comms['fwd_wire_bytes_per_step'])} "
        f"(raw {_fmt_bytes(comms['fwd_raw_bytes_per_step'])}, "
        f"{_fmt(comms['fwd_ratio'], '.2f')}x"
        + (
            f"; codec {comms['fwd_coded_bytes_per_step'] / comms['fwd_wire_bytes_per_step']:.2f}x"
            " on the distinct rows"
            if comms.get("fwd_coded_bytes_per_step") and comms["fwd_wire_bytes_per_step"]
            else ""
        )
        + f")   bwd {_fmt_bytes(comms['bwd_wire_bytes_per_step'])} "
        f"(raw {_fmt_bytes(comms['bwd_raw_bytes_per_step'])}, "
        f"{_fmt(comms['bwd_ratio'], '.2f')}x)",
        f"codec time share {_fmt(100 * timing['codec_time_share'], '.1f')}% of steady step time "
        f"(all steps, summed over ranks: encode {_fmt(timing['codec_encode_s'], '.2f')} s, "
        f"decode {_fmt(timing['codec_decode_s'], '.2f')} s{_codec_split(timing)})",
    ]
    tables = metrics.get("tables", {})
    if tables:
        lines.append(
            f"{'table':<10} {'rows':>8} {'shard':<5} {'rank':>4} {'fwd ratio':>9} "
            f"{'err/bound':>9} {'bound':>8} {'class':<10} {'enc ms':>8} {'dec ms':>8} "
            f"{'rel rms':>7} {'snap %':>6} {'bwd ratio':>9} {'bwd e/b':>8} {'bwd mean err':>12} "
            f"{'bwd row err':>11}"
        )
        for name in sorted(tables, key=_natural):
            t = tables[name]
            lines.append(
                f"{name:<10} {t['rows']:>8} {t['sharding']:<5} {t['ranks']:>4} "
                f"{_fmt(t.get('fwd_ratio'), '.2f'):>9} "
                f"{_fmt(t.get('max_error_over_bound'), '.3f'):>9} "
                f"{_fmt(t.get('bound'), '.4g'):>8} {t.get('class') or '-':<10} "
                f"{_fmt(_ms(t.get('encode_s')), '.1f'):>8} "
                f"{_fmt(_ms(t.get('decode_s')), '.1f'):>8} "
                f"{_fmt(t.get('fwd_rel_rms_error'), '.4f'):>7} "
                f"{_fmt(_pct(t.get('fwd_snapped_share')), '.1f'):>6} "
                f"{_fmt(t.get('bwd_ratio'), '.2f'):>9} "
                f"{_fmt(t.get('bwd_max_error_over_bound'), '.3f'):>8} "
                f"{_fmt(t.get('bwd_mean_signed_error'), '.2e'):>12} "
                f"{_fmt(t.get('bwd_row_relative_energy'), '.2e'):>11}"
            )
    lines += _alert_lines(metrics.get("error_alerts"))
    lines += _guard_lines(metrics.get("guard"))
    data = metrics["data"]
    if data.get("malformed_rows"):
        lines.append(
            f"data: {data['malformed_rows']} malformed rows skipped "
            f"({'; '.join(data.get('malformed_examples', [])[:3])})"
        )
    if metrics.get("notes"):
        lines.extend(f"note: {n}" for n in metrics["notes"])
    return "\n".join(lines)


def _alert_lines(alerts: dict[str, Any] | None) -> list[str]:
    """The error sample's alerts (issue 32): sampled blocks past the row-relative error level
    or holding NaN / Inf, by direction and table, with the steps they span; where the error
    passed the level, a line naming the bound that keeps it (the per-value backward)."""
    if not alerts or not alerts["count"]:
        return []
    parts = []
    for key, t in alerts["by_table"].items():
        bad = f", {t['nonfinite']} NaN/Inf" if t["nonfinite"] else ""
        parts.append(
            f"{key} x{t['count']} (steps {t['first_step']}-{t['last_step']}, "
            f"max {t['max_row_energy']:.3g}{bad})"
        )
    lines = [
        f"error alerts (row-relative error energy > {alerts['level']:g} or NaN/Inf): "
        f"{alerts['count']} sampled blocks: "
        + "; ".join(parts[:8])
        + (f"; and {len(parts) - 8} more tables" if len(parts) > 8 else "")
    ]
    if any(t["max_row_energy"] > alerts["level"] for t in alerts["by_table"].values()):
        lines.append(
            "  the gradients' error is large against their rows' own scale: a per-value "
            "backward bound keeps every element within it, e.g. comms.backward_bound: "
            "{mode: value, value: 0.03125} (docs/accuracy.md, issue 32)"
        )
    return lines


def _guard_lines(guard: dict[str, Any] | None) -> list[str]:
    """What ``comms.guard`` did (issue 32): each tightening by step, direction and table, or
    that it was on and tightened nothing, and its share of the training time; nothing where
    it was off."""
    if guard is None:
        return []
    events = guard["events"]
    share = guard.get("share_of_train")
    cost = f" ({guard['seconds'] * 1e3:.1f} ms, {_fmt(_pct(share), '.3f')}% of training)"
    if not events:
        return ["guard: on, no bound tightened" + cost]
    parts = [
        f"step {e['step']} {e['direction']}/{e['table']} "
        + ("exact" if e["factor"] == 0 else f"x{e['factor']:g}")
        for e in events
    ]
    return [
        f"guard: {len(events)} tightenings{cost}: "
        + "; ".join(parts[:8])
        + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")
    ]


def _ms(s: float | None) -> float | None:
    return None if s is None else 1e3 * s


def _pct(share: float | None) -> float | None:
    return None if share is None else 100 * share


def write_json(metrics: Mapping[str, Any], path: str | Path) -> None:
    """Writes the metrics as JSON (NaN becomes null).

    Args:
        metrics: The metrics dict.
        path: Destination file (parent folders are created).
    """

    def clean(v: Any) -> Any:
        if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
            return None
        if isinstance(v, Mapping):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(clean(metrics), indent=1))
    tmp.replace(p)


def write_tensorboard(metrics: Mapping[str, Any], logdir: str | Path) -> None:
    """Writes the run's curves as TensorBoard scalars.

    Args:
        metrics: The metrics dict (its ``history`` holds the curves).
        logdir: TensorBoard log folder.
    """
    from torch.utils.tensorboard import SummaryWriter

    hist = metrics["history"]
    with SummaryWriter(log_dir=str(logdir)) as w:
        for step, loss in zip(hist["train_step"], hist["train_loss"], strict=True):
            w.add_scalar("train/loss", loss, step)
        for step, st in zip(hist["train_step"], hist["step_time_s"], strict=True):
            w.add_scalar("train/step_time_ms", 1e3 * st, step)
        for e in metrics["evals"]:
            w.add_scalar("eval/auc", e["auc"], e["step"])
            w.add_scalar("eval/logloss", e["logloss"], e["step"])
        for point in hist["tables"]:
            step = point["step"]
            for name, t in point["tables"].items():
                if t.get("fwd_ratio") is not None:
                    w.add_scalar(f"ratio/{name}", t["fwd_ratio"], step)
                if t.get("bound") is not None:
                    w.add_scalar(f"bound/{name}", t["bound"], step)
            if point.get("fwd_ratio") is not None:
                w.add_scalar("comms/fwd_ratio", point["fwd_ratio"], step)
        # Per table at the end of the run: the forward's sampled error statistics, the
        # backward's ratio, error/bound and signed error.
        last = hist["train_step"][-1] if hist["train_step"] else 0
        for name, t in metrics.get("tables", {}).items():
            for key in (
                "fwd_rel_rms_error",
                "fwd_snapped_share",
                "bwd_ratio",
                "bwd_max_error_over_bound",
                "bwd_mean_signed_error",
            ):
                if t.get(key) is not None:
                    w.add_scalar(f"{key}/{name}", t[key], last)
        w.add_scalar("final/auc", metrics["final"].get("auc") or float("nan"), 0)
        w.add_scalar("final/examples_per_s", metrics["timing"]["examples_per_s"], 0)


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def write_png(metrics: Mapping[str, Any], path: str | Path) -> None:
    """Draws the report: loss curves, AUC, per-table ratio and effective bound over steps.

    Args:
        metrics: The metrics dict.
        path: Destination PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    hist = metrics["history"]
    run = metrics["run"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    fig.suptitle(
        f"DLRM {run['dataset']} comm={run['comm']}: {run['world_size']} ranks, batch "
        f"{run['batch_size']}/rank, dim {run['embedding_dim']}"
    )

    ax = axes[0][0]
    steps = hist["train_step"]
    if steps:
        ax.plot(steps, hist["train_loss"], color="0.8", lw=0.6, label="train loss (step)")
        window = max(1, len(steps) // 40)
        ax.plot(steps, _smooth(hist["train_loss"], window), label=f"train loss (mean {window})")
    evals = metrics["evals"]
    if evals:
        ax.plot(
            [e["step"] for e in evals], [e["logloss"] for e in evals], "o-", label="eval log loss"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("log loss")
    ax.set_title("loss")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    if evals:
        ax.plot([e["step"] for e in evals], [e["auc"] for e in evals], "o-", label="eval AUC")
    oracle = metrics["data"].get("oracle_auc")
    if oracle is not None:
        ax.axhline(oracle, ls="--", color="k", lw=0.8, label=f"hidden model {oracle:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel("AUROC")
    ax.set_title("held-out AUC")
    ax.legend(fontsize=8)

    points = hist["tables"]
    names = sorted({n for p in points for n in p["tables"]}, key=_natural)
    ax_r, ax_b = axes[1][0], axes[1][1]
    cmap = plt.get_cmap("tab20", max(1, len(names)))
    for k, name in enumerate(names):
        xs, rs, bs = [], [], []
        for p in points:
            t = p["tables"].get(name)
            if t is None:
                continue
            xs.append(p["step"])
            rs.append(t.get("fwd_ratio") or float("nan"))
            bs.append(t.get("bound") if t.get("bound") is not None else float("nan"))
        ax_r.plot(xs, rs, color=cmap(k), lw=1, label=name)
        ax_b.plot(xs, bs, color=cmap(k), lw=1, label=name)
        whole_run = metrics.get("tables", {}).get(name, {})
        bwd = whole_run.get("bwd_ratio")
        if bwd and xs:  # the backward's whole-run ratio, at the last step
            ax_r.scatter([xs[-1]], [bwd], color=cmap(k), marker="x", s=18)
        rms = whole_run.get("fwd_rel_rms_error")
        if rms is not None and xs:  # the forward's sampled RMS error / RMS value
            ax_b.scatter([xs[-1]], [rms], color=cmap(k), marker="o", s=14)
    ax_r.set_yscale("log")
    ax_r.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax_r.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("raw / wire bytes (interval)")
    ax_r.set_title("compression ratio per table (lines: forward; x: backward, whole run)")
    ax_b.set_xlabel("step")
    ax_b.set_ylabel("relative bound (x decay factor)")
    ax_b.set_title("effective error bound per table (o: forward RMS error / RMS value, run)")
    if names:
        ax_b.legend(fontsize=6, ncol=2, loc="upper right")
    else:
        for a in (ax_r, ax_b):
            a.text(0.5, 0.5, "no lossy tables in this run", ha="center", transform=a.transAxes)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)


def write_outputs(
    metrics: Mapping[str, Any],
    json_path: str | Path | None = None,
    tensorboard_dir: str | Path | None = None,
    png_path: str | Path | None = None,
) -> None:
    """Writes each requested output and prints where it went.

    Args:
        metrics: The run's metrics.
        json_path: The metrics JSON file (None: not written).
        tensorboard_dir: The TensorBoard log folder (None: not written).
        png_path: The PNG report (None: not drawn).
    """
    for label, path, write in (
        ("metrics", json_path, write_json),
        ("tensorboard", tensorboard_dir, write_tensorboard),
        ("report", png_path, write_png),
    ):
        if path:
            write(metrics, path)
            print(f"{label}: {path}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Re-draws the summary (and optionally PNG / TensorBoard) from a metrics JSON file.

    Args:
        argv: Command line (default ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics_json")
    ap.add_argument("--png", default=None)
    ap.add_argument("--tensorboard-dir", default=None)
    args = ap.parse_args(argv)
    metrics = json.loads(Path(args.metrics_json).read_text())
    print(format_summary(metrics))
    write_outputs(metrics, tensorboard_dir=args.tensorboard_dir, png_path=args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
