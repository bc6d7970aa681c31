"""The persistent Gluon forward or dQ against the per-block one (hopper_{fwd,dq}.PERSISTENT forced each way), case
by case, each (kernel, case) in its own process with CUDA_LAUNCH_BLOCKING=1 so that a fault names its kernel and
does not end the run. GPU only.

    python scripts/persistent_debug.py [fwd,dq CASE_INDICES]   e.g. `fwd,dq 0,4,6`
    ERROR_MAP=1 python scripts/persistent_debug.py fwd 0 child  one case in this process, with a map of the
                                                                 max error per 64-row half block

NOTES.md v32 (a) has what it found (docs/results/h200/round26/persistent_*_before_fix.log)."""

import os
import subprocess
import sys

CASES = [
    (2, 1024, 1024, 8, 2, 128, True),
    (1, 1024, 1024, 1, 1, 128, False),
    (1, 256, 256, 1, 1, 128, False),
    (1, 128, 128, 1, 1, 128, False),
    (2, 384, 128, 4, 1, 128, True),
    (1, 1024, 2048, 2, 1, 64, False),
    (2, 4096, 4096, 5, 5, 128, True),
    (8, 1024, 1024, 16, 4, 128, False),  # 1024 tiles: several rounds
    (4, 4096, 4096, 16, 16, 128, False),
]


def child(kind, index):
    import torch
    import triton
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    import flashpatch
    from flashpatch.kernels import config as kernel_config, hopper_dq, hopper_fwd
    b, sq, sk, h, hk, d, causal = CASES[index]
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    module = hopper_fwd if kind == "fwd" else hopper_dq
    results = []
    for persistent in (False, True):
        module.PERSISTENT = persistent
        with kernel_config.override(gluon_fwd=True, gluon_dkdv=True, gluon_dq=True):
            out = flashpatch.flash_attn_func(q, k, v, causal=causal)
            torch.cuda.synchronize()
            dq, = torch.autograd.grad(out, (q,), dout)
            torch.cuda.synchronize()
        results.append(out if kind == "fwd" else dq)
    err = (results[0].float() - results[1].float()).abs()  # (B, S, H, D)
    print(f"{kind} case {CASES[index]}: max |persistent - default| = {err.max().item():.3g}")
    if os.environ.get("ERROR_MAP") and err.max() > 0:
        # per (batch, head): the max error of each 64-row half block, and the rows of the first wrong block
        per_half = err.amax(dim=3).unflatten(1, (sq // 64, 64)).amax(dim=2)  # (B, S / 64, H)
        for bi in range(b):
            for hi in range(h):
                print(f"  b{bi} h{hi}:", " ".join(f"{x:.2f}" for x in per_half[bi, :, hi].tolist()))
        rows = err.amax(dim=3)[0, :, 0]
        bad = (rows > 0.05).nonzero().flatten().tolist()
        print("  b0 h0 wrong rows:", bad[:40], "...", len(bad))


def main():
    if len(sys.argv) == 4:
        child(sys.argv[1], int(sys.argv[2]))
        return
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fwd", "dq"]
    cases = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 1 else range(len(CASES))
    for kind in kinds:
        for index in cases:
            run = subprocess.run([sys.executable, __file__, kind, str(index), "child"], env=env, capture_output=True,
                                 text=True, timeout=120)
            text = run.stdout.strip() or run.stderr.strip().splitlines()[-1:]
            print(f"[rc {run.returncode}]", text, flush=True)


if __name__ == "__main__":
    main()
