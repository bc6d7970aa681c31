"""Compile one kernel variant for sm_90 on a machine without a GPU and report what decides its speed: shared memory,
pipelined loads, which matmuls are waited for at once, and (with the bundled ptxas) registers and spills.

    python tools/dump_ir.py dkdv --tile 64 128 --warps 8 --stages 3 --causal [--dropout] [--tma] [--dp-first]
    PYTHONPATH=/tmp/t36 python tools/dump_ir.py fwd ...   # Triton 3.6, the GPU's: pip install --target /tmp/t36

The TTGIR and PTX go to --out (default runs/ir/). Kernels compile with the alignment hints of a real launch
(compile_check.launch_hints), without which Triton pipelines no load. Compare register counts
between variants only: the GPU build reported fewer (the d128 causal forward: 182 there, 225 here).
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402

from compile_check import compile_one, feature_constexprs, launch_constexprs  # noqa: E402
from flashpatch.kernels.triton.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel  # noqa: E402
from flashpatch.kernels.config import LaunchConfig  # noqa: E402
from flashpatch.kernels.triton.forward import attn_fwd_kernel  # noqa: E402

KERNELS = {"fwd": attn_fwd_kernel, "dkdv": attn_bwd_dkdv_kernel, "dq": attn_bwd_dq_kernel}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kernel", choices=sorted(KERNELS))
    parser.add_argument("--tile", type=int, nargs=2, default=(128, 64), metavar=("BLOCK_M", "BLOCK_N"))
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dropout", action="store_true")
    parser.add_argument("--tma", action="store_true")
    parser.add_argument("--atomic-dq", action="store_true")
    parser.add_argument("--dp-first", action="store_true")
    parser.add_argument("--out", default="runs/ir")
    args = parser.parse_args()
    fn = KERNELS[args.kernel]
    cfg = LaunchConfig(*args.tile, args.warps, args.stages, tma=args.tma, dp_first=args.dp_first)
    flags = {**feature_constexprs(args.headdim, right=args.causal, dropout=args.dropout),
             **launch_constexprs(fn, cfg, even=True)}
    if args.kernel == "dkdv":
        flags["ATOMIC_DQ"] = args.atomic_dq
    kernel = compile_one(fn, "bf16", flags, 90, cfg.num_warps, cfg.num_stages)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{args.kernel}_{args.tile[0]}x{args.tile[1]}_w{args.warps}_s{args.stages}"
    stem.with_suffix(".ttgir").write_text(ttgir)
    stem.with_suffix(".ptx").write_text(ptx)
    print(f"Triton {triton.__version__}: {stem}.ttgir / .ptx")
    print(f"shared memory {kernel.metadata.shared} B; pipelined loads {ttgir.count('async_copy_global_to_local')} "
          f"(+{ttgir.count('async_tma_copy_global_to_local')} TMA), unpipelined tile loads {ttgir.count('tt.load')}")
    print(f"matmuls {len(re.findall(r'ttng.warp_group_dot ', ttgir))}, waits until none is in flight "
          f"{ttgir.count('pendings = 0')}; layout conversions {ttgir.count('ttg.convert_layout')}; "
          f"Philox multiplies (mul.hi) {ptx.count('mul.hi.u32')}")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if ptxas.exists():
        run = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(stem.with_suffix(".ptx")), "-o", os.devnull],
                             capture_output=True, text=True)
        report = run.stdout + run.stderr
        if run.returncode:
            print(f"ptxas failed: {report.strip().splitlines()[0]}")
        print("\n".join(line.strip() for line in report.splitlines() if "registers" in line or "spill" in line))
    else:
        print(f"no ptxas at {ptxas}: registers not reported")


if __name__ == "__main__":
    main()
