"""Compiles every codec kernel for a CUDA target without a GPU (Triton's bundled ptxas).

The interpreter tests check what the kernels compute; this checks that the compiled path accepts
them (types, control flow, lowering of histogram / scans / 64-bit ops) and that the quantize
kernel's PTX has no fused multiply-add. Run it with ``TRITON_INTERPRET`` unset::

    python -m torchrec_lossy.kernels._aot            # sm_90 (H100)
    python -m torchrec_lossy.kernels._aot --arch 80
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any


def _specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """(kernel, runtime argument types, constexprs, compile options) for every variant used."""
    from torchrec_lossy.kernels import codebook, common, huffman, quantize, vector_lz

    specs: list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]] = []
    for op in (common.SCAN_SUM, common.SCAN_MAX):
        for t in ("i32", "i64"):
            specs += [
                (
                    common.scan_reduce_kernel,
                    {"x_ptr": f"*{t}", "part_ptr": f"*{t}", "n": "i32", "identity": t},
                    {"OP": op, "BLOCK": 4096},
                    {},
                ),
                (
                    common.scan_partials_kernel,
                    {"part_ptr": f"*{t}", "n_parts": "i32"},
                    {"OP": op, "BLOCK": 1024},
                    {"num_warps": 4},
                ),
                (
                    common.scan_apply_kernel,
                    {
                        "x_ptr": f"*{t}",
                        "part_ptr": f"*{t}",
                        "out_ptr": f"*{t}",
                        "n": "i32",
                        "identity": t,
                    },
                    {"OP": op, "BLOCK": 4096},
                    {},
                ),
            ]
    q_sig = {
        "x_ptr": "*fp32",
        "sym_ptr": "*i16",
        "hist_ptr": "*i32",
        "err_ptr": "*fp64",
        "tile_ptr": "*i64",
        "step_ptr": "*fp32",
        "inv_step_ptr": "*fp32",
        "center_ptr": "*i64",
        "bound_ptr": "*fp64",
        "dtype_ptr": "*i32",
        "sr_key_ptr": "*i64",
        "elem_off_ptr": "*i64",
        "value_ptr": "*i64",
    }
    no_fma = {"num_warps": 8, "enable_fp_fusion": False}
    specs.append((quantize.JIT_KERNELS["quantize_kernel"], q_sig, {"BLOCK": 4096}, no_fma))
    specs.append(
        (
            quantize.JIT_KERNELS["dequantize_kernel"],
            {"sym_ptr": "*i16", "out_ptr": "*fp32", "n": "i32", "step": "fp32", "base": "i32"},
            {"BLOCK": 4096},
            no_fma,
        )
    )
    rows_2d = {"sym_ptr": "*i16", "bits_ptr": "*i32"}
    for raw in (True, False):
        tile = {"RAW": raw, "BLOCK_R": 64, "BLOCK_D": 32}
        specs += [
            (
                vector_lz.JIT_KERNELS["row_hash_kernel"],
                {
                    **rows_2d,
                    "mults_ptr": "*i64",
                    "hash_ptr": "*i64",
                    "row_off_ptr": "*i64",
                    "row_dim_ptr": "*i32",
                    "row_blk_ptr": "*i32",
                    "rows": "i32",
                    "max_dim": "i32",
                },
                tile,
                {},
            ),
            (
                vector_lz.JIT_KERNELS["verify_kernel"],
                {
                    **rows_2d,
                    "order_ptr": "*i64",
                    "run_ptr": "*i32",
                    "rep_ptr": "*i32",
                    "first_ptr": "*i32",
                    "row_off_ptr": "*i64",
                    "row_dim_ptr": "*i32",
                    "rows": "i32",
                    "max_dim": "i32",
                },
                tile,
                {},
            ),
        ]
    specs += [
        (
            vector_lz.JIT_KERNELS["run_flag_kernel"],
            {"hash_ptr": "*i64", "out_ptr": "*i32", "rows": "i32"},
            {"BLOCK": 1024},
            {},
        ),
        (
            vector_lz.JIT_KERNELS["assign_kernel"],
            {
                "rep_ptr": "*i32",
                "first_ptr": "*i32",
                "rank_ptr": "*i32",
                "ids_ptr": "*i32",
                "first_rows_ptr": "*i32",
                "rows": "i32",
            },
            {"BLOCK": 1024},
            {},
        ),
        (
            vector_lz.JIT_KERNELS["flagged_len_kernel"],
            {
                "ids_ptr": "*i32",
                "max_ptr": "*i32",
                "len_ptr": "*i64",
                "val_ptr": "*i32",
                "rows": "i32",
                "width": "i32",
            },
            {"BLOCK": 1024},
            {},
        ),
    ]
    for flagged, per_word in ((True, 34), (False, 7)):
        specs.append(
            (
                vector_lz.JIT_KERNELS["pack_refs_kernel"],
                {
                    "val_ptr": "*i32",
                    "ends_ptr": "*i64",
                    "out_ptr": "*i32",
                    "rows": "i32",
                    "n_words": "i32",
                    "width": "i32",
                    "n_iter": "i32",
                },
                {"FLAGGED": flagged, "ROWS_PER_WORD": per_word, "BLOCK_W": 256},
                {},
            )
        )
    chunks = {"stream_ptr": "*i32", "lo_ptr": "*i64", "hi_ptr": "*i64", "tab_ptr": "*i64"}
    specs += [
        (
            huffman.JIT_KERNELS["histogram_tiles_kernel"],
            {"sym_ptr": "*i16", "keep_ptr": "*i32", "tile_ptr": "*i64", "hist_ptr": "*i32"},
            {"BLOCK": 4096},
            {"num_warps": 8},
        ),
        (
            huffman.JIT_KERNELS["chunk_words_kernel"],
            {**chunks, "len_ptr": "*i32", "words_ptr": "*i64"},
            {"BLOCK": 1024},
            {},
        ),
        (
            huffman.JIT_KERNELS["place_codes_kernel"],
            {
                **chunks,
                "len_ptr": "*i32",
                "code_ptr": "*i64",
                "ends_ptr": "*i64",
                "merged_ptr": "*i64",
            },
            {"BLOCK": 1024},
            {},
        ),
        (
            codebook.JIT_KERNELS["code_lengths_kernel"],
            {
                "m_ptr": "*i64",
                "weight_ptr": "*i64",
                "parent_ptr": "*i64",
                "depth_ptr": "*i64",
                "blc_ptr": "*i32",
                "out_ptr": "*i32",
            },
            {"BLOCK": 1024},
            {"num_warps": 1},
        ),
        (
            huffman.JIT_KERNELS["join_words_kernel"],
            {"merged_ptr": "*i64", "out_ptr": "*i32", "n_words": "i32"},
            {"BLOCK": 1024},
            {},
        ),
        (
            huffman.JIT_KERNELS["decode_kernel"],
            {
                "words_ptr": "*i32",
                "ends_ptr": "*i64",
                "table_ptr": "*i32",
                "out_ptr": "*i16",
                "esc_ptr": "*i32",
                "status_ptr": "*i32",
                "fail_ptr": "*i64",
                "n": "i32",
                "n_words": "i32",
                "chunk_symbols": "i32",
                "peek_shift": "i32",
            },
            {},
            {"num_warps": 1},
        ),
        (
            huffman.JIT_KERNELS["escape_check_kernel"],
            {
                "esc_ptr": "*i32",
                "rank_ptr": "*i32",
                "expected_ptr": "*i64",
                "bad_ptr": "*i64",
                "n": "i32",
                "n_escapes": "i32",
            },
            {"BLOCK": 4096},
            {},
        ),
    ]
    return specs + _decode_specs()


def _decode_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """The batched decode kernels of ``device_decompress`` (one variant each)."""
    from torchrec_lossy.kernels import codebook, huffman, quantize, vector_lz

    i64 = "*i64"
    per_block = dict.fromkeys
    return [
        (
            codebook.JIT_KERNELS["decode_table_kernel"],
            {
                "words_ptr": "*i32",
                **per_block(("blocks_ptr", "cb_off_ptr", "lo_ptr", "count_ptr"), i64),
                "esc_len_ptr": i64,
                "sorted_ptr": "*i32",
                "table_ptr": "*i32",
                "bad_ptr": i64,
            },
            {},
            {"num_warps": 8},
        ),
        (
            huffman.JIT_KERNELS["decode_blocks_kernel"],
            {
                "words_ptr": "*i32",
                **per_block(("chunk_base_ptr", "sym_base_ptr", "ct_off_ptr", "bs_off_ptr"), i64),
                **per_block(("bs_words_ptr", "cs_ptr", "table_idx_ptr"), i64),
                "tables_ptr": "*i32",
                "out_ptr": "*i16",
                "esc_ptr": "*i32",
                "table_bad_ptr": i64,
                "fail_ptr": i64,
                "n_blocks": "i32",
                "n_iter": "i32",
            },
            {},
            {"num_warps": 1},
        ),
        (
            huffman.JIT_KERNELS["escape_check_blocks_kernel"],
            {
                "esc_ptr": "*i32",
                "rank_ptr": "*i32",
                "sym_base_ptr": i64,
                "words_ptr": "*i32",
                **per_block(("esc_off_ptr", "n_esc_ptr", "esc_bad_ptr"), i64),
                "total": "i32",
                "n_blocks": "i32",
                "n_iter": "i32",
            },
            {"BLOCK": 4096},
            {},
        ),
        (
            huffman.JIT_KERNELS["block_status_kernel"],
            {
                "sym_base_ptr": i64,
                "rank_ptr": "*i32",
                **per_block(("n_esc_ptr", "has_stream_ptr", "refs_bad_ptr"), i64),
                **per_block(("codebook_bad_ptr", "table_bad_ptr", "fail_ptr", "esc_bad_ptr"), i64),
                "code_ptr": "*i32",
                "n_blocks": "i32",
            },
            {"BLOCK": 1024},
            {},
        ),
        (
            vector_lz.JIT_KERNELS["unpack_refs_blocks_kernel"],
            {
                "words_ptr": "*i32",
                **per_block(("fixed_base_ptr", "fixed_blocks_ptr", "flagged_blocks_ptr"), i64),
                **per_block(("ref_off_ptr", "ref_words_ptr", "rows_ptr", "n_unique_ptr"), i64),
                **per_block(("width_ptr", "id_base_ptr"), i64),
                "ids_ptr": "*i32",
                "bad_ptr": i64,
                "n_fixed": "i32",
                "n_iter": "i32",
                "n_fixed_programs": "i32",
            },
            {"BLOCK": 1024},
            {},
        ),
        (
            quantize.JIT_KERNELS["decode_output_kernel"],
            {
                "words_ptr": "*i32",
                "halves_ptr": "*i16",
                **per_block(("out_base_ptr", "mode_ptr", "dtype_ptr", "dim_ptr"), i64),
                **per_block(("n_unique_ptr", "src_off_ptr", "id_base_ptr", "sym_base_ptr"), i64),
                **per_block(("step_ptr", "center_ptr", "esc_val_off_ptr", "n_esc_ptr"), i64),
                "out_off_ptr": i64,
                "ids_ptr": "*i32",
                "sym_ptr": "*i16",
                "rank_ptr": "*i32",
                "out32_ptr": "*i32",
                "out16_ptr": "*i16",
                "n_blocks": "i32",
                "n_iter": "i32",
            },
            {"BLOCK": 1024},
            {"num_warps": 4, "enable_fp_fusion": False},
        ),
    ]


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
    for fn, sig, consts, opts in _specs():
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
    """Command line: compile everything, print failures.

    Args:
        argv: Arguments (None: ``sys.argv``).

    Returns:
        0 when everything compiled, 1 otherwise, 2 under the interpreter.
    """
    p = argparse.ArgumentParser(description="compile the codec's Triton kernels without a GPU")
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    failures = compile_all(args.arch)
    for f in failures:
        print(f"FAILED {f}")
    print(f"{len(_specs()) - len(failures)} of {len(_specs())} kernel variants compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
