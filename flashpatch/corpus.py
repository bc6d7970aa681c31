"""The default corpus for recipes and parity tests: text every machine has, no download.

Documents are the Python standard library's own ``.py`` files, one file = one document, so lengths are natural and
spread widely (on CPython 3.11: 5% under 71 bytes, median ~6.5 KB, 5% over 75 KB): padding waste in a padded batch is
real, not simulated. Tokens are bytes (``ByteTokenizer``), so nothing is trained or fetched either.

Public surface:
    load_default_corpus(max_files=None, max_bytes=8_000_000, max_file_bytes=None) -> Dataset   columns: text, path
    load_corpus(source)        -> datasets.Dataset   "stdlib" | a local dir/file | a hub dataset name
    ByteTokenizer()            bytes 0-255, then BOS, EOS, PAD
    make_batches(dataset, mode, seq_len, batch_size, seed) -> iterator of dicts of torch tensors
        mode "padded" / "unpadded": right-padded to the batch's longest document, attention_mask, labels (-100 on pad)
        mode "packed": rows of exactly seq_len, position_ids restarting at 0 per document, labels -100 at each
                       document start (DataCollatorWithFlattening's convention), no attention_mask.
        mode "dense":  rows of exactly seq_len cut from the same document stream, plain causal attention across
                       document boundaries (GPT-style pretraining): no mask, no position_ids, every attention path fast.

The corpus depends on the interpreter's stdlib, so it is deterministic per Python version, not across versions.
`datasets` is imported inside functions: importing flashpatch must not pay for it.
"""

from __future__ import annotations

import hashlib
import itertools
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

BATCH_MODES = ("padded", "packed", "unpadded", "dense")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # installed packages differ between machines


def stdlib_python_files(
    max_files: int | None = None, max_bytes: int | None = None, max_file_bytes: int | None = None
) -> list[Path]:
    """The stdlib's .py files in a deterministic order, capped by count and total size.

    max_file_bytes keeps only files up to that size: tiny CPU runs (seq_len 64-128) then still see several
    documents per packed row and real padding in padded batches.

    Order is by SHA-256 of the path relative to the stdlib root: stable across runs and machines with the same
    Python, and a capped prefix samples the whole library instead of the alphabetically first packages.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts) and p.is_file()]
    files.sort(key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest())
    chosen, total = [], 0
    for p in files:
        size = p.stat().st_size
        if size == 0 or (max_file_bytes is not None and size > max_file_bytes):
            continue  # empty __init__.py files are not documents
        if max_bytes is not None and total + size > max_bytes:
            continue  # skip this one, a smaller file later may still fit
        chosen.append(p)
        total += size
        if max_files is not None and len(chosen) >= max_files:
            break
    return chosen


def load_default_corpus(
    max_files: int | None = None, max_bytes: int | None = 8_000_000, max_file_bytes: int | None = None
):
    """The stdlib corpus as a `datasets.Dataset` with columns `text` (the file, UTF-8) and `path` (relative)."""
    from datasets import Dataset

    root = Path(sysconfig.get_paths()["stdlib"])
    paths = stdlib_python_files(max_files, max_bytes, max_file_bytes)
    if not paths:
        raise RuntimeError(f"no .py files found under the stdlib at {root}")
    # errors="replace": a few test files are Latin-1 on purpose; Arrow strings must be valid UTF-8.
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in paths]
    return Dataset.from_dict({"text": texts, "path": [p.relative_to(root).as_posix() for p in paths]})


def load_corpus(source: str = "stdlib", split: str = "train", text_column: str = "text", **stdlib_kwargs):
    """`--dataset` for the recipes: "stdlib" (default), a local folder of text files, a local data file
    (.txt/.json/.jsonl/.csv/.parquet), or a hub dataset name (only where the machine reaches the hub).
    Returns a Dataset with a `text` column."""
    if source == "stdlib":
        return load_default_corpus(**stdlib_kwargs)
    from datasets import Dataset, load_dataset

    path = Path(source)
    if path.is_dir():
        # A folder: every file is one document, like the stdlib corpus.
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        texts = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
        return Dataset.from_dict({"text": texts, "path": [p.relative_to(path).as_posix() for p in files]})
    if path.is_file():
        suffix = path.suffix.lstrip(".")
        builder = {"txt": "text", "jsonl": "json"}.get(suffix, suffix)
        extra = {"sample_by": "document"} if builder == "text" else {}
        ds = load_dataset(builder, data_files=str(path), split="train", **extra)
    else:
        ds = load_dataset(source, split=split)
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    return ds


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are the bytes, then BOS=256, EOS=257, PAD=258 (vocab_size 259).

    Needs no vocabulary file and no training, is exactly invertible on valid UTF-8, and costs one `encode()` call per
    document. Models built for it should round their embedding up (e.g. to 320) for tensor-core friendly shapes.
    """

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids, self.eos_token_id] if add_special_tokens else ids

    def encode_np(self, text: str, max_length: int | None = None) -> np.ndarray:
        """BOS + bytes + EOS as int64, truncated to max_length: the fast path used by make_batches."""
        body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        ids = np.concatenate([[self.bos_token_id], body, [self.eos_token_id]])
        return ids[:max_length] if max_length is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if not skip_special_tokens and any(i > 255 for i in ids):
            raise ValueError("special tokens have no byte form; decode with skip_special_tokens=True")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _document_stream(texts: list[str], seed: int) -> Iterator[int]:
    """Document indices, reshuffled each epoch from (seed, epoch): every run with the same seed sees the same order."""
    for epoch in itertools.count():
        yield from np.random.default_rng([seed, epoch]).permutation(len(texts)).tolist()


def _padded_batch(docs: list[np.ndarray], pad_id: int) -> dict[str, torch.Tensor]:
    longest = max(len(d) for d in docs)
    input_ids = torch.full((len(docs), longest), pad_id, dtype=torch.long)  # (B, L), right padding
    attention_mask = torch.zeros((len(docs), longest), dtype=torch.long)
    for row, d in enumerate(docs):
        input_ids[row, : len(d)] = torch.from_numpy(d)
        attention_mask[row, : len(d)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # the model shifts labels itself
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_batches(
    dataset,
    mode: str,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    tokenizer: ByteTokenizer | None = None,
    num_batches: int | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Training batches from a Dataset with a `text` column; endless (cycling epochs) unless num_batches is given.

    padded / unpadded: (B, L) with L = the longest document in the batch (each truncated to seq_len), right padding,
        attention_mask, labels = input_ids with -100 on pad. The two modes yield the same tensors; they differ in
        how recipes/train.py feeds them to flashpatch. "padded": as they are (the patched attention unpads each
        layer's q/k/v into its varlen kernel, the rest of the model still computes on the pad). "unpadded": through
        `flatten_padded_batch`, one row of real tokens with varlen kwargs, so no layer computes on padding (what
        transformers' DataCollatorWithFlattening gives flash-attention models). Eager and sdpa run them padded.
    packed: (B, seq_len), documents (BOS ... EOS) concatenated and cut into rows; a document cut at a row end goes on
        at the next row's start, where its positions restart at 0 too. position_ids restart at 0 at every document
        start (transformers builds a block-diagonal causal mask from them for eager/sdpa; flashpatch goes varlen),
        labels are -100 at each document's first token so no document predicts across a boundary, and every
        token is real (no pad, no attention_mask).
    dense: (B, seq_len) like packed, but only input_ids and labels: each row is one causal sequence that may cross
        document boundaries (the BOS/EOS bytes mark them), the layout of ordinary pretraining.
    """
    if mode not in BATCH_MODES:
        raise ValueError(f"mode must be one of {BATCH_MODES}, got {mode!r}")
    if seq_len < 2 or batch_size < 1:
        raise ValueError("need seq_len >= 2 and batch_size >= 1")
    tok = tokenizer or ByteTokenizer()
    texts = dataset["text"]  # materialized once: the corpus is a few MB
    if len(texts) == 0:
        raise ValueError("empty dataset")
    docs = _document_stream(texts, seed)
    batches = itertools.count() if num_batches is None else range(num_batches)

    if mode in ("padded", "unpadded"):
        for _ in batches:
            rows = [tok.encode_np(texts[next(docs)], seq_len) for _ in range(batch_size)]
            yield _padded_batch(rows, tok.pad_token_id)
        return

    # packed / dense: a buffer of tokens and their positions; refill document by document.
    ids_buf, pos_buf = np.empty(0, np.int64), np.empty(0, np.int64)
    need = batch_size * seq_len
    for _ in batches:
        ids_parts, pos_parts = [ids_buf], [pos_buf]
        have = len(ids_buf)
        while have < need:
            d = tok.encode_np(texts[next(docs)])
            ids_parts.append(d)
            pos_parts.append(np.arange(len(d), dtype=np.int64))
            have += len(d)
        ids_all, pos_all = np.concatenate(ids_parts), np.concatenate(pos_parts)
        ids_buf, pos_buf = ids_all[need:], pos_all[need:]
        if len(pos_buf):
            pos_buf = pos_buf - pos_buf[0]  # the carried-over tail starts the next row as its own document
        input_ids = torch.from_numpy(ids_all[:need].reshape(batch_size, seq_len).copy())  # (B, S)
        position_ids = torch.from_numpy(pos_all[:need].reshape(batch_size, seq_len).copy())  # (B, S)
        # Each row's first token starts a (part-)document: restart its positions there so rows are independent.
        position_ids = _restart_rows(position_ids)
        if mode == "dense":
            yield {"input_ids": input_ids, "labels": input_ids.clone()}
            continue
        labels = input_ids.masked_fill(position_ids == 0, -100)
        yield {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def balance_padded_batches(step: list[dict[str, torch.Tensor]], pad_id: int) -> list[dict[str, torch.Tensor]]:
    """One step's padded batches (`make_batches`: right padding with pad_id, labels -100 on it) of every
    data-parallel rank, in rank order -> the same rows dealt again so that the ranks' real-token counts are near
    equal, each batch keeping its number of rows and padded to its own longest.

    Padding-free attention makes a rank's work follow its real tokens, and a data-parallel step waits for the rank
    with the most. The rows go longest first, each to the batch with the fewest tokens among those with room left;
    where that deal's heaviest batch would be no lighter than the given heaviest, the given batches stay."""
    if not step or any(set(b) != {"input_ids", "attention_mask", "labels"} for b in step):
        raise ValueError("balance_padded_batches takes one padded batch per rank (input_ids, attention_mask, labels), "
                         f"got {[sorted(b) for b in step]}")
    sizes = [b["input_ids"].shape[0] for b in step]
    rows = [(ids[: int(n)].numpy(), int(n)) for b in step
            for ids, n in zip(b["input_ids"], b["attention_mask"].sum(dim=1))]
    order = sorted(range(len(rows)), key=lambda i: -rows[i][1])  # longest first (stable: ties in rank order)
    dealt = [[] for _ in step]
    loads = [0] * len(step)
    for i in order:
        rank = min((r for r in range(len(step)) if len(dealt[r]) < sizes[r]), key=lambda r: loads[r])
        dealt[rank].append(rows[i][0])
        loads[rank] += rows[i][1]
    if max(loads) >= max(int(b["attention_mask"].sum()) for b in step):
        return list(step)
    return [_padded_batch(docs, pad_id) for docs in dealt]


def flatten_padded_batch(batch: dict[str, torch.Tensor]) -> dict:
    """A padded batch -> the same documents as one row of real tokens, for varlen attention (no padding at all).

    Returns input_ids, position_ids (restarting at 0 per document) and labels, each (1, T) with T the real tokens,
    plus transformers' packed-sequence kwargs: cu_seq_lens_q / cu_seq_lens_k (int32, documents + 1) and
    max_length_q / max_length_k (ints). Each document's first label becomes -100, so no document predicts across a
    boundary: the loss covers exactly the tokens the padded batch's loss covers.
    """
    mask = batch["attention_mask"].bool()  # (B, L)
    lengths = mask.sum(dim=1)  # (B,)
    positions = (mask.cumsum(dim=1) - 1)[mask]  # (T,): 0 .. length - 1 per row; works for left padding too
    labels = batch["labels"][mask].clone()
    labels[positions == 0] = -100
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    longest = int(lengths.max()) if lengths.numel() else 0
    return {
        "input_ids": batch["input_ids"][mask][None],
        "position_ids": positions[None],
        "labels": labels[None],
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def _restart_rows(position_ids: torch.Tensor) -> torch.Tensor:
    """Shift the positions of the document that a row starts in the middle of so that they begin at 0."""
    out = position_ids.clone()  # (B, S)
    for row in range(out.shape[0]):
        first = int(out[row, 0])
        if first != 0:
            zeros = (out[row] == 0).nonzero()
            end = int(zeros[0]) if len(zeros) else out.shape[1]  # where the next whole document starts
            out[row, :end] -= first
    return out


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-pad) tokens in a batch from make_batches: what tokens/s counts."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()
