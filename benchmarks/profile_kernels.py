"""Per-kernel GPU time of one fwd+bwd step, flashpatch against FlexAttention and SDPA (whichever backend its
dispatcher picks, named by its kernels), plus each compiled flashpatch kernel's registers, spills and shared
memory. Answers "which launch is slow" before tuning it.

    python benchmarks/profile_kernels.py [--seqlen 8192] [--headdim 128] [--causal 1] [--batch B] [--heads H]
                                      [--kv-heads HK]
The 1B training recipe's attention: --seqlen 1024 --batch 8 --heads 16 --kv-heads 4.
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashpatch  # noqa: E402
from flashpatch.kernels.triton import backward, forward  # noqa: E402


def kernel_times(step, iters=10):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / iters / 1000.0  # ms per step
    return sorted(totals.items(), key=lambda kv: -kv[1])


def times_by_kind(times, kinds):
    """{kind: ms} from kernel_times' (name, ms) pairs: the sum over the kernels whose name starts with each kind
    (Triton and Gluon kernels of one kind together)."""
    return {kind: sum(t for name, t in times if name.startswith(kind)) for kind in kinds}


def compiled_stats():
    for fn in (forward.attn_fwd_kernel, backward.attn_bwd_dkdv_kernel, backward.attn_bwd_dq_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for key, kernel in cache[0].items():
                meta = kernel.metadata
                consts = {k: v for k, v in getattr(kernel.src, "constants", {}).items()
                          if isinstance(v, (int, bool)) and str(k) in
                          ("BLOCK_M", "BLOCK_N", "TMA", "BLOCKS_FASTEST", "HAS_RIGHT", "HEADDIM", "ATOMIC_DQ")}
                print(f"  {fn.fn.__name__} {consts or str(key)[-120:]}: warps {meta.num_warps} stages "
                      f"{meta.num_stages} regs {kernel.n_regs} spills {kernel.n_spills} shared {meta.shared} B")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--batch", type=int, default=None, help="default 16384 / seqlen")
    parser.add_argument("--heads", type=int, default=None, help="default 2048 / headdim")
    parser.add_argument("--kv-heads", type=int, default=None, help="default --heads")
    args = parser.parse_args()
    n, d, causal = args.seqlen, args.headdim, bool(args.causal)
    b, h = args.batch or 16384 // n, args.heads or 2048 // d
    hk = args.kv_heads or h
    fwd_flops = 4 * b * h * n * n * d / (2 if causal else 1)
    mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731

    q, k, v = mk(b, n, h, d), mk(b, n, hk, d), mk(b, n, hk, d)  # (B, S, H, D)
    do = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)

    def fpatch_step():
        out = flashpatch.flash_attn_func(q, k, v, causal=causal)
        torch.autograd.grad(out, (q, k, v), do)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    block_mask = create_block_mask(lambda b_, h_, i, j: i >= j, None, None, n, n) if causal else None
    qf, kf, vf = mk(b, h, n, d), mk(b, hk, n, d), mk(b, hk, n, d)  # (B, H, S, D)
    dof = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    gqa = hk != h

    def flex_step():
        out = flex(qf, kf, vf, block_mask=block_mask, enable_gqa=gqa)
        torch.autograd.grad(out, (qf, kf, vf), dof)

    def sdpa_step():
        out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=gqa)
        torch.autograd.grad(out, (qf, kf, vf), dof)

    print(f"d{d} N={n} B={b} H={h}:{hk} {'causal' if causal else 'full'}; TFLOP/s use fwd {fwd_flops:.3g} FLOPs, "
          "bwd 2.5x that")
    for name, step in (("fpatch", fpatch_step), ("flex", flex_step), ("sdpa", sdpa_step)):
        rows = kernel_times(step)
        total = sum(t for _, t in rows)
        print(f"\n{name}: {total:.3f} ms per fwd+bwd ({3.5 * fwd_flops / total * 1e-9:.0f} TFLOP/s)")
        for kernel, ms in rows[:8]:
            print(f"  {ms:7.3f} ms  {kernel[:110]}")
    print("\ncompiled flashpatch kernels:")
    compiled_stats()


if __name__ == "__main__":
    main()
