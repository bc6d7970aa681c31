"""GPU time of a padded batch through a transformers layer's attention, forward + backward: flashpatch's function
running the dense kernel over the padding, the same function unpadding the rows, what its rule picks
(`integrations.transformers.dense_pairs_bound`), and transformers' sdpa function with its 4-D mask. GPU only.

    python benchmarks/padded_layer.py [--out results/latest] [--history results/history.csv]

GPU time is the sum of the CUDA kernels' durations under torch.profiler over 10 calls (the host's share does not
count); wall time the median of 5 runs of 20 calls. q, k, v are leaves, so each call also accumulates their
gradients (the same three adds for every implementation). Two sets of batches of (B, H, S, D) states at GQA 14/2 d64
(configs/lora_qwen2_0p5b.yaml's heads) and 32/8 d128: "mixed", 8192 tokens of rows whose first is full and the
others uniform in [S/8, S]; "short", 16384 tokens whose first row is full and the others hold 10, 25 or 50% real
tokens. Writes padded_layer.md and padded_layer.json to --out, appends to --history, prints the table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "benchmarks"))
import flashpatch.integrations.transformers as fp_hf  # noqa: E402
from profile_kernels import kernel_times  # noqa: E402

HEADS = [(14, 2, 64), (32, 8, 128)]  # (heads, kv heads, head dim)
MIXED = [(s, None) for s in (256, 512, 1024, 2048, 4096)]  # (row length, real fraction of the other rows)
SHORT = [(s, f) for s in (1024, 2048, 4096, 8192) for f in (0.1, 0.25, 0.5)]


def gpu_us(fn) -> float:
    """Kernel time per call, summed over every CUDA kernel the call runs (profile_kernels.kernel_times)."""
    return sum(ms for _, ms in kernel_times(fn)) * 1000.0


def wall_us(fn, iters=20, repeats=5) -> float:
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(runs)


def measure(heads, seqlen: int, fraction: float | None) -> dict:
    h, hk, d = heads
    batch = max(2, (8192 if fraction is None else 16384) // seqlen)
    generator = torch.Generator().manual_seed(0)
    others = (torch.randint(seqlen // 8, seqlen + 1, (batch - 1,), generator=generator) if fraction is None
              else torch.full((batch - 1,), int(fraction * seqlen)))
    lengths = torch.cat([torch.tensor([seqlen]), others]).cuda()
    keep = torch.arange(seqlen, device="cuda")[None, :] < lengths[:, None]  # (B, S)
    mask4 = keep[:, None, None, :] & torch.ones(seqlen, seqlen, device="cuda", dtype=torch.bool).tril()
    q, k, v = (torch.randn(batch, x, seqlen, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for x in (h, hk, hk))  # (B, H, S, D)
    dout = torch.randn(batch, seqlen, h, d, device="cuda", dtype=torch.bfloat16)
    layer = torch.nn.Module()
    layer.is_causal, layer.num_key_value_groups = True, h // hk

    def fpatch(mask):
        return lambda: fp_hf.fpatch_attention_forward(layer, q, k, v, mask, scaling=d ** -0.5,
                                                      is_causal=True)[0].backward(dout)

    rule = fp_hf.dense_pairs_bound
    row = dict(heads=f"{h}/{hk} d{d}", seqlen=seqlen, rows=batch, real_fraction=float(lengths.sum()) / (batch * seqlen),
               pairs_ratio=batch * seqlen * (seqlen + 1) / float((lengths.double() * (lengths + 1)).sum()))
    try:
        for name, bound in (("dense", lambda s, hd: float("inf")), ("unpadded", lambda s, hd: 0.0), ("rule", rule)):
            fp_hf.dense_pairs_bound = bound
            mask = keep.long()  # a new tensor each time: the decision is kept per mask tensor
            row[f"{name}_gpu_us"], row[f"{name}_wall_us"] = gpu_us(fpatch(mask)), wall_us(fpatch(mask))
        row["rule_picks"] = "dense" if fp_hf._dense_over_padding(keep.long(), seqlen, seqlen, True, d) else "unpadded"
    finally:
        fp_hf.dense_pairs_bound = rule
    sdpa = lambda: sdpa_attention_forward(layer, q, k, v, mask4, scaling=d ** -0.5,  # noqa: E731
                                          is_causal=True)[0].backward(dout)
    row["sdpa_gpu_us"], row["sdpa_wall_us"] = gpu_us(sdpa), wall_us(sdpa)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "results" / "latest"))
    parser.add_argument("--history", default=str(REPO / "results" / "history.csv"))
    args = parser.parse_args()
    import history
    import triton

    gpu = torch.cuda.get_device_name()
    lines = [f"## Padded rows through a transformers layer: GPU time, {gpu}", "",
             f"torch {torch.__version__}, Triton {triton.__version__}, bf16, {history.today()}, commit "
             f"{history.git_commit()}; `python benchmarks/padded_layer.py`. "
             "us per forward + backward; pairs ratio: the padded rows' causal pairs over the real tokens'.", "",
             "| heads | S | rows | real | pairs ratio | rule picks | dense | unpadded | rule | sdpa | wall: dense | "
             "unpadded | sdpa |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for heads in HEADS:
        for seqlen, fraction in MIXED + SHORT:
            r = measure(heads, seqlen, fraction)
            rows.append(r)
            lines.append(f"| {r['heads']} | {seqlen} | {r['rows']} | {r['real_fraction']:.2f} | "
                         f"{r['pairs_ratio']:.2f} | {r['rule_picks']} | {r['dense_gpu_us']:.0f} | "
                         f"{r['unpadded_gpu_us']:.0f} | {r['rule_gpu_us']:.0f} | {r['sdpa_gpu_us']:.0f} | "
                         f"{r['dense_wall_us']:.0f} | {r['unpadded_wall_us']:.0f} | {r['sdpa_wall_us']:.0f} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    figures = []
    for r in rows:
        case = f"padded layer {r['heads']} S {r['seqlen']} x{r['rows']} real {r['real_fraction']:.2f}"
        figures += [(case, impl, metric, r[f"{impl}_{metric}"]) for impl in ("dense", "unpadded", "rule", "sdpa")
                    for metric in ("gpu_us", "wall_us")]
    history.save_benchmark(args.out, "padded_layer", table, rows, figures, gpu=gpu, torch_version=torch.__version__,
                           triton_version=triton.__version__, history_path=args.history)
    print(table)


if __name__ == "__main__":
    main()
