"""patch_model / unpatch_model: switch one transformers model to flashpatch attention and back, exactly.

State lives on the model (one attribute), so patching one model never touches another (unless two models share one
config object, which also shares their attention implementation in transformers itself).
"""

from __future__ import annotations

import torch

from flashpatch.integrations import hf_padding_free as _pf
from flashpatch.integrations import transformers as _hf

_STATE = "_flashpatch_state"


def _pretrained_models(model: torch.nn.Module) -> list:
    from transformers import PreTrainedModel

    found = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    if not found:
        raise TypeError(
            f"patch_model expects a transformers PreTrainedModel (or a wrapper such as a PEFT model holding one), "
            f"got {type(model).__name__}"
        )
    return found


def _all_configs(models: list) -> list:
    """Every config and sub-config reachable from the models, each once (configs are not hashable: by id)."""
    seen, order, stack = set(), [], [m.config for m in models]
    while stack:
        config = stack.pop()
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        order.append(config)
        for name in getattr(config, "sub_configs", {}) or {}:
            stack.append(getattr(config, name, None))
    return order


def _check_supported(models: list) -> None:
    for m in models:
        cls = type(m)
        if not cls._can_set_attn_implementation():
            raise NotImplementedError(
                f"flashpatch cannot patch {cls.__name__}: its attention layers do not go through transformers' "
                "AttentionInterface (they call their own eager/sdpa code), so switching the implementation would "
                "change nothing."
            )
        if not (getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False)):
            raise NotImplementedError(
                f"flashpatch cannot patch {cls.__name__}: the model declares no flash-attention support "
                "(`_supports_flash_attn = False`), i.e. its attention needs something a flash kernel does not "
                "compute (e.g. additive position biases)."
            )
    for config in _all_configs(models):
        if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
            raise NotImplementedError(
                f"flashpatch cannot patch {type(models[0]).__name__}: it has cross-attention "
                f"({type(config).__name__}: is_encoder_decoder / add_cross_attention), whose 2-D padding mask "
                "belongs to the encoder keys only; flashpatch's padded path does not support that layout yet."
            )


def _install_probe(model: torch.nn.Module, state: dict) -> None:
    """Until one forward has run, check that it really called the flashpatch attention function at least once. Eager
    forwards only: under torch.compile the attention function does not count its calls (transformers.CALLS)."""

    def before(module, args):
        if not torch.compiler.is_compiling():
            state["calls_before"] = _hf.CALLS[0]

    def after(module, args, output):
        if torch.compiler.is_compiling():
            return
        if _hf.CALLS[0] == state.get("calls_before", _hf.CALLS[0]):
            raise RuntimeError(
                f"flashpatch: {type(module).__name__}.forward ran without calling the '{_hf.ATTN_IMPLEMENTATION}' "
                "attention function: this model does not dispatch its attention through transformers' "
                "AttentionInterface. Call unpatch_model(model) and use eager or sdpa."
            )
        for handle in state.pop("probe", ()):
            handle.remove()

    state["probe"] = (model.register_forward_pre_hook(before), model.register_forward_hook(after))


def patch_model(model: torch.nn.Module, padding_free: bool = False) -> torch.nn.Module:
    """Switch `model` (and every sub-model and sub-config) to flashpatch attention. Idempotent; returns the model.

    padding_free: also run padded batches without their padding, end to end. A forward that gets a 2-D
        `attention_mask` with padding and builds no KV cache (no cache passed, `use_cache` not True; in eval mode
        also not the config's default) packs the real tokens into one row, with the positions the padded row
        gives them and the rows' boundaries as cu_seqlens, so that embeddings, norms, MLPs, the LM head and the
        loss compute no pad. Outputs come back padded: logits (batch, length, vocab) and hidden states with zeros
        at pads, the loss that of the padded batch (causal targets shifted within each row; `-100` and
        `num_items_in_batch` as usual). Targets predicted from a pad position (left padding with a label on a
        row's first real token) are left out of the loss, with a warning. Batches without padding, generation
        and KV-cache decoding run as without it. Verified families and heads only: `hf_padding_free.VERIFIED`.

    Raises NotImplementedError for models flashpatch cannot run correctly (see docs/model_support.md), ValueError
    when the model is already patched with the other padding_free setting.
    """
    _hf.register()
    state = getattr(model, _STATE, None)
    if state is not None:
        if state.get("padding_free", False) != padding_free:
            raise ValueError(
                f"flashpatch: the model is already patched with padding_free={not padding_free}; call "
                "unpatch_model(model) first to change it."
            )
        return model
    models = _pretrained_models(model)
    _check_supported(models)
    if padding_free:
        _pf.check_supported(models[0])
    # Record before switching: set_attn_implementation also rewrites sub-configs it cannot check.
    previous = [(c, c._attn_implementation_internal) for c in _all_configs(models)]
    state = {"previous": previous, "padding_free": padding_free}
    try:
        models[0].set_attn_implementation(_hf.ATTN_IMPLEMENTATION)
        for m in models[1:]:  # nested models whose config is not a declared sub-config of the top one
            if m.config._attn_implementation != _hf.ATTN_IMPLEMENTATION:
                m.config._attn_implementation_internal = _hf.ATTN_IMPLEMENTATION
    except Exception:
        _restore(previous)
        raise
    if padding_free:
        _pf.install(models[0])  # the outermost transformers model: PEFT and Trainer call through it
        state["padding_free_model"] = models[0]
    _install_probe(models[0], state)
    setattr(model, _STATE, state)
    return model


def _restore(previous: list) -> None:
    for config, implementation in previous:
        config._attn_implementation_internal = implementation  # not the setter: it recurses into sub-configs


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch_model`: every config gets back exactly the implementation it had. No-op if not patched."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    for handle in state.pop("probe", ()):
        handle.remove()
    if state.get("padding_free_model") is not None:
        _pf.uninstall(state["padding_free_model"])
    _restore(state["previous"])
    delattr(model, _STATE)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return getattr(model, _STATE, None) is not None
