"""Where a training step's time goes: a few steps of a recipe under the torch profiler, kernel time summed by kind
(attention, matmul, the rest) and the top kernels, for one implementation. Written for NOTES.md "What is left" 0:
the padded-real-lengths run moved +0.3% when its varlen kernels got 17-19% faster.

    python scripts/profile_train_step.py --config configs/padded_real_lengths.yaml --implementations fpatch \
        [--tree runs/trees/<name>] [--profile_steps 3]

Every other option is recipes/train.py's (--config plus field overrides; the batches are the recipe's). --tree
imports flashpatch from an older package (`git archive <commit> flashpatch | tar -x -C runs/trees/<name>`), so two
versions can be profiled on one GPU in one call. On a machine without CUDA it profiles the host ops instead
(flashpatch's kernels in the Triton interpreter).
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Kernel-name fragments by kind, first match wins (lower case). Attention: flashpatch's Triton and Gluon kernels,
# SDPA's flash / cuDNN / efficient backends, Flex's generated kernels.
KINDS = (
    ("attention", ("attn_", "flash", "fmha", "cudnn", "flex_attention", "triton_tem_fused")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "addmm", "bmm", "::mm")),
    ("copy / pad", ("copy", "cat", "index", "gather", "scatter", "pad", "fill")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def main():
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tree", default=str(ROOT), help="a directory holding the flashpatch package to use")
    parser.add_argument("--profile_steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    args, train_argv = parser.parse_known_args()
    sys.path[:0] = [str(Path(args.tree).resolve()), str(ROOT / "recipes")]  # the tree's flashpatch first
    import train  # without CUDA it sets TRITON_INTERPRET before flashpatch defines its kernels
    import flashpatch
    import torch
    from accelerate import Accelerator
    from torch.profiler import ProfilerActivity, profile
    from train_config import parse_config

    cfg = parse_config(train_argv)
    if len(cfg.implementations) != 1:
        raise SystemExit(f"profile one implementation at a time (--implementations), got {cfg.implementations}")
    impl = cfg.implementations[0]
    print(f"{impl}: flashpatch from {Path(flashpatch.__file__).parent}", flush=True)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision or None)
    device = accelerator.device
    corpus = train.import_corpus()
    tokenizer = train.make_tokenizer(cfg, corpus)
    _, batches = train.recipe_batches(cfg, accelerator, corpus, tokenizer, cfg.warmup_steps + args.profile_steps)
    model, optimizer, scheduler = train.build_training(impl, cfg, accelerator, tokenizer)

    def step(batch):  # as train.train_one runs it, without the clock
        train.train_step(model, optimizer, scheduler, accelerator, cfg, train.device_inputs(impl, cfg, batch, device))

    for batch in batches[: cfg.warmup_steps]:
        step(batch)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for batch in batches[cfg.warmup_steps:]:
            step(batch)
        if cuda:
            torch.cuda.synchronize(device)

    per_kernel = defaultdict(float)  # ms per step
    steps = len(batches) - cfg.warmup_steps
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device == cuda:  # kernels on a GPU; host ops (self time) without one
            time_us = event.device_time if cuda else event.self_cpu_time_total
            per_kernel[event.name] += time_us / steps / 1000.0
    by_kind = defaultdict(float)
    for name, ms in per_kernel.items():
        by_kind[kind_of(name)] += ms
    total = sum(by_kind.values())
    what = "GPU kernel time" if cuda else "host self time"
    print(f"{impl}, {cfg.name}, {steps} steps: {what} {total:.1f} ms per step", flush=True)
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:12s} {ms:9.2f} ms  {100 * ms / total:5.1f}%")
    print(f"top {args.top} {'kernels' if cuda else 'ops'}:")
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {ms:9.3f} ms  [{kind_of(name)}] {name[:110]}")


if __name__ == "__main__":
    main()
