"""How evenly a causal forward's query blocks spread over the SMs: the launch as it is (the hardware hands the next
program to whichever SM frees first) against a persistent grid of one program per SM that takes every P-th block
of the same order (static striding) or snakes through it. A block's cost is its key steps (128 x 128, Sq = Sk) plus
a per-program overhead in steps (`--overhead`, `--persistent-overhead`). CPU only, no GPU needed.

    python scripts/persistent_grid_sim.py [--sms 132] [--overhead 1.5] [--persistent-overhead 0.3]

It prints, per shape and grid order (config.head_group), the last SM's finish time in steps against the ideal
(total work / SMs). NOTES.md "What is left" 2 (a) has the reading.
"""

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashpatch.kernels.config import causal_head_group  # noqa: E402

# (name, batch x heads, query blocks per head): bench_attention.py's d128 causal rows and the 1B recipe's attention
SHAPES = [("c4k", 4 * 16, 32), ("c8k", 2 * 16, 64), ("c16k", 1 * 16, 128), ("1b", 8 * 16, 8)]


def block_costs(num_heads: int, num_blocks: int, head_group: int) -> list[int]:
    """Key steps of each program, in common.head_and_block's 1-D order with the heaviest blocks first."""
    costs = []
    for pid in range(num_heads * num_blocks):
        if head_group == 0:
            block = pid // num_heads
        else:
            group, rest = divmod(pid, head_group * num_blocks)
            block = rest // min(num_heads - group * head_group, head_group)
        costs.append(num_blocks - block)  # reversed: block 0 of the order is the last query block, all keys
    return costs


def dynamic(costs: list[int], sms: int, overhead: float) -> float:
    """Programs in order, each to the SM that frees first (how the hardware dispatches a grid)."""
    free_at = [0.0] * sms
    for cost in costs:
        heapq.heapreplace(free_at, free_at[0] + cost + overhead)
    return max(free_at)


def static(costs: list[int], sms: int, overhead: float, snake: bool) -> float:
    """Program p takes blocks p, p + P, p + 2P, ... (snake: every other round in reverse)."""
    load = [0.0] * sms
    for i, cost in enumerate(costs):
        rnd, pos = divmod(i, sms)
        load[sms - 1 - pos if snake and rnd % 2 else pos] += cost + overhead
    return max(load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--overhead", type=float, default=1.5, help="per program, in steps, as launched today")
    parser.add_argument("--persistent-overhead", type=float, default=0.3, help="per block, in steps, persistent")
    args = parser.parse_args()
    print("| shape | head group | ideal | launch (dynamic) | persistent, strided | persistent, snake |")
    print("|---|---|---|---|---|---|")
    for name, heads, blocks in SHAPES:
        rule = causal_head_group(blocks, args.sms)
        for group in sorted({rule, 0}):
            costs = block_costs(heads, blocks, group)
            ideal = sum(costs) / args.sms
            cells = [dynamic(costs, args.sms, args.overhead),
                     static(costs, args.sms, args.persistent_overhead, snake=False),
                     static(costs, args.sms, args.persistent_overhead, snake=True)]
            print(f"| {name} | {group}{' (rule)' if group == rule else ''} | {ideal:.1f} | "
                  + " | ".join(f"{c:.1f} ({c / ideal:.2f}x)" for c in cells) + " |")


if __name__ == "__main__":
    main()
