"""Autograd layer: draws the dropout (seed, offset), saves what backward needs, calls the raw ops."""

from __future__ import annotations

import torch

from flashpatch import ops
from flashpatch.validation import AttnArgs


class FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args: AttnArgs,
                deterministic: bool):
        # The (seed, offset) pair lives on the device and is saved for backward, which regenerates the same
        # mask from it. Drawn from torch's generator, so manual_seed and checkpoint's RNG replay both hold.
        seed_offset = ops.draw_seed_offset(q.device) if args.dropout_p > 0 else None
        out, lse = torch.ops.flashpatch.attn_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed_offset,
            args.dropout_p, args.softmax_scale, args.window_left, args.window_right, args.softcap,
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed_offset)
        ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
        ctx.args = args
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse, seed_offset

    @staticmethod
    def backward(ctx, dout, _dlse, _dseed):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed_offset = ctx.saved_tensors
        args = ctx.args
        dq, dk, dv = torch.ops.flashpatch.attn_bwd(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, seed_offset,
            args.dropout_p, args.softmax_scale, args.window_left, args.window_right, args.softcap,
            ctx.deterministic,
        )
        return dq, dk, dv, None, None, None, None, None, None

    @classmethod
    def run(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args: AttnArgs,
            deterministic: bool, return_attn_probs: bool):
        out, lse, seed_offset = cls.apply(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args, deterministic)
        if not return_attn_probs:
            return out
        pattern = None
        if seed_offset is not None:
            pattern = ops.dropout_pattern(seed_offset, ops.batch_size(q, cu_seqlens_q), q.shape[-2], max_seqlen_q,
                                          max_seqlen_k, args.dropout_p)
        return out, lse, pattern
