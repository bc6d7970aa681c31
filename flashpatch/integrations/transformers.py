"""flashpatch as a transformers attention implementation: one generic attention function for every model.

Registered at `import flashpatch` under ATTN_IMPLEMENTATION ("fpatch": the name must not contain "flash", which
transformers routes to its online kernel hub), together with the matching mask function (`hf_masks.fpatch_mask`;
without one, transformers hands a custom implementation no padding mask at all). After that,
`from_pretrained(..., attn_implementation="fpatch")` works, and `patch_model` switches an existing model.

Batch layouts, decided per call from what the mask function returned and the kwargs:
    2D bool padding mask            -> padded_attn_func: unpad, varlen kernels, pad back  (left/right padding, q < kv)
                                       or flash_attn_func over causal rows padded on the right (dense_pairs_bound)
    1D int32 cu_seqlens             -> flash_attn_varlen_func over documents             (packed rows, position_ids)
    cu_seq_lens_q/k (+ max_length)  -> flash_attn_varlen_func                            (DataCollatorWithFlattening)
    nothing                         -> flash_attn_func                                   (dense, bottom-right causal)
    4D mask                         -> exact PyTorch fallback, warned once               (patterns kernels can't express)
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from flashpatch import interface as _kernels
from flashpatch.integrations.hf_fallback import masked_attention
from flashpatch.integrations.hf_masks import fpatch_mask
from flashpatch.memo import once_per_tensor
from flashpatch.padding import RowIndex, max_seqlen_from_cu_seqlens, padding_layout

ATTN_IMPLEMENTATION = "fpatch"

logger = logging.getLogger("flashpatch")
_warned: set[str] = set()
# Incremented on every eager call; patch_model's first-forward probe reads it to prove the model really dispatches
# here. Not under torch.compile: a traced global counter is a guard on its value, so every layer's call would
# recompile the function (and past dynamo's recompile limit run eagerly between graph breaks: 4x slower training).
CALLS = [0]
VARLEN_CALLS = [0]  # the eager calls that got cu_seq_lens_* kwargs (a padding-free forward checks all of them did)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _refuse_unsupported(module: torch.nn.Module, s_aux, kwargs: dict) -> None:
    where = type(module).__name__
    if s_aux is not None:
        raise NotImplementedError(
            f"flashpatch: {where} uses attention sinks (`s_aux`, e.g. gpt-oss); the flashpatch kernels have no sink "
            "term. Use attn_implementation='eager' or 'sdpa' for this model."
        )
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            f"flashpatch: {where} adds a learned position bias to the scores (T5-style); the kernels cannot."
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "flashpatch: output_attentions=True needs the attention probabilities, which a fused kernel never "
            "materializes. Run that forward with attn_implementation='eager' (unpatch_model, or set_attn_implementation)."
        )
    if kwargs.get("block_table") is not None or type(kwargs.get("cache")).__name__ == "PagedAttentionCache":
        raise NotImplementedError("flashpatch: paged KV caches (continuous batching) are not supported")


def _compute_dtype(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The dtype the kernels run in; fp32 states are cast down where the model is really half precision."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    if torch.float32 in dtypes:
        device = q.device.type
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)  # autocast asked for half precision; fp32 leaked (norms, RoPE)
        halves = [d for d in dtypes if d in (torch.float16, torch.bfloat16)]
        if halves:
            return halves[0]  # e.g. PEFT's fp32 layer norms make q fp32 next to bf16 v
        weight = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        return weight if weight in (torch.float16, torch.bfloat16) else torch.float32
    return q.dtype  # fp16/bf16 mismatch cannot come from autocast: follow the query


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    """transformers' `sliding_window=W` (attention interface kwarg) -> the kernels' inclusive (left, right).

    transformers counts the window as W keys including the query's own (mask: q - W < k <= q), and for
    bidirectional layers the module passes W so that |q - k| <= W - 1 (ModernBERT passes local_attention // 2 + 1).
    Its own flash integration likewise passes (W - 1, W - 1).
    """
    if sliding_window is None:
        return (-1, -1)
    sliding_window = int(sliding_window)
    if sliding_window < 1:
        raise ValueError(f"flashpatch: sliding_window must be >= 1, got {sliding_window}")
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _varlen_from_kwargs(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cu_q, cu_k, max_q, max_k) from cu_seq_lens_q/_k and max_length_q/_k, at least one cu_seq_lens given."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    cu_q = (cu_q if cu_q is not None else cu_k).to(torch.int32)
    cu_k = (cu_k if cu_k is not None else cu_q).to(torch.int32)
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    # Read once per forward from the tensor when not given (every layer gets the same cu_seq_lens tensor)
    longest = lambda cu: once_per_tensor(cu, ("longest",), lambda: max_seqlen_from_cu_seqlens(cu))  # noqa: E731
    max_q = int(max_q) if max_q is not None else longest(cu_q)
    max_k = int(max_k) if max_k is not None else longest(cu_k)
    return cu_q, cu_k, max_q, max_k


def _real_tokens(mask: torch.Tensor, k_len: int) -> torch.Tensor:
    """mask (B, Sm), 0/1 or bool -> (B, k_len) bool, True = real token (the last k_len positions). Checked and
    derived once per mask tensor: both the dense-path decision and the unpadding layout read it."""
    def compute():
        if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                "flashpatch: a 2-D attention mask must be a 0/1 padding mask (1 = real token); got values "
                f"{torch.unique(mask)[:8].tolist()}. Pass additive masks as 4-D."
            )
        return mask.bool()[:, -k_len:]
    return once_per_tensor(mask, ("real tokens", k_len), compute)


def dense_pairs_bound(seqlen: int, headdim: int) -> float:
    """How many times the real tokens' causal (query, key) pairs a padded batch's rows of `seqlen` may hold for
    `_dense_over_padding` to run them as they are: 1.2 + 512 / seqlen (1.7 at 1024, 1.325 at 4096), with 1024 in
    place of 512 at head dims up to 64, whose kernels do less work per pair. The unpadded path's gathers and
    scatters (kernels/triton/rows.py) cost GPU time per token and host time per call, so short rows pay for more
    padding before unpadding wins; long rows come close to the attention's own ratio. Fitted to the GPU time of a
    layer's forward + backward on an H200 (docs/tuning.md, "padded rows")."""
    return 1.2 + (1024 if headdim <= 64 else 512) / seqlen


def _dense_over_padding(mask: torch.Tensor, q_len: int, k_len: int, causal: bool, headdim: int) -> bool:
    """Whether a padded batch can run the dense kernel as it is, padding included: causal self-attention (q_len ==
    k_len) over rows whose real tokens all come before their padding. A real query then sees real keys only (the
    keys after it are masked), so its output is the unpadded one; a padded query's output is garbage that nothing
    real reads, as in eager and sdpa, and the loss sends it a zero gradient, which gives its keys none either. It
    also has to pay: the padded rows' causal pairs at most `dense_pairs_bound` times the real tokens'. Decided once
    per mask tensor, with one host sync."""
    if not causal or q_len != k_len:
        return False

    def decide():
        real = _real_tokens(mask, k_len)  # (B, S)
        lengths = real.sum(1, dtype=torch.float64)  # (B,)
        ordered = (real[:, 1:] <= real[:, :-1]).all()  # no real token after a padded one
        ordered, real_pairs = torch.stack([ordered.double(), (lengths * (lengths + 1)).sum() / 2]).tolist()
        padded_pairs = real.shape[0] * k_len * (k_len + 1) / 2
        return bool(ordered) and padded_pairs <= dense_pairs_bound(k_len, headdim) * real_pairs
    return once_per_tensor(mask, ("dense", k_len, headdim), decide)


def _padding_layouts(mask: torch.Tensor, k_len: int, q_len: int):
    """mask (B, Sm), nonzero = real -> ((RowIndex, cu_seqlens, max_seqlen) for the keys, the same for the queries)."""
    padding = _real_tokens(mask, k_len)
    indices, cu, longest = padding_layout(padding)
    keys = (RowIndex(indices, k_len), cu, longest)
    if q_len == k_len:
        return keys, keys
    indices, cu, longest = padding_layout(padding[:, -q_len:])
    return keys, (RowIndex(indices, q_len), cu, longest)


def _attend_rows(q, k, v, cu_q, cu_k, max_q, max_k, flash_kwargs: dict) -> torch.Tensor:
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D) rows holding documents back to back, cu_q/cu_k over the flattened rows
    -> (B, Sq, H, D); no token attends across a document boundary."""
    batch, q_len = q.shape[:2]
    q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))  # (B * S, H, D)
    out = _kernels.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **flash_kwargs)
    return out.reshape(batch, q_len, *out.shape[1:])


def _run_documents(q, k, v, cu_seqlens: torch.Tensor, flash_kwargs: dict) -> torch.Tensor:
    """Packed rows from hf_masks' cu_seqlens. Traced under torch.compile: the longest document is then bounded by
    the row length (a length read from cu_seqlens would be a value traced code guards on, a recompile per batch);
    eagerly it is read once per forward."""
    if torch.compiler.is_compiling():
        longest = q.shape[1]
    else:
        longest = once_per_tensor(cu_seqlens, ("longest",), lambda: max_seqlen_from_cu_seqlens(cu_seqlens))
    return _attend_rows(q, k, v, cu_seqlens, cu_seqlens, longest, longest, flash_kwargs)


# Padded rows and cu_seq_lens kwargs run eagerly under torch.compile (a graph break per layer, as in transformers'
# own flash-attention path): their token counts and longest sequence are values read from the mask or kwargs,
# which traced code would guard on, recompiling for every new batch composition.


@torch.compiler.disable
def _run_padded(q, k, v, mask: torch.Tensor, flash_kwargs: dict) -> torch.Tensor:
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D), mask (B, Sm) 0/1 -> (B, Sq, H, D), zeros at padded queries (garbage
    there where `_dense_over_padding` runs the batch as it is).

    With fewer queries than keys (KV cache) the queries are the last q_len positions, as with left padding."""
    q_len = q.shape[1]
    if k.shape[1] > mask.shape[1]:  # static cache: slots past the mask were never written
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
    if _dense_over_padding(mask, q_len, k.shape[1], flash_kwargs["causal"], q.shape[-1]):
        return _kernels.flash_attn_func(q, k, v, **flash_kwargs)
    layouts = once_per_tensor(mask, ("padding", k.shape[1], q_len), lambda: _padding_layouts(mask, k.shape[1], q_len))
    (rows_k, cu_k, max_k), (rows_q, cu_q, max_q) = layouts
    return _kernels.padded_attn_func(q, k, v, rows_q, rows_k, cu_q, cu_k, max_q, max_k, **flash_kwargs)


@torch.compiler.disable
def _run_flattened(q, k, v, kwargs: dict, flash_kwargs: dict) -> torch.Tensor:
    """One row of documents given by cu_seq_lens_q/k kwargs (DataCollatorWithFlattening)."""
    return _attend_rows(q, k, v, *_varlen_from_kwargs(kwargs), flash_kwargs)


def fpatch_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, Sq, D)
    key: torch.Tensor,  # (B, Hk, Sk, D)
    value: torch.Tensor,  # (B, Hk, Sk, Dv)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function. Returns ((B, Sq, H, Dv), None)."""
    if not torch.compiler.is_compiling():
        CALLS[0] += 1
    _refuse_unsupported(module, s_aux, kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = float(softcap) if softcap else 0.0

    if attention_mask is not None and attention_mask.dim() not in (1, 2):
        _warn_once(
            "mask4d",
            f"flashpatch: {type(module).__name__} got a {attention_mask.dim()}-D attention mask (a custom mask, or a "
            "pattern such as chunked attention or image-token blocks that the kernels cannot express); computing "
            "this attention exactly in plain PyTorch instead (slower, more memory).",
        )
        return masked_attention(query, key, value, attention_mask, scaling, dropout, softcap, module.training), None

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D): the kernels' layout, no copy
    dtype = _compute_dtype(module, q, k, v)
    q, k, v = (t if t.dtype == dtype else t.to(dtype) for t in (q, k, v))  # `to` costs a dispatch even as a no-op
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: the kernels need one head dim, zero columns of V give zero outputs
        v = F.pad(v, (0, head_dim - v_head_dim))

    deterministic = kwargs.get("deterministic")
    flash_kwargs = dict(
        dropout_p=float(dropout),
        softmax_scale=float(scaling),
        causal=causal,
        window_size=_window(sliding_window, causal),
        softcap=softcap,
        deterministic=bool(deterministic if deterministic is not None else torch.are_deterministic_algorithms_enabled()),
    )
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        if not torch.compiler.is_compiling():
            VARLEN_CALLS[0] += 1
        out = _run_flattened(q, k, v, kwargs, flash_kwargs)
    elif attention_mask is not None and attention_mask.dim() == 1:  # packed documents (hf_masks.fpatch_mask)
        out = _run_documents(q, k, v, attention_mask, flash_kwargs)
    elif attention_mask is not None:
        out = _run_padded(q, k, v, attention_mask, flash_kwargs)
    else:
        out = _kernels.flash_attn_func(q, k, v, **flash_kwargs)  # (B, Sq, H, D)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def register() -> None:
    """Make attn_implementation=ATTN_IMPLEMENTATION known to transformers (idempotent, no model touched)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, fpatch_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, fpatch_mask)
