"""Backward kernels. Nothing (seqlen_q, seqlen_k)-sized is ever stored: P is recomputed from the saved LSE.

  preprocess:  delta = rowsum(dO * O)                          one program per (query block, batch * head)
  dK/dV:       one program per (key block, batch * kv head); it loops over the query heads of its GQA group
               and their query blocks, so dK/dV are summed over the group in registers, with no atomics.
               With ATOMIC_DQ it also adds dS K into an fp32 dQ buffer (5 matmuls per tile instead of 7).
  dQ:          one program per (query block, batch * head), used when dQ is not accumulated atomically
               (deterministic mode): it recomputes QKᵀ and dO Vᵀ.

Dropout: P_drop = P * Z / (1 - p) with Z regenerated from the same Philox counters as in forward, and
dS = P * (dP * Z / (1 - p) - delta), delta = rowsum(dO * O) = rowsum(P_drop * dP).
Softcap: scores = c * tanh(x * scale / c), so dS picks up the factor (1 - tanh²).
"""

import triton
import triton.language as tl

from flashpatch.kernels.triton.common import (
    alibi_bias, batch_head_and_block, dropout_head_rows, dropout_keep, dropout_keep_transposed, head_rows_desc,
    key_block_range, load_tile, query_block_program, query_block_range, seq_bounds, tanh, visible)


@triton.jit(do_not_specialize=["max_seqlen_q", "padded_rows", "stride_lse_b", "stride_lse_h", "stride_lse_in_b",
                            "stride_lse_in_h"])
def attn_bwd_preprocess_kernel(
    O, DO, DELTA, LSE, LSE_PADDED, CU_SEQLENS_Q,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lse_b, stride_lse_h,  # DELTA's and LSE_PADDED's
    stride_lse_in_b, stride_lse_in_h,  # LSE's (PAD only)
    nheads, max_seqlen_q, padded_rows,
    HEADDIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
    PAD: tl.constexpr, ALIGN: tl.constexpr,
):
    """delta = rowsum(dO * O) per query row. PAD: also the forward's LSE copied into LSE_PADDED, each sequence's
    rows run on to a multiple of ALIGN with LSE +inf and delta 0, so that a kernel reading whole tiles past seqlen_q
    gets P = 0 there (the Gluon backward kernels). Dense rows run on to padded_rows; a varlen batch's sequence b
    starts at `aligned_start` (its first token + b * ALIGN, rounded down to a multiple of ALIGN), which keeps the
    sequences apart and every start aligned for the Gluon kernels' TMA loads."""
    off_bh = tl.program_id(0)  # batch * heads on axis 0: its limit is 2^31 - 1, axis 1's is 65535
    pid_m = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    q_start, seqlen_q, _, _ = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_Q, off_b, max_seqlen_q, max_seqlen_q, IS_VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEADDIM)
    rows = (q_start + offs_m[:, None])
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + rows * stride_os + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows * stride_dos + offs_d[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if PAD:
        lse = tl.load(LSE + off_b * stride_lse_in_b + off_h * stride_lse_in_h + q_start + offs_m,
                      mask=offs_m < seqlen_q, other=float("inf"))
        if IS_VARLEN:
            row_base = off_h * stride_lse_h + aligned_start(q_start, off_b, ALIGN)
            end = tl.cdiv(seqlen_q, ALIGN) * ALIGN
        else:
            row_base = off_b * stride_lse_b + off_h * stride_lse_h
            end = padded_rows
        tl.store(LSE_PADDED + row_base + offs_m, lse, mask=offs_m < end)
        tl.store(DELTA + row_base + offs_m, delta, mask=offs_m < end)
    else:
        row_base = off_b * stride_lse_b + off_h * stride_lse_h + q_start
        tl.store(DELTA + row_base + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def aligned_start(q_start, seq, ALIGN: tl.constexpr):
    """Where sequence `seq` (first token q_start) starts in a varlen backward's padded LSE and delta:
    (q_start + seq * ALIGN) rounded down to a multiple of ALIGN. Each start is at least the previous one plus its
    length rounded up to ALIGN, so the padded rows never overlap; the rows need the token count + ALIGN x batch."""
    return (q_start + seq * ALIGN) // ALIGN * ALIGN


@triton.jit
def _load_do(do_ptrs, do_desc, stride_dos, start, q_mask, TMA: tl.constexpr, EVEN: tl.constexpr):
    """The (BM, D) tile of dO for the query block at `start` (q_mask: the (D, BM) bounds of Q transposed)."""
    if TMA:
        return do_desc.load([start, 0])
    else:
        return load_tile(do_ptrs + (start + tl.zeros((), dtype=tl.int64)) * stride_dos, tl.trans(q_mask), 0.0, EVEN)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, q_desc, do_desc, dq_desc, lse_ptrs, delta_ptrs,
    stride_qs, stride_dos, stride_dqs,
    offs_n, n_start, offs_d, start_m, end_m, seqlen_q, seqlen_k, window_left, window_right,
    qk_scale, cap_log2, alibi_log2, softmax_scale, seed, offset, drop_head_rows, max_seqlen_k, dropout_p,
    HEADDIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    EVEN: tl.constexpr, DP_FIRST: tl.constexpr,
):
    """Query blocks [start_m, end_m) of one query head into (dk, dv) of this key block.

    Triton leaves a matmul in flight only when the loop reads its result no earlier than the next synchronous
    matmul, so the order of the four matmuls decides what overlaps. By default dV += Pᵀ dO is issued together with
    dPᵀ = V dOᵀ and both are waited for before dS; with DP_FIRST, dPᵀ is computed right after the scores and the
    dV matmul runs while dS is computed, at the price of holding dPᵀ in registers through the softmax (faster for
    the one-warpgroup unmasked tile, more spills for the 64 x 128 one: config.py)."""
    inv_keep = 1.0 / (1.0 - dropout_p)
    zero64 = tl.zeros((), dtype=tl.int64)  # loop offsets times strides in 64 bits
    for start in range(start_m, end_m, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seqlen_q
        q_mask = (offs_m[None, :] < seqlen_q) & (offs_d[:, None] < HEADDIM)
        if TMA:
            q_t = tl.trans(q_desc.load([start, 0]))  # (D, BM)
        else:
            q_t = load_tile(q_ptrs + (start + zero64) * stride_qs, q_mask, 0.0, EVEN)  # (D, BM)
        lse = load_tile(lse_ptrs + start, row_ok, float("inf"), EVEN)  # natural log
        qk_t = tl.dot(k, q_t, input_precision=DOT_PRECISION)  # (BN, BM): scores transposed
        if DP_FIRST:
            do = _load_do(do_ptrs, do_desc, stride_dos, start, q_mask, TMA, EVEN)  # (BM, D)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BN, BM)
        if SOFTCAP:
            t = tanh(qk_t * qk_scale)
            s_t = cap_log2 * t
        else:
            s_t = qk_t * qk_scale
        if ALIBI:
            s_t += alibi_bias(alibi_log2, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k)
        p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)  # (BN, BM), undropped probabilities
        if MASKED:
            ok = visible(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left, window_right,
                         HAS_LEFT, HAS_RIGHT)
            p_t = tl.where(ok, p_t, 0.0)
        if not DP_FIRST:
            do = _load_do(do_ptrs, do_desc, stride_dos, start, q_mask, TMA, EVEN)  # (BM, D)
        if DROPOUT:
            keep_t = dropout_keep_transposed(seed, offset, drop_head_rows + start // 2, n_start, max_seqlen_k,
                                             dropout_p, BLOCK_M, BLOCK_N)  # (BN, BM)
            p_drop_t = tl.where(keep_t, p_t * inv_keep, 0.0)
        else:
            p_drop_t = p_t
        dv += tl.dot(p_drop_t.to(do.dtype), do, input_precision=DOT_PRECISION)  # (BN, D)
        if not DP_FIRST:
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BN, BM)
        if DROPOUT:
            dp_t = tl.where(keep_t, dp_t * inv_keep, 0.0)
        delta = load_tile(delta_ptrs + start, row_ok, 0.0, EVEN)
        ds_t = p_t * (dp_t - delta[None, :])  # gradient w.r.t. the (capped) scores
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t * t)
        ds_t = ds_t.to(q_t.dtype)
        dk += tl.dot(ds_t, tl.trans(q_t), input_precision=DOT_PRECISION)  # (BN, D)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * softmax_scale  # (BM, D)
            if TMA:  # one bulk reduce-add of the tile (rows past seqlen_q dropped)
                dq_desc.atomic_add([start, 0], dq)
            else:
                tl.atomic_add(dq_ptrs + (start + zero64) * stride_dqs, dq, mask=tl.trans(q_mask), sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["max_seqlen_q", "max_seqlen_k", "window_left", "window_right", "stride_lse_b", "stride_lse_h"])
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DQ_ACCUM, DK, DV, SEED_OFFSET, CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS, ALIBI_SLOPES,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    nheads, nheads_k, group_size, max_seqlen_q, max_seqlen_k,
    qk_scale, cap_log2, softmax_scale, dropout_p, window_left, window_right,
    HEADDIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCKS_FASTEST: tl.constexpr, HEAD_GROUP: tl.constexpr, EVEN: tl.constexpr,
    EVEN_INTERIOR: tl.constexpr, DP_FIRST: tl.constexpr,
):
    off_b, off_hk, pid_n = batch_head_and_block(VARLEN_BLOCKS, nheads_k, tl.cdiv(max_seqlen_k, BLOCK_N),
                                                BLOCKS_FASTEST, HEAD_GROUP, IS_VARLEN)
    q_start, seqlen_q, k_start, seqlen_k = seq_bounds(
        CU_SEQLENS_Q, CU_SEQLENS_K, off_b, max_seqlen_q, max_seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEADDIM)
    if TMA:
        k = head_rows_desc(K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_ks, seqlen_k, stride_ks,
                           BLOCK_N, BLOCK_D).load([n0, 0])  # (BN, D)
        v = head_rows_desc(V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vs, seqlen_k, stride_vs,
                           BLOCK_N, BLOCK_D).load([n0, 0])  # (BN, D)
    else:
        k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + (k_start + offs_n[:, None]) * stride_ks
                    + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, D)
        v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + (k_start + offs_n[:, None]) * stride_vs
                    + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, D)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    seed = 0
    offset = 0
    if DROPOUT:
        seed = tl.load(SEED_OFFSET)
        offset = tl.load(SEED_OFFSET + 1)

    lo, full_lo, full_hi, hi = query_block_range(
        n0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # The middle range lies inside the sequence: its loads skip the bounds masks when EVEN_INTERIOR.
    for g in range(0, group_size):
        off_h = off_hk * group_size + g
        q_ptrs = (Q + off_b * stride_qb + off_h * stride_qh
                  + (q_start + offs_m[None, :]) * stride_qs + offs_d[:, None])  # (D, BM): Q transposed
        do_ptrs = (DO + off_b * stride_dob + off_h * stride_doh
                   + (q_start + offs_m[:, None]) * stride_dos + offs_d[None, :])  # (BM, D)
        dq_ptrs = (DQ_ACCUM + off_b * stride_dqb + off_h * stride_dqh
                   + (q_start + offs_m[:, None]) * stride_dqs + offs_d[None, :])  # (BM, D)
        lse_ptrs = LSE + off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m
        delta_ptrs = DELTA + off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m
        drop_head_rows = dropout_head_rows(off_b, nheads, off_h, max_seqlen_q)
        alibi_log2 = 0.0
        if ALIBI:  # this query head's slope
            alibi_log2 = tl.load(ALIBI_SLOPES + off_b * stride_alibi_b + off_h) * 1.4426950408889634
        q_desc = None
        do_desc = None
        dq_desc = None
        if TMA:
            q_desc = head_rows_desc(Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qs, seqlen_q,
                                    stride_qs, BLOCK_M, BLOCK_D)
            do_desc = head_rows_desc(DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_dos, seqlen_q,
                                     stride_dos, BLOCK_M, BLOCK_D)
            if ATOMIC_DQ:
                dq_desc = head_rows_desc(DQ_ACCUM + off_b * stride_dqb + off_h * stride_dqh + q_start * stride_dqs,
                                         seqlen_q, stride_dqs, BLOCK_M, BLOCK_D)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, q_desc, do_desc, dq_desc, lse_ptrs, delta_ptrs,
            stride_qs, stride_dos, stride_dqs,
            offs_n, n0, offs_d, lo, full_lo, seqlen_q, seqlen_k, window_left, window_right,
            qk_scale, cap_log2, alibi_log2, softmax_scale, seed, offset, drop_head_rows, max_seqlen_k, dropout_p,
            HEADDIM, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT, ATOMIC_DQ, DOT_PRECISION,
            TMA, EVEN, DP_FIRST)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, q_desc, do_desc, dq_desc, lse_ptrs, delta_ptrs,
            stride_qs, stride_dos, stride_dqs,
            offs_n, n0, offs_d, full_lo, full_hi, seqlen_q, seqlen_k, window_left, window_right,
            qk_scale, cap_log2, alibi_log2, softmax_scale, seed, offset, drop_head_rows, max_seqlen_k, dropout_p,
            HEADDIM, BLOCK_M, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT, ATOMIC_DQ, DOT_PRECISION,
            TMA, EVEN_INTERIOR, DP_FIRST)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, q_desc, do_desc, dq_desc, lse_ptrs, delta_ptrs,
            stride_qs, stride_dos, stride_dqs,
            offs_n, n0, offs_d, full_hi, hi, seqlen_q, seqlen_k, window_left, window_right,
            qk_scale, cap_log2, alibi_log2, softmax_scale, seed, offset, drop_head_rows, max_seqlen_k, dropout_p,
            HEADDIM, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT, ATOMIC_DQ, DOT_PRECISION,
            TMA, EVEN, DP_FIRST)

    dk = dk * softmax_scale
    if TMA:
        head_rows_desc(DK + off_b * stride_dkb + off_hk * stride_dkh + k_start * stride_dks, seqlen_k, stride_dks,
                       BLOCK_N, BLOCK_D).store([n0, 0], dk.to(DK.dtype.element_ty))
        head_rows_desc(DV + off_b * stride_dvb + off_hk * stride_dvh + k_start * stride_dvs, seqlen_k, stride_dvs,
                       BLOCK_N, BLOCK_D).store([n0, 0], dv.to(DV.dtype.element_ty))
    else:
        tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + (k_start + offs_n[:, None]) * stride_dks
                 + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + (k_start + offs_n[:, None]) * stride_dvs
                 + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(
    dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_ks, stride_vs,
    offs_m, offs_d, start_n, end_n, seqlen_q, seqlen_k, window_left, window_right,
    qk_scale, cap_log2, alibi_log2, seed, offset, drop_rows, max_seqlen_k, dropout_p,
    HEADDIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, EVEN: tl.constexpr,
):
    inv_keep = 1.0 / (1.0 - dropout_p)
    zero64 = tl.zeros((), dtype=tl.int64)  # loop offsets times strides in 64 bits
    for start in range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if TMA:
            k_t = tl.trans(k_desc.load([start, 0]))  # (D, BN)
            v_t = tl.trans(v_desc.load([start, 0]))  # (D, BN)
        else:
            kv_mask = (offs_n[None, :] < seqlen_k) & (offs_d[:, None] < HEADDIM)
            k_t = load_tile(k_ptrs + (start + zero64) * stride_ks, kv_mask, 0.0, EVEN)  # (D, BN)
            v_t = load_tile(v_ptrs + (start + zero64) * stride_vs, kv_mask, 0.0, EVEN)  # (D, BN)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # (BM, BN)
        if SOFTCAP:
            t = tanh(qk * qk_scale)
            s = cap_log2 * t
        else:
            s = qk * qk_scale
        if ALIBI:
            s += alibi_bias(alibi_log2, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k)
        p = tl.exp2(s - lse_log2[:, None])
        if MASKED:
            ok = visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
                         HAS_LEFT, HAS_RIGHT)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)  # (BM, BN)
        if DROPOUT:
            keep = dropout_keep(seed, offset, drop_rows, start, max_seqlen_k, dropout_p, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=DOT_PRECISION)  # (BM, D)
    return dq


@triton.jit(do_not_specialize=["max_seqlen_q", "max_seqlen_k", "window_left", "window_right", "stride_lse_b", "stride_lse_h"])
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, SEED_OFFSET, CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS, ALIBI_SLOPES,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    nheads, group_size, max_seqlen_q, max_seqlen_k,
    qk_scale, cap_log2, softmax_scale, dropout_p, window_left, window_right,
    HEADDIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCKS_FASTEST: tl.constexpr, HEAD_GROUP: tl.constexpr, EVEN: tl.constexpr, EVEN_INTERIOR: tl.constexpr,
):
    off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k, m0 = query_block_program(
        CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS, nheads, group_size, max_seqlen_q, max_seqlen_k, BLOCK_M,
        IS_VARLEN, BLOCKS_FASTEST, HEAD_GROUP)
    if m0 >= seqlen_q:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEADDIM)
    rows = q_start + offs_m[:, None]
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + rows * stride_qs + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows * stride_dos + offs_d[None, :], mask=mask,
                 other=0.0)
    lse = tl.load(LSE + off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m, mask=offs_m < seqlen_q,
                  other=float("inf"))
    delta = tl.load(DELTA + off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m,
                    mask=offs_m < seqlen_q, other=0.0)
    lse_log2 = lse * 1.4426950408889634
    k_ptrs = (K + off_b * stride_kb + off_hk * stride_kh
              + (k_start + offs_n[None, :]) * stride_ks + offs_d[:, None])  # (D, BN)
    v_ptrs = (V + off_b * stride_vb + off_hk * stride_vh
              + (k_start + offs_n[None, :]) * stride_vs + offs_d[:, None])  # (D, BN)
    k_desc = None
    v_desc = None
    if TMA:
        k_desc = head_rows_desc(K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_ks, seqlen_k,
                                stride_ks, BLOCK_N, BLOCK_D)
        v_desc = head_rows_desc(V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vs, seqlen_k,
                                stride_vs, BLOCK_N, BLOCK_D)

    seed = 0
    offset = 0
    if DROPOUT:
        seed = tl.load(SEED_OFFSET)
        offset = tl.load(SEED_OFFSET + 1)
    drop_rows = dropout_head_rows(off_b, nheads, off_h, max_seqlen_q) + m0 // 2  # this query block's counters
    alibi_log2 = 0.0
    if ALIBI:
        alibi_log2 = tl.load(ALIBI_SLOPES + off_b * stride_alibi_b + off_h) * 1.4426950408889634

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_block_range(
        m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dq = _dq_inner(dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_ks, stride_vs, offs_m, offs_d,
                   lo, full_lo, seqlen_q, seqlen_k, window_left, window_right, qk_scale, cap_log2, alibi_log2,
                   seed, offset, drop_rows, max_seqlen_k, dropout_p, HEADDIM, BLOCK_M, BLOCK_N, True, HAS_LEFT,
                   HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT, DOT_PRECISION, TMA, EVEN)
    dq = _dq_inner(dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_ks, stride_vs, offs_m, offs_d,
                   full_lo, full_hi, seqlen_q, seqlen_k, window_left, window_right, qk_scale, cap_log2, alibi_log2,
                   seed, offset, drop_rows, max_seqlen_k, dropout_p, HEADDIM, BLOCK_M, BLOCK_N, False, HAS_LEFT,
                   HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT, DOT_PRECISION, TMA, EVEN_INTERIOR)
    dq = _dq_inner(dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_ks, stride_vs, offs_m, offs_d,
                   full_hi, hi, seqlen_q, seqlen_k, window_left, window_right, qk_scale, cap_log2, alibi_log2,
                   seed, offset, drop_rows, max_seqlen_k, dropout_p, HEADDIM, BLOCK_M, BLOCK_N, True, HAS_LEFT,
                   HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT, DOT_PRECISION, TMA, EVEN)
    dq = dq * softmax_scale
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + rows * stride_dqs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=mask)
