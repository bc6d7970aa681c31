"""dK/dV at head dim 256 for Hopper (sm_90) in Gluon: dkdv.py's producer and ring, with the two consumer
warpgroups split by role rather than by keys.

At head dim 256 one (64 keys, 256) fp32 accumulator takes 128 registers of each of a warpgroup's threads, so a
warpgroup holds dK or dV, not both (dkdv.py's consumers hold both for their 64 keys). Here a program takes 64 keys,
and per step of 64 queries:

  producer (1 warp):      K, V of the program's keys once; per step Q, dO, LSE and delta into a ring of STAGES
                          (common.dkdv_producer).
  scores consumer (WG 0): Sᵀ = K Qᵀ, Pᵀ = exp2(scores - LSE) with the masks, Pᵀ (times softcap's derivative)
                          into a shared fp32 tile for the other consumer (`p_full` / `p_empty`), dV += Pᵀ dO.
  gradient consumer (WG 1): dPᵀ = V dOᵀ, then dSᵀ = Pᵀ (dPᵀ - delta) from the shared tile, dK += dSᵀ Q.

Each consumer issues two of the step's four matmuls, so the tensor core has work from one while the other runs
its softmax or dS; they meet once a step, at the shared Pᵀ. dQ is the separate pass (dq.py, 32 keys a step).
Scope (`supported`): dense rows of any lengths and varlen batches (a program per (sequence, key block) pair, as in
dkdv.py), bf16/fp16, causal (bottom-right aligned) or no mask, a causal sliding window, softcap, ALiBi slopes, GQA;
no dropout. Queries past seqlen_q get P = 0 from their padded LSE (ops.attn_bwd_impl), keys past seqlen_k are
masked and not stored, as in dkdv.py.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from flashpatch.kernels.config import head_group
from flashpatch.kernels.launch import Record, cdiv, launch, replay
from flashpatch.kernels.options import DEFAULT, KernelOptions
from flashpatch.kernels.sm90.common import (
    alibi_bias, allocate_dkdv_ring, causal_mask_t, descriptor, dkdv_producer, head_slope_log2, key_block_program,
    next_query_step, sm90_dense_ok, softcap_scores, vector_descriptor, window_mask_t)
from flashpatch.kernels.triton.common import alibi_batch_stride

HEADDIM = 256
BLOCK_M = 64  # queries per step
BLOCK_N = 64  # keys per program
STAGES = 2  # Q/dO ring depth: K, V (64 KB) and two stages of Q and dO (128 KB) fill most of the shared memory
MAXNREG = 168  # 12 warps x 168 = the register file; setmaxnreg moves them to the consumers
CONSUMER_REGS = 240  # each consumer's: its accumulator alone is 128
PRODUCER_REGS = 24

LOG2E = gl.constexpr(1.4426950408889634)


# the step's (keys, queries) score tile, the (keys, D) accumulators, and Pᵀ / dSᵀ as their matmuls' register operand
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]))
ACC_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEADDIM, 16]))
A_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT, k_width=2))


@gluon.jit
def _store_rows(ptr, base, stride, acc, key0, seqlen_k, BLOCK_N: gl.constexpr, HEADDIM: gl.constexpr,
                KEY_TAIL: gl.constexpr):
    """The program's (BLOCK_N, D) gradient rows from the accumulator; rows past seqlen_k are not stored."""
    offs_key = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC_LAYOUT))
    offs_d = gl.arange(0, HEADDIM, layout=gl.SliceLayout(0, ACC_LAYOUT))
    ptrs = ptr + base + offs_key[:, None] * stride + offs_d[None, :]
    if KEY_TAIL:
        gl.store(ptrs, acc.to(ptr.dtype.element_ty), mask=(offs_key < seqlen_k)[:, None])
    else:
        gl.store(ptrs, acc.to(ptr.dtype.element_ty))


@gluon.jit
def _scores_consumer(args, ALIBI_SLOPES, CAUSAL: gl.constexpr, KEY_TAIL: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEADDIM: gl.constexpr, STAGES: gl.constexpr, ALIBI: gl.constexpr,
                     SOFTCAP: gl.constexpr, WINDOW: gl.constexpr):
    """Warpgroup 0: per step Pᵀ from the scores, shared with the gradient consumer, and dV += Pᵀ dO."""
    (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ready, empty, kv_bar, p_smem, p_full, p_empty, DK, DV,
     dk_base, stride_dks, dv_base, stride_dvs, alibi_base, n0, shift, seqlen_k, m_lo, m_end, total, qk_scale,
     cap_log2, softmax_scale, window_left) = args
    dtype: gl.constexpr = q_bufs.dtype
    row_layout: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)  # one value per query (column of Sᵀ)
    offs_m = gl.arange(0, BLOCK_M, layout=row_layout)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_LAYOUT))
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, S_LAYOUT)
    dv = gl.zeros([BLOCK_N, HEADDIM], gl.float32, ACC_LAYOUT)
    mbarrier.wait(kv_bar, 0)
    g = 0
    m0 = m_lo
    for i in range(total):
        s = i % STAGES
        alibi_log2 = head_slope_log2(ALIBI_SLOPES, alibi_base + g, ALIBI)  # the step's query head's slope
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        q_s = q_bufs.index(s)  # (BM, D)
        s_t = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # (BN, BM)
        lse_log2 = lse_bufs.index(s).load(row_layout) * LOG2E
        s_t = warpgroup_mma_wait(0, deps=(s_t, ))
        if SOFTCAP:
            scores_t, slope_t = softcap_scores(s_t, qk_scale, cap_log2)  # log2 units; the cap's derivative
        else:
            scores_t = s_t * qk_scale  # log2 units
        if ALIBI:
            scores_t += alibi_bias(alibi_log2, (m0 + shift) + offs_m[None, :], offs_n[:, None])
        p_t = gl.exp2(scores_t - lse_log2[None, :])
        if CAUSAL:  # only the steps that cross the diagonal hide any of the program's keys
            if n0 + BLOCK_N - 1 > m0 + shift:
                p_t = causal_mask_t(p_t, offs_n, offs_m, m0 + shift)
            if WINDOW:  # and the steps whose last query's window starts after the program's first key
                if n0 < m0 + BLOCK_M - 1 + shift - window_left:
                    p_t = window_mask_t(p_t, offs_n, offs_m, m0 + shift - window_left)
        elif KEY_TAIL:
            p_t = gl.where((offs_n < seqlen_k)[:, None], p_t, 0.0)
        # Pᵀ (with the cap's derivative: dS = P (1 - t^2) (dP - delta)) to the gradient consumer; a fresh mbarrier
        # counts as having completed the phase before 0, so the first step does not wait
        mbarrier.wait(p_empty, (i & 1) ^ 1)
        if SOFTCAP:
            p_smem.store(p_t * slope_t)
        else:
            p_smem.store(p_t)
        gl.thread_barrier()  # every thread's part written before the other consumer is told
        mbarrier.arrive(p_full)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), A_LAYOUT), do_bufs.index(s), dv, is_async=True)
        dv = warpgroup_mma_wait(0, deps=(dv, ))
        mbarrier.arrive(empty.index(s))  # this consumer's reads of the stage (Q, dO, LSE) are done
        g, m0 = next_query_step(g, m0, m_lo, m_end, BLOCK_M)
    _store_rows(DV, dv_base, stride_dvs, dv, n0, seqlen_k, BLOCK_N, HEADDIM, KEY_TAIL)


@gluon.jit
def _gradient_consumer(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEADDIM: gl.constexpr,
                       STAGES: gl.constexpr, KEY_TAIL: gl.constexpr):
    """Warpgroup 1: per step dPᵀ = V dOᵀ, dSᵀ from the scores consumer's Pᵀ, and dK += dSᵀ Q."""
    (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ready, empty, kv_bar, p_smem, p_full, p_empty, DK, DV,
     dk_base, stride_dks, dv_base, stride_dvs, alibi_base, n0, shift, seqlen_k, m_lo, m_end, total, qk_scale,
     cap_log2, softmax_scale, window_left) = args
    dtype: gl.constexpr = q_bufs.dtype
    row_layout: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, S_LAYOUT)
    dk = gl.zeros([BLOCK_N, HEADDIM], gl.float32, ACC_LAYOUT)
    mbarrier.wait(kv_bar, 0)
    for i in range(total):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        dp_t = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        delta = delta_bufs.index(s).load(row_layout)
        dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
        mbarrier.wait(p_full, i & 1)
        p_t = p_smem.load(S_LAYOUT)
        gl.thread_barrier()  # every thread's read done before the tile is handed back
        mbarrier.arrive(p_empty)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), A_LAYOUT), q_bufs.index(s), dk, is_async=True)
        dk = warpgroup_mma_wait(0, deps=(dk, ))
        mbarrier.arrive(empty.index(s))  # this consumer's reads of the stage (Q, dO, delta) are done
    _store_rows(DK, dk_base, stride_dks, dk * softmax_scale, n0, seqlen_k, BLOCK_N, HEADDIM, KEY_TAIL)


@gluon.jit
def attn_bwd_dkdv256_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, DK, DV, ALIBI_SLOPES,
    CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS,  # varlen: (batch + 1,) int32 each, ops.varlen_blocks's (2, n)
    q_rows, q_cols, do_rows, do_cols, k_rows, k_cols, v_rows, v_cols,  # see common.rows_view
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_lse_b, stride_lse_h,
    stride_alibi_b, nheads_k, group_size, seqlen_q, seqlen_k, qk_scale, cap_log2, softmax_scale, window_left,
    CAUSAL: gl.constexpr, KEY_TAIL: gl.constexpr, HEADDIM: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HEAD_GROUP: gl.constexpr, ALIBI: gl.constexpr,
    SOFTCAP: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    gl.static_assert(not WINDOW or CAUSAL, "a sliding window runs causal")
    gl.static_assert(KEY_TAIL or not VARLEN, "a varlen sequence's last key block is masked")
    (off_b, off_hk, off_h0, n0, shift, seqlen_q, seqlen_k, m_lo, m_end, total, q_first, do_first, k_first,
     v_first, _, lse_first_row, dk_first, dv_first) = key_block_program(
        VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, q_rows, do_rows, k_rows, v_rows, q_rows, stride_dkb, stride_dks,
        stride_dvb, stride_dvs, stride_lse_b, nheads_k, group_size, seqlen_q, seqlen_k, window_left, CAUSAL, WINDOW,
        VARLEN, HEAD_GROUP, BLOCK_M, BLOCK_N)

    q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ready, empty, kv_bar = allocate_dkdv_ring(
        q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, STAGES, BLOCK_M)
    # the step's Pᵀ from one consumer to the other, in the score layout both hold it in
    p_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(p_full, count=1)
    mbarrier.init(p_empty, count=1)

    lse_base = lse_first_row + off_h0 * stride_lse_h
    consumer_args = (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ready, empty, kv_bar, p_smem, p_full,
                     p_empty, DK, DV, dk_first + off_hk * stride_dkh, stride_dks, dv_first + off_hk * stride_dvh,
                     stride_dvs, off_b * stride_alibi_b + off_h0, n0, shift, seqlen_k, m_lo, m_end, total, qk_scale,
                     cap_log2, softmax_scale, window_left)
    producer_args = (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
                     delta_bufs, k_smem, v_smem, ready, empty, kv_bar,
                     q_first + off_h0 * q_rows[1], q_rows[1], off_h0 * q_cols, q_cols,
                     do_first + off_h0 * do_rows[1], do_rows[1], off_h0 * do_cols, do_cols,
                     k_first + off_hk * k_rows[1] + n0, off_hk * k_cols,
                     v_first + off_hk * v_rows[1] + n0, off_hk * v_cols, lse_base, stride_lse_h,
                     m_lo, m_end, total)
    gl.warp_specialize([
        (_scores_consumer, (consumer_args, ALIBI_SLOPES, CAUSAL, KEY_TAIL, BLOCK_M, BLOCK_N, HEADDIM, STAGES, ALIBI,
                            SOFTCAP, WINDOW)),
        (_gradient_consumer, (consumer_args, BLOCK_M, BLOCK_N, HEADDIM, STAGES, KEY_TAIL)),
        (dkdv_producer, (producer_args, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, varlen: bool,
              max_seqlen_q: int, max_seqlen_k: int, window_left: int, window_right: int, softcap: float,
              dropout_p: float) -> bool:
    """Whether this kernel takes the call (common.sm90_dense_ok at head dim 256): dense rows of any lengths or
    varlen batches, causal or no mask or a causal sliding window, softcap; no dropout."""
    return sm90_dense_ok(q, k, v, dout, varlen=varlen, window_left=window_left, window_right=window_right,
                         softcap=softcap, dropout_p=dropout_p, with_varlen=True, with_window=True,
                         with_softcap=True, headdims=(HEADDIM, ))


def fuses_dq(headdim: int, dropout: bool = False, options: KernelOptions = DEFAULT) -> bool:
    """Whether the kernel can add dQ itself (dkdv.fuses_dq): never; dQ is the separate pass."""
    return False


def attn_bwd_dkdv256(q, k, v, dout, lse, delta, dk, dv, qk_scale: float, softmax_scale: float, causal: bool,
                     alibi_slopes=None, options: KernelOptions = DEFAULT, stream: int | None = None, site=None,
                     window_left: int = -1, cap_log2: float = 0.0, varlen=None) -> None:
    """dK, dV (written into dk, dv) for a call `supported` accepted, as dkdv.attn_bwd_dkdv without its dQ, dropout
    and varlen forms. q, dout: (B, Sq, H, 256); k, v, dk, dv: (B, Sk, Hk, 256); lse, delta: (B, H, >= Sq rounded up
    to BLOCK_M) fp32, LSE (natural log) +inf and delta 0 past Sq; qk_scale: softmax_scale * log2(e), or
    softmax_scale / softcap with cap_log2 = softcap * log2(e) > 0 (ops._scales); alibi_slopes: None or float32 (H,)
    / (B, H); window_left >= 0: a causal sliding window. stream: a raw CUDA stream handle (None: the current one);
    site: launch.launch's.

    varlen: None for dense rows, or (cu_seqlens_q, cu_seqlens_k, blocks) for a varlen batch, as
    dkdv.attn_bwd_dkdv's: q, dout (total_q, H, 256), k, v, dk, dv (total_k, Hk, 256), lse and delta (H, total_q +
    ALIGN x batch) padded per sequence, blocks ops.varlen_blocks's (2, n) (sequence, key block) pairs in blocks of
    BLOCK_N keys. With a site whose launch is recorded (launch.Record, from its second launch), the call is a replay
    (launch.replay) on `stream`."""
    cu_seqlens_q, cu_seqlens_k, blocks = (None, None, None) if varlen is None else varlen
    floats = (qk_scale, cap_log2, softmax_scale)
    if site is not None and replay(attn_bwd_dkdv256_kernel, site, (q, dout, k, v, lse, delta, dk, dv, alibi_slopes,
                                                                   cu_seqlens_q, cu_seqlens_k, blocks), floats, stream):
        return
    if varlen is not None:
        q, k, v, dout, dk, dv = (t.unsqueeze(0) for t in (q, k, v, dout, dk, dv))  # (1, total, H, D)
        lse, delta = lse.unsqueeze(0), delta.unsqueeze(0)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if headdim != HEADDIM:
        raise ValueError(f"attn_bwd_dkdv256 takes head dim {HEADDIM}, got {headdim}")
    if window_left >= 0 and not causal:
        raise ValueError(f"the Gluon dK/dV runs a sliding window only causal, got window_left={window_left}")
    q_desc, q_rows, q_cols = descriptor(q, BLOCK_M)
    do_desc, do_rows, do_cols = descriptor(dout, BLOCK_M)
    k_desc, k_rows, k_cols = descriptor(k, BLOCK_N)
    v_desc, v_rows, v_cols = descriptor(v, BLOCK_N)
    # the kernel addresses both by the LSE's strides: delta is made by empty_like(lse) (ops.attn_bwd_impl)
    assert delta.stride() == lse.stride() and lse.stride(-1) == 1, (lse.stride(), delta.stride())
    lse_desc, delta_desc = vector_descriptor(lse, BLOCK_M), vector_descriptor(delta, BLOCK_M)
    num_n = cdiv(seqlen_k, BLOCK_N)
    grid = (batch * nheads_k * num_n,)
    if varlen is not None:  # the kernel reads each sequence's lengths from cu_seqlens
        grid, seqlen_q, seqlen_k = (nheads_k * blocks.shape[1],), 0, 0
    launch(
        attn_bwd_dkdv256_kernel, grid, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dk, dv, alibi_slopes,
        cu_seqlens_q, cu_seqlens_k, blocks, q_rows, q_cols, do_rows, do_cols, k_rows, k_cols, v_rows, v_cols,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        lse.stride(0), lse.stride(1), alibi_batch_stride(alibi_slopes),
        nheads_k, nheads // nheads_k, seqlen_q, seqlen_k, qk_scale, cap_log2, softmax_scale, max(window_left, 0),
        CAUSAL=causal, KEY_TAIL=varlen is not None or seqlen_k % BLOCK_N != 0, HEADDIM=HEADDIM, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, STAGES=STAGES, HEAD_GROUP=head_group(causal, num_n, q.device, options.head_group),
        ALIBI=alibi_slopes is not None, SOFTCAP=cap_log2 > 0, WINDOW=window_left >= 0, VARLEN=varlen is not None,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=4, maxnreg=MAXNREG, cached_launch=options.cached_launch, on_stream=stream, site=site,
        record=Record(site, (q, dout, k, v, lse, delta, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k, blocks),
                      floats),
    )
