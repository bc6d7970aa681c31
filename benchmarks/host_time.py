"""Host (Python) time per attention forward + backward, flashpatch against SDPA, at shapes whose GPU work is a few
microseconds, so that what is timed is the host's. GPU only.

    python benchmarks/host_time.py [--out results/latest] [--history results/history.csv] [--repeats 7]

Each case runs as a model's layer does: inputs that need grad, forward, backward with a given output gradient.
A figure is the median over `repeats` runs of the mean over `iters` calls (perf_counter around the loop; the GPU
is synchronized before and after, not inside). The implementations take turns run by run, so that a drift of the
host's speed (the GPU machines' CPUs vary by tens of percent over a minute) reaches them alike; the table gives the
spread of flashpatch / SDPA over the runs. Cases: dense causal rows (the 1B model's and the 121M model's
heads), the same with dropout 0.1, and a padded batch (flashpatch: flash_attn_varlen_func on unpadded tokens;
SDPA: a boolean padding mask; at the LoRA recipe's heads, 16 rows of 64-512 tokens), and that batch as a transformers
model's layer hands it to its attention function (transformers' sdpa function takes a 4-D mask; flashpatch's runs
these right-padded causal rows dense over their padding), once padded on the right and once on the left (which
flashpatch's function unpads around the kernels). flashpatch runs with its launch cache
(options.KernelOptions.cached_launch) and without it.

A lone forward + backward also pays autograd's hand-off: the engine runs a CUDA backward on a device thread of its
own, waking it and then the caller. A model's backward pays that once for all its layers, so the table also times
each call with the backward on the calling thread (`torch.autograd.set_multithreading_enabled(False)`): a layer's
share of a model's step, and a floor beside it: a Python autograd.Function that only allocates what it returns
(`AllocatesOnly`), which no implementation written as one can go under. Writes host_time.md and host_time.json to
--out, appends to --history, prints the table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "recipes"))
import flashpatch  # noqa: E402
from flashpatch.integrations.transformers import fpatch_attention_forward  # noqa: E402
from flashpatch.kernels import options  # noqa: E402

# name: (batch, seqlen, heads, kv heads, head dim)
SHAPES = {"d128 GQA 16/4": (1, 128, 16, 4, 128), "d64 GQA 12/4": (1, 128, 12, 4, 64)}
LORA = (16, 512, 14, 2, 64)  # configs/lora_qwen2_0p5b.yaml's rows and heads: its padded case only


def host_us(steps: dict, iters: int, repeats: int) -> dict:
    """{name: median us per call} of each step, the steps taking turns: run r of every step before run r + 1 of
    any. Also {name + " runs": [us per call of each run]}."""
    for step in steps.values():
        for _ in range(10):
            step()
    torch.cuda.synchronize()
    runs = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(iters):
                step()
            runs[name].append((time.perf_counter() - start) / iters * 1e6)
            torch.cuda.synchronize()
    return {**{name: statistics.median(r) for name, r in runs.items()}, **{f"{n} runs": r for n, r in runs.items()}}


def uncached(step):
    def run():
        with options.override(cached_launch=False):
            step()
    return run


def on_this_thread(step):
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            step()
    return run


class AllocatesOnly(torch.autograd.Function):
    """The floor of any attention written as a Python autograd.Function: forward and backward allocate what they
    return (out and an LSE; dq, dk, dv) and launch nothing."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q), torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def floor(q, k, v, dout):
    return lambda: AllocatesOnly.apply(q, k, v)[0].backward(dout)


def cases(shape, padded_only=False):
    b, s, h, hk, d = shape
    dev, dt = "cuda", torch.bfloat16
    # padded: two rows, the second half padding; a batch of more rows: lengths from s / 8 to s, the first full
    generator = torch.Generator().manual_seed(0)
    lengths = (torch.tensor([s, s // 2]) if b == 1 else
               torch.cat([torch.tensor([s]), torch.randint(s // 8, s + 1, (b - 1,), generator=generator)]))
    lengths = lengths.to(device=dev, dtype=torch.int32)
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    total = int(lengths.sum())
    qv = torch.randn(total, h, d, device=dev, dtype=dt, requires_grad=True)
    kv_, vv = (torch.randn(total, hk, d, device=dev, dtype=dt, requires_grad=True) for _ in "kv")
    doutv = torch.randn(total, h, d, device=dev, dtype=dt)
    rows = lengths.numel()
    qp, kp, vp = (torch.randn(rows, x, s, d, device=dev, dtype=dt, requires_grad=True) for x in (h, hk, hk))
    doutp = torch.randn(rows, h, s, d, device=dev, dtype=dt)
    keep = torch.arange(s, device=dev)[None, :] < lengths[:, None].long()  # (B, S) keys that are real
    causal = torch.ones(s, s, device=dev, dtype=torch.bool).tril()
    mask = (keep[:, None, None, :] & causal)  # (B, 1, S, S)
    left = keep.flip(1)  # the same rows padded on the left, which flashpatch always unpads
    left_mask = left[:, None, None, :] & causal

    # the same batch as a transformers model's layer hands it over: (B, H, S, D) states and the model's mask (a 2-D
    # padding mask for fpatch, which runs these right-padded causal rows dense, and unpads them once padded on the
    # left; 4-D for sdpa)
    layer = torch.nn.Module()
    layer.is_causal, layer.num_key_value_groups = True, h // hk
    doutl = doutp.transpose(1, 2)  # (B, S, H, D), as both functions return

    def through_transformers(attend, layer_mask):
        return lambda: attend(layer, qp, kp, vp, layer_mask, scaling=d ** -0.5, is_causal=True)[0].backward(doutl)

    padded = {"padded": (lambda: flashpatch.flash_attn_varlen_func(qv, kv_, vv, cu, cu, s, s, causal=True)
                         .backward(doutv),
                         lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
                         .backward(doutp), floor(qv, kv_, vv, doutv)),
              "padded, a transformers layer": (through_transformers(fpatch_attention_forward, keep),
                                               through_transformers(sdpa_attention_forward, mask),
                                               floor(qv, kv_, vv, doutv)),
              "padded on the left, a transformers layer": (through_transformers(fpatch_attention_forward, left),
                                                           through_transformers(sdpa_attention_forward, left_mask),
                                                           floor(qv, kv_, vv, doutv))}
    if padded_only:
        return padded
    q = torch.randn(b, s, h, d, device=dev, dtype=dt, requires_grad=True)
    k, v = (torch.randn(b, s, hk, d, device=dev, dtype=dt, requires_grad=True) for _ in "kv")
    dout = torch.randn(b, s, h, d, device=dev, dtype=dt)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))  # SDPA's (B, H, S, D)
    doutt = dout.transpose(1, 2)

    def fp_dense(p=0.0):
        return lambda: flashpatch.flash_attn_func(q, k, v, dropout_p=p, causal=True).backward(dout)

    def sdpa_dense(p=0.0):
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=True,
                                                      enable_gqa=True).backward(doutt)
    return {"dense": (fp_dense(), sdpa_dense(), floor(q, k, v, dout)),
            "dropout 0.1": (fp_dense(0.1), sdpa_dense(0.1), floor(q, k, v, dout)), **padded}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "results" / "latest"))
    parser.add_argument("--history", default=str(REPO / "results" / "history.csv"))
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    import history
    import triton

    rows = []
    runs = [(name, shape, cases(shape)) for name, shape in SHAPES.items()]
    runs.append((f"d64 GQA 14/2, {LORA[0]} rows of <= {LORA[1]}", LORA, cases(LORA, padded_only=True)))
    for shape_name, shape, shape_cases in runs:
        for case, (fp, sdpa, alloc_only) in shape_cases.items():
            t = host_us({"fpatch": fp, "fpatch_uncached": uncached(fp), "sdpa": sdpa,
                         "fpatch_thread": on_this_thread(fp), "sdpa_thread": on_this_thread(sdpa),
                         "floor_thread": on_this_thread(alloc_only)},
                        args.iters, args.repeats)
            ratios = [a / b for a, b in zip(t["fpatch runs"], t["sdpa runs"])]
            rows.append(dict(shape=shape_name, case=case, fpatch=t["fpatch"], fpatch_uncached=t["fpatch_uncached"],
                             sdpa=t["sdpa"], ratio_min=min(ratios), ratio_max=max(ratios),
                             fpatch_thread=t["fpatch_thread"], sdpa_thread=t["sdpa_thread"],
                             floor_thread=t["floor_thread"]))
            print(f"{shape_name} {case}: fpatch {t['fpatch']:.0f} us (no launch cache {t['fpatch_uncached']:.0f}, "
                  f"on this thread {t['fpatch_thread']:.0f}), sdpa {t['sdpa']:.0f} (on this thread "
                  f"{t['sdpa_thread']:.0f})", file=sys.stderr, flush=True)
    lines = [f"## Host time per attention forward + backward, {gpu}", "",
             f"torch {torch.__version__}, Triton {triton.__version__}, bf16, causal; median of {args.repeats} runs of "
             f"{args.iters} calls, the implementations taking turns (`python benchmarks/host_time.py`). \"on the "
             "calling thread\": autograd's backward run there, a layer's share of a model's backward (the engine's "
             "hand-off to its device thread, paid once per backward call, left out). \"floor\": a Python "
             "autograd.Function whose forward and backward only allocate what they return, on the calling thread", "",
             "| heads | case | flashpatch us | flashpatch, no launch cache us | SDPA us | flashpatch / SDPA (runs) | "
             "on the calling thread: flashpatch / SDPA / floor us |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['case']} | {r['fpatch']:.0f} | {r['fpatch_uncached']:.0f} | {r['sdpa']:.0f} "
                     f"| {r['fpatch'] / r['sdpa']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) "
                     f"| {r['fpatch_thread']:.0f} / {r['sdpa_thread']:.0f} / {r['floor_thread']:.0f} |")
    table = "\n".join(lines)
    figures = []
    for r in rows:
        case = f"host time {r['shape']} {r['case']}"
        figures += [(case, "fpatch", "host_us", r["fpatch"]),
                    (case, "fpatch_uncached", "host_us", r["fpatch_uncached"]),
                    (case, "sdpa", "host_us", r["sdpa"]),
                    (case, "fpatch", "host_us_calling_thread", r["fpatch_thread"]),
                    (case, "sdpa", "host_us_calling_thread", r["sdpa_thread"]),
                    (case, "autograd_floor", "host_us_calling_thread", r["floor_thread"])]
    history.save_benchmark(args.out, "host_time", table, rows, figures, gpu=gpu, torch_version=torch.__version__,
                           triton_version=triton.__version__, history_path=args.history)
    print(table)


if __name__ == "__main__":
    main()
