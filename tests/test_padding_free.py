"""patch_model(model, padding_free=True): padded batches run as one packed row of real tokens, end to end.

Against eager on the same padded batch (tiny random float32 models on CPU, Triton interpreter): logits at real
positions, loss and every parameter's gradient, within test_patch's bar (at most 2x eager's float32 error against a
float64 twin with exact attention, plus 4 ulps); and that the layers really saw only the real tokens.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
import transformers as tf

import flashpatch
from flashpatch.integrations import hf_padding_free as pf
from flashpatch.integrations import transformers as fp_hf

from ._patch_models import DECODERS, ENCODERS, SEQ, VOCAB, as_float64, build, lora_qwen2
from .test_patch import compare_runs, forward_backward

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-interpreter tests: run with TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= on a GPU machine",
)

PACKABLE = [n for n in DECODERS if n not in pf.REFUSED] + ENCODERS
LENGTHS = (SEQ, 11, 1, 6)  # a full row, a row of one token


def batch_of(lengths, side: str, encoder: bool = False, seed: int = 0) -> dict:
    """Rows of SEQ tokens with `lengths` real ones, padded on `side`. Labels: the tokens, -100 at pads; for a causal
    LM also -100 where the predecessor is a pad (that target's logits sit at a pad: no packed row has them)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lengths), SEQ, dtype=torch.long)
    for row, n in enumerate(lengths):
        if n:
            mask[row, :n] = 1
    if side == "left":
        mask = mask.flip(1)
    ids = torch.randint(3, VOCAB, mask.shape, generator=g).masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    if encoder:
        return dict(input_ids=ids, attention_mask=mask, labels=labels)
    prev_real = torch.cat([torch.zeros(len(lengths), 1, dtype=torch.long), mask[:, :-1]], 1)
    return dict(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(prev_real == 0, -100), use_cache=False)


def varlen_calls(model, batch) -> int:
    before = fp_hf.VARLEN_CALLS[0]
    model(**batch)
    return fp_hf.VARLEN_CALLS[0] - before


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", PACKABLE)
def test_matches_eager_on_the_padded_batch(name, side):
    """Logits at real positions, loss and every gradient; zeros at pads; the attention got the rows as documents."""
    model = build(name)
    exact_model = as_float64(model)
    batch = batch_of(LENGTHS, side, encoder=name in ENCODERS)
    eager = forward_backward(model, batch)
    exact = forward_backward(exact_model, batch)
    flashpatch.patch_model(model, padding_free=True)
    before = fp_hf.VARLEN_CALLS[0]
    got = forward_backward(model, batch)
    assert fp_hf.VARLEN_CALLS[0] - before == model.config.num_hidden_layers, "the forward did not run packed"
    flashpatch.unpatch_model(model)
    real = batch["attention_mask"].bool()
    assert got[0].shape == eager[0].shape
    assert (got[0][~real] == 0).all(), "padded positions should come back as zeros"
    compare_runs(f"{name} {side}", got, eager, exact, real)


def _count_linear_tokens(model):
    """Forward hooks on every nn.Linear: the number of tokens each call saw."""
    seen, handles = [], []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[:-1].numel())))
    return seen, handles


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_every_layer_and_the_head_see_only_real_tokens(name):
    model = flashpatch.patch_model(build(name), padding_free=True)
    batch = batch_of(LENGTHS, "right", encoder=name in ENCODERS)
    seen, handles = _count_linear_tokens(model)
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    gpt2_conv1d = name == "gpt2"  # GPT-2's projections are Conv1D, not Linear: only the LM head is counted
    assert len(seen) >= (1 if gpt2_conv1d else 2 * model.config.num_hidden_layers)
    assert set(seen) == {sum(LENGTHS)}, f"tokens per call: {sorted(set(seen))}, real tokens: {sum(LENGTHS)}"
    if gpt2_conv1d:
        mlp_seen = []
        hooks = [m.register_forward_hook(lambda m, a, o: mlp_seen.append(a[0].shape[:-1].numel()))
                 for m in model.modules() if type(m).__name__ == "GPT2MLP"]
        with torch.no_grad():
            model(**batch)
        assert mlp_seen and set(mlp_seen) == {sum(LENGTHS)}
        for h in hooks:
            h.remove()


def test_rows_without_real_tokens_and_batches_of_pads():
    model = build("llama")
    exact_model = as_float64(model)
    batch = batch_of((0, 1, 5, SEQ, 0), "right")
    eager, exact = forward_backward(model, batch), forward_backward(exact_model, batch)
    flashpatch.patch_model(model, padding_free=True)
    got = forward_backward(model, batch)
    assert (got[0][:1] == 0).all() and (got[0][4:] == 0).all()
    compare_runs("llama empty rows", got, eager, exact, batch["attention_mask"].bool())
    # nothing real at all: nothing to pack, the forward runs as without padding_free
    empty = dict(batch, attention_mask=torch.zeros_like(batch["attention_mask"]), labels=None)
    assert varlen_calls(model, empty) == 0


def test_ignored_labels_and_num_items_in_batch():
    """-100 inside real rows, and the sum / num_items_in_batch path Trainer takes, against transformers' own
    ForCausalLMLoss on eager's padded logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = build("qwen2")
    batch = batch_of(LENGTHS, "right", seed=3)
    labels = batch["labels"].clone()
    labels[0, 2:7] = -100
    labels[1, 4] = -100
    batch["labels"] = labels
    items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 5)  # e.g. counted over several micro-batches
    with torch.no_grad():
        eager = model(**batch, num_items_in_batch=items)
        reference = ForCausalLMLoss(eager.logits, labels, VOCAB, num_items_in_batch=items)
        flashpatch.patch_model(model, padding_free=True)
        got = model(**batch, num_items_in_batch=items)
        mean = model(**batch).loss
    torch.testing.assert_close(eager.loss, reference)
    torch.testing.assert_close(got.loss, eager.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(mean, ForCausalLMLoss(eager.logits, labels, VOCAB), rtol=1e-6, atol=0)


def test_targets_never_cross_rows():
    """A right-padded row's last real token predicting a label on its first pad (pad = EOS, labels not masked) is a
    real target: kept, including at the packed row's very end, and no row's first token becomes the previous row's
    target."""
    model = build("llama")
    batch = batch_of((11, SEQ, 6), "right", seed=4)
    labels = batch["labels"].clone()
    labels[0, 11] = 2  # EOS after row 0's last token
    labels[2, 6] = 2  # and after the last row's: the packed row's last target
    batch["labels"] = labels
    with torch.no_grad():
        eager = model(**batch).loss
        flashpatch.patch_model(model, padding_free=True)
        got = model(**batch).loss
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=0)


def test_targets_predicted_from_pads_are_left_out_with_a_warning(caplog):
    """Left padding with labels on every real token: the first one's target sits at a pad position. Eager computes it
    from that pad's meaningless output; padding-free has no such position, leaves it out and says so."""
    model = build("llama")
    batch = batch_of(LENGTHS, "left", seed=5)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    prev_real = torch.cat([torch.zeros(len(LENGTHS), 1, dtype=torch.long), batch["attention_mask"][:, :-1]], 1)
    with torch.no_grad():
        eager_without = model(**dict(batch, labels=batch["labels"].masked_fill(prev_real == 0, -100))).loss
        flashpatch.patch_model(model, padding_free=True)
        fp_hf._warned.discard("pf-dropped")
        with caplog.at_level(logging.WARNING, logger="flashpatch"):
            got = model(**batch).loss
    assert any("3 target(s)" in r.getMessage() for r in caplog.records)  # the three rows that do have padding
    torch.testing.assert_close(got, eager_without, rtol=1e-6, atol=0)


def test_position_ids_given_are_kept():
    """Positions counted from the first real token (what generation and some collators pass) instead of arange."""
    model = build("mistral")
    batch = batch_of(LENGTHS, "left", seed=6)
    batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        eager = model(**batch)
        flashpatch.patch_model(model, padding_free=True)
        got = model(**batch)
    torch.testing.assert_close(got.logits[real], eager.logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, eager.loss, rtol=1e-6, atol=0)


def test_outputs_tuple_hidden_states_and_router_logits():
    """return_dict=False, output_hidden_states and Mixtral's router logits / load-balancing loss in the padded
    layout, equal to eager's at real tokens."""
    model = build("mixtral")
    batch = batch_of(LENGTHS, "right", seed=7)
    real = batch["attention_mask"].bool()
    kwargs = dict(output_hidden_states=True, output_router_logits=True)
    with torch.no_grad():
        eager = model(**batch, **kwargs)
        flashpatch.patch_model(model, padding_free=True)
        got = model(**batch, **kwargs)
        as_tuple = model(**batch, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[1], got.logits)
    torch.testing.assert_close(got.loss, eager.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.aux_loss, eager.aux_loss, rtol=1e-6, atol=0)
    assert len(got.hidden_states) == len(eager.hidden_states)
    for g, e in zip(got.hidden_states, eager.hidden_states):
        assert g.shape == e.shape
        torch.testing.assert_close(g[real], e[real], rtol=1e-5, atol=1e-5)
    for g, e in zip(got.router_logits, eager.router_logits):
        assert g.shape == e.shape
        torch.testing.assert_close(g[real.flatten()], e[real.flatten()], rtol=1e-5, atol=1e-5)


def test_inputs_embeds_and_token_type_ids():
    model = build("bert")
    batch = batch_of(LENGTHS, "right", encoder=True, seed=8)
    embeds = model.get_input_embeddings()(batch.pop("input_ids"))
    batch.update(inputs_embeds=embeds, token_type_ids=(torch.arange(SEQ) >= 5).long().expand(len(LENGTHS), -1))
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        eager = model(**batch)
        flashpatch.patch_model(model, padding_free=True)
        assert varlen_calls(model, batch) == model.config.num_hidden_layers
        got = model(**batch)
    torch.testing.assert_close(got.logits[real], eager.logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, eager.loss, rtol=1e-6, atol=0)


def test_base_model_without_head():
    model = build("llama").model  # LlamaModel: last_hidden_state per token
    batch = batch_of(LENGTHS, "left", seed=9)
    batch.pop("labels")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        eager = model(**batch).last_hidden_state
        flashpatch.patch_model(model, padding_free=True)
        got = model(**batch).last_hidden_state
    assert got.shape == eager.shape and (got[~real] == 0).all()
    torch.testing.assert_close(got[real], eager[real], rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing():
    model = build("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    exact_model = as_float64(model)
    batch = batch_of(LENGTHS, "right", seed=10)
    batch.pop("use_cache")  # training mode: the config's use_cache=True is not a cache request
    eager, exact = forward_backward(model, batch), forward_backward(exact_model, batch)
    flashpatch.patch_model(model, padding_free=True)
    assert varlen_calls(model, batch) == model.config.num_hidden_layers
    got = forward_backward(model, batch)
    compare_runs("llama+checkpointing", got, eager, exact, batch["attention_mask"].bool())


def test_peft_lora():
    peft = pytest.importorskip("peft", reason="peft is not installed (optional: pip install peft)")
    model = lora_qwen2(peft)
    base = model.get_base_model()
    exact_model = as_float64(model)
    batch = batch_of(LENGTHS, "left", seed=11)
    eager, exact = forward_backward(model, batch), forward_backward(exact_model, batch)
    flashpatch.patch_model(model, padding_free=True)
    assert varlen_calls(model, batch) == base.config.num_hidden_layers
    got = forward_backward(model, batch)
    flashpatch.unpatch_model(model)
    assert "forward" not in base.__dict__
    compare_runs("qwen2+lora padding-free", got, eager, exact, batch["attention_mask"].bool())


def tiny_tokenizer(padding_side: str):
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                     pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.padding_side = padding_side
    return tok


def trainer_losses(model, tmp_path, padding_side: str, steps: int = 4) -> list[float]:
    g = torch.Generator().manual_seed(12)
    lengths = torch.randint(2, SEQ + 1, (4 * steps,), generator=g).tolist()
    data = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    args = tf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps,
                                learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                dataloader_num_workers=0, seed=0, disable_tqdm=True)
    collator = tf.DataCollatorForLanguageModeling(tiny_tokenizer(padding_side), mlm=False)
    trainer = tf.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_with_its_padding_collator_trains_like_eager(tmp_path):
    """HF Trainer, DataCollatorForLanguageModeling(mlm=False) on right-padded rows: per-step loss as eager's run."""
    base = build("llama")
    eager = trainer_losses(copy.deepcopy(base).train(), tmp_path / "eager", "right")
    model = flashpatch.patch_model(copy.deepcopy(base).train(), padding_free=True)
    before = fp_hf.VARLEN_CALLS[0]
    got = trainer_losses(model, tmp_path / "pf", "right")
    assert fp_hf.VARLEN_CALLS[0] > before, "Trainer's batches did not run packed"
    assert len(got) == len(eager) == 4 and all(torch.isfinite(torch.tensor(got)))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(eager), rtol=2e-5, atol=0)


def test_generation_kv_cache_and_unpadded_batches_run_as_before():
    """generate (left padding, KV cache), a prefill asking for a cache, and a batch without padding: no packing,
    and exactly what patch_model without padding_free computes."""
    model = build("llama")
    batch = batch_of((SEQ, 9, 12), "left", seed=13)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    gen = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)

    def run(m):
        with torch.no_grad():
            before = fp_hf.VARLEN_CALLS[0]
            tokens = m.generate(ids, **gen)
            prefill = m(input_ids=ids, attention_mask=mask, use_cache=True)
            dense = m(input_ids=ids, labels=ids, use_cache=False)
            return fp_hf.VARLEN_CALLS[0] - before, tokens, prefill.logits, prefill.past_key_values, dense.loss

    flashpatch.patch_model(model)
    plain = run(model)
    flashpatch.unpatch_model(model)
    flashpatch.patch_model(model, padding_free=True)
    got = run(model)
    assert got[0] == plain[0] == 0
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2]) and torch.equal(got[4], plain[4])
    assert got[3] is not None and got[3].get_seq_length() == SEQ


def test_unpatch_restores_and_copies_stay_independent():
    model = build("llama")
    batch = batch_of(LENGTHS, "right", seed=14)
    with torch.no_grad():
        before = model(**batch).logits
        flashpatch.patch_model(model, padding_free=True)
        twin = copy.deepcopy(model)
        assert twin.forward.__self__ is twin, "a deep copy must run its own weights"
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)
        assert not torch.equal(twin(**batch).logits, model(**batch).logits)
        with pytest.raises(ValueError, match="padding_free"):
            flashpatch.patch_model(model)
        flashpatch.patch_model(model, padding_free=True)  # idempotent
        flashpatch.unpatch_model(model)
        after = model(**batch).logits
    assert "forward" not in model.__dict__ and not any(k.startswith("_flashpatch") for k in model.__dict__)
    assert model.config._attn_implementation == "eager"
    assert torch.equal(before, after)


def test_a_wrapper_installed_after_patching_keeps_working():
    """accelerate.prepare wraps model.forward (autocast, fp32 outputs) over ours: unpatching leaves ours inside as a
    pass-through, and patching again switches it back on."""
    from accelerate.utils import convert_outputs_to_fp32

    model = build("llama")
    batch = batch_of(LENGTHS, "right", seed=15)
    flashpatch.patch_model(model, padding_free=True)
    model.forward = convert_outputs_to_fp32(model.forward)  # what accelerate does, minus autocast
    assert varlen_calls(model, batch) == 2
    flashpatch.unpatch_model(model)
    assert varlen_calls(model, batch) == 0
    flashpatch.patch_model(model, padding_free=True)
    assert varlen_calls(model, batch) == 2


SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: build("stablelm"), "do not pass keyword arguments"),
        (lambda: tf.AutoModelForCausalLM.from_config(tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1,
                                                                  num_attention_heads=4, ffn_dim=96,
                                                                  word_embed_proj_dim=64)), "not verified"),
        (lambda: tf.LlamaForSequenceClassification(tf.LlamaConfig(**SMALL, pad_token_id=0)), "pools or picks"),
        (lambda: tf.BertModel(tf.BertConfig(**SMALL)), "pools or picks"),
    ],
    ids=["stablelm", "opt", "llama-seq-cls", "bert-pooler"],
)
def test_models_it_cannot_run_are_refused_at_patch_time(make, match):
    model = make()
    before = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match=match):
        flashpatch.patch_model(model, padding_free=True)
    assert model.config._attn_implementation == before and "forward" not in model.__dict__


def test_attention_switched_away_after_patching_is_an_error():
    """Packed rows attended by an implementation that does not read cu_seq_lens would leak across rows: refused."""
    model = flashpatch.patch_model(build("llama"), padding_free=True)
    model.config._attn_implementation_internal = "sdpa"
    with pytest.raises(RuntimeError, match="cu_seq_lens"):
        model(**batch_of(LENGTHS, "right"))


def test_torch_compile_matches_eager_and_settles():
    """torch.compile of a padding-free model: loss and gradients bit-equal to the same model run eagerly; the packed
    row's length changes every batch, so the second batch recompiles once (dynamic from then on), the third not."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = flashpatch.patch_model(build("llama"), padding_free=True)
    batches = [batch_of(LENGTHS, "right"), batch_of((SEQ, 3, 9, 12), "left", seed=16), batch_of((5, 7, 2, 13), "right", seed=17)]
    eager = [forward_backward(model, batch) for batch in batches]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    frames = []
    for batch, (_, loss_e, grads_e) in zip(batches, eager):
        _, loss_c, grads_c = forward_backward(compiled, batch)
        frames.append(counters["frames"]["total"])
        torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=0)
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads_c["_orig_mod." + name], grad, rtol=0, atol=0, msg=name)
    assert frames[2] == frames[1], f"the third batch compiled {frames[2] - frames[1]} more frames"
    torch._dynamo.reset()


def test_train_recipe_runs_padding_free(tmp_path):
    """recipes/train.py on the tiny config, padded batches: sdpa and fpatch_pf on them as they are, fpatch on them
    hand-flattened (data_mode unpadded). Same init, same batches, same tokens in the loss: the same losses."""
    import sys
    from pathlib import Path

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    sys.path.insert(0, str(recipes))
    try:
        import train
    finally:
        sys.path.remove(str(recipes))
    before = fp_hf.VARLEN_CALLS[0]
    args = ["--config", str(recipes.parent / "configs" / "tiny_cpu.yaml"), "--data_mode", "unpadded",
            "--seq_len", "32", "--batch_size", "3", "--warmup_steps", "0", "--hidden_size", "32", "--num_heads", "2",
            "--num_kv_heads", "1", "--intermediate_size", "64", "--corpus_max_bytes", "200000",
            "--corpus_max_file_bytes", "40", "--plots", "false"]
    out = train.main([*args, "--implementations", "sdpa,fpatch,fpatch_pf", "--steps", "2",
                      "--output_dir", str(tmp_path / "plain")])
    rows = {r["implementation"]: r for r in out["results"]}
    for impl, row in rows.items():
        assert row["status"] == "ok", row
        assert len(row["losses"]) == 2 and row["real_tokens"] == rows["sdpa"]["real_tokens"]
    assert rows["fpatch_pf"]["attn_implementation"] == "fpatch"
    assert rows["sdpa"]["padding_fraction"] > 0.05, "the batches should carry padding"
    assert fp_hf.VARLEN_CALLS[0] - before == 2 * 2 * 2, "fpatch and fpatch_pf: 2 steps of 2 layers each, packed"
    for impl in ("fpatch", "fpatch_pf"):
        torch.testing.assert_close(torch.tensor(rows[impl]["losses"]), torch.tensor(rows["sdpa"]["losses"]),
                                   rtol=1e-5, atol=0)

    # --rounds: one model, the implementations in turns; fpatch_pf switches padding_free on for its turns only
    before = fp_hf.VARLEN_CALLS[0]
    out = train.main([*args, "--implementations", "sdpa,fpatch_pf,fpatch", "--rounds", "2", "--steps", "1",
                      "--output_dir", str(tmp_path / "rounds")])
    assert all(r["status"] == "ok" for r in out["results"]), out["results"]
    assert fp_hf.VARLEN_CALLS[0] - before == 2 * 2 * 2  # fpatch and fpatch_pf, 2 rounds x 1 step x 2 layers
