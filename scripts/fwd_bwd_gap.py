"""Where a fwd+bwd step's time goes beyond its kernels: do_bench of forward+backward (as bench_attention.py times
it) against the sum of GPU kernel times of the same step, and the host calls that block (synchronisations, copies).
GPU only.

    python scripts/fwd_bwd_gap.py [--shapes g2k,c4k]
"""

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashpatch  # noqa: E402
from gluon_check import SHAPES  # noqa: E402
from profile_kernels import kernel_times  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="g2k,c4k")
    parser.add_argument("--cprofile", action="store_true", help="also the Python functions with the most own time")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        b, sq, sk, h, hk, d, causal, *dropout = SHAPES[shape]
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)

        def step():
            flashpatch.flash_attn_func(q, k, v, *dropout, causal=causal).backward(dout)

        step()
        wall = do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="median")
        times = kernel_times(step, iters=20)
        busy = sum(t for _, t in times)
        print(f"{shape}: do_bench fwd+bwd {wall:.3f} ms, kernels {busy:.3f} ms, gap {wall - busy:.3f} ms")
        for name, t in times:
            print(f"    {t:.3f} ms  {name[:90]}")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
