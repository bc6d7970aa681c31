"""Compile every kernel variant for a CUDA target on a machine with no GPU (Triton ships ptxas).

Catches type and lowering errors that the CPU interpreter accepts, without spending device time:
    python scripts/compile_check.py [--arch 90]
"""

import argparse
import itertools
import os

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashpatch.kernels.backward import (  # noqa: E402
    attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel)
from flashpatch.kernels.forward import attn_fwd_kernel  # noqa: E402


def signature(fn, dtype, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.isupper():  # tensor arguments are upper-case by convention in these kernels
            if name in ("LSE", "DELTA", "DQ_ACCUM"):
                sig[name] = "*fp32"
            elif name == "SEED_OFFSET":
                sig[name] = "*i64"
            elif name.startswith("CU_"):
                sig[name] = "*i32"
            else:
                sig[name] = f"*{dtype}"
        elif name in ("qk_scale", "cap_log2", "softmax_scale", "dropout_p"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(fn, dtype, constexprs, arch, num_warps=4, num_stages=2):
    src = ASTSource(fn=fn, signature=signature(fn, dtype, constexprs), constexprs=constexprs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    n = 0
    for dtype, varlen, left, right, softcap, dropout in itertools.product(
        ["fp16", "bf16"], [False, True], [False, True], [False, True], [False, True], [False, True]
    ):
        flags = dict(IS_VARLEN=varlen, HAS_LEFT=left, HAS_RIGHT=right, SOFTCAP=softcap, DROPOUT=dropout,
                     DOT_PRECISION="tf32", HEADDIM=128, BLOCK_D=128)
        compile_one(attn_fwd_kernel, dtype, {**flags, "BLOCK_M": 128, "BLOCK_N": 64}, args.arch, 8, 3)
        compile_one(attn_bwd_dq_kernel, dtype, {**flags, "BLOCK_M": 128, "BLOCK_N": 32}, args.arch, 8, 2)
        for atomic in (False, True):
            compile_one(attn_bwd_dkdv_kernel, dtype, {**flags, "BLOCK_M": 32, "BLOCK_N": 128, "ATOMIC_DQ": atomic},
                        args.arch, 8, 2)
            n += 1
        n += 2
    compile_one(attn_bwd_preprocess_kernel, "bf16",
                {"HEADDIM": 80, "BLOCK_D": 128, "BLOCK_M": 128, "IS_VARLEN": True}, args.arch)
    fp32 = dict(IS_VARLEN=False, HAS_LEFT=True, HAS_RIGHT=True, SOFTCAP=True, DROPOUT=True, DOT_PRECISION="ieee",
                HEADDIM=40, BLOCK_D=64)
    compile_one(attn_fwd_kernel, "fp32", {**fp32, "BLOCK_M": 64, "BLOCK_N": 32}, args.arch)
    print(f"compiled {n + 2} kernel variants for sm_{args.arch}")


if __name__ == "__main__":
    main()
