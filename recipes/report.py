"""Writing a comparison down: results.json, PNG plots, and the markdown table (printed last by the recipes)."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _max_or_none(values):
    values = [v for v in (values or []) if v is not None]
    return max(values) if values else None


def markdown_table(report: dict) -> str:
    """One row per implementation. Memory is the largest rank's peak; tokens/s is the total over ranks."""
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
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    """throughput.png, memory.png, loss.png. A failed/skipped implementation gets an empty bar and its status."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    results = report["results"]
    names = [r["implementation"] for r in results]
    title = report["config"]["name"]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    tps = [r.get("tokens_per_s") or 0.0 for r in results]
    bars = ax.bar(names, tps, color="tab:blue")
    for bar, r in zip(bars, results):
        label = f"{r['tokens_per_s']:,.0f}" if r["status"] == "ok" else r["status"]
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s (real tokens, all ranks)")
    ax.set_title(f"{title}: throughput")
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    if report["environment"]["device_type"] == "cuda":
        alloc = [_max_or_none(r.get("peak_allocated_gib")) or 0.0 for r in results]
        reserved = [_max_or_none(r.get("peak_reserved_gib")) or 0.0 for r in results]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], alloc, width=0.4, label="peak allocated")
        ax.bar([x + 0.2 for x in xs], reserved, width=0.4, label="peak reserved")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("GiB (largest rank)")
        ax.legend()
    else:
        ax.bar(names, [_max_or_none(r.get("peak_rss_gib")) or 0.0 for r in results], color="tab:gray")
        ax.set_ylabel("process RSS GiB (CPU run: no device memory)")
    ax.set_title(f"{title}: peak memory")
    paths.append(_save(fig, out_dir / "memory.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if r.get("losses"):
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["implementation"], alpha=0.8)
    warmup = report["config"]["warmup_steps"]
    if warmup:
        ax.axvline(warmup + 0.5, color="gray", linestyle=":", label="end of warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{title}: loss")
    ax.legend()
    paths.append(_save(fig, out_dir / "loss.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
