"""The mask function registered for flashpatch with transformers' `AttentionMaskInterface`.

transformers builds every mask through `mask_interface(..., mask_function=<pattern>, attention_mask=<2D padding>)`,
where `<pattern>` is a composition of index predicates (causal, sliding window, packed documents, chunks, image
blocks, user overlays). flashpatch's kernels express exactly: causal or not, a sliding window (given to the attention
function as its `sliding_window` kwarg), padding (a 2D mask), and packed documents (from position_ids or
`cu_seq_lens_*`). So the mask function:

- returns the 2D boolean padding mask (or None when nothing is padded), like transformers' own flash mask, when the
  pattern is built only from predicates the kernels reproduce;
- otherwise materializes the exact boolean 4D mask (transformers' own sdpa mask builder) so that the attention
  function takes its exact, slower masked fallback (warned once) instead of silently dropping part of the pattern.

Patterns are recognized by an allowlist of transformers' predicate names; anything unknown falls back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo  # maybe_mark_dynamic (torch.compiler.disable loads it anyway)

from flashpatch.padding import cu_seqlens_of_starts

# Leaf predicates whose effect the kernels reproduce from their own arguments (causal flag, window, varlen layout).
_KNOWN_LEAVES = {
    "causal_mask_function",
    "bidirectional_mask_function",
    "sliding_window_overlay.<locals>.inner_mask",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask",
}
_PACKED = "packed_sequence_mask_function.<locals>.inner_mask"
_AND = "and_masks.<locals>.and_mask"
_REMAP = "remap_positions_for_packed_sequence.<locals>.inner_mask"


def _closure(fn: Callable) -> dict:
    """The function's free variables by name (read from its cells: torch.compile traces this, not `inspect`)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def analyze_pattern(mask_function: Callable) -> tuple[bool, torch.Tensor | None]:
    """(expressible, packed_sequence_mask) for a transformers mask predicate.

    expressible: `mask_function` is an intersection of predicates the kernels reproduce by themselves. Unions
    (`or_masks`: image-token blocks, prefix-LM overlays), chunked attention and any function we do not know are
    not: for those the exact mask must be materialized.
    packed_sequence_mask: (B, S) document index per token when transformers detected packed documents (position ids
    that do not step by +1), else None.
    """
    code = getattr(mask_function, "__code__", None)
    # co_qualname (Python 3.11+) is what torch.compile can read; __qualname__ is the 3.10 fallback.
    name = getattr(code, "co_qualname", None) or getattr(mask_function, "__qualname__", "")
    closure = _closure(mask_function)
    if name == _PACKED:
        return True, closure.get("packed_sequence_mask")
    if name in _KNOWN_LEAVES:
        return True, None
    if name == _AND:
        packed = None
        for child in closure.get("mask_functions") or ():
            ok, child_packed = analyze_pattern(child)
            if not ok:
                return False, None
            packed = child_packed if child_packed is not None else packed
        return bool(closure.get("mask_functions")), packed
    if name == _REMAP:  # the base pattern evaluated at per-document positions: check what it wraps
        inner = closure.get("mask_function")
        return (False, None) if inner is None else analyze_pattern(inner)
    return False, None


def document_cu_seqlens(packed_sequence_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) document index per token -> (documents + 1,) int32 cu_seqlens over the B * S tokens read row by row
    (a row's first token always starts a document). Marked dynamic in its length, so that a compiled model does
    not recompile for each new number of documents."""
    starts = torch.ones_like(packed_sequence_mask, dtype=torch.bool)  # (B, S)
    starts[:, 1:] = packed_sequence_mask[:, 1:] != packed_sequence_mask[:, :-1]
    cu_seqlens = cu_seqlens_of_starts(starts)
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    return cu_seqlens


@torch.compiler.disable
def fpatch_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs,
) -> torch.Tensor | None:
    """Mask for the "fpatch" implementation. Arguments as transformers passes them to any mask interface.

    Returns one of:
        None                                no padding, no packing: dense kernel
        (B, kv_length) bool                 padding mask, True = real token: unpad -> varlen kernel -> pad
        (documents + 1,) int32              packed documents: cu_seqlens over the B * S tokens (`document_cu_seqlens`)
        (B, 1, q_length, kv_length) bool    exact mask of a pattern the kernels cannot express: masked fallback

    Runs eagerly under torch.compile (one graph break per forward, before the layers): what it decides depends on
    tensor values (is anything padded, is there more than one document per row) and on the mask predicate's
    closure, which dynamo cannot read; the layers then compile as one graph on the path it chose.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    expressible, packed = analyze_pattern(mask_function)
    # use_vmap is set by transformers exactly when the caller added its own or/and overlay
    if use_vmap or not expressible:
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("allow_is_bidirectional_skip", None)
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
            use_vmap=use_vmap,
            **kwargs,
        )
    if packed is not None and not bool((packed[:, -1] != 0).any()):
        # Under torch.compile transformers cannot test whether position_ids hold several documents (data-dependent),
        # so every compiled forward gets a "packed" mask, of one document per row when the rows are dense. Tested
        # here, where it runs eagerly (see above): dense rows keep the dense kernel.
        packed = None
    if packed is not None:
        # transformers only detects packing without a padding mask and without a cache, so q_length == kv_length
        if attention_mask is not None or q_length != kv_length or tuple(packed.shape) != (batch_size, q_length):
            raise NotImplementedError(
                "flashpatch: packed documents combined with a padding mask or a KV cache are not supported "
                f"(mask {None if attention_mask is None else tuple(attention_mask.shape)}, q_length={q_length}, "
                f"kv_length={kv_length})"
            )
        return document_cu_seqlens(packed.expand(batch_size, -1))
    if attention_mask is None:
        return None
    # Keep the last kv_length columns: with a sliding-window cache the keys are the most recent ones.
    attention_mask = attention_mask[:, -kv_length:].bool()  # (B, <= kv_length)
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None  # no padding: the dense kernel path, no unpadding cost
    return attention_mask
