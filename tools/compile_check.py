"""Compile every kernel variant for a CUDA target on a machine with no GPU (Triton ships ptxas).

Catches type and lowering errors that the CPU interpreter accepts, and launch configurations that would ask for more
shared memory than an H100/H200 block has, without spending device time. Kernels compile with the alignment the JIT
assumes at a real launch (launch_hints), so loads are pipelined as on the GPU and the shared-memory figures match
the GPU build's (checked for Triton 3.6 and 3.9); the GPU tests still have the last word.
    python tools/compile_check.py [--arch 90]
"""

import argparse
import dataclasses
import itertools
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashpatch

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashpatch.kernels import config as kernel_config  # noqa: E402
from flashpatch.kernels.triton.backward import (  # noqa: E402
    attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel)
from flashpatch.kernels.triton.forward import attn_fwd_kernel  # noqa: E402
from flashpatch.ops import block_d  # noqa: E402


def signature(fn, dtype, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.isupper():  # tensor arguments are upper-case by convention in these kernels
            if name in ("LSE", "DELTA", "DQ_ACCUM", "ALIBI_SLOPES"):
                sig[name] = "*fp32"
            elif name == "SEED_OFFSET":
                sig[name] = "*i64"
            elif name.startswith("CU_") or name == "VARLEN_BLOCKS":
                sig[name] = "*i32"
            else:
                sig[name] = f"*{dtype}"
        elif name in ("qk_scale", "cap_log2", "softmax_scale", "dropout_p"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


SHARED_MEMORY_LIMIT = 232448  # bytes per block on H100 / H200 (227 KB)


def launch_hints(fn, constexprs):
    """What the JIT assumes at a real launch: 16-byte aligned tensors (torch allocations) and strides divisible by
    16 (contiguous rows of head dims that are multiples of 16), except the arguments the kernel asks it not to
    specialize. Without these hints Triton cannot vectorize the tile loads into cp.async copies, does not pipeline
    them, and reports a fraction of the shared memory the GPU build needs (the d128 dropout forward with 128-wide
    key tiles: 65,536 bytes without, 229,376 with, as on the GPU)."""
    skip = {fn.arg_names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ())}
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if name not in constexprs and name not in skip and (name.isupper() or name.startswith("stride_"))}


def feature_constexprs(headdim, varlen=False, left=False, right=False, softcap=False, dropout=False, alibi=False):
    """The feature flags every attention kernel takes (ops._common_flags at a launch), for 16-bit inputs."""
    return dict(IS_VARLEN=varlen, HAS_LEFT=left, HAS_RIGHT=right, SOFTCAP=softcap, ALIBI=alibi, DROPOUT=dropout,
                DOT_PRECISION="tf32", HEADDIM=headdim, BLOCK_D=block_d(headdim))


def launch_constexprs(fn, cfg, even, even_interior=True):
    """The constexprs one LaunchConfig sets for kernel fn, as ops.attn_fwd / attn_bwd pass them."""
    launch = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "TMA": cfg.tma, "BLOCKS_FASTEST": cfg.blocks_fastest,
              "HEAD_GROUP": 4 if cfg.blocks_fastest else 1,  # 4: the grouped grid order
              "EVEN": even, "EVEN_INTERIOR": even_interior}
    if fn is attn_bwd_dkdv_kernel:
        launch["DP_FIRST"] = cfg.dp_first
    if fn is attn_fwd_kernel:
        launch["FOLD"] = kernel_config.KernelConfigs.fold_scale  # the default ops.attn_fwd_impl passes
    return launch


def compile_one(fn, dtype, constexprs, arch, num_warps=4, num_stages=2):
    src = ASTSource(fn=fn, signature=signature(fn, dtype, constexprs), constexprs=constexprs,
                    attrs=launch_hints(fn, constexprs))
    target = GPUTarget("cuda", arch, 32)
    kernel = triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    if kernel.metadata.shared > SHARED_MEMORY_LIMIT:
        flags = {k: v for k, v in constexprs.items() if v not in (False, None)}
        raise SystemExit(f"{fn.__name__} {dtype} {flags} (warps {num_warps}, stages {num_stages}) needs "
                         f"{kernel.metadata.shared} bytes of shared memory, over the {SHARED_MEMORY_LIMIT} limit")
    return kernel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dropout-headdims", default="32,40,64,80,96,128,160,192,224,256",
                        help="head dims of the dropout grid (every head dim flash-attn takes); '' skips it")
    args = parser.parse_args()
    n = 0
    # Dropout at every head dim, causal or not, fp16 and bf16, at a training length of 1024 (short) and beyond, the
    # backward with and without atomic dQ: the grid of tests/test_gpu_headdims.py, where ptxas once crashed.
    headdims = [int(d) for d in args.dropout_headdims.split(",") if d]
    for headdim, dtype, causal, short, varlen in itertools.product(headdims, ["fp16", "bf16"], [False, True],
                                                                   [True, False], [False, True]):
        aligned = not varlen and headdim == block_d(headdim)
        cfgs = kernel_config.configs_for(headdim, True, masked=causal, dropout=True, aligned=aligned, short=short,
                                          varlen=varlen)
        flags = feature_constexprs(headdim, varlen, right=causal, dropout=True)
        atomic = [False, True] if cfgs.atomic_dq else [False]  # deterministic=True keeps the dQ pass
        for fn, cfg, extra in ((attn_fwd_kernel, cfgs.fwd, {}), (attn_bwd_dq_kernel, cfgs.bwd_dq, {}),
                               *((attn_bwd_dkdv_kernel, cfgs.bwd_dkdv, {"ATOMIC_DQ": a}) for a in atomic)):
            if headdim != block_d(headdim):  # ops.tma_usable: descriptors only where the head dim fills its tile
                cfg = dataclasses.replace(cfg, tma=False)
            compile_one(fn, dtype, {**flags, **extra, **launch_constexprs(fn, cfg, even=aligned,
                                                                          even_interior=headdim == block_d(headdim))},
                        args.arch, cfg.num_warps, cfg.num_stages)
            n += 1
    # The launch configurations flashpatch really uses (kernels/config.py), for each feature combination; ALiBi
    # (its own loop: a bias added to the scores, orthogonal to softcap) in bf16 only.
    plain = itertools.product([("fp16", 128), ("bf16", 128), ("bf16", 64)], [False, True], [False, True],
                              [False, True], [False, True], [False, True], [False])
    alibi = itertools.product([("bf16", 128), ("bf16", 64)], [False, True], [False, True], [False, True], [False],
                              [False, True], [True])
    for (dtype, headdim), varlen, left, right, softcap, dropout, with_alibi in itertools.chain(plain, alibi):
        cfgs = kernel_config.configs_for(headdim, True, masked=left or right, dropout=dropout, aligned=not varlen,
                                         varlen=varlen)
        flags = feature_constexprs(headdim, varlen, left, right, softcap, dropout, with_alibi)
        # the forward tile for at most SHORT queries, where it differs
        short_fwd = kernel_config.configs_for(headdim, True, masked=left or right, dropout=dropout,
                                              aligned=not varlen, short=True).fwd
        for fn, cfg, extra in (
            (attn_fwd_kernel, cfgs.fwd, {}),
            *([(attn_fwd_kernel, short_fwd, {})] if short_fwd != cfgs.fwd else []),
            (attn_bwd_dq_kernel, cfgs.bwd_dq, {}),
            (attn_bwd_dkdv_kernel, cfgs.bwd_dkdv, {"ATOMIC_DQ": False}),
            (attn_bwd_dkdv_kernel, cfgs.bwd_dkdv, {"ATOMIC_DQ": True}),
        ):
            compile_one(fn, dtype, {**flags, **extra, **launch_constexprs(fn, cfg, even=not varlen)}, args.arch,
                        cfg.num_warps, cfg.num_stages)
            n += 1
    compile_one(attn_bwd_preprocess_kernel, "bf16",
                {"HEADDIM": 80, "BLOCK_D": 128, "BLOCK_M": 128, "IS_VARLEN": True}, args.arch)
    fp32 = dict(IS_VARLEN=False, HAS_LEFT=True, HAS_RIGHT=True, SOFTCAP=True, ALIBI=True, DROPOUT=True,
                DOT_PRECISION="ieee", HEADDIM=40, BLOCK_D=64)
    compile_one(attn_fwd_kernel, "fp32", {**fp32, "BLOCK_M": 64, "BLOCK_N": 32, "TMA": False, "BLOCKS_FASTEST": False,
                                          "HEAD_GROUP": 1, "EVEN": False, "EVEN_INTERIOR": False},
                args.arch)
    print(f"compiled {n + 2} kernel variants for sm_{args.arch}, each within {SHARED_MEMORY_LIMIT} bytes of "
          "shared memory")


if __name__ == "__main__":
    main()
