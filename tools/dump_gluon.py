"""Compile a Gluon Hopper kernel (flashpatch/kernels/sm90/fwd.py, dkdv.py, dkdv256.py, dq.py) for sm_90 without a
GPU and report shared memory, registers and spills, and the barriers in its PTX.

    PYTHONPATH=/tmp/t36 python tools/dump_gluon.py {dkdv,dkdv256,dq,fwd} [--headdim 128] [--causal] [--stages 2]
        [--dropout] [--alibi] [--persistent] [--set FOLD=1 --set REG_KV=1 ...]
(dkdv256 is head dim 256's dK/dV; dq takes --headdim 256 --block-n 32, as its launcher does.)
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from flashpatch.kernels import options  # noqa: E402
from flashpatch.kernels.sm90 import dkdv as hk  # noqa: E402
from flashpatch.kernels.sm90 import dkdv256 as hk256  # noqa: E402
from flashpatch.kernels.sm90 import dq as hq  # noqa: E402
from flashpatch.kernels.sm90 import fwd as hf  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kernel", choices=["dkdv", "dkdv256", "dq", "fwd"])
    parser.add_argument("--block-n", type=int, default=0)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--stages", type=int, default=0, help="0: the module's STAGES")
    parser.add_argument("--block-m", type=int, default=0)
    parser.add_argument("--head-group", type=int, default=1, help="grid order (config.head_group)")
    parser.add_argument("--dropout", action="store_true", help="dQ or dK/dV with dropout")
    parser.add_argument("--alibi", action="store_true", help="with ALiBi slopes")
    parser.add_argument("--key-tail", action="store_true", help="dK/dV: seqlen_k not a multiple of its key block")
    parser.add_argument("--varlen", action="store_true", help="the varlen form (a (sequence, block) table)")
    parser.add_argument("--persistent", action="store_true", help="the forward's or dQ's PERSISTENT variant")
    parser.add_argument("--window", action="store_true", help="the forward's or dQ's causal sliding window")
    parser.add_argument("--softcap", action="store_true", help="scores capped by softcap (sm90.common.softcap_tanh)")
    parser.add_argument("--consumers", type=int, default=0, help="the forward's consumer warpgroups (0: its rule)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=0|1",
                        help="a constexpr of the kernel (FOLD, REG_KV, LSE_FIRST); unset ones take the "
                             "launcher's choice for this head dim (dK/dV's REG_KV, LSE_FIRST), else 0")
    parser.add_argument("--out", default="runs/ir")
    args = parser.parse_args()
    d = args.headdim

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {d}],{layout!r}>"

    if args.kernel == "dkdv":
        fn, maxnreg = hk.attn_bwd_dkdv_hopper_kernel, hk.launch_maxnreg(args.dropout)
        bm = args.block_m or hk.BLOCK_M[d]
        vec = f"tensordesc<fp32[{bm}],{gl.NVMMASharedLayout.get_default_for([bm], gl.float32)!r}>"
        descs = {"q_desc": desc(bm), "do_desc": desc(bm), "k_desc": desc(hk.BLOCK_N), "v_desc": desc(hk.BLOCK_N),
                 "lse_desc": vec, "delta_desc": vec, "dk_desc": desc(hk.HALF_N), "dv_desc": desc(hk.HALF_N)}
        consts = dict(CAUSAL=args.causal, HEADDIM=d, BLOCK_M=bm, HALF_N=hk.HALF_N,
                      STAGES=args.stages or hk.STAGES,
                      HEAD_GROUP=args.head_group, REG_KV=hk.register_kv(d, args.dropout), LSE_FIRST=hk.lse_first(d),
                      CONSUMER_REGS=hk.consumer_registers(d, args.dropout),
                      PRODUCER_REGS=hk.worker_registers(args.dropout), FUSED_DQ=False, DROPOUT=args.dropout,
                      KEY_TAIL=args.key_tail or args.varlen, STORE_TMA=hk.stores_by_tma(args.dropout))
    elif args.kernel == "dkdv256":
        fn, maxnreg, d = hk256.attn_bwd_dkdv256_kernel, hk256.MAXNREG, hk256.HEADDIM
        bm = hk256.BLOCK_M
        vec = f"tensordesc<fp32[{bm}],{gl.NVMMASharedLayout.get_default_for([bm], gl.float32)!r}>"
        descs = {"q_desc": desc(bm), "do_desc": desc(bm), "k_desc": desc(hk256.BLOCK_N),
                 "v_desc": desc(hk256.BLOCK_N), "lse_desc": vec, "delta_desc": vec}
        consts = dict(CAUSAL=args.causal, HEADDIM=d, BLOCK_M=bm, BLOCK_N=hk256.BLOCK_N,
                      STAGES=args.stages or hk256.STAGES, HEAD_GROUP=args.head_group,
                      CONSUMER_REGS=hk256.CONSUMER_REGS, PRODUCER_REGS=hk256.PRODUCER_REGS,
                      KEY_TAIL=args.key_tail or args.varlen)
    elif args.kernel == "dq":
        fn, maxnreg = hq.attn_bwd_dq_hopper_kernel, hq.MAXNREG
        bn = args.block_n or hq.BLOCK_N
        descs = {"q_desc": desc(hq.BLOCK_M), "do_desc": desc(hq.BLOCK_M), "k_desc": desc(bn), "v_desc": desc(bn)}
        consts = dict(CAUSAL=args.causal, HEADDIM=d, HALF_M=hq.HALF_M, BLOCK_N=bn, STAGES=args.stages or hq.STAGES,
                      HEAD_GROUP=args.head_group, DROPOUT=args.dropout, PERSISTENT=args.persistent)
    else:
        fn, maxnreg = hf.attn_fwd_hopper_kernel, hf.MAXNREG
        consumers = args.consumers or (2 if args.persistent or args.dropout else hf.CONSUMERS_BY_HEADDIM[d])
        maxnreg, consumer_regs, worker_regs = hf.dropout_registers()
        if not args.dropout:
            maxnreg, consumer_regs, worker_regs = (hf.MAXNREG if consumers == 2 else hf.MAXNREG_3), 0, 0
        bn = args.block_n or hf.BLOCK_N
        descs = {"q_desc": desc(hf.BLOCK_M if consumers == 2 else hf.HALF_M), "k_desc": desc(bn), "v_desc": desc(bn),
                 "o_desc": desc(hf.HALF_M)}
        consts = dict(CAUSAL=args.causal, HEADDIM=d, HALF_M=hf.HALF_M, BLOCK_N=bn,
                      STAGES=args.stages or hf.STAGES, HEAD_GROUP=args.head_group, PERSISTENT=args.persistent,
                      CONSUMERS=consumers, DROPOUT=args.dropout, DRAWER_WARPS=hf.DRAWER_WARPS,
                      CONSUMER_REGS=consumer_regs, WORKER_REGS=worker_regs)
        if not args.dropout:
            consts.update(SEED_OFFSET=None)  # the launcher's None without dropout
        if not args.persistent:
            consts.update(o_desc=None)  # the launcher's None but for the persistent forms' TMA stores of O
        if not (args.persistent and args.causal and options.DEFAULT.causal_schedule):
            consts.update(SCHEDULE=None)  # the launcher's None but for a persistent causal grid's table
    consts.update(ALIBI=args.alibi, VARLEN=args.varlen)
    if "WINDOW" in fn.arg_names:
        consts.update(WINDOW=args.window)
    if "SOFTCAP" in fn.arg_names:
        consts.update(SOFTCAP=args.softcap)
    if not args.varlen:
        consts.update(CU_SEQLENS_Q=None, CU_SEQLENS_K=None, VARLEN_BLOCKS=None)
    if not (args.varlen and args.persistent):
        consts.update(TILE_COUNTER=None)  # the launcher's None but for a persistent varlen forward's counter
    flags = dict(item.split("=") for item in args.set)
    consts.update({name: bool(int(flags.pop(name, consts.get(name, 0)))) for name in fn.arg_names
                   if name.startswith(("REG_", "FOLD", "LSE_FIRST"))})
    consts.update({name: int(flags.pop(name)) for name in list(flags) if name in fn.arg_names})  # integer ones
    if flags:
        raise ValueError(f"--set names no constexpr of this kernel: {sorted(flags)}")
    if not args.alibi:
        consts.update(ALIBI_SLOPES=None)  # what the JIT makes of a None argument
    if args.kernel == "dkdv" and not consts.get("FUSED_DQ"):
        consts.update(dq_desc=None)  # no dQ buffer: the dK/dV kernel alone
    consts = {name: value for name, value in consts.items() if name in fn.arg_names}
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = descs[name]
        elif name == "dq_desc":
            sig[name] = (f"tensordesc<fp32[{bm}, 32],"
                         f"{gl.NVMMASharedLayout.get_default_for([bm, 32], gl.float32)!r}>")
        elif name in ("LSE", "DELTA", "ALIBI_SLOPES"):
            sig[name] = "*fp32"
        elif name in ("DK", "DV", "O", "DQ"):
            sig[name] = "*bf16"
        elif name.endswith("_rows"):
            sig[name] = ("i32", "i32")
        elif name in ("qk_scale", "cap_log2", "softmax_scale", "dropout_p"):
            sig[name] = "fp32"
        elif name == "SEED_OFFSET":
            sig[name] = "*i64"
        elif name in ("SCHEDULE", "CU_SEQLENS_Q", "CU_SEQLENS_K", "VARLEN_BLOCKS", "TILE_COUNTER"):
            sig[name] = "*i32"
        else:
            sig[name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in ("LSE", "DELTA", "DK", "DV", "O", "DQ") or name.startswith("stride_")}
    src = GluonASTSource(fn, sig, consts, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": maxnreg})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (f"{args.kernel}_gluon_d{d}{'_causal' if args.causal else ''}"
                  f"{f'_c{args.consumers}' if args.consumers else ''}{'_dropout' if args.dropout else ''}"
                  f"{'_alibi' if args.alibi else ''}{'_persistent' if args.persistent else ''}"
                  f"{'_tail' if args.key_tail else ''}{'_varlen' if args.varlen else ''}"
                  f"{'_window' if args.window else ''}{'_softcap' if args.softcap else ''}"
                  + "".join(f"_{item.split('=')[0].lower()}" for item in args.set if item.endswith("=1")))
    ptx = kernel.asm["ptx"]
    stem.with_suffix(".ttgir").write_text(kernel.asm["ttgir"])
    stem.with_suffix(".ptx").write_text(ptx)
    print(f"Triton {triton.__version__}: {stem}.ptx; shared memory {kernel.metadata.shared} B, "
          f"bar.sync {ptx.count('bar.sync')}, barrier.sync {ptx.count('barrier.sync')}, "
          f"wgmma.wait_group {ptx.count('wgmma.wait_group')}, setmaxnreg {ptx.count('setmaxnreg')}")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    run = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(stem.with_suffix(".ptx")), "-o", os.devnull],
                         capture_output=True, text=True)
    print("\n".join(line.strip() for line in (run.stdout + run.stderr).splitlines()
                    if "registers" in line or "spill" in line or "error" in line.lower()))


if __name__ == "__main__":
    main()
