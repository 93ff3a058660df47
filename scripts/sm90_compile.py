"""Compile turbo's decode, attention and FP8 activation kernels for an H100/H200 (sm_90)
without a GPU: a check to run before a device call, with the device's Triton version
where it differs from ours.

    pip install --target /tmp/t36 --no-deps triton==3.6.0     # the GPU machine's, once
    PYTHONPATH=/tmp/t36 python3 scripts/sm90_compile.py [--ptx DIR]

Each case is a kernel with its constexprs and the types of the arguments that are not
bf16 pointers or int32 (the default for names ending in _ptr / _ptrs, and for the
rest); every argument is taken as 16-byte aligned or a multiple of 16, as launches on
real tensors are specialized. Prints one line per case (OK with the registers a thread
ptxas gives it, or the error's first line) and exits 1 if one fails. --ptx DIR writes
each case's PTX there.

A kernel that compiles under the interpreter can still fail Triton's GPU passes (3.6
could not lay out a while loop that carried tensors, kernels/tagged.py), and a failed
compile costs a device call.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def kernels_of(module: str) -> Any:
    """A kernels module (the package's names are its functions, not its modules)."""
    return importlib.import_module(f"lmd.engine.turbo.kernels.{module}")


FLOATS = ("eps", "scale", "scale_log2", "head_eps")  # float32 scalars
NOT_ALIGNED = ("eps", "scale", "scale_log2", "num_rows", "point", "layer", "window", "num_pairs",
               "head_eps")  # fmt: skip


def case(
    kernel: Any, constexprs: dict[str, Any], types: dict[str, str], options: dict[str, Any]
) -> tuple[str, ASTSource, dict[str, Any]]:
    """(a label, the source to compile, its options) for one kernel's specialization."""
    signature, attrs = {}, {}
    for i, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in types:
            signature[name] = types[name]
        elif name.endswith(("_ptr", "_ptrs")):
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
        if name not in NOT_ALIGNED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    label = f"{kernel.fn.__name__} {constexprs}"
    return label, ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), options


def moe_cases() -> list[tuple[str, ASTSource, dict[str, Any]]]:
    """The experts' kernels past vector_gemv's (kernels/moe.py, kernels/moe_vector.py)."""
    moe, moe_vector, moe_align = (
        kernels_of("moe"),
        kernels_of("moe_vector"),
        kernels_of("moe_align"),
    )
    routing = kernels_of("routing")
    out = []
    flags: dict[str, Any]
    run = {"num_warps": 4, "num_stages": 3}
    ids = {"experts_ptr": "*i32"}
    codes = {"w_ptr": "*fp8e4nv", "ws_ptr": "*fp32"}  # FP8 experts (quant/fp8_experts.py)
    for block_n, block_k, scales in ((2, 256, 0), (4, 512, 0), (2, 128, 128), (2, 128, 1)):
        flags = {"SCALES": scales, "TOP_K": 8, "BLOCK_J": 8, "BLOCK_N": block_n,
                 "BLOCK_K": block_k}  # fmt: skip
        types = ids | {"weights_ptr": "*fp32"} | (codes if scales else {})
        out.append(case(moe_vector._mix_down_kernel, flags, types, run))
    for top_k, block_e in ((8, 128), (2, 8)):
        flags = {"TOP_K": top_k, "NORMALIZE": True, "BLOCK_E": block_e}
        types = {"logits_ptr": "*fp32", "weights_ptr": "*fp32", "experts_ptr": "*i32"}
        out.append(case(routing._top_k_kernel, flags, types, run | {"num_warps": 4}))
    ints = {"scale_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32"}
    # SCALES: 0 (16-bit), 1 (a scale a row), 128 (blocks); a_fp8: the inputs as codes;
    # w4: 4-bit experts' group (quant/w4a16_experts.py), their nibbles made in PTX, in
    # the decode form up to moe.W4_SCALE_AFTER_ROWS rows a block
    for block_m, block_n, block_k, warps, gated, scales, a_fp8, w4 in (
        (16, 64, 128, 4, False, 0, False, 0), (16, 64, 128, 4, True, 0, False, 0),
        (128, 256, 64, 8, True, 0, False, 0), (16, 64, 128, 4, True, 1, False, 0),
        (16, 64, 128, 4, True, 128, True, 0), (128, 64, 64, 8, True, 1, True, 0),
        (128, 128, 128, 8, False, 128, True, 0), (16, 64, 128, 4, True, 0, False, 128),
        (16, 64, 128, 4, False, 0, False, 64), (32, 64, 128, 4, True, 0, False, 128),
        (64, 128, 128, 4, False, 0, False, 64), (128, 128, 128, 8, True, 0, False, 128),
    ):  # fmt: skip
        flags = {"A_ROW_DIV": 8, "HAS_SCALE": not gated, "SCALES": scales, "A_FP8": a_fp8,
                 "GATED": gated, "W4_GROUP": w4, "PACKED": bool(w4),
                 "W4_SCALE_AFTER": bool(w4) and block_m <= moe.W4_SCALE_AFTER_ROWS,
                 "PRECISION": "tf32", "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "BLOCK_K": block_k}  # fmt: skip
        types = ints | (codes | {"as_ptr": "*fp32"} if scales else {})
        if a_fp8:
            types |= {"a_ptr": "*fp8e4nv"}
        if w4:
            types |= {"w_ptr": "*i32", "zs_ptr": "*u8"}
        out.append(case(moe._grouped_gemm_kernel, flags, types, run | {"num_warps": warps}))
    layout = {"experts_ptr": "*i32", "counts_ptr": "*i32", "ranks_ptr": "*i32",
              "ends_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32"}  # fmt: skip
    for block_m in (16, 128):
        flags = {"BLOCK_M": block_m, "BLOCK_E": 128, "BLOCK": moe_align.ALIGN_PAIRS}
        out.append(case(moe_align._count_kernel, flags, layout, run))
        flags |= {"BLOCK_B": moe_align.PLACE_SLOTS // block_m}
        out.append(case(moe_align._place_kernel, flags, layout, run))
    return out


def fp8_cases() -> list[tuple[str, ASTSource, dict[str, Any]]]:
    """The kernels that make FP8 activation codes."""
    activation, norm, quant = kernels_of("activation"), kernels_of("norm"), kernels_of("fp8_quant")
    run = {"num_warps": 4, "num_stages": 3}
    out = []
    codes = {"codes_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    for one_pass, block, warps in ((True, 16384, 16), (False, 2048, 4)):
        flags = {"GELU": False, "ONE_PASS": one_pass, "BLOCK": block}
        options = {"num_warps": warps, "num_stages": 3}
        out.append(case(activation._silu_and_mul_fp8_kernel, flags, codes, options))
    flags = {"GELU": False, "BLOCK": 2048}
    out.append(case(activation._silu_and_mul_groups_kernel, flags, codes, run))
    types = {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    for groups in (False, True):
        flags = {
            "HAS_RESIDUAL": True,
            "FP8": True,
            "GROUPS": groups,
            "ORDERED": False,
            "BLOCK": 4096,
        }
        out.append(case(norm._rms_norm_kernel, flags, types, {"num_warps": 16, "num_stages": 3}))
    types = {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    flags = {"ONE_PASS": True, "BLOCK_K": 4096}
    out.append(case(quant._quant_rows_kernel, flags, types, {"num_warps": 8, "num_stages": 3}))
    return out


def cases() -> list[tuple[str, ASTSource, dict[str, Any]]]:
    activation, decode_attention = kernels_of("activation"), kernels_of("decode_attention")
    gemv, vector_gemv = kernels_of("gemv"), kernels_of("vector_gemv")
    out = []
    flags: dict[str, Any]
    run = {"num_warps": 4, "num_stages": 3}
    ids = {"experts_ptr": "*i32"}
    routes = {"y_ptr": "*fp32", "count_ptr": "*i32", "chosen_w_ptr": "*fp32",
              "chosen_e_ptr": "*i32"}  # fmt: skip
    rotaries = {"count_ptr": "*i32", "positions_ptr": "*i64", "slots_ptr": "*i64",
                "rope_ptr": "*fp32"}  # fmt: skip
    for block_n, block_k, gated, experts, route, pool in (
        (4, 1024, False, False, False, ""), (4, 1024, True, False, False, ""),
        (8, 512, True, False, False, ""), (4, 1024, True, True, False, ""),
        (1, 4096, False, False, True, ""), (8, 512, False, False, False, "*bf16"),
        (4, 1024, False, False, False, "*i8"),
    ):  # fmt: skip
        flags = {"EXPERTS": experts, "SCALES": 0, "HAS_BIAS": False, "NORM": True,
                 "HAS_RESIDUAL": True, "HAS_SUMMED": True, "GATED": gated, "GELU": False,
                 "ROUTE": route,
                 "TOP_K": 8 if route else 1, "NORMALIZE": route, "BLOCK_E": 128 if route else 1,
                 "ROTARY": bool(pool), "NUM_HEADS": 32 if pool else 0,
                 "NUM_KV_HEADS": 4 if pool else 0, "HEAD_DIM": 128 if pool else 0,
                 "HAS_QK_NORM": bool(pool), "BLOCK_N": block_n,
                 "BLOCK_K": block_k}  # fmt: skip
        types = ids | routes if route else ids
        if pool:
            types = types | rotaries | {"kv_ptr": pool}
        out.append(case(vector_gemv._vector_gemv_kernel, flags, types, run))
        if experts and gated:  # FP8 experts' gate|up: blocks, a scale a row
            for scales in (128, 1):
                fp8 = types | {"w_ptr": "*fp8e4nv", "ws_ptr": "*fp32"}
                out.append(
                    case(vector_gemv._vector_gemv_kernel, flags | {"SCALES": scales}, fp8, run)
                )
    sends = {"word_ptrs": "*i64", "step_ptr": "*i64"}
    for peers, rank in ((0, 0), (2, 0), (2, 1)):
        flags = {"HAS_BIAS": False, "PEERS": peers, "RANK": rank, "BLOCK_N": 32, "BLOCK_K": 512}
        out.append(case(gemv._gemv_kernel, flags, sends, run | {"num_stages": 4}))
    flags = {"GELU": False, "BLOCK": 1024}
    out.append(case(activation._silu_and_mul_kernel, flags, {}, run))
    out += fp8_cases()
    out += moe_cases()
    for kv, warps, splits, q, merge, rope in (("*bf16", 4, 8, "*bf16", True, False),
                                              ("*i8", 2, 8, "*bf16", True, False),
                                              ("*bf16", 4, 8, "*bf16", False, False),
                                              ("*bf16", 4, 1, "*bf16", False, False),
                                              ("*fp8e4nv", 2, 1, "*bf16", False, False),
                                              ("*fp8e4nv", 2, 1, "*fp32", False, False),
                                              ("*bf16", 4, 1, "*bf16", False, True),
                                              ("*bf16", 4, 4, "*bf16", True, True),
                                              ("*i8", 2, 1, "*bf16", False, True)):  # fmt: skip
        precision = "ieee" if q == "*fp32" else "tf32"
        flags = {"GROUP": 4, "HEAD_DIM": 128, "NUM_SPLITS": splits, "BLOCK_G": 16,
                 "BLOCK_D": 128, "BLOCK_N": 64, "DOT_PRECISION": precision,
                 "HEADS_FIRST": True, "IN_BLOCK": True, "MERGE_LAST": merge,
                 "MERGE_G": 4, "ROTARY": rope, "KV_HEADS": 8, "HAS_QK_NORM": rope}  # fmt: skip
        types = {"kv_ptr": kv, "tables_ptr": "*i32", "context_lens_ptr": "*i32", "q_ptr": q,
                 "out_ptr": q, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                 "counts_ptr": "*i32", "positions_ptr": "*i64", "slots_ptr": "*i64",
                 "rope_ptr": "*fp32"}  # fmt: skip
        options = {"num_warps": warps, "num_stages": 2}
        out.append(case(decode_attention._decode_kernel, flags, types, options))
    prefill = kernels_of("prefill_attention")
    for kv, q, new_kv in (("*bf16", "*bf16", False), ("*fp8e4nv", "*bf16", True),
                          ("*fp8e4nv", "*bf16", False), ("*i8", "*fp32", True)):  # fmt: skip
        precision = "ieee" if q == "*fp32" else "tf32"
        flags = {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128,
                 "DOT_PRECISION": precision, "NEW_KV": new_kv}  # fmt: skip
        types = {"kv_ptr": kv, "q_ptr": q, "out_ptr": q, "new_k_ptr": q, "tables_ptr": "*i32",
                 "cu_seqlens_ptr": "*i32", "context_lens_ptr": "*i32"}  # fmt: skip
        options = {"num_warps": 4, "num_stages": 2}
        out.append(case(prefill._prefill_kernel, flags, types, options))
    flags = {"GROUP": 8, "HEAD_DIM": 128, "NUM_SPLITS": 16, "BLOCK_G": 8, "BLOCK_D": 128}
    out.append(case(kernels_of("decode_merge").merge_kernel, flags, {"part_out_ptr": "*fp32",
                    "part_lse_ptr": "*fp32"}, run))  # fmt: skip
    w4a16 = kernels_of("w4a16")
    types = {"q_ptr": "*i32", "z_ptr": "*u8"}
    for packed, block_m, group, swap in ((True, 16, 128, False), (False, 16, 128, False),
                                         (True, 64, 128, True), (False, 64, 128, True),
                                         (True, 64, 64, False)):  # fmt: skip
        flags = {"GROUP": group, "HAS_BIAS": False, "PACKED": packed,
                 "SCALE_AFTER_DOT": block_m <= 32,
                 "SWAP_AB": swap, "PRECISION": "tf32", "BLOCK_M": block_m, "BLOCK_N": 128,
                 "BLOCK_K": 128}  # fmt: skip
        out.append(case(w4a16._w4a16_kernel, flags, types, run))
    rotary = kernels_of("rotary")
    for kv, q_programs in (("*bf16", 4), ("*bf16", 1), ("*i8", 4)):
        flags = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 32 // q_programs,
                 "BLOCK_KVH": 8, "BLOCK_HALF": 64, "HAS_QK_NORM": True,
                 "Q_PROGRAMS": q_programs}  # fmt: skip
        types = {"positions_ptr": "*i64", "slots_ptr": "*i64", "rope_ptr": "*fp32", "kv_ptr": kv}
        out.append(case(rotary._rotary_cache_kernel, flags, types, run))
    return out


def registers(ptx: str) -> str:
    """The kernel's registers a thread, as ptxas -v counts them ("?" without ptxas)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        try:
            done = subprocess.run(["ptxas", "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                  capture_output=True, text=True, check=True)  # fmt: skip
        except (OSError, subprocess.CalledProcessError):
            return "?"
    found = re.search(r"Used (\d+) registers", done.stderr)
    return found.group(1) if found else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ptx", type=Path, default=None)
    args = parser.parse_args()
    print(f"triton {triton.__version__}, target sm_90")
    failed = 0
    for n, (label, source, options) in enumerate(cases()):
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        except Exception as exc:  # a compile error of any kind: report it, go on
            failed += 1
            print(f"FAIL {label}: {str(exc).strip().splitlines()[0][:160]}")
            continue
        print(f"OK   {label}: {registers(compiled.asm['ptx'])} registers")
        if args.ptx is not None:
            args.ptx.mkdir(parents=True, exist_ok=True)
            (args.ptx / f"{n:02d}.ptx").write_text(compiled.asm["ptx"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
