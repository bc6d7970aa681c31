"""Host time of two revisions of flashpatch in one process, taking turns: this checkout against BASE_REV.

    python tools/host_ab.py BASE_REV [--rounds 15] [--cases left_d128,left_lora] [--check]

On the GPU machines a process's host speed moves by tens of percent from one process to the next, which hides a
change of 10-20% when two revisions run in processes of their own. Here BASE_REV's flashpatch is copied (git archive)
into a temporary folder as the package `flashpatch_base`, its imports and custom-op namespace renamed, and imported
beside this checkout's. Each case's forward + backward then runs for both, `rounds` times, the order alternating
from round to round. Printed per case: the medians (us per call) and the median of the rounds' ratios this
checkout / BASE_REV, with its quartiles, on the calling thread (autograd's backward run there: a layer's share of a
model's step) and in wall time; the two revisions' gradients are checked to agree first.

Cases (CASES): dense causal rows through flash_attn_func, and a transformers layer's attention function
(integrations.transformers.fpatch_attention_forward) on rows padded on the left (which it unpads), at the 1B and
121M models' heads and the LoRA recipe's rows; and padded rows the function unpads at full size (its dense bound
set to 0). GPU only; --check runs one tiny case of each revision once on the CPU (the Triton interpreter) and
prints what both returned, a check of the copy.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = "flashpatch_base"


def rename_package(text: str, name: str = BASE) -> str:
    """A flashpatch source file's text as package `name`: its imports of flashpatch and its torch.library
    namespace (a second registration of "flashpatch::attn_fwd" in one process would fail)."""
    text = re.sub(r"\b(from|import) flashpatch(?=[.\s])", rf"\1 {name}", text)
    return text.replace('"flashpatch::', f'"{name}::').replace("torch.ops.flashpatch.", f"torch.ops.{name}.")


def base_package(rev: str, into: Path) -> Path:
    """BASE_REV's flashpatch/ as into/flashpatch_base/, renamed (`rename_package`); returns `into`."""
    archive = subprocess.run(["git", "archive", rev, "flashpatch"], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / BASE
    (into / "flashpatch").rename(package)
    for path in package.rglob("*.py"):
        text = rename_package(path.read_text())
        left = re.search(r"^\s*(from|import) flashpatch\b(?!_)", text, re.MULTILINE)
        if left:  # an import the renaming missed would run this checkout's code inside the base package
            raise RuntimeError(f"{path.relative_to(into)}: an import of flashpatch was not renamed: {left.group(0)!r}")
        path.write_text(text)
    return into


# name: (batch, seqlen, heads, kv heads, head dim, real lengths or None for dense rows, padding side, iters)
CASES = {
    "dense_d128": (1, 128, 16, 4, 128, None, None, 100),
    "dense_d64": (1, 128, 12, 4, 64, None, None, 100),
    "left_d128": (2, 128, 16, 4, 128, [128, 64], "left", 100),
    "left_d64": (2, 128, 12, 4, 64, [128, 64], "left", 100),
    "left_lora": (16, 512, 14, 2, 64, "lora", "left", 50),
    "unpadded_d64_1k": (8, 1024, 14, 2, 64, [1024] + [300] * 7, "right", 30),
    "unpadded_d128_1k": (16, 1024, 32, 8, 128, [1024] + [164] * 15, "right", 20),
}


def make_step(package, case, device: str, dtype):
    """(the case's forward + backward for `package`, its leaves)."""
    import torch

    batch, seqlen, heads, kv_heads, headdim, lengths, side, _ = case
    hf = sys.modules[package.__name__ + ".integrations.transformers"]
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, h, seqlen, headdim, device=device, dtype=dtype, generator=generator)
               .requires_grad_() for h in (heads, kv_heads, kv_heads))  # (B, H, S, D), as a layer hands them over
    dout = torch.randn(batch, seqlen, heads, headdim, device=device, dtype=dtype, generator=generator)
    if lengths is None:
        qd, kd, vd = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D)
        return (lambda: package.flash_attn_func(qd, kd, vd, causal=True).backward(dout)), (q, k, v)
    if lengths == "lora":  # configs/lora_qwen2_0p5b.yaml's rows: the first full, the rest 64..512
        lengths = [seqlen] + torch.randint(64, seqlen + 1, (batch - 1,), generator=torch.Generator().manual_seed(0))\
            .tolist()
    keep = torch.arange(seqlen, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    mask = (keep.flip(1) if side == "left" else keep).long()
    hf.dense_pairs_bound = lambda seqlen, headdim: 0.0  # unpadded whatever the side
    layer = torch.nn.Module()
    layer.is_causal, layer.num_key_value_groups = True, heads // kv_heads

    def step():
        out, _ = hf.fpatch_attention_forward(layer, q, k, v, mask, scaling=headdim ** -0.5, is_causal=True)
        out.backward(dout)
    return step, (q, k, v)


def timed(step, iters: int, calling_thread: bool) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autograd.set_multithreading_enabled(not calling_thread):
        for _ in range(iters):
            step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("base", help="the revision to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cases", default=",".join(CASES), help="CASES names, comma-separated")
    parser.add_argument("--check", action="store_true", help="CPU: one tiny call of each revision, no timing")
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; known: {list(CASES)}")
    if args.check:
        os.environ["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        sys.path.insert(0, str(base_package(args.base, Path(folder))))
        sys.path.insert(0, str(REPO))
        import torch

        import flashpatch
        base = __import__(BASE)
        flashpatch.integrations.transformers.register()  # "fpatch" back to this checkout's function
        assert Path(flashpatch.__file__).is_relative_to(REPO) and Path(base.__file__).is_relative_to(folder)
        if args.check:
            for name, lengths in (("dense_d64", None), ("left_d64", [8, 3])):
                tiny = (2, 8, 2, 1, 16, lengths, CASES[name][6], 1)
                for package in (base, flashpatch):
                    step, leaves = make_step(package, tiny, "cpu", torch.float32)
                    step()
                    print(f"{name} {package.__name__}: grad norms {[round(float(t.grad.norm()), 4) for t in leaves]}")
            return 0
        print(f"{torch.cuda.get_device_name()}: this checkout against {args.base}, {args.rounds} rounds", flush=True)
        for name in names:
            case = CASES[name]
            steps = {label: make_step(package, case, "cuda", torch.bfloat16)
                     for label, package in (("base", base), ("new", flashpatch))}
            for step, _ in steps.values():
                for _ in range(5):
                    step()
            for a, b in zip(steps["base"][1], steps["new"][1]):  # the same accumulated gradients, up to atomics' order
                torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)
            for calling_thread in (True, False):
                runs = {"base": [], "new": []}
                for r in range(args.rounds):
                    for label in (("base", "new") if r % 2 == 0 else ("new", "base")):
                        runs[label].append(timed(steps[label][0], case[7], calling_thread))
                ratios = [n / b for b, n in zip(runs["base"], runs["new"])]
                q1, median, q3 = statistics.quantiles(ratios, n=4)
                print(f"{name:18s} {'calling thread' if calling_thread else 'wall':14s} "
                      f"base {statistics.median(runs['base']):7.1f} us  new {statistics.median(runs['new']):7.1f} us"
                      f"  new / base {median:.3f} (quartiles {q1:.3f}-{q3:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
