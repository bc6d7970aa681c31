"""Which causal query blocks each program of a persistent grid runs, and in which order: a table the kernel reads.

A persistent forward (fwd.py) keeps one program per SM, each running query blocks one after another. Under a causal
mask the blocks cost 1 to n key steps, so how they are dealt out sets two things: the balance (the program that
finishes last sets the time) and how often a head's K/V comes from HBM rather than L2 (blocks of one head that run at
the same time read the same key blocks). common.persistent_tile's closed form balances only an order of all heads
block-major, where at n4096 the 132 blocks in flight belong to 64 heads, and most K/V reads miss L2.

Here the blocks keep config.head_group's order (heads in groups of about one wave of blocks, each group's blocks
heaviest first) and go greedily, each to the program that a cost model says frees first: the longest-processing-
time rule, what the hardware's dispatcher does with a grid of one program per block, without its per-program cost.
It comes within a few percent of an even split, where the closed form on the same grouped order is far off
(docs/tuning.md, "sm_90 Gluon kernels").
"""

from __future__ import annotations

import functools
import heapq

import torch

# a block's fixed cost (its Q load, first step's wait, epilogue) in key steps, for the cost model
BLOCK_OVERHEAD_STEPS = 0.5


def order_block(tile: int, num_bh: int, num_m: int, head_group: int) -> tuple[int, int]:
    """(batch x head index, query block) of `tile` in the kernels' 1-D order (triton.common.tile_head_and_block)
    with common.query_block_of_tile's causal reversal (the last query block, the heaviest, first)."""
    if head_group == 0:
        bh, block = tile % num_bh, tile // num_bh
    else:
        group, rest = divmod(tile, head_group * num_m)
        heads_here = min(num_bh - group * head_group, head_group)
        bh, block = group * head_group + rest % heads_here, rest // heads_here
    return bh, num_m - 1 - block


def causal_steps(block: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int) -> int:
    """Key blocks that causal query block `block` visits (bottom-right aligned), as query_block_of_tile counts."""
    end = min(max(block * block_m + block_m + seqlen_k - seqlen_q, 0), seqlen_k)
    return -(-end // block_n)


@functools.lru_cache(maxsize=64)
def causal_schedule(num_bh: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, head_group: int,
                    programs: int) -> tuple[int, tuple[int, ...]]:
    """(rounds, table): program p runs tiles table[p * rounds : (p + 1) * rounds] in turn, tile indices in the order
    of head_group (order_block), each tile exactly once; a program with fewer tiles is padded with the tile count,
    which the kernel skips."""
    if num_bh < 1 or seqlen_q < 1 or seqlen_k < 1 or programs < 1 or head_group < 0:
        raise ValueError(f"causal_schedule: num_bh={num_bh}, seqlen_q={seqlen_q}, seqlen_k={seqlen_k}, "
                         f"programs={programs} must be >= 1 and head_group={head_group} >= 0")
    num_m = -(-seqlen_q // block_m)
    num_tiles = num_bh * num_m
    steps = [causal_steps(block, seqlen_q, seqlen_k, block_m, block_n) for block in range(num_m)]
    free_at = [(0.0, p) for p in range(programs)]  # (cost so far, program): a heap, ties to the lower program
    tiles: list[list[int]] = [[] for _ in range(programs)]
    for tile in range(num_tiles):
        load, p = free_at[0]
        tiles[p].append(tile)
        heapq.heapreplace(free_at, (load + steps[order_block(tile, num_bh, num_m, head_group)[1]]
                                    + BLOCK_OVERHEAD_STEPS, p))
    rounds = max(len(t) for t in tiles)
    return rounds, tuple(tile for t in tiles for tile in t + [num_tiles] * (rounds - len(t)))


_TABLES: dict[tuple, tuple[torch.Tensor, int]] = {}  # causal_schedule_tensor's, oldest first
_MAX_TABLES = 64


def causal_schedule_tensor(num_bh: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, head_group: int,
                           programs: int, device: torch.device) -> tuple[torch.Tensor | None, int]:
    """`causal_schedule` as an int32 tensor on `device` (built once per shape and kept), and its rounds; (None, 0)
    where it is not built yet and the stream is capturing a CUDA graph, which a host-to-device copy would break (the
    caller falls back to the closed form: the same results, tile for tile). Building one costs ~1 us of host time
    a tile (2 ms at 2048 tiles, 34 ms at 8 x 64 heads x n8192's 32768, on a 2-core CI machine), once per
    shape (lengths within one 128-row block share a table only if they are equal; a training run meets few)."""
    key = (num_bh, seqlen_q, seqlen_k, block_m, block_n, head_group, programs, device)
    if key not in _TABLES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None, 0
        if len(_TABLES) >= _MAX_TABLES:
            del _TABLES[next(iter(_TABLES))]
        rounds, table = causal_schedule(num_bh, seqlen_q, seqlen_k, block_m, block_n, head_group, programs)
        _TABLES[key] = torch.tensor(table, dtype=torch.int32, device=device), rounds
    return _TABLES[key]
