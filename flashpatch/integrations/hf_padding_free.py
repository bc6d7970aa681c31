"""patch_model(model, padding_free=True): a padded batch runs as one packed row of its real tokens, end to end.

The model's forward is wrapped (one generic wrapper, installed on the outermost transformers model). When a forward
gets a 2-D padding mask and builds no KV cache, the wrapper

1. packs: input_ids / inputs_embeds / token_type_ids / labels of the real tokens, row after row, into one row
   (1, T); position_ids are the positions the padded row gives those tokens (the ones passed, else what every
   verified family computes without a cache: arange(L), pads counted, so left padding keeps its offsets);
2. runs the model on that row with attention_mask=None and the rows' boundaries as transformers' varlen kwargs
   (cu_seq_lens_q/k, max_length_q/k), which flashpatch's attention function takes before anything else: every
   layer, norm, MLP and the LM head see T tokens, and no token attends across rows;
3. scatters per-token outputs (logits, hidden states, MoE router logits) back to the padded layout, zeros at pads.

Causal LM targets are shifted in the padded layout (label t + 1 for position t) and only then gathered, then given
to the loss as `shift_labels`, so no target crosses a row; `labels` gets the same targets pre-shifted by one, for a
loss that shifts by itself. Targets predicted from a padding position (left padding with a label on the first real
token, or labels on pads) have no logits here: they are left out, with a warning.

Anything else runs as without padding_free: no padding, a KV cache, `logits_to_keep`, holes in the mask, other
per-token inputs.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types

import torch
import torch._dynamo  # maybe_mark_dynamic
import torch.nn.functional as F

from flashpatch.integrations import transformers as _hf
from flashpatch.padding import pad_input

# model_type -> the heads verified against eager on padded batches (tests/test_padding_free.py). A family is added
# here with a test: the wrapper relies on its default positions being arange(L), on its forward passing varlen
# kwargs down to every attention call and `shift_labels` to its loss, and on no layer mixing tokens otherwise.
VERIFIED = {
    **{t: ("causal", "base") for t in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2", "gemma3_text",
                                       "phi3", "olmo2", "starcoder2", "gpt_neox", "gpt2")},
    "bert": ("masked", "base"),
    "modernbert": ("masked", "base"),
}
# Families known not to work, and why.
REFUSED = {
    "stablelm": "its decoder layers do not pass keyword arguments on to attention, so the rows' boundaries "
    "(cu_seq_lens_*) never reach it",
}
_PACKED_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids", "labels", "shift_labels",
                  "attention_mask")
_ACTIVE = "_flashpatch_padding_free"  # on the wrapped model while padding-free is on
_PREVIOUS = "_flashpatch_previous_forward"  # an instance-level forward it had before (e.g. accelerate's autocast)
_WRAPPER = "_flashpatch_padding_free_wrapper"  # marks the wrapper function
_INSTALLED = "_flashpatch_padding_free_installed"  # on the model while the wrapper is in its forward chain


def head_kind(model: torch.nn.Module) -> str:
    """"causal" (shifted LM loss), "masked" (per-token loss), "base" (no head) or "" (a head that reads rows)."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if name.endswith("ForMaskedLM"):
        return "masked"
    if getattr(model, "base_model", None) is model and getattr(model, "pooler", None) is None:
        return "base"
    return ""


def check_supported(model: torch.nn.Module) -> None:
    """Raises NotImplementedError, naming the reason, for a model padding_free=True cannot run exactly."""
    name, model_type = type(model).__name__, getattr(model.config, "model_type", None)
    if model_type in REFUSED:
        raise NotImplementedError(
            f"flashpatch: padding_free=True cannot run {name}: {REFUSED[model_type]}. Use patch_model(model) without "
            "padding_free: padded batches then unpad inside each attention call."
        )
    if model_type not in VERIFIED:
        raise NotImplementedError(
            f"flashpatch: padding_free=True is not verified for {name} (model_type {model_type!r}); verified: "
            f"{', '.join(sorted(VERIFIED))}. Families differ in what a packed row needs (OPT and RoBERTa-style models "
            "number positions from the mask, recurrent layers carry state across rows). Use patch_model(model) "
            "without padding_free: padded batches then unpad inside each attention call."
        )
    kind = head_kind(model)
    if kind not in VERIFIED[model_type]:
        raise NotImplementedError(
            f"flashpatch: padding_free=True supports {' and '.join(VERIFIED[model_type])} models of {model_type}, not "
            f"{name}: a head that pools or picks tokens by their place in the row (sequence classification, "
            "question answering, a BERT pooler) would read the packed row's tokens instead."
        )


@functools.cache
def _parameters(cls: type) -> dict:
    return dict(inspect.signature(cls.forward).parameters)


def _bind(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """Positional and keyword arguments of the model's forward as one dict of keyword arguments."""
    params = _parameters(type(model))
    bound = inspect.Signature(list(params.values())).bind(model, *args, **kwargs).arguments
    call = {}
    for name, value in bound.items():
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            call[name] = value
    call.pop(next(iter(params)))  # self
    return call


def _packable(model: torch.nn.Module, call: dict) -> bool:
    """What can be decided without reading tensor values."""
    mask = call.get("attention_mask")
    tokens = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    if not (torch.is_tensor(mask) and mask.dim() == 2 and torch.is_tensor(tokens)):
        return False
    if tuple(tokens.shape[:2]) != tuple(mask.shape):
        return False
    if any(call.get(k) is not None for k in ("cache", "past_key_values", "cache_position")):
        return False
    if "use_cache" in _parameters(type(model)):  # a model that can build a KV cache: only when it will not
        use_cache = call.get("use_cache")
        if use_cache or (use_cache is None and not model.training and getattr(model.config, "use_cache", False)):
            return False
    keep = call.get("logits_to_keep")  # 0 = all positions; N = the last N of every padded row
    if keep is not None and (torch.is_tensor(keep) and keep.numel() != 1 or int(keep) != 0):
        return False
    if call.get("output_attentions"):
        return False  # the attention function refuses it with the reason
    per_token = [name for name, value in call.items() if name not in _PACKED_INPUTS and torch.is_tensor(value)
                 and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(mask.shape)]
    if per_token:
        _hf._warn_once(
            f"pf-inputs-{per_token}",
            f"flashpatch: padding_free cannot pack the per-token inputs {per_token}; such batches run padded.",
        )
        return False
    return True


@torch.compiler.disable
def _pack(model: torch.nn.Module, call: dict, causal: bool):
    """(packed call, (indices, batch, length)), or None when the batch has no padding, no real token, non-0/1
    values, or holes (real tokens not contiguous in a row: a window would then count the holes in eager)."""
    mask = call["attention_mask"]
    batch, length = mask.shape
    real = mask != 0
    lengths = real.sum(1)
    first = real.int().argmax(1)
    last = length - 1 - real.flip(1).int().argmax(1)
    holes = ((last - first + 1 != lengths) & (lengths > 0)).any()
    binary = ((mask == 0) | (mask == 1)).all() if mask.dtype != torch.bool else real.new_ones(())

    ignore = call.get("ignore_index", -100)
    labels, shift = call.get("labels"), call.get("shift_labels")
    targets = None  # per-position targets in the padded layout
    if causal and (labels is not None or shift is not None):
        targets = shift if shift is not None else F.pad(labels[:, 1:], (0, 1), value=ignore)
    elif labels is not None:
        targets = labels
    dropped = ((targets != ignore) & ~real).sum() if targets is not None else lengths.new_zeros(())
    stats = torch.cat([lengths, torch.stack([binary.long(), holes.long(), dropped.long()])]).tolist()
    lengths_host, (binary, holes, dropped) = stats[:batch], stats[batch:]
    total = sum(lengths_host)
    if not binary or total == 0 or total == batch * length:
        return None
    if holes:
        _hf._warn_once("pf-holes", "flashpatch: padding_free needs each row's real tokens contiguous (left or right "
                       "padding); a mask with holes runs padded.")
        return None
    if dropped:
        _hf._warn_once(
            "pf-dropped",
            f"flashpatch: padding_free left {dropped} target(s) out of the loss: they are predicted from padding "
            "positions (left padding with a label on a row's first real token, or labels on pads), which a packed "
            "row does not have; eager computes them from a padding position's meaningless output. Set those labels "
            "to -100 to make both losses equal.",
        )

    indices = real.flatten().nonzero().flatten()  # (T,)
    torch._dynamo.maybe_mark_dynamic(indices, 0)
    device = mask.device

    def gather(t: torch.Tensor) -> torch.Tensor:
        t = t.expand(batch, *t.shape[1:]) if t.shape[0] == 1 else t
        row = t.reshape(batch * length, *t.shape[2:])[indices].unsqueeze(0)  # (1, T, ...)
        torch._dynamo.maybe_mark_dynamic(row, 1)  # T changes every batch: a compiled model traces it symbolically
        return row

    packed = dict(call)
    for name in ("input_ids", "inputs_embeds", "token_type_ids"):
        if call.get(name) is not None:
            packed[name] = gather(call[name])
    positions = call.get("position_ids")
    packed["position_ids"] = gather(positions if positions is not None else torch.arange(length, device=device)[None])
    if causal and targets is not None:
        packed["shift_labels"] = gather(targets)
        # the same targets for a loss that shifts `labels` by itself; position 0's label is never a target
        packed["labels"] = F.pad(packed["shift_labels"][:, :-1], (1, 0), value=ignore)
        torch._dynamo.maybe_mark_dynamic(packed["labels"], 1)
    elif targets is not None:
        packed["labels"] = gather(targets)
    nonempty = [n for n in lengths_host if n]  # rows without a real token are no document at all
    cu_seqlens = torch.tensor([0, *itertools.accumulate(nonempty)], dtype=torch.int32, device=device)
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    # No max_length_q/k: Python ints would be values a compiled model guards on (a recompile per batch); the
    # attention function reads the longest row from cu_seqlens once per forward instead.
    packed.update(attention_mask=None, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens)
    if "use_cache" in _parameters(type(model)):
        packed["use_cache"] = False
    return packed, (indices, batch, length)


@torch.compiler.disable
def _unpack(output, layout):
    """Per-token tensors of a (1, T, ...) run back to (B, L, ...) (router logits (T, E) to (B * L, E)), zeros at
    pads; everything else (loss, aux_loss) as it is."""
    indices, batch, length = layout
    total = indices.numel()

    def scatter(value, key):
        if torch.is_tensor(value):
            if value.dim() >= 2 and tuple(value.shape[:2]) == (1, total):
                return pad_input(value[0], indices, batch, length)
            if key == "router_logits" and value.dim() == 2 and value.shape[0] == total:
                return pad_input(value, indices, batch, length).reshape(batch * length, -1)
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(scatter(v, key) for v in value)
        return value

    for key in list(output.keys()):
        output[key] = scatter(output[key], key)
    return output


def padding_free_forward(model: torch.nn.Module, *args, **kwargs):
    previous = model.__dict__.get(_PREVIOUS)
    inner = previous if previous is not None else types.MethodType(type(model).forward, model)
    if not model.__dict__.get(_ACTIVE):
        return inner(*args, **kwargs)  # unpatched while someone's wrapper still calls this one
    call = _bind(model, args, kwargs)
    if not _packable(model, call):
        return inner(*args, **kwargs)
    packed = _pack(model, call, head_kind(model) == "causal")
    if packed is None:
        return inner(*args, **kwargs)
    call, layout = packed
    asked = call.pop("return_dict", None)
    return_dict = asked if asked is not None else getattr(model.config, "return_dict", True)
    if asked is not None or not return_dict:
        call["return_dict"] = True  # the outputs are scattered by name; a tuple is made at the end if asked for

    counting = not torch.compiler.is_compiling()
    before = (_hf.CALLS[0], _hf.VARLEN_CALLS[0])
    output = inner(**call)
    if counting:
        calls, varlen = _hf.CALLS[0] - before[0], _hf.VARLEN_CALLS[0] - before[1]
        if calls == 0 or varlen != calls:
            raise RuntimeError(
                f"flashpatch: a padding-free forward of {type(model).__name__} made {calls} attention calls through "
                f"flashpatch, {varlen} of them with the rows' boundaries (cu_seq_lens_*). Every attention call must "
                "get them, or tokens attend across rows: was the attention implementation changed after "
                "patch_model, or does this model not pass its kwargs to attention?"
            )
    output = _unpack(output, layout)
    return output if return_dict else output.to_tuple()


def _wrapper_for(cls_forward):
    @functools.wraps(cls_forward)  # the model's own signature: Trainer reads it to choose the batch's columns
    def forward(self, *args, **kwargs):
        return padding_free_forward(self, *args, **kwargs)

    setattr(forward, _WRAPPER, True)
    return forward


def install(model: torch.nn.Module) -> None:
    """Wrap `model.forward` (an instance attribute: a bound method, so that deepcopy rebinds it to the copy)."""
    if not model.__dict__.get(_INSTALLED):
        current = model.__dict__.get("forward")
        if current is not None:
            setattr(model, _PREVIOUS, current)
        model.forward = types.MethodType(_wrapper_for(type(model).forward), model)
        setattr(model, _INSTALLED, True)
    setattr(model, _ACTIVE, True)


def uninstall(model: torch.nn.Module) -> None:
    """Back to the forward it had. If another wrapper was installed over ours since (accelerate.prepare's autocast),
    ours stays inside it as a pass-through, and a later install switches it on again."""
    model.__dict__.pop(_ACTIVE, None)
    current = model.__dict__.get("forward")
    if current is not None and getattr(getattr(current, "__func__", None), _WRAPPER, False):
        previous = model.__dict__.pop(_PREVIOUS, None)
        if previous is None:
            del model.forward
        else:
            model.forward = previous
        model.__dict__.pop(_INSTALLED, None)
