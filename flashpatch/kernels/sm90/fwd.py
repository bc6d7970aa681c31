"""Forward attention for Hopper (sm_90) in Gluon, warp-specialized like dkdv.py: one producer warp and two consumer
warpgroups per program (three at head dim 64: CONSUMERS_BY_HEADDIM), synchronised by mbarriers.

  producer (1 warp):     Q of the program's 128 (192) queries once; then, per step, TMA loads of a (BLOCK_N, D)
                         tile of K and one of V into a ring of STAGES buffers, each with its own `ready` mbarrier,
                         so Q Kᵀ can start before V has landed.
  consumer w (4 warps):  queries [m0 + 64 w, m0 + 64 w + 64): per step S = Q Kᵀ, the online softmax in exp2
                         (running max m, running sum l), O = O · exp2(m_old - m) + P V; the stage is released
                         (`empty`, one arrival per consumer) once P V is done.

No consumer waits for another, so one's softmax runs under the others' matmuls (FA3's intra-warpgroup skew on top of
that measured slower). Causal masks are bottom-right aligned; the steps that cross the diagonal run a masked copy of the
step, the others none. Softcap (SOFTCAP) makes the scores softcap * tanh(s / softcap) (`common.softcap_tanh`); ALiBi
slopes, when given (ALIBI), then add -slope * |i + Sk - Sq - j| to every step's scores (`alibi_bias`). LSE is stored in
natural log, +inf for a row that sees no key (its output is 0), as the Triton forward does (triton/forward.py), so both
backward kernels take it. Scope: `supported`. Lengths need not divide the tiles: the 2-D TMA views run on past a
sequence's end into the next head's or batch's rows (or zeros past the tensor), so a last query block computes rows that
its masked stores skip, and a last key block's keys past seqlen_k are masked like a causal diagonal (common.key_limit).

A persistent grid (`_persistent_fwd`, where config.persistent_grid chooses it: head dim 128, dense rows, with or
without a sliding window; head dim 64, causal rows of up to 4096) launches one program per SM instead, each looping
over query blocks (common.query_tile), so that a block's Q load and first K/V blocks run under the previous block's
steps and epilogue, which narrow windows' short blocks gain most from. On a varlen batch (`_varlen_persistent_fwd`,
head dims 64 and 128), whose blocks cost from one to dozens of key steps, a static deal ends unevenly: there each
program's producer takes the next (head, (sequence, block)) item by a ticket from a counter in global memory
(common.take_ticket) and hands its fields to the consumers with its Q (common.hand_item), so a program that finishes
early takes more. Under a causal mask without a window the programs take their blocks from a table built on the host
(schedule.causal_schedule: head groups kept together for L2, the load balanced). Its consumers' loop is pipelined by
one matmul (`_fwd_block_pipelined`): a step issues the previous block's P V and then its own S = Q Kᵀ and waits for
both, so the tensor core runs them back to back. docs/tuning.md ("Gluon forward") has the measurements.

With dropout (two consumers, on either grid) the keep bits come from warps of their own, as in dkdv.py's backward, so
that the Philox arithmetic runs beside the consumers' matmuls and softmax; a persistent program's drawers take the
same tiles as its consumers (`_fwd_keep_drawer_persistent`), and at head dim 128 its consumers run one matmul at a
time (`_fwd_block_serial`: the registers left beside the drawers do not hold the pipelined loop's two score tiles):

  drawer w (4 warps):    per step, the Philox calls of consumer w's (64 queries, 128 keys) tile at the counters of
                         triton.common.dropout_keep (the bits every kernel draws), eight decisions a call shifted into
                         two 32-bit words per consumer thread, into a ring of KEEP_SLOTS slots (`keep_full` /
                         `keep_empty`); the consumer zeroes the dropped weights of P (`_fwd_drop`) before P V, after the
                         running sum has counted them.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from flashpatch.kernels.config import head_group, persistent_grid, sm_count
from flashpatch.kernels.launch import Record, cdiv, launch, replay
from flashpatch.kernels.options import DEFAULT, KernelOptions
from flashpatch.kernels.sm90.common import (
    allocate_item_slots, allocate_keep_ring, allocate_kv_ring, allocate_query_barriers, alibi_bias, carry_addend,
    carry_shift_in_ptx, descriptor, drop_pairs, dropout_seed_offset, hand_item, head_slope_log2, kept_dims,
    key_limit, key_steps, persistent_rounds, persistent_tile, philox_wide, producer_persistent, query_block_program,
    query_tile, read_item, release_tickets, sm90_dense_ok, softcap_tanh, store_tile_by_tma, stream_kv, take_ticket,
    tma_load, varlen_item, varlen_query_block_program, window_keys, window_steps)
from flashpatch.kernels.sm90.schedule import causal_schedule_tensor
from flashpatch.kernels.triton.common import alibi_batch_stride, dropout_head_rows

HALF_M = 64  # queries per consumer warpgroup
BLOCK_M = 2 * HALF_M  # queries per program with two consumer warpgroups
# Consumer warpgroups per program (one program per query block; the persistent grid keeps two): FA3 runs head dim 64
# with three, 192 queries per program, so that two warpgroups' matmuls cover the third's softmax, which at head dim
# 64 costs as much as its matmuls (docs/tuning.md, "Gluon forward").
CONSUMERS_BY_HEADDIM = {64: 3, 128: 2, 256: 2}
BLOCK_N = 128  # keys per step
# At head dim 256, 64 keys a step: a consumer's (64, 256) fp32 output takes 128 of its registers, and two stages of
# (64, 256) K and V tiles beside the program's (128, 256) Q fill 192 KB of shared memory
BLOCK_N_D256 = 64
STAGES = 2  # K/V ring depth
MAXNREG = 168  # 12 warps x 168 = the register file; setmaxnreg moves them to the consumers
MAXNREG_3 = 128  # three consumers: 13 warps, launched as 16 (a multiple of 4): 16 x 32 x 128 = 64K
# Dropout (two consumers at either head dim, on either grid): two drawer partitions of
# DRAWER_WARPS warps each (`_fwd_keep_drawer`) draw each consumer's keep bits beside its matmuls, as dkdv.py's drawers
# do for the backward; `dropout_registers` splits the register file. Four warps each beat two (docs/tuning.md, the
# dropout forward).
DRAWER_WARPS = 4
KEEP_SLOTS = 2  # each consumer's ring of keep words


# Dropout. A consumer's step tile S is (HALF_M, BLOCK_N) = (64 queries, 128 keys). In the wgmma accumulator layout
# a thread holds query bit 3 and key bits 0, 3, 4, 5, 6 in its registers, so the eight decisions of a Philox call
# (query bit 3, key bits 0 and 3: triton.common.dropout_keep) all land in one thread, eight calls a step
# (key >> 4). They come from the consumer's drawer as two 32-bit words per consumer thread: decision (query bit 3,
# key) is word key >> 6's bit
#     8 * ((key >> 4) & 3) + 2 * (2 * query bit 3 + key bit 3) + key bit 0,
# the order in which the drawer shifts them in (`_shift_in_call`); the consumer zeroes the dropped weights of P
# once it is 16-bit, two at a time (`_fwd_drop`).
# FWD_KEEP_TILE8 is S as (query >> 4, query bit 3, query & 7, key >> 6, (key >> 4) & 3, key bit 3, (key >> 1) & 3,
# key bit 0): the accumulator layout with its register dimensions apart, so that a thread's word broadcast over
# them gives each register its bit at a position known at compile time.
FWD_KEEP_TILE8 = gl.constexpr(gl.BlockedLayout(
    size_per_thread=[1, 2, 1, 2, 4, 2, 1, 2], threads_per_warp=[1, 1, 8, 1, 1, 1, 4, 1],
    warps_per_cta=[4, 1, 1, 1, 1, 1, 1, 1], order=[7, 1, 5, 4, 3, 6, 2, 0]))
FWD_KEEP_WORDS = kept_dims(FWD_KEEP_TILE8, (0, 2, 3, 6))  # (4, 8, 2, 4): a thread's two words
FWD_KEEP_QUERY3, FWD_KEEP_CALL, FWD_KEEP_KEY3, FWD_KEEP_KEY0 = (kept_dims(FWD_KEEP_TILE8, (dim, ))
                                                               for dim in (1, 4, 5, 7))
# the drawer's tile, a slot's words (query >> 4, query & 7, key >> 6, (key >> 1) & 3) over its DRAWER_WARPS warps: a
# lane draws the words of two consumer warps
FWD_KEEP_DRAW = gl.constexpr(gl.BlockedLayout([2, 1, 1, 1], [1, 8, 1, 4], [2, 1, 2, 1], [3, 1, 2, 0]))
FWD_KEEP_SHARED = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))  # a slot's (4, 8, 2, 4) words
_KEEP_SLOTS = gl.constexpr(KEEP_SLOTS)  # as the kernel reads it

# One Philox call's eight decisions shifted into a word, r3's high half first and r0's low half last, so that
# after four calls call c's decision (output word k, half h) sits at bit 8 (c & 3) + 2 k + h. A decision
# half >= t is the carry out of half * 2^16 + (2^32 - t * 2^16), which `addc` shifts in (dkdv.py's
# drawers do the same for two words at once). $0: the word out; $1..$4: r0..r3; $5: 2^32 - t * 2^16; $6: the
# word in.
_SHIFT_IN_ASM = gl.constexpr(carry_shift_in_ptx(
    [(r, half, "$0", "$6" if (r, half) == ("$4", "hi") else "$0") for r in ("$4", "$3", "$2", "$1")
     for half in ("hi", "lo")], "$5"))


@gluon.jit
def _shift_in_call(word, r0, r1, r2, r3, carry_addend):
    """`_SHIFT_IN_ASM`: one call's decisions shifted into `word`."""
    return gl.inline_asm_elementwise(_SHIFT_IN_ASM, "=&r,r,r,r,r,r,r", [r0, r1, r2, r3, carry_addend, word],
                                     dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _fwd_keep_drawer(args, WG: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Drawer partition WG of a program of one query block: consumer WG's keep words for the block's n_steps key
    blocks (`_draw_block`)."""
    (keep_parts, SEED_OFFSET, dropout_p, off_b, nheads, off_h, seqlen_q, seqlen_k, m0, n_steps) = args
    seed, offset = dropout_seed_offset(SEED_OFFSET, True)
    addend, keep_all = carry_addend(dropout_p)
    rows0 = dropout_head_rows(off_b, nheads, off_h, seqlen_q) + (m0 + WG * HALF_M) // 2
    _draw_block(keep_parts, seed, offset, addend, keep_all, gl.cdiv(seqlen_k, 16) * 4, rows0, n_steps, 0, WG,
                BLOCK_N)


@gluon.jit
def _fwd_keep_drawer_persistent(args, WG: gl.constexpr, CAUSAL: gl.constexpr, HALF_M: gl.constexpr,
                                BLOCK_N: gl.constexpr, HEAD_GROUP: gl.constexpr):
    """Drawer partition WG of a persistent program: consumer WG's keep words for each of the program's tiles in
    the consumers' order (common.persistent_tile, common.query_tile), counted on across tiles as the K/V ring is."""
    (keep_parts, SEED_OFFSET, dropout_p, num_tiles, nheads, group_size, seqlen_q, seqlen_k, SCHEDULE,
     schedule_rounds) = args
    seed, offset = dropout_seed_offset(SEED_OFFSET, True)
    addend, keep_all = carry_addend(dropout_p)
    groups_per_row = gl.cdiv(seqlen_k, 16) * 4
    ring = 0
    for rnd in range(persistent_rounds(num_tiles, SCHEDULE, schedule_rounds)):
        tile = persistent_tile(rnd, SCHEDULE, schedule_rounds)
        if tile < num_tiles:
            off_b, off_h, _, m0, _, _, _, _, n_steps = query_tile(
                tile, num_tiles, seqlen_q, seqlen_k, nheads, group_size, 0, CAUSAL, 2 * HALF_M, BLOCK_N,
                HEAD_GROUP, False)
            rows0 = dropout_head_rows(off_b, nheads, off_h, seqlen_q) + (m0 + WG * HALF_M) // 2
            _draw_block(keep_parts, seed, offset, addend, keep_all, groups_per_row, rows0, n_steps, ring, WG,
                        BLOCK_N)
            ring += n_steps


@gluon.jit
def _draw_block(keep_parts, seed, offset, addend, keep_all, groups_per_row, rows0, n_steps, ring, WG: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """A query block's keep words for consumer WG, key block by key block, into its ring of slots (`keep_full` /
    `keep_empty`; key block i is the program's step ring + i), drawn at triton.common.dropout_keep's counters (the
    bits that the backward and the Triton kernels draw) from counter row rows0: the lanes of the drawer's warps in
    layout FWD_KEEP_DRAW over the slot's words, each lane runs calls 4 word .. 4 word + 3 of the consumer threads
    whose words it holds, one call of each at once."""
    DRAW: gl.constexpr = FWD_KEEP_DRAW
    keep_bufs, keep_full, keep_empty = keep_parts
    SLOTS: gl.constexpr = keep_bufs.shape[0] // 2  # each consumer's
    # counter row rows0 + 8 (query >> 4) + (query & 7) of each of the slot's (4, 8) query rows
    query_lo = 8 * _draw_index(4, 0, DRAW) + _draw_index(8, 1, DRAW)
    word = _draw_index(2, 2, DRAW)
    key_mid = _draw_index(4, 3, DRAW)
    for i in range(n_steps):
        c = ring + i
        s = WG * SLOTS + c % SLOTS
        # the slot's words of step c - SLOTS read (a fresh mbarrier counts as having completed the phase before
        # 0, so the first lap does not wait); with two slots a step's draw still runs under the step before
        mbarrier.wait(keep_empty.index(s), ((c // SLOTS) & 1) ^ 1)
        # call c = 4 word + 3 - j of key block i: counter column i BLOCK_N / 4 + 4 c + (key >> 1) & 3
        col = i * (BLOCK_N // 4) + word * 16 + key_mid + 12  # (1, 1, 2, 4): j = 0
        base = offset + (rows0 + query_lo).to(gl.int64) * groups_per_row + col  # (4, 8, 2, 4)
        words = gl.zeros(base.shape, gl.uint32, DRAW)
        for j in range(4):  # a call of each of the lane's words in flight
            r0, r1, r2, r3 = philox_wide(seed, base - 4 * j)
            words = _shift_in_call(words, r0, r1, r2, r3, addend)
        keep_bufs.index(s).store(gl.where(keep_all, 0xFFFFFFFF, words).to(gl.int32, bitcast=True))
        gl.thread_barrier()  # every lane's words written before the consumer is told
        mbarrier.arrive(keep_full.index(s))


@gluon.jit
def _keep_words(keep_parts, c, WG: gl.constexpr, DROPOUT: gl.constexpr = True):
    """Consumer WG's keep words of its step c (FWD_KEEP_WORDS), once its drawer has written them, and their slot
    (to arrive at `keep_empty` once they are used: `_release_keep`); (0, 0) without DROPOUT."""
    if DROPOUT:
        keep_bufs, keep_full, keep_empty = keep_parts
        KEEP_SLOTS: gl.constexpr = keep_bufs.shape[0] // 2
        keep_slot = WG * KEEP_SLOTS + c % KEEP_SLOTS
        mbarrier.wait(keep_full.index(keep_slot), (c // KEEP_SLOTS) & 1)
        return keep_bufs.index(keep_slot).load(FWD_KEEP_WORDS), keep_slot
    else:
        return 0, 0


@gluon.jit
def _draw_index(n: gl.constexpr, DIM: gl.constexpr, DRAW: gl.constexpr):
    """arange(0, n) along dimension DIM of the drawer's 4-D layout DRAW, the other three dimensions of size 1."""
    L3: gl.constexpr = gl.SliceLayout(3, DRAW)
    if DIM == 0:
        return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None, None]
    elif DIM == 1:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None, None]
    elif DIM == 2:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :, None]
    else:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, DRAW))))[
            None, None, None, :]


@gluon.jit
def _fwd_drop(p, words):
    """The step's P ((HALF_M, BLOCK_N), 16-bit, the consumer's S layout) with the dropped weights zeroed, from the
    consumer thread's two words (FWD_KEEP_WORDS): `common.drop_pairs`, each register's bit at a position known at
    compile time; the pairs are adjacent keys (key bit 0)."""
    query3 = gl.arange(0, 2, layout=FWD_KEEP_QUERY3)[None, :, None, None, None, None, None, None]
    call = gl.arange(0, 4, layout=FWD_KEEP_CALL)[None, None, None, None, :, None, None, None]
    key3 = gl.arange(0, 2, layout=FWD_KEEP_KEY3)[None, None, None, None, None, :, None, None]
    key0 = gl.arange(0, 2, layout=FWD_KEEP_KEY0)[None, None, None, None, None, None, None, :]
    bit = 8 * call + 4 * query3 + 2 * key3 + key0
    return drop_pairs(p, words[:, None, :, :, None, None, :, None], bit, key0)


@gluon.jit
def _fwd_producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, ready_k, ready_v, empty, q_bar,
                  q_row, q_col, k_row, k_col, v_row, v_col, n_steps,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_TILES: gl.constexpr):
    """Q's Q_TILES tiles into q_smem (Q_TILES, rows, D), then the program's key blocks (`stream_kv`)."""
    mbarrier.expect(q_bar, Q_TILES * q_desc.block_type.nbytes)
    for t in gl.static_range(Q_TILES):
        tma_load(q_desc, [q_row + t * q_desc.block_type.shape[0], q_col], q_bar, q_smem.index(t))
    stream_kv(k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, empty, k_row, k_col, v_row, v_col, n_steps, 0,
              BLOCK_N, STAGES)


@gluon.jit
def _fwd_step(i, ring, acc, m_i, l_i, q_s, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, offs_m, offs_n,
              shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2, MASKED: gl.constexpr, ALIBI: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr, SOFTCAP: gl.constexpr, keep_parts,
              WG: gl.constexpr, DROPOUT: gl.constexpr, WINDOW: gl.constexpr):
    """Key block i into (acc, m_i, l_i), from the ring's slot `ring` (= i but in a persistent program); offs_n:
    the block's key indices relative to its start (plus the program's first key, `window_steps`); key_lo:
    common.window_keys', which MASKED steps apply under a WINDOW. DROPOUT: the step's keep words from consumer WG's
    drawer (keep_parts: the words' ring, its slots WG * KEEP_SLOTS + the step's, and their barriers); the running
    sum counts every weight, P V only the kept ones (`_fwd_epilogue` scales by 1 / (1 - p))."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    s = ring % STAGES
    phase = (ring // STAGES) & 1
    mbarrier.wait(ready_k.index(s), phase)
    qk = warpgroup_mma(q_s, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if DROPOUT:  # read under the matmul
        words, keep_slot = _keep_words(keep_parts, ring, WG)
    qk = warpgroup_mma_wait(0, deps=(qk, ))  # (HALF_M, BLOCK_N)
    p, m_new, l_i, alpha = _softmax_update(qk, m_i, l_i, offs_m, offs_n, i, shift, key_lim, key_lo, qk_scale, cap_log2,
                                           alibi_log2, MASKED, ALIBI, BLOCK_N, FOLD, SOFTCAP, WINDOW)
    p = p.to(q_s.dtype)
    if DROPOUT:
        p = _fwd_drop(p, words)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    mbarrier.wait(ready_v.index(s), phase)
    acc = warpgroup_mma(gl.convert_layout(p, a_layout), v_bufs.index(s), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(empty.index(s))
    if DROPOUT:
        _release_keep(keep_parts, keep_slot)
    return acc, m_new, l_i


@gluon.jit
def _softmax_update(qk, m_i, l_i, offs_m, offs_n, i, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2,
                    MASKED: gl.constexpr, ALIBI: gl.constexpr, BLOCK_N: gl.constexpr, FOLD: gl.constexpr,
                    SOFTCAP: gl.constexpr, WINDOW: gl.constexpr):
    """Scores of key block i into (P, new running max, new running sum, rescale factor of the old sums); the
    running max is in log2 units. MASKED: keys past each row's key_lim (common.key_limit) hidden, and under a
    WINDOW the keys before its key_lo (common.window_keys).

    SOFTCAP: the scores are cap_log2 * tanh(qk * qk_scale) (`common.softcap_tanh`).

    FOLD (ignored with ALiBi or SOFTCAP, which change the scaled scores): the row max is taken over the raw
    scores and scaled once per row, and the scale goes into the exponent's subtraction as one fused
    multiply-add per score, instead of a multiply per score and then a subtraction (qk_scale >= 0, which
    validation ensures, keeps the max where it was). SOFTCAP without ALiBi folds the same way: the scores are
    tanh's values and cap_log2 (> 0) is the scale."""
    if SOFTCAP and not ALIBI:  # tanh's values; cap_log2 goes inside the max and the exponent, as FOLD's scale
        scores = softcap_tanh(qk * qk_scale)
        scale = cap_log2
    elif FOLD and not ALIBI:
        scores = qk  # raw; scaled inside the max and the exponent below
        scale = qk_scale
    else:
        if SOFTCAP:
            scores = cap_log2 * softcap_tanh(qk * qk_scale)  # log2 units
        else:
            scores = qk * qk_scale  # log2 units
        if ALIBI:
            scores += alibi_bias(alibi_log2, offs_m[:, None] + shift, (i * BLOCK_N + offs_n)[None, :])
        scale = 1.0
    if MASKED:
        keys = (i * BLOCK_N + offs_n)[None, :]
        if WINDOW:
            scores = gl.where((keys <= key_lim[:, None]) & (keys >= key_lo[:, None]), scores, float("-inf"))
        else:
            scores = gl.where(keys <= key_lim[:, None], scores, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, axis=1) * scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays at 0
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(scores * scale - m_safe[:, None])
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _fwd_consumer(q_s, k_bufs, v_bufs, ready_k, ready_v, empty, q_bar, O, LSE, o_base, stride_os, lse_base,
                  m0, shift, n_full, n_steps, qk_scale, cap_log2, alibi_log2, seqlen_q, seqlen_k, CAUSAL: gl.constexpr,
                  WG: gl.constexpr, HEADDIM: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, ALIBI: gl.constexpr, FOLD: gl.constexpr, SOFTCAP: gl.constexpr, keep_parts,
                  keep_fraction, DROPOUT: gl.constexpr, window, WINDOW: gl.constexpr):
    """Consumer WG's queries of the program's block; with DROPOUT, keep_parts and keep_fraction = 1 - p
    (`_fwd_step`, `_fwd_epilogue`), else unused. window: (masked left-edge steps, the first key block's first key,
    window_left) of common.window_steps under a WINDOW, else unused."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # (queries, keys)
    # q_s: this warpgroup's (HALF_M, D) rows of Q
    offs_m = m0 + WG * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    key_lim = key_limit(offs_m, shift, seqlen_k, CAUSAL)
    offs_n, key_lo, n_lo = window_keys(offs_m, offs_n, shift, key_lim, window, WINDOW)
    acc, m_i, l_i = _fwd_block(q_s, q_bar, 0, 0, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, offs_m, offs_n,
                               shift, key_lim, key_lo, n_lo, n_full, n_steps, qk_scale, cap_log2, alibi_log2, HEADDIM,
                               HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP, keep_parts, WG, DROPOUT, WINDOW)
    _fwd_epilogue(acc, m_i, l_i, O, LSE, o_base, stride_os, lse_base, offs_m, m0 + WG * HALF_M, seqlen_q,
                  q_s.dtype, HEADDIM, HALF_M, keep_fraction, DROPOUT)


@gluon.jit
def _fresh_state(zero_s, HEADDIM: gl.constexpr, HALF_M: gl.constexpr):
    """A consumer's block state before its first key block: (running max, running sum, O accumulator), the first two
    in zero_s's (queries, keys) row layout, the accumulator (HALF_M, HEADDIM) in the wgmma layout of P V."""
    s_layout: gl.constexpr = zero_s.type.layout
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEADDIM, 16])  # (queries, D)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, s_layout))
    return m_i, l_i, gl.zeros([HALF_M, HEADDIM], gl.float32, o_layout)


@gluon.jit
def _fwd_block(q_s, q_bar, q_phase, ring, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, offs_m, offs_n, shift,
               key_lim, key_lo, n_lo, n_full, n_steps, qk_scale, cap_log2, alibi_log2, HEADDIM: gl.constexpr,
               HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ALIBI: gl.constexpr,
               FOLD: gl.constexpr, SOFTCAP: gl.constexpr, keep_parts, WG: gl.constexpr, DROPOUT: gl.constexpr,
               WINDOW: gl.constexpr):
    """A consumer warpgroup's HALF_M query rows offs_m in a program of one query block, once their Q has landed
    (q_bar's phase q_phase): the key blocks below the diagonal without a mask, then the masked ones, read from the
    K/V ring from slot `ring` on; under a WINDOW, the n_lo blocks on its left edge masked before them. Returns
    (acc, m_i, l_i) for `_fwd_epilogue`. keep_parts, WG, DROPOUT: `_fwd_step`'s. (The persistent program's consumers
    run `_fwd_block_pipelined`.)"""
    m_i, l_i, acc = _fresh_state(zero_s, HEADDIM, HALF_M)
    mbarrier.wait(q_bar, q_phase)
    if WINDOW:
        for i in range(0, n_lo):
            acc, m_i, l_i = _fwd_step(i, ring + i, acc, m_i, l_i, q_s, k_bufs, v_bufs, ready_k, ready_v, empty,
                                      zero_s, offs_m, offs_n, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2,
                                      True, ALIBI, BLOCK_N, STAGES, FOLD, SOFTCAP, keep_parts, WG, DROPOUT, WINDOW)
    for i in range(n_lo, n_full):
        acc, m_i, l_i = _fwd_step(i, ring + i, acc, m_i, l_i, q_s, k_bufs, v_bufs, ready_k, ready_v, empty,
                                  zero_s, offs_m, offs_n, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2,
                                  False, ALIBI, BLOCK_N, STAGES, FOLD, SOFTCAP, keep_parts, WG, DROPOUT, WINDOW)
    for i in range(n_full, n_steps):
        acc, m_i, l_i = _fwd_step(i, ring + i, acc, m_i, l_i, q_s, k_bufs, v_bufs, ready_k, ready_v, empty,
                                  zero_s, offs_m, offs_n, shift, key_lim, key_lo, qk_scale, cap_log2, alibi_log2,
                                  True, ALIBI, BLOCK_N, STAGES, FOLD, SOFTCAP, keep_parts, WG, DROPOUT, WINDOW)
    return acc, m_i, l_i


@gluon.jit
def _fwd_block_pipelined(q_s, q_bar, q_phase, ring, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, offs_m, offs_n,
                         shift, key_lim, key_lo, n_lo, n_full, n_steps, qk_scale, cap_log2, alibi_log2,
                         HEADDIM: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         ALIBI: gl.constexpr, FOLD: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
                         prev_q_empty, prev_storing, keep_parts, WG: gl.constexpr, DROPOUT: gl.constexpr):
    """`_fwd_block` for a persistent program's consumer, software-pipelined by one matmul: step i
    issues block i - 1's P V and then block i's S = Q Kᵀ and waits for both at once, so the tensor core runs them
    back to back instead of idling while the warpgroup waits for P V, releases the slot, and issues the next S. P is
    carried from one step to the next as the bf16 matmul operand; the same arithmetic in the same order as
    `_fwd_block`, so the outputs are the per-block program's bit for bit.

    One loop over the key blocks picks the masked step per block (`_pipelined_softmax`), in place of
    `_fwd_block`'s three loops: with two loops, Triton 3.6 compiled a persistent kernel so that the first consumer
    warpgroup's matmuls read the wrong shared memory whenever the unmasked loop had no trips (a causal tile at the
    diagonal), while the second warpgroup, the same code, was right. dq.py's persistent dQ keeps one loop too.

    With prev_storing set, the previous tile's O is under a TMA store from its Q buffer (`_persistent_tile`): the
    buffer goes back to the producer (prev_q_empty) once the store has read it, waited for under block 0's S.
    DROPOUT: block i's keep words are the program's step ring + i (`_keep_words`), read under its S."""
    m_i, l_i, acc = _fresh_state(zero_s, HEADDIM, HALF_M)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    p_op = gl.zeros([HALF_M, BLOCK_N], q_s.dtype, a_layout)  # block i - 1's P, the next P V's A operand
    mbarrier.wait(q_bar, q_phase)
    if n_steps > 0:  # block 0's S and P (a row block past every key, causal with Sq > Sk, has no steps)
        mbarrier.wait(ready_k.index(ring % STAGES), (ring // STAGES) & 1)
        qk = warpgroup_mma(q_s, k_bufs.index(ring % STAGES).permute((1, 0)), zero_s, use_acc=False,
                           is_async=True)
        _release_stored(prev_q_empty, prev_storing)
        words, keep_slot = _keep_words(keep_parts, ring, WG, DROPOUT)
        qk = warpgroup_mma_wait(0, deps=(qk, ))
        p_op, acc, m_i, l_i = _pipelined_softmax(qk, acc, m_i, l_i, offs_m, offs_n, 0, n_lo, n_full, shift, key_lim,
                                                 key_lo, qk_scale, cap_log2, alibi_log2, q_s.dtype, a_layout, ALIBI,
                                                 BLOCK_N, FOLD, SOFTCAP, WINDOW, words, DROPOUT)
        _release_keep(keep_parts, keep_slot, DROPOUT)
    else:
        _release_stored(prev_q_empty, prev_storing)
    for i in range(1, n_steps):
        prev = (ring + i - 1) % STAGES
        mbarrier.wait(ready_v.index(prev), ((ring + i - 1) // STAGES) & 1)
        pv = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        s = (ring + i) % STAGES
        mbarrier.wait(ready_k.index(s), ((ring + i) // STAGES) & 1)
        qk = warpgroup_mma(q_s, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        words, keep_slot = _keep_words(keep_parts, ring + i, WG, DROPOUT)
        qk, acc = warpgroup_mma_wait(0, deps=(qk, pv))
        mbarrier.arrive(empty.index(prev))
        p_op, acc, m_i, l_i = _pipelined_softmax(qk, acc, m_i, l_i, offs_m, offs_n, i, n_lo, n_full, shift, key_lim,
                                                 key_lo, qk_scale, cap_log2, alibi_log2, q_s.dtype, a_layout, ALIBI,
                                                 BLOCK_N, FOLD, SOFTCAP, WINDOW, words, DROPOUT)
        _release_keep(keep_parts, keep_slot, DROPOUT)
    if n_steps > 0:  # the last block's P V
        last = (ring + n_steps - 1) % STAGES
        mbarrier.wait(ready_v.index(last), ((ring + n_steps - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index(last))
    return acc, m_i, l_i


@gluon.jit
def _fwd_block_serial(q_s, q_bar, q_phase, ring, k_bufs, v_bufs, ready_k, ready_v, empty, zero_s, offs_m, offs_n,
                      shift, key_lim, n_full, n_steps, qk_scale, cap_log2, alibi_log2, HEADDIM: gl.constexpr,
                      HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ALIBI: gl.constexpr,
                      FOLD: gl.constexpr, SOFTCAP: gl.constexpr, prev_q_empty, prev_storing, keep_parts,
                      WG: gl.constexpr):
    """A persistent consumer's block with dropout and without a window, one step at a time as `_fwd_block` runs
    them (where the registers left beside the drawers do not hold `_fwd_block_pipelined`'s two score tiles), in one
    loop that picks the masked step per block (`_fwd_block_pipelined` says why one loop); prev_q_empty and
    prev_storing as there."""
    m_i, l_i, acc = _fresh_state(zero_s, HEADDIM, HALF_M)
    mbarrier.wait(q_bar, q_phase)
    _release_stored(prev_q_empty, prev_storing)
    for i in range(n_steps):
        if i < n_full:
            acc, m_i, l_i = _fwd_step(i, ring + i, acc, m_i, l_i, q_s, k_bufs, v_bufs, ready_k, ready_v, empty,
                                      zero_s, offs_m, offs_n, shift, key_lim, 0, qk_scale, cap_log2, alibi_log2,
                                      False, ALIBI, BLOCK_N, STAGES, FOLD, SOFTCAP, keep_parts, WG, True, False)
        else:
            acc, m_i, l_i = _fwd_step(i, ring + i, acc, m_i, l_i, q_s, k_bufs, v_bufs, ready_k, ready_v, empty,
                                      zero_s, offs_m, offs_n, shift, key_lim, 0, qk_scale, cap_log2, alibi_log2,
                                      True, ALIBI, BLOCK_N, STAGES, FOLD, SOFTCAP, keep_parts, WG, True, False)
    return acc, m_i, l_i


@gluon.jit
def _release_keep(keep_parts, keep_slot, DROPOUT: gl.constexpr = True):
    """A consumer's keep words of a step used: their slot goes back to its drawer (with DROPOUT)."""
    if DROPOUT:
        _, _, keep_empty = keep_parts
        mbarrier.arrive(keep_empty.index(keep_slot))


@gluon.jit
def _release_stored(q_empty, storing):
    """The previous tile's Q buffer handed back where its O was stored from it, once the store has read it."""
    tma.store_wait(0)
    mbarrier.arrive(q_empty, pred=storing != 0)


@gluon.jit
def _pipelined_softmax(qk, acc, m_i, l_i, offs_m, offs_n, i, n_lo, n_full, shift, key_lim, key_lo, qk_scale, cap_log2,
                       alibi_log2, dtype: gl.constexpr, a_layout: gl.constexpr, ALIBI: gl.constexpr,
                       BLOCK_N: gl.constexpr, FOLD: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
                       words, DROPOUT: gl.constexpr):
    """`_fwd_block_pipelined`'s step after its wait: block i's scores into P (the next P V's A operand: dtype,
    a_layout), masked past the first n_full blocks (and under a WINDOW before block n_lo), and acc rescaled by the
    running max's change. DROPOUT: the dropped weights of P zeroed by the step's keep words (`_fwd_drop`) after
    the running sum has counted them."""
    if WINDOW:
        unmasked = (i >= n_lo) & (i < n_full)
    else:
        unmasked = i < n_full
    if unmasked:
        p, m_i, l_i, alpha = _softmax_update(qk, m_i, l_i, offs_m, offs_n, i, shift, key_lim, key_lo, qk_scale,
                                             cap_log2, alibi_log2, False, ALIBI, BLOCK_N, FOLD, SOFTCAP, WINDOW)
    else:
        p, m_i, l_i, alpha = _softmax_update(qk, m_i, l_i, offs_m, offs_n, i, shift, key_lim, key_lo, qk_scale,
                                             cap_log2, alibi_log2, True, ALIBI, BLOCK_N, FOLD, SOFTCAP, WINDOW)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    p = p.to(dtype)
    if DROPOUT:
        p = _fwd_drop(p, words)
    return gl.convert_layout(p, a_layout), acc, m_i, l_i


@gluon.jit
def _fwd_epilogue(acc, m_i, l_i, O, LSE, o_base, stride_os, lse_base, offs_m, row0, seqlen_q,
                  dtype: gl.constexpr, HEADDIM: gl.constexpr, HALF_M: gl.constexpr, keep_fraction,
                  DROPOUT: gl.constexpr):
    """LSE (natural log) and O = acc / l of a warpgroup's HALF_M queries from row0 (offs_m: the same rows in
    the score layout), those before seqlen_q (a last query block may run past it: `supported`); with DROPOUT,
    O = acc / (l (1 - p)), keep_fraction = 1 - p."""
    o_layout: gl.constexpr = acc.type.layout
    out = _fwd_epilogue_lse(acc, m_i, l_i, LSE, lse_base, offs_m, seqlen_q, keep_fraction, DROPOUT).to(dtype)
    rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEADDIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + o_base + rows[:, None] * stride_os + offs_d[None, :], out, mask=(rows < seqlen_q)[:, None])


@gluon.jit
def _fwd_epilogue_lse(acc, m_i, l_i, LSE, lse_base, offs_m, seqlen_q, keep_fraction=1.0, DROPOUT: gl.constexpr = False):
    """`_fwd_epilogue`'s LSE stored, and its O in fp32 returned (acc's layout)."""
    empty_row = l_i == 0.0  # the row sees no key: output 0, LSE +inf (so backward recomputes P = 0)
    lse = gl.where(empty_row, float("inf"), (m_i + gl.log2(gl.where(empty_row, 1.0, l_i))) * 0.6931471805599453)
    gl.store(LSE + lse_base + offs_m, lse, mask=offs_m < seqlen_q)
    l_o = gl.convert_layout(gl.where(empty_row, 1.0, l_i), gl.SliceLayout(1, acc.type.layout))
    if DROPOUT:
        l_o = l_o * keep_fraction
    return acc / l_o[:, None]


@gluon.jit
def _persistent_tile(q_bufs, done, ring, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready, q_empty, zero_s, offs_key,
                     O, LSE, o_base, stride_os, lse_base, m0, shift, n_first, n_lo, n_full, n_steps, seqlen_q,
                     seqlen_k, qk_scale, cap_log2, alibi_log2, window_left, o_desc, o_row, o_col, storing,
                     WG: gl.constexpr, CAUSAL: gl.constexpr,
                     HEADDIM: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     ALIBI: gl.constexpr, FOLD: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
                     keep_parts=0, keep_fraction=1.0, DROPOUT: gl.constexpr = False):
    """A persistent consumer's tile `done` (its Q in buffer done % 2, its key blocks from ring slot `ring` on): the
    query block from row m0 with `window_steps`' counts (n_first, n_lo, n_full, n_steps), LSE stored from lse_base.
    A warpgroup whose rows all lie before seqlen_q writes its O tile over its own rows of the Q buffer and hands it
    to a TMA store (o_desc, from row o_row + its first, column o_col), and releases the buffer (`q_empty`) once the
    store has read it: in the next tile, under its first matmul (`_fwd_block_pipelined`). Its rows of a last block
    that runs past seqlen_q are stored from registers (masked), the buffer released before that. storing: whether the
    previous tile left a store to wait for; returns the same for this one. DROPOUT: keep_parts and keep_fraction
    = 1 - p (`_fwd_block_pipelined`, `_fwd_epilogue`)."""
    s_layout: gl.constexpr = zero_s.type.layout
    qb = done % 2
    q_s = q_bufs.index(qb).slice(WG * HALF_M, HALF_M)  # (HALF_M, D)
    offs_m = m0 + WG * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    key_lim = key_limit(offs_m, shift, seqlen_k, CAUSAL)
    offs_n, key_lo, n_lo = window_keys(offs_m, offs_key, shift, key_lim, (n_lo, n_first * BLOCK_N, window_left),
                                       WINDOW)
    if DROPOUT and HEADDIM > 64:  # 168 registers (`dropout_registers`): the pipelined loop's wgmma serialize
        acc, m_i, l_i = _fwd_block_serial(q_s, q_ready.index(qb), (done // 2) & 1, ring, k_bufs, v_bufs, ready_k,
                                          ready_v, empty, zero_s, offs_m, offs_n, shift, key_lim, n_full, n_steps,
                                          qk_scale, cap_log2, alibi_log2, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI,
                                          FOLD, SOFTCAP, q_empty.index(1 - qb), storing, keep_parts, WG)
    else:
        acc, m_i, l_i = _fwd_block_pipelined(q_s, q_ready.index(qb), (done // 2) & 1, ring, k_bufs, v_bufs, ready_k,
                                             ready_v, empty, zero_s, offs_m, offs_n, shift, key_lim, key_lo, n_lo,
                                             n_full, n_steps, qk_scale, cap_log2, alibi_log2, HEADDIM, HALF_M,
                                             BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP, WINDOW, q_empty.index(1 - qb),
                                             storing, keep_parts, WG, DROPOUT)
    row0 = m0 + WG * HALF_M
    if row0 + HALF_M <= seqlen_q:
        o_tile = _fwd_epilogue_lse(acc, m_i, l_i, LSE, lse_base, offs_m, seqlen_q, keep_fraction, DROPOUT)
        store_tile_by_tma(o_desc, [o_row + WG * HALF_M, o_col], q_s, o_tile.to(q_s.dtype))
        storing = 1
    else:
        mbarrier.arrive(q_empty.index(qb))
        _fwd_epilogue(acc, m_i, l_i, O, LSE, o_base, stride_os, lse_base, offs_m, row0, seqlen_q, q_s.dtype,
                      HEADDIM, HALF_M, keep_fraction, DROPOUT)
        storing = 0
    return storing


@gluon.jit
def _persistent_constants(HALF_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """A persistent consumer's (key offsets within a block, zero score tile) in the (queries, keys) score layout,
    made once for all its tiles (`_persistent_tile`)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # (queries, keys)
    return (gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)),
            gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout))


@gluon.jit
def _fwd_consumer_persistent(args, WG: gl.constexpr, CAUSAL: gl.constexpr,
                             HEADDIM: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             STAGES: gl.constexpr, HEAD_GROUP: gl.constexpr, ALIBI: gl.constexpr,
                             FOLD: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr, keep_parts,
                             keep_fraction, DROPOUT: gl.constexpr):
    """`_fwd_consumer` over this program's tiles (common.query_tile), the producer's order (`_persistent_tile`);
    DROPOUT: keep_parts and keep_fraction as there."""
    (q_bufs, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready, q_empty, O, LSE, ALIBI_SLOPES, stride_ob, stride_os,
     stride_oh, stride_lse_b, stride_lse_h, stride_alibi_b, num_tiles, nheads, group_size, seqlen_q, seqlen_k,
     qk_scale, cap_log2, SCHEDULE, schedule_rounds, window_left, o_desc, o_rows, o_cols) = args
    offs_key, zero_s = _persistent_constants(HALF_M, BLOCK_N)
    ring = 0
    done = 0
    storing = 0  # the last tile's O is in its Q buffer, under a TMA store (`_persistent_tile`)
    for rnd in range(persistent_rounds(num_tiles, SCHEDULE, schedule_rounds)):
        tile = persistent_tile(rnd, SCHEDULE, schedule_rounds)
        if tile < num_tiles:
            off_b, off_h, off_hk, m0, shift, n_first, n_lo, n_full, n_steps = query_tile(
                tile, num_tiles, seqlen_q, seqlen_k, nheads, group_size, window_left, CAUSAL, 2 * HALF_M, BLOCK_N,
                HEAD_GROUP, WINDOW)
            alibi_log2 = head_slope_log2(ALIBI_SLOPES, off_b * stride_alibi_b + off_h, ALIBI)
            storing = _persistent_tile(
                q_bufs, done, ring, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready, q_empty, zero_s, offs_key, O,
                LSE, off_b * stride_ob + off_h * stride_oh, stride_os, off_b * stride_lse_b + off_h * stride_lse_h, m0,
                shift, n_first, n_lo, n_full, n_steps, seqlen_q, seqlen_k, qk_scale, cap_log2, alibi_log2,
                window_left, o_desc, off_b * o_rows[0] + off_h * o_rows[1] + m0, off_h * o_cols, storing, WG, CAUSAL,
                HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP, WINDOW, keep_parts, keep_fraction, DROPOUT)
            ring += n_steps
            done += 1
    tma.store_wait(0)  # the last tile's O written before the program's shared memory goes


@gluon.jit
def attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc, O, LSE, ALIBI_SLOPES, SEED_OFFSET, SCHEDULE, CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS,
    TILE_COUNTER, o_desc, o_rows, o_cols,  # o_*: the persistent forms' TMA stores of O (None otherwise)
    q_rows, q_cols, k_rows, k_cols, v_rows, v_cols,  # (per batch, per head) of each view
    stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h, stride_alibi_b,
    num_tiles, nheads, group_size, seqlen_q, seqlen_k, qk_scale, cap_log2, dropout_p, schedule_rounds, window_left,
    CAUSAL: gl.constexpr, HEADDIM: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HEAD_GROUP: gl.constexpr, ALIBI: gl.constexpr, PERSISTENT: gl.constexpr,
    FOLD: gl.constexpr, SOFTCAP: gl.constexpr, CONSUMERS: gl.constexpr, DROPOUT: gl.constexpr,
    DRAWER_WARPS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr, VARLEN: gl.constexpr, WINDOW: gl.constexpr,
):
    # WINDOW: a causal sliding window of window_left keys (common.window_steps)
    gl.static_assert(not WINDOW or (CAUSAL and not DROPOUT), "a sliding window runs causal, without dropout")
    if PERSISTENT and VARLEN:  # num_tiles: heads x VARLEN_BLOCKS' pairs, taken by tickets from TILE_COUNTER
        gl.static_assert(not DROPOUT, "the varlen form draws no dropout")
        _varlen_persistent_fwd(q_desc, k_desc, v_desc, O, LSE, ALIBI_SLOPES, TILE_COUNTER, VARLEN_BLOCKS,
                               o_desc, o_rows, o_cols, CU_SEQLENS_Q, CU_SEQLENS_K, q_rows, q_cols, k_rows, k_cols,
                               v_rows, v_cols, stride_os, stride_oh, stride_lse_h, stride_alibi_b, num_tiles, nheads,
                               group_size, qk_scale, cap_log2, window_left, CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES,
                               ALIBI, FOLD, SOFTCAP, WINDOW)
        return
    if PERSISTENT:  # num_tiles: batch x heads x query blocks, which the programs take in turn
        _persistent_fwd(q_desc, k_desc, v_desc, O, LSE, ALIBI_SLOPES, SEED_OFFSET, o_desc, o_rows, o_cols, q_rows,
                        q_cols, k_rows, k_cols, v_rows, v_cols, stride_ob, stride_os, stride_oh, stride_lse_b,
                        stride_lse_h, stride_alibi_b, num_tiles, nheads, group_size, seqlen_q, seqlen_k, qk_scale,
                        cap_log2, dropout_p, SCHEDULE, schedule_rounds, window_left, CAUSAL, HEADDIM, HALF_M, BLOCK_N,
                        STAGES, HEAD_GROUP, ALIBI, FOLD, SOFTCAP, WINDOW, DROPOUT, DRAWER_WARPS, CONSUMER_REGS,
                        WORKER_REGS)
        return
    if VARLEN:  # the views' rows are the packed tokens: a sequence starts at its cu_seqlens entry
        gl.static_assert(not DROPOUT, "the varlen form draws no dropout")
        off_b, off_h, off_hk, m0, shift, n_full, n_steps, q_base, k_base, seqlen_q, seqlen_k = (
            varlen_query_block_program(VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, nheads, group_size, CAUSAL,
                                       CONSUMERS * HALF_M, BLOCK_N))
        o_base = q_base * stride_os + off_h * stride_oh
        lse_base = off_h * stride_lse_h + q_base
        v_base = k_base
    else:
        off_b, off_h, off_hk, m0, shift, n_full, n_steps = query_block_program(
            seqlen_q, seqlen_k, nheads, group_size, CAUSAL, CONSUMERS * HALF_M, BLOCK_N, HEAD_GROUP)
        o_base = off_b * stride_ob + off_h * stride_oh
        lse_base = off_b * stride_lse_b + off_h * stride_lse_h
        q_base = off_b * q_rows[0]
        k_base = off_b * k_rows[0]
        v_base = off_b * v_rows[0]
    window = 0
    if WINDOW:  # the key blocks from the first one the block's first row sees: the K/V stream starts there
        n_first, n_lo, n_full, n_steps = window_steps(m0, shift, n_full, n_steps, window_left, CONSUMERS * HALF_M,
                                                      BLOCK_N, WINDOW)
        k_base += n_first * BLOCK_N
        v_base += n_first * BLOCK_N
        window = (n_lo, n_first * BLOCK_N, window_left)
    # Q in Q_TILES TMA tiles (a TMA tile's rows are a power of two: three consumers load one per warpgroup)
    Q_TILES: gl.constexpr = 1 if CONSUMERS == 2 else CONSUMERS
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_TILES] + q_desc.block_type.shape, q_desc.layout)
    k_bufs, v_bufs, ready_k, ready_v, empty = allocate_kv_ring(k_desc, v_desc, STAGES, CONSUMERS)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    if DROPOUT:  # each consumer's KEEP_SLOTS slots of keep words, filled by its drawer
        keep_bufs, keep_full, keep_empty = allocate_keep_ring(_KEEP_SLOTS, [4, 8, 2, 4], FWD_KEEP_SHARED)
    fence_async_shared()

    alibi_log2 = head_slope_log2(ALIBI_SLOPES, off_b * stride_alibi_b + off_h, ALIBI)
    q_row = q_base + off_h * q_rows[1] + m0
    k_row = k_base + off_hk * k_rows[1]
    v_row = v_base + off_hk * v_rows[1]
    if DROPOUT:  # two consumers at either head dim (`attn_fwd`)
        keep_parts = (keep_bufs, keep_full, keep_empty)
        drawer_args = (keep_parts, SEED_OFFSET, dropout_p, off_b, nheads, off_h, seqlen_q, seqlen_k, m0, n_steps)
        gl.warp_specialize([
            (_fwd_consumer, (q_smem.index(0).slice(0, HALF_M), k_bufs, v_bufs, ready_k, ready_v, empty, q_bar, O,
                             LSE, o_base, stride_os, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2,
                             alibi_log2,
                             seqlen_q, seqlen_k, CAUSAL, 0, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP,
                             keep_parts, 1.0 - dropout_p, True, 0, False)),
            (_fwd_consumer, (q_smem.index(0).slice(HALF_M, HALF_M), k_bufs, v_bufs, ready_k, ready_v, empty, q_bar,
                             O, LSE, o_base, stride_os, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2,
                             alibi_log2,
                             seqlen_q, seqlen_k, CAUSAL, 1, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP,
                             keep_parts, 1.0 - dropout_p, True, 0, False)),
            (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, ready_k, ready_v, empty, q_bar,
                             q_row, off_h * q_cols, k_row, off_hk * k_cols, v_row, off_hk * v_cols, n_steps,
                             BLOCK_N, STAGES, Q_TILES)),
            (_fwd_keep_drawer, (drawer_args, 0, HALF_M, BLOCK_N)),
            (_fwd_keep_drawer, (drawer_args, 1, HALF_M, BLOCK_N)),
        ], [4, 1, DRAWER_WARPS, DRAWER_WARPS], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS, WORKER_REGS])
    elif CONSUMERS == 3:  # head dim 64 (CONSUMERS_BY_HEADDIM): 13 warps share the register file
        gl.warp_specialize([
            (_fwd_consumer, (q_smem.index(0), k_bufs, v_bufs, ready_k, ready_v, empty, q_bar, O, LSE, o_base,
                             stride_os, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2, alibi_log2, seqlen_q,
                             seqlen_k, CAUSAL, 0, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP, 0, 1.0, False,
                             window, WINDOW)),
            (_fwd_consumer, (q_smem.index(1), k_bufs, v_bufs, ready_k, ready_v, empty, q_bar, O, LSE, o_base,
                             stride_os, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2, alibi_log2, seqlen_q,
                             seqlen_k, CAUSAL, 1, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP, 0, 1.0, False,
                             window, WINDOW)),
            (_fwd_consumer, (q_smem.index(2), k_bufs, v_bufs, ready_k, ready_v, empty, q_bar, O, LSE, o_base,
                             stride_os, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2, alibi_log2, seqlen_q,
                             seqlen_k, CAUSAL, 2, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP, 0, 1.0, False,
                             window, WINDOW)),
            (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, ready_k, ready_v, empty, q_bar,
                             q_row, off_h * q_cols, k_row, off_hk * k_cols, v_row, off_hk * v_cols, n_steps,
                             BLOCK_N, STAGES, Q_TILES)),
        ], [4, 4, 1], [160, 160, 24])
    else:
        gl.warp_specialize([
            (_fwd_consumer, (q_smem.index(0).slice(0, HALF_M), k_bufs, v_bufs, ready_k, ready_v, empty, q_bar, O,
                             LSE, o_base, stride_os, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2,
                             alibi_log2,
                             seqlen_q, seqlen_k, CAUSAL, 0, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP, 0,
                             1.0, False, window, WINDOW)),
            (_fwd_consumer, (q_smem.index(0).slice(HALF_M, HALF_M), k_bufs, v_bufs, ready_k, ready_v, empty, q_bar,
                             O, LSE, o_base, stride_os, lse_base, m0, shift, n_full, n_steps, qk_scale, cap_log2,
                             alibi_log2,
                             seqlen_q, seqlen_k, CAUSAL, 1, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP, 0,
                             1.0, False, window, WINDOW)),
            (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, ready_k, ready_v, empty, q_bar,
                             q_row, off_h * q_cols, k_row, off_hk * k_cols, v_row, off_hk * v_cols, n_steps,
                             BLOCK_N, STAGES, Q_TILES)),
        ], [4, 1], [232, 24])


@gluon.jit
def _persistent_fwd(q_desc, k_desc, v_desc, O, LSE, ALIBI_SLOPES, SEED_OFFSET, o_desc, o_rows, o_cols, q_rows, q_cols,
                    k_rows, k_cols, v_rows, v_cols,
                    stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h, stride_alibi_b,
                    num_tiles, nheads, group_size, seqlen_q, seqlen_k, qk_scale, cap_log2, dropout_p, SCHEDULE,
                    schedule_rounds, window_left, CAUSAL: gl.constexpr, HEADDIM: gl.constexpr, HALF_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HEAD_GROUP: gl.constexpr, ALIBI: gl.constexpr,
                    FOLD: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr, DROPOUT: gl.constexpr,
                    DRAWER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr):
    """The PERSISTENT kernel body: two Q buffers (the next tile's Q loads under this one's steps), the K/V
    ring, and the same three partitions looping over the program's tiles (`persistent_tile`: SCHEDULE's, or
    the closed form where it is None), with or without a sliding window; with DROPOUT, two drawer partitions
    beside them (`_fwd_keep_drawer_persistent`) taking the same tiles."""
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs, v_bufs, ready_k, ready_v, empty = allocate_kv_ring(k_desc, v_desc, STAGES, 2)
    q_ready, q_empty = allocate_query_barriers()
    keep_parts = 0
    if DROPOUT:  # each consumer's KEEP_SLOTS slots of keep words, filled by its drawer
        keep_parts = allocate_keep_ring(_KEEP_SLOTS, [4, 8, 2, 4], FWD_KEEP_SHARED)
    fence_async_shared()
    consumer_args = (q_bufs, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready, q_empty, O, LSE, ALIBI_SLOPES,
                     stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h, stride_alibi_b, num_tiles, nheads,
                     group_size, seqlen_q, seqlen_k, qk_scale, cap_log2, SCHEDULE, schedule_rounds, window_left,
                     o_desc, o_rows, o_cols)
    producer_args = (q_desc, None, k_desc, v_desc, q_bufs, None, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready,
                     q_empty, q_rows, q_cols, None, None, k_rows, k_cols, v_rows, v_cols, num_tiles, nheads,
                     group_size, seqlen_q, seqlen_k, SCHEDULE, schedule_rounds, CAUSAL, 2 * HALF_M, BLOCK_N, STAGES,
                     HEAD_GROUP, window_left, WINDOW)
    if DROPOUT:
        drawer_args = (keep_parts, SEED_OFFSET, dropout_p, num_tiles, nheads, group_size, seqlen_q, seqlen_k,
                       SCHEDULE, schedule_rounds)
        gl.warp_specialize([
            (_fwd_consumer_persistent, (consumer_args, 0, CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES, HEAD_GROUP,
                                                 ALIBI, FOLD, SOFTCAP, WINDOW, keep_parts, 1.0 - dropout_p,
                                                 True)),
            (_fwd_consumer_persistent, (consumer_args, 1, CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES, HEAD_GROUP,
                                                 ALIBI, FOLD, SOFTCAP, WINDOW, keep_parts, 1.0 - dropout_p,
                                                 True)),
            (producer_persistent, producer_args),
            (_fwd_keep_drawer_persistent, (drawer_args, 0, CAUSAL, HALF_M, BLOCK_N, HEAD_GROUP)),
            (_fwd_keep_drawer_persistent, (drawer_args, 1, CAUSAL, HALF_M, BLOCK_N, HEAD_GROUP)),
        ], [4, 1, DRAWER_WARPS, DRAWER_WARPS], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS, WORKER_REGS])
    else:
        gl.warp_specialize([
            (_fwd_consumer_persistent, (consumer_args, 0, CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES, HEAD_GROUP,
                                                 ALIBI, FOLD, SOFTCAP, WINDOW, 0, 1.0, False)),
            (_fwd_consumer_persistent, (consumer_args, 1, CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES, HEAD_GROUP,
                                                 ALIBI, FOLD, SOFTCAP, WINDOW, 0, 1.0, False)),
            (producer_persistent, producer_args),
        ], [4, 1], [232, 24])


@gluon.jit
def _varlen_persistent_fwd(q_desc, k_desc, v_desc, O, LSE, ALIBI_SLOPES, TILE_COUNTER, VARLEN_BLOCKS, o_desc, o_rows,
                           o_cols, CU_SEQLENS_Q,
                           CU_SEQLENS_K, q_rows, q_cols, k_rows, k_cols, v_rows, v_cols, stride_os, stride_oh,
                           stride_lse_h, stride_alibi_b, num_items, nheads, group_size, qk_scale, cap_log2,
                           window_left, CAUSAL: gl.constexpr, HEADDIM: gl.constexpr, HALF_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ALIBI: gl.constexpr, FOLD: gl.constexpr,
                           SOFTCAP: gl.constexpr, WINDOW: gl.constexpr):
    """The PERSISTENT kernel body on a varlen batch: `_persistent_fwd`'s buffers and partitions, the work items
    (head, (sequence, query block)) taken by tickets (common.take_ticket: a program that finishes early takes the
    next item, where a static deal of blocks costing 1 to 32 steps ended unevenly), the producer handing each item's
    fields to the consumers with its Q (common.hand_item)."""
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs, v_bufs, ready_k, ready_v, empty = allocate_kv_ring(k_desc, v_desc, STAGES, 2)
    q_ready, q_empty = allocate_query_barriers()
    items = allocate_item_slots()
    fence_async_shared()
    consumer_args = (q_bufs, items, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready, q_empty, O, LSE, ALIBI_SLOPES,
                     stride_os, stride_oh, stride_lse_h, stride_alibi_b, qk_scale, cap_log2, window_left, o_desc,
                     o_rows, o_cols)
    gl.warp_specialize([
        (_varlen_consumer, (consumer_args, 0, CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP,
                            WINDOW)),
        (_varlen_consumer, (consumer_args, 1, CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES, ALIBI, FOLD, SOFTCAP,
                            WINDOW)),
        (_varlen_producer, (q_desc, k_desc, v_desc, q_bufs, items, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready,
                            q_empty, q_rows, q_cols, k_rows, k_cols, v_rows, v_cols, TILE_COUNTER, VARLEN_BLOCKS,
                            CU_SEQLENS_Q, CU_SEQLENS_K, num_items, nheads, group_size, window_left, CAUSAL,
                            2 * HALF_M, BLOCK_N, STAGES, WINDOW)),
    ], [4, 1], [232, 24])


@gluon.jit
def _varlen_producer(q_desc, k_desc, v_desc, q_bufs, items, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready, q_empty,
                     q_rows, q_cols, k_rows, k_cols, v_rows, v_cols, TILE_COUNTER, VARLEN_BLOCKS, CU_SEQLENS_Q,
                     CU_SEQLENS_K, num_items, nheads, group_size, window_left, CAUSAL: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WINDOW: gl.constexpr):
    """`_varlen_persistent_fwd`'s producer: per item, its fields and Q into one of two buffers once both consumers
    released it two items ago, the next ticket drawn, then the item's K/V blocks into the ring (which runs on
    across items, as common.producer_persistent's). Past the work, a slot saying so, and the counter released."""
    ring = 0  # key blocks streamed so far
    done = 0  # items so far
    more, head, seq, m0, q_first, k_first, seqlen_q, seqlen_k = varlen_item(
        take_ticket(TILE_COUNTER), num_items, nheads, VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, BLOCK_M)
    while more:
        qb = done % 2
        bar = q_ready.index(qb)
        mbarrier.wait(q_empty.index(qb), ((done // 2) & 1) ^ 1)
        hand_item(items.index(qb), more, head, seq, m0, q_first, k_first, seqlen_q, seqlen_k)
        mbarrier.expect(bar, q_desc.block_type.nbytes)
        tma_load(q_desc, [q_first + head * q_rows[1] + m0, head * q_cols], bar, q_bufs.index(qb))
        ticket = take_ticket(TILE_COUNTER)  # drawn now, read after this item's stream
        shift, n_full, n_steps = key_steps(m0, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
        n_first, _, _, n_steps = window_steps(m0, shift, n_full, n_steps, window_left, BLOCK_M, BLOCK_N, WINDOW)
        off_hk = head // group_size
        key_row = k_first + n_first * BLOCK_N
        stream_kv(k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, empty, key_row + off_hk * k_rows[1],
                  off_hk * k_cols, key_row + off_hk * v_rows[1], off_hk * v_cols, n_steps, ring, BLOCK_N, STAGES)
        ring += n_steps
        done += 1
        more, head, seq, m0, q_first, k_first, seqlen_q, seqlen_k = varlen_item(
            ticket, num_items, nheads, VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, BLOCK_M)
    qb = done % 2
    mbarrier.wait(q_empty.index(qb), ((done // 2) & 1) ^ 1)
    hand_item(items.index(qb), more, head, seq, m0, q_first, k_first, seqlen_q, seqlen_k)
    mbarrier.arrive(q_ready.index(qb))
    release_tickets(TILE_COUNTER)


@gluon.jit
def _varlen_consumer(args, WG: gl.constexpr, CAUSAL: gl.constexpr, HEADDIM: gl.constexpr, HALF_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ALIBI: gl.constexpr, FOLD: gl.constexpr,
                     SOFTCAP: gl.constexpr, WINDOW: gl.constexpr):
    """`_fwd_consumer_persistent` over the items its producer hands it (common.read_item), until one says the work
    is done."""
    (q_bufs, items, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready, q_empty, O, LSE, ALIBI_SLOPES, stride_os,
     stride_oh, stride_lse_h, stride_alibi_b, qk_scale, cap_log2, window_left, o_desc, o_rows, o_cols) = args
    offs_key, zero_s = _persistent_constants(HALF_M, BLOCK_N)
    ring = 0
    done = 0
    storing = 0  # the last item's O is in its Q buffer, under a TMA store (`_persistent_tile`)
    mbarrier.wait(q_ready.index(0), 0)
    more, head, seq, m0, q_first, _, seqlen_q, seqlen_k = read_item(items.index(0))
    while more:
        shift, n_full, n_steps = key_steps(m0, seqlen_q, seqlen_k, CAUSAL, 2 * HALF_M, BLOCK_N)
        n_first, n_lo, n_full, n_steps = window_steps(m0, shift, n_full, n_steps, window_left, 2 * HALF_M, BLOCK_N,
                                                      WINDOW)
        alibi_log2 = head_slope_log2(ALIBI_SLOPES, seq * stride_alibi_b + head, ALIBI)
        storing = _persistent_tile(
            q_bufs, done, ring, k_bufs, v_bufs, ready_k, ready_v, empty, q_ready, q_empty, zero_s, offs_key, O, LSE,
            q_first * stride_os + head * stride_oh, stride_os, head * stride_lse_h + q_first, m0, shift, n_first, n_lo,
            n_full, n_steps, seqlen_q, seqlen_k, qk_scale, cap_log2, alibi_log2, window_left, o_desc,
            q_first + head * o_rows[1] + m0, head * o_cols, storing, WG, CAUSAL, HEADDIM, HALF_M, BLOCK_N, STAGES,
            ALIBI, FOLD, SOFTCAP, WINDOW)
        ring += n_steps
        done += 1
        mbarrier.wait(q_ready.index(done % 2), (done // 2) & 1)
        more, head, seq, m0, q_first, _, seqlen_q, seqlen_k = read_item(items.index(done % 2))
    tma.store_wait(0)  # the last item's O written before the program's shared memory goes


def dropout_registers() -> tuple[int, int, int]:
    """(registers a thread at launch, the consumers' setmaxnreg count, the other warpgroups') of the dropout form: its
    9 + 2 DRAWER_WARPS warps launch as whole warpgroups (20) sharing the register file; setmaxnreg applies per
    warpgroup, so the producer's and the drawers' warpgroups (with the padding warps) share one count, 48 (the
    drawers' calls in flight spill under 40), and the consumers split the rest (168; ptxas spills nothing)."""
    groups = 2 + (1 + 2 * DRAWER_WARPS + 3) // 4
    maxnreg = 65536 // (groups * 128) // 8 * 8
    worker = 48
    return maxnreg, (groups * maxnreg - (groups - 2) * worker) // 2 // 8 * 8, worker


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, varlen: bool, max_seqlen_q: int,
              max_seqlen_k: int, window_left: int, window_right: int, softcap: float, dropout_p: float) -> bool:
    """Whether this kernel covers the call: common.sm90_dense_ok, with dropout on dense rows, and
    varlen batches without dropout (`attn_fwd_varlen`). Any lengths: a last query block past seqlen_q computes rows
    that are never stored, and a last key block past seqlen_k is masked (common.key_limit)."""
    if q.shape[-1] == 256:  # no dropout (the drawers' words are laid out for 128 keys a step)
        return sm90_dense_ok(q, k, v, varlen=varlen, window_left=window_left, window_right=window_right,
                             softcap=softcap, dropout_p=dropout_p, with_varlen=True, with_window=True,
                             with_softcap=True, headdims=(256, ))
    return sm90_dense_ok(q, k, v, varlen=varlen, window_left=window_left, window_right=window_right, softcap=softcap,
                         dropout_p=dropout_p, with_dropout=not varlen, with_varlen=True,
                         with_window=True, with_softcap=True)


def block_n(headdim: int) -> int:
    """Keys per step at `headdim`."""
    return BLOCK_N_D256 if headdim == 256 else BLOCK_N


def varlen_persistent(headdim: int, options: KernelOptions) -> bool:
    """Whether a varlen forward runs `_varlen_persistent_fwd` (its items taken by tickets) rather than one program
    per item: options.persistent_fwd, or config.persistent_grid's rule; never at head dim 256 (two (128, 256) Q
    buffers would not fit beside the K/V ring)."""
    if headdim == 256:
        return False
    if options.persistent_fwd is None:
        return persistent_grid("fwd", 0, headdim, varlen=True)
    return options.persistent_fwd


def varlen_block_rows(headdim: int, options: KernelOptions) -> int:
    """The query rows of a varlen program or item (`attn_fwd_varlen`): the (sequence, block) table ops.varlen_blocks
    builds counts blocks of this many rows, those of the consumer warpgroups the form has (two when persistent)."""
    return (2 if varlen_persistent(headdim, options) else CONSUMERS_BY_HEADDIM[headdim]) * HALF_M


_COUNTERS: dict[tuple, torch.Tensor] = {}  # (device, stream) -> its int32 (2,) ticket counter


def tile_counter(device: torch.device) -> torch.Tensor | None:
    """The ticket counter of persistent varlen launches on `device`'s current stream (common.take_ticket): zeros,
    set back to zeros by each launch's last program, so launches in stream order share it and each stream has its
    own. None while the stream captures a CUDA graph (the caller runs per block): a graph's replays may run on any
    stream, beside other launches that take the same counter."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    key = (device, torch._C._cuda_getCurrentRawStream(device.index))
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def attn_fwd_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, blocks, max_seqlen_k: int, qk_scale: float,
                    causal: bool, alibi_slopes=None, fold: bool = False, options: KernelOptions = DEFAULT,
                    site=None, window_left: int = -1, cap_log2: float = 0.0) -> None:
    """`attn_fwd` for a varlen batch (`supported`, no dropout): out (total_q, H, D) and lse (H, total_q), q:
    (total_q, H, D), k, v: (total_k, Hk, D), cu_seqlens_q / _k: (batch + 1,) int32, blocks: ops.varlen_blocks's
    (2, n) table of (sequence, block) pairs in blocks of `varlen_block_rows` queries. The work items are the heads x
    pairs: one program each, or (`varlen_persistent`) one program per SM taking them by tickets. The packed rows are
    the TMA views' rows, a sequence's tiles start at its cu_seqlens entry, and a tile past its end reads the next
    sequence's rows, masked like a dense row's last tile. site: launch.launch's, passed on. window_left >= 0: a
    causal sliding window; cap_log2 > 0: softcap (`attn_fwd`)."""
    no_dropout = 0.0
    floats = (qk_scale, cap_log2, no_dropout)
    headdim = q.shape[2]
    persistent = varlen_persistent(headdim, options)
    counter = tile_counter(q.device) if persistent else None  # None in a graph capture: per block
    # a replay needs only the descriptors' base pointers: the (T, H, D) tensors stand for their (1, T, H, D) views
    sources = (q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, blocks, counter, out)
    if site is not None and replay(attn_fwd_hopper_kernel, (site, counter is None), sources, floats):
        return
    if window_left >= 0 and not causal:
        raise ValueError(f"the Gluon forward runs a sliding window only with the causal mask, got "
                         f"window_left={window_left} without it")
    nheads = q.shape[1]
    nheads_k = k.shape[1]
    consumers = 2 if persistent else CONSUMERS_BY_HEADDIM[headdim]  # the table's rows (`varlen_block_rows`)
    q1, k1, v1 = (t.unsqueeze(0) for t in (q, k, v))  # (1, T, H, D)
    q_desc, q_rows, q_cols = descriptor(q1, BLOCK_M if consumers == 2 else HALF_M)
    keys = block_n(headdim)
    k_desc, k_rows, k_cols = descriptor(k1, keys)
    v_desc, v_rows, v_cols = descriptor(v1, keys)
    out1 = out.unsqueeze(0)
    o_desc, o_rows, o_cols = descriptor(out1, HALF_M) if counter is not None else (None, (0, 0), 0)
    num_items = nheads * blocks.shape[1]
    grid = (num_items,) if counter is None else (min(num_items, sm_count(q.device)),)
    launch(
        attn_fwd_hopper_kernel, grid, q_desc, k_desc, v_desc, out, lse, alibi_slopes, None, None, cu_seqlens_q,
        cu_seqlens_k, blocks, counter, o_desc, o_rows, o_cols, q_rows, q_cols, k_rows, k_cols, v_rows, v_cols, 0,
        out.stride(0), out.stride(1), 0, lse.stride(0), alibi_batch_stride(alibi_slopes), num_items, nheads,
        nheads // nheads_k, 0, max_seqlen_k, qk_scale, cap_log2, no_dropout, 0, max(window_left, 0),
        CAUSAL=causal, HEADDIM=headdim, HALF_M=HALF_M, BLOCK_N=keys, STAGES=STAGES, HEAD_GROUP=1,
        ALIBI=alibi_slopes is not None, PERSISTENT=counter is not None, FOLD=fold, SOFTCAP=cap_log2 > 0,
        CONSUMERS=consumers, DROPOUT=False,
        DRAWER_WARPS=DRAWER_WARPS, CONSUMER_REGS=0, WORKER_REGS=0, VARLEN=True, WINDOW=window_left >= 0, num_warps=4,
        maxnreg=MAXNREG if consumers == 2 else MAXNREG_3, cached_launch=options.cached_launch,
        site=None if site is None else (site, counter is None),
        record=Record((site, counter is None), (q1, k1, v1, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                                 blocks, counter, out1), floats),
    )


def attn_fwd(q, k, v, out, lse, qk_scale: float, causal: bool, alibi_slopes=None, fold: bool = False,
             seed_offset=None, dropout_p: float = 0.0, options: KernelOptions = DEFAULT, site=None,
             window_left: int = -1, cap_log2: float = 0.0) -> None:
    """out (B, Sq, H, D) and lse (B, H, Sq, float32, natural log) for a call `supported` accepted; q: (B, Sq, H, D),
    k, v: (B, Sk, Hk, D); qk_scale = softmax_scale * log2(e); alibi_slopes: None or float32 (H,) / (B, H); fold:
    config.KernelConfigs.fold_scale (`_softmax_update`, which ignores it with ALiBi). dropout_p > 0: two consumers,
    the keep bits drawn from seed_offset (ops.draw_seed_offset's int64 (seed, offset)) at triton.common.dropout_keep's
    counters, on either grid (config.persistent_grid's rule or options.persistent_fwd). options: its
    persistent_fwd, causal_schedule, head_group and cached_launch. site: launch.launch's, for the arguments that
    follow from the call's shapes and options (the launch tells apart a schedule table built or not).
    window_left >= 0: a causal sliding window, query row m seeing keys m + Sk - Sq - window_left through
    m + Sk - Sq (common.window_steps), no dropout. cap_log2 > 0: softcap, the scores
    cap_log2 * tanh(qk * qk_scale) with qk_scale = softmax_scale / softcap (ops._scales; `_softmax_update`).
    With a site whose launch is recorded (launch.Record, from its second launch), the call is a replay
    (launch.replay): the site stands for everything but the tensors and the floats."""
    sources, floats = (q, k, v, out, lse, alibi_slopes, seed_offset, out), (qk_scale, cap_log2, dropout_p)
    if site is not None and replay(attn_fwd_hopper_kernel, site, sources, floats):
        return
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    dropout = dropout_p > 0
    if dropout and seed_offset is None:
        raise ValueError(f"the Gluon forward draws dropout from a seed_offset tensor, got dropout_p={dropout_p} with "
                         f"seed_offset=None")
    window = window_left >= 0
    if window and (dropout or not causal):
        raise ValueError(f"the Gluon forward runs a sliding window only causal and without dropout, got "
                         f"window_left={window_left}, causal={causal}, dropout_p={dropout_p}")
    if headdim == 256 and dropout:
        raise ValueError(f"the Gluon forward at head dim 256 draws no dropout, got dropout_p={dropout_p}")
    keys = block_n(headdim)
    if headdim == 256:  # two (128, 256) Q buffers would not fit beside the ring
        persistent = False
    elif options.persistent_fwd is None:
        persistent = persistent_grid("fwd", cdiv(seqlen_q, BLOCK_M), headdim, causal=causal and not window)
    else:
        persistent = options.persistent_fwd
    consumers = 2 if persistent or dropout else CONSUMERS_BY_HEADDIM[headdim]  # the drawers serve two
    block_m = consumers * HALF_M  # three consumers: the last block may run past seqlen_q (masked stores)
    q_desc, q_rows, q_cols = descriptor(q, BLOCK_M if consumers == 2 else HALF_M)  # the kernel's Q_TILES
    k_desc, k_rows, k_cols = descriptor(k, keys)
    v_desc, v_rows, v_cols = descriptor(v, keys)
    o_desc, o_rows, o_cols = descriptor(out, HALF_M) if persistent else (None, (0, 0), 0)
    num_m = cdiv(seqlen_q, block_m)
    num_tiles = batch * nheads * num_m
    order = head_group(causal, num_m, q.device, options.head_group)
    schedule, schedule_rounds = None, 0
    if persistent:
        # one program per SM; a causal grid in head groups dealt out by schedule.causal_schedule, or (without
        # options.causal_schedule, or in a CUDA graph capture that finds no table built) all heads block-major, heaviest
        # first, which persistent_tile's alternating rounds balance. Under a sliding window, whose blocks cost alike
        # but the first few, the closed form over head groups (the per-block grid's order: neighbours share K/V in L2)
        grid = (min(num_tiles, sm_count(q.device)),)
        if causal and not window and options.causal_schedule:
            schedule, schedule_rounds = causal_schedule_tensor(batch * nheads, seqlen_q, seqlen_k, block_m, keys,
                                                               order, grid[0], q.device)
        if causal and not window and schedule is None:
            order = 0
    else:
        grid = (num_tiles,)
    if dropout:
        maxnreg, consumer_regs, worker_regs = dropout_registers()
    else:  # the setmaxnreg counts of the non-dropout forms are in the kernel
        maxnreg, consumer_regs, worker_regs = (MAXNREG if consumers == 2 else MAXNREG_3), 0, 0
    launch(
        attn_fwd_hopper_kernel, grid, q_desc, k_desc, v_desc, out, lse, alibi_slopes, seed_offset, schedule, None,
        None, None, None, o_desc, o_rows, o_cols, q_rows, q_cols, k_rows, k_cols, v_rows, v_cols, out.stride(0),
        out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), alibi_batch_stride(alibi_slopes), num_tiles, nheads,
        nheads // nheads_k, seqlen_q, seqlen_k, qk_scale, cap_log2, dropout_p, schedule_rounds, max(window_left, 0),
        CAUSAL=causal, HEADDIM=headdim, HALF_M=HALF_M, BLOCK_N=keys, STAGES=STAGES,
        HEAD_GROUP=order, ALIBI=alibi_slopes is not None, PERSISTENT=persistent,
        FOLD=fold, SOFTCAP=cap_log2 > 0, CONSUMERS=consumers, DROPOUT=dropout,
        DRAWER_WARPS=DRAWER_WARPS, CONSUMER_REGS=consumer_regs,
        WORKER_REGS=worker_regs, VARLEN=False, WINDOW=window, num_warps=4, maxnreg=maxnreg,
        cached_launch=options.cached_launch,
        site=None if site is None else (site, schedule is None),
        record=Record(site, sources, floats, () if schedule is None else (schedule,)),
    )
