"""Arguments that code written for flash-attn 2 passes: window_size in any pair form, a right window under causal,
any head dim from 1 to 256, unpad_input's unused_mask, return_attn_probs' layout."""

import numpy as np
import pytest
import torch

import flashpatch
from flashpatch.reference import attention_reference, varlen_attention_reference
from tests.helpers import check_against_reference, random_qkv


@pytest.mark.parametrize("window", [[5, 2], torch.tensor([5, 2]), torch.tensor([5, 2], dtype=torch.int32),
                                    (torch.tensor(5), torch.tensor(2)), (np.int64(5), np.int32(2))],
                         ids=["list", "tensor-int64", "tensor-int32", "tuple-of-scalars", "numpy-ints"])
def test_window_size_forms_equal_the_tuple(window):
    q, k, v = random_qkv(1, 17, 23, 2, 1, 16, torch.float32, requires_grad=False)
    expected = flashpatch.flash_attn_func(q, k, v, window_size=(5, 2))
    assert torch.equal(flashpatch.flash_attn_func(q, k, v, window_size=window), expected)


@pytest.mark.parametrize("right", [0, 3, -1])
def test_causal_clamps_the_right_window_to_zero(right):
    q, k, v = random_qkv(1, 17, 30, 2, 2, 16, torch.float32)
    out = flashpatch.flash_attn_func(q, k, v, causal=True, window_size=(4, right))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    same = flashpatch.flash_attn_func(q, k, v, causal=True, window_size=(4, 0))
    assert torch.equal(out, same)
    check_against_reference(out, grads, q, k, v, dout, window_size=(4, 0))


# Head dims that are not multiples of 8 (and the smallest ones), odd lengths, GQA, Sq != Sk, rows that see no key
# (causal with seqlen_q > seqlen_k), dense and varlen, with and without dropout.
ODD_HEADDIMS = [
    (1, 1, 1, 1, 1, 1, {}),
    (2, 17, 17, 2, 1, 3, {"causal": True}),
    (1, 23, 17, 4, 2, 17, {"causal": True}),
    (1, 17, 40, 3, 1, 59, {"window_size": (9, 3)}),
    (1, 40, 17, 2, 2, 111, {"softcap": 4.0}),
    (1, 9, 11, 2, 1, 255, {"causal": True}),
]


@pytest.mark.parametrize("case", ODD_HEADDIMS, ids=lambda c: f"q{c[1]}-k{c[2]}-h{c[3]}:{c[4]}-d{c[5]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_any_headdim_matches_float64(case, dtype):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, kwargs = case
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    out = flashpatch.flash_attn_func(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


@pytest.mark.parametrize("headdim", [5, 59])
def test_any_headdim_with_dropout_matches_the_kernels_mask(headdim):
    p = 0.17
    q, k, v = random_qkv(2, 23, 17, 2, 1, headdim, torch.float32)
    out, _, pattern = flashpatch.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, causal=True, dropout_p=p, dropout_keep=pattern > 0)


@pytest.mark.parametrize("headdim, dropout_p", [(7, 0.0), (59, 0.0), (37, 0.2)])
def test_any_headdim_varlen_matches_float64(headdim, dropout_p):
    lengths = [1, 17, 0, 9]
    cu = torch.tensor([0, 1, 18, 18, 27], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), h, headdim).requires_grad_() for h in (4, 2, 2))
    out, _, pattern = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                        dropout_p=dropout_p, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    extra = {"dropout_p": dropout_p, "dropout_keep": pattern > 0} if dropout_p else {}
    check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference, ref_args=(cu, cu),
                            causal=True, **extra)


def test_return_attn_probs_layout():
    q, k, v = random_qkv(2, 13, 19, 4, 2, 16, torch.float32, requires_grad=False)
    out, lse, s_dmask = flashpatch.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    _, lse64 = attention_reference(q.double(), k.double(), v.double(), causal=True, upcast=False)
    assert lse.shape == (2, 4, 13) and lse.dtype == torch.float32  # (batch, nheads, seqlen_q), as flash-attn
    torch.testing.assert_close(lse.double(), lse64.double(), rtol=1e-5, atol=1e-5)
    assert s_dmask is None  # flash-attn returns no mask without dropout
    out_d, lse_d, s_dmask = flashpatch.flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 13, 19)

    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    qv, kv_, vv = (t[0, :13] for t in (q, k, v))
    _, lse_v, _ = flashpatch.flash_attn_varlen_func(qv, kv_, vv, cu, cu, 8, 8, return_attn_probs=True)
    assert lse_v.shape == (4, 13)  # (nheads, total_q), as flash-attn's varlen


@pytest.mark.parametrize("side", ["right", "left"])
def test_unpad_input_with_unused_mask(side):
    batch, seqlen = 3, 7
    hidden = torch.randn(batch, seqlen, 5)
    lengths = torch.tensor([7, 3, 0])
    used = torch.arange(seqlen)[None, :] < lengths[:, None]  # (B, S)
    unused = (torch.arange(seqlen)[None, :] >= lengths[:, None]) & (torch.arange(seqlen)[None, :] < lengths[:, None] + 2)
    if side == "left":
        used, unused = used.flip(1), unused.flip(1)
    unpadded, indices, cu_seqlens, max_seqlen, seqused = flashpatch.unpad_input(hidden, used.int(), unused.int())
    kept = used | unused
    assert torch.equal(unpadded, hidden[kept])
    assert torch.equal(indices, kept.flatten().nonzero().flatten())
    assert cu_seqlens.tolist() == [0, 7, 12, 14] and cu_seqlens.dtype == torch.int32
    assert max_seqlen == 7
    assert seqused.tolist() == [7, 3, 0] and seqused.dtype == torch.int32
    # without unused_mask: flash-attn's four-argument call, seqused the real lengths
    unpadded, _, cu_seqlens, max_seqlen, seqused = flashpatch.unpad_input(hidden, used)
    assert torch.equal(unpadded, hidden[used]) and cu_seqlens.tolist() == [0, 7, 10, 10]
    assert seqused.tolist() == [7, 3, 0]
    with pytest.raises(ValueError, match=r"unused_mask must be a tensor shaped like attention_mask \(3, 7\)"):
        flashpatch.unpad_input(hidden, used, unused[:, :3])
