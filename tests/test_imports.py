"""The import contract: every module imports alone, and no module imports another's private names.

1. Every module of ``torchrec_lossy`` (``torchrec_lossy.kernels.*`` included) is imported first,
   alone, in a fresh interpreter: no import cycle and no hidden dependence on import order. One
   subprocess per group loads only third-party packages (torch, triton; TorchRec for the
   groups that need it), then forks one child per module, which starts with no module of this
   project loaded and imports just that one (a fork is cheap; a new interpreter per module would
   pay TorchRec's import every time). The codec core (``config``, ``codec``, ``kernels``) must
   also import without TorchRec or fbgemm (DESIGN: a GPU box without fbgemm can still run it).
2. No module of ``torchrec_lossy/``, ``kernels/``, ``benchmarks/`` or ``examples/`` imports a
   private (``_underscore``) name or module from another module.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "torchrec_lossy"
CORE = ("torchrec_lossy", "torchrec_lossy.config", "torchrec_lossy.codec", "torchrec_lossy.kernels")
# Third-party packages a module of the codec core must not pull in.
CORE_FORBIDDEN = ("torchrec", "fbgemm_gpu")


def _files() -> dict[str, Path]:
    """Module name -> file, for the package and the top-level kernels/ it ships as a subpackage."""
    out: dict[str, Path] = {}
    for base, prefix in ((ROOT / PACKAGE, PACKAGE), (ROOT / "kernels", f"{PACKAGE}.kernels")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if rel.parts[0] == "kernels" and base.name == PACKAGE:
                continue  # the worktree's symlink to ../kernels, walked as kernels/ itself
            parts = [prefix, *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _in_core(module: str) -> bool:
    return any(module == c or module.startswith(c + ".") for c in CORE[1:]) or module == CORE[0]


# Runs in a subprocess: argv = the third-party modules to preload, "--", the modules to check,
# "--core" flag. Prints one line per failing module with its traceback.
_CHILD = r"""
import importlib, os, sys, traceback
args = sys.argv[1:]
sep = args.index("--")
preload, modules = args[:sep], [m for m in args[sep + 1:] if m != "--core"]
core = "--core" in args
for name in preload:
    importlib.import_module(name)
failed = []
for module in modules:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ours = [m for m in sys.modules if m.split(".")[0] == "torchrec_lossy"]
            assert not ours, f"already loaded before the import: {ours}"
            importlib.import_module(module)
            if core:
                bad = [m for m in ("torchrec", "fbgemm_gpu") if m in sys.modules]
                assert not bad, f"the codec core imported {bad}"
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(module)
print("FAILED:" + ",".join(failed))
"""


def _run_group(modules: list[str], preload: list[str], core: bool) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-c", _CHILD, *preload, "--", *modules] + (["--core"] if core else [])
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    failed = [ln for ln in res.stdout.splitlines() if ln.startswith("FAILED")]
    assert res.returncode == 0 and failed, res.stderr[-4000:]
    assert failed[-1] == "FAILED:", f"{failed[-1]}\n{res.stderr[-6000:]}"


def test_module_list_covers_the_package_and_the_kernels() -> None:
    names = _files()
    for must in (
        "torchrec_lossy",
        "torchrec_lossy.codec.pipeline",
        "torchrec_lossy.distributed.kjt_codec",
        "torchrec_lossy.distributed.dedupe",
        "torchrec_lossy.kernels",
        "torchrec_lossy.kernels.huffman",
        "torchrec_lossy.planner.planner",
    ):
        assert must in names, must


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    names = sorted(_files())
    core = [m for m in names if _in_core(m)]
    rest = [m for m in names if not _in_core(m)]
    pytest.importorskip("triton")
    # The core group preloads only torch and triton; the rest also TorchRec and fbgemm.
    _run_group(core, ["torch", "triton"], core=True)
    _run_group(rest, ["torch", "triton", "fbgemm_gpu", "torchrec", "torchrec.distributed"], False)


def test_the_child_reports_a_failing_import() -> None:
    """The group runner is not vacuous: a module that fails to import is reported."""
    with pytest.raises(AssertionError, match="no_such_module_here"):
        _run_group(["torchrec_lossy.no_such_module_here"], ["torch"], core=False)


# ---------------------------------------------------------------------------------------------
# Private names.

# Private imports being removed by the `codec` helper (issues 12/13: codec container module,
# no import cycles). The lead empties this list when merging that work; do not add to it.
CODEC_ALLOWLIST: set[tuple[str, str, str]] = set()
# Third-party private names with no public equivalent: TorchRec's own KJTAllToAllTensorsAwaitable
# builds its recat with _get_recat, and the lossy awaitable must produce the identical recat
# (one adapter, input_dist.torchrec_recat, pinned by tests/distributed/test_input_dist.py).
# benchmarks/device_cost_bench.py counts the aten ops a GPU would run (issue 31's budget, as
# ../shared/tools/device_cost.py counts them): only a TorchDispatchMode sees them.
THIRD_PARTY_ALLOWLIST = {
    ("torchrec_lossy/distributed/input_dist.py", "torchrec.distributed.dist_data", "_get_recat"),
    ("benchmarks/device_cost_bench.py", "torch.utils._python_dispatch", "*"),
}
ALLOWLIST = CODEC_ALLOWLIST | THIRD_PARTY_ALLOWLIST


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(rel: str, node: ast.ImportFrom) -> str:
    """The absolute module name of a (possibly relative) ``from ... import`` in file ``rel``."""
    if not node.level:
        return node.module or ""
    pkg = list(Path(rel).parent.parts)
    if pkg and pkg[0] == "kernels":
        pkg = [PACKAGE, *pkg]
    base = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_imports(rel: str, source: str) -> set[tuple[str, str, str]]:
    """``(file, module, name)`` of every private name or private module a file imports, and of
    every private attribute it reads from one of this project's modules (``common._x`` after
    ``from torchrec_lossy.kernels import common``).

    Args:
        rel: The file's path relative to the repository root.
        source: Its text.

    Returns:
        The imports; ``name`` is ``"*"`` where the module itself is private
        (``from a._b import c``, ``import a._b``).
    """
    ours = set(_files())
    found: set[tuple[str, str, str]] = set()
    bound: dict[str, str] = {}  # a local name -> the module of ours it is bound to
    tree = ast.parse(source, filename=rel)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _resolve(rel, node)
            if any(_private(p) for p in module.split(".")):
                found.add((rel, module, "*"))
            found.update((rel, module, a.name) for a in node.names if _private(a.name))
            for a in node.names:
                if f"{module}.{a.name}" in ours:
                    bound[a.asname or a.name] = f"{module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if any(_private(p) for p in a.name.split(".")):
                    found.add((rel, a.name, "*"))
                if a.name in ours:
                    bound[a.asname or a.name.split(".")[0]] = (a.asname and a.name) or a.name.split(
                        "."
                    )[0]
    for node in ast.walk(tree):
        parts = _dotted(node) if isinstance(node, ast.Attribute) else None
        if not parts or parts[0] not in bound:
            continue
        parts = [*bound[parts[0]].split("."), *parts[1:]]
        for i in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:i])
            if module in ours:
                if _private(parts[i]):
                    found.add((rel, module, parts[i]))
                break
    return found


def _scanned_files() -> list[Path]:
    files = [p for p in sorted((ROOT / PACKAGE).rglob("*.py")) if "kernels" not in p.parts]
    for folder in ("kernels", "benchmarks", "examples"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def test_no_module_imports_a_private_name_of_another() -> None:
    found: set[tuple[str, str, str]] = set()
    for path in _scanned_files():
        found |= private_imports(str(path.relative_to(ROOT)), path.read_text())
    new = sorted(found - ALLOWLIST)
    assert not new, "private imports (make the name public, or move the code):\n" + "\n".join(
        map(str, new)
    )
    stale = sorted(ALLOWLIST - found)
    assert not stale, (
        f"allowlisted private imports that are gone (drop them from the list): {stale}"
    )


def test_private_import_scan_sees_every_form() -> None:
    """The scanner is not vacuous: each import form of a private name is found."""
    source = (
        "from __future__ import annotations\n"
        "from torchrec_lossy.codec.pipeline import _Reader, LossyCodec\n"
        "from ._common import x\n"
        "from . import _aot\n"
        "import torch._dynamo\n"
        "from torchrec_lossy.codec import pipeline\n"
        "from torchrec_lossy.kernels import common as c\n"
        "import torchrec_lossy.codec.container\n"
        "x = pipeline._layout, c.scan_sum, c._scan_kernel[(1,)], torch._C\n"
        "y = torchrec_lossy.codec.container._pack\n"
    )
    found = {(m, n) for _, m, n in private_imports("kernels/probe.py", source)}
    assert found == {
        ("torchrec_lossy.codec.pipeline", "_Reader"),
        ("torchrec_lossy.kernels._common", "*"),
        ("torchrec_lossy.kernels", "_aot"),
        ("torch._dynamo", "*"),
        ("torchrec_lossy.codec.pipeline", "_layout"),
        ("torchrec_lossy.kernels.common", "_scan_kernel"),
        ("torchrec_lossy.codec.container", "_pack"),
    }


# ---------------------------------------------------------------------------------------------
# Import cycles.


def _module_level_imports(rel: str, body: list[ast.stmt], ours: set[str]) -> set[str]:
    """Modules of ours a file imports at module level (``if``/``try`` blocks included, such as
    ``if TYPE_CHECKING:``; imports inside functions are deferred and not counted).

    ``from a.b import c`` names ``a.b.c`` where that is a module of ours, else ``a.b``; the
    parent packages an import initializes are not counted (every submodule would otherwise form
    a cycle with an ``__init__`` that re-exports it).
    """
    found: set[str] = set()
    for node in body:
        if isinstance(node, ast.ImportFrom):
            module = _resolve(rel, node)
            for a in node.names:
                found.add(f"{module}.{a.name}" if f"{module}.{a.name}" in ours else module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.If | ast.Try):
            nested = [*node.body, *node.orelse]
            if isinstance(node, ast.Try):
                nested += [*node.finalbody, *(s for h in node.handlers for s in h.body)]
            found |= _module_level_imports(rel, nested, ours)
    return found & ours


def import_graph(sources: dict[str, tuple[str, str]]) -> dict[str, set[str]]:
    """The graph of module-level imports among this project's modules.

    Args:
        sources: Module name -> (file path relative to the repository root, its text).

    Returns:
        Module name -> the modules of ``sources`` it imports (itself excluded).
    """
    ours = set(sources)
    return {
        module: _module_level_imports(rel, ast.parse(text, filename=rel).body, ours) - {module}
        for module, (rel, text) in sources.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None if it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_no_import_cycles_among_the_package_modules() -> None:
    sources = {
        module: (str(path.relative_to(ROOT)), path.read_text()) for module, path in _files().items()
    }
    cycle = find_cycle(import_graph(sources))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_check_sees_a_cycle_through_a_type_checking_import() -> None:
    """The cycle check is not vacuous: a cycle closed by an ``if TYPE_CHECKING:`` import and a
    ``from pkg import module`` import is found and named."""
    sources = {
        "torchrec_lossy.a": ("torchrec_lossy/a.py", "from torchrec_lossy import b\n"),
        "torchrec_lossy.b": ("torchrec_lossy/b.py", "from .c import X\n"),
        "torchrec_lossy.c": (
            "torchrec_lossy/c.py",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from torchrec_lossy.a import Y\n",
        ),
        "torchrec_lossy.d": ("torchrec_lossy/d.py", "def f():\n    from torchrec_lossy import d\n"),
    }
    graph = import_graph(sources)
    assert graph["torchrec_lossy.d"] == set()
    assert find_cycle(graph) == [
        "torchrec_lossy.a",
        "torchrec_lossy.b",
        "torchrec_lossy.c",
        "torchrec_lossy.a",
    ]
    del graph["torchrec_lossy.c"], graph["torchrec_lossy.b"]
    graph["torchrec_lossy.a"] = set()
    assert find_cycle(graph) is None


# ---------------------------------------------------------------------------------------------
# Kernels are leaves.

# What kernels/ may import from the codec: the rules every backend shares to write the same
# bytes and the host-side records the launchers take, none of them a backend. The codec owns its
# logic (code lengths and canonical codes, quantization parameters, launch tables, the column
# records); kernels/ holds the Triton launchers and their torch twins, which import these.
KERNEL_LEAVES = {
    f"{PACKAGE}.codec.{m}"
    for m in (
        "format",  # constants, record dtypes, the per-value grid's symbols
        "codebook",  # huffman_code_lengths, canonical_codes
        "quant_params",  # QuantParams
        "launch_tables",  # block sizes, tile tables, row-hash multipliers, NO_FAILURE
        "decode_columns",  # DecodeColumns
        "encode_columns",  # EncodeColumns
        "packed_columns",  # the packed encode launches' record fields
        "size_model",  # the segment sizes and the mode choice, written once for every backend
    )
}


def kernel_codec_imports(rel: str, source: str) -> set[tuple[str, str, str]]:
    """``(file, module, name)`` of every import of a file from ``torchrec_lossy.codec``.

    Args:
        rel: The file's path relative to the repository root.
        source: Its text.

    Returns:
        The imports (``name`` is ``"*"`` for ``import module``); ``from torchrec_lossy.codec
        import x`` is named by the module ``torchrec_lossy.codec.x``, ``from torchrec_lossy
        import codec`` by ``torchrec_lossy.codec`` itself.
    """
    codec = f"{PACKAGE}.codec"
    found: set[tuple[str, str, str]] = set()
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.ImportFrom):
            module = _resolve(rel, node)
            if module == PACKAGE:
                found |= {(rel, codec, "*") for a in node.names if a.name == "codec"}
            elif module == codec:
                found |= {(rel, f"{codec}.{a.name}", "*") for a in node.names}
            elif module.startswith(codec + "."):
                found |= {(rel, module, a.name) for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {(rel, a.name, "*") for a in node.names if a.name.startswith(codec)}
    return found


def test_kernels_take_only_the_shared_leaves_from_the_codec() -> None:
    found: set[tuple[str, str, str]] = set()
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        found |= kernel_codec_imports(str(path.relative_to(ROOT)), path.read_text())
    assert found, "the scan found no codec import at all: is it still looking at kernels/?"
    extra = sorted(f for f in found if f[1] not in KERNEL_LEAVES)
    assert not extra, (
        "kernels/ imports codec logic beyond the shared leaves (kernels are launchers: move "
        f"what they share with the codec into a leaf, or name a new leaf here): {extra}"
    )


def test_the_codec_leaves_kernels_take_import_no_other_codec_module() -> None:
    """The leaves stay leaves: besides each other they import only ``codec.format``'s own
    helpers, never a backend (numba orchestration, triton) or a kernel."""
    allowed = KERNEL_LEAVES | {f"{PACKAGE}.codec.elementwise"}  # format's own helpers
    for leaf in sorted(KERNEL_LEAVES):
        rel = leaf.removeprefix(f"{PACKAGE}.").replace(".", "/") + ".py"
        path = ROOT / PACKAGE / rel
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = {
            _resolve(f"{PACKAGE}/{rel}", n) if isinstance(n, ast.ImportFrom) else a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in n.names
        }
        ours = {m for m in imported if m.startswith(PACKAGE)}
        assert ours <= allowed, (leaf, sorted(ours - allowed))
        assert "triton" not in imported and not any(m.startswith("triton.") for m in imported), leaf


@pytest.mark.parametrize(
    ("line", "want"),
    [
        ("from torchrec_lossy.codec import format as f, huffman", {"format:*", "huffman:*"}),
        ("from torchrec_lossy.codec.quantize import QuantParams", {"quantize:QuantParams"}),
        ("from ..codec.vector_lz import element_keys", {"vector_lz:element_keys"}),
        ("import torchrec_lossy.codec.vector_lz", {"vector_lz:*"}),
        ("from torchrec_lossy.codec.elementwise import where", {"elementwise:where"}),
        ("from torchrec_lossy import codec, config", {"torchrec_lossy.codec:*"}),
        ("from .. import codec", {"torchrec_lossy.codec:*"}),
        ("from torchrec_lossy.kernels import common", set()),
    ],
)
def test_kernel_codec_import_scan_sees_every_form(line: str, want: set[str]) -> None:
    """The scan is not vacuous: each import form of a codec module is found (as module:name)."""
    found = kernel_codec_imports("kernels/probe.py", line + "\n")
    codec = f"{PACKAGE}.codec."
    assert {f"{m.removeprefix(codec)}:{n}" for _, m, n in found} == want


# ---------------------------------------------------------------------------------------------
# The lossless input dist and the lossy codec.

# The lossless KJT input dist takes only format-level helpers from the codec: the checksum and
# the host-to-device upload (the codec package's __init__ is lazy: they load without the lossy
# codec; see test_codec_leaf_modules_do_not_load_the_lossy_codec).
LOSSLESS_INPUT_DIST = (
    "input_dist.py",
    "kjt_codec.py",
    "kjt_host.py",
    "kjt_layout.py",
    "kjt_torch.py",
)
FORMAT_HELPERS = {
    ("torchrec_lossy.codec.format", "checksum_words"),
    ("torchrec_lossy.codec.container", "segment_checksums"),
    ("torchrec_lossy.codec.container", "upload"),
}


def test_lossless_input_dist_takes_only_format_helpers_from_the_codec() -> None:
    found: set[tuple[str, str, str]] = set()
    for name in LOSSLESS_INPUT_DIST:
        rel = f"{PACKAGE}/distributed/{name}"
        for node in ast.walk(ast.parse((ROOT / rel).read_text(), filename=rel)):
            if isinstance(node, ast.ImportFrom):
                module = _resolve(rel, node)
                found |= {(rel, module, a.name) for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {(rel, a.name, "*") for a in node.names}
    codec = {f for f in found if f[1] == f"{PACKAGE}.codec" or f[1].startswith(f"{PACKAGE}.codec.")}
    assert codec, "the scan found no codec import at all: is it still looking at the right files?"
    extra = sorted(f for f in codec if f[1:] not in FORMAT_HELPERS)
    assert not extra, f"the lossless input dist imports more than format helpers: {extra}"


# The lossy codec's modules: a leaf of the codec (``format``, ``container``) must not load them.
LOSSY_CODEC = tuple(
    f"{PACKAGE}.codec.{m}"
    for m in (
        "pipeline",
        "grouped",
        "quantize",
        "huffman",
        "vector_lz",
        "host_compress",
        "host_decompress",
        "device_compress",
        "device_decompress",
    )
)

_LOADED = (  # argv: modules to import, or ``module:name`` to also read a name of one
    "import importlib, sys\n"
    "for arg in sys.argv[1:]:\n"
    "    name, _, attr = arg.partition(':')\n"
    "    module = importlib.import_module(name)\n"
    "    attr and getattr(module, attr)\n"
    "print(','.join(sorted(m for m in sys.modules if m.startswith('torchrec_lossy.'))))\n"
)


def _loaded_after(*modules: str) -> set[str]:
    """This project's modules loaded after importing ``modules`` (``module`` or
    ``module:name``) in a fresh interpreter."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    res = subprocess.run(
        [sys.executable, "-c", _LOADED, *modules],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return set(res.stdout.strip().splitlines()[-1].split(","))


def test_codec_leaf_modules_do_not_load_the_lossy_codec() -> None:
    """``codec/__init__`` is lazy: the format and container modules load alone."""
    loaded = _loaded_after(f"{PACKAGE}.codec.format", f"{PACKAGE}.codec.container")
    assert f"{PACKAGE}.codec.container" in loaded, loaded  # the probe sees what it imported
    assert not loaded & set(LOSSY_CODEC), sorted(loaded & set(LOSSY_CODEC))
    # A public name still loads its module on first use.
    assert f"{PACKAGE}.codec.pipeline" in _loaded_after(f"{PACKAGE}.codec:compress")


def test_lossless_kjt_codec_does_not_load_the_lossy_codec() -> None:
    pytest.importorskip("torchrec")
    loaded = _loaded_after(f"{PACKAGE}.distributed.kjt_codec")
    assert f"{PACKAGE}.distributed.kjt_codec" in loaded, loaded
    assert not loaded & set(LOSSY_CODEC), sorted(loaded & set(LOSSY_CODEC))
