"""The DLRM example end to end: tiny 2-process torchrun runs, checkpoint/resume, the netns script.

Each torchrun run takes 15-30 s on 2 CPU cores (most of it importing TorchRec and planning);
the longer cases are marked ``slow``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "dlrm_criteo.py"
NETNS = ROOT / "scripts" / "netns_cluster.sh"
BENCH = ROOT / "benchmarks" / "e2e_bench.py"
sys.path.insert(0, str(ROOT / "examples"))

from torchrec_lossy.config import ErrorBound  # noqa: E402
from torchrec_lossy.traffic import DEFAULT_CRITEO_SAMPLE  # noqa: E402

pytestmark = pytest.mark.dist
TINY = ["--steps", "6", "--batch-size", "32", "--eval-batches", "2", "--no-progress"]


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    """Runs a command; on timeout sends SIGTERM first, so scripts can clean up (netns)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _torchrun(
    args: list[str], torchrun_args: tuple[str, ...] = (), timeout: int = 240
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        *torchrun_args,
        str(EXAMPLE),
        *args,
    ]
    proc = _run(cmd, timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def _killed_after_step_3(
    args: list[str], ckpt: Path, metrics: Path
) -> subprocess.CompletedProcess[str]:
    """torchrun --max-restarts 1 with checkpoints every 2 steps: the last rank dies after step
    3 and the job resumes from step 2."""
    return _torchrun(
        [
            *args,
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "2",
            "--simulate-failure-at",
            "3",
            "--metrics-json",
            str(metrics),
        ],
        torchrun_args=("--max-restarts", "1"),
        timeout=360,
    )


def _load(path: Path) -> dict[str, Any]:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())


def _check_common(m: dict[str, Any], steps: int) -> None:
    assert m["run"]["world_size"] == 2 and m["run"]["backend"] == "gloo"
    assert m["run"]["steps_done"] == steps
    final = m["final"]
    assert final["eval_rows"] > 0
    assert final["logloss"] is not None and 0.0 < final["logloss"] < 5.0
    assert final["auc"] is None or 0.0 <= final["auc"] <= 1.0
    timing = m["timing"]
    assert timing["step_time_s_mean"] > 0 and timing["examples_per_s"] > 0
    assert len(m["tables"]) == 26
    assert m["history"]["train_step"][-1] == steps
    assert all(math.isfinite(v) for v in m["history"]["train_loss"])
    assert m["evals"] and m["evals"][-1]["step"] == steps


def test_link_gbit_prices_the_link_between_hosts() -> None:
    """--link-gbit is the inter-host bandwidth; on one host, every peer's."""
    import argparse
    from types import SimpleNamespace

    import torch
    from dlrm_env import DistEnv, load_plan_config
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=8, feature_names=["f"])
    ]
    ebc = SimpleNamespace(embedding_bag_configs=lambda: tables)
    sparse_arch = SimpleNamespace(embedding_bag_collection=ebc)
    model = SimpleNamespace(model=SimpleNamespace(sparse_arch=sparse_arch))
    args = argparse.Namespace(config=None, link_gbit=1.0, batch_size=32)
    gib_s = 1e9 / 8 / 2**30

    def topology(world: int, local: int) -> Any:
        env = DistEnv(0, world, 0, local, torch.device("cpu"), "gloo")
        return load_plan_config(args, env, model)[0].topology  # type: ignore[arg-type]

    two_hosts = topology(4, 2)
    assert two_hosts.local_world_size == 2 and two_hosts.inter_host_bandwidth_gib_s == gib_s
    assert two_hosts.intra_host_bandwidth_gib_s is None  # TorchRec's default: ranks talk locally
    one_host = topology(2, 2)
    assert one_host.intra_host_bandwidth_gib_s == one_host.inter_host_bandwidth_gib_s == gib_s


def test_parse_args_defaults_and_errors() -> None:
    import dlrm_criteo as ex

    args = ex.parse_args([])
    assert args.dataset == "synthetic" and args.comm == "lossy" and args.preset == "criteo_kaggle"
    assert ex.parse_args(["--dataset", "criteo-1tb", "--data-path", "x"]).preset == "criteo_1tb"
    for bad in (
        ["--dataset", "criteo-kaggle"],  # needs --data-path
        ["--epochs", "2"],  # synthetic is endless
        ["--batch-size", "0"],
        ["--comm", "fp8"],
        ["--dense-arch", "64,x"],
    ):
        with pytest.raises(SystemExit):
            ex.parse_args(bad)


@pytest.mark.timeout(300)
def test_torchrun_config_error_is_one_line_per_rank(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("comms:\n  default_bound: {mode: relative, value: 3}\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = _run([*cmd, str(EXAMPLE), *TINY, "--config", str(bad)], timeout=240)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if ": config error: " in x]
    # Each rank says it once: the file, the key, the value and what is allowed; no rank's
    # traceback (torchrun's own failure report stays, it is not ours to silence).
    expected = f"config error: {bad}: comms.default_bound: bound.value=3.0 is invalid: allowed <= 1"
    assert sorted(x.split(":")[0] for x in lines) == ["rank 0", "rank 1"], proc.stderr[-3000:]
    assert all(expected in x for x in lines), lines
    assert 'dlrm_criteo.py", line' not in proc.stderr, proc.stderr[-3000:]


def test_torchrun_lossy_synthetic(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    # The codec itself, whatever this machine's speeds (format auto may send raw on localhost).
    config = tmp_path / "entropy.yaml"
    config.write_text("comms: {format: entropy}\n")
    proc = _torchrun(
        [
            *TINY,
            "--config",
            str(config),
            "--comm",
            "lossy",
            "--metrics-json",
            str(out),
            "--report-png",
            str(tmp_path / "r.png"),
            "--tensorboard-dir",
            str(tmp_path / "tb"),
        ]
    )
    assert "== DLRM / synthetic / comm=lossy" in proc.stdout
    m = _load(out)
    _check_common(m, 6)
    comms = m["comms"]
    assert comms["source"] == "measured"
    assert 0 < comms["fwd_wire_bytes_per_step"] < comms["fwd_raw_bytes_per_step"]
    assert comms["fwd_ratio"] > 2
    # Raw is TorchRec's uncompressed forward (the exact backward carries the same rows), even
    # though the output dedupe hands the codec only the distinct rows.
    assert comms["fwd_raw_bytes_per_step"] == comms["bwd_raw_bytes_per_step"] > 0
    assert 0 < comms["fwd_coded_bytes_per_step"] < comms["fwd_raw_bytes_per_step"]
    assert 0 < comms["input_wire_bytes_per_step"] < comms["input_raw_bytes_per_step"]
    assert "input " in proc.stdout and "raw = TorchRec's uncompressed bytes" in proc.stdout
    compressed = [t for t in m["tables"].values() if t["sharding"] != "DP"]
    assert compressed
    for t in compressed:
        assert t["fwd_ratio"] > 1
        assert t["max_error_over_bound"] <= 1.0 + 1e-6
        assert t["bound"] == pytest.approx(ErrorBound().value)  # the default bound
    # Raw is what TorchRec hands its all-to-all, every rank's own block included: per
    # all-to-all table (one feature each), its owner sends 2 destinations 32 rows x 16 fp32.
    assert comms["fwd_raw_bytes_per_step"] == 2 * 32 * 16 * 4 * len(compressed)
    timing = m["timing"]
    assert 0 <= timing["codec_time_share"] < 1
    # The per-direction split adds up to the totals, and every coded all-to-all took time.
    split = timing["codec_s_by_direction"]
    for phase in ("encode", "decode"):
        assert all(split[d][phase] > 0 for d in ("input", "fwd", "bwd"))
        total = sum(split[d][phase] for d in split)
        assert total == pytest.approx(timing[f"codec_{phase}_s"], rel=1e-12)
    assert "encode / decode s: input " in proc.stdout
    assert m["data"]["oracle_auc"] > 0.7
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert any((tmp_path / "tb").iterdir())


@pytest.mark.skipif(not DEFAULT_CRITEO_SAMPLE.is_file(), reason="shared Criteo sample missing")
def test_torchrun_none_on_the_criteo_sample(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    _torchrun(
        [
            *TINY,
            "--comm",
            "none",
            "--dataset",
            "criteo-1tb",
            "--data-path",
            str(DEFAULT_CRITEO_SAMPLE),
            "--metrics-json",
            str(out),
        ]
    )
    m = _load(out)
    _check_common(m, 6)
    comms = m["comms"]
    assert comms["source"] == "computed from plan"
    assert comms["fwd_wire_bytes_per_step"] == comms["fwd_raw_bytes_per_step"] > 0
    assert comms["fwd_ratio"] == 1
    assert m["data"]["rows_read"] > 0 and m["data"]["malformed_rows"] == 0


@pytest.mark.slow
def test_checkpoint_resume_after_a_killed_worker(tmp_path: Path) -> None:
    """torchrun --max-restarts 1: the last rank dies after step 3, the job resumes from step 2."""
    import torch
    import yaml

    out = tmp_path / "m.json"
    ckpt = tmp_path / "ckpt"
    # The codec forced: on localhost `auto` would take TorchRec's own all-to-all, no seam state.
    config = yaml.safe_load((ROOT / "configs" / "criteo_kaggle.yaml").read_text())
    config["comms"]["format"] = "entropy"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    proc = _killed_after_step_3(
        [*TINY, "--comm", "lossy", "--config", str(tmp_path / "config.yaml")], ckpt, out
    )
    assert "simulated failure after step 3" in proc.stdout + proc.stderr
    m = _load(out)
    _check_common(m, 6)
    assert m["run"]["start_step"] == 2
    assert any("resumed from" in n for n in m["notes"])
    # The restart planned from the first attempt's speeds (auto's measured plan could differ
    # and then not load the checkpoint: DCP's "Missing key", seen in CI).
    assert (ckpt / "plan_speeds.json").is_file()
    assert "by the first attempt" in proc.stdout
    done = sorted(p.name for p in ckpt.glob("step_*") if (p / "COMPLETE").is_file())
    assert done == ["step_00000004", "step_00000006"]  # the two newest are kept
    for rank in (0, 1):
        extra = torch.load(ckpt / "step_00000006" / f"rank{rank}.pt", weights_only=True)
        assert extra["step"] == 6
        # The adaptive bounds' iteration counter carried on across the restart.
        assert [int(s["iteration"]) for s in extra["bounds"].values()] == [6]
        # The train-loss window too: steps 1-2 from the checkpoint, 3-6 after the restart.
        assert len(extra["recent_losses"]) == 6


@pytest.mark.slow
@pytest.mark.parametrize("backward", ["none", "fp16", "lossy"])
def test_resumed_run_matches_an_uninterrupted_one(tmp_path: Path, backward: str) -> None:
    config = (ROOT / "configs" / "criteo_kaggle.yaml").read_text()
    line = next(x for x in config.splitlines(keepends=True) if x.startswith("  backward:"))
    (tmp_path / "config.yaml").write_text(config.replace(line, f"  backward: {backward}\n"))
    common = [*TINY, "--comm", "lossy", "--config", str(tmp_path / "config.yaml")]
    _killed_after_step_3(common, tmp_path / "ck", tmp_path / "a.json")
    _torchrun([*common, "--metrics-json", str(tmp_path / "b.json")])
    a, b = _load(tmp_path / "a.json"), _load(tmp_path / "b.json")
    assert a["final"]["logloss"] == pytest.approx(b["final"]["logloss"], abs=1e-6)
    # final.train_loss averages the same steps (the window travels in the checkpoint).
    assert a["final"]["train_loss"] == pytest.approx(b["final"]["train_loss"], abs=1e-6)


# comms.guard on, tripped: the old block-relative backward alerts on every sampled gradient
# table of the example (docs/accuracy.md); checks and samples every step, every table coded.
GUARD_YAML = """\
comms:
  format: entropy
  backward_bound: {mode: relative, value: 0.01}
  error_sample_every: 1
  guard: {enabled: true, check_every: 1, max_tightenings: 2}
"""


@pytest.mark.slow
def test_guard_tightenings_resume_from_the_checkpoint(tmp_path: Path) -> None:
    """The guard's tightenings are in the metrics, the same in both ranks' checkpoint files, and
    a run killed after step 3 and resumed from step 2 ends with the uninterrupted run's."""
    import torch

    (tmp_path / "guard.yaml").write_text(GUARD_YAML)
    # Table-wise pinned: auto sharding ties TW and CW on this tiny model (0.0331 ms each), so
    # start-up timing would pick the plan, and with it which blocks the guard sees first.
    common = [
        *TINY,
        "--sharding",
        "table_wise",
        "--comm",
        "lossy",
        "--config",
        str(tmp_path / "guard.yaml"),
    ]
    _killed_after_step_3(common, tmp_path / "ck", tmp_path / "a.json")
    proc = _torchrun([*common, "--metrics-json", str(tmp_path / "b.json")])
    a, b = _load(tmp_path / "a.json"), _load(tmp_path / "b.json")
    assert a["run"]["start_step"] == 2
    events = b["guard"]["events"]
    assert events and {e["direction"] for e in events} == {"bwd"}
    assert {e["step"] for e in events} <= set(range(2, 7)) and events[0]["step"] == 2
    assert max(e["level"] for e in events) == 2 and 0.0 in {e["factor"] for e in events}
    assert "guard: " in proc.stdout and "tightenings" in proc.stdout
    # Reproducible from the checkpoint: the resumed run holds the tightening of step 2 and
    # the check in flight then (decided before the failure), and decides the rest as the
    # uninterrupted run did.
    assert a["guard"]["events"] == events
    assert a["final"]["logloss"] == pytest.approx(b["final"]["logloss"], abs=1e-6)
    saved = [
        torch.load(tmp_path / "ck" / "step_00000006" / f"rank{r}.pt", weights_only=True)["guard"]
        for r in (0, 1)
    ]
    assert saved[0] == saved[1] and next(iter(saved[0].values()))["steps"] == 6


def _netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' missing (apt-get install -y iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"network namespaces unavailable: {probe.stderr.strip()}"
    return None


NETNS_SKIP = _netns_skip_reason()


def _netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.skipif(NETNS_SKIP is not None, reason=str(NETNS_SKIP))
def test_netns_link_is_rate_limited_and_cleaned_up() -> None:
    before = _netns_list()
    proc = _run(["bash", str(NETNS), "--measure", "--rate", "200mbit", "--port", "29599"], 90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in (proc.stdout + proc.stderr).splitlines() if "Gbit/s" in x)
    gbit = float(line.split("TCP ")[1].split()[0])
    assert 0.1 < gbit < 0.25  # the tbf limit holds
    assert _netns_list() == before  # its namespaces are gone


@pytest.mark.slow
@pytest.mark.skipif(NETNS_SKIP is not None, reason=str(NETNS_SKIP))
def test_netns_two_node_training(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    proc = _run(
        ["bash", str(NETNS), "--port", "29598", "--", *TINY, "--metrics-json", str(out)], 300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_common(_load(out), 6)


@pytest.mark.slow
@pytest.mark.skipif(NETNS_SKIP is not None, reason=str(NETNS_SKIP))
@pytest.mark.timeout(900)
def test_netns_two_hosts_of_two_ranks(tmp_path: Path) -> None:
    """--nproc-per-node 2: 4 ranks, 2 per namespace; on gloo (intra_host auto: coded) both
    links carry coded bytes, counted apart."""
    out = tmp_path / "m.json"
    # The codec forced: `auto` may send this tiny run raw, or on TorchRec's own all-to-all.
    config = tmp_path / "config.yaml"
    config.write_text("comms: {format: entropy}\n")
    cmd = ["bash", str(NETNS), "--port", "29597", "--nproc-per-node", "2", "--"]
    proc = _run([*cmd, *TINY, "--config", str(config), "--metrics-json", str(out)], 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = _load(out)
    assert m["run"]["world_size"] == 4 and m["run"]["steps_done"] == 6
    comms = m["comms"]
    for d in ("fwd", "bwd"):
        same, cross = (comms[f"{d}_{link}_bytes_per_step"] for link in ("same_host", "cross_host"))
        assert same > 0 and cross > 0, comms
        # Every wire byte goes to one of the two links (the self block never leaves the rank).
        assert same + cross <= comms[f"{d}_wire_bytes_per_step"] + 1e-6, comms


@pytest.mark.slow
def test_e2e_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run(
        [
            sys.executable,
            str(BENCH),
            "--modes",
            "none,lossy",
            "--none-seeds",
            "0",
            "--steps",
            "4",
            "--batch-size",
            "32",
            "--embedding-dim",
            "16",
            "--no-netns",
            "--out-dir",
            str(tmp_path / "runs"),
            "--json",
            str(out),
        ],
        600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {r["mode"] for r in result["runs"]} == {"none", "lossy"}
    assert "speedup" in proc.stdout
