"""GPU: every head dim flash-attn takes, with dropout, through the packed functions too (bf16 and fp16, seqlen 1024).

Each case compiles its own kernel variants, so this grid is what catches a variant the compiler cannot build (the
offline check, tools/compile_check.py, compiles the same variants without a GPU)."""

import pytest
import torch

import flashpatch
from tests.helpers import check_against_reference
from flashpatch.reference import varlen_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADDIMS = [32, 40, 64, 80, 96, 128, 160, 192, 224, 256]
DTYPES = [torch.float16, torch.bfloat16]


def _qkv_packed(batch, seqlen, nheads, headdim, dtype):
    return torch.randn(batch, seqlen, 3, nheads, headdim, device="cuda", dtype=dtype).requires_grad_()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_dropout_qkvpacked_every_headdim(headdim, dtype, causal):
    p = 0.17
    qkv = _qkv_packed(1, 1024, 2, headdim, dtype)
    out, _, pattern = flashpatch.flash_attn_qkvpacked_func(qkv, dropout_p=p, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    q, k, v = qkv.unbind(2)
    check_against_reference(out, dqkv.unbind(2), q, k, v, dout, causal=causal, dropout_p=p,
                            dropout_keep=pattern > 0)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("seqlen", [1024, 2048])
@pytest.mark.parametrize("headdim", [32, 64])
def test_dropout_qkvpacked_causal_fp16(headdim, seqlen, deterministic):
    p = 0.17
    qkv = _qkv_packed(1, seqlen, 2, headdim, torch.float16)
    dout = torch.randn(1, seqlen, 2, headdim, device="cuda", dtype=torch.float16)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        out, _, pattern = flashpatch.flash_attn_qkvpacked_func(qkv, dropout_p=p, causal=True,
                                                               deterministic=deterministic, return_attn_probs=True)
        runs.append((out, pattern, *torch.autograd.grad(out, (qkv,), dout)))
    out, pattern, dqkv = runs[0]
    q, k, v = qkv.unbind(2)
    check_against_reference(out, dqkv.unbind(2), q, k, v, dout, causal=True, dropout_p=p, dropout_keep=pattern > 0)
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(*runs)), "deterministic=True must repeat bit for bit"


# Varlen and odd head dims: one dtype per head dim, alternating, so that both run at small and large head dims
# without doubling the compile time of the grid.
VARLEN_CASES = [(d, DTYPES[i % 2]) for i, d in enumerate([1, 17, 40, 59, 111, 160, 224, 256])]
ODD_CASES = [(d, DTYPES[i % 2]) for i, d in enumerate([1, 8, 17, 59, 111, 255])]


@pytest.mark.parametrize("headdim, dtype", VARLEN_CASES, ids=lambda c: str(c))
def test_dropout_varlen_qkvpacked(headdim, dtype):
    p = 0.17
    lengths = [1, 300, 0, 1023, 77]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    qkv = torch.randn(sum(lengths), 3, 2, headdim, device="cuda", dtype=dtype).requires_grad_()
    out, _, pattern = flashpatch.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), dropout_p=p, causal=True,
                                                                  return_attn_probs=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    q, k, v = qkv.unbind(1)
    check_against_reference(out, dqkv.unbind(1), q, k, v, dout, reference=varlen_attention_reference,
                            ref_args=(cu, cu), causal=True, dropout_p=p, dropout_keep=pattern > 0)


@pytest.mark.parametrize("headdim, dtype", ODD_CASES, ids=lambda c: str(c))
def test_odd_headdims_dense_gqa(headdim, dtype):
    q = torch.randn(2, 1023, 4, headdim, device="cuda", dtype=dtype).requires_grad_()
    k = torch.randn(2, 1000, 2, headdim, device="cuda", dtype=dtype).requires_grad_()
    v = torch.randn_like(k).requires_grad_()
    out = flashpatch.flash_attn_func(q, k, v, causal=True, window_size=[300, 5])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, causal=True, window_size=(300, 0))
