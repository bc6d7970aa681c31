"""The launch variants the GPU configs choose between compute the same function: the grid orders
(LaunchConfig.blocks_fastest, config.head_group) and tensor-descriptor (TMA) tiles, checked against the float64
reference.

The interpreter runs tensor descriptors (loads and stores, not the bulk reduce-add of atomic dQ), so the TMA
paths are forced on here by declaring the device capable; tests/test_gpu.py checks them on the GPU, atomic dQ
included."""

from dataclasses import replace

import pytest
import torch

import flashpatch
from flashpatch import ops
from flashpatch.kernels import config as kernel_config
from flashpatch.kernels import options as kernel_options
from flashpatch.kernels.config import LaunchConfig
from flashpatch.kernels.sm90 import schedule
from flashpatch.padding import cu_seqlens_from_lengths
from flashpatch.reference import varlen_attention_reference
from tests.helpers import check_against_reference, random_qkv


def launches(blocks_fastest: bool, tma: bool):
    base = kernel_config.configs_for(64, False)
    return {name: replace(getattr(base, name), blocks_fastest=blocks_fastest, tma=tma)
            for name in ("fwd", "bwd_dkdv", "bwd_dq")}


@pytest.fixture
def tma_capable(monkeypatch):
    monkeypatch.setattr(ops, "_tma_supported", lambda device: True)


@pytest.mark.parametrize("blocks_fastest,head_group", [(False, None), (True, None), (True, 3), (True, 0)])
@pytest.mark.parametrize("kwargs", [{"causal": True}, {"window_size": (9, 3)}, {}], ids=str)
def test_grid_orders_match_reference(blocks_fastest, head_group, kwargs):
    # head groups (config.head_group): 3 leaves a partial last group (8 query heads, 4 K/V heads); 0 is one group
    q, k, v = random_qkv(2, 45, 70, 4, 2, 32, torch.float32)
    with kernel_options.override(head_group=head_group, **launches(blocks_fastest, tma=False)):
        out = flashpatch.flash_attn_func(q, k, v, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


@pytest.mark.parametrize("seqlens,kwargs", [((70, 45), {"causal": True}), ((33, 33), {}), ((1, 17), {"causal": True})],
                         ids=str)
def test_tma_tiles_match_reference(tma_capable, seqlens, kwargs):
    # rows past the sequence end come from the descriptor's zero fill, not from masks: odd lengths test that
    q, k, v = random_qkv(2, *seqlens, 4, 2, 32, torch.float16)
    assert ops.tma_usable(32, q, k, v)
    with kernel_options.override(**launches(blocks_fastest=True, tma=True)):
        out = flashpatch.flash_attn_func(q, k, v, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


def test_tma_tiles_varlen_match_reference(tma_capable):
    # a descriptor per sequence: a tile never reads the next document's rows
    lengths = [23, 1, 40, 9]
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    q, k, v = (torch.randn(sum(lengths), h, 32, dtype=torch.float16, requires_grad=True) for h in (4, 2, 2))
    with kernel_options.override(**launches(blocks_fastest=True, tma=True)):
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference, ref_args=(cu, cu),
                            causal=True)


def test_tma_only_where_the_layout_allows(tma_capable):
    q = torch.randn(2, 16, 4, 64, dtype=torch.float16)
    assert ops.tma_usable(64, q)
    assert not ops.tma_usable(48, torch.randn(2, 16, 4, 48, dtype=torch.float16))  # tile != head dim
    assert not ops.tma_usable(4, torch.randn(2, 16, 4, 4, dtype=torch.float16))  # rows under 16 bytes
    wide = torch.randn(2 * 16 * 4 * 64 + 1, dtype=torch.float16)
    assert not ops.tma_usable(64, wide[1:].view(2, 16, 4, 64))  # base 2 bytes off 16-byte alignment
    assert not ops.tma_usable(64, torch.randn(2, 16, 4, 65, dtype=torch.float16)[..., :64])  # row stride 130 B


def test_aligned_tiles_only_for_dense_rows_every_tile_divides():
    # config.py may pick different tiles for aligned launches (no bounds masks in any load); anything ragged keeps
    # the tiles measured with masks.
    assert ops._aligned(False, 128, 4096, 8192)
    assert ops._aligned(False, 64, 128, 128)
    assert not ops._aligned(True, 128, 4096, 4096)  # varlen: sequences end anywhere
    assert not ops._aligned(False, 96, 4096, 4096)  # padded head-dim columns
    assert not ops._aligned(False, 128, 4096, 4032)  # 4032 = 63 * 64: a 128-key tile would overhang
    assert not ops._aligned(False, 128, 1000, 4096)


def test_tma_unavailable_on_cpu_tensors():
    assert not ops.tma_usable(64, torch.randn(2, 16, 4, 64, dtype=torch.float16))


@pytest.mark.parametrize("even_tiles", [True, False])
@pytest.mark.parametrize("kwargs", [{"causal": True}, {}], ids=str)
def test_unmasked_tile_loads_match_reference(even_tiles, kwargs):
    # lengths that the interpreter's 32-wide tiles divide, so with even_tiles the inner loops load without
    # bounds masks (ops._even); 64 queries against 96 keys also puts the causal diagonal off the tile corners
    q, k, v = random_qkv(2, 64, 96, 4, 2, 32, torch.float32)
    assert ops._even(even_tiles, False, 32, 64, 32, 96, 32) == even_tiles
    with kernel_options.override(even_tiles=even_tiles):
        out = flashpatch.flash_attn_func(q, k, v, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


def dp_first_override(enabled: bool):
    base = kernel_config.configs_for(64, False)
    return {"bwd_dkdv": replace(base.bwd_dkdv, dp_first=enabled)}


@pytest.mark.parametrize("seqlens,kwargs", [
    ((45, 70), {"causal": True}),
    ((33, 97), {"window_size": (9, 3)}),
    ((64, 96), {"softcap": 5.0}),
    ((1, 17), {}),
], ids=str)
def test_dp_first_dkdv_order_matches_reference(seqlens, kwargs):
    # LaunchConfig.dp_first: the dK/dV kernel computes dPᵀ before the softmax (backward._dkdv_inner)
    q, k, v = random_qkv(2, *seqlens, 4, 2, 32, torch.float32)
    with kernel_options.override(**dp_first_override(True)):
        out = flashpatch.flash_attn_func(q, k, v, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


def test_dp_first_dkdv_order_with_dropout_gives_the_same_gradients():
    # the same keep bits and the same arithmetic per element, only the matmuls reordered
    q, k, v = random_qkv(2, 45, 70, 4, 2, 32, torch.float32)
    dout = torch.randn(2, 45, 4, 32)
    grads = []
    for enabled in (False, True):
        torch.manual_seed(0)
        with kernel_options.override(**dp_first_override(enabled)):
            out = flashpatch.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
            grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for plain, reordered in zip(*grads):
        torch.testing.assert_close(reordered, plain, rtol=1e-6, atol=1e-6)


@pytest.fixture
def configs_for_calls(monkeypatch):
    """The positional arguments of every configs_for call ops makes:
    (headdim, is_cuda, masked, dropout, aligned, short, grouped, long_keys)."""
    calls = []
    configs_for = kernel_config.configs_for

    def spy(*args, **kwargs):
        calls.append(args)
        return configs_for(*args, **kwargs)

    monkeypatch.setattr(kernel_config, "configs_for", spy)
    return calls


def test_forward_and_backward_pick_settings_by_query_length(configs_for_calls, monkeypatch):
    # ops asks config.py for the short-row settings up to SHORT queries, the same in forward and backward;
    # 16 and 17 queries straddle a lowered SHORT, against an odd number of keys
    monkeypatch.setattr(kernel_config, "SHORT", 16)
    for seqlen_q, short in ((16, True), (17, False)):
        configs_for_calls.clear()
        q, k, v = random_qkv(1, seqlen_q, 33, 2, 1, 32, torch.float32)
        flashpatch.flash_attn_func(q, k, v, causal=True).sum().backward()
        assert [args[5] for args in configs_for_calls] == [short, short]


def test_atomic_dq_only_for_masked_d128_dropout_without_gqa():
    # config.py: atomic dQ won only there; GQA, no mask or no dropout keep the deterministic dQ pass
    def atomic(masked=True, dropout=True, grouped=False, headdim=128):
        return kernel_config.configs_for(headdim, True, masked=masked, dropout=dropout, aligned=True,
                                         grouped=grouped).atomic_dq
    assert atomic()
    assert not atomic(grouped=True)
    assert not atomic(masked=False)
    assert not atomic(dropout=False)
    assert not atomic(headdim=64)


def test_fused_dq_only_for_rows_with_long_keys_and_windows():
    # config.py (docs/tuning.md): at head dim 128 the Gluon dK/dV's fused dQ won where a query sees LONG_KEYS keys
    # or more on average, with or without a mask or GQA, and under sliding windows; at head dim 64 without dropout
    # at any length but under windows or softcap (not measured there), with dropout where keys are long; never at 256
    # or in the interpreter
    def fused(headdim=128, is_cuda=True, long_keys=True, **flags):
        return kernel_config.configs_for(headdim, is_cuda, aligned=True, long_keys=long_keys, **flags).fused_dq
    assert fused() and fused(masked=True) and fused(grouped=True) and fused(masked=True, grouped=True)
    assert not fused(long_keys=False)
    assert not fused(masked=True, long_keys=False, short=True)
    assert fused(headdim=64) and fused(headdim=64, long_keys=False, masked=True, grouped=True, varlen=True)
    assert not fused(headdim=64, softcapped=True) and fused(headdim=128, softcapped=True)
    assert not fused(headdim=256)
    assert fused(headdim=64, dropout=True) and not fused(headdim=64, dropout=True, long_keys=False)
    assert not fused(is_cuda=False)
    # sliding windows at head dim 128 whatever their width (ops._mean_keys_seen counts them as 0 keys)
    assert fused(masked=True, windowed=True, long_keys=False) and fused(masked=True, windowed=True, grouped=True,
                                                                         long_keys=False)
    assert not fused(headdim=64, masked=True, windowed=True, long_keys=False)
    # the measured edge (docs/tuning.md, "fused dQ"): causal rows of 3072 and 4000 queries gained from it, of 2048 lost
    long_causal = [ops._mean_keys_seen(n, n, -1, 0) >= kernel_config.LONG_KEYS for n in (2048, 3072, 4000)]
    assert long_causal == [False, True, True]


@pytest.mark.parametrize("headdim,accum_dtype,accum_rows,register_kv", [
    (64, torch.float32, 17, True), (128, torch.bfloat16, 17, None), (128, torch.float32, 16, None)])
def test_gluon_dkdv_refuses_a_dq_buffer_it_cannot_add_into(headdim, accum_dtype, accum_rows, register_kv):
    # the fused dQ (sm90_dkdv.fuses_dq) reads K from shared memory (not with register_kv forced on) and adds into an
    # fp32 buffer shaped like q; anything else is refused before a descriptor is built, so it fails the same on a CPU
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv

    q, k, v = random_qkv(1, 17, 17, 2, 1, headdim, torch.float16, requires_grad=False)
    lse = torch.zeros(1, 2, 17)
    accum = torch.zeros(1, accum_rows, 2, headdim, dtype=accum_dtype)
    options = kernel_options.KernelOptions(register_kv=register_kv)
    with pytest.raises(ValueError, match="fuses_dq|dq_accum must be float32"):
        sm90_dkdv.attn_bwd_dkdv(q, k, v, q, lse, lse.clone(), k.clone(), v.clone(), 1.0, 1.0, True,
                                  dq_accum=accum, options=options)


@pytest.mark.parametrize("headdim", [64, 128])
def test_gluon_dkdv_refuses_dropout_without_seed_offset(headdim):
    # the drawer warps (sm90_dkdv._keep_drawer) draw from a (seed, offset) tensor; a call without one is refused
    # naming the values, before a descriptor is built
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv

    q, k, v = random_qkv(1, 17, 17, 2, 1, headdim, torch.float16, requires_grad=False)
    lse = torch.zeros(1, 2, 17)
    with pytest.raises(ValueError, match="dropout_p=0.1 with seed_offset=None"):
        sm90_dkdv.attn_bwd_dkdv(q, k, v, q, lse, lse.clone(), k.clone(), v.clone(), 1.0, 1.0, True,
                                  seed_offset=None, dropout_p=0.1)


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_gluon_backward_refuses_dropout_on_varlen_batches(kernel):
    # the varlen forms of the Gluon dK/dV and dQ draw no keep bits (`supported` keeps those calls on the Triton
    # kernels); a direct call is refused naming dropout_p, before a descriptor is built
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv, dq as sm90_dq

    lengths = [17, 1, 113]
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    q = torch.randn(sum(lengths), 4, 128, dtype=torch.float16)  # (T, H, D)
    k, v = (torch.randn(sum(lengths), 2, 128, dtype=torch.float16) for _ in "kv")  # (T, Hk, D)
    lse = torch.zeros(4, sum(lengths) + 128 * len(lengths))
    varlen = (cu, cu, torch.zeros(2, 3, dtype=torch.int32))
    seed_offset = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="dropout_p=0.1"):
        if kernel == "dkdv":
            sm90_dkdv.attn_bwd_dkdv(q, k, v, q, lse, lse.clone(), k.clone(), v.clone(), 1.0, 1.0, True,
                                      seed_offset=seed_offset, dropout_p=0.1, varlen=varlen)
        else:
            sm90_dq.attn_bwd_dq(q, k, v, q, lse, lse.clone(), q.clone(), 1.0, 1.0, True, seed_offset=seed_offset,
                                  dropout_p=0.1, varlen=varlen)


@pytest.mark.parametrize("headdim", [64, 128])
def test_gluon_forward_refuses_dropout_without_seed_offset(headdim):
    # the forward's drawer warps (sm90_fwd._fwd_keep_drawer) draw from a (seed, offset) tensor; a direct call without
    # one is refused naming the values, before a descriptor is built
    from flashpatch.kernels.sm90 import fwd as sm90_fwd

    q, k, v = random_qkv(1, 17, 17, 2, 1, headdim, torch.float16, requires_grad=False)
    with pytest.raises(ValueError, match="dropout_p=0.1 with seed_offset=None"):
        sm90_fwd.attn_fwd(q, k, v, torch.empty_like(q), torch.zeros(1, 2, 17), 1.0, True, seed_offset=None,
                            dropout_p=0.1)


def test_gluon_forward_dropout_register_split_is_one_setmaxnreg_can_take():
    # the dropout forward launches its 9 + 2 DRAWER_WARPS warps as whole warpgroups (20) at `maxnreg` registers;
    # warp_specialize hands the worker consumer, the producer's and the drawers' warpgroups their setmaxnreg counts
    # and the default partition's consumer the rest of the pool, which must match the worker consumer's. setmaxnreg
    # takes multiples of 8 in [24, 256]: a count outside that fails only at a GPU launch.
    from flashpatch.kernels.sm90 import fwd as sm90_fwd

    maxnreg, consumer, worker = sm90_fwd.dropout_registers()
    groups = -(-(9 + 2 * sm90_fwd.DRAWER_WARPS) // 4)  # 8 consumer warps, the producer's and the drawers', in fours
    for count in (consumer, worker):
        assert 24 <= count <= 256 and count % 8 == 0, (consumer, worker)
    assert 2 * consumer + (groups - 2) * worker == groups * maxnreg  # nothing of the pool left idle
    assert maxnreg % 8 == 0 and groups * 128 * maxnreg <= 65536  # the register file


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 17), (17, 1), (113, 113), (45, 70), (70, 45), (5, 1023)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0)], ids=["full", "causal"])
def test_mean_keys_seen_counts_the_mask(seqlen_q, seqlen_k, window):
    # against the reference's own mask: the mean over queries of the keys each may attend to
    from flashpatch.reference import visibility_mask

    visible = visibility_mask(seqlen_q, seqlen_k, window_size=window)
    expected = visible.sum(-1).double().mean().item()
    assert ops._mean_keys_seen(seqlen_q, seqlen_k, *window) == pytest.approx(expected, rel=1e-12)


def test_ops_tell_config_whether_keys_are_long(configs_for_calls, monkeypatch):
    # LONG_KEYS lowered to 40: 33 queries see 40 keys each without a mask; under the causal mask 40 - 16 = 24, long
    # with dropout, where LONG_KEYS_DROPOUT (lowered to 24) counts
    monkeypatch.setattr(kernel_config, "LONG_KEYS", 40)
    monkeypatch.setattr(kernel_config, "LONG_KEYS_DROPOUT", 24)
    for kwargs, long_keys in (({}, True), ({"causal": True}, False), ({"causal": True, "dropout_p": 0.1}, True)):
        configs_for_calls.clear()
        q, k, v = random_qkv(1, 33, 40, 2, 1, 32, torch.float32)
        flashpatch.flash_attn_func(q, k, v, **kwargs).sum().backward()
        assert [args[7] for args in configs_for_calls] == [long_keys, long_keys]


def test_dp_first_only_for_unmasked_d128_without_dropout():
    # config.py: dP first won only with the one-warpgroup unmasked d128 tile on dense rows; it lost with
    # dropout and spilled in the masked 64 x 128 tile
    def dp_first(masked=False, dropout=False, headdim=128, aligned=True):
        return kernel_config.configs_for(headdim, True, masked=masked, dropout=dropout,
                                         aligned=aligned).bwd_dkdv.dp_first
    assert dp_first()
    assert not dp_first(aligned=False)  # varlen and ragged rows: not measured
    assert not dp_first(dropout=True)
    assert not dp_first(masked=True)
    assert not dp_first(headdim=64)
    assert not kernel_config.configs_for(128, False).bwd_dkdv.dp_first  # the interpreter's tiles


def test_ops_tell_config_whether_heads_are_grouped(configs_for_calls):
    for nheads_k, grouped in ((2, False), (1, True)):
        configs_for_calls.clear()
        q, k, v = random_qkv(1, 17, 17, 2, nheads_k, 32, torch.float32)
        flashpatch.flash_attn_func(q, k, v, causal=True).sum().backward()
        assert [args[6] for args in configs_for_calls] == [grouped, grouped]


@pytest.mark.parametrize("order", ["bshd", "bhsd", "sbhd"])
def test_gluon_rows_view_addresses_each_heads_rows(order):
    from flashpatch.kernels.sm90 import common as sm90_common

    batch, seqlen, heads, headdim = 3, 8, 5, 4
    physical = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}[order]
    shape = [(batch, seqlen, heads, headdim)[i] for i in physical]
    t = torch.arange(batch * seqlen * heads * headdim, dtype=torch.float32).view(shape)
    t = t.permute([physical.index(i) for i in range(4)])  # seen as (B, S, H, D)
    view = sm90_common.rows_view(t)
    if order == "sbhd":  # a (batch, head)'s positions are not evenly spaced rows of any 2-D view
        assert view is None
        return
    view_shape, strides, (rows_b, rows_h), cols_h = view
    flat = torch.as_strided(t, view_shape, strides)
    for b, h in [(0, 0), (2, 4), (1, 3)]:
        rows = flat[b * rows_b + h * rows_h:][:seqlen, h * cols_h:][:, :headdim]
        assert torch.equal(rows, t[b, :, h])


def test_gluon_kernels_only_on_sm90_cuda_tensors():
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv, dq as sm90_dq, fwd as sm90_fwd

    q, k, v = random_qkv(1, 128, 128, 2, 2, 128, torch.float16, requires_grad=False)
    scope = dict(varlen=False, max_seqlen_q=128, max_seqlen_k=128, window_left=-1, window_right=0, softcap=0.0,
                 dropout_p=0.0)
    assert not sm90_fwd.supported(q, k, v, **scope)
    assert not sm90_dkdv.supported(q, k, v, q, **scope)
    assert not sm90_dq.supported(q, k, v, q, **scope)


def test_gluon_d256_scope(monkeypatch):
    # Head dim 256 on sm_90 (stubbed here): the forward, sm90/dkdv256.py's dK/dV and the dQ pass take dense rows
    # and varlen batches, causal, unmasked or a causal window, softcap; no dropout; never CPU tensors, never another
    # head dim
    from flashpatch.kernels.sm90 import common as sm90_common, dkdv256, dq as sm90_dq, fwd as sm90_fwd

    q, k, v = random_qkv(1, 64, 64, 2, 1, 256, torch.float16, requires_grad=False)
    scope = dict(varlen=False, max_seqlen_q=64, max_seqlen_k=64, window_left=-1, window_right=0, softcap=0.0,
                 dropout_p=0.0)
    assert not dkdv256.supported(q, k, v, q, **scope)  # a CPU tensor
    monkeypatch.setattr(sm90_common, "capability", lambda device: (9, 0))
    monkeypatch.setattr(sm90_common, "enabled", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    for kernel in (sm90_fwd, dkdv256, sm90_dq):
        tensors = (q, k, v) if kernel is sm90_fwd else (q, k, v, q)
        assert kernel.supported(*tensors, **scope)
        assert kernel.supported(*tensors, **dict(scope, window_left=100, softcap=50.0))
        assert kernel.supported(*tensors, **dict(scope, window_right=-1))
        assert not kernel.supported(*tensors, **dict(scope, dropout_p=0.1))
        assert kernel.supported(*(t[0] for t in tensors), **dict(scope, varlen=True))  # (T, H, D)
        assert not kernel.supported(*tensors, **dict(scope, window_left=100, window_right=-1))
        assert not kernel.supported(*(t.float() for t in tensors), **scope)
    narrow = random_qkv(1, 64, 64, 2, 1, 128, torch.float16, requires_grad=False)
    assert not dkdv256.supported(*narrow, narrow[0], **scope)
    assert not dkdv256.fuses_dq(256)
    cfg = kernel_config.configs_for(256, True, masked=True)
    assert cfg.gluon_fwd and cfg.gluon_dkdv and cfg.gluon_dq


def test_gluon_kernels_chosen_where_they_measured_faster():
    for masked in (False, True):
        on = kernel_config.configs_for(128, True, masked=masked, aligned=True)
        assert on.gluon_fwd and on.gluon_dkdv and on.gluon_dq
        off = kernel_config.configs_for(128, False, masked=masked)
        assert not (off.gluon_fwd or off.gluon_dkdv or off.gluon_dq)
    # head dim 64: the forward past SHORT, and on short dense causal rows (its persistent form) but under a window;
    # dK/dV on every row (dense or varlen, short or not, with or without GQA); never the dQ pass on dense rows
    for masked, short, dense_fwd, packed_fwd in ((False, False, True, True), (False, True, False, False),
                                                 (True, False, True, True), (True, True, True, False)):
        for grouped in (False, True):
            cfg = kernel_config.configs_for(64, True, masked=masked, aligned=True, short=short, grouped=grouped)
            assert cfg.gluon_fwd == dense_fwd and cfg.gluon_dkdv and not cfg.gluon_dq, (masked, short, grouped)
            packed = kernel_config.configs_for(64, True, masked=masked, short=short, grouped=grouped, varlen=True)
            assert packed.gluon_fwd == packed_fwd and packed.gluon_dkdv and packed.gluon_dq, (masked, short, grouped)
            window = kernel_config.configs_for(64, True, masked=True, short=short, grouped=grouped, windowed=True)
            assert window.gluon_fwd == (not short), (short, grouped)
    # with dropout the Gluon dK/dV and dQ everywhere, and the forward past SHORT or under a causal mask
    for masked in (False, True):
        cfg = kernel_config.configs_for(64, True, masked=masked, dropout=True, aligned=True)
        assert cfg.gluon_fwd and cfg.gluon_dkdv and cfg.gluon_dq, masked
        short = kernel_config.configs_for(64, True, masked=masked, dropout=True, aligned=True, short=True)
        assert short.gluon_fwd == masked and short.gluon_dkdv and short.gluon_dq, masked


def test_d64_masked_dq_tile_varlen_apart_from_ragged_dense_rows():
    # the 64-query dQ tile was measured on the varlen mix; dense rows whose lengths divide no tile keep the 128-query
    # tile of aligned rows (kernels/config.py)
    dense = kernel_config.configs_for(64, True, masked=True, aligned=False)
    varlen = kernel_config.configs_for(64, True, masked=True, aligned=False, varlen=True)
    aligned = kernel_config.configs_for(64, True, masked=True, aligned=True)
    assert (dense.bwd_dq.block_m, varlen.bwd_dq.block_m, aligned.bwd_dq.block_m) == (128, 64, 128)


def test_causal_grids_end_on_many_heads_light_blocks(monkeypatch):
    monkeypatch.setattr(kernel_config, "sm_count", lambda device: 132)
    gpu = torch.device("cuda", 0)
    assert kernel_config.head_group(False, 32, gpu) == 1  # every block costs the same: head-major
    assert kernel_config.head_group(True, 8, gpu) == 0  # short rows: all heads in one group
    # about one wave of programs per group (132 SMs): n2048 / 4096 / 8192 / 16384 / 32768 with 128-row blocks
    assert [kernel_config.head_group(True, n // 128, gpu) for n in (2048, 4096, 8192, 16384, 32768)] == \
        [8, 4, 2, 1, 1]
    assert kernel_config.head_group(True, 32, torch.device("cpu")) == 1  # the interpreter: order is moot
    assert kernel_config.head_group(False, 32, gpu, forced=3) == 3  # options.KernelOptions.head_group
    with pytest.raises(ValueError, match="-2"), kernel_options.override(head_group=-2):
        pass


def test_gluon_switch_and_triton_release_gate(monkeypatch):
    from flashpatch.kernels import sm90

    monkeypatch.setattr(sm90, "AVAILABLE", True)
    monkeypatch.setattr(sm90.triton, "__version__", "3.6.0")
    monkeypatch.delenv("FLASHPATCH_GLUON", raising=False)
    assert sm90.enabled()
    monkeypatch.setenv("FLASHPATCH_GLUON", "0")
    assert not sm90.enabled()
    monkeypatch.delenv("FLASHPATCH_GLUON")
    monkeypatch.setattr(sm90.triton, "__version__", "3.9.0")  # a release the kernels were not checked on
    assert not sm90.enabled()


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1024, 1024), (1000, 1024), (1024, 1000), (17, 113), (1, 128)])
def test_gluon_kernels_take_lengths_that_divide_no_tile(monkeypatch, seqlen_q, seqlen_k):
    # A last tile past a sequence's end is masked in the Gluon kernels (their module docstrings), so their scope
    # (sm90_dense_ok, stubbed here: it needs sm_90) adds no length condition.
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv, dq as sm90_dq, fwd as sm90_fwd

    for module in (sm90_fwd, sm90_dkdv, sm90_dq):
        monkeypatch.setattr(module, "sm90_dense_ok", lambda *tensors, **scope: True)
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 2, 2, 128, torch.float16, requires_grad=False)
    scope = dict(varlen=False, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k, window_left=-1, window_right=0,
                 softcap=0.0, dropout_p=0.0)
    assert sm90_fwd.supported(q, k, v, **scope)
    assert sm90_dq.supported(q, k, v, q, **scope)
    assert sm90_dkdv.supported(q, k, v, q, **scope)


@pytest.mark.parametrize("seqlen_q", [1, 17, 128, 200])
def test_backward_preprocess_pads_lse_and_delta(seqlen_q):
    # Dense rows: the backward's LSE and delta run on to a multiple of 128 rows, LSE +inf and delta 0 past seqlen_q,
    # so that the Gluon kernels' whole tiles past a sequence's end get P = 0 (ops.attn_bwd_impl)
    from flashpatch.kernels.triton.backward import attn_bwd_preprocess_kernel

    batch, nheads, headdim, padded = 2, 3, 64, -(-seqlen_q // 128) * 128
    torch.manual_seed(0)
    out, dout = (torch.randn(batch, seqlen_q, nheads, headdim) for _ in range(2))  # (B, S, H, D)
    lse = torch.randn(batch, nheads, seqlen_q)
    lse_padded = torch.full((batch, nheads, padded), float("nan"))
    delta = torch.full_like(lse_padded, float("nan"))
    block = 32
    attn_bwd_preprocess_kernel[(batch * nheads, -(-padded // block))](
        out, dout, delta, lse, lse_padded, None, *out.stride()[:3], *dout.stride()[:3], *lse_padded.stride()[:2],
        *lse.stride()[:2], nheads, seqlen_q, padded, HEADDIM=headdim, BLOCK_D=headdim, BLOCK_M=block,
        IS_VARLEN=False, PAD=True, ALIGN=128)
    expected_delta = (out * dout).sum(-1).transpose(1, 2)  # (B, H, S)
    torch.testing.assert_close(delta[..., :seqlen_q], expected_delta, rtol=1e-5, atol=1e-5)
    assert torch.equal(lse_padded[..., :seqlen_q], lse)
    assert torch.equal(delta[..., seqlen_q:], torch.zeros_like(delta[..., seqlen_q:]))
    assert torch.isposinf(lse_padded[..., seqlen_q:]).all()


def test_backward_preprocess_pads_varlen_lse_per_sequence():
    # Varlen: sequence b's LSE and delta start at (cu_seqlens[b] + 128 b) rounded down to a multiple of 128 and run on
    # to its length rounded up to 128 (LSE +inf, delta 0 past the end), apart from every other sequence's rows, so
    # that the Gluon backward's TMA loads of whole tiles start aligned and read P = 0 past the end
    from flashpatch.kernels.triton.backward import attn_bwd_preprocess_kernel
    from flashpatch.padding import cu_seqlens_from_lengths

    lengths, nheads, headdim, align = [1, 0, 130, 17, 128, 300], 2, 64, 128
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    total, batch = sum(lengths), len(lengths)
    torch.manual_seed(0)
    out, dout = (torch.randn(total, nheads, headdim) for _ in range(2))  # (T, H, D)
    lse = torch.randn(nheads, total)
    lse_padded = torch.full((nheads, total + align * batch), float("nan"))
    delta = torch.full_like(lse_padded, float("nan"))
    padded = -(-max(lengths) // align) * align
    block = 32
    attn_bwd_preprocess_kernel[(batch * nheads, -(-padded // block))](
        out, dout, delta, lse, lse_padded, cu, 0, *out.stride()[:2], 0, *dout.stride()[:2], 0, lse_padded.stride(0),
        0, lse.stride(0), nheads, max(lengths), padded, HEADDIM=headdim, BLOCK_D=headdim, BLOCK_M=block,
        IS_VARLEN=True, PAD=True, ALIGN=align)
    expected_delta = (out * dout).sum(-1).t()  # (H, T)
    written = torch.zeros(lse_padded.shape[1], dtype=torch.bool)
    for b, n in enumerate(lengths):
        first = int(cu[b])
        start = (first + b * align) // align * align
        rows = -(-n // align) * align
        assert start % align == 0 and not written[start:start + rows].any(), (b, start)
        written[start:start + rows] = True
        assert torch.equal(lse_padded[:, start:start + n], lse[:, first:first + n])
        torch.testing.assert_close(delta[:, start:start + n], expected_delta[:, first:first + n], rtol=1e-5,
                                   atol=1e-5)
        assert torch.isposinf(lse_padded[:, start + n:start + rows]).all()
        assert torch.equal(delta[:, start + n:start + rows], torch.zeros(nheads, rows - n))
    assert written.any() and lse_padded[:, ~written].isnan().all()  # nothing else written


@pytest.mark.parametrize("headdim,dropout", [(64, False), (128, False), (128, True)])
def test_gluon_dkdv_register_split_is_one_setmaxnreg_can_take(headdim, dropout):
    # The dK/dV kernel launches 12 warps of MAXNREG registers and warp_specialize hands the worker consumer and the
    # third warpgroup (producer, reducer, drawer warps) their counts; the default partition's consumer gets the rest
    # of the three warpgroups' share. setmaxnreg takes multiples of 8 in [24, 256]: a count outside that fails only
    # at a GPU launch.
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv

    worker = sm90_dkdv.consumer_registers(headdim, dropout)
    default = sm90_dkdv.default_consumer_registers(worker, dropout)
    third = sm90_dkdv.worker_registers(dropout)
    for count in (worker, default, third):
        assert 24 <= count <= 256 and count % 8 == 0, (headdim, worker, default, third)
    # 12 warps (three warpgroups), or 16 with the dropout drawers, whose warps fill two warpgroups of `third`
    groups = 4 if dropout else 3
    assert worker + default + (groups - 2) * third == groups * sm90_dkdv.launch_maxnreg(dropout)
    assert groups * 128 * sm90_dkdv.launch_maxnreg(dropout) <= 65536  # the register file


def test_persistent_grid_rule():
    # the d128 Gluon forward runs as a persistent grid; the d64 one on causal rows of at most 32 query blocks (4096
    # queries), else per block; dQ persistent only on rows of at most 8 query blocks, where the per-block grid has no
    # head groups to lose (config.persistent_grid's figures)
    assert all(kernel_config.persistent_grid("fwd", n, 128) for n in (1, 8, 9, 128))
    assert [kernel_config.persistent_grid("fwd", n, 64, causal=True) for n in (1, 8, 32, 33, 64)] == [
        True, True, True, False, False]
    assert not any(kernel_config.persistent_grid("fwd", n, 64) for n in (1, 8, 9, 128))
    assert [kernel_config.persistent_grid("dq", n, 128) for n in (1, 8, 9, 64)] == [True, True, False, False]
    assert not kernel_config.persistent_grid("dq", 8, 128, beside_dkdv=True)  # dQ's programs fill dK/dV's tail
    with pytest.raises(ValueError, match="'dkdv'"):
        kernel_config.persistent_grid("dkdv", 8, 128)


def test_varlen_forward_grid_rule():
    # a varlen forward's items go by tickets at head dims 64 and 128 (two consumers, 128-row blocks in its table),
    # per block at 256 and wherever options.persistent_fwd is False
    try:
        from flashpatch.kernels.sm90 import fwd as sm90_fwd
    except ImportError:
        pytest.skip("this Triton has no Gluon")
    defaults, per_block = kernel_options.DEFAULT, kernel_options.updated(kernel_options.DEFAULT, persistent_fwd=False)
    assert [sm90_fwd.varlen_persistent(d, defaults) for d in (64, 128, 256)] == [True, True, False]
    assert [sm90_fwd.varlen_block_rows(d, defaults) for d in (64, 128, 256)] == [128, 128, 128]
    assert [sm90_fwd.varlen_block_rows(d, per_block) for d in (64, 128, 256)] == [192, 128, 128]
    forced = kernel_options.updated(kernel_options.DEFAULT, persistent_fwd=True)
    assert not sm90_fwd.varlen_persistent(256, forced)  # two Q buffers of 256 columns do not fit


@pytest.mark.parametrize("num_bh,seqlen_q,seqlen_k,head_group,programs", [
    (64, 4096, 4096, 4, 132),  # bench_attention's causal n4096 rows, config.head_group's groups
    (10, 4096, 4096, 4, 132),  # a last group of 2 heads
    (3, 2048, 2048, 8, 132),  # one group, fewer heads than its size
    (128, 1024, 1024, 0, 132),  # the 1B recipe's rows: all heads in one group
    (4, 384, 128, 0, 132),  # Sq > Sk: the first two blocks see no key; fewer tiles than programs
    (2, 640, 1152, 1, 7),  # Sq < Sk
    (5, 1023, 1023, 2, 3),  # a last block short of 128 rows
    (1, 1, 17, 0, 1),
])
def test_causal_schedule_runs_each_tile_once_and_balances(num_bh, seqlen_q, seqlen_k, head_group, programs):
    # schedule.causal_schedule's table: every tile of the grid exactly once, each program's tiles in the order's
    # sequence (heavy blocks of a head group before light ones, groups in turn), padded with the tile count, which
    # the kernel skips; and no program loaded past the mean by more than one block (the greedy rule's bound)
    rounds, table = schedule.causal_schedule(num_bh, seqlen_q, seqlen_k, 128, 128, head_group, programs)
    num_m = -(-seqlen_q // 128)
    num_tiles = num_bh * num_m
    assert len(table) == rounds * programs
    assert sorted(t for t in table if t != num_tiles) == list(range(num_tiles))
    cost = {}
    for tile in range(num_tiles):
        bh, block = schedule.order_block(tile, num_bh, num_m, head_group)
        cost[tile] = schedule.causal_steps(block, seqlen_q, seqlen_k, 128, 128) + schedule.BLOCK_OVERHEAD_STEPS
    assert sorted(schedule.order_block(t, num_bh, num_m, head_group) for t in range(num_tiles)) == \
        [(bh, block) for bh in range(num_bh) for block in range(num_m)]
    loads = []
    for p in range(programs):
        mine = [t for t in table[p * rounds:(p + 1) * rounds] if t != num_tiles]
        assert mine == sorted(mine) and table[p * rounds + len(mine):(p + 1) * rounds] == \
            (num_tiles,) * (rounds - len(mine))
        loads.append(sum(cost[t] for t in mine))
    assert max(loads) <= sum(loads) / programs + max(cost.values()) + 1e-9


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(128, 128), (384, 128), (640, 1152), (1023, 1023), (1, 17), (300, 5)])
def test_causal_steps_count_the_key_blocks_a_query_block_sees(seqlen_q, seqlen_k):
    # bottom-right aligned: query i sees keys j <= i + Sk - Sq; a block visits every key block up to its last
    # visible key, none when no row sees a key
    for block in range(-(-seqlen_q // 128)):
        rows = range(block * 128, min(block * 128 + 128, seqlen_q))
        last = max(min(i + seqlen_k - seqlen_q, seqlen_k - 1) for i in rows)
        assert schedule.causal_steps(block, seqlen_q, seqlen_k, 128, 128) == (last // 128 + 1 if last >= 0 else 0)


def test_causal_schedule_tensor_is_built_once_per_shape(monkeypatch):
    monkeypatch.setattr(schedule, "_TABLES", {})
    monkeypatch.setattr(schedule, "_MAX_TABLES", 2)
    cpu = torch.device("cpu")
    table, rounds = schedule.causal_schedule_tensor(3, 1024, 1024, 128, 128, 0, 5, cpu)
    assert (rounds, tuple(table.tolist())) == schedule.causal_schedule(3, 1024, 1024, 128, 128, 0, 5)
    assert table.dtype == torch.int32
    assert schedule.causal_schedule_tensor(3, 1024, 1024, 128, 128, 0, 5, cpu)[0] is table  # kept
    schedule.causal_schedule_tensor(3, 1024, 1024, 128, 128, 0, 6, cpu)
    schedule.causal_schedule_tensor(3, 1024, 1024, 128, 128, 0, 7, cpu)  # the third shape drops the first
    assert len(schedule._TABLES) == 2
    assert schedule.causal_schedule_tensor(3, 1024, 1024, 128, 128, 0, 5, cpu)[0] is not table


def test_causal_schedule_rejects_empty_grids():
    with pytest.raises(ValueError, match="programs=0"):
        schedule.causal_schedule(4, 1024, 1024, 128, 128, 0, 0)
    with pytest.raises(ValueError, match="head_group=-1"):
        schedule.causal_schedule(4, 1024, 1024, 128, 128, -1, 132)


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("seqlens,kwargs", [
    ((113, 17), {"causal": True}),  # Sq > Sk: bottom-right alignment leaves the first 96 rows with no key
    ((17, 113), {"window_size": (9, 3)}),
    ((33, 33), {}),
    ((1, 17), {"causal": True}),
    ((33, 51), {"softcap": 3.0}),  # the folded form does not apply: softcap needs the scaled scores
], ids=str)
def test_folded_scale_softmax_matches_reference(fold, seqlens, kwargs):
    # KernelConfigs.fold_scale: the max over the raw scores and exp2(qk * scale - max) must give the same output,
    # LSE (natural log, +inf for rows with no key) and gradients as the scaled-scores form
    q, k, v = random_qkv(2, *seqlens, 4, 2, 40, torch.float16)
    with kernel_options.override(fold_scale=fold):
        out, lse, _ = flashpatch.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    lse64 = check_against_reference(out, grads, q, k, v, dout, **kwargs)
    empty = torch.isinf(lse64)
    assert torch.equal(torch.isinf(lse), empty) and (out.transpose(1, 2)[empty] == 0).all()
    torch.testing.assert_close(lse[~empty].double(), lse64[~empty].double(), rtol=1e-3, atol=1e-3)


def test_options_override_nests_and_restores():
    # options.override: KernelOptions fields set as given, KernelConfigs fields gathered into config_fields; a nested
    # block adds to the outer one, and each block's end brings back the options before it
    assert kernel_options.current() is kernel_options.DEFAULT
    with kernel_options.override(persistent_fwd=False, atomic_dq=True) as outer:
        assert kernel_options.current() is outer
        assert outer.persistent_fwd is False and dict(outer.config_fields) == {"atomic_dq": True}
        with kernel_options.override(persistent_fwd=True, fold_scale=False) as inner:
            assert inner.persistent_fwd is True
            assert dict(inner.config_fields) == {"atomic_dq": True, "fold_scale": False}
        assert kernel_options.current() is outer
    assert kernel_options.current() is kernel_options.DEFAULT


def test_options_refuse_unknown_names_and_bad_values():
    with pytest.raises(TypeError, match="'persistent'"), kernel_options.override(persistent=True):
        pass
    with pytest.raises(ValueError, match="got 100"), kernel_options.override(dkdv_consumer_registers=100):
        pass
    # a switch takes a bool (or None where it has a rule): "false" or 0 would switch by its truth value
    for bad, message in ((dict(dkdv_store_tma="false"), "dkdv_store_tma must be bool, got 'false'"),
                         (dict(persistent_fwd=0), "persistent_fwd must be bool or None, got 0"),
                         (dict(fused_dq=1), "fused_dq must be bool, got 1")):
        with pytest.raises(TypeError, match=message), kernel_options.override(**bad):
            pass
    with kernel_options.override(dkdv_store_tma=False, persistent_fwd=None, fused_dq=True) as opts:
        assert (opts.dkdv_store_tma, opts.persistent_fwd, opts.config_fields["fused_dq"]) == (False, None, True)
    assert kernel_options.current() is kernel_options.DEFAULT


def test_options_config_fields_reach_the_launch_settings():
    q, k, v = random_qkv(1, 17, 17, 2, 1, 32, torch.float32, requires_grad=False)
    measured = ops._launch_configs(q, k, False, 17, 17, -1, -1, 0.0, 0.0, kernel_options.DEFAULT)
    forced = kernel_options.updated(kernel_options.DEFAULT, atomic_dq=not measured.atomic_dq,
                                    fwd=LaunchConfig(16, 16))
    cfgs = ops._launch_configs(q, k, False, 17, 17, -1, -1, 0.0, 0.0, forced)
    assert cfgs.atomic_dq != measured.atomic_dq and cfgs.fwd == LaunchConfig(16, 16)
    assert cfgs.bwd_dq == measured.bwd_dq


@pytest.mark.parametrize("n", [0, 1, 2, 3, 16, 17, 127, 128, 129, 1000])
def test_host_integer_helpers_match_tritons(n):
    import triton

    from flashpatch.kernels.launch import cdiv, next_power_of_2

    assert next_power_of_2(n) == triton.next_power_of_2(n)
    for b in (1, 16, 128):
        assert cdiv(n, b) == triton.cdiv(n, b)


def test_launch_cache_key_tells_apart_what_triton_specializes_on():
    # equal keys must mean the same compiled kernel: dtype and 16-byte alignment of tensors, integer values (1 and
    # multiples of 16 are specialized), True against 1, the constexpr keywords; floats are not specialized
    from flashpatch.kernels.launch import _signature_key

    a = torch.empty(64, dtype=torch.float16)
    key = lambda *args, **kw: _signature_key("kernel", 0, args, kw)  # noqa: E731
    assert key(a, 16, 0.5, BLOCK=64) == key(torch.empty(64, dtype=torch.float16), 16, 0.25, BLOCK=64)
    assert key(a, 16, 0.5, BLOCK=64) != key(a.to(torch.bfloat16), 16, 0.5, BLOCK=64)
    assert key(a, 16, 0.5, BLOCK=64) != key(a, 17, 0.5, BLOCK=64)
    assert key(a, 16, 0.5, BLOCK=64) != key(a, 16, 0.5, BLOCK=128)
    assert key(a, 1, 0.5) != key(a, True, 0.5)
    assert key(a, (1, 2)) == key(a, (1, 2)) != key(a, (1, 3))  # tuples: element by element
    assert key(a, (1, 1)) != key(a, (1, True)) and key(a, (1, 2)) != key(a, 1, 2)
    assert key(a, None) != key(a, a)
    misaligned = torch.empty(65, dtype=torch.float16)[1:]
    if misaligned.data_ptr() % 16:
        assert key(a) != key(misaligned)
    assert key(a, object()) is None  # an argument the key does not know: Triton's own path
    import enum

    assert key(a, enum.IntEnum("E", "X").X) is None  # an int subclass: the same
    assert key(a, BLOCK=[64]) is None  # an unhashable keyword value: the same
    assert _signature_key("kernel", 0, (a,), {}) != _signature_key("kernel", 1, (a,), {})  # compiled per device


def test_replay_puts_each_calls_tensors_and_floats_in_place(monkeypatch):
    # launch.replay re-issues a recorded launch through the compiled launcher's C function: the arguments it was
    # recorded with, each tensor, descriptor base pointer and float taken from the new call, a descriptor re-encoded
    from types import SimpleNamespace

    from flashpatch.kernels import launch as launch_mod

    if launch_mod._GluonDescriptor is None or launch_mod._TMA_DTYPES is None:
        pytest.skip("this Triton has no Gluon descriptor or TMA dtype table")
    calls = []
    monkeypatch.setattr(launch_mod, "_REPLAYABLE", True)
    monkeypatch.setattr(launch_mod, "_raw_launcher", lambda launcher: lambda *args: calls.append(args))
    monkeypatch.setattr(launch_mod, "_tma_encoder", lambda: lambda *args: ("tensor map", *args))
    launcher = SimpleNamespace(launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0,
                               global_scratch_align=1, profile_scratch_size=0, num_ctas=1)
    meta = dict(swizzle=128, elem_size=2, elem_type=1, block_size=[64, 64], fp4_padded=False)
    compiled = SimpleNamespace(run=launcher, function=7, packed_metadata="packed",
                               metadata=SimpleNamespace(tensordesc_meta=[meta]))
    class Kernel:  # what replay reads of a JITFunction
        pre_run_hooks = []

    kernel = Kernel()

    def descriptor(t):
        desc = object.__new__(launch_mod._GluonDescriptor)
        desc.__dict__.update(base=t, shape=[4, 64], strides=[64, 1], block_shape=[64, 64], layout=None,
                             padding="zero")
        return desc

    q, out, table = torch.empty(4, 64, dtype=torch.float16), torch.empty(4, 64), torch.zeros(3, dtype=torch.int32)
    record = launch_mod.Record("site", (q, out, None), (0.5,), captured=(table,))
    args, tail = (descriptor(q), out, None, table, 16, 0.5, (1, 2)), (True,)
    entry = launch_mod._record(compiled, 0, (3,), args, tail, record)
    assert entry is not None
    assert not any(isinstance(a, torch.Tensor) and a is not table for a in entry.template)  # no call kept alive
    monkeypatch.setitem(launch_mod._replays, (kernel, "site"), entry)
    q2, out2 = torch.empty(4, 64, dtype=torch.float16), torch.empty(4, 64)
    assert launch_mod.replay(kernel, "site", (q2, out2, None), (0.25,), stream=99)
    got = calls[-1]
    assert got[:13] == (3, 1, 1, 99, 7, False, False, None, None, "packed", None, None, None)
    assert got[13] == ("tensor map", q2.data_ptr(), 128, 2, launch_mod._TMA_DTYPES[1], [64, 64], [4, 64], [64, 1], 0)
    assert got[14:18] == (4, 64, 64, 1)
    assert got[18] is out2 and got[19] is None and got[20] is table and got[21:] == (16, 0.25, (1, 2), True)
    assert not launch_mod.replay(kernel, "another site", (q2, out2, None), (0.25,), stream=99)
    # what a replay could not put in makes no record: a tensor that is no source, a float not named in order
    stranger = torch.empty(4, 64)
    assert launch_mod._record(compiled, 0, (3,), (descriptor(q), stranger, None, table, 16, 0.5, (1, 2)), tail,
                              record) is None
    assert launch_mod._record(compiled, 0, (3,), args, tail, record._replace(floats=(0.5,) * 2)) is None
    assert launch_mod._record(compiled, 0, (3,), (*args[:5], 0.75, args[6]), tail, record) is None
    assert launch_mod._record(compiled, 0, (3,), args, tail, record._replace(captured=())) is None
    # a kernel that takes global scratch (on-device descriptors) gets it from Triton's allocator at each replay, sized
    # for the grid, on the current stream; on another stream it keeps the launch path
    launcher.global_scratch_size, launcher.global_scratch_align = 64, 128
    entry = launch_mod._record(compiled, 0, (3, 2), args, tail, record)
    assert entry.scratch == (3 * 2 * 64, 128)
    monkeypatch.setitem(launch_mod._replays, (kernel, "site"), entry)
    allocations = []
    monkeypatch.setattr(launch_mod._allocation, "_allocator", SimpleNamespace(
        get=lambda: lambda size, align, stream: allocations.append((size, align, stream)) or "scratch"))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 5, raising=False)  # CPU builds lack it
    assert launch_mod.replay(kernel, "site", (q2, out2, None), (0.25,))
    assert allocations == [(384, 128, 5)] and calls[-1][3] == 5 and calls[-1][7] == "scratch"
    assert not launch_mod.replay(kernel, "site", (q2, out2, None), (0.25,), stream=99)


def _replay_wiring_calls():
    """(name, module, make) of each Gluon host function and form whose launches replay: make() draws fresh tensors
    and returns run(scale), which calls the host function on them with `scale` as its qk_scale, at site "site"."""
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv, dkdv256 as sm90_dkdv256, dq as sm90_dq, fwd as sm90_fwd

    B, S, H, Hk = 2, 192, 4, 2
    opts = kernel_options.updated(kernel_options.DEFAULT, persistent_dq=False)

    def dense(d):  # q, k, v, dout (B, S, H, D), lse and delta padded to 256 rows, as ops.attn_bwd_impl makes them
        q, dout = (torch.randn(B, S, H, d, dtype=torch.bfloat16) for _ in "qo")
        k, v = (torch.randn(B, S, Hk, d, dtype=torch.bfloat16) for _ in "kv")
        return q, k, v, dout, torch.zeros(B, H, 256), torch.zeros(B, H, 256)

    def varlen(d):  # two sequences of 100 and 200 tokens
        cu = torch.tensor([0, 100, 300], dtype=torch.int32)
        q, dout = (torch.randn(300, H, d, dtype=torch.bfloat16) for _ in "qo")
        k, v = (torch.randn(300, Hk, d, dtype=torch.bfloat16) for _ in "kv")
        table = (cu, cu.clone(), torch.zeros(2, 7, dtype=torch.int32))
        return q, k, v, dout, torch.zeros(H, 640), torch.zeros(H, 640), table

    def fwd_dense(persistent, dropout_p=0.0):
        q, k, v, _, lse, _ = dense(128)
        out, seed = torch.empty_like(q), torch.zeros(2, dtype=torch.int64) if dropout_p else None
        options = kernel_options.updated(opts, persistent_fwd=persistent)
        return lambda scale: sm90_fwd.attn_fwd(q, k, v, out, lse[..., :S], scale, True, seed_offset=seed,
                                               dropout_p=dropout_p, site="site", options=options)

    def fwd_varlen(persistent):
        q, k, v, _, lse, _, (cu_q, cu_k, blocks) = varlen(128)
        out, slopes = torch.empty_like(q), torch.rand(H)
        options = kernel_options.updated(opts, persistent_fwd=persistent)
        return lambda scale: sm90_fwd.attn_fwd_varlen(q, k, v, out, lse[:, :300], cu_q, cu_k, blocks, 200, scale,
                                                      True, alibi_slopes=slopes, options=options, site="site",
                                                      cap_log2=2.0)

    def dq_dropout():
        q, k, v, dout, lse, delta = dense(128)
        dq, seed = torch.empty_like(q), torch.zeros(2, dtype=torch.int64)
        return lambda scale: sm90_dq.attn_bwd_dq(q, k, v, dout, lse, delta, dq, scale, 0.1, True, options=opts,
                                                 seed_offset=seed, dropout_p=0.1, site="site")

    def dq_varlen():
        q, k, v, dout, lse, delta, table = varlen(128)
        dq = torch.empty_like(q)
        return lambda scale: sm90_dq.attn_bwd_dq(q, k, v, dout, lse, delta, dq, scale, 0.1, True, options=opts,
                                                 varlen=table, site="site")

    def dkdv_fused_dq():
        q, k, v, dout, lse, delta = dense(128)
        dk, dv, dq_accum = torch.empty_like(k), torch.empty_like(v), torch.zeros(q.shape)
        return lambda scale: sm90_dkdv.attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, scale, 0.1, False,
                                                     dq_accum=dq_accum, options=opts, site="site", stream=7)

    def dkdv_varlen():
        q, k, v, dout, lse, delta, table = varlen(64)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        return lambda scale: sm90_dkdv.attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, scale, 0.1, True,
                                                     options=opts, varlen=table, site="site", stream=7)

    def dkdv256():
        q, k, v, dout, lse, delta = dense(256)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        return lambda scale: sm90_dkdv256.attn_bwd_dkdv256(q, k, v, dout, lse, delta, dk, dv, scale, 0.1, True,
                                                           options=opts, site="site", window_left=64, cap_log2=3.0)

    return [
        ("fwd", sm90_fwd, lambda: fwd_dense(False)),
        ("fwd persistent", sm90_fwd, lambda: fwd_dense(True)),
        ("fwd dropout", sm90_fwd, lambda: fwd_dense(False, 0.1)),
        ("fwd varlen", sm90_fwd, lambda: fwd_varlen(False)),
        ("fwd varlen persistent", sm90_fwd, lambda: fwd_varlen(True)),
        ("dq dropout", sm90_dq, dq_dropout),
        ("dq varlen", sm90_dq, dq_varlen),
        ("dkdv fused dq", sm90_dkdv, dkdv_fused_dq),
        ("dkdv varlen", sm90_dkdv, dkdv_varlen),
        ("dkdv256 window softcap", sm90_dkdv256, dkdv256),
    ]


@pytest.mark.parametrize("index", range(10), ids=lambda i: [
    "fwd", "fwd_persistent", "fwd_dropout", "fwd_varlen", "fwd_varlen_persistent", "dq_dropout", "dq_varlen",
    "dkdv_fused_dq", "dkdv_varlen", "dkdv256"][i])
def test_gluon_replays_launch_what_the_host_function_builds(index, monkeypatch):
    # each sm90 host function names its launch's tensors and floats twice: to replay() at its top and in the Record
    # its launch makes. A replay recorded from one call, given another call's tensors and floats, must pass the
    # launcher what that call's own launch path would: each tensor (by address), each descriptor re-encoded from its
    # base, each float
    from types import SimpleNamespace

    from flashpatch.kernels import launch as launch_mod

    if launch_mod._GluonDescriptor is None:
        pytest.skip("this Triton has no Gluon descriptor")
    name, module, make = _replay_wiring_calls()[index]
    kernel_name = {"fwd": "attn_fwd_hopper_kernel", "dq": "attn_bwd_dq_hopper_kernel",
                   "dkdv": "attn_bwd_dkdv_hopper_kernel", "dkdv256": "attn_bwd_dkdv256_kernel"}[name.split()[0]]

    class Kernel:  # what replay reads of the JIT function (whose hash the interpreter cannot compute)
        pre_run_hooks = []

    monkeypatch.setattr(module, kernel_name, Kernel())
    monkeypatch.setattr(module, "sm_count", lambda device: 8, raising=False)
    monkeypatch.setattr(launch_mod, "_REPLAYABLE", True)
    monkeypatch.setattr(launch_mod, "_tma_encoder", lambda: lambda ptr, *meta: ("tensor map", ptr, *meta))
    launched, raw_calls = [], []
    monkeypatch.setattr(module, "launch", lambda kernel, grid, *args, record=None, on_stream=None, **kw:
                        launched.append((kernel, grid, args, record, on_stream)))
    monkeypatch.setattr(launch_mod, "_raw_launcher", lambda launcher: lambda *args: raw_calls.append(args))

    def meta(desc):  # stand-in descriptor metadata: the same for the record and the expected expansion
        return dict(swizzle=len(desc.block_shape), elem_size=desc.base.element_size(), elem_type=1,
                    block_size=list(desc.block_shape), fp4_padded=False)

    def expanded(args):  # the launcher's kernel arguments for a launch path's args (Triton 3.6's expansion)
        out = []
        for a in args:
            if type(a) is launch_mod._GluonDescriptor:
                m = meta(a)
                out += [("tensor map", a.base.data_ptr(), m["swizzle"], m["elem_size"], launch_mod._TMA_DTYPES[1],
                         m["block_size"], list(a.shape), list(a.strides), 0), *a.shape, *a.strides]
            else:
                out.append(a.data_ptr() if isinstance(a, torch.Tensor) else a)
        return out

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    make()(0.5)  # one call's launch path, whose launch is recorded below
    kernel, grid, args, record, _ = launched[-1]
    # the varlen forward's site also tells its two grids apart
    site = ("site", "persistent" not in name) if name.startswith("fwd varlen") else "site"
    assert record is not None and record.site == site, f"{name}: its launch makes no Record at the site"
    descriptors = [a for a in args if type(a) is launch_mod._GluonDescriptor]
    launcher = SimpleNamespace(launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0,
                               profile_scratch_size=0, num_ctas=1)
    compiled = SimpleNamespace(run=launcher, function=1, packed_metadata=None,
                               metadata=SimpleNamespace(tensordesc_meta=[meta(d) for d in descriptors]))
    entry = launch_mod._record(compiled, 0, grid, args, (), record)
    assert entry is not None, f"{name}: a launch argument is neither a named source, a float in order nor fixed"
    monkeypatch.setitem(launch_mod._replays, (kernel, site), entry)
    run = make()  # another call of the site: a replay
    launches = len(launched)
    run(0.25)
    assert len(launched) == launches and len(raw_calls) == 1, f"{name}: the second call did not replay"
    replayed = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in raw_calls[0][13:]]
    del launch_mod._replays[(kernel, site)]
    run(0.25)  # the same call through its launch path
    assert replayed == expanded(launched[-1][2]), f"{name}: the replay launches other arguments"
    assert 0.25 in replayed


def test_ticket_counters_one_per_stream_and_none_in_a_capture(monkeypatch):
    # sm90_fwd.tile_counter: the persistent varlen forward's counter, zeroed, one per (device, stream) and kept; none
    # while the stream captures a CUDA graph (the forward then runs per block)
    try:
        from flashpatch.kernels.sm90 import fwd as sm90_fwd
    except ImportError:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(sm90_fwd, "_COUNTERS", {})
    stream = [5]
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: stream[0], raising=False)
    cpu = torch.device("cpu")
    first = sm90_fwd.tile_counter(cpu)
    assert first.dtype == torch.int32 and first.tolist() == [0, 0]
    assert sm90_fwd.tile_counter(cpu) is first
    stream[0] = 6
    second = sm90_fwd.tile_counter(cpu)
    assert second is not first and second.tolist() == [0, 0]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert sm90_fwd.tile_counter(torch.device("cuda", 0)) is None
    assert len(sm90_fwd._COUNTERS) == 2


def test_call_plans_made_once_per_call_signature(configs_for_calls):
    # ops._planned: a repeated call reuses its forward's and backward's decisions (config.py is not asked again); a
    # call that differs in anything those decisions or the launches' specialization read gets plans of its own
    def call(q, k, v, **kwargs):
        flashpatch.flash_attn_func(q, k, v, **kwargs).sum().backward()

    q, k, v = random_qkv(1, 17, 17, 2, 1, 32, torch.float32)
    call(q, k, v, causal=True)
    assert len(configs_for_calls) == 2 and len(ops._plans) == 2
    call(q, k, v, causal=True)
    assert len(configs_for_calls) == 2 and len(ops._plans) == 2
    q2, k2, v2 = random_qkv(1, 17, 17, 2, 1, 32, torch.float32)
    call(q2, k2, v2, causal=True)  # other tensors of the same signature
    assert len(ops._plans) == 2
    for kwargs in (dict(causal=False), dict(window_size=(4, 0)), dict(dropout_p=0.1), dict(softcap=5.0)):
        before = len(ops._plans)
        call(q, k, v, **kwargs)
        assert len(ops._plans) == before + 2, kwargs
    with kernel_options.override(atomic_dq=True):
        before = len(ops._plans)
        call(q, k, v, causal=True)
        assert len(ops._plans) == before + 2  # the options are part of both keys
    assert len(configs_for_calls) == 2 + 2 * 4 + 2


def test_plan_key_tells_apart_what_launches_specialize_on():
    opts = kernel_options.DEFAULT
    q = torch.randn(2, 16, 4, 32)
    key = lambda t, o=opts, *scalars: ops._plan_key("fwd", o, (t, None), *scalars)  # noqa: E731
    assert key(q) == key(torch.randn(2, 16, 4, 32))
    assert key(q) != key(q.to(torch.float16))
    assert key(q) != key(torch.randn(2, 17, 4, 32))
    assert key(q) != key(torch.randn(2, 4, 16, 32).transpose(1, 2))  # same shape, other strides
    misaligned = torch.randn(2 * 16 * 4 * 32 + 1)[1:].view(2, 16, 4, 32)
    if misaligned.data_ptr() % 16:
        assert key(q) != key(misaligned)
    assert key(q, opts, 17) != key(q, opts, 18)
    assert key(q) != key(q, kernel_options.updated(opts, fold_scale=False))
    assert key(q, kernel_options.updated(opts, fold_scale=False)) == key(q, kernel_options.updated(opts,
                                                                                                    fold_scale=False))
    assert ops._plan_key("fwd", opts, (q, None)) != ops._plan_key("fwd", opts, (q, q))


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("causal,dropout_p", [(False, 0.0), (True, 0.1)], ids=["not_causal", "dropout"])
def test_gluon_kernels_refuse_windows_they_cannot_run(kernel, causal, dropout_p):
    # the Gluon kernels run a sliding window causal and without dropout (`supported` keeps other windowed calls on
    # the Triton kernels); a direct call is refused naming window_left, before a descriptor is built
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv, dq as sm90_dq, fwd as sm90_fwd

    q = torch.randn(1, 17, 4, 128, dtype=torch.float16)  # (B, S, H, D)
    k, v = (torch.randn(1, 113, 2, 128, dtype=torch.float16) for _ in "kv")
    lse = torch.zeros(1, 4, 128)
    seed_offset = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="window_left=31"):
        if kernel == "fwd":
            sm90_fwd.attn_fwd(q, k, v, q.clone(), lse, 1.0, causal, seed_offset=seed_offset, dropout_p=dropout_p,
                              window_left=31)
        elif kernel == "dkdv":
            sm90_dkdv.attn_bwd_dkdv(q, k, v, q, lse, lse.clone(), k.clone(), v.clone(), 1.0, 1.0, causal,
                                      seed_offset=seed_offset, dropout_p=dropout_p, window_left=31)
        else:
            sm90_dq.attn_bwd_dq(q, k, v, q, lse, lse.clone(), q.clone(), 1.0, 1.0, causal, seed_offset=seed_offset,
                                  dropout_p=dropout_p, window_left=31)


def test_gluon_dkdv_refuses_softcap_with_dropout():
    # softcap and dropout together spill in the Gluon dK/dV (`supported` keeps such calls on the Triton kernel); a
    # direct call is refused naming both, before a descriptor is built
    from flashpatch.kernels.sm90 import dkdv as sm90_dkdv

    q = torch.randn(1, 17, 4, 128, dtype=torch.float16)  # (B, S, H, D)
    k, v = (torch.randn(1, 113, 2, 128, dtype=torch.float16) for _ in "kv")
    lse = torch.zeros(1, 4, 128)
    with pytest.raises(ValueError, match=r"cap_log2=72\.1.*dropout_p=0\.1"):
        sm90_dkdv.attn_bwd_dkdv(q, k, v, q, lse, lse.clone(), k.clone(), v.clone(), 1.0, 1.0, True,
                                  seed_offset=torch.zeros(2, dtype=torch.int64), dropout_p=0.1, cap_log2=72.1)
