"""Forward kernel (FlashAttention-2 loop order).

One program owns BLOCK_M query rows of one (batch, head) and streams K/V blocks through an online softmax kept
in base 2: scores are scaled by softmax_scale * log2(e) once, so the inner loop uses exp2 only. It writes the
output and the row's log-sum-exp in natural-log units (flash-attn's convention; +inf for rows that see no key),
which the backward uses to recompute P without storing it.
"""

import triton
import triton.language as tl

from flashpatch.kernels.triton.common import (
    alibi_bias, dropout_head_rows, dropout_keep, head_rows_desc, key_block_range, load_tile, query_block_program, tanh,
    visible)


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_ks, stride_vs,
    offs_m, offs_d, start_n, end_n, seqlen_q, seqlen_k, window_left, window_right,
    qk_scale, cap_log2, alibi_log2, seed, offset, drop_rows, max_seqlen_k, dropout_p,
    HEADDIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, EVEN: tl.constexpr,
    FOLD: tl.constexpr,
):
    zero64 = tl.zeros((), dtype=tl.int64)  # loop offsets times strides in 64 bits
    for start in range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if TMA:  # rows past seqlen_k arrive as zeros
            k_t = tl.trans(k_desc.load([start, 0]))  # (D, BN)
        else:
            kv_mask = (offs_n[None, :] < seqlen_k) & (offs_d[:, None] < HEADDIM)
            k_t = load_tile(k_ptrs + (start + zero64) * stride_ks, kv_mask, 0.0, EVEN)  # (D, BN)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # (BM, BN), fp32
        if FOLD and not SOFTCAP and not ALIBI:  # the max over the raw scores, the scale inside exp2's argument
            s = qk
            scale = qk_scale
        else:
            if SOFTCAP:
                s = cap_log2 * tanh(qk * qk_scale)  # log2 units
            else:
                s = qk * qk_scale
            if ALIBI:
                s += alibi_bias(alibi_log2, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k)
            scale = 1.0
        if MASKED:
            ok = visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
                         HAS_LEFT, HAS_RIGHT)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)  # with FOLD: qk_scale >= 0 (validation) keeps the max
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
        p = tl.exp2(s * scale - m_safe[:, None])  # with FOLD: one fused multiply-add per score
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)  # normalizer of the undropped softmax
        if DROPOUT:
            keep = dropout_keep(seed, offset, drop_rows, start, max_seqlen_k, dropout_p, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        if TMA:
            v = v_desc.load([start, 0])  # (BN, D)
        else:
            v = load_tile(v_ptrs + (start + zero64) * stride_vs, tl.trans(kv_mask), 0.0, EVEN)  # (BN, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["max_seqlen_q", "max_seqlen_k", "window_left", "window_right", "stride_lse_b", "stride_lse_h"])
def attn_fwd_kernel(
    Q, K, V, O, LSE, SEED_OFFSET, CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS, ALIBI_SLOPES,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    nheads, group_size, max_seqlen_q, max_seqlen_k,
    qk_scale, cap_log2, dropout_p, window_left, window_right,
    HEADDIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCKS_FASTEST: tl.constexpr, HEAD_GROUP: tl.constexpr, EVEN: tl.constexpr,
    EVEN_INTERIOR: tl.constexpr, FOLD: tl.constexpr,
):
    off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k, m0 = query_block_program(
        CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS, nheads, group_size, max_seqlen_q, max_seqlen_k, BLOCK_M,
        IS_VARLEN, BLOCKS_FASTEST, HEAD_GROUP)
    if m0 >= seqlen_q:  # varlen: an entry of the grid past the last block
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)  # BLOCK_D = next power of two >= HEADDIM; the tail is masked, not copied
    q_ptrs = (Q + off_b * stride_qb + off_h * stride_qh
              + (q_start + offs_m[:, None]) * stride_qs + offs_d[None, :])
    row_mask = offs_m[:, None] < seqlen_q
    k_desc = None
    v_desc = None
    if TMA:  # host checked: HEADDIM == BLOCK_D, 16-byte aligned rows and heads
        k_desc = head_rows_desc(K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_ks, seqlen_k,
                                stride_ks, BLOCK_N, BLOCK_D)
        v_desc = head_rows_desc(V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vs, seqlen_k,
                                stride_vs, BLOCK_N, BLOCK_D)
        q = head_rows_desc(Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qs, seqlen_q,
                           stride_qs, BLOCK_M, BLOCK_D).load([m0, 0])  # (BM, D)
    else:
        q = tl.load(q_ptrs, mask=row_mask & (offs_d[None, :] < HEADDIM), other=0.0)  # (BM, D)
    k_ptrs = (K + off_b * stride_kb + off_hk * stride_kh
              + (k_start + offs_n[None, :]) * stride_ks + offs_d[:, None])  # (D, BN): K transposed
    v_ptrs = (V + off_b * stride_vb + off_hk * stride_vh
              + (k_start + offs_n[:, None]) * stride_vs + offs_d[None, :])  # (BN, D)

    seed = 0
    offset = 0
    if DROPOUT:
        seed = tl.load(SEED_OFFSET)
        offset = tl.load(SEED_OFFSET + 1)
    drop_rows = dropout_head_rows(off_b, nheads, off_h, max_seqlen_q) + m0 // 2  # this query block's counters
    alibi_log2 = 0.0
    if ALIBI:  # the head's slope; (nheads,) slopes have batch stride 0
        alibi_log2 = tl.load(ALIBI_SLOPES + off_b * stride_alibi_b + off_h) * 1.4426950408889634

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_block_range(
        m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # Blocks that straddle a mask edge pay for the mask; the rest run unmasked. Those lie inside the sequence
    # (key_block_range), so their loads skip the bounds masks too (EVEN_INTERIOR) where only the last block of a
    # ragged or varlen sequence needs them.
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_ks, stride_vs, offs_m, offs_d, lo, full_lo,
        seqlen_q, seqlen_k, window_left, window_right, qk_scale, cap_log2, alibi_log2, seed, offset, drop_rows,
        max_seqlen_k, dropout_p, HEADDIM, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT,
        DOT_PRECISION, TMA, EVEN, FOLD)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_ks, stride_vs, offs_m, offs_d, full_lo, full_hi,
        seqlen_q, seqlen_k, window_left, window_right, qk_scale, cap_log2, alibi_log2, seed, offset, drop_rows,
        max_seqlen_k, dropout_p, HEADDIM, BLOCK_M, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT,
        DOT_PRECISION, TMA, EVEN_INTERIOR, FOLD)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_ks, stride_vs, offs_m, offs_d, full_hi, hi,
        seqlen_q, seqlen_k, window_left, window_right, qk_scale, cap_log2, alibi_log2, seed, offset, drop_rows,
        max_seqlen_k, dropout_p, HEADDIM, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT,
        DOT_PRECISION, TMA, EVEN, FOLD)

    empty = l_i == 0.0  # the row sees no key: output 0, LSE +inf (so backward recomputes P = 0)
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DROPOUT:
        acc = acc * (1.0 / (1.0 - dropout_p))
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)

    o_ptrs = (O + off_b * stride_ob + off_h * stride_oh
              + (q_start + offs_m[:, None]) * stride_os + offs_d[None, :])
    if TMA:  # rows past seqlen_q are not written
        head_rows_desc(O + off_b * stride_ob + off_h * stride_oh + q_start * stride_os, seqlen_q, stride_os,
                       BLOCK_M, BLOCK_D).store([m0, 0], acc.to(O.dtype.element_ty))
    else:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_mask & (offs_d[None, :] < HEADDIM))
    lse_ptrs = LSE + off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m
    tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)
