"""`benchmarks/gpu_codec_bench.py`: its command line (the grouped call's shape, formats,
destinations) and its refusal without a GPU (the timings need CUDA; tested where one is)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_codec_bench.py"
sys.path.insert(0, str(BENCH.parent))  # its sibling modules (grouped_call)
_spec = importlib.util.spec_from_file_location("gpu_codec_bench", BENCH)
assert _spec is not None and _spec.loader is not None
gpu_codec_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_codec_bench)


def test_defaults_are_the_production_grouped_call_in_both_formats() -> None:
    args = gpu_codec_bench.parse_args([])
    assert args.grouped_shape == (26, 2048, 64) and args.destinations == 8
    assert args.formats == ["entropy", "packed"]
    args = gpu_codec_bench.parse_args(["--grouped-shape", "4X16x8", "--formats", "packed"])
    assert args.grouped_shape == (4, 16, 8) and args.formats == ["packed"]


@pytest.mark.parametrize(
    "argv",
    [["--grouped-shape", "26x2048"], ["--grouped-shape", "0x8x8"], ["--grouped-shape", "27x8x8"],
     ["--destinations", "0"], ["--formats", "huffman"]],
)  # fmt: skip
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        gpu_codec_bench.parse_args(argv)
    assert info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_exits_2_naming_why() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--formats", "packed"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "no CUDA device" in done.stderr
