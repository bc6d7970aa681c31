"""ALiBi (alibi_slopes): the kernels against the float64 reference, with every other feature, and its validation."""

import pytest
import torch

import flashpatch
from flashpatch.kernels import options as kernel_options
from flashpatch.padding import cu_seqlens_from_lengths
from flashpatch.reference import varlen_attention_reference
from tests.helpers import check_against_reference, random_qkv


def _slopes(batch, nheads, per_sequence):
    # ALiBi's geometric slopes (2^-8/H, 2^-16/H, ...) are too gentle to show at these lengths; random ones in
    # [0.05, 1.05) make the bias move every row's softmax
    return torch.rand(batch, nheads) + 0.05 if per_sequence else torch.rand(nheads) + 0.05


@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, per_sequence, kwargs",
    [
        (2, 17, 17, 4, 2, 32, torch.float32, False, {"causal": True}),  # GQA
        (2, 9, 23, 4, 1, 16, torch.float32, True, {}),  # MQA, Sq < Sk, one slope row per sequence
        (1, 33, 20, 2, 2, 40, torch.float16, False, {"causal": True}),  # Sq > Sk: early rows see no key
        (1, 31, 31, 2, 1, 16, torch.float16, True, {"window_size": (5, 3), "softcap": 2.0}),
        (1, 1, 113, 2, 2, 16, torch.float32, False, {"causal": True}),  # one query, the bias spans 112 positions
    ],
)
def test_alibi_matches_reference(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, per_sequence, kwargs):
    torch.manual_seed(seqlen_q * 7 + seqlen_k)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    slopes = _slopes(batch, nheads, per_sequence)
    out, lse, _ = flashpatch.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    lse64 = check_against_reference(out, grads, q, k, v, dout, alibi_slopes=slopes, **kwargs)
    torch.testing.assert_close(lse, lse64, rtol=1e-3, atol=1e-3)
    if seqlen_q > seqlen_k and kwargs.get("causal"):
        assert (out[:, : seqlen_q - seqlen_k] == 0).all()  # rows that see no key stay zero under the bias


def test_alibi_changes_the_output_and_zero_slopes_change_nothing():
    torch.manual_seed(5)
    q, k, v = random_qkv(1, 16, 16, 2, 2, 16, torch.float32, requires_grad=False)
    plain = flashpatch.flash_attn_func(q, k, v, causal=True)
    zero = flashpatch.flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.zeros(2))
    biased = flashpatch.flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.ones(2))
    torch.testing.assert_close(zero, plain, rtol=0, atol=0)
    assert (biased - plain).abs().max() > 0.1


@pytest.mark.parametrize("atomic_dq", [False, True])
def test_alibi_with_dropout_and_either_dq_path(atomic_dq):
    torch.manual_seed(6)
    p = 0.2
    q, k, v = random_qkv(2, 24, 24, 2, 2, 32, torch.float32)
    slopes = _slopes(2, 2, per_sequence=True)
    with kernel_options.override(atomic_dq=atomic_dq):  # atomic dQ: the dK/dV kernel also sums dQ
        out, _, pattern = flashpatch.flash_attn_func(q, k, v, dropout_p=p, causal=True, alibi_slopes=slopes,
                                                     return_attn_probs=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, causal=True, alibi_slopes=slopes, dropout_p=p,
                            dropout_keep=pattern > 0)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_varlen_alibi_is_per_sequence_and_bottom_right(per_sequence):
    torch.manual_seed(7)
    lengths_q, lengths_k = [17, 0, 1, 30], [20, 3, 1, 30]
    nheads, nheads_k, headdim = 4, 2, 16
    q = torch.randn(sum(lengths_q), nheads, headdim, requires_grad=True)
    k = torch.randn(sum(lengths_k), nheads_k, headdim, requires_grad=True)
    v = torch.randn(sum(lengths_k), nheads_k, headdim, requires_grad=True)
    cu_q, cu_k = cu_seqlens_from_lengths(torch.tensor(lengths_q)), cu_seqlens_from_lengths(torch.tensor(lengths_k))
    slopes = _slopes(len(lengths_q), nheads, per_sequence)
    out = flashpatch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                            alibi_slopes=slopes)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference, ref_args=(cu_q, cu_k),
                            causal=True, alibi_slopes=slopes)


def test_packed_form_passes_the_slopes():
    torch.manual_seed(8)
    qkv = torch.randn(1, 12, 3, 2, 16)
    slopes = _slopes(1, 2, per_sequence=False)
    packed = flashpatch.flash_attn_qkvpacked_func(qkv, causal=True, alibi_slopes=slopes)
    separate = flashpatch.flash_attn_func(*qkv.unbind(dim=2), causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(packed, separate, rtol=0, atol=0)


@pytest.mark.parametrize("slopes, error, match", [
    (torch.ones(2, dtype=torch.float16), TypeError, "alibi_slopes must be float32, got torch.float16"),
    (torch.ones(3), ValueError, r"shape \(2,\) or \(1, 2\).*got \(3,\)"),
    (torch.ones(2, 2), ValueError, r"got \(2, 2\)"),  # batch is 1
    (torch.ones(1, 4)[:, ::2], ValueError, "contiguous last dimension"),  # (1, 2) with strides (4, 2)
    ([0.5, 0.5], TypeError, "alibi_slopes must be a torch.Tensor or None, got list"),
])
def test_bad_slopes_are_refused_by_name(slopes, error, match):
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    with pytest.raises(error, match=match):
        flashpatch.flash_attn_func(q, k, v, alibi_slopes=slopes)


def test_alibi_through_the_custom_ops_under_compile():
    torch.manual_seed(9)
    q, k, v = random_qkv(1, 16, 16, 2, 1, 16, torch.float32)
    slopes = _slopes(1, 2, per_sequence=True)

    def block(q, k, v, slopes):
        return flashpatch.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")  # traced: torch.ops.flashpatch, fakes
    out = compiled(q, k, v, slopes)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    eager = block(q, k, v, slopes)
    eager_grads = torch.autograd.grad(eager.sum(), (q, k, v))
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
