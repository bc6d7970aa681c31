"""LAZY_PV experiment: bit-identity against the default persistent forward, float64 error, and forward timing."""
import sys
from pathlib import Path
import torch
from triton.testing import do_bench
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashpatch
from flashpatch.kernels import hopper_fwd as hf

def run(q, k, v, causal, alibi=None, lazy=False):
    hf.LAZY_PV = lazy
    out, lse, _ = flashpatch.flash_attn_func(q, k, v, causal=causal, alibi_slopes=alibi, return_attn_probs=True)
    hf.LAZY_PV = False
    return out, lse

torch.manual_seed(0)
cases = [  # (b, sq, sk, h, hk, causal, alibi, dtype)
    (4, 4096, 4096, 16, 16, True, False, torch.bfloat16), (4, 4096, 4096, 16, 16, False, False, torch.bfloat16),
    (8, 1024, 1024, 16, 4, True, False, torch.bfloat16), (2, 1024, 2048, 8, 2, True, False, torch.bfloat16),
    (2, 2048, 1024, 8, 8, True, False, torch.bfloat16), (2, 2048, 2048, 8, 8, True, True, torch.bfloat16),
    (2, 2048, 2048, 8, 1, True, False, torch.float16), (1, 128, 128, 16, 4, True, False, torch.bfloat16),
    (3, 1152, 640, 4, 4, False, False, torch.float16),
]
import os
ok = True
for b, sq, sk, h, hk, causal, alibi, dt in (cases if not os.environ.get("ONLY_TIME") else []):
    q = torch.randn(b, sq, h, 128, device="cuda", dtype=dt)
    k, v = (torch.randn(b, sk, hk, 128, device="cuda", dtype=dt) for _ in "kv")
    sl = torch.rand(h, device="cuda", dtype=torch.float32) if alibi else None
    o0, l0 = run(q, k, v, causal, sl, False)
    o1, l1 = run(q, k, v, causal, sl, True)
    same = torch.equal(o0, o1) and torch.equal(l0, l1)
    nan = bool(torch.isnan(o1).any())
    ok &= same and not nan
    print(f"b{b} q{sq} k{sk} h{h}:{hk} causal={causal} alibi={alibi} {dt}: bit-identical={same} nan={nan} "
          f"max|diff|={(o0.float() - o1.float()).abs().max().item():.3g}")
print("ALL IDENTICAL" if ok else "MISMATCH")

SHAPES = {"c4k": (4, 4096, 16, 16, True), "c8k": (2, 8192, 16, 16, True), "c16k": (1, 16384, 16, 16, True),
          "f4k": (4, 4096, 16, 16, False), "f8k": (2, 8192, 16, 16, False), "f16k": (1, 16384, 16, 16, False),
          "gqa2k": (8, 2048, 16, 4, True), "1b": (8, 1024, 16, 4, True)}
print("| shape | base TFLOP/s | lazy TFLOP/s | base runs (us) | lazy runs (us) |")
print("|---|---|---|---|---|")
for name, (b, n, h, hk, causal) in SHAPES.items():
    if os.environ.get("SHAPES") and name not in os.environ["SHAPES"].split(","):
        continue
    q = torch.randn(b, n, h, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, n, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    flops = 4 * b * h * n * n * 128 / (2 if causal else 1)
    t = {False: [], True: []}
    for _ in range(int(os.environ.get("REPS", 3))):
        for lazy in (False, True):
            hf.LAZY_PV = lazy
            t[lazy].append(do_bench(lambda: flashpatch.flash_attn_func(q, k, v, causal=causal), warmup=25, rep=100,
                                    return_mode="median"))
    hf.LAZY_PV = False
    tf = {x: flops / min(t[x]) / 1e9 for x in t}
    print(f"| {name} | {tf[False]:.0f} | {tf[True]:.0f} | {' '.join(f'{x*1e3:.0f}' for x in t[False])} | "
          f"{' '.join(f'{x*1e3:.0f}' for x in t[True])} |", flush=True)
