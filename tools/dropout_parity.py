"""Issue 5's statistical dropout parity: mean loss over the last 50 steps, eager against flashpatch, per seed.

With dropout on, the two runs draw different masks, so their loss curves differ by noise even when both are right;
one seed pair cannot tell noise from bias. Each seed here fixes the model init, the batches and torch's RNG for both
implementations; the paired differences across seeds show whether flashpatch sits consistently above or below.
    python tools/dropout_parity.py runs/parity_dropout_s*/results.json
"""

from __future__ import annotations

import json
import statistics
import sys

LAST = 50
WINDOW = 25  # steps per window when showing how the gap wanders over a run


def last_mean(result: dict) -> float:
    return statistics.fmean(result["losses"][-LAST:])


def main(paths: list[str]) -> None:
    rows = []
    for path in paths:
        run = json.load(open(path))
        by_impl = {r["implementation"]: r for r in run["results"] if r["status"] == "ok"}
        if not {"eager", "fpatch"} <= by_impl.keys():
            print(f"{path}: eager or fpatch missing, skipped", file=sys.stderr)
            continue
        eager, fpatch = last_mean(by_impl["eager"]), last_mean(by_impl["fpatch"])
        e_losses, f_losses = by_impl["eager"]["losses"], by_impl["fpatch"]["losses"]
        windows = [statistics.fmean(f_losses[a:a + WINDOW]) / statistics.fmean(e_losses[a:a + WINDOW]) - 1
                   for a in range(0, len(e_losses) - WINDOW + 1, WINDOW)]
        rows.append((run["config"]["seed"], eager, fpatch, fpatch / eager - 1, windows))
    if not rows:
        raise SystemExit("no complete runs")
    print(f"| seed | eager, mean of last {LAST} | fpatch, mean of last {LAST} | fpatch / eager - 1 | "
          f"the same per {WINDOW}-step window |")
    print("|---|---|---|---|---|")
    for seed, eager, fpatch, rel, windows in rows:
        trail = " ".join(f"{100 * w:+.1f}" for w in windows)
        print(f"| {seed} | {eager:.4f} | {fpatch:.4f} | {100 * rel:+.2f}% | {trail} |")
    eager_all = statistics.fmean(r[1] for r in rows)
    fpatch_all = statistics.fmean(r[2] for r in rows)
    rels = [r[3] for r in rows]
    spread = f" (paired differences: std {100 * statistics.stdev(rels):.2f}%)" if len(rels) > 1 else ""
    print(f"\nover {len(rows)} seed(s): eager {eager_all:.4f}, fpatch {fpatch_all:.4f}, "
          f"fpatch / eager - 1 = {100 * (fpatch_all / eager_all - 1):+.2f}%{spread}")


if __name__ == "__main__":
    main(sys.argv[1:])
