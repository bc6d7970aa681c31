"""GPU checks at training sizes, bf16 and fp16 (the CPU interpreter cannot check bf16): `pytest -m gpu`.

Same bar as on CPU: error against float64 within 2x (outputs) / 3x (gradients) of PyTorch's own error in the
input dtype. tools/gpu_suite.sh runs these, then the benchmarks.
"""

import pytest
import torch

import flashpatch
from flashpatch.kernels import config as kernel_config
from flashpatch.kernels import options as kernel_options
from flashpatch.kernels import sm90
from flashpatch.kernels.sm90 import dkdv as sm90_dkdv, dkdv256 as sm90_dkdv256, dq as sm90_dq, fwd as sm90_fwd
from flashpatch.padding import cu_seqlens_from_lengths
from flashpatch.reference import varlen_attention_reference
from tests.helpers import check_against_reference, random_qkv

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, kwargs)
GRID = [
    (2, 512, 512, 8, 2, 64, {"causal": True}),
    (1, 2048, 2048, 4, 4, 128, {}),
    (1, 2048, 2048, 8, 2, 128, {"causal": True}),
    (1, 1000, 1531, 6, 2, 96, {"causal": True}),
    (1, 1531, 1000, 6, 3, 80, {}),
    (1, 8192, 8192, 2, 1, 128, {"causal": True}),
    (1, 4096, 4096, 4, 1, 64, {"window_size": (511, 0)}),
    (2, 1024, 1024, 4, 2, 128, {"softcap": 30.0, "causal": True}),
    (1, 1024, 1024, 2, 2, 256, {"causal": True}),
    (1, 1000, 1531, 4, 2, 256, {"softcap": 50.0, "window_size": (255, 0)}),  # Gemma-2-style attention, ragged
    (3, 777, 777, 4, 4, 64, {"dropout_p": 0.1, "causal": True}),
    (2, 1024, 1024, 8, 2, 128, {"dropout_p": 0.1}),  # unmasked d128 dropout: its own forward tile (shared memory)
    (1, 1000, 1531, 4, 4, 96, {"dropout_p": 0.2, "window_size": (255, 64)}),
    # ragged d128 rows: bounds masks on the edge blocks only, the 64 x 128 dK/dV tile, pointer dQ
    (2, 1000, 1000, 4, 4, 128, {"causal": True}),
    (2, 1000, 1000, 4, 4, 128, {"dropout_p": 0.1, "causal": True}),  # atomic dQ
    # the ragged-row tiles: GQA d128 dK/dV on 32 x 64 (w4), d64 dQ on 64 x 64
    (2, 1000, 1000, 8, 2, 128, {"causal": True}),
    (2, 1000, 1000, 8, 2, 64, {"causal": True}),
    # d64 rows past 1024 queries, GQA and not: the three-warpgroup Gluon forward over blocks of
    # 192 (the last one past the rows), dK/dV by the Triton kernel with GQA and by the Gluon one without
    (2, 2048, 2048, 6, 2, 64, {"causal": True}),
    (1, 2048, 2048, 4, 4, 64, {"causal": True}),
]


def _case_id(case):
    return (f"b{case[0]}-q{case[1]}-k{case[2]}-h{case[3]}:{case[4]}-d{case[5]}-"
            + "-".join(f"{k}={v}" for k, v in case[6].items()))


def _check_case(case, dtype, make_slopes=None):
    """One GRID-style case in `dtype` against float64; make_slopes(batch, nheads) adds ALiBi slopes."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, kwargs = case
    torch.manual_seed(0)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, device="cuda")
    if make_slopes is not None:
        kwargs = dict(kwargs, alibi_slopes=make_slopes(batch, nheads))
    out, _, pattern = flashpatch.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_kwargs = dict(kwargs)
    if pattern is not None:
        ref_kwargs["dropout_keep"] = pattern > 0
    check_against_reference(out, grads, q, k, v, dout, **ref_kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GRID, ids=_case_id)
def test_training_sizes_match_float64(case, dtype):
    _check_case(case, dtype)


# ALiBi on the kernels the dispatch picks (the aligned d128 rows run the Gluon ones on sm_90; ragged rows and dropout
# the Triton ones); test_gluon_kernels_alibi_match_float64 forces the Gluon kernels
ALIBI_CASES = [
    (2, 1024, 1024, 8, 2, 128, {"causal": True}),
    (1, 1000, 1531, 4, 4, 64, {}),
    (2, 1000, 1000, 4, 4, 128, {"dropout_p": 0.1, "causal": True}),  # atomic dQ
]


def _geometric_slopes(batch, nheads):
    """ALiBi's geometric slopes, 2^-1 .. 2^-8 over the heads, scaled per sequence so the rows differ: (B, H)."""
    slopes = 2.0 ** -torch.linspace(1, 8, nheads, device="cuda")
    return slopes[None, :] * torch.linspace(1.0, 0.5, batch, device="cuda")[:, None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ALIBI_CASES, ids=_case_id)
def test_alibi_matches_float64(case, dtype):
    _check_case(case, dtype, make_slopes=_geometric_slopes)


@pytest.mark.parametrize("atomic_dq", [False, True])
def test_dq_strategies_bf16(atomic_dq):
    q, k, v = random_qkv(2, 1024, 1024, 8, 2, 128, torch.bfloat16, device="cuda")
    with kernel_options.override(atomic_dq=atomic_dq):
        out = flashpatch.flash_attn_func(q, k, v, causal=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, causal=True)


@pytest.mark.parametrize("atomic_dq", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_tma_tiles_in_every_kernel_bf16(atomic_dq, causal):
    # TMA loads and stores in all three kernels, both grid orders' worth of odd tails (1000 rows), and with
    # atomic dQ the bulk reduce-add into the fp32 accumulator
    from dataclasses import replace

    base = kernel_config.configs_for(128, True, masked=causal)
    tma = {name: replace(getattr(base, name), tma=True) for name in ("fwd", "bwd_dkdv", "bwd_dq")}
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16, device="cuda")
    assert flashpatch.ops.tma_usable(128, q, k, v)
    with kernel_options.override(atomic_dq=atomic_dq, gluon_fwd=False, gluon_dkdv=False, gluon_dq=False, **tma):
        out = flashpatch.flash_attn_func(q, k, v, causal=causal)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, causal=causal)


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, memory order)
GLUON_CASES = [
    (2, 1024, 1024, 8, 2, 128, True, "bshd"),
    (1, 640, 1152, 4, 2, 128, True, "bshd"),  # Sq < Sk: causal aligned bottom-right
    (2, 384, 128, 4, 1, 128, True, "bshd"),  # Sq > Sk: the first 256 queries see no key
    (2, 512, 512, 4, 4, 128, False, "bhsd"),  # (B, H, S, D) in memory, as transformers' projections give
    (1, 1024, 2048, 2, 1, 64, False, "bshd"),  # head dim 64 (config.py: the forward only, without a mask)
    (1, 2048, 2048, 4, 2, 64, True, "bshd"),  # head dim 64 causal: the persistent forward (config.persistent_grid)
    # causal grids in head groups (config.head_group): 3 heads in a group of 8, and 10 in groups of 4
    (1, 2048, 2048, 3, 3, 128, True, "bshd"),
    (2, 4096, 4096, 5, 5, 128, True, "bshd"),
    # lengths that divide no tile: a last query block past seqlen_q (rows computed, never stored; the backward's
    # padded LSE gives them P = 0) and a last key block past seqlen_k (masked; dK/dV rows not stored), which the 2-D
    # TMA views fill from the next head's or batch's rows
    (2, 1000, 1000, 8, 2, 128, True, "bshd"),
    (1, 1023, 1023, 4, 4, 128, False, "bshd"),
    (2, 113, 17, 4, 1, 128, True, "bshd"),  # Sq > Sk: the first 96 queries see no key
    (2, 17, 113, 2, 2, 128, False, "bhsd"),
    (3, 1, 1, 2, 1, 128, True, "bshd"),
    (2, 1000, 1000, 6, 2, 64, True, "bshd"),
    (1, 777, 1234, 4, 2, 64, False, "bshd"),  # K and V in registers (head dim 64) with keys past seqlen_k
    (1, 8191, 8191, 2, 1, 128, True, "bshd"),
    # head dim 64 causal, the persistent forward's two consumers: rows that see no key, Sq < Sk, (B, H, S, D) memory
    (2, 113, 17, 4, 1, 64, True, "bshd"),
    (1, 640, 1152, 4, 2, 64, True, "bhsd"),
]


# ALiBi in the Gluon kernels: GQA (the dK/dV program steps over its group's query heads, each with its own slope),
# Sq != Sk both ways (the bias is bottom-right aligned like the mask), (B, H, S, D) memory, head dim 64, no mask,
# lengths that divide no tile
GLUON_ALIBI_CASES = GLUON_CASES[:6] + [GLUON_CASES[8], GLUON_CASES[14]]


def _gluon_id(case):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, order, *alibi = case
    return (f"b{batch}-q{seqlen_q}-k{seqlen_k}-h{nheads}:{nheads_k}-d{headdim}-{'causal' if causal else 'full'}-{order}"
            + ("-alibi" if alibi and alibi[0] else ""))


needs_gluon = pytest.mark.skipif(
    not (sm90.enabled() and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the Gluon kernels are for sm_90 with the Triton release they were checked on")


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GLUON_CASES, ids=_gluon_id)
def test_gluon_kernels_match_float64(case, dtype, monkeypatch):
    _check_gluon_case(case, dtype, monkeypatch)


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GLUON_ALIBI_CASES, ids=_gluon_id)
def test_gluon_kernels_alibi_match_float64(case, dtype, monkeypatch):
    # (batch, nheads) slopes where the batch has two sequences, (nheads,) slopes (batch stride 0) where it has one
    _check_gluon_case(case, dtype, monkeypatch,
                      make_slopes=lambda b, h: _geometric_slopes(b, h) if b > 1 else _geometric_slopes(1, h)[0])


@needs_gluon
@pytest.mark.parametrize("persistent,scheduled", [(True, True), (True, False), (False, True)],
                         ids=["persistent", "persistent_closed_form", "per_block"])
@pytest.mark.parametrize("case", [GLUON_CASES[i] for i in (0, 2, 4, 7, 8, 9, 13)], ids=_gluon_id)
def test_gluon_grid_forms_match_float64_bf16(case, persistent, scheduled, monkeypatch):
    # Both grid forms of the Gluon forward and dQ, whichever config.persistent_grid picks for the shape: one program
    # per SM taking query blocks in turn (two query buffers, a K/V ring that runs on across blocks), or one program
    # per query block. GQA causal, rows that see no key, d64 unmasked and causal, and 320 blocks (more than an H100's
    # 132 SMs: three rounds, the last one partial); a persistent causal forward takes its blocks from
    # schedule.causal_schedule's table (in head groups of 4 in the 320-block case, the last group of 2) or from the
    # closed form
    _check_gluon_case(case, torch.bfloat16, monkeypatch, persistent_fwd=persistent, causal_schedule=scheduled,
                      persistent_dq=persistent)


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [GLUON_CASES[i] for i in (0, 1, 2, 3, 7, 8, 9)]
                         + [GLUON_CASES[1][:-1] + ("bshd", True)], ids=_gluon_id)
def test_gluon_forward_pipelined_pv_is_bit_identical(case, dtype):
    # The persistent forward's consumers are pipelined by one matmul (sm90.fwd._fwd_block_pipelined: block i - 1's
    # P V issued with block i's S), the per-block program's are not (_fwd_block); at head dim 128 both run two
    # consumer warpgroups of 64 queries and the same arithmetic in the same order: outputs and LSE equal bit for bit.
    # GQA causal, Sq < Sk and Sq > Sk (rows that see no key), unmasked (B, H, S, D) memory, 320 blocks, ALiBi
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, order, *alibi = case
    assert headdim == 128  # at 64 the per-block program runs three consumers
    q, k, v = (t.detach() for t in _gluon_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, order, dtype))
    slopes = _geometric_slopes(batch, nheads) if alibi and alibi[0] else None
    results = {}
    for persistent in (False, True):
        with kernel_options.override(gluon_fwd=True, persistent_fwd=persistent):
            results[persistent] = flashpatch.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                                             return_attn_probs=True)[:2]
    (out0, lse0), (out1, lse1) = results[False], results[True]
    assert not torch.isnan(out1).any()
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)


@needs_gluon
def test_gluon_forward_in_a_cuda_graph_before_its_schedule_exists(monkeypatch):
    # A persistent causal forward first met inside a CUDA graph capture cannot copy its block table to the GPU
    # (schedule.causal_schedule_tensor): it runs the closed form there, whose outputs are the table's, bit for bit
    from flashpatch.kernels.sm90 import schedule

    q, k, v = (t.detach() for t in _gluon_qkv(2, 1280, 1280, 5, 5, 128, "bshd", torch.bfloat16))
    with kernel_options.override(gluon_fwd=True, persistent_fwd=True):
        with kernel_options.override(causal_schedule=False):
            flashpatch.flash_attn_func(q, k, v, causal=True)  # compiles the closed form outside the capture
        monkeypatch.setattr(schedule, "_TABLES", {})
        expected = flashpatch.flash_attn_func(q, k, v, causal=True)  # from the table
        monkeypatch.setattr(schedule, "_TABLES", {})
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = flashpatch.flash_attn_func(q, k, v, causal=True)
        assert not schedule._TABLES  # nothing copied inside the capture
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, expected)


GLUON_LAUNCHERS = ((sm90_fwd, "attn_fwd"), (sm90_dkdv, "attn_bwd_dkdv"), (sm90_dq, "attn_bwd_dq"))


def _record_launches(monkeypatch, launchers=GLUON_LAUNCHERS, keyword=None):
    """Wraps each (module, launcher name) so that every call first appends to the returned list its name, or with a
    keyword (name, the call's argument of that name)."""
    calls = []
    for module, name in launchers:
        def record(*args, _launch=getattr(module, name), _name=name, **kwargs):
            calls.append(_name if keyword is None else (_name, kwargs.get(keyword)))
            return _launch(*args, **kwargs)

        monkeypatch.setattr(module, name, record)
    return calls


def _gluon_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, order, dtype):
    """q, k, v (requiring grad) of a Gluon case, from seed 0; order "bhsd": (B, H, S, D) in memory, seen as
    (B, S, H, D) like every input."""
    torch.manual_seed(0)

    def tensor(seqlen, heads):
        if order == "bhsd":
            return torch.randn(batch, heads, seqlen, headdim, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(batch, seqlen, heads, headdim, device="cuda", dtype=dtype)

    return [tensor(n, h).requires_grad_() for n, h in ((seqlen_q, nheads), (seqlen_k, nheads_k), (seqlen_k, nheads_k))]


def _check_gluon_case(case, dtype, monkeypatch, make_slopes=None, **options):
    """A GLUON_CASES case, asserting that all three Gluon kernels ran; make_slopes(batch, nheads) adds ALiBi;
    options: kernel_options.override's."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, order = case
    calls = _record_launches(monkeypatch)

    q, k, v = _gluon_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, order, dtype)
    kwargs = {"causal": causal}
    if make_slopes is not None:
        kwargs["alibi_slopes"] = make_slopes(batch, nheads)
    # the separate dQ pass even where config fuses dQ into dK/dV (long rows; tested on its own below)
    with kernel_options.override(gluon_fwd=True, gluon_dkdv=True, gluon_dq=True, fused_dq=False, **options):
        out = flashpatch.flash_attn_func(q, k, v, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert sorted(calls) == ["attn_bwd_dkdv", "attn_bwd_dq", "attn_fwd"], calls
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


# Head dim 256's Gluon kernels (the forward at 64 keys a step; sm90/dkdv256.py: one consumer's Pᵀ and dV, the
# other's dSᵀ and dK; dq.py at 32 keys a step): GQA, causal with Sq != Sk both ways (rows that see no key), lengths
# that divide no tile (1, 17, 113, 1023; keys past seqlen_k come from the next head's rows, masked), (B, H, S, D)
# memory
GLUON_D256_CASES = [
    (1, 1024, 1024, 4, 2, 256, True, "bshd"),
    (2, 1023, 1023, 2, 2, 256, False, "bshd"),
    (1, 640, 1152, 4, 2, 256, True, "bhsd"),
    (2, 384, 128, 4, 1, 256, True, "bshd"),  # Sq > Sk: the first 256 queries see no key
    (2, 113, 17, 2, 1, 256, True, "bshd"),
    (2, 17, 113, 2, 2, 256, False, "bshd"),
    (3, 1, 1, 2, 1, 256, True, "bshd"),
]


def _check_gluon_d256(case, dtype, monkeypatch, **kwargs):
    """A GLUON_D256_CASES case with flash_attn_func's kwargs, asserting that the three Gluon kernels ran. With a
    softcap, q is scaled by 4 (as in GLUON_SOFTCAP_CASES) so that many scores reach the cap's bend."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, order = case
    calls = _record_launches(monkeypatch, ((sm90_fwd, "attn_fwd"), (sm90_dkdv256, "attn_bwd_dkdv256"),
                                           (sm90_dq, "attn_bwd_dq")))
    q, k, v = _gluon_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, order, dtype)
    if kwargs.get("softcap"):
        q = (q.detach() * 4).requires_grad_()
    kwargs = dict(kwargs, causal=causal)
    with kernel_options.override(gluon_fwd=True, gluon_dkdv=True, gluon_dq=True):
        out = flashpatch.flash_attn_func(q, k, v, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert sorted(calls) == ["attn_bwd_dkdv256", "attn_bwd_dq", "attn_fwd"], calls
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GLUON_D256_CASES, ids=_gluon_id)
def test_gluon_d256_dkdv_matches_float64(case, dtype, monkeypatch):
    _check_gluon_d256(case, dtype, monkeypatch)


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case, kwargs", [
    (GLUON_D256_CASES[0], {"softcap": 10.0}),
    ((1, 1000, 1531, 4, 2, 256, True, "bshd"), {"softcap": 10.0, "window_size": (255, 0)}),  # Gemma-2-style
    ((2, 1000, 1000, 4, 4, 256, True, "bshd"), {"window_size": (100, 0)}),
    (GLUON_D256_CASES[2], {"alibi_slopes": "per_head"}),
    (GLUON_D256_CASES[1], {"alibi_slopes": "per_batch"}),
], ids=lambda x: _gluon_id(x) if isinstance(x, tuple) else "-".join(f"{k}={v}" for k, v in x.items()))
def test_gluon_d256_dkdv_softcap_window_alibi_match_float64(case, kwargs, dtype, monkeypatch):
    if "alibi_slopes" in kwargs:
        slopes = _geometric_slopes(case[0], case[3])
        kwargs = dict(kwargs, alibi_slopes=slopes if kwargs["alibi_slopes"] == "per_batch" else slopes[0])
    _check_gluon_d256(case, dtype, monkeypatch, **kwargs)


@needs_gluon
@pytest.mark.parametrize("register_kv", [False, True], ids=["kv_shared", "kv_registers"])
@pytest.mark.parametrize("case", [
    (1, 512, 512, 2, 2, 64, True, "bshd"),
    (1, 512, 512, 4, 2, 64, True, "bshd"),  # GQA: the step position wraps to the next query head
    (2, 384, 128, 4, 1, 64, True, "bshd"),  # Sq > Sk: the first 256 queries see no key
    (1, 640, 1152, 4, 2, 64, True, "bshd"),  # Sq < Sk
    (1, 512, 1024, 4, 2, 64, False, "bhsd"),
    (2, 384, 128, 4, 1, 128, True, "bshd"),
], ids=_gluon_id)
def test_gluon_dkdv_kv_forms_match_triton_bitwise_bf16(case, register_kv, monkeypatch):
    # The Gluon dK/dV with K and V in registers or read from shared memory (sm90_dkdv.register_kv picks one per
    # head dim; two register forms once miscompiled under the causal mask, docs/tuning.md): both
    # accumulate the Triton kernel's products in its order, so dK and dV are bit-identical to it, and within the
    # float64 bar.
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, order = case
    q, k, v = _gluon_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, order, torch.bfloat16)
    dout = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", dtype=torch.bfloat16)
    calls = _record_launches(monkeypatch, [(sm90_dkdv, "attn_bwd_dkdv")])
    grads = {}
    for gluon in (False, True):
        with kernel_options.override(gluon_fwd=False, gluon_dkdv=gluon, gluon_dq=False, register_kv=register_kv,
                                     fused_dq=False):  # the dQ pass: its forms are tested against float64 apart
            out = flashpatch.flash_attn_func(q, k, v, causal=causal)
            grads[gluon] = torch.autograd.grad(out, (q, k, v), dout)
    assert len(calls) == 1
    for name, triton_grad, gluon_grad in zip("kv", grads[False][1:], grads[True][1:]):
        assert torch.equal(triton_grad, gluon_grad), (name, (triton_grad - gluon_grad).abs().max().item())
    check_against_reference(out, grads[True], q, k, v, dout, causal=causal)


def _spy_fused_dq(monkeypatch) -> list:
    """Whether each Gluon dK/dV launch was handed an fp32 dQ buffer to add into (the fused dQ)."""
    fused = []
    launch = sm90_dkdv.attn_bwd_dkdv
    monkeypatch.setattr(sm90_dkdv, "attn_bwd_dkdv", lambda *a, **kw: fused.append(kw.get("dq_accum") is not None)
                        or launch(*a, **kw))
    return fused


@needs_gluon
@pytest.mark.parametrize("case", [
    (2, 256, 256, 4, 4, 128, True, "bshd", False),
    (2, 256, 256, 4, 4, 128, False, "bhsd", False),
    (1, 512, 512, 8, 2, 128, True, "bshd", False),  # GQA: the steps wrap to the group's next query head
    (3, 128, 128, 3, 1, 128, False, "bshd", False),  # MQA, one key block, odd batch and head counts
    (2, 384, 128, 4, 1, 128, True, "bshd", False),  # Sq > Sk: the first 256 queries see no key
    (1, 640, 1152, 4, 2, 128, False, "bshd", False),  # Sq < Sk
    (1, 640, 1152, 4, 2, 128, True, "bshd", False),
    (1, 4096, 4096, 5, 5, 128, True, "bshd", False),  # heads in groups of 4 (config.head_group), fused by default
    (1, 512, 512, 8, 2, 128, True, "bshd", True),  # ALiBi: each step's query head's slope
    (2, 640, 1152, 4, 2, 128, False, "bhsd", True),
    # lengths that divide no tile: the reduce-adds of a last query block's rows past seqlen_q add zeros into the
    # next head's rows, and a last key block's keys past seqlen_k are masked out of dS
    (2, 1000, 1000, 4, 2, 128, True, "bshd", False),
    (1, 113, 1000, 4, 1, 128, False, "bhsd", False),
    (2, 1000, 777, 4, 2, 128, False, "bshd", True),
    # head dim 64: K read from shared memory for dS K (sm90_dkdv.register_kv)
    (2, 1024, 1024, 12, 4, 64, True, "bshd", False),
    (2, 1000, 1000, 4, 2, 64, True, "bhsd", False),
    (1, 384, 128, 4, 1, 64, True, "bshd", False),  # Sq > Sk: the first 256 queries see no key
    (1, 113, 1000, 4, 2, 64, False, "bshd", True),
], ids=_gluon_id)
def test_gluon_dkdv_fused_dq_matches_float64_bf16(case, monkeypatch):
    # The Gluon dK/dV adds dQ into the fp32 buffer itself (sm90_dkdv._fused_dq, _dq_reducer: dS split along D
    # between the consumers, each step's partial TMA-reduced by a warp of its own), forced on at short rows.
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, order, alibi = case
    q, k, v = _gluon_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, order, torch.bfloat16)
    kwargs = {"causal": causal}
    if alibi:
        kwargs["alibi_slopes"] = _geometric_slopes(batch, nheads)
    fused = _spy_fused_dq(monkeypatch)
    with kernel_options.override(fused_dq=True, gluon_dkdv=True):  # the form under test, whatever config picks
        out = flashpatch.flash_attn_func(q, k, v, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert fused == [True], fused
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_fused_dq_where_keys_are_long_unless_deterministic_bf16(causal, monkeypatch):
    # config's rule without an override: a query's mean keys seen >= LONG_KEYS fuses dQ (full n2048, causal n4096
    # with 1024 queries: 3584 keys on average), shorter rows and deterministic=True keep the separate pass
    torch.manual_seed(0)
    fused = _spy_fused_dq(monkeypatch)
    for seqlen_q, seqlen_k, deterministic, expected in ((1024, 4096 if causal else 2048, False, True),
                                                        (1024, 4096 if causal else 2048, True, False),
                                                        (1024, 1024, False, False)):
        fused.clear()
        q, k, v = random_qkv(1, seqlen_q, seqlen_k, 2, 1, 128, torch.bfloat16, device="cuda")
        out = flashpatch.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert fused == [expected], (seqlen_q, seqlen_k, deterministic, fused)
        check_against_reference(out, grads, q, k, v, dout, causal=causal)


@needs_gluon
@pytest.mark.parametrize("case", [
    (2, 1024, 1024, 8, 2, 128, True, 0.1, False),
    (1, 640, 1152, 4, 4, 128, True, 0.2, False),  # Sq < Sk, bottom-right causal
    (2, 512, 1024, 4, 1, 128, False, 0.1, False),
    (1, 1024, 2048, 2, 1, 64, False, 0.3, False),  # head dim 64
    (2, 1024, 1024, 8, 2, 128, True, 0.1, True),  # with ALiBi
    (2, 1000, 1000, 8, 2, 128, True, 0.1, False),  # lengths that divide no tile
    (1, 777, 1234, 4, 2, 128, False, 0.1, False),
], ids=lambda c: (f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}:{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-p{c[7]}"
                  + ("-alibi" if c[8] else "")))
def test_gluon_dq_dropout_matches_float64_bf16(case, monkeypatch):
    # The Gluon dQ draws common.dropout_keep's bits in the wgmma accumulator layout (sm90_dq.dropout_keep_acc):
    # the pattern that the separate dropout_mask kernel writes must be the one it applied (the forward is the Gluon
    # one, with its drawer warps, at both head dims).
    _check_gluon_dq_dropout(case, monkeypatch)


@needs_gluon
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per_block"])
def test_gluon_dq_grid_forms_dropout_match_float64_bf16(persistent, monkeypatch):
    # a persistent dQ finds each block's dropout counters from its tile, a per-block one from its program; the
    # dropout cases above take config.persistent_grid's form (persistent: at most 8 query blocks)
    _check_gluon_dq_dropout((2, 1024, 1024, 8, 2, 128, True, 0.1, False), monkeypatch, persistent_dq=persistent)


def _check_gluon_dq_dropout(case, monkeypatch, **options):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, p, alibi = case
    calls = _check_dropout_launches((batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), torch.bfloat16, causal, p,
                                    alibi, [(sm90_fwd, "attn_fwd"), (sm90_dq, "attn_bwd_dq")],
                                    dict(gluon_fwd=True, gluon_dq=True, atomic_dq=False, fused_dq=False, **options),
                                    monkeypatch)
    # the dQ pass, not the dQ fused into dK/dV that config takes for long rows
    assert calls == [("attn_fwd", p), ("attn_bwd_dq", p)]


def _check_dropout_launches(shape, dtype, causal, p, alibi, launches, overrides, monkeypatch):
    """One dropout call under kernel_options.override(**overrides) against float64 with the pattern the separate
    dropout_mask kernel writes; returns the (launcher, dropout_p) calls made of `launches` ((module, name) pairs)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = shape
    calls = _record_launches(monkeypatch, launches, "dropout_p")
    torch.manual_seed(0)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, device="cuda")
    kwargs = {"dropout_p": p, "causal": causal}
    if alibi:
        kwargs["alibi_slopes"] = _geometric_slopes(batch, nheads)
    with kernel_options.override(**overrides):
        out, _, pattern = flashpatch.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, dropout_keep=pattern > 0, **kwargs)
    return calls


# Dropout calls for the drawer warps' GPU tests (sm90_dkdv._keep_drawer, sm90_fwd._fwd_keep_drawer): (batch, Sq,
# Sk, heads, K/V heads, causal, p, ALiBi, dtype); each runs at head dim 128, and all but the threshold's ends at 64
DRAWER_DROPOUT_CASES = [
    (2, 1024, 1024, 8, 2, True, 0.1, False, torch.bfloat16),
    (1, 640, 1152, 4, 4, True, 0.2, False, torch.bfloat16),  # Sq < Sk, bottom-right causal
    (1, 1152, 640, 4, 4, True, 0.1, False, torch.bfloat16),  # Sq > Sk: the first queries see no key
    (2, 512, 1024, 4, 1, False, 0.1, False, torch.float16),
    (2, 1024, 1024, 8, 2, True, 0.1, True, torch.bfloat16),  # with ALiBi
    (1, 2048, 2048, 2, 2, True, 0.5, False, torch.bfloat16),
    # the 16-bit threshold's ends, where the drawers' carry addend 2^32 - t * 2^16 wraps to 0: t = 0 keeps every
    # weight (p under 2^-17), t = 2^16 drops every one
    (1, 1024, 1024, 2, 2, True, 2e-6, False, torch.bfloat16),
    (1, 1024, 1024, 2, 2, False, 0.999995, False, torch.bfloat16),
    # lengths that divide no tile
    (2, 1000, 1000, 4, 2, True, 0.1, False, torch.bfloat16),
    (1, 777, 1234, 4, 2, False, 0.1, False, torch.float16),
]


def _drawer_case_id(c):
    return (f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}:{c[4]}-{'causal' if c[5] else 'full'}-p{c[6]}"
            + ("-alibi" if c[7] else "") + f"-{str(c[8]).split('.')[-1]}")


# head dim 64 skips the threshold's ends, which its drawers share with head dim 128's
DRAWER_DROPOUT_PARAMS = ([(c, 128) for c in DRAWER_DROPOUT_CASES]
                         + [(c, 64) for c in DRAWER_DROPOUT_CASES[:6] + DRAWER_DROPOUT_CASES[8:]])


def _drawer_param_id(param):
    case, headdim = param
    return f"{_drawer_case_id(case)}-d{headdim}"


@needs_gluon
@pytest.mark.parametrize("param,fused", [(param, fused) for param in DRAWER_DROPOUT_PARAMS
                                         for fused in ((False, True) if sm90_dkdv.fuses_dq(param[1], dropout=True)
                                                       else (False,))],
                         ids=lambda x: ("fused_dq" if x else "dq_pass") if isinstance(x, bool) else _drawer_param_id(x))
def test_gluon_dkdv_dropout_matches_float64(param, fused, monkeypatch):
    # The Gluon dK/dV takes its keep bits from drawer warps as one packed word per consumer thread
    # (sm90_dkdv._keep_drawer, _keep_tile): the pattern that the separate dropout_mask kernel writes must be the one
    # it applied, with the Gluon dQ pass beside it or (sm90_dkdv.fuses_dq) dQ added by the kernel
    # itself, whose dS carries the bits
    case, headdim = param
    batch, seqlen_q, seqlen_k, nheads, nheads_k, causal, p, alibi, dtype = case
    calls = _check_dropout_launches((batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), dtype, causal, p, alibi,
                                    [(sm90_dkdv, "attn_bwd_dkdv"), (sm90_dq, "attn_bwd_dq")],
                                    dict(gluon_dkdv=True, gluon_dq=True, atomic_dq=False, fused_dq=fused), monkeypatch)
    assert sorted(calls) == [("attn_bwd_dkdv", p)] + ([] if fused else [("attn_bwd_dq", p)])


@needs_gluon
@pytest.mark.parametrize("param", DRAWER_DROPOUT_PARAMS, ids=_drawer_param_id)
def test_gluon_forward_dropout_matches_float64(param, monkeypatch):
    # The Gluon forward takes its keep bits from drawer warps as two packed words per consumer thread
    # (sm90_fwd._fwd_keep_drawer, _fwd_keep_tile): the pattern that the separate dropout_mask kernel writes must be
    # the one it applied (the backward is whatever config chooses, and draws the same bits)
    case, headdim = param
    batch, seqlen_q, seqlen_k, nheads, nheads_k, causal, p, alibi, dtype = case
    calls = _check_dropout_launches((batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), dtype, causal, p, alibi,
                                    [(sm90_fwd, "attn_fwd")], dict(gluon_fwd=True), monkeypatch)
    assert calls == [("attn_fwd", p)]


@needs_gluon
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per_block"])
@pytest.mark.parametrize("headdim,causal", [(128, True), (128, False), (64, True), (64, False)])
def test_gluon_forward_dropout_grid_forms_match_float64(persistent, headdim, causal, monkeypatch):
    # the persistent forward's drawers follow its programs' tiles and count their keep slots across them (256 query
    # blocks: each program takes two or more); one program per block counts from each block's first step
    calls = _check_dropout_launches((4, 1000, 1000, 8, 2, headdim), torch.bfloat16, causal, 0.1, False,
                                    [(sm90_fwd, "attn_fwd")], dict(gluon_fwd=True, persistent_fwd=persistent),
                                    monkeypatch)
    assert calls == [("attn_fwd", 0.1)]


def test_misaligned_layout_falls_back_to_pointer_tiles_bf16():
    # q, k, v viewed 2 bytes into a buffer: no 16-byte aligned base, so no descriptors; same results
    shape = (2, 1000, 4, 128)
    bufs = [torch.randn(2 * 1000 * 4 * 128 + 1, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q, k, v = (b[1:].view(shape).requires_grad_() for b in bufs)
    assert not flashpatch.ops.tma_usable(128, q, k, v)
    out = flashpatch.flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout)


# config.py: varlen batches with GQA take the 32 x 64 dK/dV tile at d128, and d64 the 64-query dQ tile
@pytest.mark.parametrize("nheads_k,headdim", [(2, 128), (8, 128), (2, 64)])
def test_varlen_realistic_mix_bf16(nheads_k, headdim):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.empty(24).uniform_(4.2, 8.3, generator=gen)).long().tolist()  # ~64 .. ~4000
    lengths[3] = 0
    total = sum(lengths)
    q = torch.randn(total, 8, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, nheads_k, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, nheads_k, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = cu_seqlens_from_lengths(torch.tensor(lengths, device="cuda"))
    out = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference, ref_args=(cu, cu),
                            causal=True)


@needs_gluon
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_short_d64_rows_take_the_gluon_dkdv_by_default(dropout_p, monkeypatch):
    # config.py without overrides: at head dim 64 short causal rows take the Gluon dK/dV, on a varlen batch (no
    # dropout: its fused dQ) and on dense rows with dropout (beside the Gluon dQ, after the Gluon forward)
    launches = _record_launches(monkeypatch, [(sm90_fwd, "attn_fwd"), (sm90_fwd, "attn_fwd_varlen"),
                                              (sm90_dkdv, "attn_bwd_dkdv"), (sm90_dq, "attn_bwd_dq")])
    if dropout_p == 0:
        lengths = [1, 17, 113, 512, 0, 300, 64]
        q, k, v, cu, _ = _varlen_qkv(lengths, lengths, 14, 2, 64, torch.bfloat16)
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert launches == ["attn_bwd_dkdv"], launches  # the Triton forward on short rows, dQ fused
        check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference, ref_args=(cu, cu),
                                causal=True)
    else:  # rows of 1000 divide no tile
        calls = _check_dropout_launches((2, 1000, 1000, 12, 4, 64), torch.bfloat16, True, dropout_p, False,
                                        [(sm90_fwd, "attn_fwd"), (sm90_dkdv, "attn_bwd_dkdv"),
                                         (sm90_dq, "attn_bwd_dq")], {}, monkeypatch)
        assert sorted(calls) == [("attn_bwd_dkdv", dropout_p), ("attn_bwd_dq", dropout_p), ("attn_fwd", dropout_p)]


def _varlen_qkv(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, q_scale=1.0):
    """(q, k, v, cu_seqlens_q, cu_seqlens_k) of a packed batch, from seed 0: q (sum lengths_q, H, D) times q_scale,
    k and v (sum lengths_k, Hk, D), all requiring grad."""
    torch.manual_seed(0)
    q = (q_scale * torch.randn(sum(lengths_q), nheads, headdim, device="cuda", dtype=dtype)).requires_grad_()
    k, v = (torch.randn(sum(lengths_k), nheads_k, headdim, device="cuda", dtype=dtype, requires_grad=True)
            for _ in "kv")
    cu_q = cu_seqlens_from_lengths(torch.tensor(lengths_q, device="cuda"))
    cu_k = cu_seqlens_from_lengths(torch.tensor(lengths_k, device="cuda"))
    return q, k, v, cu_q, cu_k


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(lengths_q=[1, 17, 113, 1000, 0, 300, 4095], causal=True, heads=(8, 2), headdim=128),
    dict(lengths_q=[1, 17, 113, 1000, 0, 300, 4095], causal=False, heads=(8, 8), headdim=128),
    # Sq != Sk per sequence, bottom-right causal: the 40 first queries of the last sequence see no key
    dict(lengths_q=[17, 300, 105, 2000], lengths_k=[113, 200, 64, 1999], causal=True, heads=(4, 1), headdim=128),
    dict(lengths_q=[700, 3, 1500, 129], causal=True, heads=(6, 2), headdim=64),  # three consumers, 192 rows
    dict(lengths_q=[1, 17, 113, 512, 0, 300, 64], causal=True, heads=(14, 2), headdim=64),  # short rows, GQA 7
    dict(lengths_q=[700, 3, 1500, 129], causal=False, heads=(6, 6), headdim=64, alibi=True),
    dict(lengths_q=[1000, 64, 2047], causal=True, heads=(8, 2), headdim=128, alibi=True),
], ids=lambda c: (f"{len(c['lengths_q'])}seqs-{'causal' if c['causal'] else 'full'}-h{c['heads'][0]}:"
                  f"{c['heads'][1]}-d{c['headdim']}" + ("-sq_ne_sk" if "lengths_k" in c else "")
                  + ("-alibi" if c.get("alibi") else "")))
@pytest.mark.parametrize("dq_form", ["dq_pass", "fused_dq"])
def test_gluon_varlen_matches_float64(case, dtype, dq_form, monkeypatch):
    # The Gluon kernels on a varlen batch: a program per (sequence, block) pair and head, the packed rows as the TMA
    # views' rows. A forward or dQ tile past a sequence's end reads the next sequence's rows, masked as a dense row's
    # last tile; dK/dV gives those rows an LSE of +inf (sm90_dkdv._row_lse) and stores no key past the end. The
    # fused form adds dQ from dK/dV's TMA reduce-adds, whose rows past a sequence's end add zeros into the next
    # one's.
    if dq_form == "fused_dq" and not sm90_dkdv.fuses_dq(case["headdim"]):
        pytest.skip("this Triton's Gluon issues no TMA reduce-adds (sm90.common.TMA_REDUCE)")
    launches = _record_launches(monkeypatch, [(sm90_fwd, "attn_fwd_varlen"), (sm90_dkdv, "attn_bwd_dkdv"),
                                              (sm90_dq, "attn_bwd_dq")], "varlen")
    lengths_q = case["lengths_q"]
    lengths_k = case.get("lengths_k", lengths_q)
    nheads, nheads_k = case["heads"]
    q, k, v, cu_q, cu_k = _varlen_qkv(lengths_q, lengths_k, nheads, nheads_k, case["headdim"], dtype)
    kwargs = {"causal": case["causal"]}
    if case.get("alibi"):
        kwargs["alibi_slopes"] = _geometric_slopes(len(lengths_q), nheads)
    fused = dq_form == "fused_dq"
    with kernel_options.override(gluon_fwd=True, gluon_dkdv=True, gluon_dq=True, fused_dq=fused):
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    # (launcher, whether it ran the varlen form: the backward's take a varlen table, attn_fwd_varlen is one)
    calls = [(name, varlen is not None or name == "attn_fwd_varlen") for name, varlen in launches]
    expected = [("attn_fwd_varlen", True), ("attn_bwd_dkdv", True)] + ([] if fused else [("attn_bwd_dq", True)])
    assert sorted(calls) == sorted(expected), calls
    check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference, ref_args=(cu_q, cu_k),
                            **kwargs)


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(lengths_q=[1, 17, 113, 1023, 0, 300], causal=True, heads=(4, 2)),
    dict(lengths_q=[1, 17, 113, 1023, 0, 300], causal=False, heads=(4, 4), alibi=True),
    # Sq != Sk per sequence, bottom-right causal: the 40 first queries of the last sequence see no key
    dict(lengths_q=[17, 300, 105, 2000], lengths_k=[113, 200, 64, 1999], causal=True, heads=(4, 1)),
    dict(lengths_q=[700, 3, 1500, 129], causal=True, heads=(8, 4), softcap=10.0, window_size=(255, 0)),
], ids=lambda c: (f"{len(c['lengths_q'])}seqs-{'causal' if c['causal'] else 'full'}-h{c['heads'][0]}:{c['heads'][1]}"
                  + ("-sq_ne_sk" if "lengths_k" in c else "") + ("-alibi" if c.get("alibi") else "")
                  + ("-softcap-window" if c.get("softcap") else "")))
def test_gluon_d256_varlen_matches_float64(case, dtype, monkeypatch):
    # Head dim 256's Gluon kernels on a varlen batch (the forward, sm90/dkdv256.py's dK/dV, the dQ pass), each a
    # program per (sequence, block) pair and head, with the packed rows as the TMA views' rows
    launches = _record_launches(monkeypatch, [(sm90_fwd, "attn_fwd_varlen"), (sm90_dkdv256, "attn_bwd_dkdv256"),
                                              (sm90_dq, "attn_bwd_dq")], "varlen")
    lengths_q = case["lengths_q"]
    lengths_k = case.get("lengths_k", lengths_q)
    nheads, nheads_k = case["heads"]
    # with a softcap, q scaled by 4 so that many scores reach the cap's bend
    q, k, v, cu_q, cu_k = _varlen_qkv(lengths_q, lengths_k, nheads, nheads_k, 256, dtype,
                                      q_scale=4.0 if "softcap" in case else 1.0)
    kwargs = {name: case[name] for name in ("causal", "softcap", "window_size") if name in case}
    if case.get("alibi"):
        kwargs["alibi_slopes"] = _geometric_slopes(len(lengths_q), nheads)
    with kernel_options.override(gluon_fwd=True, gluon_dkdv=True, gluon_dq=True):
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    calls = [(name, varlen is not None or name == "attn_fwd_varlen") for name, varlen in launches]
    assert sorted(calls) == [("attn_bwd_dkdv256", True), ("attn_bwd_dq", True), ("attn_fwd_varlen", True)], calls
    check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference, ref_args=(cu_q, cu_k),
                            **kwargs)


# Causal sliding windows on the Gluon kernels: (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, window_left)
GLUON_WINDOW_CASES = [
    (2, 1000, 1000, 8, 2, 128, 256),  # two key blocks wide; lengths that divide no tile
    (1, 2048, 2048, 4, 2, 128, 100),  # narrower than a key block: the left edge inside the diagonal's blocks
    (1, 640, 1152, 4, 2, 128, 300),  # Sq < Sk, bottom-right aligned
    (2, 384, 128, 4, 1, 128, 50),  # Sq > Sk: the first 256 queries see no key
    (1, 1023, 1023, 4, 4, 64, 0),  # each query sees its own key alone
    (2, 1000, 1000, 6, 2, 64, 333),  # head dim 64: three forward consumers, K and V in registers in dK/dV
    (1, 4096, 4096, 2, 1, 128, 1024),
    (1, 17, 113, 2, 1, 128, 4000),  # wider than the rows: the causal mask alone
]


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GLUON_WINDOW_CASES,
                         ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}:{c[4]}-d{c[5]}-w{c[6]}")
@pytest.mark.parametrize("dq_form", ["dq_pass", "fused_dq"])
def test_gluon_window_matches_float64(case, dtype, dq_form, monkeypatch):
    # common.window_steps: a query block's K/V stream starts at the first key block its first row sees, the blocks
    # on the window's left edge masked; dK/dV's query range ends where its last key leaves the windows. The fused
    # dQ's reduce-adds cover the same query range (at head dim 128 windows take it by default: config's `windowed`)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, window_left = case
    fused = dq_form == "fused_dq"
    if fused and not sm90_dkdv.fuses_dq(headdim):
        pytest.skip("this Triton's Gluon issues no TMA reduce-adds (sm90.common.TMA_REDUCE)")
    calls = _record_launches(monkeypatch, keyword="window_left")
    q, k, v = _gluon_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, "bshd", dtype)
    kwargs = dict(causal=True, window_size=(window_left, 0))
    with kernel_options.override(gluon_fwd=True, gluon_dkdv=True, gluon_dq=True, fused_dq=fused):
        out = flashpatch.flash_attn_func(q, k, v, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = ("attn_bwd_dkdv", "attn_fwd") if fused else ("attn_bwd_dkdv", "attn_bwd_dq", "attn_fwd")
    assert sorted(calls) == [(name, window_left) for name in expected], calls
    check_against_reference(out, grads, q, k, v, dout, **kwargs)


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(window=256, batch=2, lengths=(1000, 1000), heads=(8, 2)),  # dense rows: the closed form over head groups
    dict(window=100, batch=1, lengths=(2048, 2048), heads=(4, 2)),
    dict(window=300, batch=1, lengths=(640, 1152), heads=(4, 2), alibi=True),  # Sq < Sk
    dict(window=50, batch=2, lengths=(384, 128), heads=(4, 1)),  # Sq > Sk: rows that see no key
    dict(window=2000, batch=3, lengths=(4096, 4096), heads=(16, 4), softcap=10.0),  # 3 x 16 x 32 blocks: 12 rounds
], ids=lambda c: (f"b{c['batch']}-q{c['lengths'][0]}-k{c['lengths'][1]}-h{c['heads'][0]}:{c['heads'][1]}"
                  f"-w{c['window']}" + ("-alibi" if c.get("alibi") else "") + ("-softcap" if c.get("softcap") else "")))
def test_gluon_persistent_forward_windows_bit_identical(case, dtype, monkeypatch):
    # The persistent forward takes windowed blocks too (common.query_tile): its pipelined consumers run the per-block
    # program's arithmetic in its order, the masked steps on the window's left edge and diagonal included, so outputs
    # and LSE equal the per-block grid's bit for bit; the float64 window tests run the persistent form, the default at
    # head dim 128
    nheads, nheads_k = case["heads"]
    batch = case["batch"]
    kwargs = dict(causal=True, softcap=case.get("softcap", 0.0), window_size=(case["window"], 0))
    q, k, v = _gluon_qkv(batch, *case["lengths"], nheads, nheads_k, 128, "bshd", dtype)
    if case.get("alibi"):
        kwargs["alibi_slopes"] = _geometric_slopes(batch, nheads)
    forms = []  # the PERSISTENT constexpr of each forward launch

    def record(*args, _launch=sm90_fwd.launch, **launch_kwargs):
        forms.append(launch_kwargs["PERSISTENT"])
        return _launch(*args, **launch_kwargs)

    monkeypatch.setattr(sm90_fwd, "launch", record)
    results = {}
    for persistent in (False, True):
        with torch.no_grad(), kernel_options.override(gluon_fwd=True, persistent_fwd=persistent):
            results[persistent] = flashpatch.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)[:2]
    assert forms == [False, True], forms
    (out0, lse0), (out1, lse1) = results[False], results[True]
    assert not torch.isnan(out1).any() and out1.abs().sum() > 0
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)


@needs_gluon
@pytest.mark.parametrize("case", [
    dict(lengths=(1024, 1024), heads=(8, 2), headdim=128, order="bshd"),  # every key block stored by TMA
    dict(lengths=(1000, 1000), heads=(4, 4), headdim=128, order="bshd"),  # a last key block past seqlen_k
    dict(lengths=(640, 1152), heads=(4, 2), headdim=64, order="bhsd"),  # Sq < Sk, (B, H, S, D) memory
    dict(lengths=(384, 128), heads=(4, 1), headdim=128, order="bhsd", causal=True),  # rows that see no key
    dict(lengths_q=[1, 17, 113, 1000, 300], lengths_k=[64, 17, 200, 1000, 513], heads=(8, 2), headdim=128),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()).replace(" ", ""))
def test_gluon_dkdv_tma_store_bit_identical(case, monkeypatch):
    # The dK/dV stores key blocks that lie inside the sequence through V's shared memory and TMA stores, the rest
    # from registers (sm90_dkdv._consumer): the same values, so dK and dV equal the register stores' bit for bit
    forms = []

    def record(*args, _launch=sm90_dkdv.launch, **launch_kwargs):
        forms.append(launch_kwargs["STORE_TMA"])
        return _launch(*args, **launch_kwargs)

    monkeypatch.setattr(sm90_dkdv, "launch", record)
    nheads, nheads_k = case["heads"]
    causal = case.get("causal", True)
    grads = {}
    for store_tma in (False, True):
        if "lengths_q" in case:
            q, k, v, cu_q, cu_k = _varlen_qkv(case["lengths_q"], case["lengths_k"], nheads, nheads_k,
                                               case["headdim"], torch.bfloat16)
            with kernel_options.override(gluon_dkdv=True, dkdv_store_tma=store_tma):
                out = flashpatch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(case["lengths_q"]),
                                                        max(case["lengths_k"]), causal=causal)
        else:
            q, k, v = _gluon_qkv(2, *case["lengths"], nheads, nheads_k, case["headdim"], case["order"],
                                 torch.bfloat16)
            with kernel_options.override(gluon_dkdv=True, dkdv_store_tma=store_tma):
                out = flashpatch.flash_attn_func(q, k, v, causal=causal)
        with kernel_options.override(gluon_dkdv=True, dkdv_store_tma=store_tma):
            out.backward(torch.ones_like(out) + out.detach())
        grads[store_tma] = (k.grad, v.grad)
    assert forms == [False, True], forms
    (dk0, dv0), (dk1, dv1) = grads[False], grads[True]
    assert not torch.isnan(dk1).any() and dv1.abs().sum() > 0
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(lengths_q=[1, 17, 113, 1000, 0, 300, 4095], heads=(8, 2), headdim=128, window=200),
    dict(lengths_q=[17, 300, 105, 2000], lengths_k=[113, 200, 64, 1999], heads=(4, 1), headdim=128, window=64),
    dict(lengths_q=[700, 3, 1500, 129], heads=(6, 2), headdim=64, window=129, alibi=True),
], ids=lambda c: f"{len(c['lengths_q'])}seqs-d{c['headdim']}-w{c['window']}" + ("-alibi" if c.get("alibi") else ""))
@pytest.mark.parametrize("dq_form", ["dq_pass", "fused_dq"])
def test_gluon_varlen_window_matches_float64(case, dtype, dq_form, monkeypatch):
    if dq_form == "fused_dq" and not sm90_dkdv.fuses_dq(case["headdim"]):
        pytest.skip("this Triton's Gluon issues no TMA reduce-adds (sm90.common.TMA_REDUCE)")
    lengths_q = case["lengths_q"]
    lengths_k = case.get("lengths_k", lengths_q)
    nheads, nheads_k = case["heads"]
    q, k, v, cu_q, cu_k = _varlen_qkv(lengths_q, lengths_k, nheads, nheads_k, case["headdim"], dtype)
    kwargs = dict(causal=True, window_size=(case["window"], 0))
    if case.get("alibi"):
        kwargs["alibi_slopes"] = _geometric_slopes(len(lengths_q), nheads)
    calls = _record_launches(monkeypatch, ((sm90_fwd, "attn_fwd_varlen"), (sm90_dkdv, "attn_bwd_dkdv")))
    with kernel_options.override(gluon_fwd=True, gluon_dkdv=True, gluon_dq=True, fused_dq=dq_form == "fused_dq"):
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert sorted(calls) == ["attn_bwd_dkdv", "attn_fwd_varlen"], calls
    check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference, ref_args=(cu_q, cu_k),
                            **kwargs)


def _mixed_lengths(count, longest, seed):
    """`count` sequence lengths of 1..longest drawn from `seed`, a few of them 0."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator)
    lengths[::17] = 0
    return lengths.tolist()


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(lengths_q=[1, 17, 113, 1000, 0, 300, 4095], heads=(8, 2)),
    dict(lengths_q=[1, 17, 113, 1023, 0, 300], heads=(4, 4), causal=False),
    # Sq != Sk per sequence, bottom-right causal: the 40 first queries of the last sequence see no key
    dict(lengths_q=[17, 300, 105, 2000], lengths_k=[113, 200, 64, 1999], heads=(4, 1)),
    dict(lengths_q=[700, 3, 1500, 129], heads=(6, 2), window=129, alibi=True, softcap=10.0),
    dict(lengths_q=[3, 5], heads=(2, 1)),  # fewer items than programs: most programs draw no work
    dict(lengths_q=_mixed_lengths(97, 700, 0), heads=(16, 4)),  # ~1500 items over the SMs
    # head dim 64: per block three consumers (192 rows a program), persistent two (128 rows an item)
    dict(lengths_q=[700, 3, 1500, 129], heads=(6, 2), headdim=64),
    dict(lengths_q=[17, 300, 105, 2000], lengths_k=[113, 200, 64, 1999], heads=(4, 1), headdim=64, alibi=True),
], ids=lambda c: (f"{len(c['lengths_q'])}seqs-{'full' if c.get('causal') is False else 'causal'}-h{c['heads'][0]}:"
                  f"{c['heads'][1]}-d{c.get('headdim', 128)}" + ("-sq_ne_sk" if "lengths_k" in c else "")
                  + ("-window-alibi-softcap" if c.get("window") else "")))
def test_gluon_persistent_varlen_forward_bit_identical(case, dtype, monkeypatch):
    # The persistent varlen forward (items taken by tickets, sm90_fwd.varlen_persistent) runs the per-block
    # program's arithmetic for each row in its order (the pipelined loop), so outputs and LSE equal the per-block
    # grid's bit for bit; the float64 varlen tests run the default form of each head dim. After each launch the
    # stream's ticket counter is back at zero (the next launch's tickets start there), and a second stream takes a
    # counter of its own.
    lengths_q = case["lengths_q"]
    lengths_k = case.get("lengths_k", lengths_q)
    nheads, nheads_k = case["heads"]
    q, k, v, cu_q, cu_k = (t.detach() for t in _varlen_qkv(lengths_q, lengths_k, nheads, nheads_k,
                                                            case.get("headdim", 128), dtype,
                                                            q_scale=4.0 if case.get("softcap") else 1.0))
    kwargs = dict(causal=case.get("causal", True), return_attn_probs=True)
    if case.get("window"):
        kwargs["window_size"] = (case["window"], 0)
    if case.get("alibi"):
        kwargs["alibi_slopes"] = _geometric_slopes(len(lengths_q), nheads)
    if case.get("softcap"):
        kwargs["softcap"] = case["softcap"]
    forms = []  # the PERSISTENT constexpr of each forward launch

    def record(*args, _launch=sm90_fwd.launch, **launch_kwargs):
        forms.append(launch_kwargs["PERSISTENT"])
        return _launch(*args, **launch_kwargs)

    monkeypatch.setattr(sm90_fwd, "launch", record)

    def run(persistent, cached_launch=False):
        with kernel_options.override(gluon_fwd=True, persistent_fwd=persistent, cached_launch=cached_launch):
            return flashpatch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                     **kwargs)[:2]

    out0, lse0 = run(False)
    results = [run(True), run(True)]
    assert forms == [False, True, True], forms
    results += [run(True, cached_launch=True) for _ in range(3)]  # from the second, replays (launch.replay)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        results.append(run(True, cached_launch=True))  # the replay with the side stream's counter
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert all(forms[1:]), forms
    counters = [c for (device, _), c in sm90_fwd._COUNTERS.items() if device == q.device]
    assert len(counters) >= 2 and all(c.tolist() == [0, 0] for c in counters)
    assert not torch.isnan(out0).any() and out0.abs().sum() > 0
    for out1, lse1 in results:
        assert torch.equal(out0, out1) and torch.equal(lse0, lse1)


@needs_gluon
@pytest.mark.parametrize("headdim", [128, 64])
def test_gluon_varlen_forward_in_a_cuda_graph_runs_per_block(headdim, monkeypatch):
    # Inside a CUDA graph capture the varlen forward takes no ticket counter (sm90_fwd.tile_counter), even on a stream
    # that has one: a graph's replays may run beside other launches sharing it. It runs the per-block grid there,
    # whose outputs are the persistent one's bit for bit; at head dim 64 that grid keeps the table's 128-row blocks,
    # two consumers a program rather than its usual three
    lengths = [1, 17, 113, 1000, 0, 300]
    q, k, v, cu, _ = (t.detach() for t in _varlen_qkv(lengths, lengths, 8, 2, headdim, torch.bfloat16))
    forms = []  # the PERSISTENT constexpr of each launch that goes through launch.launch (replays do not)

    def record(*args, _launch=sm90_fwd.launch, **launch_kwargs):
        forms.append(launch_kwargs["PERSISTENT"])
        return _launch(*args, **launch_kwargs)

    monkeypatch.setattr(sm90_fwd, "launch", record)

    def call():
        return flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    with kernel_options.override(gluon_fwd=True, persistent_fwd=False):
        call()  # compiles the per-block form outside the capture
    with kernel_options.override(gluon_fwd=True, persistent_fwd=True):
        expected = call()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            assert torch.equal(call(), expected)  # the stream's counter, made outside the capture
        assert True in forms
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = call()
        assert forms[-1] is False  # the captured launch: per block
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, expected)


# Softcap on the Gluon kernels: (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, extra
# flash_attn_func arguments). q is scaled by 4 so that many scores reach the cap's bend.
GLUON_SOFTCAP_CASES = [
    (2, 1000, 1000, 8, 2, 128, True, {}),  # the persistent forward; lengths that divide no tile
    (1, 640, 1152, 4, 2, 128, False, {}),  # Sq < Sk, unmasked
    (2, 384, 128, 4, 1, 128, True, {}),  # Sq > Sk: the first 256 queries see no key
    (2, 1023, 1023, 6, 2, 64, True, {}),  # head dim 64: the persistent forward, K and V in registers in dK/dV
    (1, 17, 113, 2, 1, 64, False, {}),
    (1, 2048, 2048, 4, 2, 128, True, dict(window_size=(300, 0))),  # a sliding window: one program per block
    (2, 513, 513, 4, 4, 128, True, dict(alibi=True)),  # ALiBi after the cap, as the reference adds it
    (2, 1000, 1000, 4, 2, 128, True, dict(dropout_p=0.1)),  # the forward's drawers; the Triton dK/dV
]


def _check_softcap_case(case, dtype, monkeypatch, **options):
    """A GLUON_SOFTCAP_CASES case with softcap 10 against float64, the Gluon kernels on unless options (for
    kernel_options.override) turn them off; returns the names of the sm90 launchers that ran."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, extra = case
    calls = _record_launches(monkeypatch, keyword="cap_log2")
    q, k, v = _gluon_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, "bshd", dtype)
    q = (q.detach() * 4).requires_grad_()
    kwargs = dict(causal=causal, softcap=10.0, **{key: val for key, val in extra.items() if key != "alibi"})
    if extra.get("alibi"):
        kwargs["alibi_slopes"] = _geometric_slopes(batch, nheads)
    # the Gluon kernels where config would take the Triton ones (head dim 64's short rows)
    with kernel_options.override(**{"gluon_fwd": True, "gluon_dkdv": True, "gluon_dq": True, **options}):
        out, _, pattern = flashpatch.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = {"dropout_keep": pattern > 0} if pattern is not None else {}
    check_against_reference(out, grads, q, k, v, dout, **keep, **kwargs)
    assert all(cap == pytest.approx(10.0 * 1.4426950408889634) for _, cap in calls), calls
    return sorted(name for name, _ in calls)


def _softcap_id(c):
    return (f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}:{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}"
            + "".join(f"-{k}" for k in c[7]))


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GLUON_SOFTCAP_CASES, ids=_softcap_id)
def test_gluon_softcap_matches_float64(case, dtype, monkeypatch):
    # common.softcap_tanh in the forward's softmax and in both backward kernels' P, whose dS takes 1 - tanh^2
    launched = _check_softcap_case(case, dtype, monkeypatch)
    assert "attn_fwd" in launched and ("attn_bwd_dkdv" in launched) == ("dropout_p" not in case[7]), launched


@needs_gluon
@pytest.mark.parametrize("case", [GLUON_SOFTCAP_CASES[0], GLUON_SOFTCAP_CASES[3]], ids=_softcap_id)
@pytest.mark.parametrize("form", ["fused_dq", "triton_backward"])
def test_gluon_softcap_forms_match_float64_bf16(case, form, monkeypatch):
    # the dQ that the dK/dV adds itself, and the Gluon forward before the Triton backward (which recomputes P with
    # its own tanh)
    if form == "fused_dq" and not sm90_dkdv.fuses_dq(case[5]):
        pytest.skip("this Triton's Gluon issues no TMA reduce-adds (sm90.common.TMA_REDUCE)")
    options = {"fused_dq": dict(fused_dq=True), "triton_backward": dict(gluon_dkdv=False, gluon_dq=False)}[form]
    launched = _check_softcap_case(case, torch.bfloat16, monkeypatch, **options)
    assert "attn_fwd" in launched and ("attn_bwd_dkdv" in launched) == (form != "triton_backward"), launched


@needs_gluon
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gluon_varlen_softcap_matches_float64(dtype, monkeypatch):
    lengths_q, lengths_k = [1, 17, 113, 1000, 0, 300], [5, 17, 200, 1000, 3, 299]
    q, k, v, cu_q, cu_k = _varlen_qkv(lengths_q, lengths_k, 8, 2, 128, dtype, q_scale=4.0)
    calls = _record_launches(monkeypatch, ((sm90_fwd, "attn_fwd_varlen"), (sm90_dkdv, "attn_bwd_dkdv")), "cap_log2")
    kwargs = dict(causal=True, softcap=10.0)
    out = flashpatch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert sorted(name for name, cap in calls if cap > 0) == ["attn_bwd_dkdv", "attn_fwd_varlen"], calls
    check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference, ref_args=(cu_q, cu_k),
                            **kwargs)


def test_dropout_keep_fraction_large_tensor():
    seed_offset = flashpatch.ops.draw_seed_offset(torch.device("cuda"))
    pattern = flashpatch.ops.dropout_pattern(seed_offset, 4, 16, 2048, 2048, 0.1)  # 268M draws
    kept = (pattern > 0).double().mean().item()
    print(f"\nkeep fraction over {pattern.numel():,} draws at p=0.1: {kept:.6f}")
    assert abs(kept - 0.9) < 0.001


def test_deterministic_bitwise_repeat_bf16():
    q, k, v = random_qkv(2, 1536, 1536, 8, 2, 128, torch.bfloat16, device="cuda")
    dout = torch.randn(2, 1536, 8, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        out = flashpatch.flash_attn_func(q, k, v, causal=True, deterministic=True, dropout_p=0.1)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs in one process")
def test_tensors_on_another_gpu_than_the_current_one_bf16():
    # launch.on_input_device: a model spread over GPUs (device_map) calls attention with the current device elsewhere
    torch.cuda.set_device(0)
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16, device="cuda:1")
    out = flashpatch.flash_attn_func(q, k, v, causal=True, dropout_p=0.0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    check_against_reference(out, grads, q, k, v, dout, causal=True)


def test_tensors_over_2_pow_31_elements():
    """int64 addressing: 2^31 + 2^24 elements per tensor, unpadded, checked on the last sequence."""
    nheads, headdim, seqlen = 64, 128, 2048
    nseq = (2**31 + 2**24) // (nheads * headdim * seqlen) + 1
    total = nseq * seqlen
    q, k, v = (torch.randn(total, nheads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    assert q.numel() > 2**31
    cu = torch.arange(0, total + 1, seqlen, device="cuda", dtype=torch.int32)
    out = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=True)
    last = slice(total - seqlen, total)
    dout = torch.zeros_like(out)
    dout[last] = torch.randn(seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    tail = [t[last][None] for t in (q, k, v)]
    check_against_reference(out[last][None], [g[last][None] for g in (dq, dk, dv)], *tail, dout[last][None],
                            causal=True)


def test_inductor_fullgraph_compile():
    q, k, v = random_qkv(2, 512, 512, 8, 2, 64, torch.bfloat16, device="cuda")

    def block(q, k, v):
        return flashpatch.flash_attn_func(torch.nn.functional.gelu(q), k, v, causal=True).float().square().mean()

    compiled = torch.compile(block, fullgraph=True)
    loss_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    loss_e = block(q, k, v)
    grads_e = torch.autograd.grad(loss_e, (q, k, v))
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=1e-3)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("case", [
    dict(shape=(2, 1024, 1024, 8, 2, 128), causal=True),  # the Gluon kernels (GQA)
    dict(shape=(1, 1000, 1000, 4, 4, 64), window_size=(255, 64)),  # the Triton kernels
    dict(shape=(2, 512, 512, 4, 1, 128), causal=True, dropout_p=0.1),  # dropout with GQA: a separate dQ pass
    dict(lengths=[100, 513, 1024, 7], causal=True, options=dict(fused_dq=False)),  # varlen, the Gluon dQ pass
    dict(lengths=[100, 513, 1024, 7], causal=True, options=dict(gluon_dkdv=False)),  # varlen, the Triton kernels
], ids=["gluon", "triton_window", "dropout_gqa", "varlen_gluon", "varlen_triton"])
def test_concurrent_dq_matches_serial(case, monkeypatch):
    # KernelConfigs.concurrent_dq runs dK/dV on a side stream beside the dQ pass: the same kernels, so the same
    # bits as one after the other; and the side stream must have been used
    from flashpatch import ops

    used = []
    monkeypatch.setattr(ops, "_side_stream",
                        lambda device, _make=ops._side_stream: used.append(device) or _make(device))
    torch.manual_seed(0)
    kwargs = {key: value for key, value in case.items() if key not in ("shape", "lengths", "options")}
    if "lengths" in case:
        lengths = case["lengths"]
        cu = cu_seqlens_from_lengths(torch.tensor(lengths, device="cuda"))
        q, k, v = (torch.randn(sum(lengths), 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), **kwargs)
    else:
        q, k, v = random_qkv(*case["shape"], torch.bfloat16, device="cuda")
        out = flashpatch.flash_attn_func(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    grads = {}
    for concurrent in (False, True):
        with kernel_options.override(concurrent_dq=concurrent, **case.get("options", {})):
            grads[concurrent] = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert used, "the concurrent backward did not use the side stream"
    for serial, concurrent in zip(grads[False], grads[True]):
        assert not torch.isnan(serial).any()
        assert torch.equal(serial, concurrent)


@pytest.mark.parametrize("kernels", [dict(gluon_dkdv=False), dict(gluon_dkdv=True, gluon_dq=True, fused_dq=False)],
                         ids=["triton_dkdv", "gluon_dkdv"])
def test_concurrent_backward_makes_the_varlen_grid_before_the_fork_bf16(kernels, monkeypatch):
    # A varlen dK/dV grid's (sequence, block) table is made by torch ops on the caller's stream (ops.varlen_blocks),
    # and a concurrent backward runs dK/dV on a side stream forked from it: the table must be made before the fork.
    # A sleep queued on the caller's stream before each table is made holds it back long enough that a dK/dV forked
    # first would read the table's memory unwritten; a fresh cu_seqlens makes the backward's table anew.
    from flashpatch import ops

    make = ops.varlen_blocks
    monkeypatch.setattr(ops, "varlen_blocks", lambda *a, **kw: torch.cuda._sleep(100_000_000) or make(*a, **kw))
    torch.manual_seed(0)
    lengths = [100, 513, 1024, 7, 300]
    q, k, v = (torch.randn(sum(lengths), heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (8, 2, 2))
    dout = torch.randn_like(q)
    grads = {}
    for concurrent in (True, False):
        cu = cu_seqlens_from_lengths(torch.tensor(lengths, device="cuda"))
        with kernel_options.override(concurrent_dq=concurrent, atomic_dq=False, **kernels):
            out = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
            grads[concurrent] = torch.autograd.grad(out, (q, k, v), dout)
    for concurrent, serial in zip(grads[True], grads[False]):
        assert not torch.isnan(serial).any()
        assert torch.equal(concurrent, serial)


@pytest.mark.parametrize("layout", ["dense", "padded", "packed"])
def test_compiled_patched_model_compiles_once(layout):
    # tests/test_patch.py checks this on the CPU with dynamo alone; here inductor compiles the rest of the model
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tests._patch_models import build
    from tests.test_patch import compile_batches, forward_backward

    model = flashpatch.patch_model(build("llama").to("cuda", torch.bfloat16))
    batches = [{k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()} for b in compile_batches(layout)]
    eager = [forward_backward(model, batch)[1] for batch in batches]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    frames = []
    for batch, loss_e in zip(batches, eager):
        loss_c = forward_backward(compiled, batch)[1]
        frames.append(counters["frames"]["total"])
        assert torch.isfinite(loss_c)
        torch.testing.assert_close(loss_c, loss_e, rtol=2e-2, atol=2e-2)  # bf16, inductor fuses differently
    assert frames[1] == frames[0], f"the second step compiled {frames[1] - frames[0]} more frames"
    torch._dynamo.reset()


@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("lengths,dense", [([2048, 2048, 2048, 1501, 17], True), ([2048, 113, 1, 1], False)],
                         ids=["dense", "unpadded"])
def test_padded_layer_matches_float64_on_either_path(lengths, dense, headdim, monkeypatch):
    # The transformers attention function on rows of 2048 padded on the right (dense_pairs_bound 1.45 at head dim
    # 128, 1.7 at 64): the padded rows hold 1.41x the real tokens' causal pairs in the first batch, which runs the
    # dense kernel over its padding, and 3.99x in the second, which is unpadded. bf16, GQA 4/2, rows of 17, 113 and 1
    # real tokens; the real tokens' outputs and gradients against the float64 reference per row, zero gradients at
    # the padding.
    from flashpatch.integrations import transformers as fp_hf

    paths = []
    for name in ("flash_attn_func", "padded_attn_func"):
        original = getattr(fp_hf._kernels, name)
        monkeypatch.setattr(fp_hf._kernels, name,
                            lambda *a, _f=original, _n=name, **kw: paths.append(_n) or _f(*a, **kw))
    batch, seqlen = len(lengths), lengths[0]
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seqlen, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (4, 2, 2))  # (B, H, S, D), as a layer hands them over
    keep = torch.arange(seqlen, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]  # (B, S)
    dout = torch.randn(batch, seqlen, 4, headdim, device="cuda", dtype=torch.bfloat16) * keep[:, :, None, None]
    layer = torch.nn.Module()
    layer.is_causal, layer.num_key_value_groups = True, 2
    out, _ = fp_hf.fpatch_attention_forward(layer, q, k, v, keep.long(), scaling=headdim ** -0.5, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)  # (B, H, S, D) each
    assert paths == ["flash_attn_func" if dense else "padded_attn_func"]
    for g in grads:
        assert (g.transpose(1, 2)[~keep] == 0).all()
    real = lambda t: t.transpose(1, 2)[keep]  # noqa: E731  (B, H, S, D) -> the real tokens' (T, H, D)
    cu = cu_seqlens_from_lengths(torch.tensor(lengths, device="cuda"))
    check_against_reference(out[keep], [real(g) for g in grads], *(real(t) for t in (q, k, v)), dout[keep],
                            reference=varlen_attention_reference, ref_args=(cu, cu), causal=True,
                            softmax_scale=headdim ** -0.5)
