"""Compile the Gluon Hopper dK/dV kernel (flashpatch/kernels/hopper_dkdv.py) for sm_90 without a GPU and report
shared memory, registers and spills, and the barriers in its PTX.

    PYTHONPATH=/tmp/t36 python scripts/dump_gluon.py [--headdim 128] [--causal] [--stages 2] [--maxnreg 168]
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

from flashpatch.kernels import hopper_dkdv as hk  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--stages", type=int, default=hk.STAGES)
    parser.add_argument("--maxnreg", type=int, default=hk.MAXNREG)
    parser.add_argument("--no-carry", action="store_true")
    parser.add_argument("--block-m", type=int, default=0)
    parser.add_argument("--out", default="runs/ir")
    args = parser.parse_args()
    d = args.headdim
    bm = args.block_m or hk.BLOCK_M[d]
    q_layout = gl.NVMMASharedLayout.get_default_for([bm, d], gl.bfloat16)
    k_layout = gl.NVMMASharedLayout.get_default_for([hk.BLOCK_N, d], gl.bfloat16)
    qd = f"tensordesc<bf16[{bm}, {d}],{q_layout!r}>"
    kd = f"tensordesc<bf16[{hk.BLOCK_N}, {d}],{k_layout!r}>"
    fn = hk.attn_bwd_dkdv_hopper_kernel
    consts = dict(CAUSAL=args.causal, HEADDIM=d, BLOCK_M=bm, HALF_N=hk.HALF_N, STAGES=args.stages, CARRY=not args.no_carry and hk.CARRY,
                  HEADS_FASTEST=args.causal)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("q_desc", "do_desc"):
            sig[name] = qd
        elif name in ("k_desc", "v_desc"):
            sig[name] = kd
        elif name in ("LSE", "DELTA"):
            sig[name] = "*fp32"
        elif name in ("DK", "DV"):
            sig[name] = "*bf16"
        elif name.endswith("_rows"):
            sig[name] = ("i32", "i32")
        elif name in ("qk_scale", "softmax_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in ("LSE", "DELTA", "DK", "DV")}
    src = GluonASTSource(fn, sig, consts, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": args.maxnreg})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"dkdv_gluon_d{d}{'_causal' if args.causal else ''}"
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
