"""dK/dV for Hopper (sm_90) written in Gluon, with warp specialization: one producer warp and two consumer
warpgroups per program, synchronised by mbarriers instead of CTA-wide barriers.

Why: the Triton dK/dV kernel's pipelined loop has two CTA barriers per step (after the copy wait, before a stage is
refilled), which keep its two warpgroups in lockstep, so neither fills the other's softmax gaps with matmuls
(nearly half of its issue gaps are barrier waits). Triton 3.6 does not warp-specialize that loop. Here:

  producer (1 warp):     K, V of the program's 128 keys once; then, per step, TMA loads of the (64, D) tiles of Q
                         and dO and of the step's 64 LSE and delta values into a ring of STAGES buffers, each
                         signalled by its `ready` mbarrier.
  consumer w (4 warps):  keys [n0 + 64 w, n0 + 64 w + 64): per step, Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued together,
                         P from Sᵀ while dPᵀ runs, dV += Pᵀ dO issued, dS from dPᵀ while dV runs, dK += dSᵀ Q;
                         dV and dK are waited for at the end of the step, and the stage is released (`empty`,
                         one arrival per consumer) once the next step's Sᵀ is done.

With an fp32 dQ buffer (`fuses_dq`; ops.py passes one where config's `fused_dq` holds) the kernel adds dQ itself, so
the backward runs five matmuls per tile instead of the separate dQ pass's seven (FA3's form): after
issuing dK's matmul, each consumer stores its dS into the step's shared (BM, 128) tile, waits for the other's
(`ds_full`, the one place the two consumers meet), and multiplies the whole tile by its half of K's columns into a
(BM, D / 2) fp32 partial, which it leaves in the step's dQ slot; and a fourth partition does the reduce:

  reducer (1 warp):      per step, once both halves are in the slot, TMA reduce-adds of the (BM, D) partial into
                         the fp32 dQ; the slot is handed back (`dq_empty`) once those reduces have read it.

LSE and delta come through the ring rather than by loads of the consumers: loaded at the top of a step, they were
needed before the step's first matmul could be issued, and every step waited for them (a tenth of Nsight Compute's
stall samples sat at the multiply that scales the LSE). Where in the step the consumers
read them from shared memory depends on the head dim (`lse_first`: at 128, apart, to keep the registers from
spilling).

Without the fused dQ the two consumers never wait for each other, only for the producer, so one's softmax runs under
the other's matmuls (the Triton kernel's CTA barriers forbid that); with it they meet once a step, after both
softmaxes. dK and dV are waited for at the end of each step: leaving them in flight into the next made ptxas
serialize the matmuls (warning C7515) and measured slower (docs/tuning.md, "Gluon dK/dV").

With dropout the keep bits come from warps of their own, so that the Philox arithmetic runs beside
the consumers' matmuls and softmax rather than inside them:

  drawer w (2 warps):    per step, the Philox calls of consumer w's (64 keys, 64 queries) tile, at the counters of
                         triton.common.dropout_keep (the forward's bits), packed into one 32-bit word per consumer
                         thread and written into a ring of STAGES slots (one with the fused dQ, whose shared memory is
                         otherwise full; `keep_full` / `keep_empty`); the consumer turns its word into the keep tile
                         of its registers (`_keep_tile`), and its causal mask comes from lane and register bits
                         (`_visible_tile`). The kernel then runs 16 warps. With the fused dQ, the dS it multiplies
                         already carries the keep bits, so a backward draws them once.

The steps run over the query heads of the program's GQA group and, within a head, over the query blocks that see
the program's keys. Scope, checked by `supported`: dense rows of any lengths (a last key block's keys past seqlen_k
are masked, `_step`'s MASK 3, and not stored; a last query block's rows past seqlen_q have P = 0 from their padded
LSE) and varlen batches without dropout (a program per (sequence, key block) pair; the packed rows are the TMA
views' rows, and each sequence's LSE and delta rows are padded the same way, from an aligned start), bf16/fp16,
head dim 64 or 128, causal (bottom-right aligned) or no mask, ALiBi slopes or none (each step takes its query head's
slope), dropout on dense rows, no window or softcap. Everything else, and every machine that is not
sm_90 with Gluon, keeps the Triton kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from flashpatch.kernels.config import head_group
from flashpatch.kernels.launch import Record, cdiv, launch, replay
from flashpatch.kernels.options import DEFAULT, KernelOptions
from flashpatch.kernels.sm90.common import (
    TMA_REDUCE, alibi_bias, allocate_dkdv_ring, allocate_keep_ring, carry_addend, carry_shift_in_ptx, causal_mask_t,
    descriptor, dkdv_producer, drop_pairs, dropout_seed_offset, fp32_descriptor, head_slope_log2, kept_dims,
    key_block_program, next_query_step, philox_wide, sm90_dense_ok, softcap_scores, store_tile_by_tma,
    tma_reduce_add, vector_descriptor, window_mask_t)
from flashpatch.kernels.triton.common import alibi_batch_stride, dropout_head_rows

BLOCK_M = {64: 64, 128: 64}  # queries per step, by head dim
HALF_N = 64  # keys per consumer warpgroup
BLOCK_N = 2 * HALF_N  # keys per program
STAGES = 2  # Q/dO ring depth (3 within noise)
MAXNREG = 168  # 12 warps x 168 = the register file; setmaxnreg moves them to the consumers
PRODUCER_REGISTERS = 24  # the producer warp's setmaxnreg count (its warpgroup's; the least setmaxnreg takes)
# With dropout two drawer partitions of two warps each (`_keep_drawer`) join the producer warp: 13 warps, launched
# as 16 (four warpgroups) of MAXNREG_DROPOUT registers; the producer's and the drawers' warpgroups take
# DRAWER_REGISTERS each, the consumers the rest.
MAXNREG_DROPOUT = 128
DRAWER_REGISTERS = 24


LOG2E = gl.constexpr(1.4426950408889634)


# Dropout. A consumer's step tile is (HALF_N, BLOCK_M) = (64 keys, 64 queries), and in the wgmma accumulator
# layout a thread holds 32 of its scores: key bit 3 and query bits 0, 3, 4, 5 vary over its registers, the other
# bits are its lane and warp. Its keep decisions travel from the consumer's drawer partition (`_keep_drawer`) as
# one 32-bit word per consumer thread; decision (key bit 3, query bit 0, query >> 3) is that word's bit
#     4 * call + output word = 4 * (query bit 0 + 2 * (query >> 4)) + 2 * query bit 3 + key bit 3,
# the order in which the drawer shifts them in (`_shift_in_call`).
# The word tile is (key >> 4, key & 7, (query >> 1) & 3), in the order of the consumer's threads.
# KEEP_TILE6 is the score tile as (key >> 4, key bit 3, key & 7, query >> 3, (query >> 1) & 3, query bit 0): the
# accumulator layout with the register dimensions (1, 3, 5) apart, so that a thread's word broadcast over them
# gives each register its bit at a constant position.
KEEP_TILE6 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2, 1, 8, 1, 2], threads_per_warp=[1, 1, 8, 1, 4, 1],
                                           warps_per_cta=[4, 1, 1, 1, 1, 1], order=[5, 1, 3, 4, 2, 0]))

KEEP_WORDS = kept_dims(KEEP_TILE6, (0, 2, 4))  # (4, 8, 4): one word a thread
# each dimension of KEEP_TILE6 alone, for its aranges
KEEP_KEY_HI, KEEP_KEY3, KEEP_KEY_LO, KEEP_QUERY_HI, KEEP_QUERY_MID, KEEP_QUERY0 = (
    kept_dims(KEEP_TILE6, (dim, )) for dim in range(6))
# the drawer's tile: (key >> 4, (key >> 1) & 3, (query >> 1) & 3), the pairs of consumer threads that differ in
# key bit 0 only, one per lane of its two warps
KEEP_DRAW = gl.constexpr(gl.BlockedLayout([1, 1, 1], [2, 4, 4], [2, 1, 1], [2, 1, 0]))
KEEP_SHARED = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))  # a slot's (4, 8, 4) words, row-major


@gluon.jit
def _register_dims():
    """KEEP_TILE6's register dimensions as (1, 2, 1, 1, 1, 1), (1, 1, 1, 8, 1, 1), (1, 1, 1, 1, 1, 2) aranges: key
    bit 3, query >> 3, query bit 0, each value known at compile time in every register."""
    key3 = gl.arange(0, 2, layout=KEEP_KEY3)[None, :, None, None, None, None]
    query_hi = gl.arange(0, 8, layout=KEEP_QUERY_HI)[None, None, None, :, None, None]
    query0 = gl.arange(0, 2, layout=KEEP_QUERY0)[None, None, None, None, None, :]
    return key3, query_hi, query0


@gluon.jit
def _keep_bit(word):
    """Each register's position of its keep decision in the consumer thread's word (KEEP_WORDS), known at compile
    time in every register, and the word broadcast over the register dimensions: KEEP_TILE6's view."""
    key3, query_hi, query0 = _register_dims()
    bit = key3 + 2 * (query_hi & 1) + 4 * query0 + 8 * (query_hi >> 1)
    return word[:, None, :, None, :, None], bit, query0


@gluon.jit
def _keep_tile(word, like):
    """The step's (HALF_N, BLOCK_M) keep tile in the layout of `like` (the consumer's Sᵀ) from the consumer
    thread's word (KEEP_WORDS): each register takes its own bit, at a position known at compile time."""
    words, bit, query0 = _keep_bit(word)
    bits = gl.reshape((words >> bit) & 1, [like.shape[0], like.shape[1]])
    return gl.convert_layout(bits, like.type.layout, assert_trivial=True) != 0


@gluon.jit
def _drop(p_t, word):
    """Pᵀ of the step (16-bit, the consumer's Sᵀ layout) with the dropped weights zeroed (`common.drop_pairs`; the
    pairs are adjacent queries, query bit 0)."""
    words, bit, query0 = _keep_bit(word)
    return drop_pairs(p_t, words, bit, query0)


@gluon.jit
def _visible_tile(like, limit):
    """The causal mask of the step's (HALF_N, BLOCK_M) tile in the layout of `like`: key j visible from query i
    when j - i <= limit (the step's m0 + shift - key0). Written in KEEP_TILE6's dimensions, j - i is one value
    per thread (its lane's and warp's bits) plus a constant per register, so the mask holds no index tile in
    registers (with dropout `causal_mask_t`'s spilled; windows take it too, docs/tuning.md)."""
    key_hi = gl.arange(0, 4, layout=KEEP_KEY_HI)[:, None, None, None, None, None]
    key_lo = gl.arange(0, 8, layout=KEEP_KEY_LO)[None, None, :, None, None, None]
    query_mid = gl.arange(0, 4, layout=KEEP_QUERY_MID)[None, None, None, None, :, None]
    key3, query_hi, query0 = _register_dims()
    lane_part = key_hi * 16 + key_lo - 2 * query_mid - limit  # (4, 1, 8, 1, 4, 1): one value a thread
    visible = (lane_part + (8 * key3 - 8 * query_hi - query0)) <= 0
    visible = gl.reshape(visible, [like.shape[0], like.shape[1]])
    return gl.convert_layout(visible, like.type.layout, assert_trivial=True)


# One Philox call's eight decisions shifted into the two threads' words (low halves: key bit 0 = 0, high halves: 1),
# word r3 first, so that after the step's eight calls call c's word k sits at bit 4c + k. A decision h >= t is the
# carry out of h * 2^16 + (2^32 - t * 2^16), which `addc` shifts in: two or three instructions a decision, against
# five for an extract, compare, select, shift and OR. $0, $1: the words out; $2..$5: r0..r3;
# $6: 2^32 - t * 2^16; $7, $8: the words in.
_SHIFT_IN_ASM = gl.constexpr(carry_shift_in_ptx(
    [(r, half, out, word_in if r == "$5" else out)
     for r in ("$5", "$4", "$3", "$2") for half, out, word_in in (("lo", "$0", "$7"), ("hi", "$1", "$8"))], "$6"))


@gluon.jit
def _shift_in_call(lo, hi, r0, r1, r2, r3, carry_addend):
    """`_SHIFT_IN_ASM`: one call's decisions shifted into the words lo and hi."""
    return gl.inline_asm_elementwise(_SHIFT_IN_ASM, "=&r,=&r,r,r,r,r,r,r,r",
                                     [r0, r1, r2, r3, carry_addend, lo, hi], dtype=(gl.uint32, gl.uint32),
                                     is_pure=True, pack=1)


@gluon.jit
def _keep_drawer(args, WG: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr):
    """Consumer WG's keep words, step by step, into its ring of slots (`keep_full` / `keep_empty`),
    drawn by triton.common.dropout_keep's counters so that the bits are the forward's: a Philox call decides the eight
    pairs that differ in query bit 3 and key bits 0 and 3, i.e. four decisions for each of two consumer threads
    (key bit 0 is a lane bit of the transposed tile), so each lane of the drawer's two warps runs the eight
    calls of one such thread pair (query bits 0, 4, 5) and writes the pair's two words. Warps of its own, so that
    the integer work runs beside the consumers' matmuls and softmax instead of inside them."""
    (keep_bufs, keep_full, keep_empty, SEED_OFFSET, dropout_p, off_b, nheads, off_h0, seqlen_q, seqlen_k, n0,
     m_lo, m_end, total) = args
    SLOTS: gl.constexpr = keep_bufs.shape[0] // 2  # each consumer's
    key0 = n0 + WG * HALF_N
    seed, offset = dropout_seed_offset(SEED_OFFSET, True)
    addend, keep_all = carry_addend(dropout_p)
    key_hi = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, KEEP_DRAW)))[:, None, None]
    key_mid = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, KEEP_DRAW)))[None, :, None]
    query_mid = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, KEEP_DRAW)))[None, None, :]
    col = key0 // 4 + key_hi * 4 + key_mid  # counter column of the pair's keys (bits 0 and 3 dropped)
    groups_per_row = gl.cdiv(seqlen_k, 16) * 4
    g = 0
    m0 = m_lo
    for i in range(total):
        # counter row of query m0 + 2 * query_mid (bit 3 dropped): dropout_keep's rows0 + (i >> 4) * 8 + (i & 7)
        row = (dropout_head_rows(off_b, nheads, off_h0 + g, seqlen_q) + m0 // 2 + 2 * query_mid).to(gl.int64)
        base = offset + row * groups_per_row + col  # (4, 4, 4): the call of query bits 0, 4, 5 = 0
        lo = gl.zeros(base.shape, gl.uint32, KEEP_DRAW)
        hi = gl.zeros(base.shape, gl.uint32, KEEP_DRAW)
        for j in range(8):  # a loop: one call's state live
            c = 7 - j  # query bit 0 + 2 * (query >> 4); the last call shifted in lands at bits 0..3
            r0, r1, r2, r3 = philox_wide(seed, base + ((c >> 1) * 8 + (c & 1)) * groups_per_row)
            lo, hi = _shift_in_call(lo, hi, r0, r1, r2, r3, addend)
        lo = gl.where(keep_all, 0xFFFFFFFF, lo)
        hi = gl.where(keep_all, 0xFFFFFFFF, hi)
        words = gl.reshape(gl.permute(gl.join(lo, hi), [0, 1, 3, 2]), [4, 8, 4])  # key & 7 = 2 * mid + bit 0
        s = WG * SLOTS + i % SLOTS
        # a fresh mbarrier counts as having completed the phase before 0, so the first lap does not wait
        mbarrier.wait(keep_empty.index(s), ((i // SLOTS) & 1) ^ 1)
        keep_bufs.index(s).store(words.to(gl.int32, bitcast=True))
        gl.thread_barrier()  # every lane's word written before the consumer is told
        mbarrier.arrive(keep_full.index(s))
        g, m0 = next_query_step(g, m0, m_lo, m_end, BLOCK_M)


@gluon.jit
def _step(i, g, m0, dk, dv, k_s, v_s, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, ALIBI_SLOPES,
          alibi_base, offs_m, offs_n, key0, shift, seqlen_k, qk_scale, cap_log2, zero_s, a_layout: gl.constexpr,
          row_layout: gl.constexpr, MASK: gl.constexpr, HALF_N: gl.constexpr, STAGES: gl.constexpr,
          ALIBI: gl.constexpr, SOFTCAP: gl.constexpr, LSE_FIRST: gl.constexpr, dq_parts, WG: gl.constexpr,
          FUSED_DQ: gl.constexpr, keep_parts, DROPOUT: gl.constexpr, window_left=0, WINDOW: gl.constexpr = False):
    """Step i of a consumer: query block m0 of GQA head g into dK and dV. MASK: 0 none, 1 the causal mask, 2
    the causal mask where the step crosses the diagonal (a branch per step), 3 the keys past seqlen_k hidden
    (KEY_TAIL: no causal mask, and seqlen_k not a multiple of BLOCK_N; every step takes it, since a branch on the
    program's key block between two loops made ptxas spill; a causal mask hides those keys by itself), 4 the causal
    sliding window's edge alone (`window_mask_t`). Under a WINDOW (causal, no dropout) masks 1 and 2 hide the keys
    before each query's window too, 2 by a branch of its own per step; mask 2 takes its edges from `_visible_tile`
    with dropout or under a window. Queries past
    seqlen_q need no mask: their LSE is +inf (ops.attn_bwd_impl pads it), so their P is 0. FUSED_DQ: dQ's share of
    the step too (`_fused_dq`; dq_parts its buffers and barriers, else unused). DROPOUT: the step's keep word from
    the drawer (keep_parts: the rings of keep words, consumer WG's slots WG * KEEP_SLOTS + the step's, their
    barriers, and 1 / (1 - p)); dV sums the kept Pᵀ dO unscaled (`_consumer` scales it once at the end), and
    dS = P (Z dP / (1 - p) - delta). SOFTCAP (`common.softcap_tanh`; no dropout): the scores are
    cap_log2 * tanh(s * qk_scale), and dS takes the cap's derivative 1 - tanh^2, a tile kept from the scores until
    P has gone to dV's matmul (ptxas spills about 100 bytes at head dim 128 for it, and far more with dropout)."""
    dtype: gl.constexpr = q_bufs.dtype
    s = i % STAGES
    alibi_log2 = head_slope_log2(ALIBI_SLOPES, alibi_base + g, ALIBI)  # the step's query head's slope
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    q_s = q_bufs.index(s)  # (BM, D)
    do_s = do_bufs.index(s)
    if LSE_FIRST:  # (BM,) in log2 units; see `lse_first`
        lse_log2 = lse_bufs.index(s).load(row_layout) * LOG2E
    s_t = warpgroup_mma(k_s, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # (HALF_N, BM)
    dp_t = warpgroup_mma(v_s, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if not LSE_FIRST:  # read under the two matmuls
        lse_log2 = lse_bufs.index(s).load(row_layout) * LOG2E
        delta = delta_bufs.index(s).load(row_layout)
    if DROPOUT:  # read under the two matmuls
        keep_bufs, keep_full, keep_empty, keep_scale = keep_parts
        KEEP_SLOTS: gl.constexpr = keep_bufs.shape[0] // 2  # each consumer's: STAGES, or 1 with the fused dQ
        keep_slot = WG * KEEP_SLOTS + i % KEEP_SLOTS
        mbarrier.wait(keep_full.index(keep_slot), (i // KEEP_SLOTS) & 1)
        word = keep_bufs.index(keep_slot).load(KEEP_WORDS)
    s_t = warpgroup_mma_wait(1, deps=(s_t, ))
    # the previous step's stage can be refilled: its matmuls were waited for at the end of that step (and the
    # warpgroup's matmul issue is aligned: every warp has read that step's keep word too)
    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    if DROPOUT and not FUSED_DQ:
        mbarrier.arrive(keep_empty.index(WG * KEEP_SLOTS + (i + KEEP_SLOTS - 1) % KEEP_SLOTS), pred=i > 0)
    if SOFTCAP:
        scores_t, slope_t = softcap_scores(s_t, qk_scale, cap_log2)  # log2 units; the cap's derivative, for dS
    else:
        scores_t = s_t * qk_scale  # log2 units
    if ALIBI:
        scores_t += alibi_bias(alibi_log2, (m0 + shift) + offs_m[None, :], offs_n[:, None])
    p_t = gl.exp2(scores_t - lse_log2[None, :])
    if MASK == 1:
        p_t = causal_mask_t(p_t, offs_n, offs_m, m0 + shift)
        if WINDOW:
            p_t = window_mask_t(p_t, offs_n, offs_m, m0 + shift - window_left)
    elif MASK == 2:  # only the steps that cross the diagonal hide any of the warpgroup's keys
        if key0 + HALF_N - 1 > m0 + shift:
            if DROPOUT or WINDOW:
                p_t = gl.where(_visible_tile(zero_s, m0 + shift - key0), p_t, 0.0)
            else:
                p_t = causal_mask_t(p_t, offs_n, offs_m, m0 + shift)
        if WINDOW:  # and the steps whose last query's window starts after the warpgroup's first key: key j is
            # hidden from query i when j - i < m0 + shift - window_left - key0
            if key0 < m0 + zero_s.shape[1] - 1 + shift - window_left:
                p_t = gl.where(_visible_tile(zero_s, m0 + shift - window_left - key0 - 1), 0.0, p_t)
    elif MASK == 3:
        p_t = gl.where((offs_n < seqlen_k)[:, None], p_t, 0.0)
    elif MASK == 4:
        p_t = window_mask_t(p_t, offs_n, offs_m, m0 + shift - window_left)
    if DROPOUT:
        dv = warpgroup_mma(gl.convert_layout(_drop(p_t.to(dtype), word), a_layout), do_s, dv, is_async=True)
    else:
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_s, dv, is_async=True)
    if SOFTCAP:  # dS = P (1 - t^2) (dP - delta): P has gone to dV, the cap's derivative joins it here
        p_t = p_t * slope_t
    if LSE_FIRST:  # delta is live from here on only, with LSE no longer needed
        delta = delta_bufs.index(s).load(row_layout)
    dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
    if DROPOUT:  # the keep tile again from the word, reread: 32 values live across dV's issue spilled
        keep = _keep_tile(keep_bufs.index(keep_slot).load(KEEP_WORDS), zero_s)
        ds_t = p_t * (gl.where(keep, dp_t * keep_scale, 0.0) - delta[None, :])
    else:
        ds_t = p_t * (dp_t - delta[None, :])
    if FUSED_DQ:
        ds_bf = ds_t.to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds_bf, a_layout), q_s, dk, is_async=True)
        dk, dv = _fused_dq(i, ds_bf, dk, dv, dq_parts, WG)
        if DROPOUT:  # every warp has passed `_fused_dq`'s partition barriers, so every word was read: one slot
            mbarrier.arrive(keep_empty.index(keep_slot))
    else:
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q_s, dk, is_async=True)
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))  # not carried into the next step: see the docstring
    return warpgroup_mma_init(dk), warpgroup_mma_init(dv)


@gluon.jit
def _steps(dk, dv, k_s, v_s, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, ALIBI_SLOPES, alibi_base, offs_m,
           offs_n, key0, shift, seqlen_k, m_lo, m_end, total, qk_scale, cap_log2, zero_s, a_layout: gl.constexpr,
           row_layout: gl.constexpr, MASK: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr,
           STAGES: gl.constexpr, ALIBI: gl.constexpr, SOFTCAP: gl.constexpr, LSE_FIRST: gl.constexpr, dq_parts,
           WG: gl.constexpr, FUSED_DQ: gl.constexpr, keep_parts, DROPOUT: gl.constexpr, window_left,
           WINDOW: gl.constexpr):
    """A consumer's `total` steps, each with mask MASK (`_step`), over the query blocks from m_lo of each head of
    the GQA group in turn."""
    g = 0
    m0 = m_lo
    for i in range(total):
        dk, dv = _step(i, g, m0, dk, dv, k_s, v_s, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty,
                       ALIBI_SLOPES, alibi_base, offs_m, offs_n, key0, shift, seqlen_k, qk_scale, cap_log2, zero_s,
                       a_layout, row_layout, MASK, HALF_N, STAGES, ALIBI, SOFTCAP, LSE_FIRST, dq_parts, WG, FUSED_DQ,
                       keep_parts, DROPOUT, window_left, WINDOW)
        g, m0 = next_query_step(g, m0, m_lo, m_end, BLOCK_M)
    return dk, dv


@gluon.jit
def _fused_dq(i, ds_bf, dk, dv, dq_parts, WG: gl.constexpr):
    """dQ's share of step i, with the step's dK and dV matmuls in flight; returns them waited for. The step's
    query block takes dS K over the program's 128 keys, split along D between the consumers (FA3's form):
    each stores its (BM, HALF_N) dS into the step's shared tile, waits for the other's (`ds_full`), multiplies
    the whole (BM, 128) dS by its half of K's columns, and leaves that (BM, D / 2) fp32 partial in the step's
    dQ slot, which the reducer warp adds into the fp32 dQ in global memory (`_dq_reducer`). Both dS and dQ
    slots are two deep, so a consumer waits for the other only at `ds_full`."""
    ds_bufs, dq_bufs, ds_full, dq_full, dq_empty, k_smem, softmax_scale = dq_parts
    BLOCK_M: gl.constexpr = ds_bufs.shape[1]
    BLOCK_N: gl.constexpr = ds_bufs.shape[2]
    HALF_D: gl.constexpr = dq_bufs.shape[2] // 2
    HALF_N: gl.constexpr = BLOCK_N // 2
    slot = i % 2
    phase = (i // 2) & 1
    ds_s = ds_bufs.index(slot)  # (BM, BLOCK_N): dS, queries by the program's keys
    # step i + 2 rewrites this slot only after both consumers passed step i + 1's ds_full, which each reaches
    # after its step-i dQ matmul was waited for
    ds_s.slice(WG * HALF_N, HALF_N, dim=1).store(gl.permute(ds_bf, (1, 0)))
    fence_async_shared()
    gl.thread_barrier()  # every thread's write done before the other consumer is told
    mbarrier.arrive(ds_full.index(slot))
    # dK and dV done first: with them and their register operands in flight beside dQ's accumulator, ptxas
    # serialized the matmuls (warning C7512)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])  # (queries, D / 2)
    mbarrier.wait(ds_full.index(slot), phase)
    dq = warpgroup_mma(ds_s, k_smem.slice(WG * HALF_D, HALF_D, dim=1),
                       gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    # a fresh mbarrier counts as having completed the phase before 0, so the first lap does not wait
    mbarrier.wait(dq_empty.index(slot), phase ^ 1)
    dq_bufs.index(slot).slice(WG * HALF_D, HALF_D, dim=1).store(dq * softmax_scale)
    fence_async_shared()
    gl.thread_barrier()  # every thread's write done before the reducer is told
    mbarrier.arrive(dq_full.index(slot))
    return dk, dv


@gluon.jit
def _dq_reducer(args, BLOCK_M: gl.constexpr):
    """The fused dQ's reduce (`_fused_dq`): per step, once both consumers' halves are in the step's slot, a TMA
    reduce-add of the (BM, D) fp32 tile into dQ, in 128-byte column chunks (the TMA box of a 128-byte swizzle;
    the lowering splits copies, not reduces). Issued by a warp of its own so that no consumer waits for it."""
    dq_desc, dq_bufs, dq_full, dq_empty, dq_row, dq_row_per_head, dq_col, dq_col_per_head, m_lo, m_end, total = args
    CHUNK: gl.constexpr = dq_desc.block_type.shape[1]
    CHUNKS: gl.constexpr = dq_bufs.shape[2] // CHUNK
    g = 0
    m0 = m_lo
    for i in range(total):
        slot = i % 2
        mbarrier.wait(dq_full.index(slot), (i // 2) & 1)
        dq_s = dq_bufs.index(slot)
        for c in gl.static_range(CHUNKS):
            tma_reduce_add(dq_desc, [dq_row + g * dq_row_per_head + m0, dq_col + g * dq_col_per_head + c * CHUNK],
                           dq_s.slice(c * CHUNK, CHUNK, dim=1))
        tma.store_wait(CHUNKS)  # this step's reduces may run on; the step before's have read their slot
        mbarrier.arrive(dq_empty.index((i + 1) % 2), pred=i > 0)
        g, m0 = next_query_step(g, m0, m_lo, m_end, BLOCK_M)
    tma.store_wait(0)  # every reduce has read its slot before the program's shared memory goes


@gluon.jit
def _consumer(args, ALIBI_SLOPES, dq_parts, keep_parts, WG: gl.constexpr, CAUSAL: gl.constexpr,
              KEY_TAIL: gl.constexpr, HEADDIM: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr,
              STAGES: gl.constexpr, ALIBI: gl.constexpr, SOFTCAP: gl.constexpr, REG_KV: gl.constexpr,
              LSE_FIRST: gl.constexpr, FUSED_DQ: gl.constexpr, DROPOUT: gl.constexpr, WINDOW: gl.constexpr,
              STORE_TMA: gl.constexpr):
    (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ready, empty, kv_bar, DK, DV, dk_base, stride_dks,
     dv_base, stride_dvs, alibi_base, n0, shift, seqlen_k, m_lo, m_end, total, group_size, qk_scale, cap_log2,
     softmax_scale, window_left, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col) = args
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])  # (keys, queries)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEADDIM, 16])  # (keys, D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    k_s = k_smem.slice(WG * HALF_N, HALF_N)  # (HALF_N, D)
    v_s = v_smem.slice(WG * HALF_N, HALF_N)
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query (column of Sᵀ)
    offs_m = gl.arange(0, BLOCK_M, layout=row_layout)
    key0 = n0 + WG * HALF_N  # the warpgroup's first key
    offs_n = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    zero_s = gl.zeros([HALF_N, BLOCK_M], gl.float32, s_layout)
    # the loop carries dK and dV typed as pending matmul results (each step re-wraps its waited values)
    dk = warpgroup_mma_init(gl.zeros([HALF_N, HEADDIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([HALF_N, HEADDIM], gl.float32, acc_layout))

    mbarrier.wait(kv_bar, 0)
    if REG_KV:  # K and V as the register operands of every K Qᵀ and V dOᵀ (register_kv)
        operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        k_s = k_s.load(operand)
        v_s = v_s.load(operand)
    if CAUSAL and REG_KV:
        # With K and V in registers a branch on the mask inside the step miscompiled (wrong dK and dV, no ptxas
        # warning), so each head's steps run as two loops: those that cross the diagonal
        # (j < n_diag: some of the warpgroup's keys hidden from some queries) with the mask, then the rest
        # without it.
        n_mblocks = (m_end - m_lo) // BLOCK_M
        n_diag = gl.minimum(gl.cdiv(gl.maximum(key0 + HALF_N - 1 - shift - m_lo, 0), BLOCK_M), n_mblocks)
        n_top = n_mblocks  # under a WINDOW, the steps from n_top on hide keys before their queries' windows
        if WINDOW:
            edge = key0 - BLOCK_M + 1 - shift + window_left - m_lo  # step j crosses the edge when j * BLOCK_M > edge
            n_top = gl.minimum(gl.maximum(gl.where(edge < 0, 0, edge // BLOCK_M + 1), n_diag), n_mblocks)
        i = 0
        for g in range(group_size):
            for j in range(n_diag):
                dk, dv = _step(i, g, m_lo + j * BLOCK_M, dk, dv, k_s, v_s, q_bufs, do_bufs, lse_bufs, delta_bufs,
                               ready, empty, ALIBI_SLOPES, alibi_base, offs_m, offs_n, key0, shift, seqlen_k,
                               qk_scale, cap_log2, zero_s, a_layout, row_layout, 1, HALF_N, STAGES, ALIBI, SOFTCAP,
                               LSE_FIRST, dq_parts, WG, FUSED_DQ, keep_parts, DROPOUT, window_left, WINDOW)
                i += 1
            for j in range(n_diag, n_top):
                dk, dv = _step(i, g, m_lo + j * BLOCK_M, dk, dv, k_s, v_s, q_bufs, do_bufs, lse_bufs, delta_bufs,
                               ready, empty, ALIBI_SLOPES, alibi_base, offs_m, offs_n, key0, shift, seqlen_k,
                               qk_scale, cap_log2, zero_s, a_layout, row_layout, 0, HALF_N, STAGES, ALIBI, SOFTCAP,
                               LSE_FIRST, dq_parts, WG, FUSED_DQ, keep_parts, DROPOUT)
                i += 1
            if WINDOW:
                for j in range(n_top, n_mblocks):
                    dk, dv = _step(i, g, m_lo + j * BLOCK_M, dk, dv, k_s, v_s, q_bufs, do_bufs, lse_bufs,
                                   delta_bufs, ready, empty, ALIBI_SLOPES, alibi_base, offs_m, offs_n, key0, shift,
                                   seqlen_k, qk_scale, cap_log2, zero_s, a_layout, row_layout, 4, HALF_N, STAGES,
                                   ALIBI, SOFTCAP, LSE_FIRST, dq_parts, WG, FUSED_DQ, keep_parts, DROPOUT,
                                   window_left, WINDOW)
                    i += 1
    elif CAUSAL:
        dk, dv = _steps(dk, dv, k_s, v_s, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, ALIBI_SLOPES,
                        alibi_base, offs_m, offs_n, key0, shift, seqlen_k, m_lo, m_end, total, qk_scale, cap_log2,
                        zero_s, a_layout, row_layout, 2, BLOCK_M, HALF_N, STAGES, ALIBI, SOFTCAP, LSE_FIRST, dq_parts,
                        WG, FUSED_DQ, keep_parts, DROPOUT, window_left, WINDOW)
    else:
        dk, dv = _steps(dk, dv, k_s, v_s, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, ALIBI_SLOPES,
                        alibi_base, offs_m, offs_n, key0, shift, seqlen_k, m_lo, m_end, total, qk_scale, cap_log2,
                        zero_s, a_layout, row_layout, 3 if KEY_TAIL else 0, BLOCK_M, HALF_N, STAGES, ALIBI, SOFTCAP,
                        LSE_FIRST, dq_parts, WG, FUSED_DQ, keep_parts, DROPOUT, window_left, False)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))

    dtype: gl.constexpr = q_bufs.dtype
    offs_key = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, HEADDIM, layout=gl.SliceLayout(0, acc_layout))
    if DROPOUT:
        dv = dv * keep_parts[3]  # the kept Pᵀ dO, times 1 / (1 - p)
    dk_ptrs = DK + dk_base + offs_key[:, None] * stride_dks + offs_d[None, :]
    dv_ptrs = DV + dv_base + offs_key[:, None] * stride_dvs + offs_d[None, :]
    if STORE_TMA:  # through the warpgroup's rows of V (no other warp reads them): dV, then dK
        if key0 + HALF_N <= seqlen_k:
            buf = v_smem.slice(WG * HALF_N, HALF_N)  # (HALF_N, D)
            store_tile_by_tma(dv_desc, [dv_row + WG * HALF_N, dv_col], buf, dv.to(dtype))
            tma.store_wait(0)
            gl.thread_barrier()  # the store has read the rows before any thread writes dK over them
            store_tile_by_tma(dk_desc, [dk_row + WG * HALF_N, dk_col], buf, (dk * softmax_scale).to(dtype))
            tma.store_wait(0)
        else:
            gl.store(dk_ptrs, (dk * softmax_scale).to(dtype), mask=(offs_key < seqlen_k)[:, None])
            gl.store(dv_ptrs, dv.to(dtype), mask=(offs_key < seqlen_k)[:, None])
    elif KEY_TAIL:  # the rows past seqlen_k are not stored (the mask costs registers: kept to where it is needed)
        gl.store(dk_ptrs, (dk * softmax_scale).to(dtype), mask=(offs_key < seqlen_k)[:, None])
        gl.store(dv_ptrs, dv.to(dtype), mask=(offs_key < seqlen_k)[:, None])
    else:
        gl.store(dk_ptrs, (dk * softmax_scale).to(dtype))
        gl.store(dv_ptrs, dv.to(dtype))


@gluon.jit
def attn_bwd_dkdv_hopper_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc, DK, DV, dk_desc, dv_desc, ALIBI_SLOPES, SEED_OFFSET,
    CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS,  # varlen: (batch + 1,) int32 each, ops.varlen_blocks's (2, n)
    dk_rows, dk_cols, dv_rows, dv_cols,
    q_rows, q_cols, do_rows, do_cols, k_rows, k_cols, v_rows, v_cols, dq_rows, dq_cols,  # see rows_view
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_lse_b, stride_lse_h,
    stride_alibi_b, nheads_k, group_size, seqlen_q, seqlen_k, qk_scale, cap_log2, softmax_scale, dropout_p, window_left,
    CAUSAL: gl.constexpr, KEY_TAIL: gl.constexpr, HEADDIM: gl.constexpr, BLOCK_M: gl.constexpr,
    HALF_N: gl.constexpr, STAGES: gl.constexpr, HEAD_GROUP: gl.constexpr, ALIBI: gl.constexpr, SOFTCAP: gl.constexpr,
    REG_KV: gl.constexpr, LSE_FIRST: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    FUSED_DQ: gl.constexpr, DROPOUT: gl.constexpr, VARLEN: gl.constexpr, WINDOW: gl.constexpr,
    STORE_TMA: gl.constexpr,
):
    BLOCK_N: gl.constexpr = 2 * HALF_N
    # WINDOW: a causal sliding window of window_left keys: a key block's queries end where its last key leaves their
    # windows
    gl.static_assert(not WINDOW or (CAUSAL and not DROPOUT), "a sliding window runs causal, without dropout")
    if VARLEN:
        gl.static_assert(not DROPOUT, "the varlen form draws no dropout")
        gl.static_assert(KEY_TAIL, "a varlen sequence's last key block is masked")
    (off_b, off_hk, off_h0, n0, shift, seqlen_q, seqlen_k, m_lo, m_end, total, q_first, do_first, k_first,
     v_first, dq_first, lse_first_row, dk_first, dv_first) = key_block_program(
        VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, q_rows, do_rows, k_rows, v_rows, dq_rows, stride_dkb, stride_dks,
        stride_dvb, stride_dvs, stride_lse_b, nheads_k, group_size, seqlen_q, seqlen_k, window_left, CAUSAL, WINDOW,
        VARLEN, HEAD_GROUP, BLOCK_M, BLOCK_N)

    q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ready, empty, kv_bar = allocate_dkdv_ring(
        q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, STAGES, BLOCK_M)
    if FUSED_DQ:  # `_fused_dq`'s buffers: two slots each of the step's dS tile and of its dQ partial
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, BLOCK_N],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], q_desc.dtype))
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEADDIM],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEADDIM], gl.float32))
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ds_full.index(s), count=2)  # one arrival per consumer warpgroup
            mbarrier.init(dq_full.index(s), count=2)
            mbarrier.init(dq_empty.index(s), count=1)  # the reducer's
        dq_parts = (ds_bufs, dq_bufs, ds_full, dq_full, dq_empty, k_smem, softmax_scale)
    else:
        dq_parts = 0
    if DROPOUT:  # each consumer's ring of keep words (`_keep_drawer`): one slot with the fused dQ (`_step`)
        gl.static_assert(BLOCK_M == 64 and HALF_N == 64, "the keep words are laid out for 64 x 64")
        KEEP_SLOTS: gl.constexpr = 1 if FUSED_DQ else STAGES
        keep_bufs, keep_full, keep_empty = allocate_keep_ring(KEEP_SLOTS, [4, 8, 4], KEEP_SHARED)
        keep_parts = (keep_bufs, keep_full, keep_empty, 1.0 / (1.0 - dropout_p))
        nheads = nheads_k * group_size
        drawer_args = (keep_bufs, keep_full, keep_empty, SEED_OFFSET, dropout_p, off_b, nheads, off_h0, seqlen_q,
                       seqlen_k, n0, m_lo, m_end, total)
    else:
        keep_parts = 0
    fence_async_shared()

    lse_base = lse_first_row + off_h0 * stride_lse_h
    dk_base = dk_first + off_hk * stride_dkh
    dv_base = dv_first + off_hk * stride_dvh
    alibi_base = off_b * stride_alibi_b + off_h0  # the slopes of the GQA group's query heads follow
    # the partitions' runtime arguments as tuples, their constexprs apart (a constexpr in a tuple is not one)
    if VARLEN:
        dk_row = k_first + off_hk * dk_rows[1] + n0
        dv_row = k_first + off_hk * dv_rows[1] + n0
    else:
        dk_row = off_b * dk_rows[0] + off_hk * dk_rows[1] + n0
        dv_row = off_b * dv_rows[0] + off_hk * dv_rows[1] + n0
    consumer_args = (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ready, empty, kv_bar, DK, DV,
                     dk_base, stride_dks, dv_base, stride_dvs, alibi_base, n0, shift, seqlen_k, m_lo, m_end, total,
                     group_size, qk_scale, cap_log2, softmax_scale, window_left, dk_desc, dv_desc, dk_row,
                     off_hk * dk_cols, dv_row, off_hk * dv_cols)
    producer_args = (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
                     delta_bufs, k_smem, v_smem, ready, empty, kv_bar,
                     q_first + off_h0 * q_rows[1], q_rows[1], off_h0 * q_cols, q_cols,
                     do_first + off_h0 * do_rows[1], do_rows[1], off_h0 * do_cols, do_cols,
                     k_first + off_hk * k_rows[1] + n0, off_hk * k_cols,
                     v_first + off_hk * v_rows[1] + n0, off_hk * v_cols, lse_base, stride_lse_h,
                     m_lo, m_end, total)
    if FUSED_DQ:  # a fourth partition, the reducer warp
        reducer_args = (dq_desc, dq_bufs, dq_full, dq_empty, dq_first + off_h0 * dq_rows[1], dq_rows[1],
                        off_h0 * dq_cols, dq_cols, m_lo, m_end, total)
    # the partition lists differ by member (warp_specialize takes literal lists); the consumers are alike in each
    if FUSED_DQ and DROPOUT:
        gl.warp_specialize([
            (_consumer, (consumer_args, ALIBI_SLOPES, dq_parts, keep_parts, 0, CAUSAL, KEY_TAIL, HEADDIM, BLOCK_M,
                         HALF_N, STAGES, ALIBI, SOFTCAP, REG_KV, LSE_FIRST, FUSED_DQ, DROPOUT, WINDOW, STORE_TMA)),
            (_consumer, (consumer_args, ALIBI_SLOPES, dq_parts, keep_parts, 1, CAUSAL, KEY_TAIL, HEADDIM, BLOCK_M,
                         HALF_N, STAGES, ALIBI, SOFTCAP, REG_KV, LSE_FIRST, FUSED_DQ, DROPOUT, WINDOW, STORE_TMA)),
            (dkdv_producer, (producer_args, BLOCK_M, STAGES)),
            (_dq_reducer, (reducer_args, BLOCK_M)),
            (_keep_drawer, (drawer_args, 0, BLOCK_M, HALF_N)),
            (_keep_drawer, (drawer_args, 1, BLOCK_M, HALF_N)),
        ], [4, 1, 1, 2, 2], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    elif FUSED_DQ:
        gl.warp_specialize([
            (_consumer, (consumer_args, ALIBI_SLOPES, dq_parts, keep_parts, 0, CAUSAL, KEY_TAIL, HEADDIM, BLOCK_M,
                         HALF_N, STAGES, ALIBI, SOFTCAP, REG_KV, LSE_FIRST, FUSED_DQ, DROPOUT, WINDOW, STORE_TMA)),
            (_consumer, (consumer_args, ALIBI_SLOPES, dq_parts, keep_parts, 1, CAUSAL, KEY_TAIL, HEADDIM, BLOCK_M,
                         HALF_N, STAGES, ALIBI, SOFTCAP, REG_KV, LSE_FIRST, FUSED_DQ, DROPOUT, WINDOW, STORE_TMA)),
            (dkdv_producer, (producer_args, BLOCK_M, STAGES)),
            (_dq_reducer, (reducer_args, BLOCK_M)),
        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    elif DROPOUT:  # a drawer partition (two warps) per consumer, each with its consumer's keys
        gl.warp_specialize([
            (_consumer, (consumer_args, ALIBI_SLOPES, dq_parts, keep_parts, 0, CAUSAL, KEY_TAIL, HEADDIM, BLOCK_M,
                         HALF_N, STAGES, ALIBI, SOFTCAP, REG_KV, LSE_FIRST, FUSED_DQ, DROPOUT, WINDOW, STORE_TMA)),
            (_consumer, (consumer_args, ALIBI_SLOPES, dq_parts, keep_parts, 1, CAUSAL, KEY_TAIL, HEADDIM, BLOCK_M,
                         HALF_N, STAGES, ALIBI, SOFTCAP, REG_KV, LSE_FIRST, FUSED_DQ, DROPOUT, WINDOW, STORE_TMA)),
            (dkdv_producer, (producer_args, BLOCK_M, STAGES)),
            (_keep_drawer, (drawer_args, 0, BLOCK_M, HALF_N)),
            (_keep_drawer, (drawer_args, 1, BLOCK_M, HALF_N)),
        ], [4, 1, 2, 2], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (consumer_args, ALIBI_SLOPES, dq_parts, keep_parts, 0, CAUSAL, KEY_TAIL, HEADDIM, BLOCK_M,
                         HALF_N, STAGES, ALIBI, SOFTCAP, REG_KV, LSE_FIRST, FUSED_DQ, DROPOUT, WINDOW, STORE_TMA)),
            (_consumer, (consumer_args, ALIBI_SLOPES, dq_parts, keep_parts, 1, CAUSAL, KEY_TAIL, HEADDIM, BLOCK_M,
                         HALF_N, STAGES, ALIBI, SOFTCAP, REG_KV, LSE_FIRST, FUSED_DQ, DROPOUT, WINDOW, STORE_TMA)),
            (dkdv_producer, (producer_args, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, varlen: bool,
              max_seqlen_q: int, max_seqlen_k: int, window_left: int, window_right: int, softcap: float,
              dropout_p: float) -> bool:
    """Whether this kernel covers the call: sm_90 with Gluon, dense rows of any lengths or varlen batches,
    bf16/fp16, head dim 64 or 128, causal or unmasked, dropout on dense rows, softcap without
    dropout (`_step`). Anything else keeps the Triton kernel."""
    return sm90_dense_ok(q, k, v, dout, varlen=varlen, window_left=window_left, window_right=window_right,
                         softcap=softcap, dropout_p=dropout_p, with_dropout=not varlen,
                         with_varlen=True, with_window=True, with_softcap=dropout_p == 0)


def register_kv(headdim: int, dropout: bool = False, fused: bool = False) -> bool:
    """Whether `_consumer` holds its K and V rows in registers, so that the K Qᵀ and V dOᵀ matmuls read only Qᵀ
    and dOᵀ from shared memory (from shared memory, an m64n64 wgmma needs both operands' 4 KB per 32 cycles, the
    shared memory's whole 128 B per cycle). At head dim 64 that is 32 registers a thread; at head dim 128, 64
    registers, and the kernel spills. Under the causal mask it runs as two loops per head (`_consumer`), since
    skipping the mask by a branch inside the step miscompiled with K and V in registers; with dropout, unmasked rows
    came out with wrong dK the same way, and K and V from shared memory tie (docs/tuning.md, "Gluon dK/dV"). With a
    fused dQ (`fused`), dQ = dS K reads K from shared memory, and the fused dQ outweighs the register operands."""
    return headdim <= 64 and not dropout and not fused


def lse_first(headdim: int) -> bool:
    """Whether `_step` reads its LSE values before issuing the step's two matmuls and its delta values only after
    issuing dV's, rather than both right after the two matmuls. At head dim 128 a consumer's registers hold dK and dV
    (128) besides Sᵀ and dPᵀ (64), and LSE and delta live side by side (32 more) made ptxas spill, and the waits on
    those values' shared-memory reads (queued behind the matmuls' issue) and on the spills' reloads were a tenth of
    Nsight Compute's stall samples; read apart, the spills almost vanish and dK/dV is faster. At head dim 64 nothing
    spills, and the early read only delays the matmuls' issue (docs/tuning.md, "Gluon dK/dV")."""
    return headdim > 64


def worker_registers(dropout: bool) -> int:
    """The setmaxnreg count of the warpgroups after the consumers', which hold the producer warp and the reducer or
    drawer warps (and padding): setmaxnreg applies to a whole warpgroup, so they share it."""
    return DRAWER_REGISTERS if dropout else PRODUCER_REGISTERS


def consumer_registers(headdim: int, dropout: bool = False) -> int:
    """The registers a thread that setmaxnreg gives the worker consumer warpgroup; the default partition's consumer
    gets what the producer warp (PRODUCER_REGISTERS) and this one leave of the MAXNREG x 12 warps the kernel is
    launched with (`default_consumer_registers`): at 240 both consumers hold 240, where at head dim 128 ptxas
    spills nothing (and GPU time ties with 232 / 248); head dim 64 spills nothing either way and keeps 232. With
    dropout (16 warps of MAXNREG_DROPOUT) the producer's and the drawers' two warpgroups take DRAWER_REGISTERS each,
    and the consumers split the rest evenly (232 each). options.KernelOptions.dkdv_consumer_registers forces it."""
    if dropout:
        return (4 * MAXNREG_DROPOUT - 2 * worker_registers(True)) // 16 * 8
    return 240 if headdim > 64 else 232


def default_consumer_registers(consumer: int, dropout: bool = False) -> int:
    """The default partition's consumer's registers a thread: its warpgroup's share of the three warpgroups'
    MAXNREG each (four of MAXNREG_DROPOUT with dropout), less the worker consumer's and the others'
    (`worker_registers`)."""
    if dropout:
        return 4 * MAXNREG_DROPOUT - consumer - 2 * worker_registers(True)
    return 3 * MAXNREG - consumer - worker_registers(False)


def launch_maxnreg(dropout: bool) -> int:
    """The registers a thread the kernel is launched with: the register file over its 12 warps, or 16 with the
    drawers."""
    return MAXNREG_DROPOUT if dropout else MAXNREG


def stores_by_tma(dropout: bool, options: KernelOptions = DEFAULT) -> bool:
    """Whether `_consumer` stores dK and dV through its rows of V's shared memory and TMA stores (STORE_TMA) where its
    key block lies inside the sequence: as options.dkdv_store_tma says, but never with dropout, where ptxas spilled
    392 B a thread against 164 with the register stores."""
    return options.dkdv_store_tma and not dropout


def fuses_dq(headdim: int, dropout: bool = False, options: KernelOptions = DEFAULT) -> bool:
    """Whether the kernel can add dQ into an fp32 buffer itself (`_fused_dq`, `_dq_reducer`): at head dims 64 and
    128, K then read from shared memory (`register_kv`; not where options.register_kv forces K into registers), with
    a Triton whose Gluon can issue TMA reduce-adds (common.TMA_REDUCE). With dropout, the keep words' ring then has
    one slot per consumer (1 KB; at head dim 128 the shared memory is all but full), released once the step's dS is
    shared (`_step`)."""
    return TMA_REDUCE and options.register_kv is not True


def attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, qk_scale: float, softmax_scale: float, causal: bool,
                  alibi_slopes=None, dq_accum=None, seed_offset=None, dropout_p: float = 0.0,
                  options: KernelOptions = DEFAULT, stream: int | None = None, varlen=None, site=None,
                  window_left: int = -1, cap_log2: float = 0.0) -> None:
    """dK, dV (written into dk, dv) for a call `supported` accepted. q, dout: (B, Sq, H, D); k, v: (B, Sk, Hk, D);
    lse, delta: (B, H, >= Sq rounded up to BLOCK_M) fp32 (natural-log LSE), LSE +inf and delta 0 past Sq
    (ops.attn_bwd_impl); qk_scale = softmax_scale * log2(e); alibi_slopes: None or float32 (H,) / (B, H).
    dq_accum: None, or a zeroed fp32 (B, Sq, H, D) that dQ is added into (where `fuses_dq`; not deterministic: the
    key blocks' reduce-adds land in any order). dropout_p > 0: the forward's keep bits, drawn from seed_offset
    (ops.draw_seed_offset's int64 (seed, offset)). options: its register_kv, dkdv_consumer_registers,
    head_group and cached_launch. stream: a raw CUDA stream handle to launch on (None: the
    current stream). site: launch.launch's, passed on. window_left >= 0: a causal sliding window (fwd.attn_fwd's),
    no dropout. cap_log2 > 0: softcap (fwd.attn_fwd's), without dropout.

    varlen: None for dense rows, or (cu_seqlens_q, cu_seqlens_k, blocks) for a varlen batch (no dropout): q, dout,
    dq_accum (total_q, H, D), k, v, dk, dv (total_k, Hk, D); lse and delta (H, total_q + ALIGN x batch) with
    sequence b's rows from common.varlen_lse_start, padded like a dense row's (ops.attn_bwd_impl); blocks
    ops.varlen_blocks's (2, n) table of (sequence, key block) pairs in blocks of BLOCK_N keys. With a site whose
    launch is recorded (launch.Record, from its second launch), the call is a replay (launch.replay) on `stream`."""
    cu_seqlens_q, cu_seqlens_k, blocks = (None, None, None) if varlen is None else varlen
    floats = (qk_scale, cap_log2, softmax_scale, dropout_p)
    if site is not None and replay(attn_bwd_dkdv_hopper_kernel, site, (
            q, dout, k, v, lse, delta, dq_accum, dk, dv, dk, dv, alibi_slopes, seed_offset, cu_seqlens_q,
            cu_seqlens_k, blocks), floats, stream):
        return
    if varlen is not None:
        if dropout_p > 0:
            raise ValueError(f"the Gluon dK/dV draws no dropout on varlen batches, got dropout_p={dropout_p}")
        # the packed rows as one batch row: (1, total, H, D), whose rows_view rows are the tokens
        q, k, v, dout, dk, dv = (t.unsqueeze(0) for t in (q, k, v, dout, dk, dv))
        if dq_accum is not None:
            dq_accum = dq_accum.unsqueeze(0)
        lse, delta = lse.unsqueeze(0), delta.unsqueeze(0)
    if window_left >= 0 and (dropout_p > 0 or not causal):
        raise ValueError(f"the Gluon dK/dV runs a sliding window only causal and without dropout, got "
                         f"window_left={window_left}, causal={causal}, dropout_p={dropout_p}")
    if cap_log2 > 0 and dropout_p > 0:
        raise ValueError(f"the Gluon dK/dV runs softcap without dropout, got cap_log2={cap_log2} with "
                         f"dropout_p={dropout_p}")
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    fused = dq_accum is not None
    dropout = dropout_p > 0
    if fused and not fuses_dq(headdim, dropout, options):
        raise ValueError(f"the Gluon dK/dV adds dQ itself only with K in shared memory and TMA reduce-adds "
                         f"(fuses_dq), got register_kv={options.register_kv}, TMA_REDUCE={TMA_REDUCE}")
    if dropout and seed_offset is None:
        raise ValueError(f"the Gluon dK/dV draws dropout from a seed_offset tensor, got dropout_p={dropout_p} with "
                         f"seed_offset=None")
    if fused and (dq_accum.dtype != torch.float32 or dq_accum.shape != q.shape):
        raise ValueError(f"dq_accum must be float32 shaped like q {tuple(q.shape)}, got {dq_accum.dtype} "
                         f"{tuple(dq_accum.shape)}")
    block_m = BLOCK_M[headdim]
    q_desc, q_rows, q_cols = descriptor(q, block_m)
    do_desc, do_rows, do_cols = descriptor(dout, block_m)
    k_desc, k_rows, k_cols = descriptor(k, BLOCK_N)
    v_desc, v_rows, v_cols = descriptor(v, BLOCK_N)
    # the kernel addresses both by the LSE's strides: delta is made by empty_like(lse) (ops.attn_bwd_impl)
    assert delta.stride() == lse.stride() and lse.stride(-1) == 1, (lse.stride(), delta.stride())
    lse_desc, delta_desc = vector_descriptor(lse, block_m), vector_descriptor(delta, block_m)
    dq_desc, dq_rows, dq_cols = fp32_descriptor(dq_accum, block_m) if fused else (None, (0, 0), 0)
    store_tma = stores_by_tma(dropout, options)
    if store_tma:
        dk_desc, dk_rows, dk_cols = descriptor(dk, HALF_N)
        dv_desc, dv_rows, dv_cols = descriptor(dv, HALF_N)
    else:
        dk_desc, dk_rows, dk_cols, dv_desc, dv_rows, dv_cols = None, (0, 0), 0, None, (0, 0), 0
    if varlen is not None:  # the kernel reads each sequence's lengths from cu_seqlens
        grid, seqlen_q, seqlen_k, order = (nheads_k * blocks.shape[1],), 0, 0, 1
    else:
        grid = (batch * nheads_k * cdiv(seqlen_k, BLOCK_N),)
        order = head_group(causal, cdiv(seqlen_k, BLOCK_N), q.device, options.head_group)
    reg_kv, consumer_regs = options.register_kv, options.dkdv_consumer_registers
    launch(
        attn_bwd_dkdv_hopper_kernel, grid, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc, dk, dv,
        dk_desc, dv_desc, alibi_slopes, seed_offset, cu_seqlens_q, cu_seqlens_k, blocks,
        dk_rows, dk_cols, dv_rows, dv_cols,
        q_rows, q_cols, do_rows, do_cols, k_rows, k_cols, v_rows, v_cols, dq_rows, dq_cols,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        lse.stride(0), lse.stride(1), alibi_batch_stride(alibi_slopes),
        nheads_k, nheads // nheads_k, seqlen_q, seqlen_k, qk_scale, cap_log2, softmax_scale, dropout_p,
        max(window_left, 0),
        CAUSAL=causal, KEY_TAIL=varlen is not None or seqlen_k % BLOCK_N != 0, HEADDIM=headdim, BLOCK_M=block_m,
        HALF_N=HALF_N, STAGES=STAGES, HEAD_GROUP=order,
        ALIBI=alibi_slopes is not None, SOFTCAP=cap_log2 > 0,
        REG_KV=register_kv(headdim, dropout, fused) if reg_kv is None else reg_kv,
        LSE_FIRST=lse_first(headdim),
        CONSUMER_REGS=consumer_registers(headdim, dropout) if consumer_regs is None else consumer_regs,
        PRODUCER_REGS=worker_registers(dropout), FUSED_DQ=fused, DROPOUT=dropout, VARLEN=varlen is not None,
        WINDOW=window_left >= 0, STORE_TMA=store_tma,
        num_warps=4, maxnreg=launch_maxnreg(dropout), cached_launch=options.cached_launch, on_stream=stream,
        site=site, record=Record(site, (q, dout, k, v, lse, delta, dq_accum, dk, dv, dk, dv, alibi_slopes,
                                        seed_offset, cu_seqlens_q, cu_seqlens_k, blocks), floats),
    )
