"""Time flashpatch's launch configurations against each other on the GPU (one run, medians of do_bench).

    python scripts/tune_kernels.py [--out DIR]

Dense bf16, B*N = 16k tokens, H*D = 2048, causal and full. Forward configs and backward configs (dK/dV tile,
dQ tile, atomic dQ or a separate dQ pass) are timed separately; the winners go into flashpatch/kernels/config.py
by hand, with the numbers in NOTES.md.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashpatch  # noqa: E402
from flashpatch.kernels import config as kc  # noqa: E402
from flashpatch.kernels.config import LaunchConfig as L  # noqa: E402

FWD = {
    64: [L(128, 64, 4, 3), L(128, 128, 4, 3), L(128, 128, 8, 3), L(128, 64, 8, 4), L(64, 64, 4, 4)],
    128: [L(128, 64, 8, 3), L(128, 64, 4, 3), L(128, 128, 8, 3), L(128, 128, 8, 2), L(64, 64, 4, 3)],
}
DKDV = {
    64: [L(32, 128, 4, 3), L(64, 128, 8, 3), L(32, 64, 4, 3), L(64, 64, 4, 3)],
    128: [L(32, 128, 8, 2), L(64, 128, 8, 2), L(32, 64, 4, 3), L(64, 64, 4, 2)],
}
DQ = {
    64: [L(128, 32, 4, 3), L(128, 64, 8, 3), L(64, 64, 4, 3)],
    128: [L(128, 32, 8, 2), L(128, 64, 8, 2), L(64, 64, 4, 3)],
}


def tflops(ms, flops):
    return flops / ms * 1e-9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/tune")
    parser.add_argument("--seqlens", default="4096,8192")
    args = parser.parse_args()
    rows = []
    for headdim in (128, 64):
        nheads = 2048 // headdim
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            batch = 16384 // seqlen
            for causal in (True, False):
                q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                flops = 4 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
                tag = f"d{headdim} n{seqlen} {'causal' if causal else 'full'}"
                for cfg in FWD[headdim]:
                    with kc.override(fwd=cfg):
                        ms = triton.testing.do_bench(
                            lambda: flashpatch.flash_attn_func(q, k, v, causal=causal), return_mode="median")
                    rows.append(dict(case=tag, kind="fwd", cfg=str(cfg), ms=ms, tflops=tflops(ms, flops)))
                    print(f"{tag:22s} fwd  {cfg}  {tflops(ms, flops):6.1f}", flush=True)
                out = flashpatch.flash_attn_func(q, k, v, causal=causal)
                dout = torch.randn_like(out)
                combos = [(d, None, True) for d in DKDV[headdim]] + [
                    (d, c, False) for d in DKDV[headdim][:2] for c in DQ[headdim]]
                for dkdv, dq, atomic in combos:
                    fields = dict(bwd_dkdv=dkdv, atomic_dq=atomic, **({"bwd_dq": dq} if dq else {}))
                    with kc.override(**fields):
                        ms = triton.testing.do_bench(
                            lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                            return_mode="median")
                    name = f"dkdv={dkdv} dq={'atomic' if atomic else dq}"
                    rows.append(dict(case=tag, kind="bwd", cfg=name, ms=ms, tflops=tflops(ms, 2.5 * flops)))
                    print(f"{tag:22s} bwd  {name}  {tflops(ms, 2.5 * flops):6.1f}", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tune.json").write_text(json.dumps(rows, indent=1))
    print("\n| case | kind | best config | TFLOP/s |\n|---|---|---|---|")
    for case in dict.fromkeys(r["case"] for r in rows):
        for kind in ("fwd", "bwd"):
            best = max((r for r in rows if r["case"] == case and r["kind"] == kind), key=lambda r: r["tflops"])
            print(f"| {case} | {kind} | {best['cfg']} | {best['tflops']:.1f} |")


if __name__ == "__main__":
    main()
