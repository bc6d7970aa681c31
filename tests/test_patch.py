"""patch_model on tiny random transformers models: patched logits, loss and gradients against an exact float64 twin.

Accuracy rule (flash-attn's): on real tokens, flashpatch in float32 may be at most twice as far from the exact
float64 result as eager attention in float32 is, plus 4 float32 ulps of the largest value (for tensors where eager
happens to round exactly). Any bug in masking, windows, softcap, scaling or layout moves results by >= 1e-3, far
outside that band. The float64 twin runs `oracle_attention` (tests/_patch_models.py): eager semantics with a float64
softmax (eager itself softmaxes in float32 whatever the dtype, so it cannot be the oracle).
"""

from __future__ import annotations

import os

import pytest
import torch

import flashpatch
from flashpatch.integrations import transformers as fp_hf

from ._patch_models import DECODERS, ENCODERS, SEQ, VOCAB, as_float64, build, lora_qwen2

# These run CPU tensors through the Triton interpreter (float32 parity); on a CUDA machine conftest leaves it off.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-interpreter tests: run with TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= on a GPU machine",
)

EPS32 = torch.finfo(torch.float32).eps


def assert_as_accurate_as_eager(got, eager, exact, what: str) -> None:
    got, eager, exact = (t.detach().double() for t in (got, eager, exact))
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err_got = (got - exact).abs().max().item()
    err_eager = (eager - exact).abs().max().item()
    bound = 2 * err_eager + 4 * EPS32 * exact.abs().max().item()
    assert err_got <= bound, f"{what}: flashpatch error {err_got:.3e} > bound {bound:.3e} (eager error {err_eager:.3e})"


def padded_batch(encoder: bool, seed: int = 0, left: bool = True) -> dict:
    """Two rows of SEQ tokens: row 0 right-padded (11 real), row 1 left-padded (13 real), or with left=False
    right-padded too."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, 11:] = 0
    if left:
        mask[1, :3] = 0
    else:
        mask[1, 13:] = 0
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g).masked_fill(mask == 0, 0)
    if encoder:
        labels = ids.masked_fill(mask == 0, -100)
        return dict(input_ids=ids, attention_mask=mask, labels=labels)
    # A causal LM's loss at position t uses the logits at t - 1: drop targets whose predecessor is padding, so that
    # the loss only reads logits of real tokens (at padded positions eager and flashpatch output different garbage).
    prev_real = torch.cat([torch.zeros(2, 1, dtype=torch.long), mask[:, :-1]], 1)
    labels = ids.masked_fill((mask == 0) | (prev_real == 0), -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)


def forward_backward(model, batch: dict):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def compare_runs(name, got, eager, exact, real: torch.Tensor) -> None:
    (lg, Lg, gg), (le, Le, ge), (lx, Lx, gx) = got, eager, exact
    assert_as_accurate_as_eager(lg[real], le[real], lx[real], f"{name} logits")
    assert_as_accurate_as_eager(Lg, Le, Lx, f"{name} loss")
    assert gg.keys() == gx.keys(), f"{name}: parameters with gradients differ"
    scale = max(g.abs().max().item() for g in gx.values())
    for param in gx:
        if gx[param].abs().max().item() <= 1e-9 * scale:
            # Zero in exact arithmetic (key biases: softmax ignores a shift shared by all keys), so both float32
            # results are pure rounding noise and "2x eager's error" compares noise with noise. Require rounding
            # level instead: 4 ulps of the largest gradient of the same backward pass.
            noise = gg[param].abs().max().item()
            assert noise <= 4 * EPS32 * scale, f"{name} grad {param}: {noise:.2e}, exact gradient is 0"
            continue
        assert_as_accurate_as_eager(gg[param], ge[param], gx[param], f"{name} grad {param}")


@pytest.mark.parametrize("name", DECODERS + ENCODERS)
def test_padded_batch_matches_eager(name):
    """Right and left padding in one batch: logits on real tokens, loss and every parameter's gradient."""
    model = build(name)
    exact_model = as_float64(model)
    batch = padded_batch(name in ENCODERS)
    eager = forward_backward(model, batch)
    exact = forward_backward(exact_model, batch)

    flashpatch.patch_model(model)
    calls = fp_hf.CALLS[0]
    got = forward_backward(model, batch)
    assert fp_hf.CALLS[0] - calls >= model.config.num_hidden_layers, "the patched model did not run flashpatch"
    flashpatch.unpatch_model(model)
    compare_runs(name, got, eager, exact, batch["attention_mask"].bool())


@pytest.mark.parametrize("name", DECODERS)
def test_right_padded_batch_runs_dense_and_matches_eager(name, monkeypatch):
    """Causal rows padded only on the right run the dense kernel over their padding (fp_hf._dense_over_padding): the
    same logits on real tokens, loss and gradients as eager; the mixed batch above takes the unpadded path."""
    model = build(name)
    exact_model = as_float64(model)
    batch = padded_batch(encoder=False, left=False)
    eager = forward_backward(model, batch)
    exact = forward_backward(exact_model, batch)

    varlen = []
    real_padded = fp_hf._kernels.padded_attn_func
    monkeypatch.setattr(fp_hf._kernels, "padded_attn_func", lambda *a, **kw: varlen.append(1) or
                        real_padded(*a, **kw))
    flashpatch.patch_model(model)
    calls = fp_hf.CALLS[0]
    got = forward_backward(model, batch)
    assert fp_hf.CALLS[0] - calls >= model.config.num_hidden_layers, "the patched model did not run flashpatch"
    assert not varlen, "a right-padded causal batch was unpadded"
    forward_backward(model, padded_batch(encoder=False))
    assert varlen, "a left-padded batch did not take the unpadded path"
    flashpatch.unpatch_model(model)
    compare_runs(name, got, eager, exact, batch["attention_mask"].bool())


def packed_rows():
    """Two rows of SEQ tokens holding documents of lengths (5, 7, 4) and (9, 7), position_ids restarting at 0."""
    lengths = [[5, 7, 4], [9, 7]]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    return ids, position_ids, lengths


def per_document_logits(model, ids, lengths):
    """Each document run alone: the truth a packed row must reproduce."""
    rows = []
    for r, row in enumerate(lengths):
        start, docs = 0, []
        for n in row:
            docs.append(model(input_ids=ids[r : r + 1, start : start + n], use_cache=False).logits[0])
            start += n
        rows.append(torch.cat(docs))
    return torch.stack(rows).detach()


@pytest.mark.parametrize("name", DECODERS)
def test_packed_rows_match_separate_documents(name):
    """position_ids restarting at 0 mark documents; a packed row must equal its documents run one by one."""
    model = build(name)
    exact_model = as_float64(model)
    ids, position_ids, lengths = packed_rows()
    with torch.no_grad():
        eager_alone = per_document_logits(model, ids, lengths)
        exact_alone = per_document_logits(exact_model, ids, lengths)
        flashpatch.patch_model(model)
        packed = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        flashpatch.unpatch_model(model)
    assert_as_accurate_as_eager(packed, eager_alone, exact_alone, f"{name} packed logits")


@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_data_collator_with_flattening(name, flash_kwargs):
    """DataCollatorWithFlattening batches (one row, documents back to back), with and without cu_seq_lens_* kwargs:
    loss and gradients against eager on the same batch (eager masks documents from position_ids)."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(2)
    features = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in (6, 3, 7)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features, return_tensors="pt")
    if flash_kwargs:
        assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= batch.keys()
    batch = dict(batch, use_cache=False)
    model = build(name)
    exact_model = as_float64(model)
    eager = forward_backward(model, batch)
    exact = forward_backward(exact_model, batch)
    flashpatch.patch_model(model)
    got = forward_backward(model, batch)
    flashpatch.unpatch_model(model)
    compare_runs(name, got, eager, exact, torch.ones_like(batch["input_ids"], dtype=torch.bool))


def test_gradient_checkpointing():
    model = build("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    exact_model = as_float64(model)
    batch = padded_batch(encoder=False)
    eager, exact = forward_backward(model, batch), forward_backward(exact_model, batch)
    flashpatch.patch_model(model)
    assert model.is_gradient_checkpointing
    got = forward_backward(model, batch)
    flashpatch.unpatch_model(model)
    compare_runs("llama+checkpointing", got, eager, exact, batch["attention_mask"].bool())


def test_peft_lora():
    peft = pytest.importorskip("peft", reason="peft is not installed (optional: pip install peft)")
    model = lora_qwen2(peft)
    base = model.get_base_model()
    exact_model = as_float64(model)
    batch = padded_batch(encoder=False)
    eager, exact = forward_backward(model, batch), forward_backward(exact_model, batch)
    assert all("lora_" in n for n in eager[2]), "only the adapters should be trainable"
    flashpatch.patch_model(model)
    assert base.config._attn_implementation == flashpatch.ATTN_IMPLEMENTATION
    got = forward_backward(model, batch)
    flashpatch.unpatch_model(model)
    assert base.config._attn_implementation == "eager"
    compare_runs("qwen2+lora", got, eager, exact, batch["attention_mask"].bool())


def test_kv_cache_decoding_with_left_padding():
    """Prefill a left-padded batch, then decode two tokens one at a time (q_len 1 < kv_len): logits match eager."""
    model = build("mistral")  # sliding window 4 < the 13 cached tokens: the window matters while decoding
    batch = padded_batch(encoder=False)
    ids, mask = batch["input_ids"][1:].repeat(2, 1), batch["attention_mask"][1:].repeat(2, 1)
    mask[0, :5] = 0  # two left-padded rows of different lengths
    steps = torch.tensor([[7, 9], [11, 5]])

    def decode(m):
        out = m(input_ids=ids, attention_mask=mask, use_cache=True)
        cache, logits, am = out.past_key_values, [out.logits[:, -1]], mask
        for t in range(steps.shape[1]):
            am = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
            out = m(input_ids=steps[:, t : t + 1], attention_mask=am, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[:, -1])
        return torch.stack(logits, 1).detach()

    with torch.no_grad():
        exact, eager = decode(as_float64(model)), decode(model)
        flashpatch.patch_model(model)
        got = decode(model)
        flashpatch.unpatch_model(model)
    assert_as_accurate_as_eager(got, eager, exact, "decode logits")


def compile_batches(layout: str) -> list[dict]:
    """Two batches of one layout and shape, composed differently: dense rows; padded rows (a 2-D mask) with other
    real lengths; packed rows (position_ids) with other documents."""
    first = padded_batch(False, 0)
    if layout == "dense":
        return [dict(input_ids=ids, labels=ids, use_cache=False)
                for ids in (first["input_ids"], padded_batch(False, 1)["input_ids"])]
    if layout == "padded":
        second = {name: value.flip(1) if torch.is_tensor(value) else value  # left padding first, then right
                  for name, value in padded_batch(False, 1).items()}
        mask = second["attention_mask"]
        prev_real = torch.cat([torch.zeros(2, 1, dtype=torch.long), mask[:, :-1]], 1)
        second["labels"] = second["input_ids"].masked_fill((mask == 0) | (prev_real == 0), -100)  # as padded_batch
        return [first, second]
    ids, first_positions, _ = packed_rows()
    second_positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ([3, 10, 3], [16])])
    return [dict(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
            for positions in (first_positions, second_positions)]


@pytest.mark.parametrize("layout", ["dense", "padded", "packed"])
def test_compiled_model_compiles_once_and_matches_eager(layout):
    """torch.compile of a patched model (what Trainer's torch_compile=True does): the first step compiles, later
    steps of the same shapes compile nothing (state the attention function changed per call would be a guard, and
    every layer's call a recompile: 4x slower training on a GPU), and loss and gradients equal the eager model's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = flashpatch.patch_model(build("llama"))
    batches = compile_batches(layout)
    eager = [forward_backward(model, batch) for batch in batches]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    frames = []
    for batch, (_, loss_e, grads_e) in zip(batches, eager):
        _, loss_c, grads_c = forward_backward(compiled, batch)
        grads_c = {name.removeprefix("_orig_mod."): grad for name, grad in grads_c.items()}
        frames.append(counters["frames"]["total"])
        torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=0)
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads_c[name], grad, rtol=0, atol=0, msg=name)
    assert frames[1] == frames[0], f"the second step compiled {frames[1] - frames[0]} more frames"
    torch._dynamo.reset()
