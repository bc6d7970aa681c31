"""Writing a comparison down: results.json, PNG plots, the markdown table (printed last by the recipes), and on a
GPU the rows appended to results/history.csv.

On CPU flashpatch's kernels run in the Triton interpreter, one NumPy call per block operation: its step times
measure the interpreter, not the kernels, so a CPU run's result is loss parity (each implementation's largest
|loss difference| from eager over every step, same init and batches), and its speed stays in results.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_HISTORY = Path(__file__).resolve().parent.parent / "results" / "history.csv"


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _max_or_none(values):
    values = [v for v in (values or []) if v is not None]
    return max(values) if values else None


def measures_speed(report: dict) -> bool:
    """Whether the run's timings measure the kernels: on a CUDA device, not through the Triton interpreter."""
    env = report["environment"]
    return env["device_type"] == "cuda" and env.get("triton_interpret") != "1"


def loss_parity(report: dict) -> dict:
    """{"reference": name, "max_abs_diff": {implementation: max over steps of |loss - reference loss|}}. The
    reference is eager when it ran, else the first implementation that did; failed runs get None."""
    ok = [r for r in report["results"] if r["status"] == "ok" and r.get("losses")]
    ref = next((r for r in ok if r["implementation"] == "eager"), ok[0] if ok else None)
    diffs = {}
    for r in report["results"]:
        if ref is None or r not in ok or len(r["losses"]) != len(ref["losses"]):
            diffs[r["implementation"]] = None
        else:
            diffs[r["implementation"]] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
    return {"reference": ref["implementation"] if ref else None, "max_abs_diff": diffs}


def markdown_table(report: dict) -> str:
    """One row per implementation. On a GPU: speed, memory (the largest rank's peak), MFU, loss; tokens/s is the
    total over ranks. Elsewhere: loss parity, after a line saying why the speed is left out."""
    if not measures_speed(report):
        return parity_table(report)
    results = report["results"]
    baseline = next((r for r in results if r["implementation"] == "sdpa" and r["status"] == "ok"), None)
    on_gpu = report["environment"]["device_type"] == "cuda"
    mem_cols = "peak alloc GiB | peak reserved GiB" if on_gpu else "peak RSS GiB (process, CPU)"
    lines = [
        f"| implementation | status | tokens/s | vs sdpa | step ms mean / median | {mem_cols} | MFU | final loss |",
        "|---|---|---|---|---|" + ("---|---|" if on_gpu else "---|") + "---|---|",
    ]
    for r in results:
        speedup = None
        if baseline and r["status"] == "ok" and baseline["tokens_per_s"]:
            speedup = r["tokens_per_s"] / baseline["tokens_per_s"]
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"[:80]
        if r["status"] != "ok":
            mem = "- | -" if on_gpu else "-"  # a failed run's peak is where it stopped, not a comparison
        elif on_gpu:
            mem = (
                f"{_fmt(_max_or_none(r.get('peak_allocated_gib')), '.2f')} | "
                f"{_fmt(_max_or_none(r.get('peak_reserved_gib')), '.2f')}"
            )
        else:
            mem = _fmt(_max_or_none(r.get("peak_rss_gib")), ".2f")
        mfu = r.get("mfu")
        lines.append(
            f"| {r['implementation']} | {status} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{_fmt(speedup, '.2f')}{'x' if speedup is not None else ''} | "
            f"{_fmt(r.get('step_time_ms'), '.1f')} / {_fmt(r.get('step_time_ms_median'), '.1f')} | "
            f"{mem} | {_fmt(None if mfu is None else 100 * mfu, '.1f')}{'%' if mfu is not None else ''} | "
            f"{_fmt(r.get('final_loss'), '.4f')} |"
        )
    return "\n".join(lines)


def parity_table(report: dict) -> str:
    """The result of a run whose timings measure nothing (CPU, or the interpreter): each implementation's final
    loss and largest |loss difference| from the reference over every step."""
    parity = loss_parity(report)
    ref, diffs = parity["reference"], parity["max_abs_diff"]
    steps = report["config"].get("warmup_steps", 0) + report["config"].get("steps", 0)
    on_gpu = report["environment"]["device_type"] == "cuda"
    mem_col, mem_key = ("peak alloc GiB", "peak_allocated_gib") if on_gpu else ("peak RSS GiB", "peak_rss_gib")
    lines = [
        f"Loss parity over all {steps} steps, from the same init on the same batches.",
        "Speed is left out: flashpatch's kernels ran in the Triton interpreter, whose timings measure nothing about "
        "the kernels (step times and tokens/s are in results.json).",
        "",
        f"| implementation | status | final loss | max abs loss diff vs {ref or 'eager'} | {mem_col} |",
        "|---|---|---|---|---|",
    ]
    for r in report["results"]:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"[:80]
        diff_cell = "(reference)" if r["implementation"] == ref else _fmt(diffs.get(r["implementation"]), ".2e")
        mem = _fmt(_max_or_none(r.get(mem_key)), ".2f") if r["status"] == "ok" else "-"
        lines.append(f"| {r['implementation']} | {status} | {_fmt(r.get('final_loss'), '.4f')} | {diff_cell} | {mem} |")
    return "\n".join(lines)


_PARALLEL = {"DistributedType.MULTI_GPU": "ddp", "DistributedType.MULTI_CPU": "ddp", "DistributedType.FSDP": "fsdp"}


def history_case(report: dict) -> str:
    """The run as one history.csv case: config name, data mode, shape, ranks (and how they split the work: ddp,
    fsdp; "balanced" with balance_ranks), precision (and compile mode, kernel options)."""
    cfg, env = report["config"], report["environment"]
    precision = "fp32" if env.get("mixed_precision") in (None, "no") else env["mixed_precision"]
    compiled = f" compile {cfg['compile']}" if cfg.get("compile") else ""
    kernels = f" kernel_options {cfg['kernel_options']}" if env.get("kernel_options") else ""
    world = env.get("world_size", 1)
    parallel = _PARALLEL.get(env.get("distributed_type"), "") if world > 1 else ""
    if env.get("balanced_ranks"):
        parallel = f"{parallel} balanced".lstrip()
    return (f"{cfg['name']} {cfg['data_mode']} seq {cfg['seq_len']} batch {cfg['batch_size']}x{world}"
            f"{' ' + parallel if parallel else ''} {precision}{compiled}{kernels}")


def history_figures(report: dict) -> list[tuple[str, str, str, float]]:
    """(case, implementation, metric, value) per successful implementation: tokens/s, median step, peak memory, and in
    ranking mode the median of the step-by-step ratios against sdpa (ranking.paired_ratios)."""
    case = history_case(report)
    figures = []
    for r in report["results"]:
        if r["status"] != "ok":
            continue
        for metric, value in (("tokens_per_s", r.get("tokens_per_s")),
                              ("step_time_ms_median", r.get("step_time_ms_median")),
                              ("peak_allocated_gib", _max_or_none(r.get("peak_allocated_gib"))),
                              ("peak_reserved_gib", _max_or_none(r.get("peak_reserved_gib"))),
                              ("vs_sdpa_paired", r.get("vs_sdpa_paired"))):
            figures.append((case, r["implementation"], metric, value))
    return figures


def append_history(report: dict, path: str | None = None, **kwargs):
    """Append the run's figures to results/history.csv (or path; FLASHPATCH_HISTORY="" skips it), only when the
    timings measure the kernels (`measures_speed`). Returns the path written, or None. kwargs: date, commit."""
    path = os.environ.get("FLASHPATCH_HISTORY", str(DEFAULT_HISTORY)) if path is None else path
    if not path or not measures_speed(report):
        return None
    import history  # recipes/history.py (recipes/ is on sys.path for the recipes and their tests)

    env = report["environment"]
    return history.append(path, history.rows(history_figures(report), gpu=env["device_name"],
                                             torch_version=env["torch"], triton_version=env["triton"], **kwargs))


def compile_notes(report: dict) -> list[str]:
    """A line per implementation whose measured steps compiled Triton kernels: those steps' times include the
    compile, so the mean (and tokens/s) understate the steady state, the median does not."""
    notes = []
    for r in report["results"]:
        steps = [(i, n, t) for i, (n, t) in enumerate(zip(r.get("triton_compiles") or [], r.get("step_times_ms") or []))
                 if n]
        if steps:
            listed = ", ".join(f"step {i + 1}: {n} kernels, {t:,.0f} ms" for i, n, t in steps)
            notes.append(f"\n{r['implementation']}: Triton compiled kernels during measured steps ({listed}), a code "
                         "path met for the first time in this process (a fresh machine has no disk cache); tokens/s "
                         "includes it, the median step does not.")
    return notes


def rank_notes(report: dict) -> list[str]:
    """With several ranks, a line per implementation with each rank's peak memory and tokens/s (the table shows the
    largest rank's memory and the total tokens/s)."""
    if report["environment"].get("world_size", 1) < 2:
        return []
    notes = []
    for r in report["results"]:
        memory = r.get("peak_allocated_gib") or r.get("peak_rss_gib")
        if r["status"] != "ok" or not memory:
            continue
        kind = "peak alloc" if "peak_allocated_gib" in r else "peak RSS"
        rates = " / ".join(f"{t:,.0f}" for t in r.get("tokens_per_s_per_rank") or [])
        notes.append(f"{r['implementation']} per rank: {kind} {' / '.join(f'{m:.2f}' for m in memory)} GiB, "
                     f"tokens/s {rates}")
    return ["\n" + "\n".join(notes)] if notes else []


def write_json(report: dict, out_dir: Path) -> Path:
    path = out_dir / "results.json"
    path.write_text(json.dumps({**report, "loss_parity": loss_parity(report)}, indent=2, default=str))
    return path


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    """throughput.png, memory.png, loss.png. A failed/skipped implementation gets an empty bar and its status. Bars
    carry their values, and throughput goes to a log scale when one bar is tiny next to another (on CPU, where
    flashpatch runs interpreted). The loss plot draws each curve in its own style and, below, each curve's
    difference to the reference (eager), so that curves lying on top of each other stay visible."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    results = report["results"]
    names = [r["implementation"] for r in results]
    title = report["config"]["name"]
    timed = measures_speed(report)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    tps = [r.get("tokens_per_s") or 0.0 for r in results]
    bars = ax.bar(names, tps, color="tab:blue")
    positive = [t for t in tps if t > 0]
    if positive and max(positive) > 20 * min(positive):
        ax.set_yscale("log")
    for bar, r in zip(bars, results):
        x = bar.get_x() + bar.get_width() / 2
        if r["status"] == "ok":
            ax.annotate(f"{r['tokens_per_s']:,.0f}", (x, bar.get_height()), ha="center", va="bottom", fontsize=8)
        else:  # no bar: the status at the foot of the axis
            ax.annotate(r["status"], (x, 0.02), xycoords=("data", "axes fraction"), ha="center", fontsize=8)
    ax.set_ylabel("tokens/s (real tokens, all ranks)")
    ax.set_title(f"{title}: throughput" if timed else
                 f"{title}: throughput (CPU: flashpatch interpreted,\nits time measures nothing)", fontsize=10)
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    if report["environment"]["device_type"] == "cuda":
        alloc = [_max_or_none(r.get("peak_allocated_gib")) or 0.0 for r in results]
        reserved = [_max_or_none(r.get("peak_reserved_gib")) or 0.0 for r in results]
        xs = range(len(names))
        for offset, values, label in ((-0.2, alloc, "peak allocated"), (0.2, reserved, "peak reserved")):
            bars = ax.bar([x + offset for x in xs], values, width=0.4, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("GiB (largest rank)")
        ax.legend()
    else:
        bars = ax.bar(names, [_max_or_none(r.get("peak_rss_gib")) or 0.0 for r in results], color="tab:gray")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_ylabel("process RSS GiB (CPU run: no device memory)")
    ax.set_title(f"{title}: peak memory")
    paths.append(_save(fig, out_dir / "memory.png"))

    parity = loss_parity(report)
    ref = next((r for r in results if r["implementation"] == parity["reference"]), None)
    fig, (ax, diff_ax) = plt.subplots(2, 1, figsize=(6, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1)), "v")]
    for i, r in enumerate(results):
        if not r.get("losses"):
            continue
        line, marker = styles[i % len(styles)]
        steps = range(1, len(r["losses"]) + 1)
        every = max(1, len(r["losses"]) // 12)
        style = {"linestyle": line, "marker": marker, "markevery": (i % every, every), "markersize": 5,
                 "markerfacecolor": "none", "color": f"C{i}", "label": r["implementation"]}
        ax.plot(steps, r["losses"], **style)
        if ref is not None and r is not ref and len(r["losses"]) == len(ref["losses"]):
            diff_ax.plot(steps, [a - b for a, b in zip(r["losses"], ref["losses"])], **style)
    warmup = report["config"]["warmup_steps"]
    for axis in (ax, diff_ax):
        if warmup:
            axis.axvline(warmup + 0.5, color="gray", linestyle=":", label="end of warm-up" if axis is ax else None)
    diff_ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_ylabel("training loss")
    ax.set_title(f"{title}: loss")
    ax.legend()
    diff_ax.set_xlabel("step")
    diff_ax.set_ylabel(f"loss - {parity['reference'] or 'reference'}")
    diff_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if diff_ax.lines[1:]:  # besides the zero line
        diff_ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "loss.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
