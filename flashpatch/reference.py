"""Readable PyTorch attention: the test oracle.

Nothing in `flashpatch.kernels` or `flashpatch.ops` imports this module. It materializes the full score matrix,
so it is for small shapes only: tests run it in float64 as ground truth and in the input dtype as the
"same-precision reference" whose error bounds the kernel's (flash-attn's 2x rule).

Masking conventions are the ones the kernels implement (flash-attn >= 2.1):
query row i of a sequence with seqlen_q queries and seqlen_k keys sees key j when
    i + (seqlen_k - seqlen_q) - window_left  <=  j  <=  i + (seqlen_k - seqlen_q) + window_right
(a bound of -1 is unbounded; causal means window_right = 0). Rows that see no key give zeros.
"""

from __future__ import annotations

import math

import torch


def visibility_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: True where query row i may attend key column j (bottom-right aligned)."""
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)  # diagonal position of row i
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    return visible


def attention_reference(
    q: torch.Tensor,  # (B, Sq, H, D)
    k: torch.Tensor,  # (B, Sk, Hk, D)
    v: torch.Tensor,  # (B, Sk, Hk, D)
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # (H,) or (B, H): adds -slope * |i + Sk - Sq - j| to the scores
    dropout_p: float = 0.0,
    dropout_keep: torch.Tensor | None = None,  # (B, H, Sq, Sk) bool: the kernel's own dropout pattern
    key_padding_mask: torch.Tensor | None = None,  # (B, Sk) bool, True = real token
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in plain PyTorch. Returns out (B, Sq, H, D) in q's dtype and lse (B, H, Sq) in float32.

    With upcast=True the math runs in float64 (the oracle); with upcast=False it runs in the input dtype
    (the same-precision baseline that bounds the kernel's allowed error).
    """
    dtype_in = q.dtype
    compute = torch.float64 if upcast else q.dtype
    q, k, v = (t.to(compute) for t in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads % nheads_k:
        raise ValueError(f"nheads={nheads} is not a multiple of nheads_k={nheads_k}")
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=2)  # (B, Sk, H, D)
    v = v.repeat_interleave(group, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(headdim)

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # (B, H, Sq, Sk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute).reshape(-1, nheads, 1, 1)  # (1 or B, H, 1, 1)
        rows = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
        distance = (rows - torch.arange(seqlen_k, device=q.device)[None, :]).abs()  # (Sq, Sk)
        scores = scores - slopes * distance.to(compute)
    visible = visibility_mask(seqlen_q, seqlen_k, causal, window_size, q.device)[None, None]
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :].bool()
    scores = scores.masked_fill(~visible, float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq); -inf for rows that see nothing
    probs = torch.exp(scores - lse[..., None])
    probs = probs.masked_fill(~visible, 0.0).nan_to_num(0.0)  # fully masked rows: 0, not NaN
    if dropout_p > 0:
        if dropout_keep is None:
            raise ValueError("dropout_p > 0 needs the kernel's dropout_keep pattern to be reproducible")
        probs = probs * dropout_keep.to(probs.dtype) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # flash-attn convention for empty rows
    return out.to(dtype_in), lse.float()


def varlen_attention_reference(
    q: torch.Tensor,  # (total_q, H, D)
    k: torch.Tensor,  # (total_k, Hk, D)
    v: torch.Tensor,  # (total_k, Hk, D)
    cu_seqlens_q: torch.Tensor,  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor,  # (batch + 1,) int32
    dropout_keep: torch.Tensor | None = None,  # (batch, H, max_seqlen_q, max_seqlen_k) bool
    alibi_slopes: torch.Tensor | None = None,  # (H,) or (batch, H)
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence loop over `attention_reference`. Returns out (total_q, H, D) and lse (H, total_q)."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        keep = None
        if dropout_keep is not None:
            keep = dropout_keep[b : b + 1, :, : cq[b + 1] - cq[b], : ck[b + 1] - ck[b]]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        out, lse = attention_reference(q[None, qs], k[None, ks], v[None, ks], dropout_keep=keep, alibi_slopes=slopes,
                                       **kwargs)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)
