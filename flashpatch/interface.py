"""Public functional API, flash-attn 2 compatible: validate, then dispatch to the autograd layer.

Layering (one way): kernels/ (Triton) -> ops.py (torch.library custom ops) -> autograd.py -> this file.
"""

from __future__ import annotations

import torch

from flashpatch.autograd import FlashAttnFunction, PaddedAttnFunction
from flashpatch.padding import RowIndex
from flashpatch.validation import check_alibi_slopes, check_attention_args, check_cu_seqlens, check_unsupported, unpack


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Exact attention, fused: softmax(q kᵀ · scale) v without materializing the (seqlen_q, seqlen_k) matrix.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        k: (batch, seqlen_k, nheads_k, headdim)   nheads % nheads_k == 0 (GQA/MQA; K/V are never copied)
        v: (batch, seqlen_k, nheads_k, headdim)
            fp16, bf16 or fp32 (fp32 is computed in fp32: for exact parity tests); any headdim from 1 to 256 (the
            kernels pad it to a power of two by masks, nothing is copied); any strides with a contiguous last
            dimension.
        dropout_p: probability of dropping an attention weight (training only; pass 0.0 in eval).
            The keep mask comes from Philox keyed by a (seed, offset) pair drawn from torch's generator for
            q's device, so `torch.manual_seed` makes it reproducible; backward regenerates it, nothing is stored.
            Each weight's keep decision is a 16-bit draw, so p takes effect in steps of 2^-16.
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: mask keys after the query's position, aligned to the bottom-right corner when lengths differ.
            For seqlen_q = 2, seqlen_k = 5 (1 = attended):
                1 1 1 1 0
                1 1 1 1 1
            For seqlen_q = 5, seqlen_k = 2:
                0 0
                0 0
                0 0
                1 0
                1 1
            Rows that see no key output 0 (and get 0 gradient).
        window_size: (left, right), a tuple, list or 2-element integer tensor; query i attends keys in
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]; -1 leaves that side unbounded.
            With causal=True the right window is clamped to 0, as in flash-attn.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2 style).
        alibi_slopes: (nheads,) or (batch, nheads) float32, or None. ALiBi: adds
            -alibi_slopes[h] * |i + seqlen_k - seqlen_q - j| to the (scaled, softcapped) score of query i and key j;
            no gradient flows to the slopes.
        deterministic: bitwise-repeatable backward (no atomics). The default backward is deterministic too,
            except where adding dQ in fp32 inside the dK/dV kernel measured faster than a separate dQ pass: on a
            GPU for head dims 65-128 with dropout, a causal or window mask and no GQA (atomics), and on Hopper
            (sm_90) for head dim 128 rows where a query sees 2048 keys or more on average (TMA reduce-adds); as in
            flash-attn, the order of those adds varies from run to run. This flag turns both off.
        return_attn_probs: also return the log-sum-exp and, with dropout, the keep pattern (testing aid).

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype.
        With return_attn_probs=True: (out, softmax_lse, S_dmask), where softmax_lse is (batch, nheads, seqlen_q)
        float32, the natural-log log-sum-exp of the scaled (and softcapped) scores (+inf for rows that see no key),
        and S_dmask is None when dropout_p == 0, else a (batch, nheads, seqlen_q, seqlen_k) float tensor with
        +1 where the weight was kept and -1 where it was dropped (flash-attn returns signed probabilities there;
        flashpatch returns only the signs, which is what a test of the mask needs).
    """
    args = check_attention_args(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, varlen=False)
    check_alibi_slopes(alibi_slopes, q, batch=q.shape[0])
    return FlashAttnFunction.run(
        q, k, v, None, None, q.shape[1], k.shape[1], args, deterministic, return_attn_probs, alibi_slopes
    )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
):
    """Attention over a batch of sequences packed without padding.

    Arguments:
        q: (total_q, nheads, headdim), the queries of all sequences back to back
        k: (total_k, nheads_k, headdim)
        v: (total_k, nheads_k, headdim)
        cu_seqlens_q: (batch + 1,) int32, sequence b's queries are q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]]
        cu_seqlens_k: (batch + 1,) int32, likewise for keys and values
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence. They size the launch grid, so an
            upper bound (e.g. the padded length) is correct and saves a host sync; the dropout bits are keyed on
            them, so pass the same values to reproduce a mask.
        block_table: must be None (paged KV caches are an inference feature; NotImplementedError otherwise).
        Other arguments as in `flash_attn_func`; causal and window alignment (and ALiBi's distance) is
        bottom-right per sequence, and (batch, nheads) ALiBi slopes give one row per sequence.
        Sequences may be empty. Dropout draws, for a token pair, the same bit as `flash_attn_func` does on the
        same batch padded to (max_seqlen_q, max_seqlen_k).

    Returns:
        out: (total_q, nheads, headdim).
        With return_attn_probs=True: (out, softmax_lse (nheads, total_q) float32, S_dmask or None), S_dmask being
        (batch, nheads, max_seqlen_q, max_seqlen_k).
    """
    check_unsupported(block_table=block_table)
    args = check_attention_args(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, varlen=True)
    check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_alibi_slopes(alibi_slopes, q, batch=cu_seqlens_q.numel() - 1)
    return FlashAttnFunction.run(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), args, deterministic,
        return_attn_probs, alibi_slopes,
    )


def padded_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows_q: RowIndex,
    rows_k: RowIndex,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
) -> torch.Tensor:
    """`flash_attn_varlen_func` over the real tokens of padded batches, taking and returning the padded layout (the
    transformers integration's padded path; not a flash-attn function).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), any strides with a contiguous last dimension
        k, v: (batch, seqlen_k, nheads_k, headdim), likewise
        rows_q, rows_k: padding.RowIndex of the real queries and keys (the same object where they share a mask);
            cu_seqlens_q, cu_seqlens_k and max_seqlen_q, max_seqlen_k as `padding.padding_layout` gives them for
            those tokens.
        Other arguments as in `flash_attn_varlen_func`: causal and window alignment is bottom-right per sequence,
        over its real tokens.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), zeros at padded queries; gradients flow to q, k and v, zeros at
        their padding.
    """
    args = check_attention_args(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, varlen=False)
    if rows_q.device != q.device or rows_k.device != q.device:
        raise ValueError(f"the row indices must be on q's device {q.device}, got {rows_q.device} and {rows_k.device}")
    return PaddedAttnFunction.apply(q, k, v, rows_q, rows_k, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                    int(max_seqlen_k), args, deterministic)


# flash-attn 2's packed variants: the packed tensor is split into views (no copy), so the kernels read it in place.
# In backward, autograd stacks the three (or two) gradients into one tensor shaped like the packed input: one copy,
# which flash-attn's own packed functions avoid by writing each gradient into its slice.


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """`flash_attn_func` on q, k, v stacked in one tensor.

    Arguments:
        qkv: (batch, seqlen, 3, nheads, headdim); q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        Other arguments and the returns as in `flash_attn_func`.
    """
    q, k, v = unpack("qkv", qkv, 3, 5, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """`flash_attn_func` with k and v stacked in one tensor.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        kv: (batch, seqlen_k, 2, nheads_k, headdim); k, v = kv[:, :, 0], kv[:, :, 1]
        Other arguments and the returns as in `flash_attn_func`.
    """
    k, v = unpack("kv", kv, 2, 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """`flash_attn_varlen_func` on q, k, v stacked in one tensor (self-attention: one cu_seqlens).

    Arguments:
        qkv: (total, 3, nheads, headdim); q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        cu_seqlens: (batch + 1,) int32, for queries and keys alike
        max_seqlen: Python int, at least the longest sequence
        Other arguments and the returns as in `flash_attn_varlen_func`.
    """
    q, k, v = unpack("qkv", qkv, 3, 4, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """`flash_attn_varlen_func` with k and v stacked in one tensor.

    Arguments:
        q: (total_q, nheads, headdim)
        kv: (total_k, 2, nheads_k, headdim); k, v = kv[:, 0], kv[:, 1]
        Other arguments and the returns as in `flash_attn_varlen_func`.
    """
    k, v = unpack("kv", kv, 2, 4, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
