"""Tiny random transformers models for the patch tests: nothing downloaded, float32, interpreter-sized.

Sizes: hidden 64, 4 query heads of dim 16, 2 KV heads where the family has GQA, 2 layers. Sliding windows are
4 keys so that a 16-token batch really exercises them; Gemma 2's softcap is 1.0 so that tanh is far from linear on
these random logits (a softcap of 50 would never be reached and test nothing).
"""

from __future__ import annotations

import copy

import torch

VOCAB = 96
SEQ = 16

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _cfg(name: str):
    import transformers as tf

    gqa = dict(COMMON, num_key_value_heads=2)
    if name == "llama":
        return tf.LlamaConfig(**gqa)
    if name == "mistral":
        return tf.MistralConfig(**gqa, sliding_window=4)
    if name == "mixtral":
        return tf.MixtralConfig(**gqa, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if name == "qwen2":
        return tf.Qwen2Config(**gqa)
    if name == "qwen3":
        return tf.Qwen3Config(**gqa, head_dim=16)
    if name == "gemma2":
        return tf.Gemma2Config(**gqa, head_dim=16, sliding_window=4, attn_logit_softcapping=1.0,
                               final_logit_softcapping=30.0, query_pre_attn_scalar=16)
    if name == "gemma3":
        return tf.Gemma3TextConfig(**gqa, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"])
    if name == "phi3":
        return tf.Phi3Config(**gqa)
    if name == "olmo2":
        return tf.Olmo2Config(**gqa)
    if name == "starcoder2":
        return tf.Starcoder2Config(**gqa, sliding_window=4)
    if name == "gpt_neox":
        return tf.GPTNeoXConfig(**COMMON, rotary_pct=0.5)
    if name == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "stablelm":
        return tf.StableLmConfig(**dict(COMMON, num_key_value_heads=2), partial_rotary_factor=0.5, qk_layernorm=True)
    if name == "modernbert":  # alternating global / local layers; local window of 4 keys each side
        return tf.ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, global_attn_every_n_layers=2, local_attention=8,
                                   max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                   sep_token_id=2, cls_token_id=1)
    if name == "bert":
        return tf.BertConfig(**{k: v for k, v in COMMON.items() if k not in ("bos_token_id", "eos_token_id")})
    raise KeyError(name)


DECODERS = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "starcoder2",
            "gpt_neox", "gpt2", "stablelm"]
ENCODERS = ["bert", "modernbert"]


def config(name: str):
    cfg = _cfg(name)
    for attr in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "hidden_dropout_prob",
                 "resid_pdrop", "embd_pdrop", "hidden_dropout", "attention_probs_dropout_prob"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, 0.0)  # parity tests compare deterministic forwards
    return cfg


def build(name: str, attn: str = "eager", seed: int = 0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if name in ENCODERS else AutoModelForCausalLM
    # eager experts: grouped_mm has no float64 kernel, and the float64 twin must run the same code
    extra = {"experts_implementation": "eager"} if name == "mixtral" else {}
    model = auto.from_config(config(name), attn_implementation=attn, **extra)
    return model.to(dtype).eval()


def lora_qwen2(peft):
    """A Qwen2 model with LoRA adapters on q_proj and v_proj whose B matrices are not zero, so the adapters matter."""
    model = peft.get_peft_model(build("qwen2"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # LoRA starts at B = 0
    return model


ORACLE = "fp64_oracle"


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Exact attention for the float64 twin: eager's semantics (the 4D mask carries causality, windows, padding and
    packing) with the softmax in float64 too (eager softmaxes in float32 whatever the input dtype). Query rows that
    see no key give 0, as in flashpatch (eager gives a uniform average there); tests only compare real tokens.
    """
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)  # (B, H, Sk, D)
    scores = query @ key.transpose(2, 3) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        scores = scores.masked_fill(~allowed[..., : key.shape[2]], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ value).transpose(1, 2).contiguous(), None


def oracle_mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(*args, **kwargs)  # always the full (B, 1, Sq, Sk) bool mask


def register_oracle():
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ORACLE, oracle_attention)
    AttentionMaskInterface.register(ORACLE, oracle_mask)


def as_float64(model):
    """A float64 twin of `model` with identical weights running `oracle_attention`: the reference."""
    register_oracle()
    twin = copy.deepcopy(model).double()
    twin.set_attn_implementation(ORACLE)
    return twin
