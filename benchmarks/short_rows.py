"""GPU time of short causal rows without the host: flashpatch against SDPA's cuDNN backend, each call captured in a
CUDA graph and replayed, forward alone and forward + backward. GPU only.

    python benchmarks/short_rows.py [--out results/latest] [--history results/history.csv] [--iters 30]

At rows of 512-2048 a call's kernels run for tens to hundreds of microseconds, about as long as the host takes to
launch them (host_time.py), so timing calls back to back (bench_attention.py's do_bench) times the host as much as
the kernels. A graph replay launches the captured kernels without the host's per-call work. A figure is the median
of five runs of `iters` replays (CUDA events), in TFLOP/s of useful FLOPs (causal: half). bf16, inputs (B, S, H, D)
for flashpatch and (B, H, S, D) for SDPA, as each takes them. Writes short_rows.md and short_rows.json to --out,
appends to --history, prints the table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "recipes"))
import flashpatch  # noqa: E402

CASES = [  # (batch, seqlen, heads, K/V heads, head dim): B * S = 16k tokens
    (32, 512, 16, 16, 128), (16, 1024, 16, 16, 128), (8, 2048, 16, 16, 128), (4, 4096, 16, 16, 128),
    (16, 1024, 32, 8, 128), (8, 2048, 32, 8, 128),
    (16, 1024, 12, 4, 64), (8, 2048, 12, 4, 64), (4, 4096, 32, 32, 64),
]


def replay_ms(step, leaves, iters: int) -> float:
    """Median ms of one replay of step() captured in a CUDA graph (warmed up on a side stream first, as capture
    requires; leaves' gradients cleared so that the captured backward writes fresh ones)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[len(times) // 2]


def measure(case, iters: int) -> dict:
    """A CASES entry's four figures: flashpatch's and cuDNN's forward and forward + backward ms."""
    batch, seqlen, heads, kv_heads, headdim = case
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen, heads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, kv_heads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))  # (B, H, S, D)
    doutt = dout.transpose(1, 2).contiguous()
    gqa = heads != kv_heads

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)

    ms = {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        with torch.no_grad():
            ms["fpatch fwd"] = replay_ms(lambda: flashpatch.flash_attn_func(q, k, v, causal=True), (), iters)
            ms["cudnn fwd"] = replay_ms(sdpa, (), iters)
        ms["fpatch fwd+bwd"] = replay_ms(lambda: flashpatch.flash_attn_func(q, k, v, causal=True).backward(dout),
                                         (q, k, v), iters)
        ms["cudnn fwd+bwd"] = replay_ms(lambda: sdpa().backward(doutt), (qt, kt, vt), iters)
    return ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "results" / "latest"))
    parser.add_argument("--history", default=str(REPO / "results" / "history.csv"))
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    if args.iters < 1:
        parser.error(f"--iters must be at least 1, got {args.iters}")
    import history
    import triton

    gpu = torch.cuda.get_device_name()
    rows, figures = [], []
    for case in CASES:
        batch, seqlen, heads, kv_heads, headdim = case
        name = f"d{headdim} causal {heads}/{kv_heads} N={seqlen}"
        fwd_flops = 4 * batch * heads * seqlen * seqlen * headdim / 2
        ms = measure(case, args.iters)
        tflops = {key: (3.5 if key.endswith("bwd") else 1.0) * fwd_flops / value / 1e9 for key, value in ms.items()}
        rows.append(dict(case=name, batch=batch, ms=ms, tflops=tflops))
        for key, value in tflops.items():
            impl, what = key.split(" ")
            figures.append((f"graph replay {name} bf16", "sdpa_cudnn" if impl == "cudnn" else impl,
                            f"{what.replace('+', '_')}_tflops", value))
        print(f"{name}: " + ", ".join(f"{key} {value:.3f} ms" for key, value in ms.items()), file=sys.stderr,
              flush=True)
    lines = [f"## Short causal rows on the GPU alone (CUDA graph replays), {gpu}", "",
             f"torch {torch.__version__}, Triton {triton.__version__}, bf16, B·N = 16k tokens; TFLOP/s of useful "
             f"FLOPs, median of 5 runs of {args.iters} replays (`python benchmarks/short_rows.py`). ratio: "
             "flashpatch over cuDNN.", "",
             "| case | fwd: flashpatch / cuDNN | ratio | fwd+bwd: flashpatch / cuDNN | ratio |",
             "|---|---|---|---|---|"]
    for r in rows:
        t = r["tflops"]
        lines.append(f"| {r['case']} | {t['fpatch fwd']:.0f} / {t['cudnn fwd']:.0f} "
                     f"| {t['fpatch fwd'] / t['cudnn fwd']:.2f}x "
                     f"| {t['fpatch fwd+bwd']:.0f} / {t['cudnn fwd+bwd']:.0f} "
                     f"| {t['fpatch fwd+bwd'] / t['cudnn fwd+bwd']:.2f}x |")
    table = "\n".join(lines)
    history.save_benchmark(args.out, "short_rows", table, rows, figures, gpu=gpu, torch_version=torch.__version__,
                           triton_version=triton.__version__, history_path=args.history)
    print(table)


if __name__ == "__main__":
    main()
