"""The persistent Gluon forward's block order, timed: schedule.causal_schedule's table against the closed form
(hopper_fwd.CAUSAL_SCHEDULE), head groups other than config.head_group's, and one K/V head for all query heads (the
same work with K/V always in L2: what the order could gain at most). GPU only (sm_90), bf16, head dim 128.

    python scripts/fwd_order_bench.py [--shapes c4k,c8k] [--variants closed,table,table_g8,mqa] [--reps 3]
    python scripts/fwd_order_bench.py --ncu closed   # three forwards of c4k, for `ncu --kernel-name regex:attn_fwd`

Variants run interleaved, `--reps` times each (the machine's clocks drift between runs); a row gives the fastest
run's do_bench median and every run's. NOTES.md v56 has the reading.
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashpatch  # noqa: E402
from flashpatch.kernels import config as kc  # noqa: E402
from flashpatch.kernels import hopper_fwd as hf  # noqa: E402

# name: (batch, seqlen, heads, kv heads, causal)
SHAPES = {
    "c4k": (4, 4096, 16, 16, True), "c8k": (2, 8192, 16, 16, True), "c16k": (1, 16384, 16, 16, True),
    "gqa2k": (8, 2048, 16, 4, True), "1b": (8, 1024, 16, 4, True), "f4k": (4, 4096, 16, 16, False),
    "f8k": (2, 8192, 16, 16, False), "f16k": (1, 16384, 16, 16, False),
}


def variant_settings(name: str) -> tuple[bool, int | None, bool]:
    """(CAUSAL_SCHEDULE, HEAD_GROUP_OVERRIDE, one K/V head) of a variant: "closed", "table", "table_gN", "mqa"."""
    if name == "closed":
        return False, None, False
    if name == "table":
        return True, None, False
    if name.startswith("table_g") and name[7:].isdigit():
        return True, int(name[7:]), False
    if name == "mqa":
        return True, None, True
    raise ValueError(f"unknown variant {name!r}: closed, table, table_gN or mqa")


def bench(shape: str, variants: list[str], reps: int) -> None:
    batch, seqlen, heads, kv_heads, causal = SHAPES[shape]
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
    kv = {n: [torch.randn(batch, seqlen, n, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
          for n in {kv_heads, 1}}
    flops = 4 * batch * heads * seqlen * seqlen * 128 / (2 if causal else 1)
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name in variants:
            hf.CAUSAL_SCHEDULE, kc.HEAD_GROUP_OVERRIDE, mqa = variant_settings(name)
            k, v = kv[1 if mqa else kv_heads]
            times[name].append(do_bench(lambda: flashpatch.flash_attn_func(q, k, v, causal=causal), warmup=25,
                                        rep=100, return_mode="median"))
    hf.CAUSAL_SCHEDULE, kc.HEAD_GROUP_OVERRIDE = True, None
    for name in variants:
        best = min(times[name])
        print(f"| {shape} | {name} | {best * 1e3:.1f} | {flops / best * 1e-9:.0f} | "
              f"{' '.join(f'{t * 1e3:.0f}' for t in times[name])} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="c4k,c8k,c16k,gqa2k,1b")
    parser.add_argument("--variants", default="closed,table,mqa")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ncu", default=None, help="a variant: run three c4k forwards with it and stop")
    args = parser.parse_args()
    if args.ncu:
        hf.CAUSAL_SCHEDULE, kc.HEAD_GROUP_OVERRIDE, _ = variant_settings(args.ncu)
        batch, seqlen, heads, kv_heads, causal = SHAPES["c4k"]
        q, k, v = (torch.randn(batch, seqlen, h, 128, device="cuda", dtype=torch.bfloat16)
                   for h in (heads, kv_heads, kv_heads))
        for _ in range(3):
            flashpatch.flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        return
    print("| shape | variant | forward us | TFLOP/s | runs (us) |\n|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        bench(shape, args.variants.split(","), args.reps)


if __name__ == "__main__":
    main()
