"""A fixed workload for Nsight Compute: forward and backward of one gluon_check.py shape, a few times, so that
`ncu --kernel-name regex:... --launch-skip N --launch-count 1` can pick one launch of a kernel after warm-up.

    ncu --clock-control none --kernel-name regex:attn_bwd_dkdv --launch-skip 2 --launch-count 1 \
        --section SourceCounters -o dkdv python3 scripts/ncu_drive.py --shape d64c8k
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashpatch  # noqa: E402
from gluon_check import SHAPES  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="d64c8k", help="a gluon_check.SHAPES name")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    b, sq, sk, h, hk, d, causal, *dropout = SHAPES[args.shape]
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    dout = torch.randn_like(q)
    for _ in range(args.reps):
        out = flashpatch.flash_attn_func(q, k, v, dropout_p=dropout[0] if dropout else 0.0, causal=causal)
        torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
