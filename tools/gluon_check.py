"""The Gluon Hopper kernels (flashpatch/kernels/sm90/) against the Triton ones: outputs, LSE and gradients against the
float64 reference, then GPU kernel time (torch profiler) per variant. GPU only (sm_90).

    python tools/gluon_check.py [--skip-check] [--shapes 1b,c8k,f8k] [--variants "triton,gluon+fwd+dq"]

--shapes names entries of SHAPES (dense rows) and VARLEN_SHAPES (packed documents, flash_attn_varlen_func).

A variant is a VARIANTS entry (the Gluon dK/dV or not, the grid order) plus extras, each an options.override
setting: "+fwd" (the Gluon forward), "+pfwd" / "+npfwd" (that forward as a persistent grid or one program per query
block: persistent_fwd), "+snake" (a persistent causal forward's blocks by the closed form, not the table:
causal_schedule=False), "+dq" (the Gluon dQ), "+pdq" / "+npdq" (its grid forced: persistent_dq), "+gN" (every
kernel's grid in head groups of N: head_group; g0: all heads in one group), "+fold" / "+nofold" (fold_scale),
"+rkv" / "+norkv" (the dK/dV's K and V in registers or not: register_kv), "+wrN" (the dK/dV worker consumer's
setmaxnreg count: dkdv_consumer_registers, e.g. "+wr240"), "+serial" (dQ after dK/dV, not beside it: each kernel's
own time), "+gdq" (the Gluon dQ under the "default" base), "+fdq" / "+nofdq" (dQ added by the d128 Gluon dK/dV itself
or by the separate pass: fused_dq; the backward column then counts the fp32 buffer's zeroing and conversion) and
"+sepdq" (the separate dQ pass where config takes atomic dQ: dropout without GQA). The base "default" runs each
kernel that config chooses. --check-extras applies such extras (e.g. "nofold+norkv") to the float64 check.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # profile_kernels
import flashpatch  # noqa: E402
from flashpatch import reference  # noqa: E402
from flashpatch.kernels import options  # noqa: E402
from flashpatch.kernels.sm90 import dkdv as hk  # noqa: E402
from bench_attention import varlen_batch, varlen_lengths  # noqa: E402
from profile_kernels import kernel_times  # noqa: E402

CALLS = {"n": 0}
_launch = hk.attn_bwd_dkdv


def _counted(*args, **kwargs):
    CALLS["n"] += 1
    return _launch(*args, **kwargs)


hk.attn_bwd_dkdv = _counted

# name: (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, causal[, dropout p])
SHAPES = {
    "1b": (8, 1024, 1024, 16, 4, 128, True),  # the 1B recipe's attention
    "tiny": (1, 128, 128, 16, 4, 128, True),  # the 1B model's heads on one tile: host time without GPU time
    "tiny64": (1, 128, 128, 12, 4, 64, True),  # llama_125m's heads on one tile (the Triton kernels)
    "c4k": (4, 4096, 4096, 16, 16, 128, True),
    "c8k": (2, 8192, 8192, 16, 16, 128, True),
    "c16k": (1, 16384, 16384, 16, 16, 128, True),
    "g2k": (8, 2048, 2048, 16, 4, 128, True),  # bench_attention.py's GQA 16/4 row
    "1bf": (8, 1024, 1024, 16, 4, 128, False),  # the 1B recipe's attention without the causal mask
    "f4k": (4, 4096, 4096, 16, 16, 128, False),
    "f8k": (2, 8192, 8192, 16, 16, 128, False),
    "d64c8k": (2, 8192, 8192, 32, 32, 64, True),
    "d64c4k": (4, 4096, 4096, 32, 32, 64, True),
    "d64f4k": (4, 4096, 4096, 32, 32, 64, False),
    "d64f8k": (2, 8192, 8192, 32, 32, 64, False),
    "d64c1k": (16, 1024, 1024, 32, 8, 64, True),  # short GQA rows
    "d64f1k": (16, 1024, 1024, 32, 8, 64, False),  # the same without the causal mask
    "d64c2k": (8, 2048, 2048, 12, 4, 64, True),  # configs/llama_125m.yaml's attention
    "d64c1kg": (16, 1024, 1024, 12, 4, 64, True),  # the same heads on shorter rows
    "d64c512": (32, 512, 512, 12, 4, 64, True),
    "c512": (32, 512, 512, 16, 16, 128, True),  # short causal rows at 16k tokens
    "c1k": (16, 1024, 1024, 16, 16, 128, True),
    "c2k": (8, 2048, 2048, 16, 16, 128, True),
    "d64c2kmha": (8, 2048, 2048, 12, 12, 64, True),  # the same without GQA
    "d64g4k": (4, 4096, 4096, 32, 8, 64, True),  # GQA 32/8 at n4096
    "dropc2k": (8, 2048, 2048, 16, 16, 128, True, 0.1),  # dropout (the Triton kernels under "triton")
    "dropc8k": (2, 8192, 8192, 16, 16, 128, True, 0.1),
    "dropf4k": (4, 4096, 4096, 16, 16, 128, False, 0.1),
    "drop2k": (4, 2048, 2048, 16, 4, 128, True, 0.1),  # configs/dropout.yaml's attention
    "drop64c8k": (2, 8192, 8192, 32, 32, 64, True, 0.1),  # head dim 64 with dropout
    "drop64f8k": (2, 8192, 8192, 32, 32, 64, False, 0.1),
    "drop64c2k": (8, 2048, 2048, 12, 4, 64, True, 0.1),  # configs/llama_125m.yaml's heads with dropout
    "drop64c1k": (8, 1024, 1024, 12, 4, 64, True, 0.1),  # short rows with dropout
    "drop64c512": (16, 512, 512, 14, 2, 64, True, 0.1),
}
# name: (document lengths, heads, kv heads, head dim, causal): varlen batches (bench_attention.varlen_lengths)
VARLEN_SHAPES = {
    "v64rows512": (varlen_lengths(low=64, high=512, seed=1, count=16), 14, 2, 64, True),  # the LoRA recipe's rows
    "v64docs1k": (varlen_lengths(total=16384, low=64, high=1024, seed=2), 12, 4, 64, True),  # short packed documents
    "v64docs1kmha": (varlen_lengths(total=16384, low=64, high=1024, seed=2), 16, 16, 64, True),
    "v64mix": (varlen_lengths(), 16, 16, 64, True),  # bench_attention.py's varlen mix
}
VARIANTS = {  # name: (Gluon dK/dV (None: config's choice of every kernel), the grid order: options' head_group)
    "default": (None, None),
    "triton": (False, None),
    "gluon": (True, None),
    "gluon heads first": (True, 0),
    "gluon blocks first": (True, 1),
}


def grads(q, k, v, dout, causal, gluon, gluon_fwd=False, gluon_dq=False, dropout_p=0.0):
    fields = {} if gluon is None else dict(gluon_dkdv=gluon, gluon_fwd=gluon_fwd, gluon_dq=gluon_dq)
    with options.override(**fields):
        out = flashpatch.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)


def numbered_extra(extras, prefix: str):
    """N of a "+<prefix>N" extra (e.g. "g4", "wr240"), or None."""
    values = [int(e[len(prefix):]) for e in extras if e.startswith(prefix) and e[len(prefix):].isdigit()]
    return values[0] if values else None


def extras_options(extras) -> dict:
    """The options.override settings of a variant's extras (module docstring)."""
    settings = {}
    for extra, name, value in (("pfwd", "persistent_fwd", True), ("npfwd", "persistent_fwd", False),
                               ("pdq", "persistent_dq", True), ("npdq", "persistent_dq", False),
                               ("snake", "causal_schedule", False), ("rkv", "register_kv", True),
                               ("norkv", "register_kv", False), ("fold", "fold_scale", True),
                               ("nofold", "fold_scale", False), ("serial", "concurrent_dq", False),
                               ("gdq", "gluon_dq", True), ("fdq", "fused_dq", True), ("nofdq", "fused_dq", False)):
        if extra in extras:
            settings[name] = value
    if "sepdq" in extras:  # the separate dQ pass where config takes atomic dQ (dropout without GQA)
        settings.update(atomic_dq=False, fused_dq=False)
    for prefix, name in (("wr", "dkdv_consumer_registers"), ("g", "head_group")):
        if numbered_extra(extras, prefix) is not None:
            settings[name] = numbered_extra(extras, prefix)
    return settings


def reference_grads(q, k, v, dout, causal, upcast):
    leaves = [t.detach().double().requires_grad_() if upcast else t.detach().clone().requires_grad_()
              for t in (q, k, v)]
    out, _ = reference.attention_reference(*leaves, causal=causal, upcast=upcast)
    return torch.autograd.grad(out, leaves, dout.double() if upcast else dout)


def check():
    torch.manual_seed(0)
    cases = [  # batch, Sq, Sk, H, Hk, D, causal, layout
        (2, 256, 256, 4, 4, 128, True, "bshd"), (2, 256, 256, 4, 4, 128, False, "bshd"),
        (1, 128, 384, 8, 2, 128, True, "bshd"), (2, 384, 128, 4, 1, 64, True, "bshd"),
        (2, 256, 256, 4, 4, 128, True, "bhsd"), (1, 1024, 1024, 6, 3, 64, False, "bhsd"),
        (1, 640, 1152, 4, 2, 128, True, "bshd16"), (3, 192, 192, 2, 2, 64, False, "bshd16"),
    ]
    ok = True
    for b, sq, sk, h, hk_, d, causal, layout in cases:
        dtype = torch.float16 if layout.endswith("16") else torch.bfloat16

        def make(s, heads):
            if layout == "bhsd":  # (B, H, S, D) in memory, seen as (B, S, H, D)
                return torch.randn(b, heads, s, d, device="cuda", dtype=dtype).transpose(1, 2)
            return torch.randn(b, s, heads, d, device="cuda", dtype=dtype)
        q, k, v = make(sq, h).requires_grad_(), make(sk, hk_).requires_grad_(), make(sk, hk_).requires_grad_()
        dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
        before = CALLS["n"]
        with options.override(persistent_dq=False):
            g_gluon = grads(q, k, v, dout, causal, True, gluon_dq=True)
        used = CALLS["n"] > before
        with options.override(persistent_dq=True):
            g_persistent = grads(q, k, v, dout, causal, True, gluon_dq=True)
        g_triton = grads(q, k, v, dout, causal, False)
        out_ref, lse_ref = reference.attention_reference(q, k, v, causal=causal, upcast=True)
        out_low, _ = reference.attention_reference(q, k, v, causal=causal, upcast=False)
        fwd_used = sq % 128 == 0 and sk % 128 == 0
        for persistent in (False, True):
            with options.override(gluon_fwd=True, persistent_fwd=persistent):
                out_g, lse_g = flashpatch.ops.attn_fwd(q.detach(), k.detach(), v.detach(), None, None, sq, sk, None,
                                                       0.0, d ** -0.5, -1, 0 if causal else -1, 0.0)
            e_out = (out_g.double() - out_ref).abs().max().item()
            e_low = (out_low.double() - out_ref).abs().max().item()
            lse_ok = torch.allclose(lse_g.double(), lse_ref.double(), rtol=1e-4, atol=1e-4)
            good = e_out <= 2 * e_low + 1e-5 and lse_ok and not torch.isnan(out_g).any().item()
            print(f"  forward{' persistent' if persistent else ''} (gluon {'used' if fwd_used else 'not used'}): "
                  f"out err {e_out:.2e} (bf16 torch {e_low:.2e}), lse close {lse_ok}{'' if good else ' FAIL'}",
                  flush=True)
            ok &= good
        g_ref = reference_grads(q, k, v, dout, causal, True)
        g_low = reference_grads(q, k, v, dout, causal, False)
        line = []
        for name, gg, gp, gt, gr, gl_ in zip("qkv", g_gluon, g_persistent, g_triton, g_ref, g_low):
            e_gluon = (gg.double() - gr).abs().max().item()
            e_persistent = (gp.double() - gr).abs().max().item()
            e_triton = (gt.double() - gr).abs().max().item()
            e_low = (gl_.double() - gr).abs().max().item()
            good = (max(e_gluon, e_persistent) <= 3 * e_low + 1e-5
                    and not (torch.isnan(gg).any().item() or torch.isnan(gp).any().item()))
            ok &= good
            line.append(f"d{name} {e_gluon:.2e}/{e_persistent:.2e}/{e_triton:.2e}/{e_low:.2e}{'' if good else ' FAIL'}")
        print(f"B{b} Sq{sq} Sk{sk} H{h}:{hk_} d{d} {'causal' if causal else 'full'} {layout} gluon used={used}: "
              f"max |err| vs fp64 gluon/gluon with persistent dQ/triton/bf16-torch: " + "; ".join(line), flush=True)
        ok &= used == (sk % hk.BLOCK_N == 0)  # 192 keys: not a multiple of the key tile, so the Triton kernel
    print("CHECK", "PASS" if ok else "FAIL", flush=True)


def timing_inputs(shape: str):
    """(q, k, v, dout, causal, dropout p, backward FLOPs, (cu_seqlens, longest document) or None) of a SHAPES or
    VARLEN_SHAPES entry."""
    if shape in VARLEN_SHAPES:
        lengths, h, hk_, d, causal = VARLEN_SHAPES[shape]
        q, k, v, dout, cu = varlen_batch(lengths, h, hk_, d)  # (T, H, D), (T, Hk, D)
        flops = 2.5 * 4 * h * d * sum(n * n for n in lengths) / (2 if causal else 1)
        return q, k, v, dout, causal, 0.0, flops, (cu, max(lengths))
    b, sq, sk, h, hk_, d, causal, *dropout = SHAPES[shape]
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hk_, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    flops = 2.5 * 4 * b * h * sq * sk * d / (2 if causal else 1)
    return q, k, v, dout, causal, (dropout or [0.0])[0], flops, None


def varlen_grads(q, k, v, dout, varlen, causal, gluon, gluon_fwd=False, gluon_dq=False):
    cu, longest = varlen
    fields = {} if gluon is None else dict(gluon_dkdv=gluon, gluon_fwd=gluon_fwd, gluon_dq=gluon_dq)
    with options.override(**fields):
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)


def timing(shapes, variants):
    print("| shape | variant | forward ms | fwd TFLOP/s | dK/dV ms | dQ ms | backward ms | bwd TFLOP/s |\n"
          "|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        q, k, v, dout, causal, dropout_p, flops, varlen = timing_inputs(shape)
        for name in variants:
            base, *extras = name.split("+")  # +fwd: the Gluon forward; +dq: the Gluon dQ
            gluon_fwd = bool({"fwd", "pfwd", "npfwd"} & set(extras))
            gluon_dq = bool({"dq", "pdq", "npdq"} & set(extras))
            gluon, order = VARIANTS[base]
            settings = {"head_group": order, **extras_options(extras)}

            def step():
                if varlen is not None:
                    varlen_grads(q, k, v, dout, varlen, causal, gluon, gluon_fwd, gluon_dq)
                else:
                    grads(q, k, v, dout, causal, gluon, gluon_fwd, gluon_dq, dropout_p)
            try:
                with options.override(**settings):
                    times = dict(kernel_times(step, iters=20))
            except Exception as err:  # noqa: BLE001 - a variant that does not build is a result
                print(f"| {shape} | {name} | failed: {type(err).__name__}: {str(err)[:200]} | | |", flush=True)
                continue
            dkdv = sum(t for key, t in times.items() if "dkdv" in key)
            dq_time = sum(t for key, t in times.items() if "_dq_" in key)
            bwd = sum(t for key, t in times.items() if key.startswith("attn_bwd"))
            if dq_time == 0:  # dQ fused into dK/dV: the fp32 buffer's zeroing and conversion are part of the backward
                bwd += sum(t for key, t in times.items() if not key.startswith("attn_"))
            fwd = sum(t for key, t in times.items() if key.startswith("attn_fwd"))
            print(f"| {shape} | {name} | {fwd:.3f} | {flops / 2.5 / fwd * 1e-9:.0f} | {dkdv:.3f} | {dq_time:.3f} | "
                  f"{bwd:.3f} | {flops / bwd * 1e-9:.0f} |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--shapes", default="1b,c4k,c8k,f4k,f8k,d64c8k",
                        help="SHAPES and VARLEN_SHAPES names, comma-separated")
    parser.add_argument("--variants", default="triton,gluon+fwd+dq")
    parser.add_argument("--check-extras", default="", help="extras for the check, e.g. nofold+norkv")
    parser.add_argument("--check-head-group", type=int, default=None,
                        help="the check's grid order (config.head_group); default: its rule")
    args = parser.parse_args()
    unknown = [name for name in args.shapes.split(",") if name not in SHAPES and name not in VARLEN_SHAPES]
    if unknown:
        raise ValueError(f"--shapes: {unknown} name no shape; SHAPES: {', '.join(SHAPES)}; VARLEN_SHAPES: "
                         f"{', '.join(VARLEN_SHAPES)}")
    if not args.skip_check:
        with options.override(head_group=args.check_head_group, **extras_options(args.check_extras.split("+"))):
            check()
    timing(args.shapes.split(","), args.variants.split(","))


if __name__ == "__main__":
    main()
