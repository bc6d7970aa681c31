"""flash_attn_func against the float64 reference: shapes, masks, dtypes, strides, errors, determinism, compile."""

import os
import subprocess
import sys

import pytest
import torch

import flashpatch
from flashpatch import ops
from flashpatch.kernels import options as kernel_options
from flashpatch.reference import attention_reference
from tests.helpers import check_against_reference, random_qkv

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, kwargs): odd lengths, Sq != Sk both ways,
# GQA 3:1 and 4:2, MQA, every head dim the issue names.
CASES = [
    (1, 1, 1, 1, 1, 32, torch.float32, {}),
    (2, 17, 17, 2, 1, 32, torch.float32, {"causal": True}),
    (1, 113, 113, 4, 2, 64, torch.float32, {}),
    (1, 113, 113, 4, 2, 64, torch.float16, {"causal": True}),
    (2, 17, 113, 3, 1, 40, torch.float32, {"causal": True}),
    (2, 113, 17, 3, 1, 40, torch.float16, {"causal": True}),
    (1, 1, 113, 6, 2, 96, torch.float32, {"causal": True}),
    (1, 113, 1, 6, 6, 96, torch.float16, {}),
    (1, 70, 45, 5, 5, 128, torch.float16, {"causal": True}),
    (1, 45, 70, 4, 1, 128, torch.float32, {}),
    (1, 33, 40, 2, 1, 256, torch.float16, {"causal": True}),
    (1, 113, 113, 2, 1, 32, torch.float32, {"window_size": (20, 5)}),
    (1, 64, 100, 2, 2, 32, torch.float16, {"window_size": (7, -1), "causal": True}),
    (1, 100, 64, 2, 2, 40, torch.float32, {"window_size": (-1, 3)}),
    (1, 50, 90, 3, 1, 32, torch.float32, {"softcap": 5.0, "causal": True}),
    (2, 17, 30, 2, 2, 64, torch.float16, {"softcap": 2.0, "window_size": (9, 2)}),
    (1, 40, 40, 2, 1, 32, torch.float32, {"softmax_scale": 0.3}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}:{c[4]}-d{c[5]}-"
                         f"{str(c[6])[6:]}-{'-'.join(f'{k}={v}' for k, v in c[7].items())}")
def test_matches_float64_reference(case):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, kwargs = case
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    out = flashpatch.flash_attn_func(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


@pytest.mark.parametrize("strategy", [{"atomic_dq": False}, {"atomic_dq": True}, {"concurrent_dq": True}], ids=str)
def test_dq_strategies_agree_with_reference(strategy, monkeypatch):
    # concurrent_dq forks a CUDA side stream for dK/dV; CPU tensors (the interpreter) run dK/dV and dQ in turn
    monkeypatch.setattr(ops, "_side_stream", lambda device: pytest.fail("side stream requested for a CPU call"))
    q, k, v = random_qkv(2, 45, 77, 4, 2, 32, torch.float32)
    with kernel_options.override(**strategy):
        out = flashpatch.flash_attn_func(q, k, v, causal=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, causal=True)


def test_fully_masked_rows_give_zeros_not_nan():
    # Sq > Sk with causal: the first Sq - Sk query rows see no key (bottom-right alignment).
    q, k, v = random_qkv(1, 40, 9, 2, 1, 32, torch.float32)
    out, lse, _ = flashpatch.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    for t in (out, dq, dk, dv):
        assert not torch.isnan(t).any()
    empty = slice(0, 40 - 9)
    assert out[:, empty].abs().max() == 0 and dq[:, empty].abs().max() == 0
    assert torch.isinf(lse[:, :, empty]).all() and (lse[:, :, empty] > 0).all()
    assert out[:, 40 - 9:].abs().min() > 0  # the others are real
    # A window that leaves middle rows empty: keys only to the right beyond reach.
    q, k, v = random_qkv(1, 20, 20, 1, 1, 32, torch.float32)
    out = flashpatch.flash_attn_func(q, k, v, window_size=(0, 0))  # each row sees only its own key
    ref, _ = attention_reference(q.double(), k.double(), v.double(), window_size=(0, 0))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_lse_matches_reference():
    q, k, v = random_qkv(2, 33, 51, 4, 2, 40, torch.float32, requires_grad=False)
    out, lse, pattern = flashpatch.flash_attn_func(q, k, v, causal=True, softcap=3.0, return_attn_probs=True)
    ref_out, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=True, softcap=3.0)
    assert pattern is None and lse.shape == (2, 4, 33) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-5, atol=1e-5)


def test_non_contiguous_strides():
    """Slices of a packed qkv tensor and a (B, H, S, D) transpose: the kernels read strides, no copies."""
    batch, seqlen, nheads, headdim = 2, 37, 3, 40
    qkv = torch.randn(batch, seqlen, 3, nheads, headdim + 8)[..., :headdim]  # padded rows: no dense stride
    q, k, v = (t.requires_grad_() for t in qkv.unbind(2))
    q_bhsd = torch.randn(batch, nheads, seqlen, headdim).transpose(1, 2).requires_grad_()
    for query in (q, q_bhsd):
        assert not query.is_contiguous()
        out = flashpatch.flash_attn_func(query, k, v, causal=True)
        dout = torch.randn(batch, nheads, seqlen, headdim).transpose(1, 2)  # non-contiguous gradient too
        grads = torch.autograd.grad(out, (query, k, v), dout)
        check_against_reference(out, grads, query, k, v, dout, causal=True)
        # a dense input's gradient keeps its memory order; one with gaps gets a contiguous gradient
        assert grads[0].stride() == (query.stride() if query is q_bhsd else (seqlen * nheads * headdim,
                                                                              nheads * headdim, headdim, 1))
        assert grads[1].is_contiguous() and grads[2].is_contiguous()


def test_deterministic_backward_is_bitwise_repeatable():
    q, k, v = random_qkv(2, 50, 61, 4, 1, 32, torch.float16)
    dout = torch.randn(2, 50, 4, 32, dtype=torch.float16)
    runs = []
    for _ in range(2):
        out = flashpatch.flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_traces_through():
    q, k, v = random_qkv(1, 24, 24, 2, 1, 32, torch.float32)

    def block(q, k, v):
        return flashpatch.flash_attn_func(q * 1.5, k, v, causal=True).sum(dim=-1)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(out_c.sum(), (q, k, v))
    out_e = block(q, k, v)
    grads_e = torch.autograd.grad(out_e.sum(), (q, k, v))
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)


def test_eager_calls_skip_the_dispatcher_and_tracers_still_see_the_ops(monkeypatch):
    # autograd._eager: plain tensors outside any trace run the implementations directly (host time); under a
    # TorchDispatchMode, as in fake-tensor tracing, functionalization or selective checkpointing, the custom ops
    # must appear, since their fake kernels are what tracers run. Both give the same numbers.
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashpatch import ops

    class SeenOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    direct = []
    for name in ("attn_fwd_impl", "attn_bwd_impl"):
        impl = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _impl=impl, _name=name: direct.append(_name) or _impl(*a))
    q, k, v = random_qkv(1, 20, 33, 2, 1, 32, torch.float32)
    dout = torch.randn(1, 20, 2, 32)
    out = flashpatch.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert direct == ["attn_fwd_impl", "attn_bwd_impl"]

    direct.clear()
    with SeenOps() as mode:
        out_mode = flashpatch.flash_attn_func(q, k, v, causal=True)
        grads_mode = torch.autograd.grad(out_mode, (q, k, v), dout)
    assert direct == []
    assert "flashpatch.attn_fwd.default" in mode.names and "flashpatch.attn_bwd.default" in mode.names
    torch.testing.assert_close(out_mode, out, rtol=0, atol=0)
    for a, b in zip(grads_mode, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_custom_ops_pass_opcheck():
    q, k, v = random_qkv(1, 9, 11, 2, 1, 16, torch.float32, requires_grad=False)
    args = (q, k, v, None, None, 9, 11, None, 0.0, 0.25, -1, 0, 0.0)
    torch.library.opcheck(torch.ops.flashpatch.attn_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_backward_op_fake_gives_the_real_gradient_strides():
    q = torch.randn(2, 3, 9, 16).transpose(1, 2)  # (B, S, H, D) view of (B, H, S, D) memory: dense, kept
    k = torch.randn(2, 11, 2, 1, 16)[:, :, 0]  # a slice with gaps: its gradient is contiguous
    v = torch.randn(2, 1, 11, 16).transpose(1, 2)  # one head: contiguous and (B, H, S, D) at once
    out, lse = torch.ops.flashpatch.attn_fwd(q, k, v, None, None, 9, 11, None, 0.0, 0.25, -1, 0, 0.0)
    args = (torch.randn_like(out), q, k, v, out, lse, None, None, 9, 11, None, 0.0, 0.25, -1, 0, 0.0, False)
    torch.library.opcheck(torch.ops.flashpatch.attn_bwd.default, args, test_utils=("test_schema", "test_faketensor"))
    real = torch.ops.flashpatch.attn_bwd(*args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.flashpatch.attn_bwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                               for a in args))
    def layout(t):  # strides of the dimensions that have any (a size-1 dimension's stride addresses nothing)
        return [s for s, n in zip(t.stride(), t.shape) if n > 1]

    assert [layout(t) for t in real] == [layout(t) for t in fake]
    assert layout(real[0]) == layout(q) and real[1].is_contiguous() and real[2].is_contiguous()


BAD_INPUTS = [
    (lambda q, k, v: (q.half(), k, v), {}, TypeError, "share a dtype"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), {}, TypeError, "float64"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), {}, TypeError, "int32"),
    (lambda q, k, v: (q[0], k, v), {}, ValueError, "4 dims"),
    (lambda q, k, v: (q, k[:1], v[:1]), {}, ValueError, "batch mismatch"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), {}, ValueError, "headdim mismatch"),
    (lambda q, k, v: (q, k, v[:, :3]), {}, ValueError, "same shape"),
    (lambda q, k, v: (torch.randn(2, 5, 3, 16), *torch.randn(2, 2, 7, 2, 16)), {}, ValueError,
     r"nheads \(3\) must be a multiple of nheads_k \(2\)"),
    (lambda q, k, v: (*(torch.randn(2, 5, 2, 264) for _ in range(3)),), {}, ValueError,
     "between 1 and 256, got 264"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), {}, ValueError, "between 1 and 256, got 0"),
    (lambda q, k, v: (q.transpose(1, 3).contiguous().transpose(1, 3), k, v), {}, ValueError, "contiguous last"),
    (lambda q, k, v: (q, k, v), {"window_size": (-2, 0)}, ValueError, "window_size"),
    (lambda q, k, v: (q, k, v), {"window_size": (3,)}, ValueError, "window_size"),
    (lambda q, k, v: (q, k, v), {"window_size": (2.5, 0)}, ValueError, "pair of ints"),
    (lambda q, k, v: (q, k, v), {"window_size": torch.tensor([2.0, 0.0])}, ValueError, "pair of ints"),
    (lambda q, k, v: (q, k, v), {"window_size": torch.tensor([1, 2, 3])}, ValueError, r"shape \(3,\)"),
    (lambda q, k, v: (q, k, v), {"softcap": -1.0}, ValueError, "softcap"),
    (lambda q, k, v: (q, k, v), {"softmax_scale": -0.5}, ValueError, "softmax_scale"),
    (lambda q, k, v: (q, k, v), {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    (lambda q, k, v: (q, k, v), {"dropout_p": -0.1}, ValueError, "dropout_p"),
    (lambda q, k, v: (q.numpy(), k, v), {}, TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize("make, kwargs, error, match", BAD_INPUTS, ids=[b[3] for b in BAD_INPUTS])
def test_bad_input_is_a_clear_error(make, kwargs, error, match):
    q, k, v = random_qkv(2, 5, 7, 2, 1, 16, torch.float32, requires_grad=False)
    with pytest.raises(error, match=match):
        flashpatch.flash_attn_func(*make(q, k, v), **kwargs)


def test_device_mismatch_is_a_clear_error():
    q, k, v = random_qkv(1, 5, 5, 1, 1, 16, torch.float32, requires_grad=False)
    fake_cuda = torch.empty(1, 5, 1, 16, device="meta")
    with pytest.raises(ValueError, match="one device"):
        flashpatch.flash_attn_func(q, fake_cuda, fake_cuda)


def test_cpu_without_interpreter_says_how_to_enable_it():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch, flashpatch\n"
            "x = torch.randn(1, 4, 1, 16)\n"
            "flashpatch.flash_attn_func(x, x, x)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "TRITON_INTERPRET=1" in proc.stderr
