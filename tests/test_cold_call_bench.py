"""`benchmarks/cold_call_bench.py` runs as its command says and refuses sizes MX4 cannot take."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "cold_call_bench.py"


def test_default_run_times_every_call_and_bad_sizes_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--reps", "2", "--evict", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    calls = json.loads(out.read_text())["calls"]
    names = [c["call"] for c in calls]
    assert (
        len(names) == 11
        and "TorchRec mx4 encode" in names
        and "ours: pooled decode, one peer" in names
    )
    assert all(c["loop_us"] > 0 and c["after_matmul_us"] > 0 for c in calls)
    assert names[0] in done.stdout  # the table is printed
    bad = subprocess.run(
        [sys.executable, str(BENCH), "--rows", "3", "--dim", "5"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "is 105 values: MX4 needs a multiple of 32" in bad.stderr
