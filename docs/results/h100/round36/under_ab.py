"""SOFTMAX_UNDER_PV experiment: bit-identity against the v57 pipelined forward, and forward timing (1 vs 2)."""
import os
import sys
from pathlib import Path
import torch
from triton.testing import do_bench
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root
import flashpatch
from flashpatch.kernels import hopper_fwd as hf


def set_form(form):
    hf.LAZY_PV = form > 0
    hf.SOFTMAX_UNDER_PV = form == 2


def run(q, k, v, causal, alibi=None, form=1):
    set_form(form)
    out, lse, _ = flashpatch.flash_attn_func(q, k, v, causal=causal, alibi_slopes=alibi, return_attn_probs=True)
    set_form(1)
    return out, lse


torch.manual_seed(0)
cases = [  # (b, sq, sk, h, hk, causal, alibi, dtype)
    (4, 4096, 4096, 16, 16, True, False, torch.bfloat16), (4, 4096, 4096, 16, 16, False, False, torch.bfloat16),
    (8, 1024, 1024, 16, 4, True, False, torch.bfloat16), (2, 1024, 2048, 8, 2, True, False, torch.bfloat16),
    (2, 2048, 1024, 8, 8, True, False, torch.bfloat16), (2, 2048, 2048, 8, 8, True, True, torch.bfloat16),
    (2, 2048, 2048, 8, 1, True, False, torch.float16), (1, 128, 128, 16, 4, True, False, torch.bfloat16),
    (3, 1152, 640, 4, 4, False, False, torch.float16), (1, 17, 113, 2, 1, True, False, torch.bfloat16),
]
ok = True
for b, sq, sk, h, hk, causal, alibi, dt in cases:
    q = torch.randn(b, sq, h, 128, device="cuda", dtype=dt)
    k, v = (torch.randn(b, sk, hk, 128, device="cuda", dtype=dt) for _ in "kv")
    sl = torch.rand(h, device="cuda", dtype=torch.float32) if alibi else None
    o1, l1 = run(q, k, v, causal, sl, 1)
    o2, l2 = run(q, k, v, causal, sl, 2)
    same = torch.equal(o1, o2) and torch.equal(l1, l2)
    nan = bool(torch.isnan(o2).any())
    ok &= same and not nan
    print(f"b{b} q{sq} k{sk} h{h}:{hk} causal={causal} alibi={alibi} {dt}: bit-identical={same} nan={nan} "
          f"max|diff|={(o1.float() - o2.float()).abs().max().item():.3g}", flush=True)
print("ALL IDENTICAL" if ok else "MISMATCH", flush=True)

SHAPES = {"c4k": (4, 4096, 16, 16, True), "c8k": (2, 8192, 16, 16, True), "c16k": (1, 16384, 16, 16, True),
          "f4k": (4, 4096, 16, 16, False), "f8k": (2, 8192, 16, 16, False), "f16k": (1, 16384, 16, 16, False),
          "gqa2k": (8, 2048, 16, 4, True), "1b": (8, 1024, 16, 4, True)}
forms = [int(x) for x in os.environ.get("FORMS", "1,2").split(",")]
print("| shape | " + " | ".join(f"form {f} TFLOP/s" for f in forms) + " | " +
      " | ".join(f"form {f} runs (us)" for f in forms) + " |")
print("|---" * (1 + 2 * len(forms)) + "|")
for name, (b, n, h, hk, causal) in SHAPES.items():
    q = torch.randn(b, n, h, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, n, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    flops = 4 * b * h * n * n * 128 / (2 if causal else 1)
    t = {f: [] for f in forms}
    for _ in range(int(os.environ.get("REPS", 5))):
        for f in forms:
            set_form(f)
            t[f].append(do_bench(lambda: flashpatch.flash_attn_func(q, k, v, causal=causal), warmup=25, rep=100,
                                 return_mode="median"))
    set_form(1)
    med = {f: sorted(t[f])[len(t[f]) // 2] for f in forms}
    print(f"| {name} | " + " | ".join(f"{flops / med[f] / 1e9:.0f}" for f in forms) + " | " +
          " | ".join(" ".join(f"{x * 1e3:.0f}" for x in t[f]) for f in forms) + " |", flush=True)
