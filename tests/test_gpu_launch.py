"""The launch cache (kernels/launch.py): a cached launch runs the kernel Triton's own path would, on the same
arguments, so results match bit for bit with the cache off; so does a replayed one; a repeated call binds nothing;
the side stream of the concurrent backward gets its launches."""

from __future__ import annotations

import pytest
import torch

import flashpatch
from flashpatch.kernels import launch as launch_mod
from flashpatch.kernels import options

from flashpatch.padding import cu_seqlens_from_lengths

from .helpers import random_qkv

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CASES = {  # each reaches a different set of kernels
    "gluon_d128_causal_gqa": dict(shape=(2, 256, 256, 8, 2, 128), causal=True),
    "gluon_d64_full": dict(shape=(2, 256, 256, 4, 4, 64)),
    "gluon_dropout": dict(shape=(1, 256, 256, 4, 4, 128), causal=True, dropout_p=0.1),
    "triton_odd_window": dict(shape=(2, 113, 77, 4, 2, 64), window_size=(31, 5)),
    "triton_softcap_alibi": dict(shape=(1, 200, 200, 4, 4, 128), causal=True, softcap=20.0, alibi=True),
    "triton_fp16_d96": dict(shape=(2, 129, 129, 6, 3, 96), causal=True, dtype=torch.float16),
    "varlen": dict(lengths=[100, 1, 513, 0, 64], causal=True),
}


def _run(case: dict, seed: int):
    torch.manual_seed(seed)
    kwargs = {key: value for key, value in case.items() if key not in ("shape", "lengths", "dtype", "alibi")}
    dtype = case.get("dtype", torch.bfloat16)
    if "lengths" in case:
        lengths = case["lengths"]
        cu = cu_seqlens_from_lengths(torch.tensor(lengths, device="cuda"))
        q, k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in "qkv")
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), deterministic=True,
                                                **kwargs)
    else:
        q, k, v = random_qkv(*case["shape"], dtype, device="cuda")
        if case.get("alibi"):
            kwargs["alibi_slopes"] = torch.rand(q.shape[2], device="cuda", dtype=torch.float32)
        out = flashpatch.flash_attn_func(q, k, v, deterministic=True, **kwargs)
    dout = torch.randn_like(out)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("name", list(CASES))
def test_cached_launch_matches_tritons_path(name, monkeypatch):
    case = CASES[name]
    with options.override(cached_launch=False):
        expected = _run(case, seed=0)
    launch_mod._compiled.clear()
    # every launch that reuses a cached kernel by its site checks that the site still stands for its argument key
    # (the options are part of the site: both runs take the same)
    with options.override(verify_launch_sites=True):
        _run(case, seed=0)  # fills the cache
        assert launch_mod._compiled, "no launch was cached"
        from triton.runtime.jit import JITFunction

        bound = []
        run = JITFunction.run
        monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: bound.append(self) or run(self, *a, **kw))
        got = _run(case, seed=0)
    # the dropout draw and the pattern's seed are launched by torch; every flashpatch kernel came from the cache
    assert not bound, f"launches bound by Triton on a repeated call: {[getattr(f, '__name__', f) for f in bound]}"
    for name_, e, g in zip(("out", "dq", "dk", "dv"), expected, got):
        assert torch.equal(e, g), f"{name_} differs between the cached launch and Triton's path"


@pytest.mark.parametrize("name", list(CASES))
def test_replayed_launch_matches_tritons_path(name, monkeypatch):
    case = CASES[name]
    with options.override(cached_launch=False):
        expected = _run(case, seed=0)
    launch_mod._replays.clear()
    _run(case, seed=0)  # Triton's path, which caches the compiled kernels
    _run(case, seed=0)  # the cached launches, which record themselves
    replayed, must = [], {"attn_bwd_preprocess_kernel"}
    unrecorded = [key[0].__name__ for key, entry in launch_mod._replays.items() if entry is None]
    assert not unrecorded, f"launches that could not be recorded for replay: {unrecorded}"
    for key, entry in list(launch_mod._replays.items()):
        kernel_name = key[0].__name__
        if entry.scratch is None:  # one taking scratch memory keeps the launch path on the side stream
            must.add(kernel_name)
        monkeypatch.setitem(launch_mod._replays, key, entry._replace(
            raw=lambda *a, _raw=entry.raw, _name=kernel_name: replayed.append(_name) or _raw(*a)))
    got = _run(case, seed=0)
    assert must <= set(replayed), f"not replayed: {must - set(replayed)}"
    for name_, e, g in zip(("out", "dq", "dk", "dv"), expected, got):
        assert torch.equal(e, g), f"{name_} differs between the replayed launch and Triton's path"


def test_new_alignment_is_a_new_signature():
    # an input whose data pointer is not 16-byte aligned specializes differently: it must not reuse the entry of an
    # aligned one (the Triton kernels take such views; the Gluon ones refuse them)
    q, k, v = random_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16, device="cuda")
    launch_mod._compiled.clear()
    flashpatch.flash_attn_func(q, k, v, causal=True)
    entries = len(launch_mod._compiled)
    base = torch.randn(1 * 64 * 2 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    q_off = base[1:].view(1, 64, 2, 64)  # 2-byte offset
    out = flashpatch.flash_attn_func(q_off, k.detach(), v.detach(), causal=True)
    assert len(launch_mod._compiled) > entries
    with options.override(cached_launch=False):
        ref = flashpatch.flash_attn_func(q_off, k.detach(), v.detach(), causal=True)
    assert torch.equal(out, ref)


def test_concurrent_backward_launches_on_the_side_stream(monkeypatch):
    # the cached path passes the side stream's handle to the launcher instead of making it current; the stream is
    # per thread (ops._side_stream), and autograd runs the backward on a thread of its own, so it is recorded there
    from flashpatch import ops

    q, k, v = random_qkv(2, 1024, 1024, 8, 2, 128, torch.bfloat16, device="cuda")
    out = flashpatch.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    with options.override(concurrent_dq=False):
        serial = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # fills the cache
    sides = []
    monkeypatch.setattr(ops, "_side_stream",
                        lambda device, _make=ops._side_stream: sides.append(_make(device)[0].cuda_stream)
                        or _make(device))
    streams = []
    for compiled, *_ in list(launch_mod._compiled.values()):
        inner = compiled.run  # a property over _run, the launcher
        monkeypatch.setattr(compiled, "_run", lambda *a, _inner=inner: streams.append(a[3]) or _inner(*a))
    concurrent = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert sides and sides[0] in streams, "no cached launch ran on the side stream"
    for s, c in zip(serial, concurrent):
        assert torch.equal(s, c)
