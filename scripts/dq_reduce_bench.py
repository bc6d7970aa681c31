"""The dQ reduce of a fused backward, alone: how fast can programs that each own a block of keys add their (BM, D)
fp32 dQ partials into a shared fp32 dQ? GPU only (sm_90 for the TMA forms).

A fused backward (FA2/FA3's form: one program per key block computes dK, dV and dQ's partial dS K at every query
block it sees) moves Sq·D·4 bytes of reduce traffic per key block: 8.6 GB at B2 H16 N8192 D128 unmasked, against
~3.9 ms of matmuls at the dK/dV kernel's rate (NOTES.md, "What is left" 2(c)). This script times that traffic with
nothing else running, in the same order a fused kernel would issue it (each program walks the query blocks of its
head in turn), so the rate it finds is an upper bound on what the fused kernel's reduce could reach:

  tma       cp.reduce.async.bulk.tensor (a tensor descriptor's atomic_add): the tile goes register -> shared -> L2
  atomic    red.global.add.f32 from registers (tl.atomic_add, relaxed)
  store     the same tiles stored, not added (a TMA store): the write-only ceiling of the same pattern
  *_x2      the same with 256-key programs: half the traffic, as two programs of a cluster would issue once they
            have added their partials in distributed shared memory

    python scripts/dq_reduce_bench.py [--shapes f8k,c8k,1b] [--modes tma,atomic,store,tma_x2]

Each mode first runs once into a zeroed dQ and checks every element against the count of key blocks that add to it
(the values are small integers, so fp32 sums are exact), then times with triton.testing.do_bench (median).
"""

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {  # name: (batch, seqlen, heads, head dim, causal)
    "f8k": (2, 8192, 16, 128, False),
    "c8k": (2, 8192, 16, 128, True),
    "f4k": (4, 4096, 16, 128, False),
    "1b": (8, 1024, 16, 128, True),  # the 1B recipe's attention (its 16 query heads; GQA does not change dQ's size)
}
BLOCK_M = 64  # query rows per partial (the dK/dV kernel's step at d128)
DEVICE = "cuda"  # "cpu" runs the atomic and store modes under TRITON_INTERPRET=1 (the interpreter has no TMA reduce)


@triton.jit
def dq_reduce_kernel(dq_desc, DQ, seqlen, MODE: tl.constexpr, CAUSAL: tl.constexpr, HEADDIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    num_n = tl.cdiv(seqlen, BLOCK_N)
    off_bh = tl.program_id(0) // num_n
    n0 = (tl.program_id(0) % num_n) * BLOCK_N
    m_lo = (n0 // BLOCK_M) * BLOCK_M if CAUSAL else 0
    partial = tl.full((BLOCK_M, HEADDIM), 1.0, tl.float32)  # (BM, D), as dS K would leave it in registers
    row0 = off_bh * seqlen
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEADDIM)
    for m0 in range(m_lo, seqlen, BLOCK_M):
        if MODE == 0:
            dq_desc.atomic_add([row0 + m0, 0], partial)
        elif MODE == 1:
            ptrs = DQ + (row0 + m0 + offs_m[:, None]).to(tl.int64) * HEADDIM + offs_d[None, :]
            tl.atomic_add(ptrs, partial, sem="relaxed")
        else:
            dq_desc.store([row0 + m0, 0], partial)


MODES = {"tma": (0, 128), "atomic": (1, 128), "store": (2, 128), "tma_x2": (0, 256), "atomic_x2": (1, 256),
         "store_x2": (2, 256)}


def expected(seqlen, causal, block_n, device):
    """How many key blocks add to each query row (its dQ element count under this mode)."""
    rows = torch.arange(seqlen, device=device)
    if not causal:
        return torch.full_like(rows, triton.cdiv(seqlen, block_n), dtype=torch.float32)
    # a key block starting at n0 adds to query blocks from the one holding row n0 on
    n_starts = torch.arange(0, seqlen, block_n, device=device)
    first_row = (n_starts // BLOCK_M) * BLOCK_M
    return (first_row[None, :] <= rows[:, None]).sum(1).to(torch.float32)


def run(shape, mode):
    batch, seqlen, heads, headdim, causal = SHAPES[shape]
    code, block_n = MODES[mode]
    dq = torch.zeros(batch * heads * seqlen, headdim, device=DEVICE, dtype=torch.float32)  # (B·H·N, D)
    desc = TensorDescriptor.from_tensor(dq, [BLOCK_M, headdim])
    grid = (batch * heads * triton.cdiv(seqlen, block_n),)

    def launch():
        dq_reduce_kernel[grid](desc, dq, seqlen, MODE=code, CAUSAL=causal, HEADDIM=headdim, BLOCK_M=BLOCK_M,
                               BLOCK_N=block_n, num_warps=4)

    launch()
    want = expected(seqlen, causal, block_n, dq.device).repeat(batch * heads)[:, None].expand_as(dq)  # (B·H·N, D)
    if code != 2:  # a store leaves the last value, not a count
        bad = (dq != want).sum().item()
        if bad:
            raise AssertionError(f"{shape} {mode}: {bad} of {dq.numel()} dQ elements differ from the key-block count")
    gbytes = want.sum().item() * 4 / 1e9  # every (BM, D) tile a program adds or stores, 4 B an element
    ms = triton.testing.do_bench(launch, warmup=25, rep=200)
    return gbytes, ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="f8k,c8k,f4k,1b")
    parser.add_argument("--modes", default="tma,atomic,store,tma_x2,atomic_x2,store_x2")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE}, Triton {triton.__version__}")
    print("| shape | mode | reduce GB | ms | TB/s |\n|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for mode in args.modes.split(","):
            try:
                gbytes, ms = run(shape, mode)
            except Exception as err:  # noqa: BLE001 - a mode that does not build is a result
                print(f"| {shape} | {mode} | failed: {type(err).__name__}: {str(err)[:300]} | | |", flush=True)
                continue
            print(f"| {shape} | {mode} | {gbytes:.2f} | {ms:.3f} | {gbytes / ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
