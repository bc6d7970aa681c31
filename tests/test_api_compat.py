"""flash-attn 2 drop-in: the public functions' signatures, the packed variants, and block_table, kept only for the
signature, which must fail loudly when used (ALiBi has its own tests, test_alibi.py)."""

import inspect

import pytest
import torch

import flashpatch
from flashpatch.padding import cu_seqlens_from_lengths

# flash-attn 2.8's parameter lists, in order: positional calls written for flash-attn must mean the same here.
COMMON_TAIL = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
               "return_attn_probs"]
FLASH_ATTN_SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", *COMMON_TAIL],
    "flash_attn_qkvpacked_func": ["qkv", *COMMON_TAIL],
    "flash_attn_kvpacked_func": ["q", "kv", *COMMON_TAIL],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                               *COMMON_TAIL, "block_table"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen", *COMMON_TAIL],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                        *COMMON_TAIL],
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_SIGNATURES))
def test_signature_matches_flash_attn(name):
    params = list(inspect.signature(getattr(flashpatch, name)).parameters)
    assert params == FLASH_ATTN_SIGNATURES[name]


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_qkvpacked_equals_separate_tensors():
    torch.manual_seed(0)
    qkv = torch.randn(2, 17, 3, 2, 16, requires_grad=True)  # (B, S, 3, H, D)
    out = flashpatch.flash_attn_qkvpacked_func(qkv, causal=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)

    q, k, v = _leaves(*qkv.unbind(dim=2))
    ref = flashpatch.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dqkv, torch.stack(grads, dim=2), rtol=1e-6, atol=1e-6)


def test_kvpacked_with_gqa_and_window_equals_separate_tensors():
    torch.manual_seed(1)
    q = torch.randn(1, 9, 4, 16, requires_grad=True)
    kv = torch.randn(1, 13, 2, 1, 16, requires_grad=True)  # (B, Sk, 2, Hk, D): MQA, Sq != Sk
    out = flashpatch.flash_attn_kvpacked_func(q, kv, window_size=(3, 1), softcap=2.0)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)

    q2, k2, v2 = _leaves(q, *kv.unbind(dim=2))
    ref = flashpatch.flash_attn_func(q2, k2, v2, window_size=(3, 1), softcap=2.0)
    dq2, dk2, dv2 = torch.autograd.grad(ref, (q2, k2, v2), dout)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dq, dq2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dkv, torch.stack((dk2, dv2), dim=2), rtol=1e-6, atol=1e-6)


def test_varlen_packed_variants_equal_separate_tensors():
    torch.manual_seed(2)
    lengths = [5, 1, 12]
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    qkv = torch.randn(sum(lengths), 3, 2, 16, requires_grad=True)  # (total, 3, H, D)
    out = flashpatch.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)

    q, k, v = _leaves(*qkv.unbind(dim=1))
    ref = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dqkv, torch.stack(grads, dim=1), rtol=1e-6, atol=1e-6)

    q3, kv = _leaves(qkv[:, 0], qkv[:, 1:])  # (total, H, D), (total, 2, H, D)
    out_kv = flashpatch.flash_attn_varlen_kvpacked_func(q3, kv, cu, cu, max(lengths), max(lengths), causal=True)
    torch.testing.assert_close(out_kv, ref, rtol=1e-6, atol=1e-6)


def test_positional_call_in_flash_attn_order():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    # q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    out, lse, pattern = flashpatch.flash_attn_func(q, k, v, 0.0, 0.5, True, (-1, -1), 0.0, None, True, True)
    out_kw, lse_kw, _ = flashpatch.flash_attn_func(q, k, v, softmax_scale=0.5, causal=True, deterministic=True,
                                                    return_attn_probs=True)
    assert pattern is None
    torch.testing.assert_close(out, out_kw, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_kw, rtol=0, atol=0)


def test_block_table_is_refused():
    q, k, v = (torch.randn(8, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"block_table \(got \(1, 1\)\)"):
        flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, block_table=torch.zeros(1, 1))


@pytest.mark.parametrize("fn, packed, error, match", [
    ("flash_attn_qkvpacked_func", torch.randn(1, 8, 2, 2, 16), ValueError, r"\(1, 8, 2, 2, 16\)"),  # 2 parts, not 3
    ("flash_attn_qkvpacked_func", torch.randn(8, 3, 2, 16), ValueError, r"\(batch, seqlen, 3, nheads, headdim\)"),
    ("flash_attn_varlen_qkvpacked_func", [1, 2, 3], TypeError, "qkv must be a torch.Tensor, got list"),
])
def test_bad_packed_input_names_the_shape(fn, packed, error, match):
    args = (torch.tensor([0, 8], dtype=torch.int32), 8) if "varlen" in fn else ()
    with pytest.raises(error, match=match):
        getattr(flashpatch, fn)(packed, *args)


def test_packed_function_compiles_fullgraph():
    torch.manual_seed(4)
    qkv = torch.randn(1, 8, 3, 2, 16, requires_grad=True)
    compiled = torch.compile(lambda t: flashpatch.flash_attn_qkvpacked_func(t, causal=True), fullgraph=True,
                             backend="aot_eager")
    out = compiled(qkv)
    torch.testing.assert_close(out, flashpatch.flash_attn_qkvpacked_func(qkv, causal=True), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
