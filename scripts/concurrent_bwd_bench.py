"""GPU time of one backward (attn_bwd_impl: preprocess, dK/dV, dQ) with dK/dV and dQ in turn on one stream or side by
side on two (KernelConfigs.concurrent_dq) or with dQ added by the Gluon dK/dV itself (KernelConfigs.fused_dq), with
the Gluon dQ's grid persistent or per block, and with the Gluon dQ or dK/dV where config keeps the Triton one. GPU
only.

The backwards are queued behind a GPU sleep long enough for the host to queue them all, so CUDA events around
them time the GPU alone: at the 1B recipe's shape a backward costs the host more than the GPU (NOTES.md v21), and
kernel-time sums (gluon_check.py) cannot show two kernels overlapping.

    python scripts/concurrent_bwd_bench.py [--shapes 1b,g2k,c4k] [--reps 3]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))  # bench_attention's varlen mix

from flashpatch import ops
from flashpatch.kernels import config as kc, hopper_dq

SHAPES = {  # name: (batch, seqlen, heads, kv heads, head dim, causal[, dropout p]); batch 0: the varlen mix
    "1b": (8, 1024, 16, 4, 128, True),  # the 1B recipe's attention
    "1bf": (8, 1024, 16, 4, 128, False),
    "g2k": (8, 2048, 16, 4, 128, True),
    "c4k": (4, 4096, 16, 16, 128, True),
    "f4k": (4, 4096, 16, 16, 128, False),
    "c8k": (2, 8192, 16, 16, 128, True),
    "f8k": (2, 8192, 16, 16, 128, False),
    "c16k": (1, 16384, 16, 16, 128, True),
    "f16k": (1, 16384, 16, 16, 128, False),
    "c2k": (8, 2048, 16, 16, 128, True),
    "f2k": (8, 2048, 16, 16, 128, False),
    "g8k": (2, 8192, 16, 4, 128, True),
    "gf4k": (4, 4096, 16, 4, 128, False),
    "d64c1k": (16, 1024, 32, 8, 64, True),
    "d64f1k": (16, 1024, 32, 8, 64, False),
    "d64c2k": (8, 2048, 12, 4, 64, True),  # configs/llama_125m.yaml's attention
    "d64g4k": (4, 4096, 32, 8, 64, True),
    "d64c4k": (4, 4096, 32, 32, 64, True),
    "drop2k": (4, 2048, 16, 4, 128, True, 0.1),  # configs/dropout.yaml's attention (GQA 16/4)
    "dropc2k": (8, 2048, 16, 16, 128, True, 0.1),  # no GQA: the Triton dK/dV's atomic dQ before v51
    "dropc8k": (2, 8192, 16, 16, 128, True, 0.1),  # bench_attention.py's dropout rows
    "dropf4k": (4, 4096, 16, 16, 128, False, 0.1),
    "varlen": (0, 4096, 16, 16, 128, True),  # bench_attention.py's mix: 73 documents of 64..4096, 64k tokens
}
VARIANTS = {  # name: (concurrent_dq, hopper_dq.PERSISTENT, other KernelConfigs fields); all but "default" and
    # "fused_dq" keep the separate dQ pass where config would fuse it (long rows at head dim 128)
    "default": (True, None, {}),
    "serial": (False, None, {"fused_dq": False}),
    "concurrent": (True, None, {"fused_dq": False}),
    "concurrent+perblock_dq": (True, False, {"fused_dq": False}),
    # the Gluon dQ where config keeps the Triton one (d64)
    "concurrent+gluon_dq": (True, None, {"gluon_dq": True, "fused_dq": False}),
    # the Gluon dK/dV where config keeps the Triton one
    "concurrent+gluon_dkdv": (True, None, {"gluon_dkdv": True, "fused_dq": False}),
    "fused_dq": (False, None, {"fused_dq": True}),  # d128: dQ added by the Gluon dK/dV itself (hopper_dkdv.fuses_dq)
    # dropout: the Triton dK/dV (before v51; with config's atomic dQ where it takes it), and the separate dQ pass
    # beside whichever dK/dV config picks (neither atomic nor fused)
    "concurrent+triton_dkdv": (True, None, {"gluon_dkdv": False, "fused_dq": False}),
    "concurrent+separate_dq": (True, None, {"atomic_dq": False, "fused_dq": False}),
}


def backward_ms(shape, concurrent, persistent, fields, iters=20):
    b, n, h, hk, d, causal, *dropout = SHAPES[shape]
    p = dropout[0] if dropout else 0.0
    torch.manual_seed(0)
    cu = None
    if b == 0:  # varlen: (total, H, D) tensors and cu_seqlens
        from bench_attention import varlen_batch, varlen_lengths
        q, k, v, dout, cu = (t.detach() for t in varlen_batch(varlen_lengths(), h, hk, d))
    else:
        q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        dout = torch.randn_like(q)
    seed_offset = ops.draw_seed_offset(q.device) if p > 0 else None
    scale = d ** -0.5
    window_right = 0 if causal else -1
    out, lse = ops.attn_fwd(q, k, v, cu, cu, n, n, seed_offset, p, scale, -1, window_right, 0.0)
    hopper_dq.PERSISTENT = persistent
    try:
        with kc.override(concurrent_dq=concurrent, **fields):
            def step():
                return ops.attn_bwd_impl(dout, q, k, v, out, lse, cu, cu, n, n, seed_offset, p, scale, -1,
                                         window_right, 0.0, False)
            reference = step()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(200_000_000)  # ~100 ms: the host queues every backward before the GPU reaches them
            start.record()
            for _ in range(iters):
                step()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / iters, reference
    finally:
        hopper_dq.PERSISTENT = None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1b,g2k,c4k")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print("| shape | variant | backward ms (each rep) | max abs diff vs the first variant |\n|---|---|---|---|",
          flush=True)
    names = args.variants.split(",")
    for shape in args.shapes.split(","):
        times = {name: [] for name in names}
        grads = {}
        for _ in range(args.reps):  # variants interleaved, so drift over the run hits each alike
            for name in names:
                ms, grads[name] = backward_ms(shape, *VARIANTS[name])
                times[name].append(ms)
        for name in names:
            diff = max((a.float() - g.float()).abs().max().item() for a, g in zip(grads[names[0]], grads[name]))
            print(f"| {shape} | {name} | {' / '.join(f'{t:.3f}' for t in times[name])} | {diff:.3g} |", flush=True)

if __name__ == "__main__":
    main()
