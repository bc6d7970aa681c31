"""results/history.csv: one row per measured figure, appended by the GPU benchmarks (benchmarks/*.py; host_time.py
and padded_layer.py write their reports through `save_benchmark`) and by recipes/train.py, so that every figure
keeps its date, commit, GPU and versions.

Columns: date (UTC, YYYY-MM-DD), commit (`git rev-parse --short HEAD`, "-dirty" when tracked files differ from it,
"unknown" outside a git checkout), gpu, torch, triton, case, implementation, metric, value.
"""

from __future__ import annotations

import csv
import datetime
import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PATH = REPO / "results" / "history.csv"
COLUMNS = ("date", "commit", "gpu", "torch", "triton", "case", "implementation", "metric", "value")


def git_commit(repo: Path = REPO) -> str:
    """The checkout's short commit, "-dirty" if tracked files have uncommitted changes, or "unknown"."""
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit or "unknown"


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def rows(figures, *, gpu: str, torch_version: str, triton_version: str, date: str | None = None,
         commit: str | None = None) -> list[dict]:
    """History rows from (case, implementation, metric, value) tuples; values keep 4 significant digits (whole
    numbers from 1000 on)."""
    date = date or today()
    commit = commit or git_commit()
    return [
        {"date": date, "commit": commit, "gpu": gpu, "torch": torch_version, "triton": triton_version, "case": case,
         "implementation": impl, "metric": metric, "value": f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"}
        for case, impl, metric, value in figures
        if value is not None
    ]


def append(path: str | Path, new_rows: list[dict]) -> Path | None:
    """Append rows to the CSV at path (header written when the file is new); None when path is empty or nothing
    to write."""
    if not path or not new_rows:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    is_new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        if is_new:
            writer.writeheader()
        writer.writerows(new_rows)
    return path


def save_benchmark(out: str | Path, stem: str, table: str, report_rows: list[dict], figures, *, gpu: str,
                   torch_version: str, triton_version: str, history_path: str | Path) -> None:
    """A GPU benchmark's results: `stem`.md (its table) and `stem`.json (gpu, versions, its rows) written to `out`,
    and its (case, implementation, metric, value) figures appended to history_path; either skipped when empty."""
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.md").write_text(table + "\n")
        report = dict(gpu=gpu, torch=torch_version, triton=triton_version, rows=report_rows)
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    if history_path:
        append(history_path, rows(figures, gpu=gpu, torch_version=torch_version, triton_version=triton_version))
