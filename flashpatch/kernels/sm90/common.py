"""What the Gluon Hopper kernels (hopper_fwd.py, hopper_dkdv.py, hopper_dq.py) share on the host: whether Gluon imports, which
calls they may take, the 2-D TMA views of (B, S, H, D) tensors they load from, and the ALiBi slopes' batch stride
(which the Triton launches in ops.py pass too)."""

from __future__ import annotations

import functools
import os

import torch
import triton

try:  # Gluon is experimental: its module layout has changed between Triton releases
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # TMA tile load into shared memory, signalling an mbarrier: renamed after Triton 3.6
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False


def kept_dims(parent, dims):
    """Gluon layout `parent` (a constexpr) sliced down to its dimensions `dims`, the others removed from the last: the
    layout whose tensor `x[...]`, with None at those other positions, expands back into `parent` (the keep words of
    hopper_fwd.py and hopper_dkdv.py, one dimension of a tile for its aranges)."""
    layout = parent.value
    for dim in reversed(range(len(layout.size_per_thread))):
        if dim not in dims:
            layout = gl.SliceLayout(dim, layout)
    return gl.constexpr(layout)


def carry_shift_in_ptx(decisions, addend: str) -> str:
    """Inline PTX that shifts 16-bit dropout decisions into 32-bit words, one per decision in the order given: a
    decision half >= t is the carry out of half * 2^16 + (2^32 - t * 2^16) (`addend` holds the latter), and
    `addc` doubles the word and adds that carry, so the last decision lands at bit 0. `decisions`: (source word
    operand, "lo" or "hi" half, word operand out, word operand in) each; the drawers of hopper_fwd.py and
    hopper_dkdv.py build their per-call blocks from it."""
    lines = ["{", ".reg .b32 t;"]
    for source, half, word_out, word_in in decisions:
        if half == "lo":
            lines += [f"shl.b32 t, {source}, 16;", f"add.cc.u32 t, t, {addend};"]
        else:
            lines.append(f"add.cc.u32 t, {source}, {addend};")
        lines.append(f"addc.u32 {word_out}, {word_in}, {word_in};")
    return "\n".join(lines + ["}"])


TMA_REDUCE = False  # whether tma_reduce_add below could be defined (the fused dQ needs it: hopper_dkdv.fuses_dq)
if AVAILABLE:
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
        TMA_REDUCE = hasattr(_ir, "DESCRIPTOR_REDUCE_KIND")
    except ImportError:  # pragma: no cover - depends on the installed Triton
        pass

# Gluon's API changes between Triton releases; the kernels were written and checked against this one (the GPU
# stack's). Other releases, or FLASHPATCH_GLUON=0 in the environment, keep the Triton kernels.
GLUON_TRITON = "3.6."


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability, once per device (it is asked several times per call)."""
    return torch.cuda.get_device_capability(device)


def enabled() -> bool:
    """Whether the Gluon kernels may run at all (read at each call, so FLASHPATCH_GLUON=0 works at any time)."""
    return AVAILABLE and triton.__version__.startswith(GLUON_TRITON) and os.environ.get("FLASHPATCH_GLUON") != "0"


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
                  dropout_p: float, with_dropout: bool = False) -> bool:
    """The scope the Gluon kernels share: sm_90 with Gluon enabled (`enabled`), dense (B, S, H, D) tensors that
    `rows_view` maps, bf16 or fp16, head dim 64 or 128, causal or unmasked, no softcap, no dropout unless the
    kernel draws it (`with_dropout`), 32-bit element offsets. Each kernel adds its tile divisibility."""
    q = tensors[0]
    if not (enabled() and q.is_cuda and capability(q.device) == (9, 0)):
        return False
    if varlen or softcap > 0 or (dropout_p > 0 and not with_dropout) or window_left >= 0 or window_right not in (-1, 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    return all(rows_view(t) is not None and t.data_ptr() % 16 == 0 and t.numel() < 2**31 for t in tensors)


def alibi_batch_stride(alibi_slopes) -> int:
    """The slopes' stride between sequences: 0 for None or (nheads,) slopes (one row for every sequence), else
    that of the (batch, nheads) tensor; the kernels read the slope of (b, h) at b * stride + h."""
    return alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0


def descriptor(t: torch.Tensor, block_rows: int):
    """(TensorDescriptor of (block_rows, D) tiles, rows per (batch, head), columns per head) for `rows_view`'s view."""
    shape, strides, rows, cols = rows_view(t)
    layout = _shared_layout(block_rows, t.shape[-1], t.dtype == torch.float16)
    return TensorDescriptor(t, shape, strides, [block_rows, t.shape[-1]], layout), rows, cols


def fp32_descriptor(t: torch.Tensor, block_rows: int):
    """`descriptor` for an fp32 (B, S, H, D) tensor (a dQ accumulator), in (block_rows, 32) tiles: 128 bytes wide,
    the widest box a 128-byte swizzle allows, as a TMA reduce is not split the way copies are."""
    shape, strides, rows, cols = rows_view(t)
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, 32], gl.float32)
    return TensorDescriptor(t, shape, strides, [block_rows, 32], layout), rows, cols


def vector_descriptor(t: torch.Tensor, block: int):
    """TensorDescriptor of `block`-element runs of an fp32 tensor's storage, seen as one vector from its first element
    (last dimension contiguous): the run of (b, h, m..) in a (B, H, S) tensor starts at b * stride(0) + h * stride(1)
    + m. For the LSE and delta rows of a step."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    layout = _vector_layout(block)
    return TensorDescriptor(t.as_strided((extent,), (1,)), [extent], [1], [block], layout)


@functools.lru_cache(maxsize=None)
def _vector_layout(block: int):
    return gl.NVMMASharedLayout.get_default_for([block], gl.float32)


@functools.lru_cache(maxsize=None)
def _shared_layout(block_rows: int, headdim: int, fp16: bool):
    """The tile's shared-memory layout, built once per tile shape (descriptors are built at every launch)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, headdim], gl.float16 if fp16 else gl.bfloat16)
