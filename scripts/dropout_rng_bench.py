"""Where dropout's time goes: mask generation alone, per way of drawing it, against the dropout-free forward.

Each kernel walks a causal-free (B*H, N/BM) grid of (BM, BN) tiles like the forward does, draws every keep bit
and folds them into one count per program (so nothing is optimized away). Variants:
    kernels          the kernels' dropout_keep: one Philox4x32-10 call per eight (query, key) pairs, 16-bit
                     decisions, grouped so that each thread's matmul-accumulator elements share its calls
    kernels_t        dropout_keep_transposed (the dK/dV kernel's keys x queries tile: four decisions per call)
    four_lanes_v11   the generator before: one call per four keys of a row, 24-bit decisions, interleaved by
                     tl.join/reshape through shared memory
    one_lane         one Philox call per key, output 0 only (no interleave, 4x the arithmetic of four_lanes_v11)
The forward with and without dropout is timed too: the number that matters.
    python scripts/dropout_rng_bench.py      (CUDA GPU)
"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout, not installed
from flashpatch.kernels.triton.common import dropout_keep, dropout_keep_transposed  # noqa: E402

VARIANTS = ("kernels", "kernels_t", "four_lanes_v11", "one_lane")


@triton.jit
def _four_lanes_v11(seed, offset, row_base, offs_m, start_n, max_seqlen_k, p, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    groups = start_n // 4 + tl.arange(0, BLOCK_N // 4)
    counter = offset + (row_base + offs_m.to(tl.int64))[:, None] * ((max_seqlen_k + 3) // 4) + groups[None, :]
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero, zero)
    threshold = tl.ceil(p * 16777216.0).to(tl.uint32)
    k0, k1, k2, k3 = (r0 >> 8) >= threshold, (r1 >> 8) >= threshold, (r2 >> 8) >= threshold, (r3 >> 8) >= threshold
    return tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), (BLOCK_M, BLOCK_N))


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
def _mask_kernel(OUT, seed, offset, seqlen, p, VARIANT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_base = bh.to(tl.int64) * seqlen
    rows0 = bh.to(tl.int64) * (seqlen // 2) + tl.program_id(1) * BLOCK_M // 2  # seqlen is a multiple of 16
    kept = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for start_n in range(0, seqlen, BLOCK_N):
        if VARIANT == 0:
            keep = dropout_keep(seed, offset, rows0, start_n, seqlen, p, BLOCK_M, BLOCK_N)
        elif VARIANT == 1:
            keep = tl.trans(dropout_keep_transposed(seed, offset, rows0, start_n, seqlen, p, BLOCK_M, BLOCK_N))
        elif VARIANT == 2:
            keep = _four_lanes_v11(seed, offset, row_base, offs_m, start_n, seqlen, p, BLOCK_M, BLOCK_N)
        else:
            keep = _one_lane(seed, offset, row_base, offs_m, start_n, seqlen, p, BLOCK_M, BLOCK_N)
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
    for variant, name in enumerate(VARIANTS):
        run = lambda: _mask_kernel[grid](out, 12345, 678, seqlen, 0.1, VARIANT=variant,  # noqa: E731
                                         BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)
        ms = triton.testing.do_bench(run, return_mode="median")
        run()
        kept = out.double().sum().item() / elements
        print(f"| {name} | {ms:.3f} | {elements / ms * 1e-6:.0f} | {kept:.5f} |")


if __name__ == "__main__":
    main()
