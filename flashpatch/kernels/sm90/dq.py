"""dQ for Hopper (sm_90) in Gluon, warp-specialized like fwd.py and dkdv.py.

  producer (1 warp):     Q and dO of the program's 128 queries once; then, per step, TMA loads of a (BLOCK_N, D)
                         tile of K and one of V into a ring of STAGES buffers, each with its own `ready` mbarrier.
  consumer w (4 warps):  queries [m0 + 64 w, m0 + 64 w + 64): per step S = Q Kᵀ and dP = dO Vᵀ issued together,
                         P = exp2(S - LSE) while dP runs, dS = P (dP - delta), dQ += dS K; the stage is released
                         once dS K is done. With dropout, the keep bits of the step are drawn while the two
                         matmuls run (`dropout_keep_acc`) and dP becomes dP · Z / (1 - p).

Reads the LSE (natural log) and delta = rowsum(dO * O) that the forward and triton/backward.py's preprocess kernel
wrote. Its programs, K/V ring and producer loop are the forward's (common.py). Scope: `supported`, the forward's and
dropout, drawn in the consumers' registers under the step's two matmuls.
A persistent grid (`_persistent_dq`), as the forward's, where config.persistent_grid chooses it (rows of at most 8
query blocks, when dK/dV does not run beside it).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from flashpatch.kernels.config import head_group, persistent_grid, sm_count
from flashpatch.kernels.launch import Record, cdiv, launch, replay
from flashpatch.kernels.options import DEFAULT, KernelOptions
from flashpatch.kernels.sm90.common import (
    alibi_bias, allocate_kv_ring, allocate_query_barriers, descriptor, dropout_seed_offset, head_slope_log2,
    key_limit, persistent_rounds, persistent_tile, philox_wide, producer_persistent, query_block_of_tile,
    query_block_program, sm90_dense_ok, softcap_scores, stream_kv, tma_load, varlen_lse_start,
    varlen_query_block_program, window_keys, window_steps)
from flashpatch.kernels.triton.common import alibi_batch_stride, dropout_head_rows, keep_from_words

HALF_M = 64  # queries per consumer warpgroup
BLOCK_M = 2 * HALF_M  # queries per program
BLOCK_N = 64  # keys per step
# At head dim 256, 32 keys a step: two stages of (32, 256) K and V tiles beside the program's Q and dO (128 KB) fill
# the shared memory (64 keys would take 256 KB), and a consumer's registers hold its (64, 256) fp32 dQ
BLOCK_N_D256 = 32
STAGES = 2  # K/V ring depth
MAXNREG = 168  # 12 warps x 168 = the register file; setmaxnreg moves them to the consumers


@gluon.jit
def dropout_keep_acc(seed, offset, rows0, n0, seqlen_k, dropout_p, like):
    """triton.common.dropout_keep's (BLOCK_M, BLOCK_N) keep tile, bit for bit, in the shape and layout of `like`, a
    wgmma accumulator (rows0 = dropout_head_rows(...) + m0 // 2).

    Each Philox call decides the eight (query, key) pairs that differ in query bit 3 and key bits 0 and 3, and
    in the accumulator layout a thread holds all eight. So the counters are computed per element, the tile is
    reshaped so that those three bits are its last dimensions, and splitting them off leaves one counter per
    call in the thread that needs its outputs; joining the outputs back and undoing the reshape gives the
    accumulator layout again, which `assert_trivial` checks at compile time (no data moves between threads)."""
    BLOCK_M: gl.constexpr = like.shape[0]
    BLOCK_N: gl.constexpr = like.shape[1]
    layout: gl.constexpr = like.type.layout
    groups_per_row = gl.cdiv(seqlen_k, 16) * 4
    i = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    row = (rows0 + (i >> 4) * 8 + (i & 7)).to(gl.int64)  # counter row of query i (bit 3 dropped)
    col = n0 // 4 + (j >> 4) * 4 + ((j >> 1) & 3)  # counter column of key j (bits 0 and 3 dropped)
    counter = offset + row[:, None] * groups_per_row + col[None, :]  # (BM, BN): each counter 8 times
    # (i >> 4, i3, i & 7, j >> 4, j3, (j >> 1) & 3, j0) -> (i >> 4, i & 7, j >> 4, (j >> 1) & 3, j0, j3, i3)
    counter = gl.permute(gl.reshape(counter, [BLOCK_M // 16, 2, 8, BLOCK_N // 16, 2, 4, 2]),
                         [0, 2, 3, 5, 6, 4, 1])
    counter, _ = gl.split(counter)  # i3 = 0
    counter, _ = gl.split(counter)  # j3 = 0
    counter, _ = gl.split(counter)  # j0 = 0: (BM / 16, 8, BN / 16, 4), one counter per call
    r0, r1, r2, r3 = philox_wide(seed, counter)  # triton.common.keep_tile's words, fewer instructions
    keep = keep_from_words(r0, r1, r2, r3, dropout_p, BLOCK_M, BLOCK_N)  # its joins undo the splits and reshape
    return gl.convert_layout(keep, layout, assert_trivial=True)


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, ready_k, ready_v, empty,
                 qdo_bar, q_row, q_col, do_row, do_col, k_row, k_col, v_row, v_col, n_steps,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(qdo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, q_col], qdo_bar, q_smem)
    tma_load(do_desc, [do_row, do_col], qdo_bar, do_smem)
    stream_kv(k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, empty, k_row, k_col, v_row, v_col, n_steps, 0,
              BLOCK_N, STAGES)


@gluon.jit
def _dq_step(i, ring, dq, q_s, do_s, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, lse_log2, delta, offs_m,
             offs_n, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2, seed, offset, drop_rows, seqlen_k,
             dropout_p, MASKED: gl.constexpr, DROPOUT: gl.constexpr, ALIBI: gl.constexpr, SOFTCAP: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WINDOW: gl.constexpr):
    """Key block i into dq, from the ring's slot `ring` (= i but in a persistent program). MASKED: keys past each
    row's key_lim (common.key_limit) hidden, and under a WINDOW the keys before its key_lo (common.window_keys; offs_n
    then counts from the program's first key block, common.window_steps). Rows past seqlen_q have an LSE of +inf
    (ops.attn_bwd_impl pads it), so their P is 0. SOFTCAP (`common.softcap_tanh`): the scores are
    cap_log2 * tanh(qk * qk_scale), and dS takes the cap's derivative 1 - tanh^2, folded into P as soon as P is
    made, so that only P stays live until dP lands."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq.type.layout, k_width=2)
    s = ring % STAGES
    phase = (ring // STAGES) & 1
    k_s = k_bufs.index(s)  # (BLOCK_N, D)
    mbarrier.wait(ready_k.index(s), phase)
    qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # (HALF_M, BLOCK_N)
    mbarrier.wait(ready_v.index(s), phase)
    dp = warpgroup_mma(do_s, v_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if DROPOUT:  # integer work under both matmuls
        keep = dropout_keep_acc(seed, offset, drop_rows, i * BLOCK_N, seqlen_k, dropout_p, zero_s)
    qk = warpgroup_mma_wait(1, deps=(qk, ))
    if SOFTCAP:
        scores, slope = softcap_scores(qk, qk_scale, cap_log2)  # log2 units; the cap's derivative, for dS
    else:
        scores = qk * qk_scale  # log2 units
    if ALIBI:
        scores += alibi_bias(alibi_log2, offs_m[:, None] + shift, (i * BLOCK_N + offs_n)[None, :])
    p = gl.exp2(scores - lse_log2[:, None])
    if MASKED:
        keys = (i * BLOCK_N + offs_n)[None, :]
        if WINDOW:
            p = gl.where((keys <= key_lim[:, None]) & (keys >= key_lo[:, None]), p, 0.0)
        else:
            p = gl.where(keys <= key_lim[:, None], p, 0.0)
    if SOFTCAP:  # dS = P (1 - t^2) (dP - delta): P alone carries on
        p = p * slope
    dp = warpgroup_mma_wait(0, deps=(dp, ))
    if DROPOUT:
        dp = gl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    dq = warpgroup_mma(gl.convert_layout(ds.to(q_s.dtype), a_layout), k_s, dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    mbarrier.arrive(empty.index(s))
    return dq


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_bufs, v_bufs, ready_k, ready_v, empty, qdo_bar, DQ, LSE, DELTA, dq_base,
                 stride_dqs, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2, softmax_scale, alibi_log2,
                 SEED_OFFSET, drop_rows, seqlen_q, seqlen_k, dropout_p, CAUSAL: gl.constexpr, WG: gl.constexpr,
                 HEADDIM: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 DROPOUT: gl.constexpr, ALIBI: gl.constexpr, SOFTCAP: gl.constexpr, window, WINDOW: gl.constexpr):
    """Consumer WG's queries of the program's block. window: (masked left-edge steps, the first key block's first
    key, window_left) of common.window_steps under a WINDOW, else unused."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # (queries, keys)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEADDIM, 16])  # (queries, D)
    q_s = q_smem.slice(WG * HALF_M, HALF_M)  # (HALF_M, D)
    do_s = do_smem.slice(WG * HALF_M, HALF_M)
    offs_m = m0 + WG * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    lse_log2 = gl.load(LSE + lse_base + offs_m) * 1.4426950408889634
    delta = gl.load(DELTA + lse_base + offs_m)
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([HALF_M, HEADDIM], gl.float32, o_layout)
    seed, offset = dropout_seed_offset(SEED_OFFSET, DROPOUT)
    drop_rows = drop_rows + WG * HALF_M // 2  # this warpgroup's first counter row

    key_lim = key_limit(offs_m, shift, seqlen_k, CAUSAL)
    offs_n, key_lo, n_lo = window_keys(offs_m, offs_n, shift, key_lim, window, WINDOW)
    dq = _dq_block(dq, q_s, do_s, qdo_bar, 0, 0, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, lse_log2, delta,
                   offs_m, offs_n, shift, key_lim, key_lo, n_lo, n_full, n_steps, qk_scale, cap_log2, alibi_log2,
                   seed, offset, drop_rows, seqlen_k, dropout_p, DROPOUT, ALIBI, SOFTCAP, BLOCK_N, STAGES, False,
                   WINDOW)
    _dq_store(dq, DQ, dq_base, stride_dqs, m0 + WG * HALF_M, seqlen_q, softmax_scale, q_s.dtype, HEADDIM, HALF_M)


@gluon.jit
def _dq_block(dq, q_s, do_s, qdo_bar, qdo_phase, ring, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, lse_log2,
              delta, offs_m, offs_n, shift, key_lim, key_lo, n_lo, n_full, n_steps, qk_scale, cap_log2, alibi_log2,
              seed, offset, drop_rows, seqlen_k, dropout_p, DROPOUT: gl.constexpr, ALIBI: gl.constexpr,
              SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ONE_LOOP: gl.constexpr,
              WINDOW: gl.constexpr):
    """A consumer warpgroup's query rows offs_m, once their Q and dO have landed (qdo_bar's phase qdo_phase): the
    key blocks below the diagonal without a mask, then the masked ones, from the K/V ring's slot `ring` on;
    returns dq (unscaled) for `_dq_store`. ONE_LOOP: one loop that picks the masked step per block, for the
    persistent kernel (fwd._fwd_block_pipelined says why). Under a WINDOW (not with ONE_LOOP) the n_lo blocks on
    its left edge go first, masked."""
    gl.static_assert(not (WINDOW and ONE_LOOP), "the persistent dQ runs no sliding window")
    mbarrier.wait(qdo_bar, qdo_phase)
    if ONE_LOOP:
        for i in range(0, n_steps):
            if i < n_full:
                dq = _dq_step(i, ring + i, dq, q_s, do_s, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s,
                              lse_log2, delta, offs_m, offs_n, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2,
                              seed, offset, drop_rows, seqlen_k, dropout_p, False, DROPOUT, ALIBI, SOFTCAP, BLOCK_N,
                              STAGES, False)
            else:
                dq = _dq_step(i, ring + i, dq, q_s, do_s, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s,
                              lse_log2, delta, offs_m, offs_n, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2,
                              seed, offset, drop_rows, seqlen_k, dropout_p, True, DROPOUT, ALIBI, SOFTCAP, BLOCK_N,
                              STAGES, False)
    else:
        if WINDOW:
            for i in range(0, n_lo):
                dq = _dq_step(i, ring + i, dq, q_s, do_s, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s,
                              lse_log2, delta, offs_m, offs_n, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2,
                              seed, offset, drop_rows, seqlen_k, dropout_p, True, DROPOUT, ALIBI, SOFTCAP, BLOCK_N,
                              STAGES, WINDOW)
        for i in range(n_lo, n_full):
            dq = _dq_step(i, ring + i, dq, q_s, do_s, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, lse_log2,
                          delta, offs_m, offs_n, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2, seed, offset,
                          drop_rows, seqlen_k, dropout_p, False, DROPOUT, ALIBI, SOFTCAP, BLOCK_N, STAGES, WINDOW)
        for i in range(n_full, n_steps):
            dq = _dq_step(i, ring + i, dq, q_s, do_s, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, lse_log2,
                          delta, offs_m, offs_n, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2, seed, offset,
                          drop_rows, seqlen_k, dropout_p, True, DROPOUT, ALIBI, SOFTCAP, BLOCK_N, STAGES, WINDOW)
    return dq


@gluon.jit
def _dq_store(dq, DQ, dq_base, stride_dqs, row0, seqlen_q, softmax_scale, dtype: gl.constexpr,
              HEADDIM: gl.constexpr, HALF_M: gl.constexpr):
    """dQ = softmax_scale * dq of a warpgroup's HALF_M queries from row0, those before seqlen_q."""
    o_layout: gl.constexpr = dq.type.layout
    rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEADDIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(DQ + dq_base + rows[:, None] * stride_dqs + offs_d[None, :], (dq * softmax_scale).to(dtype),
             mask=(rows < seqlen_q)[:, None])


@gluon.jit
def _dq_consumer_persistent(q_bufs, do_bufs, k_bufs, v_bufs, ready_k, ready_v, empty, qdo_ready, qdo_empty, DQ,
                            LSE, DELTA, SEED_OFFSET, ALIBI_SLOPES, stride_dqb, stride_dqs, stride_dqh,
                            stride_lse_b, stride_lse_h, stride_alibi_b, num_tiles, nheads, group_size, seqlen_q,
                            seqlen_k, qk_scale, cap_log2, softmax_scale, dropout_p, WG: gl.constexpr,
                            CAUSAL: gl.constexpr, HEADDIM: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, HEAD_GROUP: gl.constexpr, DROPOUT: gl.constexpr,
                            ALIBI: gl.constexpr, SOFTCAP: gl.constexpr):
    """`_dq_consumer` over this program's tiles, the producer's order; releases Q and dO (`qdo_empty`) after
    the tile's last step, before its store."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # (queries, keys)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEADDIM, 16])  # (queries, D)
    num_bh = num_tiles // gl.cdiv(seqlen_q, 2 * HALF_M)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    seed, offset = dropout_seed_offset(SEED_OFFSET, DROPOUT)
    ring = 0
    done = 0
    for rnd in range(persistent_rounds(num_tiles, None, 0)):
        tile = persistent_tile(rnd, None, 0)
        if tile < num_tiles:
            off_b, off_h, off_hk, m0, shift, n_full, n_steps = query_block_of_tile(
                tile, num_bh, seqlen_q, seqlen_k, nheads, group_size, CAUSAL, 2 * HALF_M, BLOCK_N, HEAD_GROUP)
            lse_base = off_b * stride_lse_b + off_h * stride_lse_h
            offs_m = m0 + WG * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
            key_lim = key_limit(offs_m, shift, seqlen_k, CAUSAL)
            lse_log2 = gl.load(LSE + lse_base + offs_m) * 1.4426950408889634
            delta = gl.load(DELTA + lse_base + offs_m)
            alibi_log2 = head_slope_log2(ALIBI_SLOPES, off_b * stride_alibi_b + off_h, ALIBI)
            # this warpgroup's first dropout counter row (the kernel's drop_rows + WG * HALF_M // 2)
            drop_rows = dropout_head_rows(off_b, nheads, off_h, seqlen_q) + (m0 + WG * HALF_M) // 2
            qb = done % 2
            q_s = q_bufs.index(qb).slice(WG * HALF_M, HALF_M)  # (HALF_M, D)
            do_s = do_bufs.index(qb).slice(WG * HALF_M, HALF_M)
            dq = gl.zeros([HALF_M, HEADDIM], gl.float32, o_layout)
            dq = _dq_block(dq, q_s, do_s, qdo_ready.index(qb), (done // 2) & 1, ring, k_bufs, v_bufs, ready_k,
                           ready_v, empty, zero_s, lse_log2, delta, offs_m, offs_n, shift, key_lim, key_lim, 0,
                           n_full, n_steps, qk_scale, cap_log2, alibi_log2, seed, offset, drop_rows, seqlen_k,
                           dropout_p, DROPOUT, ALIBI, SOFTCAP, BLOCK_N, STAGES, True, False)
            mbarrier.arrive(qdo_empty.index(qb))
            _dq_store(dq, DQ, off_b * stride_dqb + off_h * stride_dqh, stride_dqs, m0 + WG * HALF_M, seqlen_q,
                      softmax_scale, q_s.dtype, HEADDIM, HALF_M)
            ring += n_steps
            done += 1


@gluon.jit
def _persistent_dq(q_desc, do_desc, k_desc, v_desc, DQ, LSE, DELTA, SEED_OFFSET, ALIBI_SLOPES, q_rows, q_cols,
                   do_rows, do_cols, k_rows, k_cols, v_rows, v_cols, stride_dqb, stride_dqs, stride_dqh,
                   stride_lse_b, stride_lse_h, stride_alibi_b, num_tiles, nheads, group_size, seqlen_q,
                   seqlen_k, qk_scale, cap_log2, softmax_scale, dropout_p, CAUSAL: gl.constexpr, HEADDIM: gl.constexpr,
                   HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HEAD_GROUP: gl.constexpr,
                   DROPOUT: gl.constexpr, ALIBI: gl.constexpr, SOFTCAP: gl.constexpr):
    """The PERSISTENT kernel body: two buffers of Q and dO, the K/V ring, the three partitions looping over
    the program's tiles."""
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    k_bufs, v_bufs, ready_k, ready_v, empty = allocate_kv_ring(k_desc, v_desc, STAGES, 2)
    qdo_ready, qdo_empty = allocate_query_barriers()
    fence_async_shared()
    gl.warp_specialize([
        (_dq_consumer_persistent, (q_bufs, do_bufs, k_bufs, v_bufs, ready_k, ready_v, empty, qdo_ready,
                                   qdo_empty, DQ, LSE, DELTA, SEED_OFFSET, ALIBI_SLOPES, stride_dqb, stride_dqs,
                                   stride_dqh, stride_lse_b, stride_lse_h, stride_alibi_b, num_tiles, nheads,
                                   group_size, seqlen_q, seqlen_k, qk_scale, cap_log2, softmax_scale, dropout_p, 0,
                                   CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES, HEAD_GROUP, DROPOUT, ALIBI, SOFTCAP)),
        (_dq_consumer_persistent, (q_bufs, do_bufs, k_bufs, v_bufs, ready_k, ready_v, empty, qdo_ready,
                                   qdo_empty, DQ, LSE, DELTA, SEED_OFFSET, ALIBI_SLOPES, stride_dqb, stride_dqs,
                                   stride_dqh, stride_lse_b, stride_lse_h, stride_alibi_b, num_tiles, nheads,
                                   group_size, seqlen_q, seqlen_k, qk_scale, cap_log2, softmax_scale, dropout_p, 1,
                                   CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES, HEAD_GROUP, DROPOUT, ALIBI, SOFTCAP)),
        (producer_persistent, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, ready_k,
                               ready_v, empty, qdo_ready, qdo_empty, q_rows, q_cols, do_rows, do_cols,
                               k_rows, k_cols, v_rows, v_cols, num_tiles, nheads, group_size, seqlen_q,
                               seqlen_k, None, 0, CAUSAL, 2 * HALF_M, BLOCK_N, STAGES, HEAD_GROUP)),
    ], [4, 1], [232, 24])


@gluon.jit
def attn_bwd_dq_hopper_kernel(
    q_desc, do_desc, k_desc, v_desc, DQ, LSE, DELTA, SEED_OFFSET, ALIBI_SLOPES,
    CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS,  # varlen: (batch + 1,) int32 each, ops.varlen_blocks's (2, n)
    q_rows, q_cols, do_rows, do_cols, k_rows, k_cols, v_rows, v_cols,  # (per batch, per head) of each view
    stride_dqb, stride_dqs, stride_dqh, stride_lse_b, stride_lse_h, stride_alibi_b,
    num_tiles, nheads, group_size, seqlen_q, seqlen_k, qk_scale, cap_log2, softmax_scale, dropout_p, window_left,
    CAUSAL: gl.constexpr, HEADDIM: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HEAD_GROUP: gl.constexpr, DROPOUT: gl.constexpr, ALIBI: gl.constexpr, SOFTCAP: gl.constexpr,
    PERSISTENT: gl.constexpr, VARLEN: gl.constexpr, WINDOW: gl.constexpr,
):
    # WINDOW: a causal sliding window of window_left keys (common.window_steps), on the grid of one program per block
    gl.static_assert(not WINDOW or (CAUSAL and not PERSISTENT and not DROPOUT),
                     "a sliding window runs causal, one program per block, without dropout")
    if PERSISTENT:  # num_tiles: batch x heads x query blocks, which the programs take in turn
        _persistent_dq(q_desc, do_desc, k_desc, v_desc, DQ, LSE, DELTA, SEED_OFFSET, ALIBI_SLOPES, q_rows, q_cols,
                       do_rows, do_cols, k_rows, k_cols, v_rows, v_cols, stride_dqb, stride_dqs, stride_dqh,
                       stride_lse_b, stride_lse_h, stride_alibi_b, num_tiles, nheads, group_size, seqlen_q,
                       seqlen_k, qk_scale, cap_log2, softmax_scale, dropout_p, CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES,
                       HEAD_GROUP, DROPOUT, ALIBI, SOFTCAP)
        return
    if VARLEN:  # the views' rows are the packed tokens: a sequence starts at its cu_seqlens entry
        gl.static_assert(not DROPOUT, "the varlen form draws no dropout")
        off_b, off_h, off_hk, m0, shift, n_full, n_steps, q_first, k_first, seqlen_q, seqlen_k = (
            varlen_query_block_program(VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, nheads, group_size, CAUSAL,
                                       2 * HALF_M, BLOCK_N))
        do_first = q_first
        v_first = k_first
        dq_base = q_first * stride_dqs + off_h * stride_dqh
        lse_base = off_h * stride_lse_h + varlen_lse_start(q_first, off_b)
    else:
        off_b, off_h, off_hk, m0, shift, n_full, n_steps = query_block_program(
            seqlen_q, seqlen_k, nheads, group_size, CAUSAL, 2 * HALF_M, BLOCK_N, HEAD_GROUP)
        q_first = off_b * q_rows[0]
        do_first = off_b * do_rows[0]
        k_first = off_b * k_rows[0]
        v_first = off_b * v_rows[0]
        dq_base = off_b * stride_dqb + off_h * stride_dqh
        lse_base = off_b * stride_lse_b + off_h * stride_lse_h
    window = 0
    if WINDOW:  # the key blocks from the first one the block's first row sees: the K/V stream starts there
        n_first, n_lo, n_full, n_steps = window_steps(m0, shift, n_full, n_steps, window_left, 2 * HALF_M, BLOCK_N,
                                                      WINDOW)
        k_first += n_first * BLOCK_N
        v_first += n_first * BLOCK_N
        window = (n_lo, n_first * BLOCK_N, window_left)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, do_desc.block_type.shape, do_desc.layout)
    k_bufs, v_bufs, ready_k, ready_v, empty = allocate_kv_ring(k_desc, v_desc, STAGES, 2)
    qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qdo_bar, count=1)
    fence_async_shared()

    drop_rows = dropout_head_rows(off_b, nheads, off_h, seqlen_q) + m0 // 2
    alibi_log2 = head_slope_log2(ALIBI_SLOPES, off_b * stride_alibi_b + off_h, ALIBI)
    gl.warp_specialize([
        (_dq_consumer, (q_smem, do_smem, k_bufs, v_bufs, ready_k, ready_v, empty, qdo_bar, DQ, LSE, DELTA,
                        dq_base, stride_dqs, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2, softmax_scale,
                        alibi_log2, SEED_OFFSET, drop_rows, seqlen_q, seqlen_k, dropout_p, CAUSAL, 0, HEADDIM,
                        HALF_M, BLOCK_N, STAGES, DROPOUT, ALIBI, SOFTCAP, window, WINDOW)),
        (_dq_consumer, (q_smem, do_smem, k_bufs, v_bufs, ready_k, ready_v, empty, qdo_bar, DQ, LSE, DELTA,
                        dq_base, stride_dqs, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2, softmax_scale,
                        alibi_log2, SEED_OFFSET, drop_rows, seqlen_q, seqlen_k, dropout_p, CAUSAL, 1, HEADDIM,
                        HALF_M, BLOCK_N, STAGES, DROPOUT, ALIBI, SOFTCAP, window, WINDOW)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, ready_k, ready_v,
                        empty, qdo_bar,
                        q_first + off_h * q_rows[1] + m0, off_h * q_cols,
                        do_first + off_h * do_rows[1] + m0, off_h * do_cols,
                        k_first + off_hk * k_rows[1], off_hk * k_cols,
                        v_first + off_hk * v_rows[1], off_hk * v_cols,
                        n_steps, BLOCK_N, STAGES)),
    ], [4, 1], [232, 24])


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, varlen: bool,
              max_seqlen_q: int, max_seqlen_k: int, window_left: int, window_right: int, softcap: float,
              dropout_p: float) -> bool:
    """common.sm90_dense_ok, with dropout on dense rows, any lengths, varlen batches without dropout, softcap (the
    forward's bounds: fwd.supported); at head dim 256 no dropout (beside dkdv256.py's dK/dV)."""
    if q.shape[-1] == 256:
        return sm90_dense_ok(q, k, v, dout, varlen=varlen, window_left=window_left, window_right=window_right,
                             softcap=softcap, dropout_p=dropout_p, with_varlen=True, with_window=True,
                             with_softcap=True, headdims=(256, ))
    return sm90_dense_ok(q, k, v, dout, varlen=varlen, window_left=window_left, window_right=window_right,
                         softcap=softcap, dropout_p=dropout_p, with_dropout=not varlen, with_varlen=True,
                         with_window=True, with_softcap=True)


def attn_bwd_dq(q, k, v, dout, lse, delta, dq, qk_scale: float, softmax_scale: float, causal: bool,
                seed_offset=None, dropout_p: float = 0.0, alibi_slopes=None, beside_dkdv: bool = False,
                options: KernelOptions = DEFAULT, varlen=None, site=None, window_left: int = -1,
                cap_log2: float = 0.0) -> None:
    """dQ (written into dq, (B, Sq, H, D)) for a call `supported` accepted; lse, delta: (B, H, >= Sq rounded up to
    BLOCK_M) fp32, LSE +inf and delta 0 past Sq (ops.attn_bwd_impl);
    seed_offset: the forward's (2,) int64 (ops.draw_seed_offset) when dropout_p > 0; alibi_slopes: None or float32
    (H,) / (B, H); beside_dkdv: the dK/dV kernel runs at the same time on another stream (config.persistent_grid);
    options: its persistent_dq, head_group and cached_launch. site: launch.launch's, passed on. window_left >= 0: a
    causal sliding window (fwd.attn_fwd's), one program per query block, no dropout. cap_log2 > 0: softcap
    (fwd.attn_fwd's).

    varlen: None for dense rows, or (cu_seqlens_q, cu_seqlens_k, blocks) for a varlen batch (no dropout): q, dout,
    dq (total_q, H, D), k, v (total_k, Hk, D), lse and delta (H, total_q + ALIGN x batch) padded per sequence as
    dkdv.attn_bwd_dkdv's, blocks ops.varlen_blocks's (2, n) table of (sequence, query block) pairs in blocks of
    BLOCK_M queries. One program per head and pair. With a site whose launch is recorded (launch.Record, from
    its second launch), the call is a replay (launch.replay)."""
    cu_seqlens_q, cu_seqlens_k, blocks = (None, None, None) if varlen is None else varlen
    floats = (qk_scale, cap_log2, softmax_scale, dropout_p)
    if site is not None and replay(attn_bwd_dq_hopper_kernel, site, (q, dout, k, v, dq, lse, delta, seed_offset,
                                                                     alibi_slopes, cu_seqlens_q, cu_seqlens_k, blocks),
                                   floats):
        return
    if varlen is not None:
        if dropout_p > 0:
            raise ValueError(f"the Gluon dQ draws no dropout on varlen batches, got dropout_p={dropout_p}")
        q, k, v, dout, dq = (t.unsqueeze(0) for t in (q, k, v, dout, dq))  # (1, total, H, D)
        lse, delta = lse.unsqueeze(0), delta.unsqueeze(0)
    window = window_left >= 0
    if window and (dropout_p > 0 or not causal):
        raise ValueError(f"the Gluon dQ runs a sliding window only causal and without dropout, got "
                         f"window_left={window_left}, causal={causal}, dropout_p={dropout_p}")
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if headdim == 256 and dropout_p > 0:
        raise ValueError(f"the Gluon dQ at head dim 256 draws no dropout, got dropout_p={dropout_p}")
    block_n = BLOCK_N_D256 if headdim == 256 else BLOCK_N
    q_desc, q_rows, q_cols = descriptor(q, BLOCK_M)
    do_desc, do_rows, do_cols = descriptor(dout, BLOCK_M)
    k_desc, k_rows, k_cols = descriptor(k, block_n)
    v_desc, v_rows, v_cols = descriptor(v, block_n)
    num_tiles = batch * nheads * cdiv(seqlen_q, BLOCK_M)
    num_m = cdiv(seqlen_q, BLOCK_M)
    order = head_group(causal, num_m, q.device, options.head_group)
    persistent = options.persistent_dq
    if persistent is None:
        persistent = persistent_grid("dq", num_m, headdim, beside_dkdv)
    persistent = persistent and not window and headdim <= 128  # two (128, 256) query buffers would not fit
    if varlen is not None:  # the kernel reads each sequence's lengths from cu_seqlens
        grid, persistent, order, seqlen_q, seqlen_k = (nheads * blocks.shape[1],), False, 1, 0, 0
        num_tiles = grid[0]
    elif persistent:  # as fwd.attn_fwd's
        grid = (min(num_tiles, sm_count(q.device)),)
        order = 0 if causal else order
    else:
        grid = (num_tiles,)
    launch(
        attn_bwd_dq_hopper_kernel, grid, q_desc, do_desc, k_desc, v_desc, dq, lse, delta, seed_offset, alibi_slopes,
        cu_seqlens_q, cu_seqlens_k, blocks,
        q_rows, q_cols, do_rows, do_cols, k_rows, k_cols, v_rows, v_cols,
        dq.stride(0), dq.stride(1), dq.stride(2), lse.stride(0), lse.stride(1), alibi_batch_stride(alibi_slopes),
        num_tiles, nheads, nheads // nheads_k, seqlen_q, seqlen_k, qk_scale, cap_log2, softmax_scale, dropout_p,
        max(window_left, 0), CAUSAL=causal, HEADDIM=headdim, HALF_M=HALF_M, BLOCK_N=block_n, STAGES=STAGES,
        HEAD_GROUP=order, DROPOUT=dropout_p > 0, ALIBI=alibi_slopes is not None,
        SOFTCAP=cap_log2 > 0, PERSISTENT=persistent,
        VARLEN=varlen is not None, WINDOW=window,
        num_warps=4, maxnreg=MAXNREG, cached_launch=options.cached_launch, site=site,
        record=Record(site, (q, dout, k, v, dq, lse, delta, seed_offset, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                             blocks), floats),
    )
