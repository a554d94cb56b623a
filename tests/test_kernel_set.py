"""The kernel set: the device orchestration reaches the kernels only through the set it is given,
the torch twins offer every launcher it calls with the Triton launcher's signature, and the
``"reference"`` backend (the orchestration over the twins) runs without triton."""

from __future__ import annotations

import ast
import inspect
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from torchrec_lossy.codec.kernel_set import KernelSet, load_kernels

CODEC = Path(__file__).resolve().parents[1] / "torchrec_lossy" / "codec"
ORCHESTRATION = (
    "device_compress.py",
    "device_decompress.py",
    "device_packed_compress.py",
    "device_packed_decode.py",
)


def _launcher_calls() -> dict[str, set[str]]:
    """Per kernel module, the launchers the orchestration calls (``k.huffman.encode_chunks(``)."""
    calls: dict[str, set[str]] = {m: set() for m in KernelSet._fields}
    pattern = re.compile(rf"\b(?:k|kernels)\.({'|'.join(KernelSet._fields)})\.(\w+)\(")
    for name in ORCHESTRATION:
        for module, fn in pattern.findall((CODEC / name).read_text()):
            calls[module].add(fn)
    return calls


def test_orchestration_imports_no_kernel_module() -> None:
    """device_compress / device_decompress take the set as an argument: they import nothing from
    ``kernels`` (the launch tables and column records they build are the codec's)."""
    for name in ORCHESTRATION:
        tree = ast.parse((CODEC / name).read_text())
        imported = {
            f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom) else a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for a in node.names
        }
        kernels = {i for i in imported if i.startswith("torchrec_lossy.kernels")}
        assert not kernels, (name, kernels)
        # The scan sees this file's imports: each orchestration takes the codec's records.
        assert any(i.startswith("torchrec_lossy.codec.") for i in imported), (name, imported)


def test_every_kernel_module_is_called() -> None:
    """The source scan finds launchers of every module (it is not looking at the wrong files)."""
    calls = _launcher_calls()
    assert all(calls.values()), calls
    assert "encode_chunks" in calls["huffman"] and "decode_outputs" in calls["quantize"]


def test_twins_offer_every_launcher_with_its_signature() -> None:
    """Each launcher the orchestration calls exists in both sets with the same parameters."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton", reason="triton is not installed: no launchers to compare")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    triton_set, twins = load_kernels(device), load_kernels(device, reference=True)
    for module, names in _launcher_calls().items():
        for fn in sorted(names):
            launcher = getattr(getattr(triton_set, module), fn)
            twin = getattr(getattr(twins, module), fn, None)
            assert callable(twin), f"kernels/{module}_ref.py has no {fn}"
            want = [
                (p.name, p.kind, p.default) for p in inspect.signature(launcher).parameters.values()
            ]
            got = [(p.name, p.kind, p.default) for p in inspect.signature(twin).parameters.values()]
            assert got == want, f"{module}.{fn}"


def test_reference_backend_runs_without_triton(run_without_triton: Callable[[str], str]) -> None:
    """With triton unimportable, backend "reference" compresses to the CPU path's bytes and
    decodes them (grouped too); the Triton set says what is missing."""
    out = run_without_triton(
        "import torch\n"
        "from torchrec_lossy.codec import CodecConfig, compress, decompress, compress_groups\n"
        "from torchrec_lossy.codec.kernel_set import load_kernels\n"
        "x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))\n"
        "x[5] = x[2]\n"
        "ref = CodecConfig(backend='reference')\n"
        "p = compress([x, x[:3]], [0.01, 0.0], ref)\n"
        "cpu = CodecConfig(backend='cpu')\n"
        "print('SAME', torch.equal(p, compress([x, x[:3]], [0.01, 0.0], cpu)))\n"
        "got = decompress(p, backend='reference')\n"
        "print('DECODED', all(torch.equal(a, b) for a, b in zip(got, decompress(p))))\n"
        "g = compress_groups([[x], [x[:3]]], [[0.01], [0.0]], ref)\n"
        "want = torch.cat([compress([x], [0.01], cpu), compress([x[:3]], [0.0], cpu)])\n"
        "print('GROUPED', torch.equal(g.buffer, want))\n"
        "try:\n"
        "    load_kernels(torch.device('cpu'))\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    for line in ("SAME True", "DECODED True", "GROUPED True"):
        assert line in out, out
    assert "ERR the triton backend needs the triton package" in out, out
