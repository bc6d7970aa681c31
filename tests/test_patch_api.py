"""patch_model / unpatch_model bookkeeping, refusals, the mask function's decisions, dtypes, fallback and dropout."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

import flashpatch
from flashpatch.integrations import hf_masks
from flashpatch.integrations import transformers as fp_hf

from ._patch_models import SEQ, VOCAB, as_float64, build
from .test_patch import assert_as_accurate_as_eager, padded_batch

# These run CPU tensors through the Triton interpreter (float32 parity); on a CUDA machine conftest leaves it off.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-interpreter tests: run with TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= on a GPU machine",
)

NAME = flashpatch.ATTN_IMPLEMENTATION


def implementations(model) -> list:
    configs = [model.config] + [getattr(model.config, k) for k in model.config.sub_configs]
    return [c._attn_implementation for c in configs]


def tiny_multimodal(attn):
    """Llava, a Llama text model with a SigLIP vision tower: a config with two sub-configs, each with its own
    implementation. (Gemma 3's multimodal model, used before, declares no flash-attention support since
    transformers 5.2x, so patch_model refuses it.)"""
    text = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=16, patch_size=8)
    config = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=299)
    return tf.LlavaForConditionalGeneration._from_config(config, attn_implementation=attn)


def test_patch_records_and_restores_every_sub_config():
    chosen = {"": "sdpa", "text_config": "eager", "vision_config": "sdpa"}
    model = tiny_multimodal(chosen)
    before = implementations(model)
    assert dict(zip(["", *model.config.sub_configs], before)) == chosen
    assert flashpatch.patch_model(model) is model
    assert implementations(model) == [NAME] * 3
    assert {m.config._attn_implementation for m in model.modules() if isinstance(m, tf.PreTrainedModel)} == {NAME}
    flashpatch.patch_model(model)  # idempotent: must not record "fpatch" as the state to go back to
    assert flashpatch.unpatch_model(model) is model
    assert implementations(model) == before
    flashpatch.unpatch_model(model)  # no-op
    assert implementations(model) == before


def test_round_trip_is_exact_and_per_model():
    model, other = build("llama"), build("llama", seed=1)
    batch = padded_batch(encoder=False)
    with torch.no_grad():
        before = model(**batch).logits
        flashpatch.patch_model(model)
        assert model.config._attn_implementation == NAME
        assert other.config._attn_implementation == "eager", "patching one model changed another"
        model(**batch)
        flashpatch.unpatch_model(model)
        after = model(**batch).logits
    assert model.config._attn_implementation == "eager"
    assert torch.equal(before, after), "unpatched model does not compute exactly what it did before"
    assert not hasattr(model, "_flashpatch_state")


def test_attn_implementation_name_works_in_from_config():
    model = build("qwen3", attn=NAME)
    assert model.config._attn_implementation == NAME
    assert "flash" not in NAME  # transformers would route such a name to its kernel hub
    exact_model = as_float64(model)
    eager_model = build("qwen3")
    batch = padded_batch(encoder=False)
    with torch.no_grad():
        got, eager, exact = (m(**batch).logits for m in (model, eager_model, exact_model))
    real = batch["attention_mask"].bool()
    assert_as_accurate_as_eager(got[real], eager[real], exact[real], "from_config logits")


SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: AutoModelForCausalLM.from_config(tf.FalconConfig(**SMALL)), "AttentionInterface"),
        (lambda: AutoModelForCausalLM.from_config(tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=1,
                                                                 n_head=4)), "AttentionInterface"),
        (lambda: AutoModelForSeq2SeqLM.from_config(tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96,
                                                               num_layers=1, num_heads=4)), "_supports_flash_attn"),
        (lambda: AutoModelForSeq2SeqLM.from_config(tf.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1,
                                                                 decoder_layers=1, encoder_attention_heads=4,
                                                                 decoder_attention_heads=4, encoder_ffn_dim=96,
                                                                 decoder_ffn_dim=96)), "cross-attention"),
    ],
    ids=["falcon", "bloom", "t5", "bart"],
)
def test_unsupported_models_are_refused_at_patch_time(make, match):
    model = make()
    before = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match=match):
        flashpatch.patch_model(model)
    assert model.config._attn_implementation == before
    assert not hasattr(model, "_flashpatch_state")


def test_attention_sinks_are_refused_on_first_call():
    config = tf.GptOssConfig(**SMALL, num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=4, layer_types=["full_attention"])
    model = flashpatch.patch_model(AutoModelForCausalLM.from_config(config))
    with pytest.raises(NotImplementedError, match="s_aux"):
        model(input_ids=torch.randint(3, VOCAB, (1, 8)))


def test_output_attentions_is_refused():
    model = flashpatch.patch_model(build("llama"))
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=torch.randint(3, VOCAB, (1, 8)), output_attentions=True)


def test_model_that_bypasses_the_interface_fails_on_first_forward():
    model = flashpatch.patch_model(build("llama"))
    model.config._attn_implementation_internal = "eager"  # as if its layers ignored the attention interface
    with pytest.raises(RuntimeError, match="without calling"):
        model(input_ids=torch.randint(3, VOCAB, (1, 8)))
    model.config._attn_implementation_internal = NAME
    model(input_ids=torch.randint(3, VOCAB, (1, 8)))  # a model that does dispatch passes the probe


def test_mask_function_decisions():
    from transformers import masking_utils as mu

    pad = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    args = dict(batch_size=2, q_length=4, kv_length=4)
    assert hf_masks.fpatch_mask(**args, mask_function=mu.causal_mask_function) is None
    assert hf_masks.fpatch_mask(**args, mask_function=mu.causal_mask_function, attention_mask=torch.ones(2, 4)) is None
    out = hf_masks.fpatch_mask(**args, mask_function=mu.sliding_window_causal_mask_function(2), attention_mask=pad)
    assert out.dtype == torch.bool and torch.equal(out, pad)
    # packed documents come back as cu_seqlens over the flattened rows (1-D: never confusable with a padding mask)
    packed = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 2]])
    if hasattr(mu, "packed_sequence_compatibility_function"):  # transformers >= 5.2x
        fn = mu.packed_sequence_compatibility_function(mu.causal_mask_function, positions, packed)
    else:
        fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(packed))
    docs = hf_masks.fpatch_mask(**args, mask_function=fn)
    assert docs.dtype == torch.int32 and docs.tolist() == [0, 2, 4, 5, 8]  # row 0: 2 + 2 tokens; row 1: 1 + 3
    # patterns the kernels cannot express come back as the exact 4D mask (-> warned fallback)
    image_block = mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: (q < 2) & (k < 2))
    chunked = mu.chunked_causal_mask_function(2, torch.zeros(2, dtype=torch.long))
    for fn, vmap in ((image_block, True), (image_block, False), (chunked, False), (lambda b, h, q, k: q >= k, False)):
        out = hf_masks.fpatch_mask(**args, mask_function=fn, attention_mask=pad, use_vmap=vmap)
        assert out.shape == (2, 1, 4, 4) and out.dtype == torch.bool
        expected = mu.sdpa_mask(**args, mask_function=fn, attention_mask=pad, allow_is_causal_skip=False,
                                use_vmap=vmap)
        assert torch.equal(out, expected)


def test_custom_4d_mask_takes_the_exact_fallback(caplog):
    """A 4D mask the kernels cannot express (here: keys 2..4 hidden from every query) is computed exactly, warned."""
    model = build("llama")
    exact_model = as_float64(model)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    allowed[4:, 2:5] = False
    additive = torch.zeros(2, 1, SEQ, SEQ).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=additive, use_cache=False).logits
        exact = exact_model(input_ids=ids, attention_mask=additive.double(), use_cache=False).logits
        flashpatch.patch_model(model)
        fp_hf._warned.discard("mask4d")
        with caplog.at_level(logging.WARNING, logger="flashpatch"):
            got = model(input_ids=ids, attention_mask=additive, use_cache=False).logits
            model(input_ids=ids, attention_mask=additive, use_cache=False)
    assert sum("plain PyTorch" in r.getMessage() for r in caplog.records) == 1, "fallback must warn exactly once"
    assert_as_accurate_as_eager(got, eager, exact, "4D-mask fallback logits")


def test_two_dimensional_non_binary_mask_is_refused():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="0/1 padding mask"):
        fp_hf.fpatch_attention_forward(torch.nn.Linear(2, 2), q, q, q, torch.full((1, 8), 2), scaling=0.25)


class _Spy:
    def __init__(self):
        self.dtypes = []

    def __call__(self, q, k, v, *args, **kwargs):
        self.dtypes.append((q.dtype, k.dtype, v.dtype))
        return torch.zeros_like(q)


@pytest.mark.parametrize(
    "dtypes, autocast, expected",
    [
        ((torch.float32,) * 3, True, torch.bfloat16),  # fp32 states under autocast: the autocast dtype
        ((torch.float32, torch.float32, torch.bfloat16), False, torch.bfloat16),  # upcast norm next to bf16 values
        ((torch.float32,) * 3, False, torch.float32),  # a float32 model stays float32
    ],
    ids=["autocast", "mismatch", "fp32"],
)
def test_kernel_dtype(monkeypatch, dtypes, autocast, expected):
    """Which dtype reaches the kernels (the spy stands in for them: the interpreter's bf16 dot is not exact)."""
    spy = _Spy()
    monkeypatch.setattr(fp_hf._kernels, "flash_attn_func", spy)
    q, k, v = (torch.randn(2, 4, 8, 16, dtype=d) for d in dtypes)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, weights = fp_hf.fpatch_attention_forward(torch.nn.Linear(2, 2), q, k, v, None, scaling=0.25)
    assert spy.dtypes == [(expected,) * 3]
    assert out.shape == (2, 8, 4, 16) and out.dtype == expected and weights is None


def test_attention_dropout_trains_and_is_seeded():
    """Dropout 0.1 in train mode: finite, reproducible under one seed, and actually dropping (differs from eval)."""
    model = build("llama")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    flashpatch.patch_model(model.train())
    batch = padded_batch(encoder=False)

    def loss(seed):
        torch.manual_seed(seed)
        try:
            return model(**batch).loss
        except NotImplementedError as e:  # dropout lands with its own kernel issue
            pytest.skip(f"kernel dropout not available: {e}")

    first = loss(0)
    first.backward()
    assert torch.isfinite(first) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert torch.equal(first.detach(), loss(0).detach())
    model.eval()
    with torch.no_grad():
        no_dropout = model(**batch).loss
    assert not torch.equal(first.detach(), no_dropout)


@pytest.mark.parametrize("dense", [False, True], ids=["unpadded", "dense_when_right_padded"])
def test_padding_mask_written_in_place_is_read_again(dense, monkeypatch):
    """What a mask decides is derived once per mask tensor (every layer of a forward gets the same one): the
    unpadding layout, and whether the dense kernel may run over right padding. A mask changed in place between
    calls must not reuse it, nor must a new mask that lands at a freed one's address."""
    if not dense:
        monkeypatch.setattr(fp_hf, "dense_pairs_bound", lambda seqlen, headdim: 0.0)
    module = torch.nn.Linear(2, 2)
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))  # (B, H, S, D)
    mask = torch.ones(2, 8, dtype=torch.long)

    def check(mask_now):
        out, _ = fp_hf.fpatch_attention_forward(module, q, k, v, mask_now, scaling=0.25, is_causal=True)
        right_padded = bool((mask_now[:, 1:] <= mask_now[:, :-1]).all())
        for row in range(2):
            real = mask_now[row].bool()  # one run of real tokens per row
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[row : row + 1, :, real], k[row : row + 1, :, real], v[row : row + 1, :, real], is_causal=True,
                scale=0.25)
            torch.testing.assert_close(out[row, real], ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
            if not dense or not right_padded:  # unpadded: zeros at the padding (else what nothing reads)
                assert (out[row, ~real] == 0).all()

    check(mask)
    mask[0, 5:] = 0  # in place: same tensor, new version
    check(mask)
    mask[1, :2] = 0  # in place again: left padding in row 1, which the dense kernel must not run as it is
    check(mask)
    check(torch.tensor([[1] * 3 + [0] * 5, [1] * 8]))  # a new tensor


def test_dense_over_padding_takes_only_causal_rows_padded_on_the_right(monkeypatch):
    # fp_hf._dense_over_padding: the dense kernel runs a padded batch as it is only where no real query can see a
    # padded key (causal self-attention, every row's real tokens before its padding), and where the padding's extra
    # attention stays within dense_pairs_bound
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert fp_hf._dense_over_padding(right, 4, 4, causal=True, headdim=128)
    assert fp_hf._dense_over_padding(right.bool(), 4, 4, causal=True, headdim=128)
    # bidirectional (real queries see the pads), a KV cache's queries
    assert not fp_hf._dense_over_padding(right, 4, 4, causal=False, headdim=128)
    assert not fp_hf._dense_over_padding(right, 1, 4, causal=True, headdim=128)
    for refused in ([[0, 1, 1, 1], [1, 1, 1, 1]], [[1, 0, 1, 1], [1, 1, 1, 1]]):  # left padding, a hole
        assert not fp_hf._dense_over_padding(torch.tensor(refused), 4, 4, causal=True, headdim=128)
    nothing_real = torch.zeros(2, 4, dtype=torch.long)
    assert not fp_hf._dense_over_padding(nothing_real, 4, 4, causal=True, headdim=128)
    # rows of 4096 at head dim 128 (bound 1.325): a third row of 3000 real tokens gives the padded rows 1.18x the
    # real pairs, one of 2000 gives 1.34x; rows of 16 with 16 and 2 real tokens give 1.96x, under the 33.2 that
    # rows of 16 allow
    lengths = {"dense": [4096, 4096, 3000], "unpadded": [4096, 4096, 2000], "short rows": [16, 2]}
    masks = {name: (torch.arange(n[0])[None, :] < torch.tensor(n)[:, None]).long() for name, n in lengths.items()}
    assert fp_hf._dense_over_padding(masks["dense"], 4096, 4096, causal=True, headdim=128)
    assert not fp_hf._dense_over_padding(masks["unpadded"], 4096, 4096, causal=True, headdim=128)
    assert fp_hf._dense_over_padding(masks["short rows"], 16, 16, causal=True, headdim=128)
    # at head dim 64 the bound at 4096 is 1.45: the second batch runs dense too
    assert fp_hf._dense_over_padding(masks["unpadded"], 4096, 4096, causal=True, headdim=64)
    monkeypatch.setattr(fp_hf, "dense_pairs_bound", lambda seqlen, headdim: 1.1)
    assert not fp_hf._dense_over_padding(masks["dense"].clone(), 4096, 4096, causal=True, headdim=128)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"0/1 padding mask \(1 = real token\); got values \[0, 1, 2\]"):
        fp_hf._dense_over_padding(torch.tensor([[1, 2, 0, 0]]), 4, 4, causal=True, headdim=128)
