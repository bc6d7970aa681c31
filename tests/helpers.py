"""Error bounds in the style of flash-attn's tests.

A kernel result passes when its max error against a float64 reference is at most `factor` times the error of
PyTorch computing the same thing in the input dtype (2x for outputs, 3x for gradients), plus a float32 rounding
floor: 2 ulps of the magnitude of the quantities involved (the largest of out, dq, dk, dv) times sqrt(headdim).
The kernels accumulate in fp32 in a different order than PyTorch, so in fp32 both errors sit at rounding level,
and where PyTorch's algebra cancels exactly the kernel's need not: with a single visible key, softmax's gradient
is 0, which PyTorch gets exactly while the kernel's dS = P * (dP - delta) subtracts two fp32 dot products over
headdim summed in different orders (error ~ eps * sqrt(headdim) * their size). NaN never passes.
"""

from __future__ import annotations

import math

import torch

from flashpatch.reference import attention_reference

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0


def assert_close_to_reference(name, value, ref64, ref_lowp, factor, magnitude=None):
    value, ref64, ref_lowp = value.double(), ref64.double(), ref_lowp.double()
    assert not torch.isnan(value).any(), f"{name}: NaN in kernel result"
    assert value.shape == ref64.shape, f"{name}: shape {tuple(value.shape)} != {tuple(ref64.shape)}"
    err = (value - ref64).abs().max().item() if value.numel() else 0.0
    err_pt = (ref_lowp - ref64).abs().max().item() if value.numel() else 0.0
    if magnitude is None:
        magnitude = ref64.abs().max().item() if value.numel() else 0.0
    floor = 2 * torch.finfo(torch.float32).eps * magnitude
    bound = factor * err_pt + floor
    assert err <= bound, f"{name}: max error {err:.3e} > {factor} x PyTorch's {err_pt:.3e} + floor {floor:.1e}"


def random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, device="cpu", requires_grad=True):
    q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def reference_pair(q, k, v, dout, reference=attention_reference, ref_args=(), **kwargs):
    """(out, lse, grads) in float64 and in the inputs' dtype, from a PyTorch reference
    (`attention_reference`, or `varlen_attention_reference` with ref_args=(cu_seqlens_q, cu_seqlens_k))."""
    results = []
    for dtype in (torch.float64, q.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = reference(*leaves, *ref_args, upcast=False, **kwargs)
        grads = torch.autograd.grad(out, leaves, dout.to(dtype))
        results.append((out, lse, grads))
    return results


def check_against_reference(out, grads, q, k, v, dout, reference=attention_reference, ref_args=(), **kwargs):
    """Asserts the 2x / 3x rule for out and (dq, dk, dv); returns the float64 reference's LSE."""
    (out64, lse64, grads64), (out_pt, _, grads_pt) = reference_pair(q, k, v, dout, reference, ref_args, **kwargs)
    magnitude = max((t.abs().max().item() for t in (out64, *grads64) if t.numel()), default=0.0)
    magnitude *= math.sqrt(q.shape[-1])  # rounding of the length-headdim fp32 reductions (module docstring)
    assert_close_to_reference("out", out, out64, out_pt, OUT_FACTOR, magnitude)
    for name, g, g64, gpt in zip(("dq", "dk", "dv"), grads, grads64, grads_pt):
        assert_close_to_reference(name, g, g64, gpt, GRAD_FACTOR, magnitude)
    return lse64
