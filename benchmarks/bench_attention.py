"""Kernel-level attention benchmark: flashpatch against SDPA's flash, cuDNN and efficient backends and FlexAttention.

    python benchmarks/bench_attention.py --quick            # a few shapes, minutes
    python benchmarks/bench_attention.py --seqlens 4096,8192,16384 --peers fpatch,sdpa_flash,sdpa_cudnn,flex
    python benchmarks/bench_attention.py --match window --peers fpatch --kernel_options persistent_fwd=false

Cases: dense full and causal at head dim 64 and 128 (B·N = 16k tokens, H·D = 2048), GQA (4 query heads per K/V
head), dropout p = 0.1 (dense, and one varlen case), ALiBi (SDPA gets it as a float mask, FlexAttention as a score_mod), and varlen: document
lengths log-uniform in 64..4096 totalling 64k tokens, causal, where flashpatch and FlexAttention (document mask) see
the packed documents and SDPA sees them padded to the longest (right padding + is_causal: the pad never reaches a
real token, so its fastest backends apply; the pad's work is SDPA's cost of not unpadding). Each cell is fwd / bwd /
fwd+bwd TFLOP/s with FLOPs = 4·B·H·Sq·Sk·D for fwd (halved for causal; varlen sums the real documents), bwd = 2.5 ×
fwd, fwd+bwd = 3.5 × fwd; times are medians of triton.testing.do_bench. A peer that refuses a case shows "n/a" and
the reason goes to the JSON.
Writes <out>/bench_attention.md, .json and .png (default out: results/latest/), appends one row per figure to
results/history.csv (--history; "" skips it), then prints the markdown table last. GPU only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))  # import flashpatch from this checkout without `pip install -e .`

from flashpatch.kernels import options  # noqa: E402

PEERS = ("fpatch", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex")


@dataclass
class Case:
    name: str
    batch: int
    heads: int
    kv_heads: int
    seqlen: int  # per row; for varlen the longest document
    head_dim: int
    causal: bool
    dropout: float = 0.0
    doc_lens: list[int] = field(default_factory=list)  # varlen only: the documents, packed
    alibi: bool = False  # ALiBi with the standard slopes (`alibi_slopes`); FLOPs count as without it
    window: int = -1  # >= 0: a causal sliding window, query i seeing keys i - window .. i
    softcap: float = 0.0  # > 0: scores capped to softcap * tanh(score / softcap), Gemma 2's
    bhsd: bool = False  # flashpatch gets (B, S, H, D) views of (B, H, S, D) memory, as transformers' rotary leaves q, k

    @property
    def varlen(self) -> bool:
        return bool(self.doc_lens)

    def fwd_flops(self) -> float:
        """Useful forward FLOPs: QKᵀ and PV, 2·Sq·Sk·D each per head; causal halves; varlen counts real documents."""
        if self.window >= 0:  # the (query, key) pairs a causal window leaves, counted exactly
            w, n = self.window, self.seqlen
            seen = sum(min(i + 1, w + 1) for i in range(n))
            return 4.0 * self.heads * self.batch * seen * self.head_dim
        pairs = sum(n * n for n in self.doc_lens) if self.varlen else self.batch * self.seqlen**2
        flops = 4.0 * self.heads * pairs * self.head_dim
        return flops / 2 if self.causal else flops

    def tokens(self) -> int:
        return sum(self.doc_lens) if self.varlen else self.batch * self.seqlen


def varlen_lengths(total: int = 65536, low: int = 64, high: int = 4096, seed: int = 0,
                   count: int | None = None) -> list[int]:
    """Log-uniform lengths in [low, high], drawn until they sum to `total` (the last one is cut to fit), or with
    `count` that many."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while (len(lengths) < count) if count is not None else (sum(lengths) < total):
        u = torch.rand((), generator=gen).item()
        n = int(round(math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))
        lengths.append(n if count is not None else min(n, total - sum(lengths)))
    return lengths


def varlen_batch(lengths: list[int], nheads: int, nheads_k: int, headdim: int):
    """The timing scripts' varlen inputs on the GPU, bf16, seeded: q, k, v with gradients, dout, cu_seqlens."""
    from flashpatch.padding import cu_seqlens_from_lengths

    torch.manual_seed(0)
    cu_seqlens = cu_seqlens_from_lengths(torch.tensor(lengths, device="cuda"))  # (docs + 1,)
    total = sum(lengths)
    q = torch.randn(total, nheads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # (T, H, D)
    k, v = (torch.randn(total, nheads_k, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # (T, Hk, D)
    return q, k, v, torch.randn_like(q), cu_seqlens


def build_cases(quick: bool, seqlens: tuple[int, ...] | None = None) -> list[Case]:
    """seqlens: the dense cases' lengths (default: 4096 with quick, else 1k to 16k)."""
    tokens = 16384  # B·N, as in the README's table (B = 16384 // N where N does not divide it)
    cases = []
    seqlens = seqlens or ((4096,) if quick else (1024, 2048, 4096, 8192, 16384))
    for head_dim in (128, 64):
        heads = 2048 // head_dim
        for causal in (True, False):
            if quick and head_dim == 64 and not causal:
                continue
            for n in seqlens:
                mask = "causal" if causal else "full"
                cases.append(Case(f"d{head_dim} {mask} N={n}", tokens // n, heads, heads, n, head_dim, causal))
    for n in (4096,) if quick else (2048, 8192):
        cases.append(Case(f"d128 causal GQA 16/4 N={n}", tokens // n, 16, 4, n, 128, True))
        cases.append(Case(f"d128 causal dropout0.1 N={n}", tokens // n, 16, 16, n, 128, True, dropout=0.1))
    if not quick:  # the attention of configs/llama_125m.yaml (12 query heads, 4 K/V heads of 64, rows of 2048)
        cases.append(Case("d64 causal GQA 12/4 N=2048", 8, 12, 4, 2048, 64, True))
    cases.append(Case("d128 causal ALiBi N=4096", 4, 16, 16, 4096, 128, True, alibi=True))
    cases.append(Case("d128 causal N=4096 BHSD memory", 4, 16, 16, 4096, 128, True, bhsd=True))
    if not quick:  # sliding windows: Mistral's 4096 at 16k with GQA 32/8, and 1024 at 8k
        cases.append(Case("d128 window 4096 GQA 32/8 N=16384", 1, 32, 8, 16384, 128, True, window=4096))
        cases.append(Case("d128 window 1024 N=8192", 2, 16, 16, 8192, 128, True, window=1024))
        cases.append(Case("d128 causal softcap 50 N=8192", 2, 16, 16, 8192, 128, True, softcap=50.0))
        # dropout against the same calls without it (d128 causal above): full rows, and head dim 64
        cases.append(Case("d128 full dropout0.1 N=8192", 2, 16, 16, 8192, 128, False, dropout=0.1))
        for causal in (True, False):
            mask = "causal" if causal else "full"
            cases.append(Case(f"d64 {mask} dropout0.1 N=8192", 2, 32, 32, 8192, 64, causal, dropout=0.1))
        # head dim 256 at the Gemma-2 shape: causal, with softcap alone, and with its window and softcap
        cases.append(Case("d256 causal GQA 8/4 N=8192", 2, 8, 4, 8192, 256, True))
        cases.append(Case("d256 causal softcap 50 GQA 8/4 N=8192", 2, 8, 4, 8192, 256, True, softcap=50.0))
        cases.append(Case("d256 window 4096 softcap 50 GQA 8/4 N=8192", 2, 8, 4, 8192, 256, True, window=4096,
                          softcap=50.0))
    lens = varlen_lengths()
    cases.append(Case(f"d128 varlen {len(lens)} docs 64..4096", len(lens), 16, 16, max(lens), 128, True, 0.0, lens))
    if not quick:
        cases.append(Case(f"d128 varlen GQA 16/8 {len(lens)} docs 64..4096", len(lens), 16, 8, max(lens), 128, True,
                          0.0, lens))
        cases.append(Case(f"d64 varlen {len(lens)} docs 64..4096", len(lens), 16, 16, max(lens), 64, True, 0.0, lens))
        cases.append(Case(f"d256 varlen GQA 8/4 {len(lens)} docs 64..4096", len(lens), 8, 4, max(lens), 256, True, 0.0,
                          lens))
        # configs/lora_qwen2_0p5b.yaml's attention: 16 rows of at most 512 tokens, unpadded (GQA 14/2, head dim 64)
        rows = varlen_lengths(low=64, high=512, seed=1, count=16)
        cases.append(Case("d64 varlen GQA 14/2 16 rows 64..512", len(rows), 14, 2, max(rows), 64, True, 0.0, rows))
        # a padded batch with attention dropout, as the transformers integration hands it over unpadded (GPT-2 style
        # d64 heads): varlen with dropout runs the portable kernels
        cases.append(Case(f"d64 varlen dropout0.1 {len(lens)} docs 64..4096", len(lens), 16, 16, max(lens), 64, True,
                          0.1, lens))
    return cases


def alibi_slopes(nheads: int, device) -> torch.Tensor:
    """(H,) float32: ALiBi's slopes 2^(-8 (h + 1) / H), the geometric sequence of its paper for H a power of two."""
    return torch.exp2(-8.0 * torch.arange(1, nheads + 1, device=device, dtype=torch.float32) / nheads)


def alibi_bias(case: Case, dtype, device) -> torch.Tensor:
    """(1, H, S, S) additive mask for SDPA: -slope * |i - j|, and -inf above the diagonal when causal."""
    pos = torch.arange(case.seqlen, device=device)
    dist = (pos[:, None] - pos[None, :]).abs().float()  # (S, S)
    bias = -alibi_slopes(case.heads, device)[:, None, None] * dist  # (H, S, S)
    if case.causal:
        bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return bias[None].to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# One callable per (peer, case): returns (forward function, the tensors whose .grad backward fills), or raises.


def _rand(*shape, dtype, device):
    return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)


def make_fpatch(case: Case, dtype, device):
    import flashpatch

    d = case.head_dim
    if case.varlen:
        total = case.tokens()
        q = _rand(total, case.heads, d, dtype=dtype, device=device)  # (total, H, D)
        k = _rand(total, case.kv_heads, d, dtype=dtype, device=device)
        v = _rand(total, case.kv_heads, d, dtype=dtype, device=device)
        cu = flashpatch.padding.cu_seqlens_from_lengths(torch.tensor(case.doc_lens, device=device))  # (docs + 1,)
        longest = max(case.doc_lens)

        def fn():
            return flashpatch.flash_attn_varlen_func(
                q, k, v, cu, cu, longest, longest, dropout_p=case.dropout, causal=case.causal
            )

        return fn, [q, k, v]
    if case.bhsd:  # (B, S, H, D) views of (B, H, S, D) memory; the leaves keep their own layout
        leaves = [_rand(case.batch, h, case.seqlen, d, dtype=dtype, device=device)
                  for h in (case.heads, case.kv_heads, case.kv_heads)]
        q, k, v = (t.transpose(1, 2) for t in leaves)
        slopes = alibi_slopes(case.heads, device) if case.alibi else None
        return (lambda: flashpatch.flash_attn_func(q, k, v, dropout_p=case.dropout, causal=case.causal,
                                                   alibi_slopes=slopes)), leaves
    q = _rand(case.batch, case.seqlen, case.heads, d, dtype=dtype, device=device)  # (B, S, H, D)
    k = _rand(case.batch, case.seqlen, case.kv_heads, d, dtype=dtype, device=device)
    v = _rand(case.batch, case.seqlen, case.kv_heads, d, dtype=dtype, device=device)
    slopes = alibi_slopes(case.heads, device) if case.alibi else None
    window = (case.window, 0) if case.window >= 0 else (-1, -1)
    return (lambda: flashpatch.flash_attn_func(q, k, v, dropout_p=case.dropout, causal=case.causal, alibi_slopes=slopes,
                                               window_size=window, softcap=case.softcap)), [q, k, v]


def make_sdpa(backend_name: str):
    def make(case: Case, dtype, device):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if case.window >= 0:
            raise NotImplementedError("SDPA takes a sliding window only as a dense mask")
        if case.softcap:
            raise NotImplementedError("SDPA has no softcap")
        backend = getattr(SDPBackend, backend_name)
        # (B, H, S, D); varlen: the documents padded to the longest, right padding, causal without a mask
        q = _rand(case.batch, case.heads, case.seqlen, case.head_dim, dtype=dtype, device=device)
        k = _rand(case.batch, case.kv_heads, case.seqlen, case.head_dim, dtype=dtype, device=device)
        v = _rand(case.batch, case.kv_heads, case.seqlen, case.head_dim, dtype=dtype, device=device)
        gqa = case.kv_heads != case.heads
        # ALiBi reaches SDPA as a float mask that also carries the causal mask (SDPA takes one or the other)
        bias = alibi_bias(case, dtype, device) if case.alibi else None
        causal = case.causal and bias is None

        def fn():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=bias, dropout_p=case.dropout, is_causal=causal, enable_gqa=gqa
                )

        return fn, [q, k, v]

    return make


_FLEX = {}


def make_flex(case: Case, dtype, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if case.dropout:
        raise NotImplementedError("FlexAttention has no attention dropout")
    if "fn" not in _FLEX:
        from torch import _dynamo, _functorch

        # one compiled graph per shape; the default cache limit (8) would drop later shapes to uncompiled flex
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(_dynamo.config, knob):
                setattr(_dynamo.config, knob, 64)
        # the backward-only timing replays one graph (retain_graph=True), which donated buffers forbid
        _functorch.config.donated_buffer = False
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    if case.varlen:
        # the documents packed into one row, a document-causal block mask
        doc_id = torch.repeat_interleave(
            torch.arange(len(case.doc_lens), device=device), torch.tensor(case.doc_lens, device=device)
        )

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

        batch, seqlen = 1, case.tokens()
    elif case.window >= 0:

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= case.window)

        batch, seqlen = case.batch, case.seqlen
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        batch, seqlen = case.batch, case.seqlen
    block_mask = create_block_mask(mask_mod, None, None, seqlen, seqlen, device=device) if case.causal else None
    q = _rand(batch, case.heads, seqlen, case.head_dim, dtype=dtype, device=device)  # (B, H, S, D)
    k = _rand(batch, case.kv_heads, seqlen, case.head_dim, dtype=dtype, device=device)
    v = _rand(batch, case.kv_heads, seqlen, case.head_dim, dtype=dtype, device=device)
    gqa = case.kv_heads != case.heads
    slopes = alibi_slopes(case.heads, device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def softcap(score, b, h, q_idx, kv_idx):
        return case.softcap * torch.tanh(score / case.softcap)

    score_mod = alibi if case.alibi else softcap if case.softcap else None
    return (lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)), [q, k, v]


MAKERS = {
    "fpatch": make_fpatch,
    "sdpa_flash": make_sdpa("FLASH_ATTENTION"),
    "sdpa_cudnn": make_sdpa("CUDNN_ATTENTION"),
    "sdpa_efficient": make_sdpa("EFFICIENT_ATTENTION"),
    "flex": make_flex,
}


def _reason(exc: Exception, caught: list) -> str:
    """The backend's own explanation if torch warned one (SDPA warns why it skipped a kernel), else the error."""
    msgs = [str(w.message).splitlines()[0] for w in caught if "kernel" in str(w.message).lower()]
    text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return (" | ".join(msgs[:2]) + " -> " + text)[:300] if msgs else text[:300]


def bench_one(peer: str, case: Case, dtype, warmup: int, rep: int) -> dict:
    from triton.testing import do_bench

    row = {"peer": peer, "case": case.name, "status": "ok", "reason": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn, inputs = MAKERS[peer](case, dtype, torch.device("cuda"))
            out = fn()  # first call: compiles / autotunes, and surfaces "unsupported" before timing
            dout = torch.randn_like(out)
            out.backward(dout)
            fwd = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
            both = do_bench(
                lambda: fn().backward(dout), warmup=warmup, rep=rep, grad_to_none=inputs, return_mode="median"
            )
            out = fn()
            bwd = do_bench(
                lambda: out.backward(dout, retain_graph=True), warmup=warmup, rep=rep, grad_to_none=inputs,
                return_mode="median",
            )
        except torch.OutOfMemoryError as exc:
            return {**row, "status": "OOM", "reason": str(exc).splitlines()[0][:200]}
        except Exception as exc:  # noqa: BLE001 - an unsupported peer is a result ("n/a"), not a crash
            return {**row, "status": "n/a", "reason": _reason(exc, caught)}
        finally:
            torch.cuda.empty_cache()
    f = case.fwd_flops()
    row.update(
        fwd_ms=fwd, bwd_ms=bwd, fwd_bwd_ms=both,
        fwd_tflops=f / fwd / 1e9, bwd_tflops=2.5 * f / bwd / 1e9, fwd_bwd_tflops=3.5 * f / both / 1e9,
        tokens_per_s_fwd_bwd=case.tokens() / (both / 1e3),
    )
    return row


def check_fpatch(case: Case, dtype) -> float | None:
    """max |fpatch - SDPA (default backend)| on the forward, so that a fast wrong kernel cannot pass unnoticed."""
    if case.dropout:
        return None
    import flashpatch

    gen = torch.Generator(device="cuda").manual_seed(0)
    if case.varlen:
        lens = case.doc_lens[:8]  # a few documents, each compared on its own
        worst = 0.0
        total = sum(lens)
        q, k, v = (torch.randn(total, h, case.head_dim, device="cuda", dtype=dtype, generator=gen)
                   for h in (case.heads, case.kv_heads, case.kv_heads))
        cu = flashpatch.padding.cu_seqlens_from_lengths(torch.tensor(lens, device="cuda"))
        out = flashpatch.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        for i in range(len(lens)):
            s = slice(int(cu[i]), int(cu[i + 1]))
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[s].transpose(0, 1)[None], k[s].transpose(0, 1)[None], v[s].transpose(0, 1)[None], is_causal=True,
                enable_gqa=case.kv_heads != case.heads,
            )[0].transpose(0, 1)
            worst = max(worst, (out[s].float() - ref.float()).abs().max().item())
        return worst
    b = min(case.batch, 2)
    q, k, v = (torch.randn(b, case.seqlen, h, case.head_dim, device="cuda", dtype=dtype, generator=gen)
               for h in (case.heads, case.kv_heads, case.kv_heads))
    slopes = alibi_slopes(case.heads, "cuda") if case.alibi else None
    out = flashpatch.flash_attn_func(q, k, v, causal=case.causal, alibi_slopes=slopes)
    bias = alibi_bias(case, dtype, "cuda") if case.alibi else None
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
        is_causal=case.causal and bias is None, enable_gqa=case.kv_heads != case.heads,
    ).transpose(1, 2)
    return (out.float() - ref.float()).abs().max().item()


def markdown_table(rows: list[dict], cases: list[Case]) -> str:
    def cell(r):
        if r is None:
            return "-"
        if r["status"] != "ok":
            return r["status"]
        return f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f} / {r['fwd_bwd_tflops']:.0f}"

    lines = [
        "TFLOP/s as fwd / bwd / fwd+bwd. ratio: fpatch fwd+bwd over the best peer's.",
        "",
        "| case | " + " | ".join(PEERS) + " | ratio |",
        "|---|" + "---|" * (len(PEERS) + 1),
    ]
    for case in cases:
        by_peer = {r["peer"]: r for r in rows if r["case"] == case.name}
        ours = by_peer.get("fpatch")
        peers = [r["fwd_bwd_tflops"] for p, r in by_peer.items() if p != "fpatch" and r["status"] == "ok"]
        ratio = "-"
        if ours and ours["status"] == "ok" and peers:
            ratio = f"{ours['fwd_bwd_tflops'] / max(peers):.2f}x"
        lines.append(f"| {case.name} | " + " | ".join(cell(by_peer.get(p)) for p in PEERS) + f" | {ratio} |")
    return "\n".join(lines)


def write_plot(rows: list[dict], cases: list[Case], path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = [p for p in PEERS if any(r["peer"] == p for r in rows)]  # the peers this run measured
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(cases)), 5))
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        vals = []
        for case in cases:
            r = next((r for r in rows if r["case"] == case.name and r["peer"] == peer), None)
            vals.append(r["fwd_bwd_tflops"] if r and r["status"] == "ok" else 0.0)
        ax.bar([x + (i - len(peers) / 2 + 0.5) * width for x in range(len(cases))], vals, width, label=peer)
    ax.set_xticks(range(len(cases)), [c.name for c in cases], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("fwd+bwd TFLOP/s (0 = n/a)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes (fits a short GPU session)")
    parser.add_argument("--seqlens", default="", help="dense cases' lengths, comma-separated (e.g. 4096,8192,16384; "
                        "any length: 16384 // N rows, e.g. 4000 next to 4096)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--out", default=str(REPO / "results" / "latest"), help="output folder (default: %(default)s)")
    parser.add_argument("--history", default=str(REPO / "results" / "history.csv"),
                        help='CSV that gets one row per figure (default: %(default)s; "" skips it)')
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS))
    parser.add_argument("--match", default="",
                        help="only the cases whose name contains this, or one of its '|'-separated parts "
                             "(e.g. dropout, or 'd256|softcap')")
    parser.add_argument("--kernel_options", default="",
                        help="flashpatch.kernels.options.override arguments for the whole run, as recipes/train.py "
                             "takes them (e.g. persistent_fwd=false,fused_dq=true): an A/B against the defaults, "
                             "its fpatch rows named with them in the history")
    args = parser.parse_args(argv)
    try:
        overrides = kernel_overrides(args.kernel_options)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        print("bench_attention.py measures GPU kernels and needs a CUDA GPU; none is visible here. On CPU the "
              "kernels run in the Triton interpreter, whose timings measure nothing; recipes/train.py checks loss "
              "parity there.", file=sys.stderr)
        return 2
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    try:
        seqlens = tuple(int(n) for n in args.seqlens.split(",") if n.strip())
    except ValueError:
        parser.error(f"--seqlens takes comma-separated integers, got {args.seqlens!r}")
    if any(n < 1 or n > 16384 for n in seqlens):
        parser.error(f"--seqlens must lie in 1..16384 (B = 16384 // N rows, B·N about 16k tokens), got {args.seqlens!r}")
    cases = [c for c in build_cases(args.quick, seqlens or None) if any(m in c.name for m in args.match.split("|"))]
    if not cases:
        parser.error(f"no case name contains --match {args.match!r}")
    gpu = torch.cuda.get_device_name()

    rows, checks = [], {}
    with options.override(**overrides):  # read by every flashpatch call the cases make
        measure_cases(cases, peers, dtype, args.warmup, args.rep, rows, checks)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    report = {
        "gpu": gpu,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flops": "fwd = 4*B*H*Sq*Sk*D (causal /2, varlen: sum over documents); bwd = 2.5x, fwd+bwd = 3.5x",
        "kernel_options": args.kernel_options,
        "cases": [asdict(c) for c in cases],
        "fpatch_max_abs_diff_vs_sdpa": checks,
        "results": rows,
    }
    title = (f"## bench_attention: {gpu}, {args.dtype}{' (quick)' if args.quick else ''}"
             + (f", fpatch with {args.kernel_options}" if args.kernel_options else ""))
    table = markdown_table(rows, cases)
    (out / "bench_attention.json").write_text(json.dumps(report, indent=2))
    (out / "bench_attention.md").write_text(f"{title}\n\n{table}\n")
    write_plot(rows, cases, out / "bench_attention.png", f"{gpu}, {args.dtype}")
    written = [out / f"bench_attention.{ext}" for ext in ("md", "json", "png")]
    appended = append_history(args.history, report)
    print("wrote " + ", ".join(map(str, written)) + (f"; appended to {appended}" if appended else ""), file=sys.stderr)
    print(f"\n{title}\n")
    print(table, flush=True)
    return 0


def _recipe_module(name: str):
    """recipes/<name>.py, imported with recipes/ on the path (its helpers serve the recipes and this benchmark)."""
    if str(REPO / "recipes") not in sys.path:
        sys.path.insert(1, str(REPO / "recipes"))
    return importlib.import_module(name)


def kernel_overrides(text: str) -> dict:
    """--kernel_options text -> options.override's keyword arguments (recipes/train_config.parse_kernel_options's
    syntax), each name checked against flashpatch's options: ValueError or TypeError naming the bad entry."""
    overrides = _recipe_module("train_config").parse_kernel_options(text)
    options.updated(options.DEFAULT, **overrides)  # TypeError naming fields that do not exist
    return overrides


def measure_cases(cases: list, peers: list[str], dtype: torch.dtype, warmup: int, rep: int, rows: list,
                  checks: dict) -> None:
    """Each case against each peer into rows (and fpatch's check against SDPA into checks), a line each on stderr."""
    for case in cases:
        try:
            checks[case.name] = check_fpatch(case, dtype) if "fpatch" in peers else None
        except Exception as exc:  # noqa: BLE001
            checks[case.name] = f"{type(exc).__name__}: {exc}"[:200]
        for peer in peers:
            row = bench_one(peer, case, dtype, warmup, rep)
            rows.append(row)
            tf = f"{row['fwd_bwd_tflops']:.0f} TFLOP/s fwd+bwd" if row["status"] == "ok" else row["reason"]
            print(f"{case.name:34s} {peer:15s} {tf}", file=sys.stderr, flush=True)


def history_figures(report: dict) -> list[tuple[str, str, str, float]]:
    """(case, implementation, metric, value) of every measured cell: fwd, bwd and fwd+bwd TFLOP/s; under
    --kernel_options fpatch is named with them."""
    overrides = report.get("kernel_options", "")

    def implementation(peer: str) -> str:
        return f"{peer} ({overrides})" if overrides and peer == "fpatch" else peer

    return [
        (f"{r['case']} {report['dtype']}", implementation(r["peer"]), metric, r[metric])
        for r in report["results"] if r["status"] == "ok"
        for metric in ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")
    ]


def append_history(path: str, report: dict, **kwargs):
    """Append the report's figures to the CSV at path (recipes/history.py); kwargs: date, commit."""
    history = _recipe_module("history")
    return history.append(path, history.rows(history_figures(report), gpu=report["gpu"],
                                             torch_version=report["torch"], triton_version=report["triton"],
                                             **kwargs))


if __name__ == "__main__":
    sys.exit(main())
