"""Compiles every codec kernel for a CUDA target without a GPU (Triton's bundled ptxas).

The interpreter tests check what the kernels compute; this checks that the compiled path accepts
them and that the quantize kernel's PTX has no fused multiply-add. The kernels and their variants
are one table (:data:`TABLE`); :func:`missing_specs` finds a kernel ``kernels/`` launches that it
lacks. Run it with ``TRITON_INTERPRET`` unset (docs/kernels.md, 'Testing')::

    python -m torchrec_lossy.kernels._aot [--arch 80] [--check] [--without KERNEL]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import os
import re
import sys
import traceback
from typing import Any

MODULES = ("common", "quantize", "vector_lz", "huffman", "codebook", "packed")
NO_FMA = {"num_warps": 8, "enable_fp_fusion": False}

# (module, kernel, runtime argument types in argument order, constexpr variants, options).
# A variants entry maps each constexpr to one value or to a tuple of values (every combination
# is compiled); "{t}" in the types is expanded for each scan element type.
TABLE: list[tuple[str, str, str, dict[str, Any], dict[str, Any]]] = [
    ("common", "scan_reduce_kernel", "*{t} *{t} i32 {t}", {"OP": "ops", "BLOCK": 4096}, {}),
    ("common", "scan_partials_kernel", "*{t} i32", {"OP": "ops", "BLOCK": 1024}, {"num_warps": 4}),
    ("common", "scan_apply_kernel", "*{t} *{t} *{t} i32 {t}", {"OP": "ops", "BLOCK": 4096}, {}),
    ("quantize", "quantize_kernel", "*fp32 *i16 *i32 *fp64 *i64 *i64",
     {"BLOCK": 4096, "HIST": (True, False)}, NO_FMA),
    ("quantize", "grid_kernel", "*fp32 *i64 *i64 *i64 *i64 *i64 *i64",
     {"OCTAVES": 16, "STOCHASTIC": (True, False), "QUANTIZATION": (True, False), "BLOCK": 1024},
     {"enable_fp_fusion": False}),
    ("quantize", "decode_output_kernel",
     "*i32 *i16 *i64 *i32 *i16 *i32 *i32 *i16 i32 i32 i32 i32",
     {"BLOCK": 1024, "PACKED": (True, False)}, {"num_warps": 4, "enable_fp_fusion": False}),
    ("vector_lz", "row_hash_kernel", "*i16 *i32 *i64 *i64 *i64 *i64 i32 i32",
     {"RAW_FIRST": (True, False), "BLOCK_R": 64, "BLOCK_D": 32}, {}),
    ("vector_lz", "verify_kernel", "*i16 *i32 *i64 *i64 *i32 *i64 *i64 i32 i32",
     {"RAW_FIRST": (True, False), "BLOCK_R": 64, "BLOCK_D": 32}, {}),
    ("vector_lz", "unpack_refs_blocks_kernel", "*i32 *i64 *i32 i32 i32 i32 i32", {"BLOCK": 1024},
     {}),
    ("huffman", "histogram_tiles_kernel", "*i16 *i32 *i64 *i32", {"BLOCK": 4096},
     {"num_warps": 8}),
    ("huffman", "chunk_words_kernel", "*i32 *i64 *i64 *i64 *i32 *i64", {"BLOCK": 1024}, {}),
    ("huffman", "place_codes_kernel", "*i32 *i64 *i64 *i64 *i32 *i64 *i64 *i64",
     {"BLOCK": 1024}, {}),
    ("huffman", "join_words_kernel", "*i64 *i32 i32", {"BLOCK": 1024}, {}),
    ("huffman", "decode_blocks_kernel", "*i32 *i64 *i32 *i16 *i32 i32 i32 i32", {},
     {"num_warps": 1}),
    ("huffman", "escape_check_blocks_kernel", "*i32 *i32 *i32 *i64 i32 i32 i32 i32",
     {"BLOCK": 4096}, {}),
    ("huffman", "block_status_kernel", "*i64 *i32 *i32 i32 i32", {"BLOCK": 1024}, {}),
    ("codebook", "code_lengths_kernel", "*i64 *i64 *i64 *i64 *i32 *i32", {"BLOCK": 1024},
     {"num_warps": 1}),
    ("codebook", "decode_table_kernel", "*i32 *i64 i32 *i32 *i32", {}, {"num_warps": 8}),
    ("packed", "checksum_kernel", "*i32 *i64 *i64", {"TILE": 1024}, {}),
    ("packed", "widths_kernel", "*i32 *i64 *i16 i32 i32 i32 i32", {"GB": 32, "GROUP": 32}, {}),
    ("packed", "check_groups_kernel", "*i32 *i64 *i16 *i32 i32 i32 i32 i32 i32",
     {"GB": 32, "GROUP": 32}, {}),
    ("packed", "status_kernel", "*i64 *i64 *i32 i32 i32", {"BLOCK": 1024}, {}),
    ("packed", "plan_kernel",
     "*i16 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 "
     "i32 i32",
     {"GB": 32, "GROUP": 32}, {}),
    ("packed", "put_data_kernel",
     "*i16 *i32 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i64 *i32 *i64 "
     "i32 i32 i32 i32",
     {"GB": 32, "GROUP": 32, "TILE": 1024}, {}),
]  # fmt: skip

Spec = tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]


def _variants(consts: dict[str, Any], scan_ops: tuple[int, ...]) -> list[dict[str, Any]]:
    """Every combination of a table entry's constexpr values ("ops": the scan operators)."""
    choices = {
        k: scan_ops if v == "ops" else (v if isinstance(v, tuple) else (v,))
        for k, v in consts.items()
    }
    return [
        dict(zip(choices, combo, strict=True)) for combo in itertools.product(*choices.values())
    ]


def _kernel(mod: Any, name: str) -> Any:
    """A kernel by its public name: a key of the module's ``JIT_KERNELS``, or an attribute."""
    return getattr(mod, "JIT_KERNELS", {}).get(name) or getattr(mod, name)


def specs() -> list[Spec]:
    """(kernel, runtime argument types by name, constexprs, compile options) for every variant.

    Returns:
        One spec per compiled variant, in table order.

    Raises:
        ValueError: A table entry's type list does not match its kernel's runtime arguments.
    """
    mods = {m: importlib.import_module(f"torchrec_lossy.kernels.{m}") for m in MODULES}
    scan_ops = (mods["common"].SCAN_SUM, mods["common"].SCAN_MAX)
    out: list[Spec] = []
    for module, name, types, consts, opts in TABLE:
        fn = _kernel(mods[module], name)
        runtime = [p.name for p in fn.params if not p.is_constexpr]
        for t in ("i32", "i64") if "{t}" in types else ("",):
            sig = types.format(t=t).split()
            if len(sig) != len(runtime):
                raise ValueError(f"{name}: {len(sig)} types for {len(runtime)} args {runtime}")
            for variant in _variants(consts, scan_ops):
                out.append((fn, dict(zip(runtime, sig, strict=True)), variant, opts))
    return out


def missing_specs() -> list[str]:
    """The kernels ``kernels/`` launches (``name[grid](...)``) that :data:`TABLE` has no row for.

    Returns:
        ``module.kernel`` names; empty when every launched kernel is compiled here.
    """
    mods = {m: importlib.import_module(f"torchrec_lossy.kernels.{m}") for m in MODULES}
    listed = {id(_kernel(mods[m], k)) for m, k, *_ in TABLE}
    missing = []
    for module, mod in mods.items():
        for name in sorted(set(re.findall(r"\b(\w+)\[", inspect.getsource(mod)))):
            fn = vars(mod).get(name)
            if type(fn).__name__ == "JITFunction" and id(fn) not in listed:
                missing.append(f"{module}.{name}")
    return missing


def compile_all(arch: int = 90) -> list[str]:
    """Compiles every kernel variant to a cubin for ``sm_<arch>``.

    Args:
        arch: CUDA compute capability as an integer (90 = H100).

    Returns:
        One line per failure (empty when everything compiled and the quantize PTX is FMA-free).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failures = []
    for fn, sig, consts, opts in specs():
        full = {**sig, **dict.fromkeys(consts, "constexpr")}
        full = {name: full[name] for name in fn.arg_names}
        try:
            kernel = triton.compile(ASTSource(fn, full, constexprs=consts), target, opts)
        except Exception:
            failures.append(f"{fn.__name__} {consts}: {traceback.format_exc(limit=2)}")
            continue
        if opts.get("enable_fp_fusion") is False and "fma" in kernel.asm["ptx"]:
            failures.append(f"{fn.__name__} {consts}: fused multiply-add in the PTX")
    return failures


def main(argv: list[str] | None = None) -> int:
    """Command line: compile everything (or only check the table's coverage), print failures.

    Args:
        argv: Arguments (None: ``sys.argv``).

    Returns:
        0 when everything compiled (or is covered), 1 otherwise, 2 under the interpreter.
    """
    p = argparse.ArgumentParser(description="compile the codec's Triton kernels without a GPU")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--check", action="store_true", help="only check every kernel has a spec")
    p.add_argument(
        "--without", action="append", default=[], help="drop a kernel's row (see --check fail)"
    )
    args = p.parse_args(argv)
    TABLE[:] = [row for row in TABLE if row[1] not in args.without]
    missing = missing_specs()
    for name in missing:
        print(f"MISSING a spec for the launched kernel {name}")
    if args.check:
        print(f"{len(specs())} kernel variants in the table, {len(missing)} kernels missing")
        return 1 if missing else 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    failures = compile_all(args.arch)
    for f in failures:
        print(f"FAILED {f}")
    n = len(specs())
    print(f"{n - len(failures)} of {n} kernel variants compiled")
    return 1 if failures or missing else 0


if __name__ == "__main__":
    sys.exit(main())
