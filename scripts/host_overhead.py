"""Host (Python) time per call of flashpatch's launch path, piece by piece, at one shape: the time to enqueue
each piece, measured with perf_counter over many calls while the GPU has work queued. GPU only.

    python scripts/host_overhead.py [--shape 1b]
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashpatch  # noqa: E402
from flashpatch import ops  # noqa: E402
from flashpatch.kernels import hopper_common, hopper_dkdv, hopper_dq, hopper_fwd  # noqa: E402
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1b")
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
    rows = [
        ("flash_attn_func forward, no grad", lambda: flashpatch.flash_attn_func(qd, kd, vd, causal=causal)),
        ("flash_attn_func forward + backward", lambda: flashpatch.flash_attn_func(q, k, v, causal=causal)
         .backward(dout)),
        ("SDPA forward + backward (peer)", lambda: F.scaled_dot_product_attention(
            qk, kk, vk, is_causal=causal, enable_gqa=h != hk).backward(dout.transpose(1, 2))),
        ("ops.attn_fwd (the custom op)", lambda: ops.attn_fwd(qd, kd, vd, None, None, sq, sk, None, 0.0, d ** -0.5,
                                                              -1, 0 if causal else -1, 0.0)),
        ("hopper_fwd.attn_fwd (descriptors + launch)", lambda: hopper_fwd.attn_fwd(qd, kd, vd, out, lse, 0.1,
                                                                                   causal)),
        ("ops.attn_fwd's own function (no custom-op dispatch)", lambda: ops.attn_fwd._init_fn(
            qd, kd, vd, None, None, sq, sk, None, 0.0, d ** -0.5, -1, 0 if causal else -1, 0.0)),
        ("ops.attn_bwd (the custom op)", lambda: ops.attn_bwd(*bwd_args)),
        ("ops.attn_bwd's own function", lambda: ops.attn_bwd._init_fn(*bwd_args)),
        ("hopper_dkdv.attn_bwd_dkdv", lambda: hopper_dkdv.attn_bwd_dkdv(qd, kd, vd, dout, lse_, delta, dk, dv, 0.1,
                                                                         0.1, causal)),
        ("hopper_dq.attn_bwd_dq", lambda: hopper_dq.attn_bwd_dq(qd, kd, vd, dout, lse_, delta, dq, 0.1, 0.1,
                                                                 causal)),
        ("hopper_fwd.supported", lambda: hopper_fwd.supported(qd, kd, vd, **scope)),
        ("hopper_common.descriptor, one", lambda: hopper_common.descriptor(qd, 128)),
        ("torch.cuda.get_device_capability", lambda: torch.cuda.get_device_capability(qd.device)),
        ("torch.empty_like", lambda: torch.empty_like(qd)),
    ]
    print(f"| {args.shape}: piece | host us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn):.1f} |", flush=True)


if __name__ == "__main__":
    main()
