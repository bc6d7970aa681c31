"""Row moves between padded (B, S, H, D) tensors of any strides and packed (T, H, D) ones, for the padded path of
the transformers integration (padding.gather_rows / scatter_rows).

A padded batch's real tokens are gathered into the packed layout the varlen kernels take, and their outputs (and
gradients) scattered back. torch's advanced indexing does each move as an index kernel plus, for a scatter, a zero
fill of the whole padded tensor first; on (B, S, H, D) views of (B, H, S, D) memory, as transformers hands over q, k
and v, those index kernels ran at a fraction of the memory bandwidth (docs/tuning.md, "padded rows"). Here a gather
reads each real token's (H, D) block once, and a scatter writes every padded position once: the token's row where
it has one, zeros elsewhere, with no separate fill.
"""

import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(
    SRC, DST, BATCH_INDEX, POSITION,  # SRC (B, S, H, D) any strides; DST (T, H, D) contiguous; indices (T,) int64
    stride_b, stride_s, stride_h, stride_d, nheads, headdim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """DST[t] = SRC[BATCH_INDEX[t], POSITION[t]]: program (t, head block)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # int64: strides times heads
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < nheads) & (offs_d[None, :] < headdim)
    b = tl.load(BATCH_INDEX + t)
    s = tl.load(POSITION + t)
    src = SRC + b * stride_b + s * stride_s + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    dst = DST + (t * nheads + offs_h[:, None]) * headdim + offs_d[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


@triton.jit
def scatter_rows_kernel(
    SRC, DST, ROW_OF,  # SRC (T, H, D) contiguous; DST (B, S, H, D) any strides; ROW_OF (B * S,) int32, -1: none
    seqlen, stride_b, stride_s, stride_h, stride_d, nheads, headdim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """DST[b, s] = SRC[ROW_OF[b * S + s]], or zeros where that is -1: program (b * S + s, head block)."""
    r = tl.program_id(0).to(tl.int64)
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < nheads) & (offs_d[None, :] < headdim)
    # the row as a (BLOCK_H, 1) column, not a scalar: the interpreter takes a mask built from tensors only
    t = tl.load(ROW_OF + r).to(tl.int64) + tl.zeros([BLOCK_H, 1], tl.int64)
    src = SRC + (t * nheads + offs_h[:, None]) * headdim + offs_d[None, :]
    values = tl.load(src, mask=mask & (t >= 0), other=0.0)
    b = r // seqlen
    s = r - b * seqlen
    dst = DST + b * stride_b + s * stride_s + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    tl.store(dst, values, mask=mask)
