"""Argument checks for the public API. Every message names the offending values."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from flashpatch.memo import once_per_tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256


@dataclass(frozen=True)
class AttnArgs:
    """Normalized scalar arguments shared by the dense and varlen paths."""

    dropout_p: float
    softmax_scale: float
    window_left: int  # -1 = unbounded
    window_right: int  # -1 = unbounded; causal sets 0
    softcap: float  # 0 = off


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


def check_attention_args(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, varlen: bool
) -> AttnArgs:
    ndim = 3 if varlen else 4
    layout = "(total, nheads, headdim)" if varlen else "(batch, seqlen, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        try:
            _check_tensor(name, t, ndim)
        except ValueError as err:
            raise ValueError(f"{err}; expected layout {layout}") from None
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    headdim, nheads, nheads_k = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch mismatch: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if k.shape[-1] != headdim:
        raise ValueError(f"headdim mismatch: q has {headdim}, k/v have {k.shape[-1]}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")

    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(headdim)
    if not math.isfinite(softmax_scale) or softmax_scale < 0:
        raise ValueError(f"softmax_scale must be finite and >= 0, got {softmax_scale}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 disables it), got {softcap}")
    left, right = window_pair(window_size)
    if causal:
        right = 0  # flash-attn's rule: causal clamps the right window to 0
    return AttnArgs(float(dropout_p), float(softmax_scale), left, right, float(softcap))


def window_pair(window_size) -> tuple[int, int]:
    """(left, right) as Python ints from any pair flash-attn takes: a tuple or list of ints, or a 2-element integer
    tensor (flash-attn's tests pass `torch.tensor([left, right])`)."""
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2 or window_size.is_floating_point() or window_size.is_complex():
            raise ValueError(f"window_size must be a (left, right) pair of ints, got a tensor of dtype "
                             f"{window_size.dtype} and shape {tuple(window_size.shape)}")
        window_size = window_size.flatten().tolist()
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    pair = []
    for w in window_size:
        try:  # ints, NumPy integers and one-element integer tensors; floats and bools are refused
            if isinstance(w, bool):
                raise TypeError
            pair.append(operator.index(w))
        except TypeError:
            raise ValueError(f"window_size must be a (left, right) pair of ints, got {window_size!r}") from None
    left, right = pair
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded, got {tuple(pair)}")
    return left, right


def check_alibi_slopes(alibi_slopes, q: torch.Tensor, batch: int) -> None:
    """None, or float32 slopes of shape (nheads,) or (batch, nheads) on q's device (flash-attn's contract)."""
    if alibi_slopes is None:
        return
    nheads = q.shape[-2]
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}) (nheads, or batch x "
                         f"nheads), got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, q is on {q.device}")
    if alibi_slopes.stride(-1) != 1:
        raise ValueError(f"alibi_slopes must have a contiguous last dimension, got strides {alibi_slopes.stride()}")


def check_unsupported(**arguments) -> None:
    """flash-attn arguments kept for its signature whose features flashpatch does not have: only None passes."""
    for name, value in arguments.items():
        if value is not None:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise NotImplementedError(f"flashpatch does not support {name} (got {shape}); pass None")


def unpack(name: str, packed, parts: int, ndim: int, layout: str) -> tuple[torch.Tensor, ...]:
    """Views of a packed q/k/v tensor of `ndim` dims: the `parts` slices along its third-from-last dimension."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != ndim or packed.shape[-3] != parts:
        raise ValueError(f"{name} must be laid out as {layout}, got shape {tuple(packed.shape)}")
    return packed.unbind(dim=-3)


def check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Checks that need no device sync come first; the value checks sync once (one small copy)."""
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device}, q is on {q.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_seqlens_q.numel()} "
            f"and {cu_seqlens_k.numel()}"
        )
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise TypeError(f"{name} must be a non-negative Python int, got {m!r}")
    if torch.compiler.is_compiling():
        return  # values are data-dependent under tracing; the eager path checks them
    # Checked once per tensor (each check is a host sync; a model hands the same cu_seqlens to every layer).
    for name, cu, total, max_len in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k),
    ):
        once_per_tensor(cu, ("valid cu_seqlens", total, max_len),
                        lambda: _check_cu_seqlens_values(name, cu, total, max_len))


def _check_cu_seqlens_values(name: str, cu: torch.Tensor, total: int, max_len: int) -> bool:
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name}[-1] = {values[-1]} must equal the number of tokens, {total}")
    if max(lengths) > max_len:
        raise ValueError(f"{name} has a sequence of length {max(lengths)} > max_seqlen {max_len}")
    return True
