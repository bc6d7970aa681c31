"""Train one causal LM with each attention implementation in turn and compare: same model, data and seed.

    accelerate launch --config_file configs/accelerate/cpu.yaml recipes/train.py --config configs/tiny_cpu.yaml
    accelerate launch --config_file configs/accelerate/single_gpu.yaml recipes/train.py \
        --config configs/llama_1b.yaml --seq_len 4096 --batch_size 2

Per implementation: tokens/s on real (non-pad) tokens summed over ranks, step time, peak allocated/reserved GPU
memory per rank (process RSS on CPU), MFU, the loss of every step. Warm-up steps are trained but not measured.
An out-of-memory run is a result ("OOM"); an implementation that cannot run here is "skipped" with the reason.
Writes <output_dir>/results.json, throughput.png, memory.png, loss.png, and prints a markdown table last: on a GPU
speed, memory and loss; on CPU, where flashpatch runs in the Triton interpreter and its timings measure nothing,
loss parity. On a GPU the figures are also appended to results/history.csv (FLASHPATCH_HISTORY="" skips it).
--rounds N ranks them instead: one model, the implementations taking turns (recipes/ranking.py).
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import statistics
import sys
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Without CUDA, flashpatch's Triton kernels run in the interpreter; the flag is read when triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))  # run from a checkout without `pip install -e .`

import measure  # noqa: E402  (recipes/ is sys.path[0] when this file is run)
import ranking  # noqa: E402
import report  # noqa: E402
from train_config import CUDA_GRAPH_MODES, TrainConfig, parse_config, parse_kernel_options, to_dict  # noqa: E402

OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)


def import_flashpatch():
    """(module, None) or (None, why): a broken flashpatch skips its column instead of stopping the comparison."""
    try:
        import flashpatch

        return flashpatch, None
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return None, f"import flashpatch failed: {type(exc).__name__}: {exc}"


def kernel_options(cfg: TrainConfig, flashpatch):
    """(context, kwargs): `flashpatch.kernels.options.override(**kwargs)` for the run's `kernel_options`, checked
    against flashpatch's option names before anything runs; a null context when there are none or flashpatch did not
    import (its rows are skipped then)."""
    kwargs = parse_kernel_options(cfg.kernel_options)
    if not kwargs or flashpatch is None:
        return contextlib.nullcontext(), kwargs
    from flashpatch.kernels import options

    try:
        options.updated(options.current(), **kwargs)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"kernel_options {cfg.kernel_options!r}: {exc}") from exc
    return options.override(**kwargs), kwargs


def import_corpus():
    """flashpatch.corpus, loaded by file path if the package itself fails to import (eager/sdpa still run)."""
    try:
        from flashpatch import corpus

        return corpus
    except Exception:  # noqa: BLE001
        import importlib.util

        spec = importlib.util.spec_from_file_location("flashpatch_corpus", REPO / "flashpatch" / "corpus.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["flashpatch_corpus"] = module
        spec.loader.exec_module(module)
        return module


class HubTokenizer:
    """A transformers tokenizer behind the two things make_batches uses (for `--model` runs only)."""

    def __init__(self, name: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(name)
        self.bos_token_id = self.tok.bos_token_id
        self.eos_token_id = self.tok.eos_token_id
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    def encode_np(self, text: str, max_length: int | None = None):
        import numpy as np

        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        ids = [i for i in (self.bos_token_id, *ids, self.eos_token_id) if i is not None]
        return np.asarray(ids[:max_length] if max_length else ids, dtype=np.int64)


def make_tokenizer(cfg: TrainConfig, corpus):
    """The model's own tokenizer for `model` runs, else the corpus's byte tokenizer."""
    return HubTokenizer(cfg.model) if cfg.model else corpus.ByteTokenizer()


def build_model(cfg: TrainConfig, attn: str, tokenizer, device: torch.device):
    """The model for one implementation; torch.manual_seed first, so every implementation starts from the same init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    if cfg.model:
        return AutoModelForCausalLM.from_pretrained(
            cfg.model, attn_implementation=attn, attention_dropout=cfg.attention_dropout
        )
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
    intermediate = cfg.intermediate_size or -(-(cfg.hidden_size * 8 // 3) // 64) * 64
    vocab = cfg.vocab_size or -(-tokenizer.vocab_size // 64) * 64
    extra = {"sliding_window": cfg.sliding_window} if cfg.sliding_window else {}
    config = AutoConfig.for_model(
        cfg.model_family,
        hidden_size=cfg.hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=max(cfg.seq_len, 2048),
        attention_dropout=cfg.attention_dropout,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=False,
        **extra,
    )
    # Initialise directly on the GPU: a 1B model initialises in well under a second there, ~10 s on the host.
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def build_training(impl: str, cfg: TrainConfig, accelerator, tokenizer):
    """(model, optimizer, scheduler) for one implementation, prepared by accelerate and in train mode."""
    model = build_model(cfg, "fpatch" if impl.startswith("fpatch") else impl, tokenizer, accelerator.device)
    if impl == "fpatch_pf":  # the padded batches as they are; flashpatch packs their real tokens in the forward
        import flashpatch

        flashpatch.patch_model(model, padding_free=True)
    if cfg.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                                 target_modules=list(cfg.lora_targets), lora_dropout=0.0))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    # Linear learning-rate warm-up over the (unmeasured) warm-up steps, then constant: random-init models in bf16
    # spike without it, and a spike makes the loss curves useless for comparing implementations.
    ramp = cfg.warmup_steps + 1
    # Not passed to prepare(): accelerate would step it once per process per step.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / ramp))
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    if cfg.compile:
        model = torch.compile(model, mode=cfg.compile)  # compiles at the first (warm-up) steps
    return model, optimizer, scheduler


def device_inputs(impl: str, cfg: TrainConfig, batch: dict, device: torch.device) -> dict:
    """The model's inputs for one batch, on the device. "unpadded": fpatch gets each padded batch as one row of
    real tokens with varlen kwargs; the others (fpatch_pf included) run the padded batch. The losses cover the same
    tokens."""
    if cfg.data_mode == "unpadded" and impl == "fpatch":
        batch = import_corpus().flatten_padded_batch(batch)
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def train_step(model, optimizer, scheduler, accelerator, cfg: TrainConfig, batch_dev: dict) -> torch.Tensor:
    """One optimizer step on one batch; returns the loss."""
    if cfg.compile in CUDA_GRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()  # a new step: the graphs' previous outputs may be overwritten
    loss = model(**batch_dev, use_cache=False).loss
    accelerator.backward(loss)
    if cfg.max_grad_norm > 0:
        accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def warm_full_rows(model, optimizer, accelerator, cfg: TrainConfig, batch_dev: dict) -> None:
    """Padded data: a forward and backward of `batch_dev` with every row taken as full (no padding), the gradients
    then dropped and no optimizer step taken. A padded batch that happens to hold no padding runs other kernels
    (transformers passes no mask: dense rows, where padded ones are unpadded), which would otherwise compile in
    whichever measured step first meets such a batch (a LoRA run: 3.7-4.6 s in one step of 0.2 s). Part of the
    warm-up, untimed, and the same for every implementation."""
    if cfg.data_mode != "padded" or "attention_mask" not in batch_dev:
        return
    full = dict(batch_dev, attention_mask=torch.ones_like(batch_dev["attention_mask"]))
    if cfg.compile in CUDA_GRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()
    accelerator.backward(model(**full, use_cache=False).loss)
    optimizer.zero_grad(set_to_none=True)


def train_one(impl: str, cfg: TrainConfig, accelerator, batches, tokenizer) -> dict:
    """Warm-up + measured steps for one implementation; returns this rank's raw measurements."""
    from tqdm.auto import tqdm

    device = accelerator.device
    model, optimizer, scheduler = build_training(impl, cfg, accelerator, tokenizer)
    # The model itself: DDP does not forward attributes. keep_torch_compile=False, as with True accelerate would
    # replace the compiled wrapper's _orig_mod by the unwrapped model, taking DDP out of a compiled DDP model.
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    n_matmul, n_frozen = measure.matmul_params(unwrapped), measure.frozen_matmul_params(unwrapped)
    mcfg = unwrapped.config
    head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
    attn_width = mcfg.num_attention_heads * head_dim  # query heads x head dim: the width of QKᵀ and PV

    raw = {"losses": [], "step_times": [], "gc_ms": [], "gc_full": 0, "compiles": [], "tokens": 0, "padded_tokens": 0,
           "flops": 0.0, "rss": []}
    total = cfg.warmup_steps + cfg.steps
    bar = tqdm(total=total, desc=impl, disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    gc_pauses, compiles = measure.GcPauses(), measure.TritonCompiles()
    for step, batch in enumerate(batches):
        batch_dev = device_inputs(impl, cfg, batch, device)  # made before the clock starts, like a collator's work
        if step == 0:
            warm_full_rows(model, optimizer, accelerator, cfg, batch_dev)
        traced = step + 1 == cfg.profile_step
        trace = measure.StepTrace(trace_path(cfg, impl, accelerator.process_index), device) if traced else \
            contextlib.nullcontext()
        loss, elapsed, step_gc_ms, step_gc_full, step_compiles = measure.timed_step(
            lambda: train_step(model, optimizer, scheduler, accelerator, cfg, batch_dev), device, gc_pauses, compiles,
            trace)

        mean_loss = accelerator.reduce(loss.detach().float(), reduction="mean").item()  # the curve: mean over ranks
        raw["losses"].append(mean_loss)
        raw["rss"].append(measure.rss_gib())
        if traced:
            raw["traced_step_ms"] = round(1000 * elapsed, 2)  # with the profiler's overhead
        elif step >= cfg.warmup_steps:
            raw["step_times"].append(elapsed)
            raw["gc_ms"].append(step_gc_ms)
            raw["compiles"].append(step_compiles)
            raw["gc_full"] += step_gc_full
            lengths = measure.segment_lengths(batch)
            raw["tokens"] += sum(lengths)
            raw["padded_tokens"] += batch["input_ids"].numel()
            raw["flops"] += measure.train_flops(n_matmul, mcfg.num_hidden_layers, attn_width, lengths,
                                                frozen_params=n_frozen)
        bar.set_postfix(loss=f"{mean_loss:.3f}", ms=f"{1000 * elapsed:.0f}")
        bar.update()
    bar.close()
    raw["attn_implementation"] = getattr(mcfg, "_attn_implementation", impl)
    raw["n_matmul_params"], raw["frozen_matmul_params"] = n_matmul, n_frozen
    return raw


def trace_path(cfg: TrainConfig, impl: str, rank: int | str) -> Path:
    return Path(cfg.output_dir) / "traces" / f"{impl}_rank{rank}.json"


def run_implementation(impl: str, cfg: TrainConfig, accelerator, batches, tokenizer, skip_reason) -> dict:
    """One row of the comparison. Errors become the row's status; memory is freed for the next implementation."""
    result = {"implementation": impl, "status": "ok", "reason": None}
    if skip_reason:
        return {**result, "status": "skipped", "reason": skip_reason}
    device = accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        # Should be ~0: what an earlier implementation's run left allocated would inflate this one's peak.
        result["allocated_before_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 3)
    raw = None
    try:
        raw = train_one(impl, cfg, accelerator, batches, tokenizer)
    except OOM_ERRORS as exc:
        result.update(status="OOM", reason=str(exc).splitlines()[0][:200])
    except Exception as exc:  # noqa: BLE001 - one implementation's failure must not stop the others
        traceback.print_exc()
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        result.update(status="skipped", reason=f"{type(exc).__name__}: {first_line}")
    # Outside the except blocks: the traceback (and the model it references) is gone; free the rest.
    accelerator.free_memory()
    gc.collect()
    from accelerate.utils import gather_object

    # One outcome for all ranks: every rank must take the same gathers below, and the row names a failed rank.
    outcomes = gather_object([(result["status"], result["reason"])])
    failed = [(rank, status, reason) for rank, (status, reason) in enumerate(outcomes) if status != "ok"]
    if failed and result["status"] == "ok":
        rank, status, reason = failed[0]
        result.update(status=status, reason=f"rank {rank}: {reason}")
        raw = None

    world = accelerator.num_processes
    if device.type == "cuda":
        mem = torch.tensor(
            [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
            dtype=torch.float64,
            device=device,
        )
        mem = accelerator.gather(mem).view(world, 2).cpu() / 2**30  # (ranks, [allocated, reserved]) in GiB
        result["peak_allocated_gib"] = [round(x, 3) for x in mem[:, 0].tolist()]
        result["peak_reserved_gib"] = [round(x, 3) for x in mem[:, 1].tolist()]
        result["memory_note"] = "torch.cuda.max_memory_allocated/reserved per rank, reset before the model was built"
        torch.cuda.empty_cache()
    else:
        rss = max((r for r in (raw or {}).get("rss", []) if r is not None), default=0.0)
        result["peak_rss_gib"] = [round(x, 3) for x in accelerator.gather(torch.tensor([rss])).tolist()]
        result["memory_note"] = "CPU: process RSS sampled after each step (includes what earlier runs left cached)"
    if raw is None:
        return result

    stats = [raw["tokens"], raw["padded_tokens"], sum(raw["step_times"]), raw["flops"]]
    stats = torch.tensor(stats, dtype=torch.float64)
    stats = accelerator.gather(stats.to(device)).view(world, 4).cpu()  # (ranks, 4)
    tokens, padded, flops = stats[:, 0].sum().item(), stats[:, 1].sum().item(), stats[:, 3].sum().item()
    seconds = stats[:, 2].max().item()  # the slowest rank sets the pace under DDP/FSDP
    peak, _ = measure.peak_tflops(device, cfg.peak_tflops)
    measured = raw["losses"][cfg.warmup_steps :]
    result.update(
        attn_implementation=raw["attn_implementation"],
        tokens_per_s=tokens / seconds,
        tokens_per_s_per_rank=[round(t / s, 1) for t, s in zip(stats[:, 0].tolist(), stats[:, 2].tolist())],
        step_time_ms=1000 * statistics.mean(raw["step_times"]),
        step_time_ms_median=1000 * statistics.median(raw["step_times"]),
        step_times_ms=[round(1000 * t, 2) for t in raw["step_times"]],  # this rank's measured steps
        # host ms inside Python's garbage collector per measured step, and the full (generation 2) collections
        gc_ms=[round(t, 2) for t in raw["gc_ms"]],
        gc_full_collections=raw["gc_full"],
        # Triton kernels compiled during each measured step (a code path met for the first time in this process)
        triton_compiles=raw["compiles"],
        measured_steps=len(raw["step_times"]),
        real_tokens=int(tokens),
        padded_tokens=int(padded),
        padding_fraction=1 - tokens / padded,
        model_tflops_per_s=flops / seconds / 1e12,
        mfu=(flops / seconds) / (peak * 1e12 * world) if peak else None,
        losses=raw["losses"],
        final_loss=raw["losses"][-1],
        mean_measured_loss=statistics.mean(measured),
        n_matmul_params=raw["n_matmul_params"],
        frozen_matmul_params=raw["frozen_matmul_params"],
    )
    if cfg.profile_step:
        result.update(traced_step=cfg.profile_step, traced_step_ms=raw.get("traced_step_ms"),
                      traces=str(trace_path(cfg, impl, "<r>")))
    return result


def environment(accelerator, flashpatch, fp_error, cfg: TrainConfig, kernel_kwargs: dict | None = None) -> dict:
    import accelerate
    import transformers
    import triton

    device = accelerator.device
    peak, peak_source = measure.peak_tflops(device, cfg.peak_tflops)
    try:
        import datasets

        datasets_version = datasets.__version__
    except ImportError:
        datasets_version = None
    return {
        "device_type": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision,
        "peak_tflops": peak,
        "peak_tflops_source": peak_source,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets_version,
        "flashpatch": getattr(flashpatch, "__version__", None),
        "flashpatch_error": fp_error,
        # what flashpatch.kernels.options.override got for the whole run ({}: the defaults)
        "kernel_options": kernel_kwargs or {},
        "balanced_ranks": balanced_ranks(cfg, accelerator),  # each step's rows dealt across ranks by real tokens
    }


def balanced_ranks(cfg: TrainConfig, accelerator) -> bool:
    """Whether the ranks' rows are dealt by real tokens (balance_ranks: padded rows, several ranks)."""
    return cfg.balance_ranks and accelerator.num_processes > 1 and cfg.data_mode in ("padded", "unpadded")


def recipe_batches(cfg: TrainConfig, accelerator, corpus, tokenizer, num_batches: int):
    """(dataset, batches): the recipe's corpus and this rank's first num_batches batches. The same batches serve
    every implementation, made once (data time stays out of the step time); each rank draws its own stream so
    data-parallel ranks see different documents. With balance_ranks (padded rows, several ranks) every rank draws
    every rank's stream and keeps its share of each step's rows dealt by real tokens."""
    source_kwargs = {}
    if cfg.dataset == "stdlib":
        source_kwargs = {"max_bytes": cfg.corpus_max_bytes, "max_file_bytes": cfg.corpus_max_file_bytes or None}
    dataset = corpus.load_corpus(cfg.dataset, **source_kwargs)
    rank, world = accelerator.process_index, accelerator.num_processes

    def stream(r: int) -> list:
        return list(corpus.make_batches(dataset, cfg.data_mode, cfg.seq_len, cfg.batch_size,
                                        seed=cfg.seed * 1000 + r, tokenizer=tokenizer, num_batches=num_batches))

    if not balanced_ranks(cfg, accelerator):
        return dataset, stream(rank)
    streams = [stream(r) for r in range(world)]
    return dataset, [corpus.balance_padded_batches(list(step), tokenizer.pad_token_id)[rank]
                     for step in zip(*streams)]


def main(argv: list[str] | None = None) -> dict:
    from accelerate import Accelerator

    cfg = parse_config(argv)
    # cpu=True without CUDA: under a multi-process launch the ranks then form one gloo group (MULTI_CPU).
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=cfg.mixed_precision or None)
    flashpatch, fp_error = import_flashpatch()
    kernel_context, kernel_kwargs = kernel_options(cfg, flashpatch)  # a bad name stops the run here
    corpus = import_corpus()

    tokenizer = make_tokenizer(cfg, corpus)
    num_batches = cfg.warmup_steps + cfg.steps * max(cfg.rounds, 1)
    dataset, batches = recipe_batches(cfg, accelerator, corpus, tokenizer, num_batches)

    with kernel_context:  # the kernel forms only flashpatch's rows launch; the other rows ignore them
        if cfg.rounds:  # ranking mode: the implementations take turns on one model
            skip = {"fpatch": fp_error, "fpatch_pf": fp_error}
            results, ranked = ranking.compare(cfg, accelerator, batches, tokenizer, skip, build_training, train_step,
                                              device_inputs, warm_full_rows)
        else:
            results, ranked = [], None
            for impl in cfg.implementations:
                reason = fp_error if impl.startswith("fpatch") else None
                results.append(run_implementation(impl, cfg, accelerator, batches, tokenizer, reason))
                accelerator.wait_for_everyone()

    out = {
        "config": to_dict(cfg),
        "environment": environment(accelerator, flashpatch, fp_error, cfg, kernel_kwargs),
        "data": {
            "documents": len(dataset),
            "note": "padded and unpadded modes make the same padded batches; eager/sdpa/flex run them padded; "
            "fpatch unpads each layer's attention in padded mode and gets one row of real tokens (varlen kwargs, no "
            "layer computes on padding) in unpadded mode; fpatch_pf runs the padded batches through "
            "patch_model(padding_free=True), which packs them in the forward",
        },
        "results": results,
    }
    if ranked:
        out["ranking"] = ranked
    if accelerator.is_main_process:
        out_dir = Path(cfg.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        files = [report.write_json(out, out_dir)]
        if cfg.plots:
            files += report.write_plots(out, out_dir)
        files += [p for p in [report.append_history(out)] if p]  # results/history.csv, on a GPU only
        print("\nwrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:
        sys.stderr.flush()
        # Last on stdout, so `... | tail` shows it.
        print(
            f"\n## {cfg.name}: {cfg.data_mode}, seq {cfg.seq_len}, batch {cfg.batch_size} x "
            f"{accelerator.num_processes}, {out['environment']['device_name']}, "
            f"{'fp32' if accelerator.mixed_precision == 'no' else accelerator.mixed_precision}"
            f"{f', torch.compile {cfg.compile}' if cfg.compile else ''}"
            f"{f', kernel_options {cfg.kernel_options}' if kernel_kwargs else ''}"
            f"{', rows balanced across ranks' if out['environment']['balanced_ranks'] else ''}\n"
        )
        print(ranking.table(out) if ranked else report.markdown_table(out), flush=True)
        for note in report.compile_notes(out) + (ranking.slow_step_notes(out) if ranked else report.rank_notes(out)):
            print(note, flush=True)
    return out


if __name__ == "__main__":
    main()
