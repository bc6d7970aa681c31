"""LAZY_PER_BLOCK experiment: the per-block Gluon forward (d64 three consumers, d128 dropout) pipelined by one matmul.
Bit-identity against the one-step loop, then forward timing (median of REPS interleaved do_bench medians)."""
import os
import sys
from pathlib import Path
import torch
from triton.testing import do_bench
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root
import flashpatch
from flashpatch.kernels import config as kernel_config
from flashpatch.kernels import hopper_fwd as hf


def run(q, k, v, causal, p, lazy, alibi=None):
    hf.LAZY_PER_BLOCK = lazy
    torch.cuda.manual_seed(1234)  # the same dropout seed for both forms
    with kernel_config.override(gluon_fwd=True):  # the Gluon forward even where its rule picks the Triton one
        out, lse, _ = flashpatch.flash_attn_func(q, k, v, dropout_p=p, causal=causal, alibi_slopes=alibi,
                                                 return_attn_probs=True)
    hf.LAZY_PER_BLOCK = False
    return out, lse


torch.manual_seed(0)
cases = [  # (b, sq, sk, h, hk, d, causal, p, alibi, dtype)
    (2, 2048, 2048, 16, 16, 128, True, 0.1, False, torch.bfloat16), (2, 2048, 2048, 8, 8, 128, False, 0.1, False,
                                                                        torch.bfloat16),
    (2, 1024, 2048, 8, 2, 128, True, 0.2, False, torch.bfloat16), (2, 2048, 1024, 8, 8, 128, True, 0.1, False,
                                                                      torch.bfloat16),
    (2, 1152, 1152, 8, 8, 128, True, 0.1, True, torch.float16),
    (4, 4096, 4096, 32, 32, 64, True, 0.0, False, torch.bfloat16), (4, 4096, 4096, 32, 32, 64, False, 0.0, False,
                                                                       torch.bfloat16),
    (2, 1000, 1500, 8, 2, 64, True, 0.0, False, torch.bfloat16), (2, 1500, 1000, 8, 8, 64, True, 0.0, True,
                                                                     torch.float16),
]
ok = True
for b, sq, sk, h, hk, d, causal, p, alibi, dt in cases:
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in "kv")
    sl = torch.rand(h, device="cuda", dtype=torch.float32) if alibi else None
    o0, l0 = run(q, k, v, causal, p, False, sl)
    o1, l1 = run(q, k, v, causal, p, True, sl)
    same = torch.equal(o0, o1) and torch.equal(l0, l1)
    nan = bool(torch.isnan(o1).any())
    ok &= same and not nan
    print(f"b{b} q{sq} k{sk} h{h}:{hk} d{d} causal={causal} p={p} alibi={alibi} {dt}: bit-identical={same} "
          f"nan={nan} max|diff|={(o0.float() - o1.float()).abs().max().item():.3g}", flush=True)
print("ALL IDENTICAL" if ok else "MISMATCH", flush=True)

SHAPES = {  # name: (b, n, h, d, causal, p), the bench's rows (B.N = 16k tokens)
    "drop2k": (8, 2048, 16, 128, True, 0.1), "drop8k": (2, 8192, 16, 128, True, 0.1),
    "d64c4k": (4, 4096, 32, 64, True, 0.0), "d64c8k": (2, 8192, 32, 64, True, 0.0),
    "d64c16k": (1, 16384, 32, 64, True, 0.0), "d64f4k": (4, 4096, 32, 64, False, 0.0),
    "d64f8k": (2, 8192, 32, 64, False, 0.0), "d64f16k": (1, 16384, 32, 64, False, 0.0),
    "d64gqa2k": (8, 2048, 12, 64, True, 0.0),
}
print("| shape | base TFLOP/s | lazy TFLOP/s | base runs (us) | lazy runs (us) |")
print("|---|---|---|---|---|")
for name, (b, n, h, d, causal, p) in SHAPES.items():
    hk = 4 if name == "d64gqa2k" else h
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    t = {False: [], True: []}
    for _ in range(int(os.environ.get("REPS", 5))):
        for lazy in (False, True):
            hf.LAZY_PER_BLOCK = lazy
            t[lazy].append(do_bench(lambda: flashpatch.flash_attn_func(q, k, v, dropout_p=p, causal=causal),
                                    warmup=25, rep=100, return_mode="median"))
    hf.LAZY_PER_BLOCK = False
    med = {x: sorted(t[x])[len(t[x]) // 2] for x in t}
    print(f"| {name} | {flops / med[False] / 1e9:.0f} | {flops / med[True] / 1e9:.0f} | "
          f"{' '.join(f'{x * 1e3:.0f}' for x in t[False])} | {' '.join(f'{x * 1e3:.0f}' for x in t[True])} |",
          flush=True)
