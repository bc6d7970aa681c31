"""GPU kernel time (torch profiler) of one varlen fwd+bwd step, per kernel, for the flashpatch package found in
--tree (default: this checkout), so that an older commit's kernels can be timed on the same GPU in the same call:

    git archive <commit> flashpatch | tar -x -C runs/trees/<name>
    python scripts/varlen_kernel_times.py --tree runs/trees/<name> --label <name>

The batch is recipes/bench_attention.py's varlen mix (document lengths log-uniform in 64..4096, 64k tokens,
causal, bf16, d128, 16 query heads; --kv-heads 4 for the 1B recipe's GQA). --masked-loads times the checkout with
`even_tiles` off (every load keeps its bounds mask, as before NOTES.md v28); --batch-order, --dkdv-block-m and
--dq-tma time other grid orders and tiles.
"""

import argparse
import contextlib
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", default=str(ROOT), help="a directory holding the flashpatch package to time")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--masked-loads", action="store_true", help="config.override(even_tiles=False)")
    parser.add_argument("--batch-order", action="store_true",
                        help="sequences in batch order (config.VARLEN_LONGEST_FIRST off)")
    parser.add_argument("--dkdv-block-m", type=int, help="the dK/dV kernel's query tile")
    parser.add_argument("--dq-tma", type=int, choices=(0, 1), help="the dQ kernel's TMA loads off / on")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import flashpatch  # the tree's package first: profile_kernels and bench_attention then find it imported
    sys.path[1:1] = [str(ROOT / "recipes"), str(ROOT / "scripts")]
    import torch
    from bench_attention import varlen_batch, varlen_lengths
    from profile_kernels import kernel_times, times_by_kind

    lengths = varlen_lengths()
    nheads, headdim = 16, 128
    q, k, v, dout, cu_seqlens = varlen_batch(lengths, nheads, args.kv_heads, headdim)

    def step():
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max(lengths), max(lengths),
                                                causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    from flashpatch.kernels import config
    current = config.configs_for(headdim, True, masked=True, grouped=args.kv_heads != nheads)  # as ops picks
    fields = {}  # the checkout's settings unless a flag names one (older trees may lack the newer fields)
    if args.masked_loads:
        fields["even_tiles"] = False
    if args.dkdv_block_m is not None:
        fields["bwd_dkdv"] = replace(current.bwd_dkdv, block_m=args.dkdv_block_m)
    if args.dq_tma is not None:
        fields["bwd_dq"] = replace(current.bwd_dq, tma=bool(args.dq_tma))
    if args.batch_order:
        config.VARLEN_LONGEST_FIRST = False
    context = config.override(**fields) if fields else contextlib.nullcontext()
    print(f"{args.label}: flashpatch from {Path(flashpatch.__file__).parent}", flush=True)
    kinds = ("attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq")
    with context:
        for _ in range(args.repeats):
            per_kind = times_by_kind(kernel_times(step, iters=20), kinds)
            print(f"{args.label:24s} Hk {args.kv_heads:2d}: "
                  + "  ".join(f"{kind[5:]} {t:.3f}" for kind, t in per_kind.items())
                  + f"  total {sum(per_kind.values()):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
