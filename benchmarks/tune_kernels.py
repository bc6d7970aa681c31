"""Time flashpatch's launch configurations against each other on the GPU (one run, medians of do_bench).

    python benchmarks/tune_kernels.py [--out DIR] [--headdim {64,128,256}] [--seqlens 8192] [--heads H --kv-heads HK]
                                   [--batch B] [--masks causal,full] [--dropout P] [--skip-bwd] [--match REGEX]

Dense bf16, by default B*N = 16k tokens, H*D = 2048, causal and full. Forward configs and backward configs
(dK/dV tile, dQ tile, atomic dQ or a separate dQ pass) are timed separately; the winners go into
flashpatch/kernels/config.py by hand, with the numbers in docs/tuning.md. Each candidate is a set of
options.override fields (config.KernelConfigs) over config's current pick.
"""

import argparse
import json
import re
from dataclasses import replace
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashpatch  # noqa: E402
from flashpatch.kernels import config as kc  # noqa: E402
from flashpatch.kernels import options  # noqa: E402
from flashpatch.kernels.config import LaunchConfig as L  # noqa: E402

# The grids below (`--headdim`, `--dropout`, `--seqlens`, `--masks`, `--heads`, `--kv-heads`, `--batch`). At the 1B
# recipe's shape (--heads 16 --kv-heads 4 --batch 8 --seqlens 1024 --masks causal) the kernels take ~0.1 ms and
# do_bench times the host's launch overhead too: time GPU kernels with the profiler there
# (profile_kernels.kernel_times, as tools/gluon_check.py does). Each entry: (name, function of the current
# KernelConfigs giving the fields to override). What each grid found, and what was tried and removed:
# docs/tuning.md.
FWD = {
    64: [("current", lambda c: {}),
         ("fwd 4 warps", lambda c: dict(fwd=replace(c.fwd, num_warps=4))),
         ("fwd 8 warps", lambda c: dict(fwd=replace(c.fwd, num_warps=8))),
         ("fwd 64x64 w4 s3", lambda c: dict(fwd=replace(c.fwd, block_m=64, num_warps=4))),
         ("fwd 128x128 w8 s2", lambda c: dict(fwd=replace(c.fwd, block_n=128, num_warps=8, num_stages=2)))],
    128: [("current", lambda c: {}),
          ("fwd 128x128 w8 s2", lambda c: dict(fwd=replace(c.fwd, block_n=128, num_stages=2))),
          ("fwd 128x64 w4 s3", lambda c: dict(fwd=replace(c.fwd, block_n=64, num_warps=4))),
          ("fwd 64x64 w4 s3", lambda c: dict(fwd=replace(c.fwd, block_m=64, block_n=64, num_warps=4)))],
    # head dim 256: a (rows, 256) fp32 accumulator takes rows * 256 / threads registers a thread; the tiles below
    # are those that ptxas (tools/dump_ir.py --headdim 256) compiles without spilling more than a few bytes
    256: [("current", lambda c: {}),
          ("fwd 128x32 w8 s2", lambda c: dict(fwd=L(128, 32, 8, 2, c.fwd.blocks_fastest))),
          ("fwd 128x64 w8 s2", lambda c: dict(fwd=L(128, 64, 8, 2, c.fwd.blocks_fastest))),
          ("fwd 64x32 w4 s3", lambda c: dict(fwd=L(64, 32, 4, 3, c.fwd.blocks_fastest)))],
}
BWD = {
    64: [("current", lambda c: {}),
         ("dkdv 32x64 w4 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_n=64, num_stages=3))),
         ("dkdv 64x64 w4 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_m=64, block_n=64, num_stages=3))),
         ("dkdv 32x128 w8 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, num_warps=8, num_stages=3))),
         ("dq 64x64 w4 s3", lambda c: dict(bwd_dq=replace(c.bwd_dq, block_m=64))),
         ("both blocks first", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, blocks_fastest=True),
                                              bwd_dq=replace(c.bwd_dq, blocks_fastest=True))),
         ("both heads first", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, blocks_fastest=False),
                                             bwd_dq=replace(c.bwd_dq, blocks_fastest=False))),
         ("dkdv dp first", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, dp_first=True))),
         ("current, again", lambda c: {})],
    128: [("current", lambda c: {}),
          ("dkdv 32x128 w8 s3", lambda c: dict(bwd_dkdv=L(32, 128, 8, 3, c.bwd_dkdv.blocks_fastest))),
          ("dkdv 64x64 w4 s3 TMA", lambda c: dict(bwd_dkdv=L(64, 64, 4, 3, c.bwd_dkdv.blocks_fastest, True))),
          ("dkdv 32x64 w4 s3 TMA", lambda c: dict(bwd_dkdv=L(32, 64, 4, 3, c.bwd_dkdv.blocks_fastest, True))),
          ("dkdv blocks first", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, blocks_fastest=True))),
          ("dkdv 2 stages", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, num_stages=2))),
          ("dkdv 4 stages", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, num_stages=4))),
          ("dq 64x64 w4 s3 TMA", lambda c: dict(bwd_dq=L(64, 64, 4, 3, c.bwd_dq.blocks_fastest, True))),
          ("dq 64x128 w8 s2 TMA", lambda c: dict(bwd_dq=L(64, 128, 8, 2, c.bwd_dq.blocks_fastest, True))),
          ("atomic dQ", lambda c: dict(atomic_dq=True)),
          ("dkdv dp first", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, dp_first=True))),
          ("dkdv dp last", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, dp_first=False))),
          # one-warpgroup tiles (two blocks per SM, so no CTA barrier ties their warpgroups together)
          ("dkdv 32x64 w4 s3 TMA dp first", lambda c: dict(bwd_dkdv=L(32, 64, 4, 3, c.bwd_dkdv.blocks_fastest, True,
                                                                       dp_first=True))),
          ("dkdv 64x64 w4 s3 TMA dp first", lambda c: dict(bwd_dkdv=L(64, 64, 4, 3, c.bwd_dkdv.blocks_fastest, True,
                                                                       dp_first=True))),
          ("current, again", lambda c: {})],  # drift within the run
    # head dim 256: dK and dV accumulators of (keys, 256) fp32 each, 2 * keys * 256 / threads registers a thread
    256: [("current", lambda c: {}),
          ("dkdv 16x64 w8 s2", lambda c: dict(bwd_dkdv=L(16, 64, 8, 2, c.bwd_dkdv.blocks_fastest))),
          ("dkdv 16x64 w8 s3", lambda c: dict(bwd_dkdv=L(16, 64, 8, 3, c.bwd_dkdv.blocks_fastest))),
          ("dkdv 16x32 w4 s3", lambda c: dict(bwd_dkdv=L(16, 32, 4, 3, c.bwd_dkdv.blocks_fastest))),
          ("dq 128x32 w8 s2", lambda c: dict(bwd_dq=L(128, 32, 8, 2, c.bwd_dq.blocks_fastest))),
          ("dq 128x16 w8 s2", lambda c: dict(bwd_dq=L(128, 16, 8, 2, c.bwd_dq.blocks_fastest))),
          ("dq 64x32 w4 s2", lambda c: dict(bwd_dq=L(64, 32, 4, 2, c.bwd_dq.blocks_fastest))),
          ("current, again", lambda c: {})],
}

# --dropout P: attention dropout at d128. The forward draws the keep bits with ALU work that the matmuls do not
# hide; the backward draws them in dK/dV and again in the dQ pass, or once with atomic dQ.
DROPOUT_FWD = [
    ("current", lambda c: {}),
    ("fwd 128x128 w8 s2", lambda c: dict(fwd=replace(c.fwd, block_n=128, num_warps=8, num_stages=2))),
    ("fwd 128x128 w8 s3", lambda c: dict(fwd=replace(c.fwd, block_n=128, num_warps=8, num_stages=3))),
    ("fwd 64x64 w4 s3", lambda c: dict(fwd=replace(c.fwd, block_m=64, block_n=64, num_warps=4))),
    ("fwd 128x64 w4 s3", lambda c: dict(fwd=replace(c.fwd, num_warps=4))),
]
DROPOUT_BWD = [
    ("current", lambda c: {}),
    # the Gluon dQ pass draws dropout too
    ("separate Gluon dQ", lambda c: dict(atomic_dq=False, gluon_dq=True)),
    ("separate Triton dQ", lambda c: dict(atomic_dq=False, gluon_dq=False)),
    ("atomic dQ", lambda c: dict(atomic_dq=True)),
    ("separate dQ", lambda c: dict(atomic_dq=False)),
    ("atomic dQ, TMA", lambda c: dict(atomic_dq=True, bwd_dkdv=replace(c.bwd_dkdv, tma=True))),
    ("dkdv 32x64 w4 s3 TMA", lambda c: dict(bwd_dkdv=L(32, 64, 4, 3, c.bwd_dkdv.blocks_fastest, True))),
    ("dkdv 32x128 w8 s3", lambda c: dict(bwd_dkdv=replace(c.bwd_dkdv, block_m=32))),
    ("dq 64x64 w4 s3", lambda c: dict(bwd_dq=replace(c.bwd_dq, block_m=64, num_warps=4))),
    ("current, again", lambda c: {}),
]


def tflops(ms, flops):
    return flops / ms * 1e-9


def bench(fn) -> float:
    """Median ms, or NaN when the config does not compile or fit the GPU (shared memory, registers)."""
    try:
        return triton.testing.do_bench(fn, return_mode="median")
    except Exception as err:  # noqa: BLE001 - a variant that fails to build is a result, not a crash
        print(f"  skipped: {type(err).__name__}: {str(err)[:300]}", flush=True)
        return float("nan")


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def record(rows, tag, kind, name, ms, flops, err=float("nan")):
    rows.append(dict(case=tag, kind=kind, cfg=name, ms=ms, tflops=tflops(ms, flops), rel_err_vs_pointers=err))
    print(f"{tag:22s} {kind}  {name:28s} {tflops(ms, flops):6.1f}  (rel. diff to pointers {err:.1e})", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/tune")
    parser.add_argument("--seqlens", default="8192")
    parser.add_argument("--headdim", type=int, default=64, choices=sorted(FWD))
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 2048 / headdim)")
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: --heads)")
    parser.add_argument("--batch", type=int, default=None, help="default 16384 / seqlen")
    parser.add_argument("--masks", default="causal,full")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p: time the dropout grid at d128")
    parser.add_argument("--skip-bwd", action="store_true", help="time the forward grid only")
    parser.add_argument("--match", default="", help="regular expression: only the grid entries whose name it finds")
    args = parser.parse_args()
    p = args.dropout
    fwd_grid = {128: DROPOUT_FWD} if p else {args.headdim: FWD[args.headdim]}
    bwd_grid = {128: DROPOUT_BWD} if p else {args.headdim: BWD[args.headdim]}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for headdim in fwd_grid:
        nheads = args.heads or 2048 // headdim
        nheads_k = args.kv_heads or nheads
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            batch = args.batch or 16384 // seqlen
            for causal in (m == "causal" for m in args.masks.split(",")):
                q, k, v = (torch.randn(batch, seqlen, h, headdim, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for h in (nheads, nheads_k, nheads_k))
                flops = 4 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
                tag = (f"d{headdim} n{seqlen} {'causal' if causal else 'full'}" + (f" p{p}" if p else "")
                       + (f" b{batch} h{nheads}:{nheads_k}" if (args.heads or args.batch) else ""))
                attend = lambda: flashpatch.flash_attn_func(q, k, v, dropout_p=p, causal=causal)  # noqa: E731
                dout = torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16)  # (B, S, H, D)
                # what ops.py would pick for these dense rows, which every tuned tile divides
                base = kc.configs_for(headdim, True, masked=causal, dropout=p > 0, aligned=True,
                                      short=seqlen <= kc.SHORT, grouped=nheads != nheads_k)
                want = None
                for name, make_fields in fwd_grid[headdim]:
                    if not re.search(args.match, name):
                        continue
                    fields = make_fields(base)
                    with options.override(**fields):
                        ms = bench(attend)
                        err = float("nan")
                        if ms == ms:
                            torch.manual_seed(0)  # the same keep bits for every variant
                            got = attend()
                            want = got if want is None else want
                            err = rel_err(got, want)
                    record(rows, tag, "fwd", name, ms, flops, err)
                out = attend()
                want = None
                for name, make_fields in ([] if args.skip_bwd else bwd_grid[headdim]):
                    if not re.search(args.match, name):
                        continue
                    fields = make_fields(base)
                    with options.override(**fields):
                        ms = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                        err = float("nan")
                        if ms == ms:
                            got = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                            want = got if want is None else want
                            err = max(rel_err(g, w) for g, w in zip(got, want))
                    record(rows, tag, "bwd", name, ms, 2.5 * flops, err)
                (out_dir / "tune.json").write_text(json.dumps(rows, indent=1))  # after every case: a cut run keeps them
    print("\n| case | kind | best config | TFLOP/s |\n|---|---|---|---|")
    for case in dict.fromkeys(r["case"] for r in rows):
        for kind in ("fwd", "bwd"):
            timed = [r for r in rows if r["case"] == case and r["kind"] == kind and r["ms"] == r["ms"]]  # not NaN
            if not timed:
                continue
            best = max(timed, key=lambda r: r["tflops"])
            print(f"| {case} | {kind} | {best['cfg']} | {best['tflops']:.1f} |")
    print("\nregisters, spills and shared memory of every compiled variant:")
    from profile_kernels import compiled_stats
    compiled_stats()


if __name__ == "__main__":
    main()
