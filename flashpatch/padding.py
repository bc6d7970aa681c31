"""Moving between padded (batch, seqlen, ...) tensors and unpadded (total_tokens, ...) ones.

The unpadded layout is what `flash_attn_varlen_func` takes: the real tokens of every sequence back to back,
with `cu_seqlens` (int32, batch + 1 entries) giving where each sequence starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashpatch.kernels.launch import cdiv, launch, next_power_of_2, on_input_device
from flashpatch.kernels.triton.rows import gather_rows_kernel, scatter_rows_kernel

_INTERPRETED = type(gather_rows_kernel).__name__ == "InterpretedFunction"


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
        self.indices = indices
        self.seqlen = seqlen
        self.batch_index = torch.div(indices, seqlen, rounding_mode="floor")  # (T,)
        self.position = indices - self.batch_index * seqlen  # (T,)
        self._row_of: torch.Tensor | None = None

    def row_of(self, batch: int) -> torch.Tensor:
        """(batch * S,) int32: each padded position's row among the T real tokens, -1 at padding (made once)."""
        if self._row_of is None or self._row_of.numel() != batch * self.seqlen:
            row_of = torch.full((batch * self.seqlen,), -1, dtype=torch.int32, device=self.indices.device)
            row_of[self.indices] = torch.arange(self.indices.numel(), dtype=torch.int32, device=self.indices.device)
            self._row_of = row_of
        return self._row_of


def covers_its_span(shape, stride) -> bool:
    """Whether a tensor of this shape and these strides covers its memory span once, in some dimension order."""
    span = 1
    for step, size in sorted((st, n) for st, n in zip(stride, shape) if n != 1):
        if step != span:
            return False
        span *= size
    return True


def _kernels_run(t: torch.Tensor) -> bool:
    """Whether Triton kernels run on t's device: CUDA, or any under the Triton interpreter."""
    return t.is_cuda or _INTERPRETED


def _by_kernel(t: torch.Tensor) -> bool:
    """Whether the row-move kernels (kernels/triton/rows.py) take t: (B, S, H, D), where the kernels run."""
    return t.dim() == 4 and _kernels_run(t)


def _launch_rows(kernel, rows: int, *args, nheads: int, headdim: int) -> None:
    """A row-move launch over `rows` rows, (head, column) blocks of about 4096 elements a program."""
    block_d = next_power_of_2(headdim)
    block_h = min(next_power_of_2(nheads), max(1, 4096 // block_d))
    launch(kernel, (rows, cdiv(nheads, block_h)), *args, nheads, headdim, BLOCK_H=block_h, BLOCK_D=block_d)


@on_input_device
def _gather(t: torch.Tensor, index: RowIndex) -> torch.Tensor:
    """(B, S, H, D) -> its rows at index, (T, H, D) contiguous."""
    rows = torch.empty(index.indices.numel(), *t.shape[2:], dtype=t.dtype, device=t.device)
    if rows.numel():
        _launch_rows(gather_rows_kernel, rows.shape[0], t, rows, index.batch_index, index.position, *t.stride(),
                     nheads=t.shape[2], headdim=t.shape[3])
    return rows


@on_input_device
def _scatter_into(full: torch.Tensor, rows: torch.Tensor, index: RowIndex) -> torch.Tensor:
    """Writes all of `full` (B, S, H, D): rows (T, H, D) at index, zeros elsewhere."""
    if full.numel():
        batch, seqlen = full.shape[:2]
        _launch_rows(scatter_rows_kernel, batch * seqlen, rows.contiguous(), full, index.row_of(batch), seqlen,
                     *full.stride(), nheads=full.shape[2], headdim=full.shape[3])
    return full


class _GatherRows(torch.autograd.Function):
    """(B, S, ...) tensors -> their rows at `index`, (T, ...) each. Backward: each gradient scattered into zeros laid
    out like its input where that layout covers its memory once (no sort: the rows are distinct, so nothing
    accumulates)."""

    @staticmethod
    def forward(ctx, index: RowIndex, *tensors):
        ctx.index = index
        ctx.inputs = [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]
        return tuple(_gather(t, index) if _by_kernel(t) else t[index.batch_index, index.position] for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        index = ctx.index
        out = [None]
        for grad, (shape, stride, dtype, device), needed in zip(grads, ctx.inputs, ctx.needs_input_grad[1:]):
            if grad is None or not needed:
                out.append(None)
                continue
            if covers_its_span(shape, stride):  # the gradient in the input's memory order
                full = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            else:  # gaps or overlaps (an expanded view): one value per element needs a layout of its own
                full = torch.empty(shape, dtype=dtype, device=device)
            if _by_kernel(full):
                _scatter_into(full, grad, index)
            else:
                full.zero_().index_put_((index.batch_index, index.position), grad)
            out.append(full)
        return tuple(out)


def gather_rows(index: RowIndex, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (B, S, ...) tensor's rows at `index`: (T, ...) with a unit last stride; differentiable."""
    return _GatherRows.apply(index, *tensors)


class _ScatterRows(torch.autograd.Function):
    """(T, H, D) rows -> (B, S, H, D) with zeros where `index` has no row. Backward: the gradient's rows."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: RowIndex, batch: int, seqlen: int):
        ctx.index = index
        full = torch.empty(batch, seqlen, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        return _scatter_into(full, rows, index)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.index), None, None, None


def scatter_rows(rows: torch.Tensor, index: RowIndex, batch: int, seqlen: int) -> torch.Tensor:
    """(T, ...) rows -> (batch, seqlen, ...) with zeros where `index` has no row; differentiable (its backward
    gathers)."""
    if rows.dim() == 3 and _kernels_run(rows):
        return _ScatterRows.apply(rows, index, batch, seqlen)
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
