"""What the Gluon kernels of fwd.py, dkdv.py, dkdv256.py and dq.py share: which calls they may take (`sm90_dense_ok`),
the 2-D TMA views of (B, S, H, D) tensors they load from, and the Gluon functions of more than one kernel (a program's
query block, the K/V ring and its producer loop, a register tile's TMA store, the persistent grid's tiles and
tickets, the Philox draw of the keep bits, the drawers' rings, the dK/dV kernels' producer, step order and masks).
Imported only where Gluon is (sm90.AVAILABLE)."""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashpatch.kernels.config import ALIGN
from flashpatch.kernels.sm90 import capability, enabled
from flashpatch.kernels.triton.common import PHILOX_ROUNDS, dropout_threshold, head_and_block, tile_head_and_block

LSE_ALIGN = gl.constexpr(ALIGN)  # the varlen backward's LSE rows start at multiples of this (`varlen_lse_start`)

# TMA tile load into shared memory, signalling an mbarrier: renamed after Triton 3.6
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

try:  # private names: a release without them loses the fused dQ only, not the Gluon kernels
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """TMA reduce-add of a shared-memory tile into global memory (cp.reduce.async.bulk.tensor .add): issued
        like a TMA store, and waited for like one (tma.store_wait). Triton 3.6's Gluon builds the op but names
        no Python function for it."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)
    TMA_REDUCE = hasattr(_ir, "DESCRIPTOR_REDUCE_KIND")  # whether the fused dQ may use it (dkdv.fuses_dq)
except ImportError:  # pragma: no cover - depends on the installed Triton
    tma_reduce_add = None
    TMA_REDUCE = False


def rows_view(t: torch.Tensor):
    """A 2-D view of a (B, S, H, D) tensor for a TMA descriptor in which the S positions of one (batch, head) are
    consecutive rows, or None if its strides allow none.

    Returns (shape, strides, (rows per batch, rows per head), columns per head): the tile of batch b, head h,
    positions m.. starts at row b * rows_b + h * rows_h + m, column h * cols_h."""
    B, S, H, D = t.shape
    sb, ss, sh, sd = t.stride()
    if sd != 1:
        return None
    if (sh == D or H == 1) and (sb == S * ss or B == 1):  # (B, S, H, D) order: a row holds every head
        return [B * S, H * D], [ss, 1], (S, 0), D
    if (ss == D or S == 1) and (sh == S * D or H == 1) and (sb == H * S * D or B == 1):  # (B, H, S, D) order
        return [B * H * S, D], [D, 1], (H * S, S), 0
    return None


def sm90_dense_ok(*tensors: torch.Tensor, varlen: bool, window_left: int, window_right: int, softcap: float,
                  dropout_p: float, with_dropout: bool = False, with_varlen: bool = False,
                  with_window: bool = False, with_softcap: bool = False, headdims: tuple = (64, 128)) -> bool:
    """The scope the Gluon kernels share: sm_90 with Gluon enabled (`enabled`), dense (B, S, H, D) tensors that
    `rows_view` maps (varlen (T, H, D) ones where the kernel takes them: `with_varlen`), bf16 or fp16, one of the
    kernel's `headdims`, causal or unmasked (or a causal sliding window without dropout: `with_window`), no softcap
    unless the kernel caps the scores (`with_softcap`), no dropout unless the kernel draws it (`with_dropout`), 32-bit
    element offsets. Any lengths: the kernels mask a last tile that runs past a sequence (`key_limit`, the
    backward's padded LSE)."""
    q = tensors[0]
    if not (enabled() and q.is_cuda and capability(q.device) == (9, 0)):
        return False
    if (varlen and not with_varlen) or (softcap > 0 and not with_softcap) or (dropout_p > 0 and not with_dropout) \
            or window_right not in (-1, 0):
        return False
    if window_left >= 0 and not (with_window and window_right == 0 and dropout_p == 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in headdims:
        return False
    views = [t.unsqueeze(0) if varlen else t for t in tensors]  # varlen (T, H, D) as one row of T tokens
    return all(rows_view(t) is not None and t.data_ptr() % 16 == 0 and t.numel() < 2**31 for t in views)


def _descriptor(base: torch.Tensor, shape: list, strides: list, block: list, layout) -> TensorDescriptor:
    """TensorDescriptor(base, shape, strides, block, layout) without its constructor's checks, which cost host time
    at every launch: what they check holds for every call `sm90_dense_ok` accepts (a 16-byte aligned base with 16-byte
    aligned strides, a unit last stride, power-of-two blocks, no empty dimension; the callers return before launching
    on empty tensors)."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block, layout=layout, padding="zero")
    return desc


def descriptor(t: torch.Tensor, block_rows: int):
    """(TensorDescriptor of (block_rows, D) tiles, rows per (batch, head), columns per head) for `rows_view`'s view."""
    shape, strides, rows, cols = rows_view(t)
    layout = _shared_layout(block_rows, t.shape[-1], t.dtype == torch.float16)
    return _descriptor(t, shape, strides, [block_rows, t.shape[-1]], layout), rows, cols


def fp32_descriptor(t: torch.Tensor, block_rows: int):
    """`descriptor` for an fp32 (B, S, H, D) tensor (a dQ accumulator), in (block_rows, 32) tiles: 128 bytes wide,
    the widest box a 128-byte swizzle allows, as a TMA reduce is not split the way copies are."""
    shape, strides, rows, cols = rows_view(t)
    return _descriptor(t, shape, strides, [block_rows, 32], _fp32_layout(block_rows)), rows, cols


def vector_descriptor(t: torch.Tensor, block: int):
    """TensorDescriptor of `block`-element runs of an fp32 tensor's storage, seen as one vector from its first element
    (last dimension contiguous): the run of (b, h, m..) in a (B, H, S) tensor starts at b * stride(0) + h * stride(1)
    + m. For the LSE and delta rows of a step. The descriptor reads only its base's address and dtype, so the base is
    `t` itself."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return _descriptor(t, [extent], [1], [block], _vector_layout(block))


@functools.lru_cache(maxsize=None)
def _fp32_layout(block_rows: int):
    return gl.NVMMASharedLayout.get_default_for([block_rows, 32], gl.float32)


@functools.lru_cache(maxsize=None)
def _vector_layout(block: int):
    return gl.NVMMASharedLayout.get_default_for([block], gl.float32)


@functools.lru_cache(maxsize=None)
def _shared_layout(block_rows: int, headdim: int, fp16: bool):
    """The tile's shared-memory layout, built once per tile shape (descriptors are built at every launch)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, headdim], gl.float16 if fp16 else gl.bfloat16)


def kept_dims(parent, dims):
    """Gluon layout `parent` (a constexpr) sliced down to its dimensions `dims`, the others removed from the last: the
    layout whose tensor `x[...]`, with None at those other positions, expands back into `parent` (the keep words of
    fwd.py and dkdv.py, one dimension of a tile for its aranges)."""
    layout = parent.value
    for dim in reversed(range(len(layout.size_per_thread))):
        if dim not in dims:
            layout = gl.SliceLayout(dim, layout)
    return gl.constexpr(layout)


def carry_shift_in_ptx(decisions, addend: str) -> str:
    """Inline PTX that shifts 16-bit dropout decisions into 32-bit words, one per decision in the order given: a
    decision half >= t is the carry out of half * 2^16 + (2^32 - t * 2^16) (`addend` holds the latter), and
    `addc` doubles the word and adds that carry, so the last decision lands at bit 0. `decisions`: (source word
    operand, "lo" or "hi" half, word operand out, word operand in) each; the drawers of fwd.py and
    dkdv.py build their per-call blocks from it."""
    lines = ["{", ".reg .b32 t;"]
    for source, half, word_out, word_in in decisions:
        if half == "lo":
            lines += [f"shl.b32 t, {source}, 16;", f"add.cc.u32 t, t, {addend};"]
        else:
            lines.append(f"add.cc.u32 t, {source}, {addend};")
        lines.append(f"addc.u32 {word_out}, {word_in}, {word_in};")
    return "\n".join(lines + ["}"])


# A 16-bit pair ($1: two bf16 or fp16 weights of P) with its dropped halves zeroed, for `drop_pairs`: $2, $3 are the
# two elements' keep words, each shifted so that the element's decision is the top bit of a byte, and $4, $5 their
# `prmt` selectors, which fill the low half with the sign of the first element's byte (in $2) and the high half with
# the second's (in $3). One `prmt` and one `and` per pair.
_DROP_PAIR_ASM = gl.constexpr("{ .reg .b32 m, s; or.b32 s, $4, $5; prmt.b32 m, $2, $3, s; and.b32 $0, $1, m; }")


@gluon.jit
def drop_pairs(p, words, bit, second):
    """P (a 2-D bf16 or fp16 tile, the A operand of P V or Pᵀ dO in registers) with the weights that dropout drops
    set to 0: `words` holds each element's 32 keep decisions (broadcast to the kernel's register-split view of
    the tile, as fwd.py's FWD_KEEP_TILE8 and dkdv.py's KEEP_TILE6), `bit` the position of its own (1 = keep), and
    `second` is 1 for the second element of each pair of adjacent registers, which share a 32-bit register once P
    is 16-bit. `bit` and `second` must be known at compile time in every register (aranges of the view's register
    dimensions), so that the shifts and selectors are constants: at most eight shifts a word, then one `prmt` and
    one `and` per pair, against a bit test and a select per weight."""
    shifted = words << (7 - (bit & 7))  # the decision at the top of byte bit >> 3
    byte = bit >> 3
    sel = gl.where(second == 0, (8 | byte) * 0x11, (8 | (4 + byte)) * 0x1100)
    shifted, sel = gl.broadcast(shifted, sel)
    shape: gl.constexpr = [p.shape[0], p.shape[1]]
    shifted = gl.convert_layout(gl.reshape(shifted, shape), p.type.layout, assert_trivial=True)
    sel = gl.convert_layout(gl.reshape(sel, shape), p.type.layout, assert_trivial=True)
    return gl.inline_asm_elementwise(_DROP_PAIR_ASM, "=r,r,r,r,r,r", [p, shifted, sel], dtype=p.dtype,
                                     is_pure=True, pack=2)


@gluon.jit
def query_block_program(seqlen_q, seqlen_k, nheads, group_size, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, HEAD_GROUP: gl.constexpr):
    """This program's query block (the forward's and dQ's): (batch, head, K/V head, first query row, Sk - Sq,
    key blocks below the diagonal, key blocks to visit)."""
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    return query_block_of_tile(gl.program_id(0), gl.num_programs(0) // num_m, seqlen_q, seqlen_k, nheads,
                               group_size, CAUSAL, BLOCK_M, BLOCK_N, HEAD_GROUP)


@gluon.jit
def query_block_of_tile(tile, num_bh, seqlen_q, seqlen_k, nheads, group_size, CAUSAL: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_GROUP: gl.constexpr):
    """`query_block_program` for tile `tile` of num_bh (batch x heads) x the query blocks."""
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    off_bh, pid_m = tile_head_and_block(tile, num_bh, num_m, HEAD_GROUP)  # Triton's 1-D grid order (triton/common.py)
    if CAUSAL:
        pid_m = num_m - 1 - pid_m  # the heaviest query blocks (the last ones) first
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    off_hk = off_h // group_size
    m0 = pid_m * BLOCK_M
    shift, n_full, n_steps = key_steps(m0, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    return off_b, off_h, off_hk, m0, shift, n_full, n_steps


@gluon.jit
def query_tile(tile, num_tiles, seqlen_q, seqlen_k, nheads, group_size, window_left, CAUSAL: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_GROUP: gl.constexpr, WINDOW: gl.constexpr):
    """A persistent program's query block `tile` of num_tiles = batch x heads x query blocks: `query_block_of_tile`'s
    (batch, head, K/V head, first query row, Sk - Sq) and `window_steps`' four counts."""
    off_b, off_h, off_hk, m0, shift, n_full, n_steps = query_block_of_tile(
        tile, num_tiles // gl.cdiv(seqlen_q, BLOCK_M), seqlen_q, seqlen_k, nheads, group_size, CAUSAL, BLOCK_M,
        BLOCK_N, HEAD_GROUP)
    n_first, n_lo, n_full, n_steps = window_steps(m0, shift, n_full, n_steps, window_left, BLOCK_M, BLOCK_N, WINDOW)
    return off_b, off_h, off_hk, m0, shift, n_first, n_lo, n_full, n_steps


@gluon.jit
def key_steps(m0, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(Sk - Sq, key blocks below the diagonal, key blocks to visit) of the query block from row m0."""
    shift = seqlen_k - seqlen_q
    n_steps = gl.cdiv(seqlen_k, BLOCK_N)
    n_full = seqlen_k // BLOCK_N  # without a mask, a last key block past seqlen_k is masked (`key_limit`)
    if CAUSAL:
        n_end = gl.minimum(gl.maximum(m0 + BLOCK_M + shift, 0), seqlen_k)
        n_steps = gl.cdiv(n_end, BLOCK_N)
        n_full = gl.minimum(gl.maximum(m0 + shift + 1, 0) // BLOCK_N, n_steps)  # blocks below the diagonal
    return shift, n_full, n_steps


@gluon.jit
def window_steps(m0, shift, n_full, n_steps, window_left, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 WINDOW: gl.constexpr):
    """A query block's key steps under a causal sliding window of window_left keys (the forward's and dQ's; without
    WINDOW the steps `key_steps` gave): (first key block, masked left-edge steps, steps before the masked diagonal
    ones, steps), the last three counted from the first key block. Query row m sees keys m + Sk - Sq - window_left
    through m + Sk - Sq; a block holding no key that the block's first row sees is skipped, and a block from which
    its last row sees every key is not masked on the left (`window_keys`)."""
    if WINDOW:
        n_first = gl.minimum(gl.maximum(m0 + shift - window_left, 0) // BLOCK_N, n_steps)
        n_lo = gl.cdiv(gl.maximum(m0 + BLOCK_M - 1 + shift - window_left, 0), BLOCK_N)
        n_lo = gl.minimum(gl.maximum(n_lo, n_first), n_full)
        return n_first, n_lo - n_first, n_full - n_first, n_steps - n_first
    else:
        return 0, 0, n_full, n_steps


@gluon.jit
def window_keys(offs_m, offs_n, shift, key_lim, window, WINDOW: gl.constexpr):
    """A forward or dQ consumer's keys under a causal sliding window: (offs_n counted from the program's first key,
    the first key each query row offs_m may see in a masked step, the masked steps on the window's left edge), from
    `window_steps`' window (masked left-edge steps, the program's first key, window_left); without a WINDOW,
    (offs_n, key_lim, 0): no left edge."""
    if WINDOW:
        n_lo, key_first, window_left = window
        return offs_n + key_first, offs_m + shift - window_left, n_lo
    else:
        return offs_n, key_lim, 0


@gluon.jit
def varlen_lse_start(q_first, seq):
    """Where sequence `seq` (first token q_first) starts in a varlen backward's LSE and delta rows, as
    triton.backward's aligned_start places it: a multiple of config.ALIGN, so that the rows' TMA loads start
    aligned, with the rows past the sequence's end padded like a dense row's."""
    return (q_first + seq * LSE_ALIGN) // LSE_ALIGN * LSE_ALIGN


@gluon.jit
def varlen_pair(VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, heads):
    """This program's (sequence, head, block index, first query row and first key row in the packed tensors, query
    length, key length) on a varlen grid of `heads` x the (sequence, block) pairs of VARLEN_BLOCKS ((2, n) int32,
    ops.varlen_blocks), a head's pairs side by side."""
    pairs = gl.num_programs(0) // heads
    seq, block, q_first, k_first, seqlen_q, seqlen_k = _sequence_block(
        gl.program_id(0) % pairs, pairs, VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K)
    return seq, gl.program_id(0) // pairs, block, q_first, k_first, seqlen_q, seqlen_k


@gluon.jit
def _sequence_block(pair, pairs, VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K):
    """Pair `pair` of the `pairs` in VARLEN_BLOCKS: (sequence, block index, first query row and first key row in the
    packed tensors, query length, key length)."""
    seq = gl.load(VARLEN_BLOCKS + pair)
    block = gl.load(VARLEN_BLOCKS + pairs + pair)
    q_first = gl.load(CU_SEQLENS_Q + seq)
    k_first = gl.load(CU_SEQLENS_K + seq)
    seqlen_q = gl.load(CU_SEQLENS_Q + seq + 1) - q_first
    seqlen_k = gl.load(CU_SEQLENS_K + seq + 1) - k_first
    return seq, block, q_first, k_first, seqlen_q, seqlen_k


@gluon.jit
def varlen_query_block_program(VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, nheads, group_size, CAUSAL: gl.constexpr,
                               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """This program's query block of a varlen batch (the forward's and dQ's): (sequence, head, K/V head, first query row
    within the sequence, Sk - Sq, key blocks below the diagonal, key blocks to visit, the sequence's first query row
    and first key row in the packed tensors, its query length). The grid holds nheads x the (sequence, block) pairs
    of VARLEN_BLOCKS (`varlen_pair`); a pair past the last block gets no steps and a query length of 0, so it
    stores nothing."""
    seq, off_h, block, q_start, k_start, seqlen_q, seqlen_k = varlen_pair(VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                                          nheads)
    m0 = block * BLOCK_M
    shift, n_full, n_steps = key_steps(m0, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    past_end = m0 >= seqlen_q
    n_steps = gl.where(past_end, 0, n_steps)
    n_full = gl.minimum(n_full, n_steps)
    seqlen_q = gl.where(past_end, 0, seqlen_q)
    return seq, off_h, off_h // group_size, m0, shift, n_full, n_steps, q_start, k_start, seqlen_q, seqlen_k


@gluon.jit
def key_limit(offs_m, shift, seqlen_k, CAUSAL: gl.constexpr):
    """The last key each query row offs_m may see in a masked step (the forward's and dQ's): its causal diagonal,
    key n <= m + Sk - Sq (bottom-right aligned), which for every row before seqlen_q lies before seqlen_k, or
    without a mask the sequence's last key, for a last key block that runs past it. The rows past seqlen_q of a last
    query block compute on whatever their TMA tile held and are never stored."""
    if CAUSAL:
        return offs_m + shift
    else:
        return offs_m * 0 + (seqlen_k - 1)


@gluon.jit
def head_slope_log2(ALIBI_SLOPES, index, ALIBI: gl.constexpr):
    """ALiBi's slope of one (sequence, head), ALIBI_SLOPES[index], times log2(e) (the scores are in log2
    units); 0 without ALiBi."""
    if ALIBI:
        return gl.load(ALIBI_SLOPES + index) * 1.4426950408889634
    else:
        return 0.0


@gluon.jit
def dropout_seed_offset(SEED_OFFSET, DROPOUT: gl.constexpr):
    """The call's Philox (seed, offset) (ops.draw_seed_offset); zeros without dropout."""
    seed = 0
    offset = 0
    if DROPOUT:
        seed = gl.load(SEED_OFFSET)
        offset = gl.load(SEED_OFFSET + 1)
    return seed, offset


@gluon.jit
def carry_addend(dropout_p):
    """(2^32 - t * 2^16 as uint32, whether t = 0) for threshold t = triton.common.dropout_threshold(dropout_p):
    the addend whose carry out of half * 2^16 + addend is the decision half >= t (`carry_shift_in_ptx`), for the
    drawers of fwd.py and dkdv.py. t = 2^16 (every weight dropped) wraps it to 0 as it should; t = 0 (p under
    2^-17) wraps it to 0 too, so there the caller keeps every weight by the second value."""
    threshold = dropout_threshold(dropout_p)
    return 0 - (threshold << 16), threshold == 0


@gluon.jit
def allocate_keep_ring(SLOTS: gl.constexpr, SLOT_SHAPE: gl.constexpr, LAYOUT: gl.constexpr):
    """The drawers' rings of keep words (fwd.py's and dkdv.py's): SLOTS int32 slots of SLOT_SHAPE for each of the
    two consumers (consumer w's are w * SLOTS ..), a `keep_full` mbarrier per slot, which its drawer arrives at,
    and a `keep_empty` one, which its consumer arrives at."""
    bufs = gl.allocate_shared_memory(gl.int32, [2 * SLOTS] + SLOT_SHAPE, LAYOUT)
    full = gl.allocate_shared_memory(gl.int64, [2 * SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2 * SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2 * SLOTS):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return bufs, full, empty


# The PTX of one 32 x 32 -> 64-bit product by each of Philox's round multipliers (Random123's, as tl.philox) as a
# (high word, low word) pair
_MUL_WIDE_A_ASM = gl.constexpr("{ .reg .b64 w; mul.wide.u32 w, $2, 0xD2511F53; mov.b64 {$1, $0}, w; }")


_MUL_WIDE_B_ASM = gl.constexpr("{ .reg .b64 w; mul.wide.u32 w, $2, 0xCD9E8D57; mov.b64 {$1, $0}, w; }")


@gluon.jit
def _mul_wide(x, ASM: gl.constexpr):
    """(high word, low word) of x times ASM's multiplier."""
    return gl.inline_asm_elementwise(ASM, "=r,=r,r", [x], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)


@gluon.jit
def philox_wide(seed, counter):
    """triton.common.philox4x32's four words (tl.philox's rounds, the same arithmetic) with each round's two
    products written as one mul.wide each, for the Gluon kernels that draw keep bits (the drawers of fwd.py and
    dkdv.py, the dQ pass of dq.py): from tl.philox's mul.hi and mul.lo ptxas mostly issues two IMADs a product, here
    one IMAD.WIDE, a third fewer instructions a call. The first round is written out with c2 = c3 = 0."""
    c0 = (counter & 0xFFFFFFFF).to(gl.uint32)
    c1 = (counter >> 32).to(gl.uint32)
    seed = seed.to(gl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
    k1 = (seed >> 32).to(gl.uint32)
    hi_a, lo_a = _mul_wide(c0, _MUL_WIDE_A_ASM)
    c0 = c1 ^ k0  # umulhi(B, 0) ^ c1 ^ k0
    c1 = c0 & 0  # B * 0
    c2 = hi_a ^ k1  # umulhi(A, c0) ^ 0 ^ k1
    c3 = lo_a
    for _ in gl.static_range(PHILOX_ROUNDS - 1):
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
        hi_b, lo_b = _mul_wide(c2, _MUL_WIDE_B_ASM)
        hi_a, lo_a = _mul_wide(c0, _MUL_WIDE_A_ASM)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
    return c0, c1, c2, c3


@gluon.jit
def softcap_tanh(x):
    """tanh(x) for softcap's scores, cap_log2 * tanh(qk * qk_scale) in log2 units (qk_scale = softmax_scale / softcap,
    cap_log2 = softcap * log2(e): ops._scales), as the MUFU's tanh.approx.f32: one instruction, with a relative error
    of about 2^-11 (a bf16 score's own rounding is 2^-9). 1 - 2 / (e^2x + 1) through exp2 and a division, as the
    Triton kernels compute it, cost a quarter of the forward's speed (docs/tuning.md)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def softcap_scores(s, qk_scale, cap_log2):
    """The backward's softcapped scores in log2 units, cap_log2 * tanh(s * qk_scale), and the cap's derivative
    1 - tanh^2 that dS takes."""
    t = softcap_tanh(s * qk_scale)
    slope = 1.0 - t * t
    return cap_log2 * t, slope


@gluon.jit
def alibi_bias(alibi_log2, rows, cols):
    """ALiBi's -slope * |i + Sk - Sq - j| in log2 units, as triton.common.alibi_bias: `rows` are query positions
    already shifted by Sk - Sq (bottom-right aligned, so a causal diagonal has no bias), `cols` key positions,
    as a column and a row that broadcast to the tile (a row and a column in dK/dV's keys x queries tile). They
    are subtracted as float32 (exact below 2^24): float subtraction is not reassociated, so the compiler cannot
    hoist a loop-invariant integer (rows - cols) tile out of the loop and hold it in registers, as it did in the
    dK/dV kernel (296 B of spills against 72)."""
    return -alibi_log2 * gl.abs(rows.to(gl.float32) - cols.to(gl.float32))


@gluon.jit
def allocate_kv_ring(k_desc, v_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The K/V ring (the forward's and dQ's): STAGES (BLOCK_N, D) tiles of each, a `ready` mbarrier per tile and an
    `empty` one per stage, which each of the CONSUMERS consumer warpgroups arrives at."""
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    ready_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready_k.index(s), count=1)
        mbarrier.init(ready_v.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)  # one arrival per consumer warpgroup
    return k_bufs, v_bufs, ready_k, ready_v, empty


@gluon.jit
def store_tile_by_tma(desc, coords, buf, tile):
    """A warpgroup's register tile written over its rows of shared memory `buf` and handed to a TMA store at coords
    of desc's tensor, once every thread's rows are written. The caller waits for the store (tma.store_wait) before
    the rows are written again or handed back."""
    buf.store(tile)
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(desc, coords, buf)


@gluon.jit
def stream_kv(k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, empty, k_row, k_col, v_row, v_col, n_steps,
              ring, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producer's loop (the forward's and dQ's): key block i into stage (ring + i) % STAGES once both
    consumers have released it; K and V signal separately, so Q Kᵀ can start before V has landed. ring: the
    key blocks this program streamed before (0 but in a persistent program)."""
    for i in range(n_steps):
        s = (ring + i) % STAGES
        # a fresh mbarrier counts as having completed the phase before 0, so the first lap does not wait
        mbarrier.wait(empty.index(s), (((ring + i) // STAGES) & 1) ^ 1)
        mbarrier.expect(ready_k.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [k_row + i * BLOCK_N, k_col], ready_k.index(s), k_bufs.index(s))
        mbarrier.expect(ready_v.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [v_row + i * BLOCK_N, v_col], ready_v.index(s), v_bufs.index(s))


@gluon.jit
def persistent_rounds(num_tiles, SCHEDULE, schedule_rounds):
    """How many tiles each program of a persistent grid takes (`persistent_tile`), some past num_tiles."""
    if SCHEDULE is None:
        return gl.cdiv(num_tiles, gl.num_programs(0))
    else:
        return schedule_rounds


@gluon.jit
def persistent_tile(rnd, SCHEDULE, schedule_rounds):
    """This program's tile in round `rnd` of a persistent grid (num_tiles or more: none). With a SCHEDULE
    table (schedule.causal_schedule: the causal forward), the table's; else every other round runs in reverse
    (program p takes tile p, then 2P - 1 - p, ...), so over a causal grid ordered heaviest first a program that
    took a heavy block takes a light one next (close to an even split: docs/tuning.md, "sm_90 Gluon kernels")."""
    pid = gl.program_id(0)
    if SCHEDULE is None:
        num_programs = gl.num_programs(0)
        return rnd * num_programs + pid + (rnd % 2) * (num_programs - 1 - 2 * pid)
    else:
        return gl.load(SCHEDULE + pid * schedule_rounds + rnd)


@gluon.jit
def allocate_query_barriers():
    """A persistent program's two query buffers' mbarriers (the forward's and dQ's): `ready` per buffer, which the
    producer's TMA completes, and `empty`, which both consumer warpgroups arrive at."""
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=2)  # one arrival per consumer warpgroup
    return ready, empty


@gluon.jit
def producer_persistent(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, ready_k, ready_v, empty,
                        q_ready, q_empty, q_rows, q_cols, do_rows, do_cols, k_rows, k_cols, v_rows, v_cols,
                        num_tiles, nheads, group_size, seqlen_q, seqlen_k, SCHEDULE, schedule_rounds,
                        CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, HEAD_GROUP: gl.constexpr, window_left=0, WINDOW: gl.constexpr = False):
    """A persistent program's producer (the forward's, which passes None for dO, and dQ's): per
    tile (`query_tile`), Q (and dO) into one of two buffers once both consumers released it two tiles ago, then the
    tile's K/V blocks into the ring, which runs on across tiles (so the next tile's first blocks load under this
    one's last steps and epilogue). WINDOW (the forward's): a tile's K/V stream starts at the first key block its
    first row sees."""
    ring = 0  # key blocks streamed so far
    done = 0  # tiles so far
    for rnd in range(persistent_rounds(num_tiles, SCHEDULE, schedule_rounds)):
        tile = persistent_tile(rnd, SCHEDULE, schedule_rounds)
        if tile < num_tiles:
            off_b, off_h, off_hk, m0, _, n_first, _, _, n_steps = query_tile(
                tile, num_tiles, seqlen_q, seqlen_k, nheads, group_size, window_left, CAUSAL, BLOCK_M, BLOCK_N,
                HEAD_GROUP, WINDOW)
            qb = done % 2
            bar = q_ready.index(qb)
            mbarrier.wait(q_empty.index(qb), ((done // 2) & 1) ^ 1)
            if do_desc is None:
                mbarrier.expect(bar, q_desc.block_type.nbytes)
            else:
                mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                tma_load(do_desc, [off_b * do_rows[0] + off_h * do_rows[1] + m0, off_h * do_cols], bar,
                         do_bufs.index(qb))
            tma_load(q_desc, [off_b * q_rows[0] + off_h * q_rows[1] + m0, off_h * q_cols], bar, q_bufs.index(qb))
            key_row = n_first * BLOCK_N
            stream_kv(k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, empty,
                      off_b * k_rows[0] + off_hk * k_rows[1] + key_row, off_hk * k_cols,
                      off_b * v_rows[0] + off_hk * v_rows[1] + key_row, off_hk * v_cols, n_steps, ring, BLOCK_N, STAGES)
            ring += n_steps
            done += 1


# A dynamically scheduled persistent grid (the varlen forward's): a program's producer takes work items by tickets
# from a counter, and hands each item's fields to its consumers through a shared-memory slot per query buffer, which
# the query buffer's `ready` mbarrier publishes (the producer writes the slot before its expect-arrival). An item's
# fields: more work (1 or 0), head, sequence, the block's first query row in the sequence, the sequence's first query
# and key rows in the packed tensors, its query length and its key length.
ITEM_FIELDS = gl.constexpr(8)


@gluon.jit
def take_ticket(COUNTER):
    """The next work item of a dynamically scheduled grid: COUNTER[0] before this program's increment (a one-warp
    partition's call; lane 0 takes it, a shuffle gives it to the warp)."""
    return _warp_increment(COUNTER)


@gluon.jit
def _warp_increment(PTR):
    """*PTR before adding 1 to it, for every lane of a one-warp partition: lane 0 adds, a shuffle gives the value to
    the warp."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    before = gl.atomic_add(PTR + lane * 0, gl.full([32], 1, gl.int32, layout), mask=lane == 0)
    return gl.max(gl.where(lane == 0, before, 0), axis=0)


@gluon.jit
def release_tickets(COUNTER):
    """A producer's last act once it drew a ticket past the work: COUNTER[1] counts the programs done drawing, and the
    last of them sets both counters back to 0 for the next launch on the stream (every program has drawn its last
    ticket by then)."""
    last = _warp_increment(COUNTER + 1) == gl.num_programs(0) - 1
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    gl.store(COUNTER + lane, gl.zeros([32], gl.int32, layout), mask=(lane < 2) & last)


@gluon.jit
def varlen_item(ticket, num_items, nheads, VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, BLOCK_M: gl.constexpr):
    """Ticket `ticket` of num_items = nheads x the (sequence, block) pairs of VARLEN_BLOCKS (ops.varlen_blocks), the
    heads of a pair side by side (so the heaviest blocks of every head come first): (more work, head, sequence,
    first query row in the sequence, first query and key rows of the sequence, query length, key length). A ticket
    past the items or naming a pair past the last block is no work: those pairs are the table's tail, so every later
    ticket is past it too."""
    pairs = num_items // nheads
    seq, block, q_first, k_first, seqlen_q, seqlen_k = _sequence_block(
        gl.minimum(ticket // nheads, pairs - 1), pairs, VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K)
    m0 = block * BLOCK_M
    more = (ticket < num_items) & (m0 < seqlen_q)
    return more, ticket % nheads, seq, m0, q_first, k_first, seqlen_q, seqlen_k


@gluon.jit
def allocate_item_slots():
    """The shared memory of `hand_item`: ITEM_FIELDS int32 per query buffer (two)."""
    return gl.allocate_shared_memory(gl.int32, [2, ITEM_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def hand_item(slot, more, head, seq, m0, q_first, k_first, seqlen_q, seqlen_k):
    """The producer's half of the hand-off (a one-warp partition): an item's fields (`varlen_item`) into its slot."""
    layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [1], [0])
    f = gl.arange(0, ITEM_FIELDS, layout=layout)
    fields = gl.where(f == 0, more.to(gl.int32), gl.where(f == 1, head, gl.where(f == 2, seq, gl.where(
        f == 3, m0, gl.where(f == 4, q_first, gl.where(f == 5, k_first, gl.where(f == 6, seqlen_q, seqlen_k)))))))
    slot.store(fields)


@gluon.jit
def _item_field(fields, f, index: gl.constexpr):
    return gl.sum(gl.where(f == index, fields, 0), axis=0)


@gluon.jit
def read_item(slot):
    """A consumer warpgroup's half of the hand-off, once the slot's query buffer is ready: `varlen_item`'s fields."""
    layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [4], [0])
    fields = slot.load(layout)  # every thread holds every field
    f = gl.arange(0, ITEM_FIELDS, layout=layout)
    return (_item_field(fields, f, 0) != 0, _item_field(fields, f, 1), _item_field(fields, f, 2),
            _item_field(fields, f, 3), _item_field(fields, f, 4), _item_field(fields, f, 5),
            _item_field(fields, f, 6), _item_field(fields, f, 7))


@gluon.jit
def next_query_step(g, m0, m_lo, m_end, BLOCK_M: gl.constexpr):
    """The (head in the GQA group, first query row) after step (g, m0): the next query block of the head, or
    the next head's first (m_lo). Carried through the loop instead of derived from the step count, whose
    integer division each step cost a few percent of the samples."""
    m0 += BLOCK_M
    wrap = m0 >= m_end
    return gl.where(wrap, g + 1, g), gl.where(wrap, m_lo, m0)


@gluon.jit
def causal_mask_t(p_t, offs_n, offs_m, last_key_of_first_query):
    """Pᵀ with the scores of keys after each query's last visible one zeroed (bottom-right aligned: key n is
    visible from query m0 + j when n <= m0 + j + Sk - Sq)."""
    return gl.where(offs_n[:, None] <= last_key_of_first_query + offs_m[None, :], p_t, 0.0)


@gluon.jit
def window_mask_t(p_t, offs_n, offs_m, first_key_of_first_query):
    """Pᵀ with the scores of keys before each query's first visible one zeroed under a causal sliding window:
    key n is visible from query m0 + j when n >= m0 + j + Sk - Sq - window_left."""
    return gl.where(offs_n[:, None] >= first_key_of_first_query + offs_m[None, :], p_t, 0.0)


@gluon.jit
def dkdv_producer(args, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """The dK/dV kernels' producer warp: the program's K and V once (`kv_bar`), then per step the (BLOCK_M, D) tiles
    of Q and dO and the step's LSE and delta into the ring that `allocate_dkdv_ring` made."""
    (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs,
     k_smem, v_smem, ready, empty, kv_bar,
     q_row, q_row_per_head, q_col, q_col_per_head, do_row, do_row_per_head, do_col, do_col_per_head,
     k_row, k_col, v_row, v_col, lse_base, lse_per_head, m_lo, m_end, total) = args
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [k_row, k_col], kv_bar, k_smem)
    tma_load(v_desc, [v_row, v_col], kv_bar, v_smem)
    step_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
    g = 0
    m0 = m_lo
    for i in range(total):
        s = i % STAGES
        # a fresh mbarrier counts as having completed the phase before 0, so the first lap does not wait
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, step_bytes)
        tma_load(q_desc, [q_row + g * q_row_per_head + m0, q_col + g * q_col_per_head], bar, q_bufs.index(s))
        tma_load(do_desc, [do_row + g * do_row_per_head + m0, do_col + g * do_col_per_head], bar,
                 do_bufs.index(s))
        rows = lse_base + g * lse_per_head + m0
        tma_load(lse_desc, [rows], bar, lse_bufs.index(s))
        tma_load(delta_desc, [rows], bar, delta_bufs.index(s))
        g, m0 = next_query_step(g, m0, m_lo, m_end, BLOCK_M)


@gluon.jit
def key_block_program(VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, q_rows, do_rows, k_rows, v_rows, dq_rows,
                      stride_dkb, stride_dks, stride_dvb, stride_dvs, stride_lse_b, nheads_k, group_size, seqlen_q,
                      seqlen_k, window_left, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr,
                      HEAD_GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """A dK/dV program's key block and the query blocks it visits (dkdv.py's and dkdv256.py's): (sequence or batch
    row, K/V head, its group's first query head, first key, Sk - Sq, query length, key length, first query row
    visited, the end of its query rows, steps over the GQA group, then the first rows of its batch row or sequence
    in the Q, dO, K, V and dQ views, of its LSE rows, and of its dK and dV rows). On a varlen grid (VARLEN) a
    (sequence, key block) pair of VARLEN_BLOCKS per program, a K/V head's pairs side by side, and a pair past the
    last key block gets no steps; else Triton's 1-D grid order (triton/common.py), under a causal mask the first
    key blocks (which the most queries see) first. Under a causal WINDOW the query rows end where the block's last
    key leaves their windows."""
    if VARLEN:
        off_b, off_hk, block, q_first, k_first, seqlen_q, seqlen_k = varlen_pair(
            VARLEN_BLOCKS, CU_SEQLENS_Q, CU_SEQLENS_K, nheads_k)  # off_b: the sequence
        n0 = block * BLOCK_N
        do_first = q_first
        v_first = k_first
        dq_first = q_first
        lse_first_row = varlen_lse_start(q_first, off_b)
        dk_first = k_first * stride_dks
        dv_first = k_first * stride_dvs
    else:
        num_n = gl.cdiv(seqlen_k, BLOCK_N)
        off_bhk, pid_n = head_and_block(num_n, True, HEAD_GROUP)
        off_b = off_bhk // nheads_k
        off_hk = off_bhk % nheads_k
        n0 = pid_n * BLOCK_N
        q_first = off_b * q_rows[0]
        do_first = off_b * do_rows[0]
        k_first = off_b * k_rows[0]
        v_first = off_b * v_rows[0]
        dq_first = off_b * dq_rows[0]
        lse_first_row = off_b * stride_lse_b
        dk_first = off_b * stride_dkb
        dv_first = off_b * stride_dvb
    off_h0 = off_hk * group_size
    shift = seqlen_k - seqlen_q
    m_lo = 0
    if CAUSAL:  # the first query block that sees any of the block's keys
        m_lo = (gl.maximum(n0 - shift, 0) // BLOCK_M) * BLOCK_M
    m_stop = seqlen_q
    if WINDOW:  # query m sees key n while n >= m + Sk - Sq - window_left
        m_stop = gl.minimum(n0 + BLOCK_N - shift + window_left, seqlen_q)
    n_mblocks = gl.cdiv(gl.maximum(m_stop - m_lo, 0), BLOCK_M)
    if VARLEN:  # a pair past the last key block (ops.varlen_blocks) has no steps, and stores nothing
        n_mblocks = gl.where(n0 < seqlen_k, n_mblocks, 0)
    return (off_b, off_hk, off_h0, n0, shift, seqlen_q, seqlen_k, m_lo, m_lo + n_mblocks * BLOCK_M,
            group_size * n_mblocks, q_first, do_first, k_first, v_first, dq_first, lse_first_row, dk_first, dv_first)


@gluon.jit
def allocate_dkdv_ring(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, STAGES: gl.constexpr,
                       BLOCK_M: gl.constexpr):
    """The shared memory `dkdv_producer` fills: STAGES stages of Q, dO, LSE and delta (a `ready` mbarrier each, and an
    `empty` one that both consumer warpgroups arrive at), and the program's K and V (`kv_bar`)."""
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    mbarrier.init(kv_bar, count=1)
    return q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ready, empty, kv_bar
