"""GPU kernel time (torch profiler, not wall clock) of launch variants at one shape: for shapes whose kernels are
short enough that do_bench's timing includes host launch overhead (the 1B recipe's attention: ~0.1 ms kernels).
Dense rows (causal unless --full), bf16; each variant overrides fields of the launch settings config.py picks for
the shape.

    python scripts/kernel_time_variants.py [--seqlen 1024 --batch 8 --heads 16 --kv-heads 4 --headdim 128] [--match fwd]
                                           [--dropout 0.1] [--full]
"""

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashpatch  # noqa: E402
from flashpatch.kernels import config as kc  # noqa: E402
from flashpatch.kernels.config import LaunchConfig as L  # noqa: E402
from profile_kernels import compiled_stats, kernel_times, times_by_kind  # noqa: E402

VARIANTS = [
    ("current", lambda c: {}),
    ("fwd 128x64 w8 s3", lambda c: dict(fwd=L(128, 64, 8, 3, True))),  # the d128 masked forward before round 14
    ("fwd 64x64 w4 s3", lambda c: dict(fwd=L(64, 64, 4, 3, True))),
    ("fwd 128x64 w4 s3", lambda c: dict(fwd=L(128, 64, 4, 3, True))),
    # round 16: deeper and shallower pipelines and narrower tiles at this short, GQA shape
    ("fwd 64x64 w4 s2", lambda c: dict(fwd=L(64, 64, 4, 2, True))),
    ("fwd 64x64 w4 s4", lambda c: dict(fwd=L(64, 64, 4, 4, True))),
    ("fwd 64x32 w4 s3", lambda c: dict(fwd=L(64, 32, 4, 3, True))),
    ("fwd 64x128 w4 s2", lambda c: dict(fwd=L(64, 128, 4, 2, True))),
    ("fwd 64x64 w4 s3 TMA", lambda c: dict(fwd=L(64, 64, 4, 3, True, True))),
    ("dq 128x64 w8 s2 TMA", lambda c: dict(bwd_dq=replace(c.bwd_dq, num_stages=2))),
    ("dq 128x64 w8 s4 TMA", lambda c: dict(bwd_dq=replace(c.bwd_dq, num_stages=4))),
    ("dq 128x32 w8 s3 TMA", lambda c: dict(bwd_dq=replace(c.bwd_dq, block_n=32))),
    ("dq 64x64 w4 s2 TMA", lambda c: dict(bwd_dq=L(64, 64, 4, 2, c.bwd_dq.blocks_fastest, True))),
    ("dkdv 64x64 w4 s3", lambda c: dict(bwd_dkdv=L(64, 64, 4, 3, c.bwd_dkdv.blocks_fastest))),
    ("dkdv 2 stages", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, num_stages=2))),
    ("dkdv 4 stages", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, num_stages=4))),
    ("dkdv 32x128 w8 s3", lambda c: dict(bwd_dkdv=L(32, 128, 8, 3, c.bwd_dkdv.blocks_fastest))),
    ("dkdv 64x64 w4 s3 TMA", lambda c: dict(bwd_dkdv=L(64, 64, 4, 3, c.bwd_dkdv.blocks_fastest, True))),
    ("dkdv blocks first", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, blocks_fastest=True))),
    # TMA tiles: no (D, BM) pointer tensors for Q and dO held across the GQA group loop
    ("dkdv TMA", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, tma=True))),
    ("dkdv 32x128 w8 s3 TMA", lambda c: dict(bwd_dkdv=L(32, 128, 8, 3, c.bwd_dkdv.blocks_fastest, True))),
    # 16 warps: the 64x128 tile's fp32 dK and dV accumulators over 512 threads instead of 256 (it spills at 8)
    ("dkdv 64x128 w16 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, num_warps=16))),
    ("dkdv 64x128 w16 s2", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, num_warps=16, num_stages=2))),
    ("dkdv 128x128 w16 s2", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_m=128, num_warps=16,
                                                             num_stages=2))),
    ("dq 128x64 w16 s3", lambda c: dict(bwd_dq=replace(c.bwd_dq, num_warps=16))),
    ("dq 64x64 w4 s3 TMA", lambda c: dict(bwd_dq=L(64, 64, 4, 3, c.bwd_dq.blocks_fastest, True))),
    # round 20 (--dropout): the Gluon dQ pass with dropout (hopper_dq.dropout_keep_acc)
    ("Gluon dq with dropout", lambda c: dict(gluon_dq=True, atomic_dq=False)),
    ("Triton dq", lambda c: dict(gluon_dq=False, atomic_dq=False)),
    # round 24: 256-query forward tiles (FA3's d64 forward runs 192 queries per program, three warpgroups; Triton's
    # tiles are powers of two); the Triton forward where the Gluon one is the default (unmasked d64, d128)
    ("fwd Triton, current tile", lambda c: dict(gluon_fwd=False)),
    ("fwd Triton 256x64 w8 s3", lambda c: dict(fwd=L(256, 64, 8, 3, True), gluon_fwd=False)),
    ("fwd Triton 256x64 w16 s3", lambda c: dict(fwd=L(256, 64, 16, 3, True), gluon_fwd=False)),
    ("fwd Triton 256x128 w16 s2", lambda c: dict(fwd=L(256, 128, 16, 2, True), gluon_fwd=False)),
    ("fwd Triton 128x128 w8 s3", lambda c: dict(fwd=L(128, 128, 8, 3, True), gluon_fwd=False)),
    ("current, again", lambda c: {}),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--full", action="store_true", help="no causal mask")
    parser.add_argument("--match", default="", help="regular expression: only the variants whose name it finds "
                        "(and 'current')")
    args = parser.parse_args()
    b, n, h, hk, d = args.batch, args.seqlen, args.heads, args.kv_heads, args.headdim
    q, k, v = (torch.randn(b, n, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (h, hk, hk))  # (B, S, H, D)
    dout = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    causal = not args.full
    fwd_flops = 4 * b * h * n * n * d / (2 if causal else 1)

    def step():
        out = flashpatch.flash_attn_func(q, k, v, causal=causal, dropout_p=args.dropout)
        torch.autograd.grad(out, (q, k, v), dout)

    base = kc.configs_for(d, True, masked=causal, dropout=args.dropout > 0, aligned=True, short=n <= kc.SHORT,
                          grouped=h != hk)
    mask = "causal" if causal else "full"
    print(f"d{d} N={n} B={b} H={h}:{hk} {mask}, dropout {args.dropout}, GPU kernel ms per fwd+bwd (torch profiler, "
          "20 steps; Triton and Gluon kernels of each kind together)")
    print("| variant | fwd | dK/dV | dQ | fwd+bwd | TFLOP/s |\n|---|---|---|---|---|---|")
    for name, make_fields in VARIANTS:
        if not re.search(args.match, name) and not name.startswith("current"):
            continue
        try:
            with kc.override(**make_fields(base)):
                times = kernel_times(step, iters=20)
        except Exception as err:  # noqa: BLE001 - a variant that does not build or fit is a result
            print(f"| {name} | failed: {type(err).__name__}: {str(err)[:120]} |||||", flush=True)
            continue
        fwd, dkdv, dq, total = (t or float("nan") for t in times_by_kind(
            times, ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_")).values())
        print(f"| {name} | {fwd:.3f} | {dkdv:.3f} | {dq:.3f} | {total:.3f} | {3.5 * fwd_flops / total * 1e-9:.0f} |",
              flush=True)
    print("\ncompiled flashpatch kernels:")
    compiled_stats()


if __name__ == "__main__":
    main()
