"""Moving between padded (batch, seqlen, ...) tensors and unpadded (total_tokens, ...) ones.

The unpadded layout is what `flash_attn_varlen_func` takes: the real tokens of every sequence back to back,
with `cu_seqlens` (int32, batch + 1 entries) giving where each sequence starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_mask(attention_mask: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (batch, seqlen), got shape {tuple(attention_mask.shape)}")
    if hidden is not None and tuple(hidden.shape[:2]) != tuple(attention_mask.shape):
        raise ValueError(
            f"hidden states (batch, seqlen) = {tuple(hidden.shape[:2])} do not match "
            f"attention_mask shape {tuple(attention_mask.shape)}"
        )


def cu_seqlens_from_lengths(seqlens: torch.Tensor) -> torch.Tensor:
    """(batch,) lengths -> (batch + 1,) int32 cumulative offsets starting at 0."""
    return F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


def unpad_input(
    hidden_states: torch.Tensor,  # (B, S, ...)
    attention_mask: torch.Tensor,  # (B, S), nonzero = real token
    unused_mask: torch.Tensor | None = None,  # (B, S), nonzero = allocated but unused
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Drop padding tokens. Works for left and right padding, and for holes anywhere. flash-attn >= 2.7's signature.

    Arguments:
        hidden_states: (batch, seqlen, ...)
        attention_mask: (batch, seqlen), bool or int, nonzero where a token is real.
        unused_mask: None, or (batch, seqlen), bool or int, nonzero where a token is allocated but unused: it is kept
            in the unpadded tensor and counted in cu_seqlens, but not in seqused.

    Returns:
        unpadded:   (total_tokens, ...) the tokens of attention_mask | unused_mask, sequence after sequence
        indices:    (total_tokens,) int64 flat positions of those tokens in (B * S)
        cu_seqlens: (B + 1,) int32, over the tokens kept
        max_seqlen: int, the longest sequence kept (a Python int: the kernel grid needs it on the host)
        seqused:    (B,) int32, the real tokens of each sequence (attention_mask alone)
    """
    _check_mask(attention_mask, hidden_states)
    kept = attention_mask
    if unused_mask is not None:
        if not isinstance(unused_mask, torch.Tensor) or tuple(unused_mask.shape) != tuple(attention_mask.shape):
            shape = tuple(unused_mask.shape) if isinstance(unused_mask, torch.Tensor) else type(unused_mask).__name__
            raise ValueError(f"unused_mask must be a tensor shaped like attention_mask {tuple(attention_mask.shape)}, "
                             f"got {shape}")
        kept = (attention_mask != 0) | (unused_mask != 0)
    indices, cu_seqlens, max_seqlen = padding_layout(kept)
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    seqused = (attention_mask != 0).sum(dim=-1, dtype=torch.int32)
    return flat[indices], indices, cu_seqlens, max_seqlen, seqused


def padding_layout(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(B, S) mask, nonzero = real token -> (indices (T,) int64 into B * S, cu_seqlens (B + 1,) int32, max_seqlen).

    Two host syncs (the number of real tokens, the longest sequence): callers that see one mask many times, like
    the layers of a model, compute this once."""
    _check_mask(attention_mask)
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    return indices, cu_seqlens_from_lengths(seqlens), max_seqlen


def pad_input(
    unpadded: torch.Tensor,  # (total_tokens, ...)
    indices: torch.Tensor,  # (total_tokens,)
    batch: int,
    seqlen: int,
) -> torch.Tensor:
    """Inverse of `unpad_input`: scatter tokens back to (batch, seqlen, ...), zeros at padding."""
    out = unpadded.new_zeros(batch * seqlen, *unpadded.shape[1:])
    out[indices] = unpadded  # in place on a fresh tensor: no copy of it, and autograd still reaches `unpadded`
    return out.reshape(batch, seqlen, *unpadded.shape[1:])


class RowIndex:
    """The real tokens of a (B, S) padding mask as (batch index, position) pairs: `gather_rows` and `scatter_rows`
    move rows of (B, S, ...) tensors of any strides with them, where flattening (B, S) would first copy a view such
    as (B, S, H, D) of (B, H, S, D) memory."""

    def __init__(self, indices: torch.Tensor, seqlen: int):  # indices: (T,) int64 flat positions in B * S
        self.batch_index = torch.div(indices, seqlen, rounding_mode="floor")  # (T,)
        self.position = indices - self.batch_index * seqlen  # (T,)


def covers_its_span(shape, stride) -> bool:
    """Whether a tensor of this shape and these strides covers its memory span once, in some dimension order."""
    span = 1
    for step, size in sorted((st, n) for st, n in zip(stride, shape) if n != 1):
        if step != span:
            return False
        span *= size
    return True


class _GatherRows(torch.autograd.Function):
    """(B, S, ...) tensors -> their rows at `index`, (T, ...) each. Backward: each gradient scattered into zeros laid
    out like its input where that layout covers its memory once (no sort: the rows are distinct, so nothing
    accumulates)."""

    @staticmethod
    def forward(ctx, index: RowIndex, *tensors):
        ctx.index = index
        ctx.inputs = [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]
        return tuple(t[index.batch_index, index.position] for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        index = ctx.index
        out = [None]
        for grad, (shape, stride, dtype, device), needed in zip(grads, ctx.inputs, ctx.needs_input_grad[1:]):
            if grad is None or not needed:
                out.append(None)
                continue
            if covers_its_span(shape, stride):  # the gradient in the input's memory order
                full = torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
            else:  # gaps or overlaps (an expanded view): one value per element needs a layout of its own
                full = torch.zeros(shape, dtype=dtype, device=device)
            full.index_put_((index.batch_index, index.position), grad)
            out.append(full)
        return tuple(out)


def gather_rows(index: RowIndex, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (B, S, ...) tensor's rows at `index`: (T, ...) with a unit last stride; differentiable."""
    return _GatherRows.apply(index, *tensors)


def scatter_rows(rows: torch.Tensor, index: RowIndex, batch: int, seqlen: int) -> torch.Tensor:
    """(T, ...) rows -> (batch, seqlen, ...) with zeros where `index` has no row; differentiable (its backward
    gathers)."""
    out = rows.new_zeros(batch, seqlen, *rows.shape[1:])
    out[index.batch_index, index.position] = rows
    return out


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Packed rows: a position id of 0 starts a new document.

    position_ids (B, S) or (S,) -> (cu_seqlens over the flattened B * S tokens as int32, max_seqlen).
    Every row must start a document (position 0 at its first token), since documents never span rows.
    """
    if position_ids.dim() not in (1, 2):
        raise ValueError(f"position_ids must be (batch, seqlen) or (seqlen,), got {tuple(position_ids.shape)}")
    rows = position_ids if position_ids.dim() == 2 else position_ids[None]
    if rows.shape[1] and bool((rows[:, 0] != 0).any()):
        raise ValueError(f"each packed row must start at position 0; first positions are {rows[:, 0].tolist()}")
    return cu_seqlens_from_starts(rows == 0)


def cu_seqlens_from_starts(starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """starts: bool, True at each sequence's first token (the first token must be one), any shape; read in
    flattened order -> (cu_seqlens int32 over the flattened tokens, max_seqlen)."""
    cu_seqlens = cu_seqlens_of_starts(starts)
    return cu_seqlens, max_seqlen_from_cu_seqlens(cu_seqlens)


def cu_seqlens_of_starts(starts: torch.Tensor) -> torch.Tensor:
    """`cu_seqlens_from_starts` without the longest sequence (which costs a second host sync)."""
    flat = starts.flatten()
    begin = torch.nonzero(flat, as_tuple=False).flatten().to(torch.int32)
    return torch.cat([begin, begin.new_tensor([flat.numel()])])


def max_seqlen_from_cu_seqlens(cu_seqlens: torch.Tensor) -> int:
    """The longest sequence (0 for an empty batch). A host sync: the kernel grid is sized on the host."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if cu_seqlens.numel() > 1 else 0
