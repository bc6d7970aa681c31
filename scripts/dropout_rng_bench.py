"""Where dropout's time goes: mask generation alone, per way of drawing it, against the dropout-free forward.

Each kernel walks a causal-free (B*H, N/BM) grid of (BM, BN) tiles like the forward does, draws every keep bit
and folds them into one count per program (so nothing is optimized away). Variants:
    four_lanes   the kernels' dropout_keep: one Philox4x32-10 call per four keys, interleaved by tl.join/reshape
    one_lane     one Philox call per key, output 0 only (no interleave, 4x the arithmetic)
    eight_lanes  one call per eight keys, 16-bit decisions (half the arithmetic of four_lanes, a deeper interleave)
    python scripts/dropout_rng_bench.py      (CUDA GPU)
"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout, not installed
from flashpatch.kernels.common import dropout_keep  # noqa: E402


@triton.jit
def _four_lanes(seed, offset, row_base, offs_m, start_n, max_seqlen_k, p, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    return dropout_keep(seed, offset, row_base, offs_m, start_n, max_seqlen_k, p, BLOCK_M, BLOCK_N)


@triton.jit
def _one_lane(seed, offset, row_base, offs_m, start_n, max_seqlen_k, p, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    cols = start_n + tl.arange(0, BLOCK_N)
    counter = offset + (row_base + offs_m.to(tl.int64))[:, None] * max_seqlen_k + cols[None, :]
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    r0, _, _, _ = tl.philox(seed, c0, c1, zero, zero)
    return (r0 >> 8).to(tl.float32) * (1.0 / 16777216.0) >= p


@triton.jit
def _eight_lanes(seed, offset, row_base, offs_m, start_n, max_seqlen_k, p, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    groups = start_n // 8 + tl.arange(0, BLOCK_N // 8)
    counter = offset + (row_base + offs_m.to(tl.int64))[:, None] * ((max_seqlen_k + 7) // 8) + groups[None, :]
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero, zero)
    lo0, lo1, lo2, lo3 = r0 & 0xFFFF, r1 & 0xFFFF, r2 & 0xFFFF, r3 & 0xFFFF
    hi0, hi1, hi2, hi3 = r0 >> 16, r1 >> 16, r2 >> 16, r3 >> 16
    bits = tl.join(tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3)), tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3)))
    bits = tl.reshape(bits, (BLOCK_M, BLOCK_N))
    threshold = (p * 65536.0 + 0.5).to(tl.uint32)
    return bits >= threshold


@triton.jit
def _mask_kernel(OUT, seed, offset, seqlen, p, VARIANT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_base = bh.to(tl.int64) * seqlen
    kept = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for start_n in range(0, seqlen, BLOCK_N):
        if VARIANT == 0:
            keep = _four_lanes(seed, offset, row_base, offs_m, start_n, seqlen, p, BLOCK_M, BLOCK_N)
        elif VARIANT == 1:
            keep = _one_lane(seed, offset, row_base, offs_m, start_n, seqlen, p, BLOCK_M, BLOCK_N)
        else:
            keep = _eight_lanes(seed, offset, row_base, offs_m, start_n, seqlen, p, BLOCK_M, BLOCK_N)
        kept += keep.to(tl.int32)
    tl.store(OUT + bh * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(kept, 1), 0))


def main():
    import flashpatch

    batch, heads, seqlen, block_m, block_n = 4, 16, 4096, 128, 64  # the forward's d128 tiles at N = 4096
    out = torch.empty(batch * heads * (seqlen // block_m), dtype=torch.int32, device="cuda")
    grid = (batch * heads, seqlen // block_m)
    elements = batch * heads * seqlen * seqlen
    q, k, v = (torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fwd_ms = triton.testing.do_bench(lambda: flashpatch.flash_attn_func(q, k, v), return_mode="median")
    fwd_drop_ms = triton.testing.do_bench(lambda: flashpatch.flash_attn_func(q, k, v, dropout_p=0.1),
                                          return_mode="median")
    print(f"forward (full attention, d128, N={seqlen}): {fwd_ms:.3f} ms without dropout, {fwd_drop_ms:.3f} ms with")
    print("| variant | ms for all B*H*N*N keep bits | Gbit/s | kept fraction |\n|---|---|---|---|")
    for variant, name in enumerate(("four_lanes", "one_lane", "eight_lanes")):
        run = lambda: _mask_kernel[grid](out, 12345, 678, seqlen, 0.1, VARIANT=variant,  # noqa: E731
                                         BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)
        ms = triton.testing.do_bench(run, return_mode="median")
        run()
        kept = out.double().sum().item() / elements
        print(f"| {name} | {ms:.3f} | {elements / ms * 1e-6:.0f} | {kept:.5f} |")


if __name__ == "__main__":
    main()
