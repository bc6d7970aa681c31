"""Row moves between padded (B, S, H, D) tensors of any strides and packed (T, H, D) ones, for the padded path of
the transformers integration (padding.gather and padding.scatter, which autograd.PaddedAttnFunction calls).

A padded batch's real tokens are gathered into the packed layout the varlen kernels take, and their outputs (and
gradients) scattered back. torch's advanced indexing does each move as an index kernel plus, for a scatter, a zero
fill of the whole padded tensor first; on (B, S, H, D) views of (B, H, S, D) memory, as transformers hands over q, k
and v, those index kernels ran at a fraction of the memory bandwidth (docs/tuning.md, "padded rows"). Here a gather
reads each real token's (H, D) block once, and a scatter writes every padded position once: the token's row where
it has one, zeros elsewhere, with no separate fill. One launch moves up to three tensors that share the rows (q, k
and v, or their gradients): the grid's third axis picks the tensor, so a layer's unpadded attention pays two row
launches a forward and two a backward rather than four each.
"""

import triton
import triton.language as tl


@triton.jit
def _gather_one(SRC, DST, t, b, s, stride_b, stride_s, stride_h, stride_d, nheads, headdim,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """DST[t] = SRC[b, s] over the program's block of heads."""
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # int64: strides times heads
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < nheads) & (offs_d[None, :] < headdim)
    src = SRC + b * stride_b + s * stride_s + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    dst = DST + (t * nheads + offs_h[:, None]) * headdim + offs_d[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


@triton.jit
def gather_rows_kernel(
    SRC0, DST0, SRC1, DST1, SRC2, DST2,  # SRCi (B, S, Hi, D) any strides; DSTi (T, Hi, D) contiguous
    BATCH_INDEX, POSITION,  # (T,) int64: row t is SRCi[BATCH_INDEX[t], POSITION[t]]
    stride0_b, stride0_s, stride0_h, stride0_d, nheads0,
    stride1_b, stride1_s, stride1_h, stride1_d, nheads1,
    stride2_b, stride2_s, stride2_h, stride2_d, nheads2,
    headdim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """DSTi[t] = SRCi[BATCH_INDEX[t], POSITION[t]]: program (t, head block, i). The launch's third grid axis holds as
    many programs as there are tensors; unused pointers are never read."""
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(2)
    b = tl.load(BATCH_INDEX + t)
    s = tl.load(POSITION + t)
    if which == 0:
        _gather_one(SRC0, DST0, t, b, s, stride0_b, stride0_s, stride0_h, stride0_d, nheads0, headdim, BLOCK_H, BLOCK_D)
    elif which == 1:
        _gather_one(SRC1, DST1, t, b, s, stride1_b, stride1_s, stride1_h, stride1_d, nheads1, headdim, BLOCK_H, BLOCK_D)
    else:
        _gather_one(SRC2, DST2, t, b, s, stride2_b, stride2_s, stride2_h, stride2_d, nheads2, headdim, BLOCK_H, BLOCK_D)


@triton.jit
def _scatter_one(SRC, DST, r, row, seqlen, stride_b, stride_s, stride_h, stride_d, nheads, headdim,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """DST[r // S, r % S] = SRC[row], or zeros where row < 0, over the program's block of heads."""
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < nheads) & (offs_d[None, :] < headdim)
    src = SRC + (row * nheads + offs_h[:, None]) * headdim + offs_d[None, :]
    values = tl.load(src, mask=mask & (row >= 0), other=0.0)
    b = r // seqlen
    s = r - b * seqlen
    dst = DST + b * stride_b + s * stride_s + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    tl.store(dst, values, mask=mask)


@triton.jit
def scatter_rows_kernel(
    SRC0, DST0, SRC1, DST1, SRC2, DST2,  # SRCi (T, Hi, D) contiguous; DSTi (B, S, Hi, D) any strides
    ROW_OF, seqlen,  # ROW_OF (B * S,) int32: each position's row, -1 at padding
    stride0_b, stride0_s, stride0_h, stride0_d, nheads0,
    stride1_b, stride1_s, stride1_h, stride1_d, nheads1,
    stride2_b, stride2_s, stride2_h, stride2_d, nheads2,
    headdim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """DSTi[b, s] = SRCi[ROW_OF[b * S + s]], or zeros where that is -1: program (b * S + s, head block, i)."""
    r = tl.program_id(0).to(tl.int64)
    which = tl.program_id(2)
    # the row as a (BLOCK_H, 1) column, not a scalar: the interpreter takes a mask built from tensors only
    row = tl.load(ROW_OF + r).to(tl.int64) + tl.zeros([BLOCK_H, 1], tl.int64)
    if which == 0:
        _scatter_one(SRC0, DST0, r, row, seqlen, stride0_b, stride0_s, stride0_h, stride0_d, nheads0, headdim,
                     BLOCK_H, BLOCK_D)
    elif which == 1:
        _scatter_one(SRC1, DST1, r, row, seqlen, stride1_b, stride1_s, stride1_h, stride1_d, nheads1, headdim,
                     BLOCK_H, BLOCK_D)
    else:
        _scatter_one(SRC2, DST2, r, row, seqlen, stride2_b, stride2_s, stride2_h, stride2_d, nheads2, headdim,
                     BLOCK_H, BLOCK_D)
