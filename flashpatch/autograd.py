"""Autograd layer: draws the dropout (seed, offset), saves what backward needs, calls the raw ops (and, for padded
batches, the row moves around them)."""

from __future__ import annotations

import torch

from flashpatch import ops, padding
from flashpatch.padding import RowIndex
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


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args: AttnArgs, alibi_slopes):
    """(out, lse, seed_offset) of one attention forward. The (seed, offset) pair lives on the device and is saved for
    backward, which regenerates the same mask from it; drawn from torch's generator, so manual_seed and
    checkpoint's RNG replay both hold."""
    seed_offset = ops.draw_seed_offset(q.device) if args.dropout_p > 0 else None
    eager = _eager(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    attn_fwd = ops.attn_fwd_impl if eager else torch.ops.flashpatch.attn_fwd
    out, lse = attn_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed_offset,
        args.dropout_p, args.softmax_scale, args.window_left, args.window_right, args.softcap, alibi_slopes,
    )
    return out, lse, seed_offset


def _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlens: tuple[int, int], seed_offset,
              args: AttnArgs, deterministic: bool, alibi_slopes):
    """(dq, dk, dv) of the forward that returned (out, lse) with this seed_offset."""
    attn_bwd = (ops.attn_bwd_impl if _eager(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
                else torch.ops.flashpatch.attn_bwd)
    return attn_bwd(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *max_seqlens, seed_offset,
        args.dropout_p, args.softmax_scale, args.window_left, args.window_right, args.softcap, deterministic,
        alibi_slopes,
    )


class FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args: AttnArgs,
                deterministic: bool, alibi_slopes):
        if cu_seqlens_k is None:  # `run` passes one tensor once (see there)
            cu_seqlens_k = cu_seqlens_q
        out, lse, seed_offset = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args,
                                         alibi_slopes)
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
        dq, dk, dv = _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlens, seed_offset,
                               ctx.args, ctx.deterministic, alibi_slopes)
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


class PaddedAttnFunction(torch.autograd.Function):
    """Attention over the real tokens of padded batches, in one autograd node: q (B, Sq, H, D) and k, v (B, Sk, Hk, D)
    of any strides have their rows at `rows_q` and `rows_k` (padding.RowIndex) gathered into the varlen layout
    (one launch for q, k and v where they share rows), run through the varlen kernels with cu_seqlens_q and _k, and
    the output scattered back to (B, Sq, H, D) with zeros at padded queries. The backward gathers dout's rows, runs
    the varlen backward and scatters each gradient into its input's memory order (padding.grad_like_input), zeros at
    padding. A gather node, an attention node and a scatter node would cost a host-bound layer two more autograd
    nodes and four more launches (docs/tuning.md, "Host time")."""

    @staticmethod
    def forward(ctx, q, k, v, rows_q: RowIndex, rows_k: RowIndex, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                max_seqlen_k: int, args: AttnArgs, deterministic: bool):
        ops.check_runnable(q)
        if rows_q is rows_k:
            q_rows, k_rows, v_rows = padding.gather(rows_q, q, k, v)  # (Tq, H, D), (Tk, Hk, D) x 2
        else:
            (q_rows,), (k_rows, v_rows) = padding.gather(rows_q, q), padding.gather(rows_k, k, v)
        out_rows, lse, seed_offset = _forward(q_rows, k_rows, v_rows, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, args, None)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, Sq, H, D)
        padding.scatter(rows_q, (out_rows,), (out,))
        ctx.save_for_backward(q_rows, k_rows, v_rows, out_rows, lse, cu_seqlens_q, cu_seqlens_k, seed_offset)
        ctx.rows = (rows_q, rows_k)
        ctx.inputs = [(t.shape, t.stride(), t.dtype, t.device) for t in (q, k, v)]
        ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
        ctx.args = args
        ctx.deterministic = deterministic
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 11
        q_rows, k_rows, v_rows, out_rows, lse, cu_seqlens_q, cu_seqlens_k, seed_offset = ctx.saved_tensors
        rows_q, rows_k = ctx.rows
        (dout_rows,) = padding.gather(rows_q, dout)
        grad_rows = _backward(dout_rows, q_rows, k_rows, v_rows, out_rows, lse, cu_seqlens_q, cu_seqlens_k,
                              ctx.max_seqlens, seed_offset, ctx.args, ctx.deterministic, None)
        grads = [padding.grad_like_input(*layout) if needed else None
                 for layout, needed in zip(ctx.inputs, ctx.needs_input_grad[:3])]
        # one scatter per row index, of the gradients asked for
        groups = [(rows_q, (0, 1, 2))] if rows_q is rows_k else [(rows_q, (0,)), (rows_k, (1, 2))]
        for index, which in groups:
            wanted = [i for i in which if grads[i] is not None]
            if wanted:
                padding.scatter(index, tuple(grad_rows[i] for i in wanted), tuple(grads[i] for i in wanted))
        return (*grads, None, None, None, None, None, None, None, None)
