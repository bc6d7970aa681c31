"""Host (Python) time per call of flashpatch's launch path, piece by piece, at one shape: the time to enqueue
each piece, measured with perf_counter over many calls while the GPU has work queued. GPU only.

    python benchmarks/host_overhead.py [--shape 1b] [--launch-profile] [--call-profile]

--launch-profile: cProfile of one Gluon launch (sm90_fwd.attn_fwd), the Python functions with the most own time.
--call-profile: cProfile of flash_attn_func's forward and backward (autograd run on this thread), the Python
functions with the most own time.
--jit-pieces: each Triton launch of one forward + backward, timed whole and in the pieces of Triton's
JITFunction.run (binding and specialization, cache key, launcher).
"""

import argparse
import cProfile
import pstats
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))  # gluon_check.SHAPES
import flashpatch  # noqa: E402
from flashpatch import autograd as fp_autograd, ops, validation  # noqa: E402
from flashpatch.autograd import FlashAttnFunction  # noqa: E402
from flashpatch.kernels.sm90 import common as sm90_common  # noqa: E402
from flashpatch.kernels.sm90 import dkdv as sm90_dkdv, dq as sm90_dq, fwd as sm90_fwd  # noqa: E402
from gluon_check import SHAPES  # noqa: E402


def per_call_us(fn, iters=200):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / iters * 1e6


def in_thread(fn, iters=20):
    """fn run `iters` times in one new thread; per_call_us divides by its own count, so this reports the cost of
    one call plus 1/iters of a thread start."""
    worker = threading.Thread(target=lambda: [fn() for _ in range(iters)])
    worker.start()
    worker.join()


class Timed:
    """Wraps module attributes with host-time accumulators: the pieces of a call where autograd runs it."""

    def __init__(self):
        self.totals, self.calls = {}, {}

    def wrap(self, module, name, label=None):
        label = label or f"{module.__name__.split('.')[-1]}.{name}"
        inner = getattr(module, name)
        if hasattr(inner, "run") and hasattr(inner, "__getitem__"):  # a @triton.jit kernel: time kernel[grid](...)
            timed = self

            class Launcher:
                def __getitem__(self, grid):
                    launch = inner[grid]

                    def run(*a, **kw):
                        return timed.time(label, launch, *a, **kw)
                    return run
            setattr(module, name, Launcher())
        else:
            setattr(module, name, lambda *a, **kw: self.time(label, inner, *a, **kw))
        return inner

    def time(self, label, fn, *a, **kw):
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - start
            self.calls[label] = self.calls.get(label, 0) + 1


def inside_autograd(q, k, v, dout, causal, iters=200):
    """Host time of each piece of the backward as the autograd engine runs it, on its device thread and, for
    comparison, on the calling thread. The kernels themselves are not wrapped: launch.launch caches only real
    JITFunctions, so a wrapped kernel would time Triton's slow path instead. `launch._tritons_launch` counts the
    launches that took Triton's own path (none once every signature was met)."""
    from flashpatch.kernels import config as kc
    from flashpatch.kernels import launch as kernel_launch

    for multithreaded in (True, False):
        timed = Timed()
        originals = [(ops, "_launch_configs"), (ops, "tma_usable"), (sm90_dkdv, "attn_bwd_dkdv"),
                     (sm90_dq, "attn_bwd_dq"), (sm90_dkdv, "supported"), (sm90_dq, "supported"), (kc, "head_group"),
                     (sm90_dkdv, "descriptor"), (sm90_dq, "descriptor"), (kernel_launch, "_tritons_launch"),
                     (ops, "_side_stream")]
        with torch.autograd.set_multithreading_enabled(multithreaded):
            flashpatch.flash_attn_func(q, k, v, causal=causal).backward(dout)  # the thread's side stream made
            saved = [(m, n, timed.wrap(m, n)) for m, n in originals]
            backward = fp_autograd.FlashAttnFunction.backward
            fp_autograd.FlashAttnFunction.backward = staticmethod(
                lambda ctx, *g: timed.time("FlashAttnFunction.backward (all of it)", backward, ctx, *g))
            try:
                for _ in range(iters):
                    out = flashpatch.flash_attn_func(q, k, v, causal=causal)
                    timed.time("out.backward (caller's view)", out.backward, dout)
                if q.is_cuda:
                    torch.cuda.synchronize()
            finally:
                for m, n, inner in saved:
                    setattr(m, n, inner)
                fp_autograd.FlashAttnFunction.backward = staticmethod(backward)
        where = "autograd's device thread" if multithreaded else "the calling thread"
        print(f"\n| backward on {where}: piece | host us per call | calls per step |\n|---|---|---|")
        for label, total in sorted(timed.totals.items(), key=lambda kv: -kv[1]):
            print(f"| {label} | {total / timed.calls[label] * 1e6:.1f} | {timed.calls[label] / iters:g} |")


def on_this_thread(fn):
    """fn with the autograd engine running CUDA backwards on the calling thread (no hand-off to its device thread)."""
    with torch.autograd.set_multithreading_enabled(False):
        return fn()


def through_ops(fn):
    """fn with autograd's direct calls turned off, so every call dispatches through torch.ops.flashpatch."""
    eager = fp_autograd._eager
    fp_autograd._eager = lambda *tensors: False
    try:
        return fn()
    finally:
        fp_autograd._eager = eager


def jit_pieces(call):
    """Host us of each Triton launch inside call(), whole and piece by piece (JITFunction.run's own steps)."""
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction, compute_cache_key

    captured = []
    run = JITFunction.run

    def capture(self, *a, grid, warmup, **kw):
        captured.append((self, a, grid, dict(kw)))
        return run(self, *a, grid=grid, warmup=warmup, **kw)
    JITFunction.run = capture
    try:
        call()
    finally:
        JITFunction.run = run
    torch.cuda.synchronize()
    print("\n| launch | whole | device+stream | bind | key | globals | launcher |\n|---|---|---|---|---|---|---|")
    for fn, a, grid, kw in captured:
        kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
        kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        kernel_cache, key_cache, _, _, binder = fn.device_caches[device]
        bound, spec, options = binder(*a, **kw)
        kernel = kernel_cache[compute_cache_key(key_cache, spec, options)]
        g = tuple(grid) + (1,) * (3 - len(grid))

        def globals_check():
            for (name, _), (val, globals_dict) in fn.used_global_vals.items():
                globals_dict.get(name) != val
        pieces = [
            lambda: fn.run(*a, grid=grid, warmup=False, **kw),
            lambda: driver.active.get_current_stream(driver.active.get_current_device()),
            lambda: binder(*a, **kw),
            lambda: compute_cache_key(key_cache, spec, options),
            globals_check,
            lambda: kernel.run(*g, stream, kernel.function, kernel.packed_metadata, None, None, None,
                               *bound.values()),
        ]
        times = [per_call_us(p, iters=100) for p in pieces]
        print(f"| {fn.__name__} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--launch-profile", action="store_true")
    parser.add_argument("--call-profile", action="store_true")
    parser.add_argument("--jit-pieces", action="store_true")
    args = parser.parse_args()
    b, sq, sk, h, hk, d, causal, *_ = SHAPES[args.shape]
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = torch.empty_like(qd), torch.empty(b, h, sq, device="cuda", dtype=torch.float32)
    scope = dict(varlen=False, max_seqlen_q=sq, max_seqlen_k=sk, window_left=-1, window_right=0 if causal else -1,
                 softcap=0.0, dropout_p=0.0)
    qk, kk, vk = (t.transpose(1, 2) for t in (q, k, v))
    o, lse_ = ops.attn_fwd(qd, kd, vd, None, None, sq, sk, None, 0.0, d ** -0.5, -1, 0 if causal else -1, 0.0)
    bwd_args = (dout, qd, kd, vd, o, lse_, None, None, sq, sk, None, 0.0, d ** -0.5, -1, 0 if causal else -1, 0.0,
                False)
    delta = torch.empty_like(lse_)
    dq, dk, dv = (torch.empty_like(t) for t in (qd, kd, vd))
    out_g = flashpatch.flash_attn_func(q, k, v, causal=causal)
    args_ = validation.check_attention_args(qd, kd, vd, 0.0, None, causal, (-1, -1), 0.0, varlen=False)
    rows = [
        ("validation.check_attention_args", lambda: validation.check_attention_args(
            qd, kd, vd, 0.0, None, causal, (-1, -1), 0.0, varlen=False)),
        ("FlashAttnFunction.apply, no grad", lambda: FlashAttnFunction.apply(qd, kd, vd, None, None, sq, sk, args_,
                                                                            False, None)),
        ("flash_attn_func forward, inputs need grad", lambda: flashpatch.flash_attn_func(q, k, v, causal=causal)),
        ("backward alone (retain_graph)", lambda: out_g.backward(dout, retain_graph=True)),
        ("torch.autograd.grad alone (retain_graph)", lambda: torch.autograd.grad(out_g, (q, k, v), dout,
                                                                                  retain_graph=True)),
        ("flash_attn_func forward, no grad", lambda: flashpatch.flash_attn_func(qd, kd, vd, causal=causal)),
        ("flash_attn_func forward + backward", lambda: flashpatch.flash_attn_func(q, k, v, causal=causal)
         .backward(dout)),
        ("flash_attn_func forward + backward through the custom ops (as under a tracer)", lambda: through_ops(
            lambda: flashpatch.flash_attn_func(q, k, v, causal=causal).backward(dout))),
        ("flash_attn_func forward + backward, autograd on this thread", lambda: on_this_thread(
            lambda: flashpatch.flash_attn_func(q, k, v, causal=causal).backward(dout))),
        ("SDPA forward + backward, autograd on this thread", lambda: on_this_thread(
            lambda: F.scaled_dot_product_attention(qk, kk, vk, is_causal=causal, enable_gqa=h != hk).backward(
                dout.transpose(1, 2)))),
        ("SDPA forward + backward (peer)", lambda: F.scaled_dot_product_attention(
            qk, kk, vk, is_causal=causal, enable_gqa=h != hk).backward(dout.transpose(1, 2))),
        ("ops.attn_fwd (the custom op)", lambda: ops.attn_fwd(qd, kd, vd, None, None, sq, sk, None, 0.0, d ** -0.5,
                                                              -1, 0 if causal else -1, 0.0)),
        ("sm90_fwd.attn_fwd (descriptors + launch)", lambda: sm90_fwd.attn_fwd(qd, kd, vd, out, lse, 0.1,
                                                                                   causal)),
        ("ops.attn_fwd's own function (no custom-op dispatch)", lambda: ops.attn_fwd_impl(
            qd, kd, vd, None, None, sq, sk, None, 0.0, d ** -0.5, -1, 0 if causal else -1, 0.0)),
        ("ops.attn_bwd (the custom op)", lambda: ops.attn_bwd(*bwd_args)),
        ("ops.attn_bwd's own function", lambda: ops.attn_bwd_impl(*bwd_args)),
        ("ops.attn_bwd in a fresh thread (as autograd's engine runs it)", lambda: in_thread(
            lambda: ops.attn_bwd(*bwd_args))),
        ("an empty fresh thread", lambda: in_thread(lambda: None)),
        ("sm90_dkdv.attn_bwd_dkdv", lambda: sm90_dkdv.attn_bwd_dkdv(qd, kd, vd, dout, lse_, delta, dk, dv, 0.1,
                                                                         0.1, causal)),
        ("sm90_dq.attn_bwd_dq", lambda: sm90_dq.attn_bwd_dq(qd, kd, vd, dout, lse_, delta, dq, 0.1, 0.1,
                                                                 causal)),
        ("sm90_fwd.supported", lambda: sm90_fwd.supported(qd, kd, vd, **scope)),
        ("sm90_common.descriptor, one", lambda: sm90_common.descriptor(qd, 128)),
        ("torch.cuda.get_device_capability", lambda: torch.cuda.get_device_capability(qd.device)),
        ("torch.empty_like", lambda: torch.empty_like(qd)),
    ]
    print(f"| {args.shape}: piece | host us per call |\n|---|---|")
    for name, fn in rows:
        # in_thread rows run fn 20 times per call of theirs
        per_call = per_call_us(fn, iters=10) / 20 if "fresh thread" in name else per_call_us(fn)
        print(f"| {name} | {per_call:.1f} |", flush=True)
    inside_autograd(q, k, v, dout, causal)
    if args.launch_profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            sm90_fwd.attn_fwd(qd, kd, vd, out, lse, 0.1, causal)
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if args.jit_pieces:
        jit_pieces(lambda: (flashpatch.flash_attn_func(q, k, v, causal=causal).backward(dout)))
    if args.call_profile:
        def call():  # the whole forward + backward, autograd's included, on this thread
            with torch.autograd.set_multithreading_enabled(False):
                flashpatch.flash_attn_func(q, k, v, causal=causal).backward(dout)
        call()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
