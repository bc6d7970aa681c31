"""Values derived from a tensor, remembered while that very tensor comes back unchanged.

A model hands the same small tensors (padding mask, cu_seqlens) to every layer, and deriving anything from their
values (unpadding indices, the longest sequence, a validity check) is a host sync. `once_per_tensor` computes
such a value once per tensor, keyed by identity and version counter: a tensor written in place gets a new version
and is derived again, and a new tensor that lands at a freed one's address is told apart by a weak reference.
"""

from __future__ import annotations

import weakref
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
_MAX_TENSORS = 8  # a forward uses a few (a mask, cu_seqlens_q and _k); older ones are dropped
_MEMO: dict[int, tuple[weakref.ref, int, dict]] = {}  # id(tensor) -> (weak ref, version, {key: value})


@torch.compiler.disable
def once_per_tensor(tensor: torch.Tensor, key: tuple, compute: Callable[[], T]) -> T:
    """compute(), reused while the same tensor, not modified in place, comes back with the same key. Never
    reused for inference tensors (they keep no version counter). A compute() that raises leaves nothing behind, so
    a failed check fails again next time.

    Run eagerly under torch.compile (what it computes depends on tensor values: unpadding indices, document
    bounds), so a compiled model still derives them once per forward, not once per layer; traced, each call site's
    `compute` would be a guard of its own and recompile this function."""
    try:
        version = tensor._version
    except RuntimeError:  # inference tensors keep no version counter
        version = None
    if version is None:
        return compute()
    entry = _MEMO.get(id(tensor))
    if entry is None or entry[0]() is not tensor or entry[1] != version:
        if len(_MEMO) >= _MAX_TENSORS:
            _MEMO.clear()
        entry = _MEMO[id(tensor)] = (weakref.ref(tensor), version, {})
    derived = entry[2]
    if key not in derived:
        derived[key] = compute()
    return derived[key]
