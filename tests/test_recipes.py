"""The recipes' data and reporting, on CPU: corpus, byte tokenizer, batch modes, config parsing, FLOP counting, and a
smoke run of recipes/train.py through `accelerate launch` (the README's main command, shrunk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from flashpatch.corpus import (
    ByteTokenizer,
    balance_padded_batches,
    count_tokens,
    flatten_padded_batch,
    load_default_corpus,
    make_batches,
    stdlib_python_files,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes"))

import measure  # noqa: E402
import report  # noqa: E402
from train_config import parse_config  # noqa: E402

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def corpus():
    return load_default_corpus(max_files=120)


@pytest.fixture(scope="module")
def short_docs():
    # Files up to 2 KB: several documents per packed row and real padding at seq 512.
    return load_default_corpus(max_bytes=400_000, max_file_bytes=2048)


# --- corpus -------------------------------------------------------------------------------------------------------


def test_corpus_is_deterministic_nontrivial_and_varied(corpus):
    again = load_default_corpus(max_files=120)
    assert corpus["path"] == again["path"] and corpus["text"] == again["text"]
    assert len(corpus) == 120
    lengths = np.array([len(t.encode()) for t in corpus["text"]])
    assert lengths.sum() > 200_000  # real source code, not stubs
    assert lengths.min() > 0
    # natural lengths: spread over orders of magnitude, mostly distinct
    assert lengths.max() / np.median(lengths) > 4 and np.median(lengths) / lengths.min() > 4
    assert len(set(lengths.tolist())) > 100
    assert all(p.endswith(".py") and "site-packages" not in p for p in corpus["path"])
    root = Path(sysconfig.get_paths()["stdlib"])
    first = corpus[0]
    assert (root / first["path"]).read_bytes().decode("utf-8", errors="replace") == first["text"]


def test_corpus_caps():
    files = stdlib_python_files(max_bytes=300_000, max_file_bytes=5_000)
    sizes = [p.stat().st_size for p in files]
    assert sum(sizes) <= 300_000 and max(sizes) <= 5_000 and len(files) > 50
    assert stdlib_python_files(max_files=7) == stdlib_python_files(max_files=7)
    assert len(stdlib_python_files(max_files=7)) == 7


def test_load_corpus_from_local_files(tmp_path):
    from flashpatch.corpus import load_corpus

    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(["a = 1\n", "def f():\n    pass\n", "x" * 500]):
        (folder / f"{i}.py").write_text(text)
    ds = load_corpus(str(folder))
    assert ds["text"] == ["a = 1\n", "def f():\n    pass\n", "x" * 500] and ds["path"] == ["0.py", "1.py", "2.py"]
    one = tmp_path / "one.txt"
    one.write_text("line one\nline two\n")
    assert load_corpus(str(one))["text"] == ["line one\nline two\n"]  # a text file is one document


# --- tokenizer ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x  # ok\n", "héllo ✓ 日本語 \U0001f600", "\x00\t\r\n\x7f"])
def test_tokenizer_round_trip(text):
    ids = TOK.encode(text)
    assert ids[0] == TOK.bos_token_id and ids[-1] == TOK.eos_token_id
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert TOK.decode(ids) == text
    assert TOK.encode_np(text).tolist() == ids
    assert TOK.encode_np(text, max_length=3).tolist() == ids[:3]


def test_tokenizer_round_trips_the_corpus(corpus):
    for text in corpus["text"][:20]:
        assert TOK.decode(TOK.encode(text)) == text
    assert len({TOK.bos_token_id, TOK.eos_token_id, TOK.pad_token_id}) == 3
    with pytest.raises(ValueError):
        TOK.decode([TOK.bos_token_id, 65], skip_special_tokens=False)


# --- batches ------------------------------------------------------------------------------------------------------


def _doc_encodings(ds) -> set[tuple[int, ...]]:
    return {tuple(TOK.encode(t)) for t in ds["text"]}


@pytest.mark.parametrize("mode", ["padded", "unpadded"])
def test_padded_batches(short_docs, mode):
    seq_len, bsz = 512, 6
    docs = _doc_encodings(short_docs)
    truncated = {d[:seq_len] for d in docs}
    saw_padding = False
    for batch in make_batches(short_docs, mode, seq_len, bsz, seed=3, num_batches=8):
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        assert ids.shape == mask.shape == labels.shape and ids.shape[0] == bsz and ids.shape[1] <= seq_len
        lengths = mask.sum(1)
        assert ids.shape[1] == int(lengths.max())  # padded to the batch's longest, not to seq_len
        for row in range(bsz):
            n = int(lengths[row])
            assert mask[row, :n].all() and not mask[row, n:].any()  # right padding
            assert tuple(ids[row, :n].tolist()) in truncated  # each row is one document's head
            assert (ids[row, n:] == TOK.pad_token_id).all()
        assert torch.equal(labels == -100, mask == 0) and torch.equal(labels[mask == 1], ids[mask == 1])
        assert count_tokens(batch) == int(mask.sum())
        saw_padding |= count_tokens(batch) < ids.numel()
    assert saw_padding  # natural lengths: pad is real, and not counted


def test_unpadded_is_the_padded_batch(short_docs):
    for a, b in zip(
        make_batches(short_docs, "padded", 256, 4, seed=1, num_batches=3),
        make_batches(short_docs, "unpadded", 256, 4, seed=1, num_batches=3),
    ):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_flatten_padded_batch_keeps_exactly_the_real_tokens(short_docs):
    """The "unpadded" mode's one-row batch: the same tokens, positions restarting per document, no label that
    crosses a document boundary, and the same number of predicted tokens as the padded batch."""
    for batch in make_batches(short_docs, "unpadded", 512, 5, seed=2, num_batches=4):
        flat = flatten_padded_batch(batch)
        lengths = batch["attention_mask"].sum(1).tolist()
        docs = [batch["input_ids"][row, :n] for row, n in enumerate(lengths)]
        assert torch.equal(flat["input_ids"][0], torch.cat(docs))
        assert torch.equal(flat["position_ids"][0], torch.cat([torch.arange(n) for n in lengths]))
        starts = flat["position_ids"][0] == 0
        assert (flat["labels"][0][starts] == -100).all()
        assert torch.equal(flat["labels"][0][~starts], flat["input_ids"][0][~starts])
        cu = flat["cu_seq_lens_q"]
        assert cu.dtype == torch.int32 and cu.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
        assert flat["cu_seq_lens_k"] is cu and flat["max_length_q"] == flat["max_length_k"] == max(lengths)
        # Targets after the model's shift by one: padded sum(n - 1) over rows, flattened the same.
        predicted_padded = int((batch["labels"][:, 1:] != -100).sum())
        assert int((flat["labels"][0, 1:] != -100).sum()) == predicted_padded == sum(n - 1 for n in lengths)


def _rows(batches):
    """The real token rows of padded batches, as sorted tuples (a multiset)."""
    return sorted(tuple(ids[: int(n)].tolist()) for b in batches
                  for ids, n in zip(b["input_ids"], b["attention_mask"].sum(dim=1)))


def _padded(lengths, start=0):
    docs = [np.arange(start + i * 1000, start + i * 1000 + n, dtype=np.int64) % 250 for i, n in enumerate(lengths)]
    from flashpatch.corpus import _padded_batch

    return _padded_batch(docs, TOK.pad_token_id)


def test_balance_padded_batches_deals_rows_by_real_tokens():
    # rank 0 drew the long documents, rank 1 the short ones: 900 against 40 real tokens
    step = [_padded([400, 300, 200]), _padded([20, 10, 10], start=7)]
    dealt = balance_padded_batches(step, TOK.pad_token_id)
    loads = [int(b["attention_mask"].sum()) for b in dealt]
    assert sorted(loads) == [430, 510], loads  # 400 + 20 + 10 and 300 + 200 + 10: the heaviest 900 -> 510
    assert _rows(dealt) == _rows(step)  # the same rows, each once
    for b in dealt:
        assert b["input_ids"].shape[0] == 3  # each rank keeps its row count
        mask = b["attention_mask"].bool()
        assert b["input_ids"].shape[1] == int(mask.sum(1).max())  # padded to its own longest
        assert torch.equal(b["labels"], b["input_ids"].masked_fill(~mask, -100))
        assert (b["input_ids"][~mask] == TOK.pad_token_id).all()
        assert mask.cumsum(1).max(1).values.equal(mask.sum(1))  # right padding


def test_balance_padded_batches_keeps_batches_it_cannot_improve():
    step = [_padded([300, 10]), _padded([290, 20], start=3)]  # 310 and 310: already even
    assert all(a is b for a, b in zip(balance_padded_batches(step, TOK.pad_token_id), step))


def test_balance_padded_batches_refuses_what_is_not_padded_batches(short_docs):
    with pytest.raises(ValueError, match="one padded batch per rank"):
        balance_padded_batches([], TOK.pad_token_id)
    packed = list(make_batches(short_docs, "packed", 64, 2, num_batches=2))  # position_ids, no attention_mask
    with pytest.raises(ValueError, match="position_ids"):
        balance_padded_batches(packed, TOK.pad_token_id)


def test_recipe_batches_balanced_across_ranks(short_docs, monkeypatch):
    # every rank draws every rank's stream and keeps its share: the ranks' rows together are the unbalanced ones,
    # and the heaviest rank's real tokens never grow
    from types import SimpleNamespace

    import flashpatch.corpus as corpus_mod
    import train

    monkeypatch.setattr(corpus_mod, "load_corpus", lambda *a, **k: short_docs)
    cfg = parse_config(["--data_mode", "unpadded", "--seq_len", "512", "--batch_size", "3"])
    world, steps = 3, 4

    def batches(balance: bool, rank: int):
        cfg.balance_ranks = balance
        acc = SimpleNamespace(process_index=rank, num_processes=world)
        return train.recipe_batches(cfg, acc, corpus_mod, TOK, steps)[1]

    plain = [batches(False, r) for r in range(world)]
    dealt = [batches(True, r) for r in range(world)]
    improved = 0
    for step in range(steps):
        before, after = [p[step] for p in plain], [d[step] for d in dealt]
        assert _rows(after) == _rows(before)
        heaviest = [max(int(b["attention_mask"].sum()) for b in bs) for bs in (before, after)]
        assert heaviest[1] <= heaviest[0]
        improved += heaviest[1] < heaviest[0]
    assert improved > 0  # natural lengths: some step was uneven
    assert not train.balanced_ranks(cfg, SimpleNamespace(process_index=0, num_processes=1))


def test_packed_batches(short_docs):
    from transformers.masking_utils import find_packed_sequence_indices

    seq_len, bsz, n = 512, 4, 6
    docs = _doc_encodings(short_docs)
    batches = list(make_batches(short_docs, "packed", seq_len, bsz, seed=0, num_batches=n))
    for batch in batches:
        ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
        assert set(batch) == {"input_ids", "position_ids", "labels"}
        assert ids.shape == pos.shape == labels.shape == (bsz, seq_len)
        assert count_tokens(batch) == bsz * seq_len and not (ids == TOK.pad_token_id).any()  # no pad at all
        assert (pos[:, 0] == 0).all()  # every row starts a (part-)document
        step = torch.diff(pos, dim=1)
        assert ((step == 1) | (pos[:, 1:] == 0)).all()  # +1 inside a document, restart at 0 between
        # a document starts exactly where positions restart (a BOS), apart from a row's carried-over head
        assert torch.equal((ids[:, 1:] == TOK.bos_token_id), (pos[:, 1:] == 0))
        assert torch.equal(labels == -100, pos == 0) and torch.equal(labels[pos > 0], ids[pos > 0])
        assert ((pos == 0).sum(1) > 1).any()  # short docs: several per row
        # transformers segments the rows the same way (that is what eager/sdpa masks are built from)
        segments = find_packed_sequence_indices(pos)
        assert torch.equal(torch.diff(segments, dim=1) != 0, pos[:, 1:] == 0)
    # rows concatenated = whole documents back to back (cut only at row and batch edges)
    stream = torch.cat([b["input_ids"].flatten() for b in batches]).tolist()
    starts = [i for i, t in enumerate(stream) if t == TOK.bos_token_id]
    whole = [tuple(stream[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    assert len(whole) > 8 and all(d in docs for d in whole)


def test_dense_batches(short_docs):
    for batch in make_batches(short_docs, "dense", 128, 2, seed=0, num_batches=3):
        assert set(batch) == {"input_ids", "labels"} and torch.equal(batch["input_ids"], batch["labels"])
        assert batch["input_ids"].shape == (2, 128) and count_tokens(batch) == 256


def test_batches_follow_the_seed(short_docs):
    def take(seed):
        return [b["input_ids"] for b in make_batches(short_docs, "packed", 128, 2, seed=seed, num_batches=3)]

    assert all(torch.equal(a, b) for a, b in zip(take(5), take(5)))
    assert not all(torch.equal(a, b) for a, b in zip(take(5), take(6)))


def test_bad_mode_is_refused(short_docs):
    with pytest.raises(ValueError, match="mode"):
        next(make_batches(short_docs, "ragged", 64, 2))


# --- FLOPs, config, report ----------------------------------------------------------------------------------------


def test_segment_lengths_and_flops():
    padded = {"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    assert measure.segment_lengths(padded) == [3, 5]
    packed = {"input_ids": torch.zeros(1, 6), "position_ids": torch.tensor([[0, 1, 0, 1, 2, 0]])}
    assert measure.segment_lengths(packed) == [2, 3, 1]
    assert measure.segment_lengths({"input_ids": torch.zeros(3, 4)}) == [4, 4, 4]
    # 6·N·T + 3 · (4 · layers · width · ΣL² / 2 for causal)
    assert measure.train_flops(10, 2, 8, [2, 3]) == 6 * 10 * 5 + 3 * (4 * 2 * 8 * 13 / 2)
    assert measure.train_flops(10, 2, 8, [2, 3], causal=False) == 6 * 10 * 5 + 3 * 4 * 2 * 8 * 13
    # frozen (LoRA base) weights: no weight gradient, 4 FLOPs per parameter and token instead of 6
    assert measure.train_flops(10, 2, 8, [2, 3], frozen_params=7) == (6 * 3 + 4 * 7) * 5 + 3 * (4 * 2 * 8 * 13 / 2)


def test_gc_pauses_counts_collections_only_while_entered():
    import gc

    pauses = measure.GcPauses()
    gc.collect()  # outside: not counted
    assert pauses.take() == (0.0, 0)
    with pauses:
        junk = [[i] for i in range(20_000)]  # something for the collector to scan
        gc.collect()  # a full collection
        gc.collect(0)
    gc.collect()
    ms, full = pauses.take()
    assert full == 1 and ms > 0
    assert pauses.take() == (0.0, 0)  # take() starts a new count
    assert pauses._on_collect not in gc.callbacks
    del junk


def test_triton_compiles_counted_only_while_entered_and_reported():
    from triton import knobs

    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw) or False  # a hook already in place (a profiler's)
    try:
        compiles = measure.TritonCompiles()
        with compiles:
            for _ in range(3):  # what Triton calls before each in-process compile
                assert knobs.runtime.jit_cache_hook(key="k", repr="r") is False  # False: compile as usual
        assert compiles.take() == 3 and compiles.take() == 0
        assert len(seen) == 3, "the hook in place still sees every compile"
    finally:
        restored = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = None
    assert restored is not None and restored is not compiles._on_compile
    results = {"results": [
        {"implementation": "sdpa", "triton_compiles": [0, 0], "step_times_ms": [50.0, 51.0]},
        {"implementation": "fpatch", "triton_compiles": [0, 4], "step_times_ms": [40.0, 3386.0]},
    ]}
    (note,) = report.compile_notes(results)
    assert "fpatch" in note and "step 2: 4 kernels, 3,386 ms" in note


def test_config_yaml_and_overrides(tmp_path):
    cfg = parse_config(["--config", str(REPO / "configs" / "tiny_cpu.yaml")])
    assert cfg.name == "tiny_cpu" and cfg.output_dir == os.path.join("runs", "tiny_cpu")
    assert cfg.implementations == ["eager", "sdpa", "fpatch"] and cfg.learning_rate == pytest.approx(1e-3)
    cfg = parse_config(
        ["--config", str(REPO / "configs" / "llama_1b.yaml"), "--seq_len", "4096", "--implementations", "sdpa,fpatch",
         "--gradient_checkpointing", "true", "--attention_dropout", "0.1"]
    )
    assert (cfg.seq_len, cfg.implementations, cfg.gradient_checkpointing, cfg.attention_dropout) == (
        4096, ["sdpa", "fpatch"], True, 0.1)
    for name in ("llama_125m", "padded_real_lengths", "dropout"):
        assert parse_config(["--config", str(REPO / "configs" / f"{name}.yaml")]).name == name
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_lenn: 3\n")
    with pytest.raises(ValueError, match="seq_lenn"):
        parse_config(["--config", str(bad)])
    with pytest.raises(ValueError, match="implementations"):
        parse_config(["--implementations", "eager,flash_attention_2"])
    assert parse_config(["--compile", "reduce-overhead"]).compile == "reduce-overhead"
    with pytest.raises(ValueError, match="'fast'"):
        parse_config(["--compile", "fast"])


def test_kernel_options_parse_and_bad_entries_are_refused():
    import flashpatch
    import train
    from flashpatch.kernels import options
    from train_config import parse_kernel_options

    assert parse_kernel_options("") == {}
    assert parse_kernel_options(" persistent_fwd=false, concurrent_dq=FALSE,register_kv=None,head_group=4,") == {
        "persistent_fwd": False, "concurrent_dq": False, "register_kv": None, "head_group": 4}
    cfg = parse_config(["--kernel_options", "persistent_fwd=true,concurrent_dq=false"])
    assert cfg.kernel_options == "persistent_fwd=true,concurrent_dq=false"
    for bad, named in (("persistent_fwd=maybe", "'persistent_fwd=maybe'"), ("persistent_fwd", "'persistent_fwd'"),
                       ("head_group=4,head_group=2", "'head_group'"), ("=true", "'=true'")):
        with pytest.raises(ValueError, match=f"kernel_options: {named}"):
            parse_config(["--kernel_options", bad])

    # The names are checked against flashpatch's options before the run; the override holds for the whole block.
    context, kwargs = train.kernel_options(parse_config(["--kernel_options", "persistent_fwd=false"]), flashpatch)
    with context:
        assert options.current().persistent_fwd is False and kwargs == {"persistent_fwd": False}
    assert options.current() == options.DEFAULT
    with pytest.raises(TypeError, match="kernel_options 'persistent_fw=false'.*persistent_fw"):
        train.kernel_options(parse_config(["--kernel_options", "persistent_fw=false"]), flashpatch)
    with pytest.raises(ValueError, match="kernel_options 'head_group=-1'"):
        train.kernel_options(parse_config(["--kernel_options", "head_group=-1"]), flashpatch)
    assert train.kernel_options(parse_config([]), flashpatch)[1] == {}


def test_oom_is_a_result_and_the_next_implementation_runs(monkeypatch, short_docs):
    import train
    from accelerate import Accelerator

    cfg = parse_config(["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--steps", "2", "--warmup_steps", "1",
                        "--hidden_size", "32", "--num_heads", "2", "--num_kv_heads", "1", "--seq_len", "32"])
    accelerator = Accelerator(cpu=True)
    batches = list(make_batches(short_docs, "packed", 32, 2, seed=0, num_batches=3))
    real_train_one = train.train_one

    def oom_for_eager(impl, *args):
        if impl == "eager":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real_train_one(impl, *args)

    monkeypatch.setattr(train, "train_one", oom_for_eager)
    rows = [train.run_implementation(i, cfg, accelerator, batches, TOK, None) for i in ("eager", "sdpa")]
    rows.append(train.run_implementation("fpatch", cfg, accelerator, batches, TOK, "import flashpatch failed: X"))
    assert rows[0]["status"] == "OOM" and "out of memory" in rows[0]["reason"]
    assert rows[1]["status"] == "ok" and len(rows[1]["losses"]) == 3 and rows[1]["tokens_per_s"] > 0
    assert rows[2]["status"] == "skipped" and "import flashpatch failed" in rows[2]["reason"]
    fake = {"config": {"name": "t", "warmup_steps": 1}, "environment": {"device_type": "cpu"}, "results": rows}
    table = report.markdown_table(fake)
    assert "| eager | OOM: CUDA out of memory" in table and "| sdpa | ok |" in table and "| fpatch | skipped" in table


def test_padded_warm_up_runs_full_rows_and_takes_no_step(monkeypatch, short_docs):
    # train.warm_full_rows: a forward + backward with every row taken as full (the dense kernels a batch without
    # padding runs), then no optimizer step and no gradients left; once per implementation, in its warm-up
    import train
    from accelerate import Accelerator

    cfg = parse_config(["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--steps", "1", "--warmup_steps", "1",
                        "--hidden_size", "32", "--num_heads", "2", "--num_kv_heads", "1", "--seq_len", "256",
                        "--data_mode", "padded"])
    accelerator = Accelerator(cpu=True)
    batches = list(make_batches(short_docs, "padded", 256, 4, seed=0, num_batches=2))
    assert not bool(batches[0]["attention_mask"].all()), "the test needs a batch with padding"
    model, optimizer, _ = train.build_training("sdpa", cfg, accelerator, TOK)
    masks = []
    model.register_forward_pre_hook(lambda module, args, kwargs: masks.append(kwargs["attention_mask"].clone()),
                                    with_kwargs=True)
    before = [p.detach().clone() for p in model.parameters()]
    batch_dev = train.device_inputs("sdpa", cfg, batches[0], accelerator.device)
    train.warm_full_rows(model, optimizer, accelerator, cfg, batch_dev)
    assert len(masks) == 1 and bool(masks[0].all()) and masks[0].shape == batches[0]["attention_mask"].shape
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    packed = parse_config(["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--data_mode", "packed"])
    train.warm_full_rows(model, optimizer, accelerator, packed, batch_dev)
    assert len(masks) == 1  # other data modes have no padded rows to stand in for

    calls = []
    monkeypatch.setattr(train, "warm_full_rows", lambda *args: calls.append(args[-1]["attention_mask"]))
    train.run_implementation("sdpa", cfg, accelerator, batches, TOK, None)
    assert len(calls) == 1 and torch.equal(calls[0], batches[0]["attention_mask"])


# --- the recipe end to end ----------------------------------------------------------------------------------------


def run_train(tmp_path, config: str, *args: str, timeout: int = 240):
    """`accelerate launch` of recipes/train.py on CPU with configs/<config>.yaml and `args`; returns the finished
    process (checked to have succeeded) and its results.json."""
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs/accelerate/cpu.yaml"),
        str(REPO / "recipes" / "train.py"), "--config", str(REPO / "configs" / f"{config}.yaml"), *args,
        "--output_dir", str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)  # train.py must set it by itself when there is no CUDA
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "results.json").read_text())


def test_train_smoke_run(tmp_path):
    """`accelerate launch recipes/train.py` with eager, sdpa and fpatch (Triton interpreter) on a tiny model."""
    proc, res = run_train(
        tmp_path, "tiny_cpu", "--implementations", "eager,sdpa,fpatch", "--seq_len", "64", "--batch_size", "2",
        "--steps", "2", "--warmup_steps", "1", "--hidden_size", "32", "--num_heads", "2", "--num_kv_heads", "1",
        "--intermediate_size", "64", "--corpus_max_bytes", "300000")
    out = tmp_path / "run"

    assert res["environment"]["device_type"] == "cpu" and res["environment"]["triton_interpret"] == "1"
    assert res["config"]["data_mode"] == "packed" and res["config"]["seq_len"] == 64
    assert res["config"]["kernel_options"] == "" and res["environment"]["kernel_options"] == {}
    rows = {r["implementation"]: r for r in res["results"]}
    assert list(rows) == ["eager", "sdpa", "fpatch"]
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["attn_implementation"] == r["implementation"]
        assert len(r["losses"]) == 3 and r["measured_steps"] == 2 and len(r["step_times_ms"]) == 2
        assert len(r["gc_ms"]) == 2 and r["gc_full_collections"] >= 0
        assert r["real_tokens"] == r["padded_tokens"] == 2 * 2 * 64  # packed: every token is real
        assert r["tokens_per_s"] > 0 and r["mfu"] is None and r["peak_rss_gib"][0] > 0
    # same init, same batches: eager and sdpa agree tightly in fp32, fpatch (varlen kernel, interpreted) closely
    for impl in ("sdpa", "fpatch"):
        np.testing.assert_allclose(rows[impl]["losses"], rows["eager"]["losses"], rtol=1e-4)
    assert rows["eager"]["losses"][-1] < rows["eager"]["losses"][0]  # it trains
    for png in ("throughput.png", "memory.png", "loss.png"):
        assert (out / png).stat().st_size > 5_000

    assert res["loss_parity"]["reference"] == "eager"
    assert res["loss_parity"]["max_abs_diff"]["fpatch"] < 1e-3

    # on CPU the result is loss parity, and the table says why no speed is shown
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines[-5].startswith("| implementation | status | final loss | max abs loss diff vs eager")
    assert lines[-4].startswith("|---|")  # the table is the last thing on stdout
    assert [line.split("|")[1].strip() for line in lines[-3:]] == ["eager", "sdpa", "fpatch"]
    assert "Triton interpreter, whose timings measure nothing" in lines[-6]
    assert "tokens/s" not in lines[-5] and "x |" not in proc.stdout  # no "0.00x sdpa" ratios


def test_lora_recipe_trains_only_the_adapters(tmp_path):
    """`--lora_rank`: PEFT LoRA adapters on a Qwen2 model; sdpa and fpatch train the same adapters to the same
    losses, and the report counts the frozen base weights."""
    _, res = run_train(
        tmp_path, "tiny_cpu", "--implementations", "sdpa,fpatch", "--model_family", "qwen2", "--lora_rank", "4",
        "--lora_targets", "q_proj,v_proj,down_proj", "--data_mode", "padded", "--seq_len", "48", "--batch_size", "2",
        "--steps", "2", "--warmup_steps", "1", "--hidden_size", "32", "--num_heads", "2", "--num_kv_heads", "1",
        "--intermediate_size", "64", "--corpus_max_bytes", "300000", "--plots", "false")
    rows = {r["implementation"]: r for r in res["results"]}
    for r in rows.values():
        assert r["status"] == "ok", r
        # everything but the adapters is frozen: the adapters are a few percent of the weights here
        assert 0 < r["n_matmul_params"] - r["frozen_matmul_params"] < 0.1 * r["n_matmul_params"]
    np.testing.assert_allclose(rows["fpatch"]["losses"], rows["sdpa"]["losses"], rtol=1e-4)
    with pytest.raises(ValueError, match="lora_rank"):
        parse_config(["--lora_rank", "-1"])


@pytest.mark.parametrize("config", ["gemma2_1b", "mistral_window_1b"])
def test_window_and_softcap_configs_train_like_eager(config, tmp_path):
    """The Gemma-2-style (softcap, alternating windows) and Mistral-style (sliding window) configs, shrunk to toy size
    with a window shorter than the rows: fpatch trains to eager's losses."""
    _, res = run_train(
        tmp_path, config, "--implementations", "eager,fpatch", "--seq_len", "48", "--sliding_window", "16",
        "--batch_size", "2", "--steps", "2", "--warmup_steps", "1", "--hidden_size", "32", "--num_layers", "2",
        "--num_heads", "2", "--num_kv_heads", "1", "--head_dim", "16", "--intermediate_size", "64",
        "--gradient_checkpointing", "false", "--mixed_precision", "no", "--corpus_max_bytes", "300000",
        "--plots", "false", timeout=300)
    rows = {r["implementation"]: r for r in res["results"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    np.testing.assert_allclose(rows["fpatch"]["losses"], rows["eager"]["losses"], rtol=1e-4)


def _fake_report(device_type: str, interpret: str | None = None) -> dict:
    rows = [
        {"implementation": "eager", "status": "ok", "losses": [5.0, 4.0, 3.0], "final_loss": 3.0,
         "tokens_per_s": 30000.0, "step_time_ms": 10.0, "step_time_ms_median": 10.0, "peak_rss_gib": [0.5],
         "peak_allocated_gib": [1.0], "peak_reserved_gib": [1.5]},
        {"implementation": "sdpa", "status": "ok", "losses": [5.0, 4.0, 3.0], "final_loss": 3.0,
         "tokens_per_s": 40000.0, "step_time_ms": 8.0, "step_time_ms_median": 8.0, "peak_rss_gib": [0.5],
         "peak_allocated_gib": [1.0], "peak_reserved_gib": [1.25]},
        {"implementation": "fpatch", "status": "ok", "losses": [5.0, 4.0002, 3.0001], "final_loss": 3.0001,
         "tokens_per_s": 50.0, "step_time_ms": 8000.0, "step_time_ms_median": 8000.0, "peak_rss_gib": [0.5],
         "peak_allocated_gib": [0.9, 0.95], "peak_reserved_gib": [1.2, 1.3]},
        {"implementation": "flex_attention", "status": "skipped", "reason": "no dropout"},
    ]
    return {"config": {"name": "t", "warmup_steps": 1, "steps": 2, "data_mode": "packed", "seq_len": 64,
                       "batch_size": 2, "compile": ""},
            "environment": {"device_type": device_type, "device_name": "NVIDIA H100 80GB HBM3" if device_type ==
                            "cuda" else "x86_64", "world_size": 2, "mixed_precision": "bf16",
                            "triton_interpret": interpret, "torch": "2.11.0+cu130", "triton": "3.6.0"},
            "results": rows}


def test_cpu_report_is_loss_parity_and_plots_stay_readable(tmp_path):
    fake = _fake_report("cpu", "1")
    assert not report.measures_speed(fake) and not report.measures_speed(_fake_report("cuda", "1"))
    parity = report.loss_parity(fake)
    assert parity["reference"] == "eager"
    assert parity["max_abs_diff"]["sdpa"] == 0.0 and parity["max_abs_diff"]["fpatch"] == pytest.approx(2e-4)
    assert parity["max_abs_diff"]["flex_attention"] is None
    table = report.markdown_table(fake)
    assert "| fpatch | ok | 3.0001 | 2.00e-04 | 0.50 |" in table and "| eager | ok | 3.0000 | (reference) |" in table
    assert "| flex_attention | skipped: no dropout |" in table
    assert "tokens/s |" not in table and "measure nothing" in table
    assert report.append_history(fake, str(tmp_path / "h.csv")) is None and not (tmp_path / "h.csv").exists()
    paths = report.write_plots(fake, tmp_path)  # tiny fpatch bar (log scale), coinciding loss curves
    assert [p.name for p in paths] == ["throughput.png", "memory.png", "loss.png"]
    assert all(p.stat().st_size > 5_000 for p in paths)


def test_gpu_report_appends_history_rows(tmp_path):
    import csv

    import history

    fake = _fake_report("cuda")
    assert report.measures_speed(fake) and "| implementation | status | tokens/s" in report.markdown_table(fake)
    path = tmp_path / "history.csv"
    for _ in range(2):  # the header once, the rows each time
        assert report.append_history(fake, str(path), date="2026-01-02", commit="abc1234") == path
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == list(history.COLUMNS) and len(rows) == 2 * 3 * 4  # 3 ok implementations x 4 metrics
    fp = {r["metric"]: r for r in rows[:12] if r["implementation"] == "fpatch"}
    assert fp["tokens_per_s"]["value"] == "50" and fp["peak_allocated_gib"]["value"] == "0.95"
    assert fp["tokens_per_s"]["case"] == "t packed seq 64 batch 2x2 bf16"
    assert [r["value"] for r in rows if r["metric"] == "tokens_per_s"][:2] == ["30000", "40000"]
    assert (fp["tokens_per_s"]["date"], fp["tokens_per_s"]["commit"], fp["tokens_per_s"]["gpu"],
            fp["tokens_per_s"]["torch"], fp["tokens_per_s"]["triton"]) == (
        "2026-01-02", "abc1234", "NVIDIA H100 80GB HBM3", "2.11.0+cu130", "3.6.0")
    assert report.append_history(fake, "") is None  # FLASHPATCH_HISTORY="" turns it off
    fake["config"]["kernel_options"] = "concurrent_dq=false"
    fake["environment"]["kernel_options"] = {"concurrent_dq": False}
    assert report.history_case(fake) == "t packed seq 64 batch 2x2 bf16 kernel_options concurrent_dq=false"
    for distributed, name in (("DistributedType.FSDP", "fsdp"), ("DistributedType.MULTI_GPU", "ddp")):
        fake["environment"]["distributed_type"] = distributed  # the ranks' split named: DDP and FSDP2 rows apart
        assert report.history_case(fake).startswith(f"t packed seq 64 batch 2x2 {name} bf16 ")
    fake["environment"]["balanced_ranks"] = True  # padded rows dealt across the ranks: a case of its own
    assert report.history_case(fake).startswith("t packed seq 64 batch 2x2 ddp balanced bf16 ")


def test_bench_attention_history_rows(tmp_path):
    import csv

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_attention

    fake = {"gpu": "NVIDIA H100 80GB HBM3", "dtype": "bf16", "torch": "2.11.0+cu130", "triton": "3.6.0", "results": [
        {"peer": "fpatch", "case": "d128 causal N=4096", "status": "ok", "fwd_tflops": 558.84, "bwd_tflops": 466.1,
         "fwd_bwd_tflops": 477.2},
        {"peer": "flex", "case": "d128 causal dropout0.1 N=2048", "status": "n/a", "reason": "no dropout"},
    ]}
    path = bench_attention.append_history(str(tmp_path / "h.csv"), fake, date="2026-11-27", commit="3bb085d")
    rows = list(csv.DictReader(path.open()))
    assert [(r["case"], r["implementation"], r["metric"], r["value"]) for r in rows] == [
        ("d128 causal N=4096 bf16", "fpatch", "fwd_tflops", "558.8"),
        ("d128 causal N=4096 bf16", "fpatch", "bwd_tflops", "466.1"),
        ("d128 causal N=4096 bf16", "fpatch", "fwd_bwd_tflops", "477.2"),
    ]
    # an A/B run's fpatch rows carry its kernel options; the peers' do not
    fake["kernel_options"] = "persistent_fwd=false"
    fake["results"].append({**fake["results"][0], "peer": "sdpa_cudnn"})
    rows = list(csv.DictReader(bench_attention.append_history(str(tmp_path / "ab.csv"), fake).open()))
    assert sorted({r["implementation"] for r in rows}) == ["fpatch (persistent_fwd=false)", "sdpa_cudnn"]
    assert bench_attention.kernel_overrides("persistent_fwd=false,fused_dq=true") == {"persistent_fwd": False,
                                                                                       "fused_dq": True}
    for bad in ("persistent_fwd", "no_such_option=true", "persistent_fwd=maybe"):
        with pytest.raises(SystemExit):  # argparse's error, naming the entry, before any GPU is asked for
            bench_attention.main(["--kernel_options", bad])
    if not torch.cuda.is_available():
        assert bench_attention.main(["--quick"]) == 2  # GPU only: a clear refusal here
