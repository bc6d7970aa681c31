"""Moving between padded (batch, seqlen, ...) tensors and unpadded (total_tokens, ...) ones.

The unpadded layout is what `flash_attn_varlen_func` takes: the real tokens of every sequence back to back,
with `cu_seqlens` (int32, batch + 1 entries) giving where each sequence starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashpatch.kernels.launch import cdiv, launch, next_power_of_2, on_input_device
from flashpatch.kernels.triton.rows import gather_rows_kernel, scatter_rows_kernel

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
    """The real tokens of a (B, S) padding mask as (batch index, position) pairs: `gather` and `scatter` move rows of
    (B, S, H, D) tensors of any strides with them, where flattening (B, S) would first copy a view such as
    (B, S, H, D) of (B, H, S, D) memory."""

    def __init__(self, indices: torch.Tensor, seqlen: int):  # indices: (T,) int64 flat positions in B * S
        self.indices = indices
        self.seqlen = seqlen
        self.batch_index = torch.div(indices, seqlen, rounding_mode="floor")  # (T,)
        self.position = indices - self.batch_index * seqlen  # (T,)
        self._row_of: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.indices.device

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


def _launch_rows(kernel, programs: int, pairs: list[tuple[torch.Tensor, torch.Tensor]], padded: int,
                 *index_args) -> None:
    """One row-move launch over `programs` positions for up to three (source, destination) pairs of one head dim,
    the padded tensor of each pair at position `padded` (0 or 1) and the packed one contiguous; (head, column) blocks
    of about 4096 elements a program."""
    headdim = pairs[0][0].shape[-1]
    heads = max(src.shape[-2] for src, _ in pairs)
    block_d = next_power_of_2(headdim)
    block_h = min(next_power_of_2(heads), max(1, 4096 // block_d))
    args, layouts = [], []
    for pair in pairs + [pairs[0]] * (3 - len(pairs)):  # unused slots repeat the first pair: never read
        args += pair
        layouts += [*pair[padded].stride(), pair[padded].shape[-2]]
    grid = (programs, cdiv(heads, block_h), len(pairs))
    launch(kernel, grid, *args, *index_args, *layouts, headdim, BLOCK_H=block_h, BLOCK_D=block_d)


@on_input_device
def gather(index: RowIndex, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Up to three (B, S, H, D) tensors of one head dim and any strides -> their rows at `index`, (T, H, D)
    contiguous each, in one launch."""
    rows = tuple(torch.empty(index.indices.numel(), *t.shape[2:], dtype=t.dtype, device=t.device) for t in tensors)
    if rows[0].numel():
        _launch_rows(gather_rows_kernel, rows[0].shape[0], list(zip(tensors, rows)), 0, index.batch_index,
                     index.position)
    return rows


@on_input_device
def scatter(index: RowIndex, rows: tuple[torch.Tensor, ...], fulls: tuple[torch.Tensor, ...]) -> None:
    """Writes all of each (B, S, H, D) tensor in `fulls` (up to three, one head dim, any strides that cover their
    memory once): its rows (T, H, D) at index, zeros elsewhere, in one launch."""
    if fulls[0].numel():
        batch, seqlen = fulls[0].shape[:2]
        _launch_rows(scatter_rows_kernel, batch * seqlen, [(r.contiguous(), f) for r, f in zip(rows, fulls)], 1,
                     index.row_of(batch), seqlen)


def grad_like_input(shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """Uninitialized memory for the gradient of a (B, S, H, D) input of this layout: in the input's own memory order
    where that covers its memory once (a (B, S, H, D) view of (B, H, S, D) memory, as transformers hands over q, k and
    v, so that the transpose's backward copies nothing), contiguous where it has gaps or overlaps (an expanded view,
    whose backward then sums)."""
    if covers_its_span(shape, stride):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


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
