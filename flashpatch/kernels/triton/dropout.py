"""Writes the dropout keep pattern of one attention call, for tests and debugging.

It calls the very `dropout_keep` the attention kernels call, with the same counters, so what it shows is what
they drew. Materializes (batch, nheads, max_seqlen_q, max_seqlen_k): small shapes only.
"""

import triton
import triton.language as tl

from flashpatch.kernels.triton.common import dropout_head_rows, dropout_keep


@triton.jit
def dropout_mask_kernel(
    OUT, SEED_OFFSET, nheads, max_seqlen_q, max_seqlen_k, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    off_bh = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    seed = tl.load(SEED_OFFSET)
    offset = tl.load(SEED_OFFSET + 1)
    rows0 = dropout_head_rows(off_bh // nheads, nheads, off_bh % nheads, max_seqlen_q) + pid_m * BLOCK_M // 2
    keep = dropout_keep(seed, offset, rows0, n0, max_seqlen_k, dropout_p, BLOCK_M, BLOCK_N)
    ptrs = OUT + (off_bh * max_seqlen_q + offs_m[:, None]) * max_seqlen_k + offs_n[None, :]
    mask = (offs_m[:, None] < max_seqlen_q) & (offs_n[None, :] < max_seqlen_k)
    tl.store(ptrs, tl.where(keep, 1.0, -1.0), mask=mask)
