"""flash_attn_varlen_func: unpadded batches equal per-sequence dense runs and padded runs; helpers; validation."""

import pytest
import torch

import flashpatch
from flashpatch.kernels.options import DEFAULT
from flashpatch.padding import cu_seqlens_from_lengths
from flashpatch.reference import varlen_attention_reference
from tests.helpers import check_against_reference


def _packed(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype):
    q = torch.randn(sum(lengths_q), nheads, headdim, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), nheads_k, headdim, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), nheads_k, headdim, dtype=dtype, requires_grad=True)
    cu_q = cu_seqlens_from_lengths(torch.tensor(lengths_q))
    cu_k = cu_seqlens_from_lengths(torch.tensor(lengths_k))
    return q, k, v, cu_q, cu_k


def _check_varlen(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, dropout_p=0.0, **kwargs):
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype)
    out, lse, pattern = flashpatch.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dropout_p=dropout_p, return_attn_probs=True, **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = None if pattern is None else pattern > 0
    lse64 = check_against_reference(out, grads, q, k, v, dout, reference=varlen_attention_reference,
                                    ref_args=(cu_q, cu_k), dropout_keep=keep, dropout_p=dropout_p, **kwargs)
    assert lse.shape == (nheads, sum(lengths_q))
    torch.testing.assert_close(lse, lse64, rtol=1e-3, atol=1e-3)
    return out, grads


@pytest.mark.parametrize(
    "lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, kwargs",
    [
        ([17, 0, 1, 40], [17, 0, 1, 40], 2, 1, 32, torch.float32, {"causal": True}),
        ([5, 33, 1], [40, 12, 7], 4, 2, 40, torch.float32, {"causal": True}),
        ([30, 9], [30, 9], 3, 1, 64, torch.float16, {"window_size": (6, 2)}),
        ([1, 50, 0, 23], [3, 50, 5, 0], 2, 2, 32, torch.float16, {"softcap": 3.0}),
        ([44, 13], [20, 61], 2, 1, 32, torch.float32, {"dropout_p": 0.2, "causal": True}),
        ([0, 33, 5], [0, 40, 5], 2, 1, 32, torch.float32, {"causal": True}),  # the first sequence empty
    ],
)
def test_varlen_matches_per_sequence_reference(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, kwargs):
    _check_varlen(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, **kwargs)


@pytest.mark.parametrize("heaviest_first", [False, True])
@pytest.mark.parametrize("longest_first", [False, True])
def test_varlen_grid_lists_every_block_once(heaviest_first, longest_first):
    """ops.varlen_blocks: the varlen grid's (sequence, block) pairs are each block of each sequence exactly once,
    a sequence's blocks side by side, descending within it when heaviest_first; the sequences longest first (ties
    in batch order) when longest_first, else in batch order; every other entry names a block past the end of
    sequence 0, which the kernels skip."""
    lengths, block = [0, 5, 33, 1, 64, 0, 16], 16
    cu = flashpatch.padding.cu_seqlens_from_lengths(torch.tensor(lengths))
    pairs = flashpatch.ops.varlen_blocks(cu, sum(lengths), block, heaviest_first, longest_first)
    assert pairs.dtype == torch.int32 and pairs.shape == (2, sum(lengths) // block + len(lengths))
    counts = [-(-n // block) for n in lengths]  # [0, 1, 3, 1, 4, 0, 1]
    visit = [4, 2, 1, 3, 6, 0, 5] if longest_first else range(len(lengths))
    expected = [(seq, b) for seq in visit
                for b in (reversed(range(counts[seq])) if heaviest_first else range(counts[seq]))]
    listed = [tuple(p) for p in pairs.t().tolist()]
    assert listed[: len(expected)] == expected
    assert all(p == (0, 0) for p in listed[len(expected):])  # sequence 0 is empty: block 0 is past its end


def test_varlen_grid_past_the_second_axis_limit_turns_one_dimensional():
    # (heads, blocks) grids allow 65535 blocks; the varlen grid counts tokens / block, so millions of tokens need
    # the 1-D order (checked on the grid alone: running it takes a GPU)
    cu = flashpatch.padding.cu_seqlens_from_lengths(torch.tensor([3_000_000, 5]))
    small = flashpatch.ops._launch_grid(4, 128, False, cu, 3_000_005, 2, 3_000_000, heaviest_first=True,
                                         opts=DEFAULT)
    large = flashpatch.ops._launch_grid(4, 32, False, cu, 3_000_005, 2, 3_000_000, heaviest_first=True,
                                         opts=DEFAULT)
    assert small[0] == (4, 3_000_005 // 128 + 2) and small[2] is False
    assert large[0] == (4 * (3_000_005 // 32 + 2),) and large[2] is True


def test_declared_max_seqlen_above_the_longest_changes_nothing():
    # the varlen grid follows the tokens, not max_seqlen: a generous max_seqlen runs the very same blocks
    q, k, v, cu, _ = _packed([9, 30, 2], [9, 30, 2], 2, 1, 32, torch.float32)
    exact = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True)
    generous = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True)
    assert torch.equal(exact, generous)


def test_hundreds_of_length_one_sequences():
    _check_varlen([1] * 200, [1] * 200, 2, 1, 32, torch.float32, causal=True)


def test_varlen_equals_padded_dense_on_valid_rows():
    """Same tokens run padded through flash_attn_func (right-padded; causal rows see only real keys
    because padding sits after them) and unpadded through the varlen path."""
    lengths = [23, 7, 40]
    batch, seqlen, nheads, headdim = len(lengths), max(lengths), 2, 32
    q, k, v, cu, _ = _packed(lengths, lengths, nheads, nheads, headdim, torch.float32)
    mask = torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
    _, indices, cu_seqlens, max_seqlen, _ = flashpatch.unpad_input(torch.zeros(batch, seqlen, 1), mask)
    assert torch.equal(cu_seqlens, cu) and max_seqlen == seqlen
    padded = [flashpatch.pad_input(t, indices, batch, seqlen) for t in (q, k, v)]  # differentiable
    dout = torch.randn_like(q)
    torch.manual_seed(11)
    out_var = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=True, dropout_p=0.1)
    grads_var = torch.autograd.grad(out_var, (q, k, v), dout)
    torch.manual_seed(11)  # same (seed, offset): packed and padded layouts must draw the same bits
    out_pad = flashpatch.flash_attn_func(*padded, causal=True, dropout_p=0.1)
    out_pad_valid = out_pad.reshape(batch * seqlen, nheads, headdim)[indices]
    grads_pad = torch.autograd.grad(out_pad_valid, (q, k, v), dout)
    torch.testing.assert_close(out_var, out_pad_valid, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_var, grads_pad):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_position_ids_mark_documents():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    cu, max_len = flashpatch.cu_seqlens_from_position_ids(position_ids)
    assert cu.tolist() == [0, 3, 5, 6, 12] and cu.dtype == torch.int32 and max_len == 6
    with pytest.raises(ValueError, match="start at position 0"):
        flashpatch.cu_seqlens_from_position_ids(torch.tensor([[1, 2, 0]]))


def test_unpad_pad_round_trip_left_padding():
    hidden = torch.randn(2, 5, 3)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    unpadded, indices, cu, max_len, lens = flashpatch.unpad_input(hidden, mask)
    assert unpadded.shape == (8, 3) and cu.tolist() == [0, 3, 8] and max_len == 5 and lens.tolist() == [3, 5]
    back = flashpatch.pad_input(unpadded, indices, 2, 5)
    torch.testing.assert_close(back, hidden * mask[..., None])



def _count_launches(monkeypatch):
    from flashpatch import padding

    launches = []
    real = padding.launch
    monkeypatch.setattr(padding, "launch", lambda kernel, grid, *a, **kw: launches.append(grid) or
                        real(kernel, grid, *a, **kw))
    return launches


def test_row_gather_and_scatter_move_three_tensors_in_one_launch(device, monkeypatch):
    """The padded path's row moves (padding.gather / scatter) against indexing a flattened copy: q, k and v of
    different head counts, as (B, S, H, D) views of (B, H, S, D) memory (as transformers hands them over), gathered
    in one launch; rows scattered back in one launch, zeros at padding, into memory that held NaN; an expanded input
    (stride 0 over its heads) read as it is. Queries fewer than keys (a KV cache) index their own rows."""
    from flashpatch.padding import RowIndex, gather, padding_layout, scatter

    launches = _count_launches(monkeypatch)
    torch.manual_seed(3)
    batch, seqlen, nheads, headdim = 3, 9, 3, 5  # a head dim below its block
    mask = torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    mask[0, 6:] = False  # right padding
    mask[2, :4] = False  # left padding
    keys, _, _ = padding_layout(mask)
    memory = [torch.randn(batch, h, seqlen, headdim, device=device) for h in (nheads, 1, 1)]  # (B, H, S, D)
    q, k, v = (t.transpose(1, 2) for t in memory)  # (B, S, H, D) views
    v = v.expand(batch, seqlen, 2, headdim)  # stride 0 over its heads
    index = RowIndex(keys, seqlen)
    rows = gather(index, q, k, v)
    assert len(launches) == 1
    for got, t in zip(rows, (q, k, v)):
        assert got.is_contiguous() and torch.equal(got, t.reshape(-1, *t.shape[2:])[keys])
    fulls = tuple(torch.full((batch, h, seqlen, headdim), float("nan"), device=device).transpose(1, 2)
                  for h in (nheads, 1, 2))
    scatter(index, rows, fulls)
    assert len(launches) == 2
    for full, t in zip(fulls, (q, k, v)):
        assert torch.equal(full, t * mask[:, :, None, None])
    q_len = 5
    queries, _, _ = padding_layout(mask[:, -q_len:])
    (q_rows,) = gather(RowIndex(queries, q_len), q[:, -q_len:])
    assert torch.equal(q_rows, q[:, -q_len:].reshape(-1, nheads, headdim)[queries])


def test_row_scatter_of_an_empty_batch_writes_zeros(device):
    """A batch whose rows hold no real token: nothing to gather, and the scatter still writes every position."""
    from flashpatch.padding import RowIndex, gather, padding_layout, scatter

    mask = torch.zeros(2, 4, dtype=torch.bool, device=device)
    indices, _, _ = padding_layout(mask)
    index = RowIndex(indices, 4)
    (rows,) = gather(index, torch.randn(2, 4, 3, 8, device=device))
    assert rows.shape == (0, 3, 8)
    full = torch.full((2, 4, 3, 8), float("nan"), device=device)
    scatter(index, (rows,), (full,))
    assert torch.equal(full, torch.zeros_like(full))


@pytest.mark.parametrize("q_len", [9, 4], ids=["self", "fewer_queries"])
def test_padded_attention_matches_float64_in_one_node(device, q_len, monkeypatch):
    """interface.padded_attn_func (the transformers integration's padded path) against the float64 reference per
    sequence: left and right padding and a row with no real token, GQA 4/2, causal. One autograd node whose
    backward hands each input a gradient in its own memory order with zeros at padding, and launches two row moves
    a forward and two a backward where queries and keys share their rows (three each with fewer queries); an input
    that needs no gradient gets none."""
    from flashpatch.autograd import PaddedAttnFunction
    from flashpatch.interface import padded_attn_func
    from flashpatch.padding import RowIndex, padding_layout

    torch.manual_seed(0)
    batch, seqlen, nheads, nheads_k, headdim = 4, 9, 4, 2, 16
    lengths = torch.tensor([9, 6, 0, 5])
    mask = torch.arange(seqlen)[None, :] < lengths[:, None]
    mask[3] = mask[3].flip(0)  # left padding
    mask = mask.to(device)
    memory = [torch.randn(batch, h, s, headdim, device=device, requires_grad=True)
              for h, s in ((nheads, q_len), (nheads_k, seqlen), (nheads_k, seqlen))]  # (B, H, S, D)
    q, k, v = (t.transpose(1, 2) for t in memory)  # (B, S, H, D)
    keys, cu_k, max_k = padding_layout(mask)
    rows_k = RowIndex(keys, seqlen)
    if q_len == seqlen:
        rows_q, cu_q, max_q = rows_k, cu_k, max_k
    else:
        queries, cu_q, max_q = padding_layout(mask[:, -q_len:])
        rows_q = RowIndex(queries, q_len)
    launches = _count_launches(monkeypatch)
    out = padded_attn_func(q, k, v, rows_q, rows_k, cu_q, cu_k, max_q, max_k, causal=True)  # (B, Sq, H, D)
    assert type(out.grad_fn).__name__ == PaddedAttnFunction.__name__ + "Backward"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, memory, dout)
    assert len(launches) == (4 if q_len == seqlen else 6)
    real_q, real_k = mask[:, -q_len:], mask
    assert (out[~real_q] == 0).all()
    for g, t, real in zip(grads, memory, (real_q, real_k, real_k)):
        assert g.stride() == t.stride() and (g.transpose(1, 2)[~real] == 0).all()
    flat = lambda t, real: t.transpose(1, 2)[real]  # noqa: E731  (B, H, S, D) -> the real tokens' (T, H, D)
    check_against_reference(out[real_q], [flat(grads[0], real_q), flat(grads[1], real_k), flat(grads[2], real_k)],
                            flat(memory[0], real_q), flat(memory[1], real_k), flat(memory[2], real_k), dout[real_q],
                            reference=varlen_attention_reference, ref_args=(cu_q, cu_k), causal=True)
    frozen = memory[1].detach().transpose(1, 2)
    out = padded_attn_func(q, frozen, v, rows_q, rows_k, cu_q, cu_k, max_q, max_k, causal=True)
    dq, dv = torch.autograd.grad(out, (memory[0], memory[2]), dout)
    torch.testing.assert_close(dq, grads[0]) and torch.testing.assert_close(dv, grads[2])


def test_padded_attention_dropout_is_the_varlen_calls(device):
    """With dropout, the padded node draws its (seed, offset) as flash_attn_varlen_func does and its backward
    regenerates the same keep bits: under one seed, outputs and gradients on the real tokens equal the varlen call's
    on the gathered rows, and differ from a call without dropout."""
    from flashpatch.interface import padded_attn_func
    from flashpatch.padding import RowIndex, padding_layout

    torch.manual_seed(1)
    batch, seqlen, nheads, nheads_k, headdim = 3, 12, 2, 1, 16
    mask = torch.arange(seqlen)[None, :] < torch.tensor([12, 7, 4])[:, None]
    mask[2] = mask[2].flip(0)  # left padding
    mask = mask.to(device)
    memory = [torch.randn(batch, h, seqlen, headdim, device=device, requires_grad=True) for h in (nheads, 1, 1)]
    q, k, v = (t.transpose(1, 2) for t in memory)  # (B, S, H, D) views
    indices, cu, longest = padding_layout(mask)
    rows = RowIndex(indices, seqlen)
    dout = torch.randn(batch, seqlen, nheads, headdim, device=device)
    torch.manual_seed(7)
    out = padded_attn_func(q, k, v, rows, rows, cu, cu, longest, longest, dropout_p=0.3, causal=True)
    grads = torch.autograd.grad(out, memory, dout)
    flat = [t.detach().transpose(1, 2)[mask].requires_grad_() for t in memory]  # (T, H, D) each
    torch.manual_seed(7)
    want = flashpatch.flash_attn_varlen_func(*flat, cu, cu, longest, longest, dropout_p=0.3, causal=True)
    want_grads = torch.autograd.grad(want, flat, dout[mask])
    assert torch.equal(out[mask], want)
    for got, expected in zip(grads, want_grads):
        assert torch.equal(got.transpose(1, 2)[mask], expected)
    plain = padded_attn_func(q, k, v, rows, rows, cu, cu, longest, longest, causal=True)
    assert not torch.equal(plain[mask], out[mask])


def test_padded_attention_refuses_row_indices_on_another_device():
    from flashpatch.interface import padded_attn_func
    from flashpatch.padding import RowIndex

    q = torch.randn(2, 4, 2, 8)
    on_meta = RowIndex(torch.arange(8, device="meta"), 4)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"row indices must be on q's device cpu, got meta and meta"):
        padded_attn_func(q, q, q, on_meta, on_meta, cu, cu, 4, 4)


BAD_CU = [
    (lambda cu: cu.long(), TypeError, "int32"),
    (lambda cu: cu[None], ValueError, "1-D"),
    (lambda cu: cu + 1, ValueError, "start at 0"),
    (lambda cu: torch.tensor([0, 9, 5, 12], dtype=torch.int32), ValueError, "non-decreasing"),
    (lambda cu: torch.tensor([0, 3, 5, 11], dtype=torch.int32), ValueError, r"\[-1\] = 11 must equal .* 12"),
    (lambda cu: cu[:3], ValueError, "same length"),
]


@pytest.mark.parametrize("corrupt, error, match", BAD_CU, ids=[b[2] for b in BAD_CU])
def test_bad_cu_seqlens_are_clear_errors(corrupt, error, match):
    q, k, v, cu, _ = _packed([3, 2, 7], [3, 2, 7], 2, 1, 16, torch.float32)
    with pytest.raises(error, match=match):
        flashpatch.flash_attn_varlen_func(q, k, v, corrupt(cu), cu, 7, 7)


def test_max_seqlen_too_small_is_a_clear_error():
    q, k, v, cu, _ = _packed([3, 9], [3, 9], 1, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="length 9 > max_seqlen 4"):
        flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, 4, 9)


def test_checked_cu_seqlens_are_rechecked_after_an_in_place_change():
    """Values are checked once per tensor (each check is a host sync, and a model passes the same cu_seqlens to
    every layer); writing into the tensor, or other totals or max_seqlen, must bring the check back."""
    q, k, v, cu, _ = _packed([3, 2, 7], [3, 2, 7], 2, 1, 16, torch.float32)
    flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)  # cached: still fine
    with pytest.raises(ValueError, match="length 7 > max_seqlen 6"):
        flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, 6, 7)
    cu[2] = 1  # lengths 3, -2, 11
    with pytest.raises(ValueError, match="non-decreasing"):
        flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)


def test_shared_cu_seqlens_compile_in_one_graph():
    # self-attention over packed documents passes one cu_seqlens tensor as both cu_seqlens_q and cu_seqlens_k; an
    # autograd.Function given one tensor twice cannot be traced, which broke the graph at every layer of a compiled
    # model (fullgraph=True turns a break into an error)
    cu = cu_seqlens_from_lengths(torch.tensor([5, 11, 1]))
    q, k, v = (torch.randn(17, 2, 16, requires_grad=True) for _ in range(3))

    def attend(q, k, v, cu):
        return flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True)

    out = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v, cu)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    expected = attend(q, k, v, cu)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v), torch.ones_like(expected))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
