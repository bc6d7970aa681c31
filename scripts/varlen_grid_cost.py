"""What the varlen grid costs beyond the work: GPU kernel time (torch profiler) of one varlen batch with max_seqlen
as it is, x2 and x4, then as it is again. The kernels' loops follow the real lengths; with a grid of batch x
ceil(max_seqlen / block) blocks per head every extra block is a program that exits at once, with the grid of
ops.varlen_blocks (NOTES.md v27) nothing changes.

    python scripts/varlen_grid_cost.py      (CUDA GPU; the batch is recipes/bench_attention.py's varlen mix, d128)
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "recipes"), str(ROOT / "scripts")]  # runnable from a checkout, not installed
import flashpatch  # noqa: E402
from bench_attention import varlen_batch, varlen_lengths  # noqa: E402
from profile_kernels import kernel_times, times_by_kind  # noqa: E402


def main():
    lengths = varlen_lengths()
    q, k, v, dout, cu_seqlens = varlen_batch(lengths, 16, 16, 128)
    for scale in (1, 2, 4, 1):
        max_seqlen = max(lengths) * scale

        def step():
            out = flashpatch.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                    causal=True)
            torch.autograd.grad(out, (q, k, v), dout)

        times = kernel_times(step, iters=20)
        per_kind = times_by_kind(times, ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"))
        print(f"max_seqlen {max_seqlen}: " + "  ".join(f"{kind[5:]} {t:.3f} ms" for kind, t in per_kind.items()),
              flush=True)


if __name__ == "__main__":
    main()
