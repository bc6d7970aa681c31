"""Where a training step's time goes, for one implementation: after the warm-up, the next steps run once timed
(wall time without the profiler) and once under the torch profiler, which gives the kernel time summed by kind
(attention, matmul, the rest), the host syncs per step, the top kernels, and the GPU's idle gaps between kernels
by the host op that launched the kernel after each (host-bound, or waiting on something else). Written for the
padded-real-lengths run, which moved +0.3% when its varlen kernels got 17-19% faster.

    python benchmarks/profile_train_step.py --config configs/padded_real_lengths.yaml --implementations fpatch \
        [--tree runs/trees/<name>] [--profile_steps 8]

Every other option is recipes/train.py's (--config plus field overrides; the batches are the recipe's). Under
`accelerate launch` (DDP, FSDP) rank 0 prints and every other rank writes <output_dir>/profile_<impl>_rank<r>.txt;
the report then adds the collectives' time beside computation and exposed. --tree
imports flashpatch from an older package (`git archive <commit> flashpatch | tar -x -C runs/trees/<name>`), so two
versions can be profiled on one GPU in one call. On a machine without CUDA it profiles the host ops instead
(flashpatch's kernels in the Triton interpreter).
"""

import argparse
import bisect
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# Kernel-name fragments by kind, first match wins (lower case). Communication: NCCL's collectives. Attention:
# flashpatch's Triton and Gluon kernels, SDPA's flash / cuDNN / efficient backends, Flex's generated kernels.
KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("attn_", "flash", "fmha", "cudnn", "flex_attention", "triton_tem_fused")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "addmm", "bmm", "::mm")),
    ("copy / pad", ("copy", "cat", "index", "gather", "scatter", "pad", "fill")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
)

# What waits for the GPU: CUDA runtime calls; without a GPU, the host ops that would (.item(), nonzero). AdamW's
# .item() on its step counts, which live on the host, shows in the second list but never waits.
SYNC_FRAGMENTS = {True: ("Synchronize", "cudaMemcpy"), False: ("_local_scalar_dense", "aten::nonzero")}
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # the Chrome trace's categories of work on the GPU
GAP_US = 2.0  # back-to-back launches leave about 1-2 us between kernels


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
    from accelerate import Accelerator
    from torch.profiler import ProfilerActivity, profile
    from train_config import parse_config

    cfg = parse_config(train_argv)
    if len(cfg.implementations) != 1:
        raise SystemExit(f"profile one implementation at a time (--implementations), got {cfg.implementations}")
    impl = cfg.implementations[0]
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision or None)
    if not accelerator.is_main_process:  # under accelerate launch: rank 0 prints, the others write a file each
        path = Path(cfg.output_dir) / f"profile_{impl}_rank{accelerator.process_index}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout = path.open("w")
    print(f"{impl}: flashpatch from {Path(flashpatch.__file__).parent}, rank {accelerator.process_index} of "
          f"{accelerator.num_processes}", flush=True)
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
    if cuda:  # wall time of the same steps without the profiler: kernel time below it is time the GPU sat idle
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for batch in batches[cfg.warmup_steps:]:
            step(batch)
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1000.0 / args.profile_steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for batch in batches[cfg.warmup_steps:]:
            step(batch)
        if cuda:
            torch.cuda.synchronize(device)

    per_kernel = defaultdict(float)  # ms per step
    counted = 0  # the events in per_kernel: kernels on a GPU
    steps = len(batches) - cfg.warmup_steps
    for event in prof.events():
        on_host = event.device_type != torch.autograd.DeviceType.CUDA
        if is_kernel(event) if cuda else on_host:  # kernels on a GPU; host ops (self time) without one
            time_us = event.device_time if cuda else event.self_cpu_time_total
            per_kernel[event.name] += time_us / steps / 1000.0
            counted += 1
    by_kind = defaultdict(float)
    for name, ms in per_kernel.items():
        by_kind[kind_of(name)] += ms
    total = sum(by_kind.values())
    what = "GPU kernel time" if cuda else "host self time"
    wall = f" (wall {wall_ms:.1f} ms per step unprofiled)" if cuda else ""
    print(f"{impl}, {cfg.name}, {steps} steps: {what} {total:.1f} ms per step{wall}"
          + (f", {counted / steps:.0f} kernels per step" if cuda else ""), flush=True)
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:12s} {ms:9.2f} ms  {100 * ms / total:5.1f}%")
    # Host syncs: each drains the GPU's queue, and the GPU then idles while the host launches the next kernels.
    syncs = defaultdict(int)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA and any(
            fragment in event.name for fragment in SYNC_FRAGMENTS[cuda]
        ):
            syncs[event.name] += 1
    print("host syncs per step: " + (", ".join(f"{n} {c / steps:g}" for n, c in sorted(syncs.items())) or "none"))
    print(f"top {args.top} {'kernels' if cuda else 'ops'}:")
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {ms:9.3f} ms  [{kind_of(name)}] {name[:110]}")
    if cuda:
        report_idle(prof, steps, args.top)
        report_host_ops(prof, steps, args.top)


def report_host_ops(prof, steps: int, top: int) -> None:
    """The host ops with the most time per step, inclusive (what a call costs the host with everything it runs) and
    self (its own share), with calls per step: where a host-bound step's time goes, op by op."""
    averages = [a for a in prof.key_averages() if a.device_type != torch.autograd.DeviceType.CUDA]
    for label, key in (("inclusive", "cpu_time_total"), ("self", "self_cpu_time_total")):
        print(f"host ops by {label} time, ms per step (calls per step):")
        for a in sorted(averages, key=lambda a: -getattr(a, key))[:top]:
            print(f"  {getattr(a, key) / steps / 1000.0:8.2f} ms  ({a.count / steps:6.0f})  {a.key[:100]}")


def is_kernel(event) -> bool:
    """A GPU kernel or copy, not a record_function span the profiler also draws on the GPU (Optimizer.step#...)."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both of two sorted lists of disjoint intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def report_overlap(device: list[dict], steps: int) -> tuple[float, float]:
    """Kernel time per GPU stream by kind, and how much of the collectives' time (NCCL) ran beside computation on
    another stream: a collective no kernel overlaps is exposed, the step waits for it (or for the rank it syncs
    with). Under DDP and FSDP the collectives have streams of their own; flashpatch's concurrent dQ runs on one."""
    by_stream = defaultdict(lambda: defaultdict(float))
    comm, compute = [], []
    for e in device:
        kind = kind_of(e["name"])
        by_stream[e.get("tid")][kind] += e["dur"]
        (comm if kind == "communication" else compute).append((e["ts"], e["ts"] + e["dur"]))
    print("GPU streams, kernel ms per step by kind:")
    for stream, kinds in sorted(by_stream.items(), key=lambda kv: -sum(kv[1].values())):
        parts = ", ".join(f"{kind} {us / steps / 1000.0:.1f}"
                          for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1]))
        print(f"  stream {stream}: {sum(kinds.values()) / steps / 1000.0:.1f} ms ({parts})")
    if not comm:
        return 0.0, 0.0
    comm, compute = _union(comm), _union(compute)
    comm_us = sum(end - start for start, end in comm)
    hidden = _overlap_us(comm, compute)
    print(f"collectives {comm_us / steps / 1000.0:.1f} ms per step (busy time of their streams together), "
          f"{hidden / steps / 1000.0:.1f} beside computation, {(comm_us - hidden) / steps / 1000.0:.1f} exposed")
    return comm_us, hidden


def report_idle(prof, steps: int, top: int) -> None:
    """Where the GPU sat idle, from the profile's Chrome trace: each gap between kernels longer than GAP_US, by the
    host op that launched the kernel after it. A gap whose kernel the host launched after the GPU had gone idle is
    host-bound: the host was busy in that op (its outermost and innermost names are shown); the others waited on
    something else (a copy from pageable memory, an event)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    report_overlap(device, steps)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops_by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_by_thread[e["tid"]].append(e)
    starts_by_thread, top_by_thread = {}, {}
    for tid, ops in ops_by_thread.items():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        starts_by_thread[tid] = [e["ts"] for e in ops]
        outer, end = [], float("-inf")  # the outermost ops: those no earlier op contains
        for e in ops:
            if e["ts"] >= end:
                outer.append(e)
                end = e["ts"] + e["dur"]
        top_by_thread[tid] = (outer, [e["ts"] for e in outer])

    def host_op(launch) -> str:
        """The outermost and innermost host ops around a launch; a bisection each (a step has ~10^5 ops)."""
        tid, ts = launch["tid"], launch["ts"]
        if tid not in ops_by_thread:
            return "?"
        outer, outer_starts = top_by_thread[tid]
        i = bisect.bisect_right(outer_starts, ts) - 1
        if i < 0 or ts > outer[i]["ts"] + outer[i]["dur"]:
            return "?"
        ops, starts = ops_by_thread[tid], starts_by_thread[tid]
        j = bisect.bisect_right(starts, ts) - 1
        inner = outer[i]
        while j >= 0 and ops[j]["ts"] >= outer[i]["ts"]:  # the latest-starting op that still contains ts
            if ts <= ops[j]["ts"] + ops[j]["dur"]:
                inner = ops[j]
                break
            j -= 1
        return " > ".join(dict.fromkeys([outer[i]["name"], inner["name"]]))

    idle = defaultdict(float)  # (host-bound?, op) -> us
    gaps = []
    busy_until = device[0]["ts"] + device[0]["dur"] if device else 0.0
    for kernel in device[1:]:
        gap = kernel["ts"] - busy_until
        if gap > GAP_US:
            launch = launches.get(kernel.get("args", {}).get("correlation"))
            bound = launch is not None and launch["ts"] > busy_until
            op = host_op(launch) if launch else "?"
            idle[(bound, op)] += gap
            gaps.append((gap, bound, kernel["name"], op))
        busy_until = max(busy_until, kernel["ts"] + kernel["dur"])
    total = sum(idle.values()) / steps / 1000.0
    bound_ms = sum(us for (bound, _), us in idle.items() if bound) / steps / 1000.0
    span = (busy_until - device[0]["ts"]) / steps / 1000.0 if device else 0.0
    print(f"GPU span (first kernel's start to last kernel's end) {span:.1f} ms per step under the profiler")
    print(f"GPU idle in gaps over {GAP_US:g} us: {total:.1f} ms per step, {bound_ms:.1f} of it host-bound "
          "(the kernel after the gap launched once the GPU had gone idle); by the op launching that kernel:")
    for (bound, op), us in sorted(idle.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / steps / 1000.0:8.2f} ms  {'host ' if bound else 'wait '} {op[:120]}")
    print("largest gaps:")
    for gap, bound, name, op in sorted(gaps, key=lambda g: -g[0])[:top]:
        print(f"  {gap / 1000.0:8.2f} ms  {'host ' if bound else 'wait '} before {name[:40]}  ({op[:80]})")


if __name__ == "__main__":
    main()
