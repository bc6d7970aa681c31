"""Where a kernel's warps stall, from Nsight Compute's source page: the share of each stall reason over all warp
samples, then the instructions holding the most samples with their leading reasons. No GPU needed.

    ncu --clock-control none --kernel-name regex:attn_bwd_dkdv --launch-skip 2 --launch-count 1 \
        --section SourceCounters --section WarpStateStats -o dkdv python3 scripts/ncu_drive.py --shape d64c8k
    ncu -i dkdv.ncu-rep --page source --csv --print-source sass > dkdv_sass.csv
    python scripts/ncu_stalls.py dkdv_sass.csv [--top 40]

Samples cover every warp of the program, idle ones too: a warp-specialized kernel's padding warps wait at a barrier
for the whole launch, and its producer warp mostly waits for free ring slots, so read the consumers' lines.
"""

import argparse
import csv
from collections import Counter


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=40, help="instructions to list")
    args = parser.parse_args()
    rows = list(csv.reader(open(args.csv)))
    header = rows[1]  # rows[0] names the kernel
    column = {name: i for i, name in enumerate(header)}
    data = [row for row in rows[2:] if len(row) == len(header)]
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    totals = Counter()
    for row in data:
        for reason in reasons:
            totals[reason] += number(row[column[reason]])
    total = sum(totals.values())
    print(f"{rows[0][1] if len(rows[0]) > 1 else ''}: {total:.0f} warp samples")
    for reason, count in totals.most_common(12):
        print(f"  {reason:28s} {count / total * 100:5.1f}%")
    samples = "Warp Stall Sampling (All Samples)"
    ranked = sorted(((number(row[column[samples]]), i, row) for i, row in enumerate(data)), reverse=True)
    print(f"\n{'index':>5} {'share':>6} instruction (leading stall reasons, % of its samples)")
    for count, i, row in ranked[:args.top]:
        leading = sorted(((number(row[column[r]]), r[len("stall_"):]) for r in reasons), reverse=True)[:3]
        print(f"{i:5d} {count / total * 100:5.1f}% {row[column['Source']][:70]:70s} "
              + " ".join(f"{name}:{value / count * 100:.0f}" for value, name in leading if value))


if __name__ == "__main__":
    main()
