"""Triton helpers shared by the forward, backward and mask kernels.

Masking convention (flash-attn >= 2.1, bottom-right aligned): with diag = seqlen_k - seqlen_q, query row i
sees key j when  i + diag - left <= j <= i + diag + right,  each bound only when HAS_LEFT / HAS_RIGHT
(causal is right = 0). Every kernel derives its loop bounds and masks from the functions below, so the
forward and both backward passes always agree on what is visible.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, off_b, max_seqlen_q, max_seqlen_k, IS_VARLEN: tl.constexpr):
    """(first token, length) of batch entry off_b's queries and keys."""
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + off_b)
        q_len = tl.load(CU_SEQLENS_Q + off_b + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + off_b)
        k_len = tl.load(CU_SEQLENS_K + off_b + 1) - k_start
        return q_start.to(tl.int64), q_len, k_start.to(tl.int64), k_len
    else:
        return tl.zeros((), tl.int64), max_seqlen_q, tl.zeros((), tl.int64), max_seqlen_k


@triton.jit
def head_and_block(num_blocks, BLOCKS_FASTEST: tl.constexpr, HEAD_GROUP: tl.constexpr):
    """(batch * head index, block index) of this program. BLOCKS_FASTEST: a 1-D grid in which the programs running
    at once take blocks of a few heads, so they stream those heads' tiles and find them in L2: the heads go in
    groups of HEAD_GROUP (config.head_group; 0: all in one group), each group block-major (every head's block 0,
    then every head's block 1, ...; with a group of 1, a head's blocks side by side). Otherwise batch * heads on
    axis 0 (its limit is 2^31 - 1, axis 1's is 65535) and blocks on axis 1, so the programs running at once each
    stream a different head."""
    if BLOCKS_FASTEST:
        return tile_head_and_block(tl.program_id(0), tl.num_programs(0) // num_blocks, num_blocks, HEAD_GROUP)
    else:
        return tl.program_id(0), tl.program_id(1)


@triton.jit
def tile_head_and_block(tile, num_heads, num_blocks, HEAD_GROUP: tl.constexpr):
    """`head_and_block`'s 1-D order for tile `tile` of num_heads x num_blocks (also a persistent program's tiles)."""
    if HEAD_GROUP == 0:
        return tile % num_heads, tile // num_heads
    group = tile // (HEAD_GROUP * num_blocks)
    rest = tile % (HEAD_GROUP * num_blocks)
    heads_here = tl.minimum(num_heads - group * HEAD_GROUP, HEAD_GROUP)
    return group * HEAD_GROUP + rest % heads_here, rest // heads_here


@triton.jit
def batch_head_and_block(VARLEN_BLOCKS, nheads, num_blocks, BLOCKS_FASTEST: tl.constexpr, HEAD_GROUP: tl.constexpr,
                         IS_VARLEN: tl.constexpr):
    """(batch entry, head, block) of this program. Dense: num_blocks blocks per (batch entry, head), in
    `head_and_block`'s order. Varlen: the grid holds only the blocks that exist, nheads x the length of
    VARLEN_BLOCKS ((2, num_blocks) int32 of (sequence, block) pairs, ops.varlen_blocks; num_blocks is ignored), so
    its size follows the tokens, not batch x the longest sequence. Pairs past the last block name a block past the
    end of sequence 0, which the kernels skip."""
    if IS_VARLEN:
        if BLOCKS_FASTEST:
            grid_blocks = tl.num_programs(0) // nheads
        else:
            grid_blocks = tl.num_programs(1)
        off_h, block = head_and_block(grid_blocks, BLOCKS_FASTEST, HEAD_GROUP)
        off_b = tl.load(VARLEN_BLOCKS + block)
        block = tl.load(VARLEN_BLOCKS + grid_blocks + block)
        return off_b.to(tl.int64), off_h.to(tl.int64), block
    else:
        off_bh, block = head_and_block(num_blocks, BLOCKS_FASTEST, HEAD_GROUP)
        return (off_bh // nheads).to(tl.int64), (off_bh % nheads).to(tl.int64), block


@triton.jit
def query_block_program(CU_SEQLENS_Q, CU_SEQLENS_K, VARLEN_BLOCKS, nheads, group_size, max_seqlen_q, max_seqlen_k,
                        BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCKS_FASTEST: tl.constexpr,
                        HEAD_GROUP: tl.constexpr):
    """The work of a program in a query-block grid (the forward and dQ kernels), query blocks in reverse, so the
    heaviest causal blocks start first (varlen: ops.varlen_blocks lists them so). Returns (off_b, off_h, off_hk,
    q_start, seqlen_q, k_start, seqlen_k, m0); off_hk is the K/V head that query head off_h reads in place (GQA).
    A program with m0 >= seqlen_q has nothing to do."""
    num_blocks = tl.cdiv(max_seqlen_q, BLOCK_M)
    off_b, off_h, block = batch_head_and_block(VARLEN_BLOCKS, nheads, num_blocks, BLOCKS_FASTEST, HEAD_GROUP,
                                               IS_VARLEN)
    if IS_VARLEN:
        pid_m = block
    else:
        pid_m = num_blocks - 1 - block
    q_start, seqlen_q, k_start, seqlen_k = seq_bounds(
        CU_SEQLENS_Q, CU_SEQLENS_K, off_b, max_seqlen_q, max_seqlen_k, IS_VARLEN)
    return off_b, off_h, off_h // group_size, q_start, seqlen_q, k_start, seqlen_k, pid_m * BLOCK_M


@triton.jit
def load_tile(ptrs, mask, other, EVEN: tl.constexpr):
    """tl.load, without the bounds mask when EVEN (every tile of the launch in bounds), which saves computing
    the predicates in the inner loops."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def head_rows_desc(base, nrows, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tensor (TMA) descriptor over one head of one sequence: nrows rows of BLOCK_D contiguous elements,
    stride_row apart, read and written in (BLOCK_ROWS, BLOCK_D) tiles. Rows past nrows load as zeros and are
    not stored, so tiles need no masks. The host guarantees 16-byte aligned bases and strides (ops.tma_usable)."""
    return tl.make_tensor_descriptor(base, shape=[nrows, BLOCK_D], strides=[stride_row, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])


@triton.jit
def key_block_range(
    m0, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """For the query block [m0, m0 + BLOCK_M): key-block starts split as
    [lo, full_lo) masked | [full_lo, full_hi) fully visible, no mask needed | [full_hi, hi) masked.
    All four are multiples of BLOCK_N; blocks outside [lo, hi) see nothing and are skipped. Fully visible blocks
    end at or before seqlen_k (full_hi <= seqlen_k // BLOCK_N * BLOCK_N), so their loads need no bounds masks."""
    diag = seqlen_k - seqlen_q
    lo = m0 * 0  # a run-time int32 from the start, so every branch below assigns one type
    hi = lo + seqlen_k
    full_lo = lo
    full_hi = hi
    if HAS_RIGHT:
        hi = tl.minimum(hi, m0 + BLOCK_M - 1 + diag + window_right + 1)
        full_hi = tl.minimum(full_hi, m0 + diag + window_right + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, m0 + diag - window_left)
        full_lo = tl.maximum(full_lo, m0 + BLOCK_M - 1 + diag - window_left)
    lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
    hi = tl.maximum(tl.cdiv(tl.maximum(hi, 0), BLOCK_N) * BLOCK_N, lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(full_lo, 0), BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.minimum(tl.maximum(tl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_block_range(
    n0, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """For the key block [n0, n0 + BLOCK_N): query-block starts split as in `key_block_range`
    (masked | fully visible | masked), all multiples of BLOCK_M. Fully visible blocks end at or before seqlen_q,
    and a key block that is cut by seqlen_k has none."""
    diag = seqlen_k - seqlen_q
    lo = n0 * 0
    hi = lo + seqlen_q
    full_lo = lo
    full_hi = hi
    if HAS_RIGHT:
        lo = tl.maximum(lo, n0 - diag - window_right)
        full_lo = tl.maximum(full_lo, n0 + BLOCK_N - 1 - diag - window_right)
    if HAS_LEFT:
        hi = tl.minimum(hi, n0 + BLOCK_N - diag + window_left)
        full_hi = tl.minimum(full_hi, n0 - diag + window_left + 1)
    lo = tl.maximum(lo, 0) // BLOCK_M * BLOCK_M
    hi = tl.maximum(tl.cdiv(tl.maximum(hi, 0), BLOCK_M) * BLOCK_M, lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(full_lo, 0), BLOCK_M) * BLOCK_M, lo), hi)
    full_hi = tl.minimum(tl.maximum(tl.maximum(full_hi, 0) // BLOCK_M * BLOCK_M, full_lo), hi)
    if n0 + BLOCK_N > seqlen_k:
        full_lo = hi  # a partial key block needs the bounds mask everywhere
        full_hi = hi
    return lo, full_lo, full_hi, hi


@triton.jit
def alibi_bias(alibi_log2, offs_m, offs_n, seqlen_q, seqlen_k):
    """ALiBi's -slope * |i + Sk - Sq - j| in log2 units (alibi_log2 = slope * log2(e)): bottom-right aligned like
    the masks, so the diagonal of a causal mask has no bias (offs_m, offs_n already broadcast to 2-D)."""
    return -alibi_log2 * tl.abs(offs_m + (seqlen_k - seqlen_q) - offs_n).to(tl.float32)


@triton.jit
def visible(
    offs_m, offs_n, seqlen_q, seqlen_k, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Bool tile: query offs_m may see key offs_n (offs_m, offs_n already broadcast to 2-D)."""
    ok = (offs_m < seqlen_q) & (offs_n < seqlen_k)
    diag = seqlen_k - seqlen_q
    if HAS_RIGHT:
        ok = ok & (offs_n <= offs_m + diag + window_right)
    if HAS_LEFT:
        ok = ok & (offs_n >= offs_m + diag - window_left)
    return ok


@triton.jit
def tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates cleanly to +-1 (e^{2x} -> inf or 0), no libdevice needed.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def dropout_head_rows(off_b, nheads, off_h, max_seqlen_q):
    """Counter row of the first query pair of head (off_b, off_h) (see `dropout_keep`)."""
    return (off_b * nheads + off_h) * (tl.cdiv(max_seqlen_q, 16) * 8)


@triton.jit
def dropout_threshold(dropout_p):
    # Decisions are 16-bit: keep when the value is >= round(p * 2^16), so p takes effect in steps of 2^-16.
    return tl.floor(dropout_p * 65536.0 + 0.5).to(tl.uint32)


# Philox4x32's rounds: seven, as flash-attn draws its dropout (Random123 counts Philox4x32-7 among its generators that
# pass TestU01's BigCrush; ten is its default, with a safety margin). Every kernel draws through these rounds, so
# changing them changes every mask alike; the Gluon kernels' philox_wide reads the same constant.
PHILOX_ROUNDS = tl.constexpr(7)


@triton.jit
def philox4x32(seed, counter):
    """The four 32-bit output words of Philox4x32 with PHILOX_ROUNDS rounds, keyed by the 64-bit seed at the 64-bit
    counter (words c0, c1; c2 = c3 = 0)."""
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    zero = c0 & 0  # not tl.zeros_like, which Gluon (sm90/dq.py calls this too) cannot give a layout
    return tl.philox(seed, c0, c1, zero, zero, n_rounds=PHILOX_ROUNDS)


@triton.jit
def dropout_keep(seed, offset, rows0, n0, max_seqlen_k, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) bool tile, queries x keys: keep the weight of (query m0 + i, key n0 + j)?
    rows0 = dropout_head_rows(...) + m0 // 2; m0, n0 and both block sizes are multiples of 16.

    The generator is Philox4x32-7 (`philox4x32`), keyed by the 64-bit seed. Each call yields eight 16-bit decisions,
    for the eight (query, key) pairs that differ only in bit 3 of the query and bits 0 and 3 of the key. For query i
    and key j of head h (h counts batch entries times heads) the call's 64-bit counter (words c0, c1) is
        offset + (h * 8 * ceil(max_seqlen_q / 16) + i') * 4 * ceil(max_seqlen_k / 16) + j',
    i' = i without bit 3, j' = j without bits 0 and 3; the decision is output word 2 * i[3] + j[3], its low half
    for even j and high half for odd j. The bits depend on no block size, grid or layout, so packed and padded
    batches and every tiling agree.

    Why this grouping: in the matmul accumulator layout of Hopper and Ampere, which the score tile lives in, a
    thread holds rows i and i + 8 and columns j, j + 1, j + 8, j + 9 (and further multiples of 8), so the eight
    decisions of one call land in the registers of the thread that computed them. The interleave below (join,
    permute, reshape) is therefore free: Triton propagates the accumulator layout back through it, with no
    shared-memory round trip (checked in the compiled IR)."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "dropout tiles are whole 16 x 16 groups")
    groups_per_row = tl.cdiv(max_seqlen_k, 16) * 4
    rows = (rows0 + tl.arange(0, BLOCK_M // 16)[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.int64)  # (BM/16, 8)
    cols = n0 // 4 + tl.arange(0, BLOCK_N // 16)[:, None] * 4 + tl.arange(0, 4)[None, :]  # (BN/16, 4)
    counter = offset + rows[:, :, None, None] * groups_per_row + cols[None, None, :, :]  # (BM/16, 8, BN/16, 4)
    return keep_tile(seed, counter, dropout_p, BLOCK_M, BLOCK_N)


@triton.jit
def keep_tile(seed, counter, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) keep tile from the (BM/16, 8, BN/16, 4) Philox counters of `dropout_keep`, one per
    call: the part of the draw that `dropout_keep` and the Gluon dQ (sm90.dq.dropout_keep_acc) share, so that
    their bits agree by construction."""
    r0, r1, r2, r3 = philox4x32(seed, counter)
    return keep_from_words(r0, r1, r2, r3, dropout_p, BLOCK_M, BLOCK_N)


@triton.jit
def keep_from_words(r0, r1, r2, r3, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`keep_tile` from its calls' four Philox words (the Gluon dQ draws them as sm90.common.philox_wide)."""
    threshold = dropout_threshold(dropout_p)
    # word r[2 * i3 + j3]; joined dims after the three joins: (i >> 4, i & 7, j >> 4, (j >> 1) & 3, j0, j3, i3)
    keep = tl.join(tl.join(tl.join(r0 & 0xFFFF, r0 >> 16), tl.join(r1 & 0xFFFF, r1 >> 16)),
                   tl.join(tl.join(r2 & 0xFFFF, r2 >> 16), tl.join(r3 & 0xFFFF, r3 >> 16))) >= threshold
    keep = tl.permute(keep, (0, 6, 1, 2, 5, 3, 4))  # (i >> 4, i3, i & 7, j >> 4, j3, (j >> 1) & 3, j0)
    return tl.reshape(keep, (BLOCK_M, BLOCK_N))


@triton.jit
def dropout_keep_transposed(seed, offset, rows0, n0, max_seqlen_k, dropout_p,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_N, BLOCK_M) bool tile, keys x queries: `dropout_keep`'s decisions, transposed, for the dK/dV
    kernel's transposed score tile. There a thread holds keys j and j + 8 but not j + 1, so drawing in that layout
    would make two threads run each Philox call (each keeping four of its eight decisions). Instead the tile is drawn
    in `dropout_keep`'s own layout, one call per eight decisions, and transposed; the compiler moves the Philox words
    through shared memory to do it, which costs less than the second draw (the dK/dV kernel measured faster)."""
    keep = dropout_keep(seed, offset, rows0, n0, max_seqlen_k, dropout_p, BLOCK_M, BLOCK_N).to(tl.int8)
    return tl.trans(keep) != 0


def alibi_batch_stride(alibi_slopes) -> int:
    """The slopes' stride between sequences, on the host: 0 for None or (nheads,) slopes (one row for every
    sequence), else that of the (batch, nheads) tensor; every kernel reads the slope of (b, h) at b * stride + h."""
    return alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
