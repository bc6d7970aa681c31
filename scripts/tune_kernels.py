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

# Round 3: every dK/dV x dQ pair among round 2's winners (round 1: docs/results/h200/tune_round1.json, a small
# grid; round 2: tune_round2.json, one factor at a time around the then-current configs).
FWD = {
    64: [L(128, 64, 4, 3), L(128, 64, 4, 4), L(128, 64, 4, 5)],
    128: [L(128, 64, 8, 3), L(128, 128, 8, 3)],
}
DKDV = {
    64: [L(32, 128, 4, 3), L(32, 128, 4, 2)],
    128: [L(64, 128, 8, 2), L(32, 128, 8, 3), L(32, 128, 8, 2)],
}
DQ = {
    64: [L(128, 64, 4, 3), L(128, 64, 4, 4), L(128, 64, 8, 3)],
    128: [L(128, 64, 8, 3), L(128, 64, 8, 4), L(128, 128, 8, 3)],
}


def tflops(ms, flops):
    return flops / ms * 1e-9


def bench(fn) -> float:
    """Median ms, or NaN when the config does not fit the GPU (shared memory, registers)."""
    try:
        return triton.testing.do_bench(fn, return_mode="median")
    except triton.runtime.errors.OutOfResources as err:
        print(f"  skipped: {err}", flush=True)
        return float("nan")


def record(rows, tag, kind, name, ms, flops):
    rows.append(dict(case=tag, kind=kind, cfg=name, ms=ms, tflops=tflops(ms, flops)))
    print(f"{tag:22s} {kind}  {name}  {tflops(ms, flops):6.1f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/tune")
    parser.add_argument("--seqlens", default="8192")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
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
                        ms = bench(lambda: flashpatch.flash_attn_func(q, k, v, causal=causal))
                    record(rows, tag, "fwd", str(cfg), ms, flops)
                out = flashpatch.flash_attn_func(q, k, v, causal=causal)
                dout = torch.randn_like(out)
                current = kc.configs_for(headdim, True, masked=causal)
                combos = [dict(bwd_dkdv=d, bwd_dq=c) for d in DKDV[headdim] for c in DQ[headdim]]
                combos.append({})  # the current configs
                for fields in combos:
                    with kc.override(**fields):
                        ms = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                        used = kc.configs_for(headdim, True, masked=causal)
                    dq = "atomic" if used.atomic_dq else used.bwd_dq
                    name = f"dkdv={used.bwd_dkdv} dq={dq}" + (" (current)" if used == current else "")
                    record(rows, tag, "bwd", name, ms, 2.5 * flops)
                (out_dir / "tune.json").write_text(json.dumps(rows, indent=1))  # after every case: a cut run keeps them
    print("\n| case | kind | best config | TFLOP/s |\n|---|---|---|---|")
    for case in dict.fromkeys(r["case"] for r in rows):
        for kind in ("fwd", "bwd"):
            timed = [r for r in rows if r["case"] == case and r["kind"] == kind and r["ms"] == r["ms"]]  # not NaN
            best = max(timed, key=lambda r: r["tflops"])
            print(f"| {case} | {kind} | {best['cfg']} | {best['tflops']:.1f} |")


if __name__ == "__main__":
    main()
