"""Autograd layer: draws the dropout (seed, offset), saves what backward needs, calls the raw ops."""

from __future__ import annotations

import torch

from flashpatch import ops
from flashpatch.validation import AttnArgs

try:  # private, but stable since torch 2.0; without it every call goes through the custom ops
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # pragma: no cover - depends on the installed torch
    _get_current_dispatch_mode = None


def _eager(*tensors) -> bool:
    """Whether a call may skip the custom op's dispatch and run its implementation directly: plain tensors, no
    torch.compile trace and no TorchDispatchMode (fake tensors, functionalization, selective checkpointing...),
    i.e. when dispatching would only cost host time (a large share of a small call's; docs/tuning.md, "host
    overhead"). Everything else goes through torch.ops.flashpatch, whose fake kernels tracers need."""
    if _get_current_dispatch_mode is None or torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


class FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args: AttnArgs,
                deterministic: bool, alibi_slopes):
        if cu_seqlens_k is None:  # `run` passes one tensor once (see there)
            cu_seqlens_k = cu_seqlens_q
        # The (seed, offset) pair lives on the device and is saved for backward, which regenerates the same
        # mask from it. Drawn from torch's generator, so manual_seed and checkpoint's RNG replay both hold.
        seed_offset = ops.draw_seed_offset(q.device) if args.dropout_p > 0 else None
        eager = _eager(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
        attn_fwd = ops.attn_fwd_impl if eager else torch.ops.flashpatch.attn_fwd
        out, lse = attn_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed_offset,
            args.dropout_p, args.softmax_scale, args.window_left, args.window_right, args.softcap, alibi_slopes,
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed_offset, alibi_slopes)
        ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
        ctx.args = args
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradients made for lse and seed_offset
        return out, lse, seed_offset

    @staticmethod
    def backward(ctx, dout, _dlse, _dseed):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed_offset, alibi_slopes = ctx.saved_tensors
        if dout is None:  # out took no part in the loss (gradients are not materialized)
            return (None,) * 10
        args = ctx.args
        attn_bwd = (ops.attn_bwd_impl if _eager(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
                    else torch.ops.flashpatch.attn_bwd)
        dq, dk, dv = attn_bwd(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, seed_offset,
            args.dropout_p, args.softmax_scale, args.window_left, args.window_right, args.softcap,
            ctx.deterministic, alibi_slopes,
        )
        return dq, dk, dv, None, None, None, None, None, None, None  # no gradient for the slopes (flash-attn: none)

    @classmethod
    def run(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args: AttnArgs,
            deterministic: bool, return_attn_probs: bool, alibi_slopes=None):
        # The same cu_seqlens for queries and keys (self-attention over packed documents) goes in once: torch.compile
        # cannot trace an autograd.Function given one tensor twice, and would break the graph at every layer.
        shared_k = None if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k
        out, lse, seed_offset = cls.apply(
            q, k, v, cu_seqlens_q, shared_k, max_seqlen_q, max_seqlen_k, args, deterministic, alibi_slopes)
        if not return_attn_probs:
            return out
        pattern = None
        if seed_offset is not None:
            pattern = ops.dropout_pattern(seed_offset, ops.batch_size(q, cu_seqlens_q), q.shape[-2], max_seqlen_q,
                                          max_seqlen_k, args.dropout_p)
        return out, lse, pattern
