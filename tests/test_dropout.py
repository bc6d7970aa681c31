"""Attention dropout: Philox mask keyed by (seed, offset) and element position, replayed in backward."""

import itertools
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import flashpatch
from flashpatch.kernels import options as kernel_options
from flashpatch.kernels.config import LaunchConfig
from flashpatch.reference import attention_reference
from tests.helpers import check_against_reference, random_qkv


def _run(q, k, v, p, **kwargs):
    out, lse, pattern = flashpatch.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **kwargs)
    return out, pattern


def test_keep_fraction_and_exact_scaling():
    p = 0.3
    batch, nheads, seqlen, headdim = 2, 2, 64, 64  # v = identity: out rows are the dropped probabilities
    q = torch.randn(batch, seqlen, nheads, headdim)
    k = torch.randn(batch, seqlen, nheads, headdim)
    v = torch.eye(seqlen)[None, :, None, :].expand(batch, seqlen, nheads, headdim).contiguous()
    out, pattern = _run(q, k, v, p)
    keep = pattern > 0
    assert set(pattern.unique().tolist()) == {-1.0, 1.0}
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / headdim**0.5, dim=-1)
    dropped = out.permute(0, 2, 1, 3).double()  # (B, H, Sq, Sk) = P * Z / (1 - p)
    assert (dropped[~keep] == 0).all()
    ratio = dropped[keep] / probs[keep]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 1 / (1 - p)), rtol=2e-5, atol=0)

    big = flashpatch.ops.dropout_pattern(flashpatch.ops.draw_seed_offset(q.device), 4, 4, 128, 128, 0.1)
    kept_fraction = (big > 0).double().mean().item()  # 262k draws: std of the fraction is 6e-4
    assert abs(kept_fraction - 0.9) < 0.01, kept_fraction


@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, kwargs",
    [
        (2, 37, 37, 2, 1, 32, torch.float32, {}),
        (1, 113, 50, 4, 2, 40, torch.float32, {"causal": True}),
        (2, 17, 70, 3, 3, 64, torch.float16, {"causal": True}),
        (1, 60, 60, 2, 1, 32, torch.float32, {"window_size": (9, 4), "softcap": 4.0}),
    ],
)
def test_matches_reference_built_on_the_kernels_mask(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype,
                                                     kwargs):
    p = 0.17
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    out, pattern = _run(q, k, v, p, **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, q, k, v, dout, dropout_p=p, dropout_keep=pattern > 0, **kwargs)


def test_same_seed_same_bits_new_draw_new_mask():
    q, k, v = random_qkv(1, 40, 40, 2, 1, 32, torch.float16)
    dout = torch.randn(1, 40, 2, 32, dtype=torch.float16)
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        out, pattern = _run(q, k, v, 0.25, causal=True)
        runs.append((out, pattern, *torch.autograd.grad(out, (q, k, v), dout)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    out3, pattern3 = _run(q, k, v, 0.25, causal=True)  # no reseed: the generator moved on
    assert not torch.equal(pattern3, runs[0][1])
    assert not torch.equal(out3, runs[0][0])


def test_mask_does_not_depend_on_block_sizes():
    q, k, v = random_qkv(1, 70, 90, 2, 1, 32, torch.float32)
    dout = torch.randn(1, 70, 2, 32)
    results = []
    for blocks in ((16, 16), (32, 64)):
        cfg = LaunchConfig(*blocks)
        with kernel_options.override(fwd=cfg, bwd_dq=cfg, bwd_dkdv=LaunchConfig(blocks[1], blocks[0])):
            torch.manual_seed(7)
            out, pattern = _run(q, k, v, 0.4, causal=True)
            results.append((out, pattern, *torch.autograd.grad(out, (q, k, v), dout)))
    (out_a, pattern_a, *grads_a), (out_b, pattern_b, *grads_b) = results
    assert torch.equal(pattern_a, pattern_b)
    # Tilings sum in different orders, so equal masks mean equal up to fp32 rounding; a different mask would be
    # off by O(1). Both also match the reference built on that mask.
    for a, b in zip((out_a, *grads_a), (out_b, *grads_b)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    check_against_reference(out_a, grads_a, q, k, v, dout, dropout_p=0.4, dropout_keep=pattern_a > 0, causal=True)


def test_checkpoint_recompute_gives_same_grads():
    q, k, v = random_qkv(2, 33, 33, 2, 2, 32, torch.float32)

    def layer(q, k, v):
        return flashpatch.flash_attn_func(q, k, v, dropout_p=0.3, causal=True).square().sum()

    torch.manual_seed(3)
    plain = torch.autograd.grad(layer(q, k, v), (q, k, v))
    torch.manual_seed(3)
    loss = checkpoint(layer, q, k, v, use_reentrant=False, preserve_rng_state=True)
    recomputed = torch.autograd.grad(loss, (q, k, v))
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)


def test_zero_dropout_is_the_plain_path():
    q, k, v = random_qkv(1, 20, 20, 1, 1, 32, torch.float32, requires_grad=False)
    out, lse, pattern = flashpatch.flash_attn_func(q, k, v, dropout_p=0.0, return_attn_probs=True)
    assert pattern is None
    ref, _ = attention_reference(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


MASK32 = 0xFFFFFFFF


def _philox4x32(counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int) -> tuple[int, int, int, int]:
    """Philox4x32 with `rounds` rounds as specified by Salmon et al. (SC'11, Random123), in plain Python integers."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        prod0, prod1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((prod1 >> 32) ^ c1 ^ k0, prod1 & MASK32, (prod0 >> 32) ^ c3 ^ k1, prod0 & MASK32)
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


def test_philox_oracle_matches_published_known_answers():
    """The plain-Python Philox against Random123's known-answer vectors (kat_vectors) at 7 and 10 rounds."""
    ones, digits = (MASK32,) * 4, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    assert _philox4x32((0, 0, 0, 0), (0, 0), 7) == (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)
    assert _philox4x32(ones, (MASK32, MASK32), 7) == (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)
    assert _philox4x32(digits, (0xA4093822, 0x299F31D0), 7) == (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)
    assert _philox4x32((0, 0, 0, 0), (0, 0), 10) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)


def test_mask_is_philox4x32_7_at_documented_counters():
    """The kernels' generator is Philox4x32-7 (the oracle above, checked against the published vectors), bit for bit
    at the counter layout `dropout_keep` documents (eight 16-bit decisions per call)."""
    # 21 queries, 37 keys: partial 16-row and 16-key groups, and both halves of bit 3 in each
    batch, nheads, seqlen_q, seqlen_k, p = 2, 3, 21, 37, 0.3
    seed_offset = flashpatch.ops.draw_seed_offset(torch.device("cpu"))
    seed, offset = seed_offset.tolist()
    pattern = flashpatch.ops.dropout_pattern(seed_offset, batch, nheads, seqlen_q, seqlen_k, p)
    threshold = math.floor(torch.tensor(p, dtype=torch.float32).item() * 65536 + 0.5)  # the kernels' fp32 p
    rows_per_head = 8 * math.ceil(seqlen_q / 16)
    groups_per_row = 4 * math.ceil(seqlen_k / 16)
    expected = torch.empty_like(pattern)
    for b, h, i, j in itertools.product(range(batch), range(nheads), range(seqlen_q), range(seqlen_k)):
        i_pair = (i >> 4) * 8 + (i & 7)  # i without bit 3
        j_group = (j >> 4) * 4 + ((j >> 1) & 3)  # j without bits 0 and 3
        counter = offset + ((b * nheads + h) * rows_per_head + i_pair) * groups_per_row + j_group
        word = _philox4x32((counter & MASK32, counter >> 32, 0, 0), (seed & MASK32, seed >> 32), 7)[
            2 * ((i >> 3) & 1) + ((j >> 3) & 1)]
        bits = (word >> 16) if j & 1 else (word & 0xFFFF)
        expected[b, h, i, j] = 1.0 if bits >= threshold else -1.0
    assert torch.equal(pattern, expected), (pattern != expected).sum().item()


def test_mask_bits_are_independent_like_bernoulli():
    """No correlation between neighbouring columns, rows, heads, batch entries or consecutive calls, and per-row
    keep counts spread like a binomial: statistically the same noise as torch's dropout."""
    p = 0.1
    draw = lambda: flashpatch.ops.dropout_pattern(  # noqa: E731
        flashpatch.ops.draw_seed_offset(torch.device("cpu")), 3, 4, 96, 96, p).gt(0).double()
    z, z_next = draw(), draw()

    def corr(a, b):
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item(), a.numel()

    pairs = {
        "columns": (z[..., 1:], z[..., :-1]),
        "rows": (z[..., 1:, :], z[..., :-1, :]),
        "heads": (z[:, 1:], z[:, :-1]),
        "batch": (z[1:], z[:-1]),
        "calls": (z, z_next),
    }
    for name, (a, b) in pairs.items():
        c, n = corr(a, b)
        assert abs(c) < 5 / n**0.5, f"{name}: correlation {c:.4f} over {n} pairs"
    per_row = z.sum(-1).flatten()
    expected_var = 96 * p * (1 - p)
    assert 0.75 * expected_var < per_row.var().item() < 1.3 * expected_var


def test_dropout_is_unbiased_in_output_and_gradients():
    """out = (P * Z / (1 - p)) V is linear in the mask, so over many draws the mean output and the mean gradients
    of <out, dout> converge to the no-dropout values. Checked against a 5-sigma bound from the draws' own spread."""
    q, k, v = random_qkv(1, 24, 24, 2, 1, 32, torch.float32)
    dout = torch.randn(1, 24, 2, 32)
    exact = [flashpatch.flash_attn_func(q, k, v, causal=True)]
    exact += torch.autograd.grad(exact[0], (q, k, v), dout)
    draws = 150
    samples = [[] for _ in exact]
    for _ in range(draws):
        out = flashpatch.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
        for bucket, value in zip(samples, (out, *torch.autograd.grad(out, (q, k, v), dout))):
            bucket.append(value.detach().double())
    for name, target, bucket in zip(("out", "dq", "dk", "dv"), exact, samples):
        stacked = torch.stack(bucket)
        mean, sem = stacked.mean(0), stacked.std(0) / draws**0.5
        # Entries whose value no mask can change (causal row 0 sees one key: its dq is 0 for every draw) spread
        # only by fp32 rounding, so the standard error gets the usual fp32 floor of the quantity's magnitude.
        floor = 4 * torch.finfo(torch.float32).eps * target.abs().max().item()
        z = (mean - target.double()).abs() / (sem.square() + floor**2).sqrt()
        assert z.max() < 5.5, f"{name}: mean over {draws} draws is {z.max():.1f} standard errors off"
        assert z.mean() < 1.2, f"{name}: mean z-score {z.mean():.2f} (unbiased noise gives at most ~0.8)"
