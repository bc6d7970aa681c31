"""Raw ops: the Triton launches, registered as torch.library custom ops with fake (meta) implementations so that
torch.compile traces through them as opaque nodes.

Dense tensors are (batch, seqlen, heads, headdim); varlen tensors are (total_tokens, heads, headdim) with
cu_seqlens. Both run the same kernels: varlen reads a sequence's start and length from cu_seqlens, dense uses a
batch stride. On an H100/H200 (sm_90), dense calls at head dim 64, 128 or 256 that are causal or unmasked (with or
without ALiBi slopes or softcap), of any lengths, run warp-specialized Gluon kernels instead, and so do such varlen
calls and causal sliding windows without dropout (kernels/sm90/; same results; dropout at head dims 64 and 128 only);
FLASHPATCH_GLUON=0 turns them off.
No argument checking here: flashpatch.validation does it in the public layer.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable, Optional

import torch
import triton

from flashpatch.kernels import config as kernel_config
from flashpatch.kernels import options as kernel_options
from flashpatch.kernels import sm90
from flashpatch.kernels.launch import Record, cdiv, launch, next_power_of_2, on_input_device, replay
from flashpatch.kernels.triton.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from flashpatch.kernels.triton.common import alibi_batch_stride
from flashpatch.kernels.triton.dropout import dropout_mask_kernel
from flashpatch.kernels.triton.forward import attn_fwd_kernel
from flashpatch.memo import once_per_tensor
from flashpatch.padding import grad_like_input

if sm90.AVAILABLE:  # the Gluon kernels, which take the calls in their scope where sm90.enabled()
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv, dkdv256 as sm90_dkdv256, dq as sm90_dq, fwd as sm90_fwd
else:  # pragma: no cover - depends on the installed Triton
    sm90_dkdv = sm90_dkdv256 = sm90_dq = sm90_fwd = None

LOG2E = math.log2(math.e)
_INTERPRETED = type(attn_fwd_kernel).__name__ == "InterpretedFunction"


def check_runnable(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _INTERPRETED:
        raise RuntimeError(
            f"flashpatch kernels need CUDA tensors, got a tensor on {t.device}. To run on the CPU through the "
            "Triton interpreter (slow; for tests and small runs), set TRITON_INTERPRET=1 in the environment "
            "before flashpatch is imported."
        )


def _seq_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, seq, head) strides; varlen tensors have no batch dimension (stride 0)."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    # dense LSE (B, H, Sq); varlen LSE (H, total_q) addressed from the sequence's first token
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _scales(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap_log2): scores in log2 units are qk * qk_scale, or cap_log2 * tanh(qk * qk_scale)."""
    if softcap > 0:
        return softmax_scale / softcap, softcap * LOG2E
    return softmax_scale * LOG2E, 0.0


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are computed in fp32 ("ieee"), not TF32: exact parity tests rely on it.
    return "ieee" if dtype == torch.float32 else "tf32"


def _common_flags(varlen, window_left, window_right, softcap, dropout_p, dtype, alibi_slopes):
    return dict(
        IS_VARLEN=varlen,
        HAS_LEFT=window_left >= 0,
        HAS_RIGHT=window_right >= 0,
        SOFTCAP=softcap > 0,
        ALIBI=alibi_slopes is not None,
        DROPOUT=dropout_p > 0,
        DOT_PRECISION=_dot_precision(dtype),
    )


def _tma_supported(device: torch.device) -> bool:
    return (not _INTERPRETED and device.type == "cuda" and sm90.capability(device)[0] >= 9
            and hasattr(triton.language, "make_tensor_descriptor"))


def block_d(headdim: int) -> int:
    """The kernels' head-dim tile: the next power of two, at least 16 (tl.dot's smallest K); columns past headdim
    are masked on load and store, never copied."""
    return max(16, next_power_of_2(headdim))


def tma_usable(headdim: int, *tensors: torch.Tensor) -> bool:
    """Tensor descriptors need the head dim to fill its tile (a power of two, at least 16; the tile is the whole row),
    and 16-byte aligned bases and strides in every tensor they address; otherwise the kernels use pointer
    arithmetic."""
    if headdim != block_d(headdim) or not _tma_supported(tensors[0].device):
        return False
    for t in tensors:
        size = t.element_size()
        if headdim * size < 16 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _descriptor_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


_side_streams = threading.local()


def _side_stream(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]:
    """(stream, fork event, join event) of KernelConfigs.concurrent_dq for `device`: the stream at the highest priority
    CUDA offers, and two events reused by every call (a wait takes the record before it). Per thread, so that two
    threads' backwards never wait on each other's records."""
    per_device = getattr(_side_streams, "per_device", None)
    if per_device is None:
        per_device = _side_streams.per_device = {}
    entry = per_device.get(device)
    if entry is None:
        highest = torch.cuda.Stream.priority_range()[1]
        entry = per_device[device] = (torch.cuda.Stream(device=device, priority=highest), torch.cuda.Event(),
                                      torch.cuda.Event())
    return entry


def _ensure_allocator() -> None:
    """Kernels that build tensor descriptors on the device need scratch memory from triton's allocator. The
    setting is a context variable (the autograd engine's threads start without it), so it is checked before
    each launch; an allocator the user has set is left alone."""
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_descriptor_scratch)


def _grid(heads: int, num_blocks: int, blocks_fastest: bool) -> tuple[int, ...]:
    return (heads * num_blocks,) if blocks_fastest else (heads, num_blocks)


def _varlen_grid_blocks(cu_seqlens: torch.Tensor, rows: int, block: int) -> int:
    """rows // block + batch: a bound on sum(ceil(length / block)) over the sequences, from shapes alone."""
    return rows // block + cu_seqlens.numel() - 1


def varlen_blocks(cu_seqlens: torch.Tensor, rows: int, block: int, heaviest_first: bool,
                  longest_first: bool = True) -> torch.Tensor:
    """(2, n) int32: the (sequence, block) pairs of a varlen launch's grid (triton.common.batch_head_and_block),
    which then holds nheads x n programs. A grid of batch x ceil(max_seqlen / block) blocks per head would be mostly
    empty programs on a batch of mixed lengths (64k tokens in 73 documents of 64..4096: 37k programs per kernel, 9k
    of them with work; the empty ones cost GPU time too: docs/tuning.md, "varlen grids"), and it grows with the
    longest sequence times the batch.

    n = `_varlen_grid_blocks` bounds the blocks that exist from shapes alone (no host sync); the pairs past the
    last block name block ceil(length_0 / block) of sequence 0, which the kernels skip.

    Order: a sequence's blocks side by side, so the programs in flight share its K/V (or Q/dO) in L2; sorting all
    pairs by block index instead (the order of a (batch x heads, blocks) grid) made the varlen dQ slower. Within a
    sequence, heaviest_first runs the blocks from the last down (query blocks: under a causal mask the last see the
    most keys), else from 0 up (key blocks: the first are seen by the most queries). With longest_first
    (options.KernelOptions.varlen_longest_first) the sequences go longest first (ties in batch order), so the grid
    ends on short sequences' light blocks instead of a long one's. Computed on the device once per cu_seqlens tensor
    (memo.once_per_tensor)."""
    batch = cu_seqlens.numel() - 1
    count = _varlen_grid_blocks(cu_seqlens, rows, block)

    def compute():
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        blocks = (lengths + block - 1) // block  # (batch,)
        if longest_first:
            visit = torch.sort(blocks, descending=True, stable=True).indices  # (batch,): the sequences in grid order
        else:
            visit = torch.arange(batch, device=cu_seqlens.device)
        visited_blocks = blocks[visit]
        ends = visited_blocks.cumsum(0)
        index = torch.arange(count, device=cu_seqlens.device)
        slot = torch.searchsorted(ends, index, right=True).clamp_(max=batch - 1)  # past the end: clamped, below
        block_in_seq = index - (ends[slot] - visited_blocks[slot])
        if heaviest_first:
            block_in_seq = visited_blocks[slot] - 1 - block_in_seq
        past_end = index >= ends[-1]
        seq = visit[slot].masked_fill(past_end, 0)
        block_in_seq = torch.where(past_end, blocks[0], block_in_seq)
        return torch.stack([seq, block_in_seq]).to(torch.int32)

    return once_per_tensor(cu_seqlens, ("varlen_blocks", rows, block, heaviest_first, longest_first), compute)


_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


def _launch_grid(heads: int, block: int, blocks_fastest: bool, cu_seqlens: Optional[torch.Tensor], rows: int,
                 batch: int, max_seqlen: int, heaviest_first: bool, opts: kernel_options.KernelOptions):
    """(grid, VARLEN_BLOCKS, BLOCKS_FASTEST) of a launch with one program per head and block of `block` rows (of
    queries: the forward and dQ, heaviest_first; of keys: dK/dV). A varlen grid too long for the second axis of
    a 2-D grid becomes a 1-D one (triton.common.head_and_block: a head's blocks side by side)."""
    if cu_seqlens is None:
        return _grid(batch * heads, cdiv(max_seqlen, block), blocks_fastest), None, blocks_fastest
    if not blocks_fastest and _varlen_grid_blocks(cu_seqlens, rows, block) > _MAX_GRID_Y:
        blocks_fastest = True
    blocks = varlen_blocks(cu_seqlens, rows, block, heaviest_first, opts.varlen_longest_first)
    return _grid(heads, blocks.shape[1], blocks_fastest), blocks, blocks_fastest


def _head_group(cfg: kernel_config.LaunchConfig, varlen: bool, window_left: int, window_right: int, max_seqlen: int,
                device: torch.device, opts: kernel_options.KernelOptions, by_keys: bool = False) -> int:
    """The grid order of a `blocks_fastest` launch (config.head_group): by how much a block's work varies, which
    the rule knows for dense causal rows; the rest keep a head's blocks side by side (1)."""
    if not cfg.blocks_fastest:
        return 1  # unused: a 2-D grid
    causal = not varlen and window_left < 0 and window_right == 0
    return kernel_config.head_group(causal, cdiv(max_seqlen, cfg.block_n if by_keys else cfg.block_m),
                                    device, opts.head_group)


def _even_interior(enabled: bool, headdim: int) -> bool:
    """The fully visible blocks between the mask edges (triton.common.key_block_range, query_block_range) always
    lie inside the sequence, so their loads need a mask only for padded head-dim columns: ragged and varlen rows keep
    the masks on their edge blocks alone."""
    return enabled and headdim == block_d(headdim)


def _even(enabled: bool, varlen: bool, headdim: int, *length_and_tile: int) -> bool:
    """Every inner-loop tile lies in bounds: `_even_interior`, and the batch is dense (varlen sequences end
    anywhere) with each (length, tile) pair dividing."""
    pairs = zip(length_and_tile[::2], length_and_tile[1::2])
    return (_even_interior(enabled, headdim) and not varlen
            and all(length % tile == 0 for length, tile in pairs))


def _aligned(varlen: bool, headdim: int, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    """_even for every tile config.py may choose (all are powers of two up to ALIGN): then no launch keeps bounds
    masks in its loads, and config.py picks the tiles measured for that case."""
    align = kernel_config.ALIGN
    return _even(True, varlen, headdim, max_seqlen_q, align, max_seqlen_k, align)


def _launch_configs(q: torch.Tensor, k: torch.Tensor, varlen: bool, max_seqlen_q: int, max_seqlen_k: int,
                    window_left: int, window_right: int, dropout_p: float, softcap: float,
                    opts: kernel_options.KernelOptions) -> kernel_config.KernelConfigs:
    """config.py's launch settings for one call, forward or backward (the same inputs pick the same settings), with
    the KernelConfigs fields that `opts` sets on top."""
    headdim = q.shape[-1]
    long_from = kernel_config.LONG_KEYS_DROPOUT if dropout_p > 0 else kernel_config.LONG_KEYS
    long_keys = _mean_keys_seen(max_seqlen_q, max_seqlen_k, window_left, window_right) >= long_from
    return kernel_config.configs_for(headdim, q.is_cuda, window_left >= 0 or window_right >= 0, dropout_p > 0,
                                     _aligned(varlen, headdim, max_seqlen_q, max_seqlen_k),
                                     max_seqlen_q <= kernel_config.SHORT, q.shape[-2] != k.shape[-2], long_keys,
                                     varlen, window_left >= 0, softcap > 0, fields=opts.config_fields)


def _mean_keys_seen(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int) -> float:
    """Keys a query attends to, averaged over the queries: all seqlen_k without a mask; under the bottom-right causal
    mask query i sees i + 1 + seqlen_k - seqlen_q of them, none where that is below 1. Sliding windows count as 0:
    config's `windowed` decides for them what `long_keys` decides for the rest."""
    if window_left < 0 and window_right < 0:
        return float(seqlen_k)
    if window_left < 0 and window_right == 0:
        if seqlen_q <= seqlen_k:
            return seqlen_k - (seqlen_q - 1) / 2
        return seqlen_k * (seqlen_k + 1) / (2 * seqlen_q)
    return 0.0


_MAX_PLANS = 1024  # call signatures kept; a process meeting more starts over
_plans: dict[tuple, Any] = {}


def _tensor_key(t: Optional[torch.Tensor]):
    """What a call's decisions and its launches' specialization read from a tensor: shape, strides, dtype and
    16-byte alignment (None for an absent one)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16


def _plan_key(kind: str, opts: kernel_options.KernelOptions, tensors: tuple, *scalars) -> tuple:
    """The key of a call's plan: everything its decisions read (the tensors' metadata, the scalar arguments that pick
    kernels and tiles, the options, whether the Gluon kernels may run, the device), so that two calls with equal keys
    make the same decisions and pass their launches arguments of the same signature (launch.launch's `site`). The
    tensors the call allocates itself follow from these (fresh allocations are contiguous and 256-byte aligned)."""
    return (kind, opts, sm90.enabled(), tensors[0].device, *map(_tensor_key, tensors), *scalars)


def _planned(key: tuple, make: Callable[[], Any]):
    """make(), once per key: the decisions of a call signature, which a training run repeats every step and layer."""
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = make()
    return plan


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped like t (empty_like's host path is the shorter one where t is contiguous)."""
    if t.is_contiguous():
        return torch.empty_like(t)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _grad_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized gradient for t, in t's own memory order where t is dense: a (B, S, H, D) view of (B, H, S, D)
    memory, as transformers' rotary embedding leaves q and k, gets its gradient in that memory, so that neither a
    leaf's gradient accumulation nor the rotary backward copies it. Contiguous where t has gaps (a slice of a packed
    qkv tensor). The rule is padding.grad_like_input's, which the padded path applies to its inputs' layouts."""
    if t.is_contiguous():
        return torch.empty_like(t)  # empty_like's host path is the shorter one
    return grad_like_input(t.shape, t.stride(), t.dtype, t.device)


@dataclasses.dataclass(frozen=True)
class _FwdPlan:
    cfgs: kernel_config.KernelConfigs
    gluon: bool  # the Gluon forward takes the call
    tma: bool  # the Triton forward's tensor descriptors (tma_usable)
    site: Any  # launch.launch's site for the call's launch (None: the launch builds its argument key)
    # the Triton launches' arguments that follow from the plan's key (strides, sizes, constexprs), by launch: made by
    # the first call (`_static_args`)
    static: dict = dataclasses.field(default_factory=dict, compare=False)


def _fwd_plan(q, k, v, out, varlen, max_seqlen_q, max_seqlen_k, window_left, window_right, softcap, dropout_p,
              opts, key) -> _FwdPlan:
    cfgs = _launch_configs(q, k, varlen, max_seqlen_q, max_seqlen_k, window_left, window_right, dropout_p, softcap,
                           opts)
    gluon = cfgs.gluon_fwd and sm90_fwd is not None and sm90_fwd.supported(
        q, k, v, varlen=varlen, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window_left=window_left,
        window_right=window_right, softcap=softcap, dropout_p=dropout_p)
    tma = not gluon and cfgs.fwd.tma and tma_usable(q.shape[-1], q, k, v, out)
    return _FwdPlan(cfgs, gluon, tma, key if opts.cached_launch else None)


def _static_args(plan, name: str, make: Callable[[], tuple[tuple, dict]]) -> tuple[tuple, dict]:
    """(integer arguments, constexpr and launch keywords) of the plan's Triton launch `name`, made once: they follow
    from what the plan's key holds (the inputs' shapes and strides, the scalars that pick kernels, the options), and
    the tensors a call allocates are laid out by rule from those."""
    args = plan.static.get(name)
    if args is None:
        args = plan.static[name] = make()
    return args


def batch_size(q: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor]) -> int:
    return cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]


@on_input_device
def attn_fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    seed_offset: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out shaped like q, lse float32: (B, H, Sq) dense or (H, total_q) varlen). alibi_slopes: None, or
    float32 (nheads,) or (batch, nheads)."""
    check_runnable(q)
    varlen = cu_seqlens_q is not None
    nheads, headdim = q.shape[-2], q.shape[-1]
    nheads_k = k.shape[-2]
    batch = batch_size(q, cu_seqlens_q)
    out = _empty_like(q)
    lse = torch.empty(_lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    opts = kernel_options.current()  # read once: every launch of the call takes the same
    key = _plan_key("fwd", opts, (q, k, v, cu_seqlens_q, cu_seqlens_k, seed_offset, alibi_slopes), max_seqlen_q,
                    max_seqlen_k, window_left, window_right, softcap > 0, dropout_p > 0)
    plan = _planned(key, lambda: _fwd_plan(q, k, v, out, varlen, max_seqlen_q, max_seqlen_k, window_left,
                                           window_right, softcap, dropout_p, opts, key))
    cfgs = plan.cfgs
    if plan.gluon:  # the Gluon kernel where it applies
        qk_scale, cap_log2 = _scales(softmax_scale, softcap)
        if varlen:
            blocks = varlen_blocks(cu_seqlens_q, q.shape[0], sm90_fwd.varlen_block_rows(headdim, opts),
                                   heaviest_first=True, longest_first=opts.varlen_longest_first)
            sm90_fwd.attn_fwd_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, blocks, max_seqlen_k, qk_scale,
                                     causal=window_right == 0, alibi_slopes=alibi_slopes, fold=cfgs.fold_scale,
                                     options=opts, site=plan.site, window_left=window_left, cap_log2=cap_log2)
        else:
            sm90_fwd.attn_fwd(q, k, v, out, lse, qk_scale, causal=window_right == 0, alibi_slopes=alibi_slopes,
                              fold=cfgs.fold_scale, seed_offset=seed_offset, dropout_p=dropout_p, options=opts,
                              site=plan.site, window_left=window_left, cap_log2=cap_log2)
        return out, lse
    cfg = cfgs.fwd
    if plan.tma:
        _ensure_allocator()
    qk_scale, cap_log2 = _scales(softmax_scale, softcap)
    grid, blocks, blocks_fastest = _launch_grid(nheads, cfg.block_m, cfg.blocks_fastest, cu_seqlens_q, q.shape[0],
                                                batch, max_seqlen_q, heaviest_first=True, opts=opts)
    sources, floats = (q, k, v, out, lse, seed_offset, cu_seqlens_q, cu_seqlens_k, blocks, alibi_slopes), (
        qk_scale, cap_log2, dropout_p)
    if _replayed(attn_fwd_kernel, plan.site, sources, floats):
        return out, lse
    ints, consts = _static_args(plan, "fwd", lambda: (
        (*_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen), *_seq_strides(out, varlen),
         *_lse_strides(lse, varlen), alibi_batch_stride(alibi_slopes),
         nheads, nheads // nheads_k, max_seqlen_q, max_seqlen_k),
        dict(HEADDIM=headdim, BLOCK_D=block_d(headdim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
             **_common_flags(varlen, window_left, window_right, softcap, dropout_p, q.dtype, alibi_slopes),
             TMA=plan.tma, BLOCKS_FASTEST=blocks_fastest,
             HEAD_GROUP=_head_group(cfg, varlen, window_left, window_right, max_seqlen_q, q.device, opts),
             EVEN=_even(cfgs.even_tiles, varlen, headdim, max_seqlen_k, cfg.block_n),
             EVEN_INTERIOR=_even_interior(cfgs.even_tiles, headdim), FOLD=cfgs.fold_scale,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    launch(
        attn_fwd_kernel, grid,
        q, k, v, out, lse, seed_offset, cu_seqlens_q, cu_seqlens_k, blocks, alibi_slopes, *ints,
        qk_scale, cap_log2, dropout_p, window_left, window_right,
        **consts, cached_launch=opts.cached_launch, site=plan.site, record=Record(plan.site, sources, floats),
    )
    return out, lse


def _replayed(kernel, site, sources: tuple, floats: tuple = (), stream: Optional[int] = None) -> bool:
    """Whether launch.replay re-issued this plan's launch of `kernel` (sources and floats: the launch's tensors and
    floats in argument order, as its launch.Record names them)."""
    return site is not None and replay(kernel, site, sources, floats, stream)


# The custom op is what torch.compile and every tracer see; the autograd layer calls attn_fwd_impl directly in eager
# mode on plain tensors, saving the dispatcher's host time (autograd._eager).
attn_fwd = torch.library.custom_op("flashpatch::attn_fwd", attn_fwd_impl, mutates_args=(), device_types=("cuda", "cpu"))


@attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed_offset, dropout_p, softmax_scale,
      window_left, window_right, softcap, alibi_slopes=None):
    varlen = cu_seqlens_q is not None
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        _lse_shape(q, varlen), dtype=torch.float32)


@dataclasses.dataclass(frozen=True)
class _BwdPlan:
    cfgs: kernel_config.KernelConfigs
    dkdv_on_gluon: bool  # the Gluon dK/dV runs (else the Triton one)
    gluon_dq: bool  # the Gluon dQ pass runs (else the Triton one, or none with atomic_dq)
    atomic_dq: bool  # dQ is added into an fp32 buffer by the dK/dV kernel: no separate pass
    concurrent: bool  # the dQ pass runs beside dK/dV, which goes on a side stream (config.concurrent_dq)
    pad: bool  # LSE and delta padded past each row's end (below)
    padded_rows: int  # rows per (batch, head) of the preprocess grid
    lse_shape: Optional[tuple]  # the padded LSE's shape, where pad
    site: Any  # launch.launch's site for the call's launches (None: each launch builds its argument key)
    static: dict = dataclasses.field(default_factory=dict, compare=False)  # as _FwdPlan's


def _gluon_dkdv(headdim: int):
    """The Gluon dK/dV module for `headdim` (None without Gluon): head dim 256 has its own (sm90/dkdv256.py)."""
    return sm90_dkdv256 if headdim == 256 else sm90_dkdv


def _bwd_plan(q, k, v, dout, varlen, batch, max_seqlen_q, max_seqlen_k, window_left, window_right, softcap,
              dropout_p, deterministic, opts, key) -> _BwdPlan:
    """attn_bwd_impl's decisions, from what _plan_key holds."""
    headdim, nheads = q.shape[-1], q.shape[-2]
    cfgs = _launch_configs(q, k, varlen, max_seqlen_q, max_seqlen_k, window_left, window_right, dropout_p, softcap,
                           opts)
    # The Gluon Hopper kernels take the calls in their scope (sm90.common.sm90_dense_ok), the Triton ones the rest
    gluon_scope = dict(varlen=varlen, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window_left=window_left,
                       window_right=window_right, softcap=softcap, dropout_p=dropout_p)
    dkdv_kernel = _gluon_dkdv(headdim)
    gluon_dkdv = cfgs.gluon_dkdv and dkdv_kernel is not None and dkdv_kernel.supported(q, k, v, dout, **gluon_scope)
    fuses_dq = gluon_dkdv and dkdv_kernel.fuses_dq(headdim, dropout_p > 0, opts)  # whether the Gluon dK/dV could add dQ
    fused_dq = not deterministic and cfgs.fused_dq and gluon_dkdv and fuses_dq
    # config's atomic dQ is the Triton dK/dV's, taken with dropout to spare the dQ pass its second draw; where the
    # Gluon dK/dV draws the bits, its fused dQ or the separate pass beside it is faster
    gluon_draws = gluon_dkdv and dropout_p > 0
    atomic_dq = (cfgs.atomic_dq and not deterministic and not gluon_draws) or fused_dq
    gluon_dq = (cfgs.gluon_dq and not atomic_dq and sm90_dq is not None
                and sm90_dq.supported(q, k, v, dout, **gluon_scope))
    # with atomic dQ, the Gluon dK/dV only where it adds dQ itself (sm90_dkdv.fuses_dq)
    dkdv_on_gluon = gluon_dkdv and (not atomic_dq or fuses_dq)
    if varlen:
        # The Gluon kernels read a varlen batch's LSE and delta padded per sequence (below), which the Triton ones
        # do not: on varlen batches the Gluon dK/dV runs with the Gluon dQ (or its own fused dQ), or not at all.
        if dkdv_on_gluon and not (atomic_dq or gluon_dq):
            dkdv_on_gluon = False
        gluon_dq = gluon_dq and dkdv_on_gluon

    # The LSE and delta that the Gluon kernels read run on past each sequence's end to a multiple of ALIGN rows, LSE
    # +inf and delta 0, so that whole tiles past a sequence's end give P = 0 (what lets them take any length). Dense
    # rows: (B, H, Sq rounded up); varlen: (H, total_q + ALIGN x batch, rounded up), sequence b from an aligned start
    # (triton.backward.aligned_start). The Triton kernels read the forward's LSE as it is.
    align = kernel_config.ALIGN
    pad = dkdv_on_gluon if varlen else max_seqlen_q % align != 0  # varlen: the Gluon dQ runs only beside it
    padded_rows = cdiv(max_seqlen_q, align) * align if pad else max_seqlen_q
    lse_shape = None
    if pad:  # varlen rows per head rounded up to ALIGN too, so that every head's rows start aligned
        lse_shape = ((nheads, cdiv(q.shape[0] + align * batch, align) * align) if varlen
                     else (batch, nheads, padded_rows))
    concurrent = cfgs.concurrent_dq and not atomic_dq and q.is_cuda
    return _BwdPlan(cfgs, dkdv_on_gluon, gluon_dq, atomic_dq, concurrent, pad, padded_rows, lse_shape,
                    key if opts.cached_launch else None)


@on_input_device
def attn_bwd_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    seed_offset: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv) shaped like q, k, v, each in its input's memory order where that is dense (`_grad_like`)."""
    check_runnable(q)
    # Incoming gradients can be broadcast views (stride 0, e.g. from a sum); the kernels need unit stride in
    # the last dimension. User inputs are validated instead, never copied.
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    varlen = cu_seqlens_q is not None
    nheads, headdim = q.shape[-2], q.shape[-1]
    nheads_k = k.shape[-2]
    batch = batch_size(q, cu_seqlens_q)
    dq, dk, dv = _grad_like(q), _grad_like(k), _grad_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    opts = kernel_options.current()  # read once: every launch of the call takes the same
    key = _plan_key("bwd", opts, (q, k, v, dout, out, lse, cu_seqlens_q, cu_seqlens_k, seed_offset, alibi_slopes),
                    max_seqlen_q, max_seqlen_k, window_left, window_right, softcap > 0, dropout_p > 0, deterministic)
    plan = _planned(key, lambda: _bwd_plan(q, k, v, dout, varlen, batch, max_seqlen_q, max_seqlen_k, window_left,
                                           window_right, softcap, dropout_p, deterministic, opts, key))
    cfgs, site = plan.cfgs, plan.site
    atomic_dq, gluon_dq, dkdv_on_gluon = plan.atomic_dq, plan.gluon_dq, plan.dkdv_on_gluon
    qk_scale, cap_log2 = _scales(softmax_scale, softcap)
    tile_d = block_d(headdim)

    lse_in = lse
    if plan.pad:
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse)
    padded_rows, pre = plan.padded_rows, cfgs.bwd_dq
    sources = (out, dout, delta, lse_in, lse, cu_seqlens_q)
    if not _replayed(attn_bwd_preprocess_kernel, site, sources):
        ints, consts = _static_args(plan, "preprocess", lambda: (
            (*_seq_strides(out, varlen), *_seq_strides(dout, varlen), *_lse_strides(lse, varlen),
             *_lse_strides(lse_in, varlen), nheads, max_seqlen_q, padded_rows),
            dict(HEADDIM=headdim, BLOCK_D=tile_d, BLOCK_M=pre.block_m, IS_VARLEN=varlen, PAD=plan.pad,
                 ALIGN=kernel_config.ALIGN)))
        launch(attn_bwd_preprocess_kernel, (batch * nheads, cdiv(padded_rows, pre.block_m)),
               *sources, *ints, **consts, cached_launch=opts.cached_launch, site=site, record=Record(site, sources))

    # fp32 accumulator for atomic dQ; otherwise dQ gets its own pass and the pointer is unused.
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic_dq else dq
    causal = window_right == 0
    c = cfgs.bwd_dkdv
    # The grid now, on the caller's stream: a varlen grid's table is computed by torch ops on the current stream,
    # which the side stream of a concurrent dK/dV has not waited for once forked.
    if not dkdv_on_gluon:
        grid, blocks, blocks_fastest = _launch_grid(nheads_k, c.block_n, c.blocks_fastest, cu_seqlens_k, k.shape[0],
                                                    batch, max_seqlen_k, heaviest_first=False, opts=opts)
    elif varlen:  # the Gluon dK/dV's (sequence, key block) pairs, a sequence's first key block first
        gluon_varlen = (cu_seqlens_q, cu_seqlens_k,
                        varlen_blocks(cu_seqlens_k, k.shape[0], _gluon_dkdv(headdim).BLOCK_N, heaviest_first=False,
                                      longest_first=opts.varlen_longest_first))
    else:
        gluon_varlen = None

    def launch_dkdv(stream: Optional[int] = None):  # stream: a raw CUDA stream handle, None for the current one
        # host work only from here: on a side stream, device work of the current stream would not be ordered
        if dkdv_on_gluon and headdim == 256:
            sm90_dkdv256.attn_bwd_dkdv256(q, k, v, dout, lse, delta, dk, dv, qk_scale, softmax_scale, causal,
                                          alibi_slopes, options=opts, stream=stream, site=site,
                                          window_left=window_left, cap_log2=cap_log2, varlen=gluon_varlen)
        elif dkdv_on_gluon:
            sm90_dkdv.attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, qk_scale, softmax_scale, causal,
                                      alibi_slopes, dq_accum=dq_accum if atomic_dq else None,
                                      seed_offset=seed_offset, dropout_p=dropout_p, options=opts, stream=stream,
                                      varlen=gluon_varlen, site=site, window_left=window_left, cap_log2=cap_log2)
        else:
            sources = (q, k, v, dout, lse, delta, dq_accum, dk, dv, seed_offset, cu_seqlens_q, cu_seqlens_k, blocks,
                       alibi_slopes)
            floats = (qk_scale, cap_log2, softmax_scale, dropout_p)
            if c.tma:  # on-device descriptors: their scratch comes from Triton's allocator, replayed or not
                _ensure_allocator()
            if _replayed(attn_bwd_dkdv_kernel, site, sources, floats, stream):
                return
            ints, consts = _static_args(plan, "dkdv", lambda: (
                (*_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
                 *_seq_strides(dout, varlen), *_seq_strides(dq_accum, varlen), *_seq_strides(dk, varlen),
                 *_seq_strides(dv, varlen), *_lse_strides(lse, varlen), alibi_batch_stride(alibi_slopes),
                 nheads, nheads_k, nheads // nheads_k, max_seqlen_q, max_seqlen_k),
                dict(HEADDIM=headdim, BLOCK_D=tile_d, BLOCK_M=c.block_m, BLOCK_N=c.block_n, ATOMIC_DQ=atomic_dq,
                     TMA=c.tma and tma_usable(headdim, q, k, v, dout, dq_accum, dk, dv), BLOCKS_FASTEST=blocks_fastest,
                     HEAD_GROUP=_head_group(c, varlen, window_left, window_right, max_seqlen_k, q.device, opts,
                                            by_keys=True),
                     EVEN=_even(cfgs.even_tiles, varlen, headdim, max_seqlen_q, c.block_m),
                     EVEN_INTERIOR=_even_interior(cfgs.even_tiles, headdim), DP_FIRST=c.dp_first,
                     **_common_flags(varlen, window_left, window_right, softcap, dropout_p, q.dtype, alibi_slopes),
                     num_warps=c.num_warps, num_stages=c.num_stages)))
            launch(
                attn_bwd_dkdv_kernel, grid, *sources, *ints, *floats, window_left, window_right,
                **consts, cached_launch=opts.cached_launch, on_stream=stream, site=site,
                record=Record(site, sources, floats),
            )

    concurrent = plan.concurrent

    def launch_dq():
        if atomic_dq:
            dq.copy_(dq_accum)
        elif gluon_dq:
            dq_varlen = None
            if varlen:  # the (sequence, query block) pairs, a sequence's last query block first
                dq_varlen = (cu_seqlens_q, cu_seqlens_k,
                             varlen_blocks(cu_seqlens_q, q.shape[0], sm90_dq.BLOCK_M, heaviest_first=True,
                                           longest_first=opts.varlen_longest_first))
            sm90_dq.attn_bwd_dq(q, k, v, dout, lse, delta, dq, qk_scale, softmax_scale, causal,
                                  seed_offset=seed_offset, dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                                  beside_dkdv=concurrent, options=opts, varlen=dq_varlen, site=site,
                                  window_left=window_left, cap_log2=cap_log2)
        else:
            c = cfgs.bwd_dq
            grid, blocks, blocks_fastest = _launch_grid(nheads, c.block_m, c.blocks_fastest, cu_seqlens_q,
                                                        q.shape[0], batch, max_seqlen_q, heaviest_first=True,
                                                        opts=opts)
            sources = (q, k, v, dout, lse, delta, dq, seed_offset, cu_seqlens_q, cu_seqlens_k, blocks, alibi_slopes)
            floats = (qk_scale, cap_log2, softmax_scale, dropout_p)
            if c.tma:
                _ensure_allocator()
            if _replayed(attn_bwd_dq_kernel, site, sources, floats):
                return
            ints, consts = _static_args(plan, "dq", lambda: (
                (*_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
                 *_seq_strides(dout, varlen), *_seq_strides(dq, varlen), *_lse_strides(lse, varlen),
                 alibi_batch_stride(alibi_slopes), nheads, nheads // nheads_k, max_seqlen_q, max_seqlen_k),
                # TMA: not atomic_dq, whose branch is taken above
                dict(HEADDIM=headdim, BLOCK_D=tile_d, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                     TMA=c.tma and tma_usable(headdim, k, v), BLOCKS_FASTEST=blocks_fastest,
                     HEAD_GROUP=_head_group(c, varlen, window_left, window_right, max_seqlen_q, q.device, opts),
                     EVEN=_even(cfgs.even_tiles, varlen, headdim, max_seqlen_k, c.block_n),
                     EVEN_INTERIOR=_even_interior(cfgs.even_tiles, headdim),
                     **_common_flags(varlen, window_left, window_right, softcap, dropout_p, q.dtype, alibi_slopes),
                     num_warps=c.num_warps, num_stages=c.num_stages)))
            launch(
                attn_bwd_dq_kernel, grid, *sources, *ints, *floats, window_left, window_right,
                **consts, cached_launch=opts.cached_launch, site=site, record=Record(site, sources, floats),
            )

    if concurrent:
        # dK/dV on a side stream of higher priority, so its programs are scheduled first and dQ's take the SMs its
        # last wave leaves; the caller's stream waits for both. Every tensor either kernel touches was made on the
        # caller's stream before the fork and is released only after the join, so the allocator needs no
        # record_stream.
        side, fork, join = _side_stream(q.device)
        current = torch.cuda.current_stream(q.device)
        fork.record(current)
        side.wait_event(fork)
        launch_dkdv(side.cuda_stream)
        launch_dq()
        join.record(side)
        current.wait_event(join)  # the caller's stream waits for dK/dV
    else:
        launch_dkdv()
        launch_dq()
    return dq, dk, dv


attn_bwd = torch.library.custom_op("flashpatch::attn_bwd", attn_bwd_impl, mutates_args=(), device_types=("cuda", "cpu"))


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed_offset, dropout_p,
      softmax_scale, window_left, window_right, softcap, deterministic, alibi_slopes=None):
    return _grad_like(q), _grad_like(k), _grad_like(v)


@on_input_device
def dropout_pattern(
    seed_offset: torch.Tensor, batch: int, nheads: int, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float
) -> torch.Tensor:
    """(batch, nheads, max_seqlen_q, max_seqlen_k) float: +1 where the attention kernels keep a weight, -1 where
    they drop it, for the call that used `seed_offset`."""
    check_runnable(seed_offset)
    out = torch.empty(batch, nheads, max_seqlen_q, max_seqlen_k, dtype=torch.float32, device=seed_offset.device)
    if out.numel():
        block = 32
        grid = (cdiv(max_seqlen_q, block), cdiv(max_seqlen_k, block), batch * nheads)
        dropout_mask_kernel[grid](out, seed_offset, nheads, max_seqlen_q, max_seqlen_k, dropout_p,
                                  BLOCK_M=block, BLOCK_N=block)
    return out


def draw_seed_offset(device: torch.device) -> torch.Tensor:
    """A fresh (seed, offset) pair from torch's generator for `device`, kept on the device (no host sync).

    The offset is kept below 2^32 so that offset + element position never overflows the 64-bit counter."""
    seed_offset = torch.randint(0, 2**62, (2,), device=device, dtype=torch.int64)
    seed_offset[1:] >>= 30  # in place: one launch after the draw (a stack of the two would take three)
    return seed_offset
