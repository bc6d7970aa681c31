"""Block sizes and launch settings per kernel, head dim and device.

options.override(...) swaps any of them for a block of code (KernelConfigs fields): tests use it to show that results
(the dropout mask above all) do not depend on the tiling.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch
import triton


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 1
    blocks_fastest: bool = False  # grid order (common.head_and_block): a head's blocks on consecutive programs
    tma: bool = False  # tensor (TMA) descriptors for tiles, where the GPU and the layout allow (ops.tma_usable)
    dp_first: bool = False  # dK/dV only: dP before the softmax, so the dV matmul overlaps dS (backward._dkdv_inner)


@dataclass(frozen=True)
class KernelConfigs:
    fwd: LaunchConfig
    bwd_dkdv: LaunchConfig  # block_n keys per program, block_m queries per inner step
    bwd_dq: LaunchConfig
    atomic_dq: bool  # accumulate dQ inside the dK/dV kernel (not deterministic) instead of a separate dQ pass
    # inner-loop loads without bounds masks: everywhere when the lengths divide the tiles (ops._even), else between
    # the mask edges (ops._even_interior)
    even_tiles: bool = True
    # The warp-specialized Gluon dK/dV kernel (kernels/hopper_dkdv.py) wherever it applies (its `supported`: sm_90,
    # dense rows dividing its tiles, causal or unmasked, no dropout or softcap); the Triton kernel elsewhere.
    # Round 17 (NOTES.md v19): d128 dK/dV 13-21% faster; at d64 it won on long causal rows only until round 29 (v40:
    # LSE and delta through its TMA ring, the causal mask skipped off the diagonal), and now everywhere but on short
    # causal rows.
    gluon_dkdv: bool = False
    gluon_fwd: bool = False  # the same for the forward (kernels/hopper_fwd.py): d128 forward 15-17% faster (v19)
    gluon_dq: bool = False  # and for the separate dQ pass (kernels/hopper_dq.py): d128 dQ 10-18% faster (v19)
    # The separate dQ pass on the caller's stream while dK/dV runs on a high-priority side stream (ops.attn_bwd_impl),
    # so dQ's programs take the SMs that the dK/dV grid's last wave leaves idle. Round 26 (NOTES.md v33, H100, GPU
    # time of a backward, serial -> concurrent): the 1B shape 0.305-0.308 -> 0.292-0.296 ms, GQA n2048 0.906-0.914
    # -> 0.860-0.874, causal n4096 1.600-1.635 -> 1.567-1.603, d64 GQA n1024 0.753-0.761 -> 0.719-0.720.
    concurrent_dq: bool = True
    # dQ added by the Gluon dK/dV itself (hopper_dkdv: dS split along D between its two consumers, a reducer warp's
    # TMA reduce-adds into an fp32 buffer), no separate pass, where that kernel takes the call and the call is not
    # deterministic. Round 32 (NOTES.md v47, H100, scripts/concurrent_bwd_bench.py, GPU time of a whole backward,
    # concurrent separate pass -> fused): the fp32 buffer's zeroing and conversion cost per dQ element and the two
    # saved matmuls per key seen, so it wins with a query's mean keys seen (`long_keys`): full n2048 / 4096 /
    # 8192 / 16384 -3 / -9 / -10 / -11%, causal n4096 / 8192 / 16384 -1 / -6 / -10%, GQA 16/4 full n4096 -6%,
    # causal n8192 -4%; and loses below 2048 (causal n2048 +5%, GQA n2048 +12%, the 1B shape +31%). With dropout
    # the separate pass draws every keep bit a second time, so the fused dQ wins from fewer keys on (round 33,
    # NOTES.md v52, the same measure against the separate pass beside the Gluon dK/dV: GQA 16/4 causal n2048 -16%,
    # causal n2048 -18%, n8192 -24%, full n4096 -29%): `long_keys` then counts from LONG_KEYS_DROPOUT.
    fused_dq: bool = False
    # The forwards' softmax with the scale folded into the exponent: the row max over the raw scores, then
    # exp2(qk * scale - max) as one fused multiply-add per score instead of a multiply and a subtraction
    # (forward.py, hopper_fwd.py; the kernels ignore it with softcap or ALiBi, which need the scaled scores).
    fold_scale: bool = True


ALIGN = 128  # every block size below is a power of two up to this (ops._aligned)
SHORT = 1024  # query lengths up to this count as short (configs_for's `short`)
LONG_KEYS = 2048  # a query's mean keys seen from this on count as long (configs_for's `long_keys`)
LONG_KEYS_DROPOUT = 1024  # the same with dropout (KernelConfigs.fused_dq: measured from 1024 on)


def configs_for(headdim: int, is_cuda: bool, masked: bool = False, dropout: bool = False,
                aligned: bool = False, short: bool = False, grouped: bool = False,
                long_keys: bool = False, fields: Mapping = MappingProxyType({})) -> KernelConfigs:
    """`measured_configs` (cached: it runs twice per call), with `fields` on top (options.KernelOptions.config_fields:
    what options.override set)."""
    cfg = measured_configs(headdim, is_cuda, masked, dropout, aligned, short, grouped, long_keys)
    return replace(cfg, **fields) if fields else cfg


@functools.lru_cache(maxsize=None)
def measured_configs(headdim: int, is_cuda: bool, masked: bool = False, dropout: bool = False,
                     aligned: bool = False, short: bool = False, grouped: bool = False,
                     long_keys: bool = False) -> KernelConfigs:
    """Launch settings measured by scripts/tune_kernels.py on an H200 (bf16, B*N = 16k, H*D = 2048; NOTES.md and
    docs/results/h200/tune_round*.json). `masked`: causal or windowed, where the forward prefers narrower key tiles
    (less work wasted on the diagonal) and the d64 dK/dV kernel a deeper pipeline. `dropout`: the unmasked d128
    forward keeps the narrow key tile too. Until v17 that was forced (the Philox outputs went through a
    shared-memory interleave that, with 128-wide key tiles, asked for 240 KB); since then the keep bits stay in
    registers, and round 15 measured the 128-wide tile within noise (n8192 forward 327 against 319 TFLOP/s, with
    register spills and 229 KB of shared memory), so the narrow one stays.
    `aligned` (ops._aligned): dense rows whose lengths every tile divides, so the loads carry no bounds masks
    (v10); some tiles win only then and lose on varlen batches (scripts/tune_varlen.py, NOTES.md v12-v15).
    `short`: at most SHORT queries, where a grid of 128-row tiles leaves too few programs to fill the SMs evenly.
    `grouped`: GQA/MQA (fewer K/V heads than query heads), where the dK/dV kernel loops over each K/V head's group.
    `long_keys`: a query sees LONG_KEYS (with dropout LONG_KEYS_DROPOUT) keys or more on average
    (ops._mean_keys_seen), where the fused dQ wins.

    The separate dQ pass beat atomic dQ in every measured case (e.g. d128 n8192 causal: 253 vs 232 TFLOP/s
    backward; round 4: 290 vs 246 with TMA bulk reduce-add) but one, so it is the default, which also makes the
    backward deterministic by construction. The exception (round 15, after v17's register-local keep bits): d128
    causal or windowed with dropout and as many K/V heads as query heads, where atomic dQ saves the dQ pass's
    second draw of every keep bit (backward n2048 / n8192: 191 / 231 -> 206 / 257 TFLOP/s). Without a mask it
    still loses (n8192: 255 -> 217), and with GQA 16/4 too (the 1B recipe's n2048, batch 4: 193 -> 175). There
    `deterministic=True` (or torch's deterministic mode, through the transformers integration) keeps the
    separate pass. Those are the Triton kernels' atomics; the Gluon dK/dV's fused dQ (`fused_dq`, round 32) is the
    other exception. TMA descriptors (`tma`) are used only where they measured faster: elsewhere in
    rounds 4-7 they were within noise of pointer arithmetic, or slower (the d128 forward: 490 -> 456)."""
    block_d = triton.next_power_of_2(headdim)
    # Grid order (round 5, docs/results/h200/tune_round5.json): the forward always runs a head's query blocks on
    # consecutive programs (d128 n8192 full 445 -> 498 TFLOP/s, causal 414 -> 439), which lets the programs in
    # flight share that head's K/V in L2. The backward gains from it without a mask (d64 n8192 full 225 -> 313)
    # but loses with one (d128 n8192 causal 287 -> 274): there the heads-first order starts every head's
    # heaviest causal blocks first.
    bwd_blocks_fastest = not masked
    if not is_cuda:
        # Triton interpreter: each block op is a numpy call, so mid-size tiles keep the Python overhead low.
        cfg = KernelConfigs(
            fwd=LaunchConfig(32, 32, blocks_fastest=True),
            bwd_dkdv=LaunchConfig(32, 32, blocks_fastest=bwd_blocks_fastest),
            bwd_dq=LaunchConfig(32, 32, blocks_fastest=bwd_blocks_fastest),
            atomic_dq=False,
        )
    elif block_d <= 64:
        # Round 3, n8192 backward: causal 270 TFLOP/s (was 262), full 298 (was 257). Round 10 (tune_round10.json),
        # with a mask, n4096 / n8192: dQ through TMA, backward 272 / 293 -> 290 / 310 (on the varlen mix of
        # scripts/tune_varlen.py within +-3%); the forward with 8 warps, 362 / 382 -> 374 / 390, but only when
        # aligned: on varlen batches, whose loads keep their bounds masks, 8 warps lose 36% (1.84 -> 2.49 ms).
        cfg = KernelConfigs(
            fwd=LaunchConfig(128, 64, num_warps=8 if masked and aligned else 4, num_stages=3, blocks_fastest=True),
            # Without a mask, aligned: 32 x 64 dK/dV tiles, 3 stages (rounds 10 and 13, backward at n1024 / 2048 /
            # 4096 / 8192: 281 / 312 / 333 / 343 -> 319 / 329 / 360 / 344).
            bwd_dkdv=(LaunchConfig(32, 64, num_warps=4, num_stages=3, blocks_fastest=True) if aligned and not masked
                      else LaunchConfig(32, 128, num_warps=4, num_stages=3 if masked else 2,
                                        blocks_fastest=bwd_blocks_fastest)),
            # Round 23 (docs/results/h100/round23/tune_varlen_d64*.log): on the varlen mix, 64-query dQ tiles,
            # 1.88-1.90 -> 1.73 ms (32 heads), 1.87-1.89 -> 1.74 (GQA 32/8); round 22 saw the same 8% once. Dense
            # rows and head dims up to 32, not measured with it, keep 128 queries.
            bwd_dq=LaunchConfig(64 if masked and not aligned and block_d == 64 else 128, 64, num_warps=4,
                                num_stages=3, blocks_fastest=bwd_blocks_fastest, tma=masked),
            atomic_dq=False,
            # Round 18 (round18_gluon_d64.log, GPU kernel time, Triton -> Gluon): the Gluon forward wins without a
            # mask (n4096 / n8192 1.40 / 2.88 -> 1.31 / 2.54-2.63 ms) but not with one (causal n4096 0.728 ->
            # 0.739, n1024 GQA 0.26 -> 0.30); the Gluon dQ loses everywhere (n8192 causal 1.33 -> 1.41-1.46). Only
            # where they apply (head dim 64).
            # Round 28 (NOTES.md v36, H200): the Gluon forward with three consumer warpgroups (192-query programs,
            # hopper_fwd.CONSUMERS_BY_HEADDIM) against two, full n4096 / n8192 1.29-1.30 / 2.50-2.51 -> 1.14-1.15 /
            # 2.14-2.18 ms, causal n4096 / n8192 0.73-0.74 / 1.35-1.36 -> 0.68-0.69 / 1.17-1.18 (the Triton forward:
            # 0.72-0.73 / 1.36-1.37), so it takes causal rows too, but not short ones (n1024 GQA 0.30 -> 0.32 against
            # the Triton forward's 0.26), and round 29 (v40, H100) found the same without the mask (16 x n1024, 32/8
            # heads: 0.381-0.392 ms against the Triton forward's 0.358-0.360).
            gluon_fwd=not short,
            # Round 29 (NOTES.md v40, H100, scripts/concurrent_bwd_bench.py, backward GPU time with dQ beside dK/dV,
            # Triton -> Gluon dK/dV): since LSE and delta come through the Gluon kernel's TMA ring and the causal mask
            # is skipped off the diagonal, it wins with GQA (the 121M recipe's 8 x n2048, 12/4 heads, 0.434-0.436 ->
            # 0.405 ms; 32/8 heads n4096 1.96-1.99 -> 1.80-1.82) and without a mask (16 x n1024, 32/8 heads,
            # 1.126-1.129 -> 0.944-0.949), but on short causal rows the Triton one keeps a small lead (16 x n1024,
            # 32/8: 0.720-0.724 against 0.738-0.745). Rounds 18 and 28 had kept the Triton dK/dV everywhere but on
            # long causal rows without GQA.
            gluon_dkdv=not (masked and short),
        )
    elif block_d <= 128 and masked:
        # Round 3, n8192 backward: causal 288 TFLOP/s (was 257). Round 10: dQ through TMA, 295 / 321 -> 299 / 324
        # (n4096 / n8192; within noise, kept as it never lost). Round 11 (tune_round11.json): FlexAttention's sm90
        # dK/dV tile, 64 queries x 128 keys, 8 warps, 3 stages, pointer loads: 294 / 318 -> 324 / 355 when
        # aligned. It spilled here before the unmasked loads of round 8 (v10), and on the varlen mix, whose loads
        # all kept their bounds masks, it lost (backward 6.24 -> 7.57 ms) until v28 dropped the masks between the
        # mask edges: then it won there too (H100, GPU kernel time, dK/dV 3.49 -> 3.14 ms), except with GQA 16/4,
        # where the 32-query tile stays ahead (2.97 against 2.67-2.70 ms; the group loop holds more registers).
        # Without a causal mask it loses (376 -> 352). v28 also turned the varlen dQ to pointer loads, now 5% ahead
        # of TMA there (1.79 -> 1.70 ms).
        # Round 23 (docs/results/h100/round23, tune_varlen.py --kv-heads 4): with GQA, one warpgroup on 32 x 64
        # tiles beats the 32 x 128 tile on the mix (2.71-2.73 -> 2.55 ms) and on the padded recipe's batches of
        # four long documents (1.15 -> 1.05, 1.21 -> 1.17, 0.51 -> 0.44 ms); without GQA it loses (2.97-3.04 ->
        # 3.27). Dropout, not measured with it, keeps the 32 x 128 tile.
        # Round 14 (kernel_time_round14.log, GPU kernel time): at the 1B training recipe's shape (batch 8, 16
        # query / 4 K/V heads, n1024, causal) the forward with 64 x 64 tiles and 4 warps takes 0.119 ms against
        # 0.129 (presumably as twice the programs spread better over 132 SMs); at n4096 it loses
        # (tune_round14.log: 416 -> 400 TFLOP/s), so it is kept to short, aligned rows.
        short_fwd = short and aligned and not dropout
        cfg = KernelConfigs(
            fwd=(LaunchConfig(64, 64, num_warps=4, num_stages=3, blocks_fastest=True) if short_fwd
                 else LaunchConfig(128, 64, num_warps=8, num_stages=3, blocks_fastest=True)),
            bwd_dkdv=(LaunchConfig(64, 128, num_warps=8, num_stages=3) if aligned or not grouped
                      else LaunchConfig(32, 128, num_warps=8, num_stages=3) if dropout
                      else LaunchConfig(32, 64, num_warps=4, num_stages=3)),
            bwd_dq=LaunchConfig(128, 64, num_warps=8, num_stages=3, tma=aligned),
            atomic_dq=dropout and not grouped,  # round 15: see the docstring
            gluon_dkdv=True,
            # with dropout too since v54 (its drawer warps; H100, forward GPU time, Triton -> Gluon: causal n8192
            # 1.73-1.75 -> 1.63-1.68 ms, 8 x n2048 0.53 -> 0.50; unmasked 4 x n4096 1.76 -> 1.64-1.71; NOTES.md v54,
            # v55)
            gluon_fwd=True,
            gluon_dq=True,
            fused_dq=long_keys,
        )
    elif block_d <= 128:
        # Round 7 (tune_round7.json), n4096 / n8192 backward: 317 / 325 -> 344 / 352 TFLOP/s with one-warpgroup
        # dK/dV tiles over 64 keys: 83 KB of shared memory and 128 threads, so two programs share an SM and hide
        # each other's latency. They need TMA loads: with pointer tiles they spill. (With a mask they tie.)
        # Round 16 (NOTES.md v18): dP first (dp_first), backward n4096 / 8192 / 16384 365 / 373 / 381 -> 374 / 392 /
        # 397 TFLOP/s (means of four interleaved samples, dense rows); with dropout it lost 1-2.4% (n8192 255 -> 249),
        # and the masked 64 x 128 tile spilled more with it (the 1B recipe's dK/dV 0.189 -> 0.233 ms). Varlen
        # batches, not measured, keep the old order.
        cfg = KernelConfigs(
            fwd=LaunchConfig(128, 64 if dropout else 128, num_warps=8, num_stages=3, blocks_fastest=True),
            bwd_dkdv=LaunchConfig(32, 64, num_warps=4, num_stages=3, blocks_fastest=True, tma=True,
                                  dp_first=aligned and not dropout),
            bwd_dq=LaunchConfig(128, 64, num_warps=8, num_stages=3, blocks_fastest=True, tma=True),
            atomic_dq=False,
            gluon_dkdv=True,
            gluon_fwd=True,
            gluon_dq=True,
            fused_dq=long_keys,
        )
    else:  # head dim 256: register pressure; small tiles (not yet tuned)
        cfg = KernelConfigs(
            fwd=LaunchConfig(64, 32, num_warps=4, num_stages=2, blocks_fastest=True),
            bwd_dkdv=LaunchConfig(16, 64, num_warps=4, num_stages=1, blocks_fastest=bwd_blocks_fastest),
            bwd_dq=LaunchConfig(64, 16, num_warps=4, num_stages=1, blocks_fastest=bwd_blocks_fastest),
            atomic_dq=False,
        )
    return cfg


def head_group(causal: bool, num_blocks: int, device: torch.device, forced: int | None = None) -> int:
    """HEAD_GROUP, the order of a 1-D grid of num_blocks blocks per head (common.head_and_block: the Triton kernels
    with `blocks_fastest` and the Gluon kernels). Without a mask every block costs the
    same and a head's blocks side by side share its tiles in L2 (1). With a causal mask the blocks cost 1 to
    num_blocks steps, and the grid should end on light blocks of many heads: groups of about one wave of programs
    (SMs / num_blocks heads, a power of two) keep the L2 sharing and balance the last wave; short rows (at most 8
    blocks, a grid of a few waves) take all heads in one group. Round 19 (NOTES.md v21, GPU kernel time, H200,
    head-major -> this rule): d128 causal n4096 forward / dK/dV / dQ 0.566 / 1.004 / 0.614 -> 0.540 / 0.969 / 0.580
    ms; GQA 16/4 n2048 0.334 / 0.652 / 0.358 -> 0.320 / 0.548 / 0.336; n16384 (one head per group) unchanged."""
    if forced is not None:  # options.KernelOptions.head_group
        return forced
    if not causal or device.type != "cuda":  # the interpreter runs the programs one at a time
        return 1
    return causal_head_group(num_blocks, sm_count(device))


def causal_head_group(num_blocks: int, num_sms: int) -> int:
    """`head_group`'s rule for a causal grid on a GPU of num_sms SMs (also scripts/persistent_grid_sim.py's)."""
    if num_blocks <= 8:
        return 0
    return 1 << max(0, round(math.log2(num_sms / num_blocks)))


def persistent_grid(kernel: str, num_blocks: int, headdim: int, beside_dkdv: bool = False) -> bool:
    """Whether the Gluon `kernel` ("fwd" or "dq") runs as a persistent grid (one program per SM taking query blocks
    in turn, hopper_fwd.persistent_tile) for rows of num_blocks query blocks, rather than one program per block.
    Round 26 (NOTES.md v32, H200, GPU kernel time, ms, one program per block -> persistent): the d128 forward gains
    or ties everywhere measured (the 1B recipe's shape, GQA 16/4 n1024 causal, 0.113 -> 0.094; GQA n2048 0.317 ->
    0.276; causal n4096 0.535 -> 0.524, n8192 1.003 -> 0.998; full n4096 within that run's noise), since each
    block's Q load and first K/V blocks now run under the previous block's steps; the d64 forward (full n4096)
    loses 1-2% (1.283-1.294 -> 1.307-1.308). dQ gains on short rows (0.116 -> 0.108 at the 1B shape) but loses from
    n2048 on (0.335 -> 0.353, n8192 1.090 -> 1.29): the closed-form deal (hopper_fwd.persistent_tile) cannot keep
    `head_group`'s head groups, whose L2 sharing dQ needs there (the forward's table, schedule.causal_schedule,
    can: not tried for dQ), and with at most 8 blocks per head the rule has none anyway. A dQ
    that runs beside dK/dV (KernelConfigs.concurrent_dq) starts its programs as dK/dV's finish, where per-block
    programs fill in and a persistent program's fixed share of the blocks would end late: per block there (the 1B
    shape's backward 0.297-0.298 -> 0.292-0.296 ms, H100, scripts/concurrent_bwd_bench.py)."""
    if kernel == "fwd":
        return headdim == 128
    if kernel == "dq":
        return num_blocks <= 8 and not beside_dkdv
    raise ValueError(f"persistent_grid: kernel must be 'fwd' or 'dq', got {kernel!r}")


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
