"""Time launch configurations on a varlen batch, whose loads keep their bounds masks (ops._even is False), so a
tile that wins on dense rows can lose here; benchmarks/tune_kernels.py times dense rows only.

    python benchmarks/tune_varlen.py [--headdim 64] [--kv-heads 4] [--lengths 4096,4096,2551,4096] [--match fwd]

The batch is benchmarks/bench_attention.py's unless --lengths names one: document lengths log-uniform in 64..4096,
64k tokens, causal, bf16, H*D = 2048. Prints forward and backward medians (triton.testing.do_bench) per variant,
and each kernel's GPU time (torch profiler). CUDA GPU only.
"""

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "recipes")]  # a checkout; bench_attention in either
import flashpatch  # noqa: E402
from bench_attention import varlen_batch, varlen_lengths  # noqa: E402
from flashpatch.kernels import config as kc  # noqa: E402
from flashpatch.kernels import options  # noqa: E402
from profile_kernels import kernel_times, times_by_kind  # noqa: E402

# Each entry: (name, function of the current KernelConfigs giving the fields to override).
VARIANTS = [
    ("current", lambda c: {}),
    ("fwd 8 warps", lambda c: dict(fwd=replace(c.fwd, num_warps=8))),
    ("fwd 4 warps", lambda c: dict(fwd=replace(c.fwd, num_warps=4))),
    ("dq TMA", lambda c: dict(bwd_dq=replace(c.bwd_dq, tma=True))),
    ("dq pointers", lambda c: dict(bwd_dq=replace(c.bwd_dq, tma=False))),
    ("dkdv 32x128 w8 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_m=32, block_n=128, num_warps=8))),
    ("dkdv 64x128 w8 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_m=64, block_n=128, num_warps=8))),
    # narrower key blocks (less causal waste on the diagonal of short documents), one warpgroup
    ("dkdv 64x64 w4 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_m=64, block_n=64, num_warps=4))),
    ("dkdv 32x64 w4 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_m=32, block_n=64, num_warps=4))),
    ("dkdv 32x64 w8 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_m=32, block_n=64, num_warps=8))),
    ("dq 64x64 w4 s3", lambda c: dict(bwd_dq=replace(c.bwd_dq, block_m=64, block_n=64, num_warps=4))),
    ("dq 128x32 w8 s3", lambda c: dict(bwd_dq=replace(c.bwd_dq, block_n=32))),
    # the padded recipe's batches (four documents, most of 4096 tokens) are long rows
    ("fwd 128x128 w8 s2", lambda c: dict(fwd=replace(c.fwd, block_m=128, block_n=128, num_warps=8, num_stages=2))),
    ("dkdv 64x128 w8 s2", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_m=64, block_n=128, num_warps=8,
                                                           num_stages=2))),
    # 256 queries per forward program (on dense unmasked d128 rows the Triton forward gained 6% with it)
    ("fwd 256x64 w8 s3", lambda c: dict(fwd=replace(c.fwd, block_m=256, block_n=64, num_warps=8, num_stages=3))),
    ("fwd 256x64 w16 s3", lambda c: dict(fwd=replace(c.fwd, block_m=256, block_n=64, num_warps=16, num_stages=3))),
    ("current, again", lambda c: {}),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, help="K/V heads (default: as many as query heads, 2048 / headdim)")
    parser.add_argument("--lengths", help="document lengths, comma-separated (default: the bench's varlen mix)")
    parser.add_argument("--match", default="", help="regular expression: only the variants whose name it finds "
                        "(and 'current')")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else varlen_lengths()
    total, nheads, headdim = sum(lengths), 2048 // args.headdim, args.headdim
    nheads_k = args.kv_heads or nheads
    q, k, v, dout, cu_seqlens = varlen_batch(lengths, nheads, nheads_k, headdim)

    def attend():
        return flashpatch.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max(lengths), max(lengths),
                                                 causal=True)

    current = kc.configs_for(headdim, True, masked=True, grouped=nheads_k != nheads, varlen=True)
    print(f"varlen, {len(lengths)} documents, {total} tokens, d{headdim}, {nheads}/{nheads_k} heads, causal")
    for name, make_fields in VARIANTS:
        if not re.search(args.match, name) and not name.startswith("current"):
            continue
        with options.override(**make_fields(current)):
            fwd_ms = triton.testing.do_bench(attend, return_mode="median")
            out = attend()
            bwd_ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                             return_mode="median")
            times = kernel_times(lambda: torch.autograd.grad(attend(), (q, k, v), dout))
        gpu = times_by_kind(times, ("attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"))
        print(f"{name:18s} fwd {fwd_ms:.3f} ms  bwd {bwd_ms:.3f} ms  total {fwd_ms + bwd_ms:.3f} ms  | GPU kernel ms: "
              + "  ".join(f"{kind[5:]} {t:.3f}" for kind, t in gpu.items()), flush=True)


if __name__ == "__main__":
    main()
