"""The Gluon Hopper kernels (flashpatch/kernels/hopper_{fwd,dkdv,dq}.py) against the Triton ones: outputs, LSE and
gradients against the float64 reference, then GPU kernel time (torch profiler) per variant. GPU only (sm_90).

    python scripts/gluon_check.py [--skip-check] [--shapes 1b,c8k,f8k] [--variants "triton,gluon+fwd+dq"]

A variant is a VARIANTS entry (Gluon dK/dV or not, its stages, its grid order) plus "+fwd" (the Gluon forward,
its grid form as config.persistent_grid chooses), "+pfwd" / "+npfwd" (the Gluon forward as a persistent grid or as
one program per query block, hopper_fwd.PERSISTENT), "+snake" (a persistent causal forward's blocks by the closed
form, not schedule.causal_schedule's table: hopper_fwd.CAUSAL_SCHEDULE), "+eager_pv" (the persistent forward's
one-step loop, each P V waited for in its own step: hopper_fwd.LAZY_PV off), "+dq" / "+dq128" (the Gluon dQ, 64- or
128-key steps), "+pdq" / "+npdq" (the Gluon dQ's grid forced, hopper_dq.PERSISTENT), "+m128" (the d64 Gluon dK/dV
with 128-query steps), "+gN" (every kernel's grid in head groups of N, config.head_group; g0: all heads in one
group; a persistent grid orders causal blocks its own way), and round 28's register operands and folded scale:
"+fold" / "+nofold" (config.KernelConfigs.fold_scale), "+rkv" / "+norkv" (hopper_dkdv.REGISTER_KV forced on or
off), "+wrN" (the dK/dV worker consumer's setmaxnreg count, hopper_dkdv.CONSUMER_REGISTERS, e.g. "+wr240"),
"+c3" / "+c2" (the d64 Gluon forward with three or two consumer warpgroups,
hopper_fwd.CONSUMERS_BY_HEADDIM), "+serial" (dQ after dK/dV, not beside it: each kernel's own time), "+gdq" (the
Gluon dQ under the "default" base) and "+fdq" / "+nofdq" (dQ added by the d128 Gluon dK/dV itself or by the separate
pass, config.KernelConfigs.fused_dq; its backward column counts the fp32 buffer's zeroing and conversion), "+sepdq"
(the separate dQ pass where config takes atomic dQ: dropout without GQA) and "+nophilox" (a probe: the d128 dK/dV's
dropout drawers write all-kept words without drawing, hopper_dkdv.DRAWER_PHILOX; NOTES.md v51). Its
measured losers, removed since: "+rq" (the forward's Q, and "+rqdo" the dQ kernel's Q and dO, held in registers as
matmul operands), "+rk" (K alone), "+c3dk" and "+c3dq" (three consumer warpgroups in the d64 dK/dV and dQ: NOTES.md
v37, v38), "+ahN" (the dK/dV step's LSE read a step ahead, v45), "+adq" (v46's atomic dQ fused into the d128 Gluon
dK/dV; v47's fused dQ is "+fdq"). The base "default" runs each kernel that config chooses (no override).
--check-extras applies such extras (e.g. "nofold+norkv") to the float64 check. Round 17's logs also name variants
since removed: "carry" (dK/dV left in flight into the next step) and "fwdskew" (the forward's intra-warpgroup skew),
NOTES.md v19.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashpatch  # noqa: E402
from flashpatch import reference  # noqa: E402
from flashpatch.kernels import config as kc  # noqa: E402
from flashpatch.kernels.sm90 import dkdv as hk  # noqa: E402
from flashpatch.kernels.sm90 import dq as hq  # noqa: E402
from flashpatch.kernels.sm90 import fwd as hf  # noqa: E402
from profile_kernels import kernel_times  # noqa: E402

CALLS = {"n": 0}
CONSUMERS_D64 = hf.CONSUMERS_BY_HEADDIM[64]
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
    "d64c2kmha": (8, 2048, 2048, 12, 12, 64, True),  # the same without GQA
    "d64g4k": (4, 4096, 4096, 32, 8, 64, True),  # GQA 32/8 at n4096
    "dropc2k": (8, 2048, 2048, 16, 16, 128, True, 0.1),  # dropout (the Triton kernels under "triton")
    "dropc8k": (2, 8192, 8192, 16, 16, 128, True, 0.1),
    "dropf4k": (4, 4096, 4096, 16, 16, 128, False, 0.1),
    "drop2k": (4, 2048, 2048, 16, 4, 128, True, 0.1),  # configs/dropout.yaml's attention
}
VARIANTS = {  # name: (Gluon dK/dV (None: config's choice of every kernel), its stages, its grid order)
    "default": (None, 2, None),
    "triton": (False, 2, None),
    "gluon": (True, 2, None),
    "gluon s3": (True, 3, None),
    "gluon heads first": (True, 2, 0),
    "gluon blocks first": (True, 2, 1),
}


def grads(q, k, v, dout, causal, gluon, gluon_fwd=False, gluon_dq=False, dropout_p=0.0):
    fields = {} if gluon is None else dict(gluon_dkdv=gluon, gluon_fwd=gluon_fwd, gluon_dq=gluon_dq)
    with kc.override(**fields):
        out = flashpatch.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)


def numbered_extra(extras, prefix: str):
    """N of a "+<prefix>N" extra (e.g. "g4", "wr240"), or None."""
    values = [int(e[len(prefix):]) for e in extras if e.startswith(prefix) and e[len(prefix):].isdigit()]
    return values[0] if values else None


def apply_round28_extras(extras) -> dict:
    """Round 28's kernel flags from a variant's extras (module docstring): sets the module-level ones and returns the
    KernelConfigs fields for kc.override."""
    hk.REGISTER_KV = True if "rkv" in extras else False if "norkv" in extras else None
    hk.CONSUMER_REGISTERS = numbered_extra(extras, "wr")
    hf.CONSUMERS_BY_HEADDIM[64] = 3 if "c3" in extras else 2 if "c2" in extras else CONSUMERS_D64
    fields = {"fold_scale": e == "fold" for e in extras if e in ("fold", "nofold")}
    if "serial" in extras:  # dQ after dK/dV, so each kernel's time is its own
        fields["concurrent_dq"] = False
    if "gdq" in extras:  # the Gluon dQ under the "default" base
        fields["gluon_dq"] = True
    if "sepdq" in extras:  # the separate dQ pass where config takes atomic dQ (dropout without GQA)
        fields.update(atomic_dq=False, fused_dq=False)
    hk.DRAWER_PHILOX = "nophilox" not in extras  # probe: the dK/dV drawers write all-kept words without drawing
    if "fdq" in extras or "nofdq" in extras:  # dQ inside the d128 Gluon dK/dV (hopper_dkdv.fuses_dq) or not
        fields["fused_dq"] = "fdq" in extras
    return fields


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
        hq.PERSISTENT = False
        g_gluon = grads(q, k, v, dout, causal, True, gluon_dq=True)
        used = CALLS["n"] > before
        hq.PERSISTENT = True
        g_persistent = grads(q, k, v, dout, causal, True, gluon_dq=True)
        hq.PERSISTENT = None
        g_triton = grads(q, k, v, dout, causal, False)
        out_ref, lse_ref = reference.attention_reference(q, k, v, causal=causal, upcast=True)
        out_low, _ = reference.attention_reference(q, k, v, causal=causal, upcast=False)
        fwd_used = sq % 128 == 0 and sk % 128 == 0
        for persistent in (False, True):
            hf.PERSISTENT = persistent
            with kc.override(gluon_fwd=True):
                out_g, lse_g = flashpatch.ops.attn_fwd(q.detach(), k.detach(), v.detach(), None, None, sq, sk, None,
                                                       0.0, d ** -0.5, -1, 0 if causal else -1, 0.0)
            hf.PERSISTENT = None
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


def timing(shapes, variants):
    print("| shape | variant | forward ms | fwd TFLOP/s | dK/dV ms | dQ ms | backward ms | bwd TFLOP/s |\n"
          "|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        b, sq, sk, h, hk_, d, causal, *dropout = SHAPES[shape]
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, sk, hk_, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        flops = 2.5 * 4 * b * h * sq * sk * d / (2 if causal else 1)
        for name in variants:
            base, *extras = name.split("+")  # +fwd: the Gluon forward; +dq, +dq128: the Gluon dQ
            gluon_fwd = bool({"fwd", "pfwd", "npfwd"} & set(extras))
            hf.PERSISTENT = True if "pfwd" in extras else False if "npfwd" in extras else None
            hf.CAUSAL_SCHEDULE = "snake" not in extras
            hf.LAZY_PV = "eager_pv" not in extras
            gluon_dq = any(e.startswith(("dq", "pdq", "npdq")) for e in extras)
            hq.BLOCK_N = 128 if "dq128" in extras else 64
            hq.PERSISTENT = True if "pdq" in extras else False if "npdq" in extras else None
            gluon, hk.STAGES, order = VARIANTS[base]
            fields = apply_round28_extras(extras)
            hk.BLOCK_M[64] = 128 if "m128" in extras else 64  # +m128: 128-query steps in the d64 Gluon dK/dV
            group = numbered_extra(extras, "g")
            kc.HEAD_GROUP_OVERRIDE = order if group is None else group

            def step():
                grads(q, k, v, dout, causal, gluon, gluon_fwd, gluon_dq, *dropout)
            try:
                with kc.override(**fields):
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
    parser.add_argument("--shapes", default="1b,c4k,c8k,f4k,f8k,d64c8k")
    parser.add_argument("--variants", default="triton,gluon+fwd+dq")
    parser.add_argument("--check-extras", default="", help="round 28's flags for the check, e.g. nofold+norkv")
    parser.add_argument("--check-head-group", type=int, default=None,
                        help="the check's grid order (config.head_group); default: its rule")
    args = parser.parse_args()
    if not args.skip_check:
        kc.HEAD_GROUP_OVERRIDE = args.check_head_group
        with kc.override(**apply_round28_extras(args.check_extras.split("+"))):
            check()
    timing(args.shapes.split(","), args.variants.split(","))


if __name__ == "__main__":
    main()
