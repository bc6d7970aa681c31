"""What a training step costs: model FLOPs for MFU, the GPU's peak, and memory readings.

MFU counts useful work only (the PaLM convention): 6 FLOPs per matmul parameter per real token, plus attention's
two matmuls over the real document lengths (block-diagonal for packed rows, causal halves it). Padding and the extra
forward of gradient checkpointing are not counted: an implementation that wastes work on pad scores lower.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from pathlib import Path

import torch

# Dense (no sparsity) bf16/fp16 tensor-core peaks in TFLOP/s, from the vendors' data sheets; matched by substring of
# torch.cuda.get_device_name(), first hit wins (so "H100 PCIe" precedes "H100").
PEAK_TFLOPS_16BIT = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A10G", 125.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("4090", 165.0),
    ("3090", 71.0),
    ("V100", 125.0),
    ("T4", 65.0),
)


def peak_tflops(device: torch.device, override: float = 0.0) -> tuple[float | None, str]:
    """(peak TFLOP/s, where it came from); (None, reason) where there is no meaningful peak (CPU, unknown GPU)."""
    if override > 0:
        return override, "config peak_tflops"
    if device.type != "cuda":
        return None, "no MFU on CPU"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS_16BIT:
        if key in name:
            return tflops, f"{name}: dense 16-bit peak"
    return None, f"unknown GPU {name!r}: set peak_tflops"


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all of them minus the input embedding (a lookup), counted once if tied."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    return total if tied else total - embed.numel()


def segment_lengths(batch: dict[str, torch.Tensor]) -> list[int]:
    """Lengths of the real sequences attention sees: unpadded rows, documents inside packed rows, or whole rows."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(dim=1).tolist()
    if "position_ids" not in batch:  # dense rows: one causal sequence each
        return [batch["input_ids"].shape[1]] * batch["input_ids"].shape[0]
    lengths = []
    for row in batch["position_ids"]:  # (S,) per row; a new document wherever the position restarts at 0
        starts = (row == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        bounds = [*starts, row.numel()]
        lengths += [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return lengths


def frozen_matmul_params(model: torch.nn.Module) -> int:
    """The part of `matmul_params` that does not train (LoRA's base weights): the backward computes their inputs'
    gradients but not their own."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
               if not p.requires_grad and p is not embed)


def train_flops(n_matmul_params: int, n_layers: int, attn_width: int, lengths: list[int], causal: bool = True,
                frozen_params: int = 0) -> float:
    """FLOPs of one forward+backward over sequences of the given real lengths: per token 2 per parameter forward and
    4 backward (the input's gradient and the weight's), or 2 for the `frozen_params` among them (no weight gradient).

    attn_width = num_heads * head_dim. Forward attention per layer: QKᵀ and PV, 2·L²·width FLOPs each; its backward
    twice that.
    """
    tokens = sum(lengths)
    attn_fwd = 4.0 * n_layers * attn_width * sum(length * length for length in lengths)
    if causal:
        attn_fwd /= 2
    return (6.0 * (n_matmul_params - frozen_params) + 4.0 * frozen_params) * tokens + 3.0 * attn_fwd


def rss_gib() -> float | None:
    """This process's resident memory now (Linux /proc), the CPU stand-in for peak GPU memory."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return None


class TritonCompiles:
    """Triton kernels compiled in this process while entered (a JIT cache miss: the binary may still come from
    Triton's disk cache). A first-time code path, such as the first batch of one layout in a run of mixed batches,
    compiles its kernels inside the step that meets it, for seconds on a fresh machine: the step's count tells such
    a step from a slow GPU. `take()` returns the count since its last call."""

    def __init__(self):
        self._count, self._previous = 0, None
        try:
            from triton import knobs

            self._runtime = knobs.runtime
        except ImportError:  # older Triton: nothing counted
            self._runtime = None

    def __enter__(self) -> TritonCompiles:
        if self._runtime is not None:
            self._previous = self._runtime.jit_cache_hook
            self._runtime.jit_cache_hook = self._on_compile
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook = self._previous

    def _on_compile(self, *args, **kwargs):
        self._count += 1
        return self._previous(*args, **kwargs) if self._previous else False  # False: compile as usual

    def take(self) -> int:
        taken, self._count = self._count, 0
        return taken


class GcPauses:
    """Host time spent in Python's garbage collector while entered. A training step keeps the host only a little
    ahead of the GPU, so a collection during a step delays the next launches by its length, which the GPU can wait
    out: the step's gc_ms tells such a pause from a slow GPU. `take()` returns (ms, full collections) since its
    last call."""

    def __init__(self):
        self._ms, self._full, self._start = 0.0, 0, None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_collect)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_collect)

    def _on_collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._ms += 1000 * (time.perf_counter() - self._start)
            self._full += info.get("generation") == 2
            self._start = None

    def take(self) -> tuple[float, int]:
        taken = (self._ms, self._full)
        self._ms, self._full = 0.0, 0
        return taken


class StepTrace:
    """torch.profiler around one step, written on exit as a Chrome trace (Perfetto, chrome://tracing): the host ops
    and, on a GPU, every stream's kernels (NCCL's and flashpatch's side stream included)."""

    def __init__(self, path: Path, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.path, self._profile = Path(path), profile(activities=activities)

    def __enter__(self) -> StepTrace:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        if exc[0] is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._profile.export_chrome_trace(str(self.path))


def sync(device: torch.device) -> None:
    """Wait for the GPU, so that a host clock around it times the device's work too."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(step, device: torch.device, gc_pauses: "GcPauses", compiles: "TritonCompiles",
               trace=contextlib.nullcontext()):
    """step() between two device syncs, with the GC pauses and Triton compiles inside it counted (and `trace`, a
    StepTrace, around it). Returns (step's result, seconds, GC ms, full collections, Triton compiles)."""
    sync(device)
    gc_pauses.take()
    compiles.take()
    with gc_pauses, compiles, trace:
        start = time.perf_counter()
        result = step()
        sync(device)
        elapsed = time.perf_counter() - start
    gc_ms, gc_full = gc_pauses.take()
    return result, elapsed, gc_ms, gc_full, compiles.take()
