"""Exact masked attention in plain PyTorch, for masks the kernels cannot express (arbitrary 4D masks).

This is transformers' eager attention, written once for every model: the 4D mask already encodes causality, windows
and padding (eager ignores `is_causal` and `sliding_window` too), so only scale, softcap, mask, softmax and dropout
remain. It materializes the (B, H, Sq, Sk) scores: correct, not fast, which is why the caller warns once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_attention(
    query: torch.Tensor,  # (B, H, Sq, D)
    key: torch.Tensor,  # (B, Hk, Sk, D)
    value: torch.Tensor,  # (B, Hk, Sk, Dv)
    mask: torch.Tensor,  # (B or 1, 1 or H, Sq, Sk): bool (True = attend) or additive float
    scaling: float,
    dropout: float = 0.0,
    softcap: float = 0.0,
    training: bool = True,
) -> torch.Tensor:
    """Returns (B, Sq, H, Dv), like the kernels' path."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)  # (B, H, Sk, D): GQA groups are consecutive query heads
    value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, Sq, Sk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    mask = mask[..., : key.shape[-2]]  # static caches hand over masks longer than the keys
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=training and dropout > 0)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, Sq, H, Dv)
