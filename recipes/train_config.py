"""Settings of recipes/train.py: one dataclass, filled from defaults < YAML file < command line.

Every field is a command-line option of the same name: `--seq_len 4096`, `--implementations sdpa,fpatch`,
`--gradient_checkpointing true`. Unknown YAML keys are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# fpatch_pf: flashpatch with patch_model(model, padding_free=True): padded batches as they are, packed by flashpatch
IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "fpatch", "fpatch_pf")
COMPILE_MODES = ("", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that replay the step's kernels as CUDA graphs
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"


@dataclass
class TrainConfig:
    # --- what is compared ---
    name: str = ""  # run name; "" = the YAML file's stem. Output goes to runs/<name> unless output_dir is set
    implementations: list[str] = field(default_factory=lambda: ["eager", "sdpa", "fpatch"])  # run in this order

    # --- model: built from these fields with random weights, unless `model` is set ---
    model: str = ""  # a local path or hub name: load its weights and tokenizer instead (needs the hub or files)
    model_family: str = "llama"  # a transformers model_type: llama, mistral, qwen2, qwen3, ...
    hidden_size: int = 64
    intermediate_size: int = 0  # 0 = 8/3 * hidden rounded up to a multiple of 64 (the Llama ratio)
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # < num_heads = grouped-query attention
    head_dim: int = 0  # 0 = hidden_size // num_heads
    vocab_size: int = 0  # 0 = the byte tokenizer's 259 rounded up to 320 (a multiple of 64 for tensor cores)
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0  # set on the model config; active because the model trains in train() mode
    sliding_window: int = 0  # > 0: set on the model config (families with sliding-window layers); 0 = the default
    # > 0: fine-tune LoRA adapters of this rank (peft) on the lora_targets modules; the base weights are frozen
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    # --- data ---
    dataset: str = "stdlib"  # "stdlib" (embedded, no download), a local folder/file, or a hub dataset name
    corpus_max_bytes: int = 8_000_000  # cap on the stdlib corpus: enough distinct documents, fast to load
    corpus_max_file_bytes: int = 0  # keep only stdlib files up to this size (0 = all): short documents for tiny runs
    data_mode: str = "packed"  # padded | packed | unpadded | dense (see flashpatch.corpus.make_batches)
    seq_len: int = 64
    batch_size: int = 4  # per process
    # padded / unpadded under DDP or FSDP: deal each step's rows across the ranks so that their real tokens are near
    # equal (flashpatch.corpus.balance_padded_batches); without it each rank trains the rows of its own stream
    balance_ranks: bool = False

    # --- training ---
    steps: int = 8  # measured steps, after the warm-up
    warmup_steps: int = 2  # run but not measured: allocator growth, autotuning, compilation
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 = no clipping
    gradient_checkpointing: bool = False
    # torch.compile the model: "" = no; "default"; "reduce-overhead" (CUDA graphs: the step's kernels replay without
    # host time per launch, what small host-bound models want); "max-autotune-no-cudagraphs"; "max-autotune"
    compile: str = ""
    mixed_precision: str = ""  # no | bf16 | fp16 through Accelerator(mixed_precision=...); "" = accelerate's setting
    seed: int = 0  # same model init and same batches for every implementation
    # > 0: ranking mode (recipes/ranking.py): one model, the implementations take turns for `steps` steps each on the
    # same batches, in this many rounds with the order rotated each round; reports each one's spread over rounds
    rounds: int = 0
    # flashpatch's kernel forms for this run, "name=value,..." (true/false, none, integers) given to
    # flashpatch.kernels.options.override around the whole run, e.g. "persistent_fwd=false,concurrent_dq=false";
    # "" = the defaults. For A/B runs of kernel forms; results.json's environment records what ran
    kernel_options: str = ""

    # --- reporting ---
    output_dir: str = ""  # "" = runs/<name>
    peak_tflops: float = 0.0  # the GPU's dense bf16/fp16 peak for MFU; 0 = look it up from the GPU's name
    plots: bool = True
    # > 0: trace step N (warm-up steps counted, from 1) with torch.profiler: a Chrome trace per implementation and
    # rank in <output_dir>/traces/<implementation>_rank<r>.json. A traced measured step is left out of the figures.
    profile_step: int = 0


def _parse_value(text: str, annotation: str):
    """Command-line text -> the field's type (annotations are strings under `from __future__ import annotations`)."""
    if annotation == "bool":
        lowered = text.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
        return lowered in ("true", "1", "yes")
    if annotation == "int":
        return int(text)
    if annotation == "float":
        return float(text)
    if annotation.startswith("list"):
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


def parse_kernel_options(text: str) -> dict[str, bool | int | None]:
    """`kernel_options` text -> keyword arguments of flashpatch.kernels.options.override: "a=true,b=none,c=64" ->
    {"a": True, "b": None, "c": 64}. Only the syntax is checked here; the names are checked against flashpatch's
    options when the run starts (train.kernel_options)."""
    kwargs: dict[str, bool | int | None] = {}
    for entry in (e.strip() for e in (text or "").split(",")):
        if not entry:
            continue
        name, sep, value = (part.strip() for part in entry.partition("="))
        if not sep or not name.isidentifier():
            raise ValueError(f"kernel_options: {entry!r} is not name=value (e.g. persistent_fwd=false)")
        if name in kwargs:
            raise ValueError(f"kernel_options: {name!r} is given twice")
        lowered = value.lower()
        if lowered in ("true", "false"):
            kwargs[name] = lowered == "true"
        elif lowered == "none":
            kwargs[name] = None
        else:
            try:
                kwargs[name] = int(value)
            except ValueError:
                raise ValueError(f"kernel_options: {entry!r}: the value must be true, false, none or an integer") \
                    from None
    return kwargs


def _check(cfg: TrainConfig) -> TrainConfig:
    unknown = [i for i in cfg.implementations if i not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"unknown implementations {unknown}; choose from {IMPLEMENTATIONS}")
    if cfg.data_mode not in ("padded", "packed", "unpadded", "dense"):
        raise ValueError(f"data_mode must be padded, packed, unpadded or dense, got {cfg.data_mode!r}")
    if cfg.mixed_precision not in ("", "no", "bf16", "fp16"):
        raise ValueError(f"mixed_precision must be no, bf16 or fp16, got {cfg.mixed_precision!r}")
    if cfg.compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES} ('' = no torch.compile), got {cfg.compile!r}")
    if cfg.steps < 1 or cfg.warmup_steps < 0:
        raise ValueError("need steps >= 1 and warmup_steps >= 0")
    if cfg.sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: the model family's default), got {cfg.sliding_window}")
    if cfg.lora_rank < 0 or (cfg.lora_rank and not cfg.lora_targets):
        raise ValueError(f"lora_rank must be >= 0 (0: full fine-tuning) with lora_targets named, got {cfg.lora_rank} "
                         f"and {cfg.lora_targets}")
    if cfg.rounds < 0 or cfg.profile_step < 0:
        raise ValueError(f"rounds and profile_step must be >= 0, got {cfg.rounds} and {cfg.profile_step}")
    if cfg.rounds and cfg.compile:
        raise ValueError("rounds does not support compile yet (one compiled model would hold a graph per attention "
                         "implementation, under dynamo's recompile limit; untested): compare compiled models with "
                         "rounds 0")
    if cfg.rounds and cfg.profile_step:
        raise ValueError("profile_step traces the default mode's runs; set rounds 0 to take a trace")
    parse_kernel_options(cfg.kernel_options)  # raises ValueError naming the bad entry
    if cfg.profile_step > cfg.warmup_steps + cfg.steps:
        raise ValueError(f"profile_step {cfg.profile_step} is past the last step ({cfg.warmup_steps + cfg.steps})")
    return cfg


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """`--config file.yaml` (default configs/tiny_cpu.yaml) plus `--field value` overrides."""
    parser = argparse.ArgumentParser(description="Compare attention implementations on one training recipe.")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="recipe YAML (default: %(default)s)")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, f in fields.items():
        parser.add_argument(
            f"--{name}", default=None, type=lambda s, a=str(f.type): _parse_value(s, a), help=f"type {f.type}"
        )
    args = parser.parse_args(argv)

    values = yaml.safe_load(Path(args.config).read_text()) or {}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{args.config}: unknown keys {unknown}")
    for name, value in values.items():
        if isinstance(value, str) or (str(fields[name].type) == "float" and isinstance(value, int)):
            values[name] = _parse_value(str(value), str(fields[name].type))  # YAML reads 3e-4 as a string
    for name in fields:
        override = getattr(args, name)
        if override is not None:
            values[name] = override
    cfg = TrainConfig(**values)
    if not cfg.name:
        cfg.name = Path(args.config).stem
    if not cfg.output_dir:
        cfg.output_dir = str(Path("runs") / cfg.name)
    return _check(cfg)


def to_dict(cfg: TrainConfig) -> dict[str, typing.Any]:
    return dataclasses.asdict(cfg)
