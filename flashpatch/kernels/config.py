"""Block sizes and launch settings per kernel, head dim and device: the winners of the measurements that
docs/tuning.md records, topic by topic (the comments below name the topic).

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


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 1
    blocks_fastest: bool = False  # grid order (triton.common.head_and_block): a head's blocks on consecutive programs
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
    # The warp-specialized Gluon dK/dV kernel (kernels/sm90/dkdv.py) wherever it applies (its `supported`: sm_90,
    # dense rows dividing its tiles, causal or unmasked); the Triton kernel elsewhere. Where each Gluon kernel wins:
    # docs/tuning.md, "Gluon kernels".
    gluon_dkdv: bool = False
    gluon_fwd: bool = False  # the same for the forward (kernels/sm90/fwd.py)
    gluon_dq: bool = False  # and for the separate dQ pass (kernels/sm90/dq.py)
    # The separate dQ pass on the caller's stream while dK/dV runs on a high-priority side stream (ops.attn_bwd_impl),
    # so dQ's programs take the SMs that the dK/dV grid's last wave leaves idle (docs/tuning.md, "concurrent dQ").
    concurrent_dq: bool = True
    # dQ added by the Gluon dK/dV itself (sm90/dkdv.py: dS split along D between its two consumers, a reducer warp's
    # TMA reduce-adds into an fp32 buffer), no separate pass, where that kernel takes the call and the call is not
    # deterministic. The fp32 buffer's zeroing and conversion cost per dQ element, the two saved matmuls per key
    # seen, so it wins from a query's mean keys seen (`long_keys`); with dropout from fewer keys, as the separate pass
    # draws every keep bit a second time (docs/tuning.md, "fused dQ").
    fused_dq: bool = False
    # The forwards' softmax with the scale folded into the exponent: the row max over the raw scores, then
    # exp2(qk * scale - max) as one fused multiply-add per score instead of a multiply and a subtraction
    # (triton/forward.py, sm90/fwd.py; the kernels ignore it with softcap or ALiBi, which need the scaled scores).
    fold_scale: bool = True


ALIGN = 128  # every block size below is a power of two up to this (ops._aligned)
SHORT = 1024  # query lengths up to this count as short (configs_for's `short`)
LONG_KEYS = 1536  # a query's mean keys seen from this on count as long (configs_for's `long_keys`)
LONG_KEYS_DROPOUT = 1024  # the same with dropout (KernelConfigs.fused_dq: measured from 1024 on)


def configs_for(headdim: int, is_cuda: bool, masked: bool = False, dropout: bool = False,
                aligned: bool = False, short: bool = False, grouped: bool = False,
                long_keys: bool = False, varlen: bool = False, windowed: bool = False, softcapped: bool = False,
                fields: Mapping = MappingProxyType({})) -> KernelConfigs:
    """`measured_configs` (cached: it runs twice per call), with `fields` on top (options.KernelOptions.config_fields:
    what options.override set)."""
    cfg = measured_configs(headdim, is_cuda, masked, dropout, aligned, short, grouped, long_keys, varlen, windowed,
                           softcapped)
    return replace(cfg, **fields) if fields else cfg


@functools.lru_cache(maxsize=None)
def measured_configs(headdim: int, is_cuda: bool, masked: bool = False, dropout: bool = False,
                     aligned: bool = False, short: bool = False, grouped: bool = False,
                     long_keys: bool = False, varlen: bool = False, windowed: bool = False,
                     softcapped: bool = False) -> KernelConfigs:
    """Launch settings measured by benchmarks/tune_kernels.py (bf16, B*N = 16k, H*D = 2048; docs/tuning.md, by head
    dim and case). `masked`: causal or windowed, where the forward prefers narrower key tiles (less work wasted on
    the diagonal) and the d64 dK/dV kernel a deeper pipeline. `dropout`: the unmasked d128 forward keeps the narrow
    key tile too (the 128-wide one ties with spills and 229 KB of shared memory); at d64 the Gluon dQ runs, and on short
    rows the Gluon forward under a causal mask.
    `aligned` (ops._aligned): dense rows whose lengths every tile divides, so the loads carry no bounds masks; some
    tiles win only then and lose on varlen batches (benchmarks/tune_varlen.py).
    `short`: at most SHORT queries, where a grid of 128-row tiles leaves too few programs to fill the SMs evenly.
    `grouped`: GQA/MQA (fewer K/V heads than query heads), where the dK/dV kernel loops over each K/V head's group.
    `long_keys`: a query sees LONG_KEYS (with dropout LONG_KEYS_DROPOUT) keys or more on average
    (ops._mean_keys_seen), where the fused dQ wins. `varlen`: a varlen batch (not aligned, and its tiles measured on
    the varlen mix apart from dense rows whose lengths divide no tile). `windowed`: a sliding window (`masked` too),
    where the fused dQ wins at head dim 128 at the widths measured (1024 and 4096). `softcapped`: scores capped by
    softcap.

    The separate dQ pass beat the Triton dK/dV's atomic dQ in every measured case but one, so it is the default,
    which also makes the backward deterministic by construction. The exception: d128 causal or windowed with
    dropout and as many K/V heads as query heads, where atomic dQ saves the dQ pass's second draw of every keep bit
    (without a mask, or with GQA, it still loses). There `deterministic=True` (or torch's deterministic mode, through
    the transformers integration) keeps the separate pass. The Gluon dK/dV's fused dQ (`fused_dq`) is the other
    exception. TMA descriptors (`tma`) are used only where they measured faster: elsewhere they were within noise
    of pointer arithmetic, or slower (docs/tuning.md, "atomic dQ" and "TMA")."""
    block_d = 1 << (headdim - 1).bit_length()  # the kernels' head-dim tile: the next power of two
    # Grid order (docs/tuning.md, "grid order"): the forward always runs a head's query blocks on consecutive
    # programs, so the programs in flight share that head's K/V in L2. The backward gains from it without a mask but
    # loses with one: there the heads-first order starts every head's heaviest causal blocks first.
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
        # Head dim 64 (docs/tuning.md, "d64 tiles"). With a mask, dQ through TMA; the forward with 8 warps only when
        # aligned: on varlen batches, whose loads keep their bounds masks, 8 warps lose a third.
        cfg = KernelConfigs(
            fwd=LaunchConfig(128, 64, num_warps=8 if masked and aligned else 4, num_stages=3, blocks_fastest=True),
            # without a mask, aligned: 32 x 64 dK/dV tiles, 3 stages
            bwd_dkdv=(LaunchConfig(32, 64, num_warps=4, num_stages=3, blocks_fastest=True) if aligned and not masked
                      else LaunchConfig(32, 128, num_warps=4, num_stages=3 if masked else 2,
                                        blocks_fastest=bwd_blocks_fastest)),
            # 64-query dQ tiles on the varlen mix (8% faster); dense rows (on rows of 1000 / 4000, 128 queries
            # measured 188 / 362 TFLOP/s fwd+bwd against 168 / 301 for 64) and head dims up to 32 keep 128 queries
            bwd_dq=LaunchConfig(64 if masked and varlen and block_d == 64 else 128, 64, num_warps=4,
                                num_stages=3, blocks_fastest=bwd_blocks_fastest,
                                # ptxas (Triton 3.6) crashes on the masked dropout dQ at head dims up to 32 with TMA
                                tma=masked and not (dropout and block_d < 64)),
            atomic_dq=False,
            # The Gluon forward (three consumer warpgroups, sm90.fwd.CONSUMERS_BY_HEADDIM; with dropout two beside
            # their drawer warps; on dense causal rows of up to 4096 a persistent grid of two, config.persistent_grid)
            # wins with or without the mask but on short rows, where its persistent form on dense causal rows and
            # its dropout form under a causal mask still win (GPU ms, 16 x 1024 GQA 32/8: 0.262 -> 0.241, 12/4:
            # 0.101 -> 0.098; 8 x 1024 GQA 12/4 with dropout: 0.095 -> 0.082). The Gluon dQ loses on dense rows at
            # head dim 64 but with dropout, and on varlen batches runs with the Gluon dK/dV, which reads the LSE it
            # pads (varlen mix: 282 TFLOP/s fwd+bwd against 254).
            gluon_fwd=not short or (masked and (dropout or not (varlen or windowed))),
            gluon_dq=varlen or dropout,
            # The dK/dV adds dQ itself (reading K from shared memory, sm90.dkdv.register_kv): without dropout
            # wherever the Gluon dK/dV runs (bwd TFLOP/s, causal n2048 297 -> 336, full n2048 373 -> 388, the varlen
            # mix 287 -> 308), but under sliding windows or softcap (neither measured nor GPU-tested in that form);
            # with dropout from long rows on, sparing the dQ pass its second draw of the keep bits (causal n8192
            # 9.41 -> 4.67 ms; docs/tuning.md)
            fused_dq=long_keys if dropout else not (windowed or softcapped),
            # The Gluon dK/dV everywhere: on short causal rows (bwd TFLOP/s, Triton -> Gluon: causal n512 144 -> 155,
            # n1024 207 -> 213), and there with dropout or on varlen batches (fwd+bwd GPU us: 16 rows of 64-512,
            # GQA 14/2, 166 -> 112; 8 x 1024 with dropout, GQA 12/4, 577 -> 325)
            gluon_dkdv=True,
        )
    elif block_d <= 128 and masked:
        # Head dim 128 with a mask (docs/tuning.md, "d128 masked tiles"). dK/dV: FlexAttention's sm90 tile (64
        # queries x 128 keys, 8 warps, 3 stages), except on varlen batches with GQA, where the group loop holds more
        # registers and a 32-query tile stays ahead (one warpgroup on 32 x 64; with dropout, not measured there, 32 x
        # 128). dQ through TMA on dense rows; varlen rows load by pointer. The forward takes 64 x 64 tiles on short,
        # aligned rows only (twice the programs spread better over the SMs; at n4096 it loses).
        short_fwd = short and aligned and not dropout
        cfg = KernelConfigs(
            fwd=(LaunchConfig(64, 64, num_warps=4, num_stages=3, blocks_fastest=True) if short_fwd
                 else LaunchConfig(128, 64, num_warps=8, num_stages=3, blocks_fastest=True)),
            bwd_dkdv=(LaunchConfig(64, 128, num_warps=8, num_stages=3) if aligned or not grouped
                      else LaunchConfig(32, 128, num_warps=8, num_stages=3) if dropout
                      else LaunchConfig(32, 64, num_warps=4, num_stages=3)),
            bwd_dq=LaunchConfig(128, 64, num_warps=8, num_stages=3, tma=aligned),
            atomic_dq=dropout and not grouped,  # see the docstring
            gluon_dkdv=True,
            gluon_fwd=True,  # with dropout too (its drawer warps)
            gluon_dq=True,
            # the varlen mix: the fused dQ 377 TFLOP/s fwd+bwd against 358 with the dQ pass (GQA 16/8: 395 / 369);
            # windows: backward 1024 at N 8192 356-357 -> 362-364, 4096 at N 16384 (GQA 32/8) 480 -> 493-499
            fused_dq=long_keys or varlen or windowed,
        )
    elif block_d <= 128:
        # Head dim 128 without a mask (docs/tuning.md, "d128 unmasked tiles"): one-warpgroup dK/dV tiles over 64
        # keys (83 KB of shared memory, 128 threads), so two programs share an SM and hide each other's latency;
        # they need TMA loads (with pointer tiles they spill). dP first on dense rows without dropout (with dropout
        # it lost; varlen batches, not measured, keep the old order).
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
    elif headdim == 256:
        # Head dim 256 (docs/tuning.md, "d256 tiles"): the tiles whose (rows, 256) fp32 accumulators fit the
        # registers, 64 rows a warpgroup; the dK/dV's dK and dV take 64 keys over two warpgroups. On sm_90 the
        # Gluon forward (64 keys a step), dK/dV (sm90/dkdv256.py: one warpgroup's dV beside the other's dK) and dQ
        # (32 keys a step) where they apply (dense rows, no dropout).
        cfg = KernelConfigs(
            fwd=LaunchConfig(128, 64, num_warps=8, num_stages=2, blocks_fastest=True),
            bwd_dkdv=LaunchConfig(16, 64, num_warps=8, num_stages=3, blocks_fastest=bwd_blocks_fastest),
            bwd_dq=LaunchConfig(64, 32, num_warps=4, num_stages=2, blocks_fastest=bwd_blocks_fastest),
            atomic_dq=False,
            gluon_dkdv=True,
            gluon_dq=True,
            gluon_fwd=True,
        )
    else:  # head dims 129-255, padded to 256: small tiles, not measured or GPU-tested with head dim 256's
        cfg = KernelConfigs(
            fwd=LaunchConfig(64, 32, num_warps=4, num_stages=2, blocks_fastest=True),
            bwd_dkdv=LaunchConfig(16, 64, num_warps=4, num_stages=1, blocks_fastest=bwd_blocks_fastest),
            bwd_dq=LaunchConfig(64, 16, num_warps=4, num_stages=1, blocks_fastest=bwd_blocks_fastest),
            atomic_dq=False,
        )
    return cfg


def head_group(causal: bool, num_blocks: int, device: torch.device, forced: int | None = None) -> int:
    """HEAD_GROUP, the order of a 1-D grid of num_blocks blocks per head (triton.common.head_and_block: the Triton
    kernels with `blocks_fastest` and the Gluon kernels). Without a mask every block costs the same and a head's
    blocks side by side share its tiles in L2 (1). With a causal mask the blocks cost 1 to num_blocks steps, and the
    grid should end on light blocks of many heads: groups of about one wave of programs (SMs / num_blocks heads, a
    power of two) keep the L2 sharing and balance the last wave; short rows (at most 8 blocks, a grid of a few
    waves) take all heads in one group (docs/tuning.md, "grid order"). `forced`: options.KernelOptions.head_group."""
    if forced is not None:  # options.KernelOptions.head_group
        return forced
    if not causal or device.type != "cuda":  # the interpreter runs the programs one at a time
        return 1
    return causal_head_group(num_blocks, sm_count(device))


def causal_head_group(num_blocks: int, num_sms: int) -> int:
    """`head_group`'s rule for a causal grid on a GPU of num_sms SMs."""
    if num_blocks <= 8:
        return 0
    return 1 << max(0, round(math.log2(num_sms / num_blocks)))


def persistent_grid(kernel: str, num_blocks: int, headdim: int, beside_dkdv: bool = False,
                    varlen: bool = False, causal: bool = False) -> bool:
    """Whether the Gluon `kernel` ("fwd" or "dq") runs as a persistent grid (one program per SM taking query blocks
    in turn, sm90.common.persistent_tile) for rows of num_blocks query blocks (of 128), rather than one program per
    block (docs/tuning.md, "sm_90 Gluon kernels"). The d128 forward on dense rows (sliding windows included) gains or
    ties everywhere, since each block's Q load and first K/V blocks run under the previous block's steps; with
    dropout too, its drawer warps taking the same blocks (2-11% faster forwards, d128 rows of 2048 the most). The d64
    forward on dense `causal` rows (no window) gains with two consumer warpgroups over three up to rows of 4096
    (num_blocks <= 32), and loses beyond. On a `varlen` batch (sm90.fwd.varlen_persistent: its blocks taken by
    tickets, num_blocks unused) the forward gains at head dims 64 and 128 alike, its blocks being short. dQ gains on
    short rows only: the closed-form deal cannot keep `head_group`'s head groups, whose L2 sharing dQ needs on
    longer ones. A dQ that runs beside dK/dV (KernelConfigs.concurrent_dq) starts its programs as dK/dV's finish,
    where per-block programs fill in and a persistent program's fixed share of the blocks would end late."""
    if kernel == "fwd":
        if varlen:
            return headdim in (64, 128)
        return headdim == 128 or (headdim == 64 and causal and num_blocks <= 32)
    if kernel == "dq":
        return num_blocks <= 8 and not beside_dkdv
    raise ValueError(f"persistent_grid: kernel must be 'fwd' or 'dq', got {kernel!r}")


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
