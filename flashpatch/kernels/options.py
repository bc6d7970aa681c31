"""The kernels' run-time switches as one frozen value, and the one way to change them for a block of code.

    from flashpatch.kernels import options

    with options.override(persistent_fwd=False, atomic_dq=True):
        out = flashpatch.flash_attn_func(q, k, v)  # every launch in the block runs with these

`override` takes the fields of `KernelOptions` below, and the fields of config.KernelConfigs (the tiles and kernel
choices that config.py picks per head dim and case), which then replace config's pick in every call. `current()`
is the value in force: ops.py reads it once a call and passes it to what it launches. The defaults are what measured
fastest (docs/tuning.md, by topic); the other values serve the tests that check each form against the reference and
the maintainers' timing tools (tools/gluon_check.py). The value belongs to the process, not to a thread: the autograd
engine runs a backward on threads of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from flashpatch.kernels.config import KernelConfigs


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Switches of the kernels' forms that config.py does not pick per call. None: the rule named beside it."""

    # The Gluon forward as a persistent grid (one program per SM, taking query blocks in turn; on a varlen batch by
    # tickets) or as one program per query block; None: config.persistent_grid (persistent at head dim 128, at 64 on
    # causal rows of up to 4096, and on varlen batches at 64 and 128), with or without dropout. Head dim 256 always
    # runs per block (no room for two Q buffers of 256 columns).
    persistent_fwd: bool | None = None
    # The same for the Gluon dQ; None: config.persistent_grid (rows of at most 8 query blocks, not beside dK/dV).
    persistent_dq: bool | None = None
    # A persistent causal forward's blocks dealt out by schedule.causal_schedule's table (head groups kept together
    # for L2, the load balanced), or with False by sm90.common.persistent_tile's closed form over all heads (what a
    # CUDA graph capture that finds no table built runs; the same results, tile for tile).
    causal_schedule: bool = True
    # The Gluon dK/dV holding K and V in registers as matmul operands; None: sm90.dkdv.register_kv (head dim 64).
    register_kv: bool | None = None
    # The Gluon dK/dV's worker consumer setmaxnreg count; None: sm90.dkdv.consumer_registers.
    dkdv_consumer_registers: int | None = None
    # The Gluon dK/dV storing dK and dV through shared memory and TMA stores (key blocks inside the sequence).
    dkdv_store_tma: bool = True
    # The order of every 1-D grid, heads in groups of this many (0: all in one group); None: config.head_group.
    head_group: int | None = None
    # A varlen grid's sequences longest first (ops.varlen_blocks), or with False in batch order.
    varlen_longest_first: bool = True
    # Launches through launch.launch's cache of compiled kernels per argument signature (Triton's binder runs once
    # per signature), or with False through Triton's own path every time.
    cached_launch: bool = True
    # Every launch that ops.py's per-call plan keys by its call signature (launch.launch's `site`) also builds the
    # argument key and checks that it matches the one the site was cached with: a test aid, it costs the host time
    # the site saves.
    verify_launch_sites: bool = False
    # config.KernelConfigs fields set over config's pick in every call (override(atomic_dq=True, ...) fills it).
    config_fields: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self):
        if self.head_group is not None and self.head_group < 0:
            raise ValueError(f"head_group must be None or >= 0 (0: all heads in one group), got {self.head_group}")
        regs = self.dkdv_consumer_registers
        if regs is not None and not (24 <= regs <= 256 and regs % 8 == 0):
            raise ValueError(f"dkdv_consumer_registers must be None or a multiple of 8 in [24, 256] (setmaxnreg's "
                             f"range), got {regs}")
        unknown = set(self.config_fields) - _CONFIG_FIELDS
        if unknown:
            raise TypeError(f"config_fields names no KernelConfigs field: {sorted(unknown)}")
        for name, value in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)):
            _check_switch(name, value, _SWITCH_TYPES.get(name))
        for name, value in self.config_fields.items():
            _check_switch(name, value, _CONFIG_SWITCH_TYPES.get(name))
        # hashed once: ops.py keys its per-call plans by the options in force (a mapping field has no hash)
        own = tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config_fields")
        object.__setattr__(self, "_hash", hash((own, tuple(sorted(self.config_fields.items())))))

    def __hash__(self) -> int:
        return self._hash


def _check_switch(name: str, value: Any, annotation: str | None) -> None:
    """A switch (a field annotated `bool` or `bool | None`) takes a bool (or None): a string such as "false" or an
    integer would otherwise switch on whatever its truth value says."""
    allowed = {"bool": (bool,), "bool | None": (bool, type(None))}.get(annotation)
    if allowed is not None and type(value) not in allowed:
        raise TypeError(f"{name} must be {annotation.replace(' | ', ' or ')}, got {value!r}")


_OWN_FIELDS = frozenset(f.name for f in dataclasses.fields(KernelOptions)) - {"config_fields"}
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(KernelConfigs))
# the switches' annotations (dataclasses keep them as strings here: `from __future__ import annotations`)
_SWITCH_TYPES = {f.name: f.type for f in dataclasses.fields(KernelOptions) if f.type in ("bool", "bool | None")}
_CONFIG_SWITCH_TYPES = {f.name: f.type for f in dataclasses.fields(KernelConfigs) if f.type == "bool"}
DEFAULT = KernelOptions()
_current = DEFAULT


def current() -> KernelOptions:
    """The options in force (DEFAULT outside any `override`)."""
    return _current


def updated(options: KernelOptions, **changes) -> KernelOptions:
    """`options` with `changes`: KernelOptions fields, or KernelConfigs fields added to its config_fields."""
    unknown = set(changes) - _OWN_FIELDS - _CONFIG_FIELDS
    if unknown:
        raise TypeError(f"options.override: {sorted(unknown)} name no field of KernelOptions or KernelConfigs")
    own = {name: value for name, value in changes.items() if name in _OWN_FIELDS}
    config = {name: value for name, value in changes.items() if name in _CONFIG_FIELDS}
    if config:
        own["config_fields"] = MappingProxyType({**options.config_fields, **config})
    return dataclasses.replace(options, **own)


@contextlib.contextmanager
def override(**changes) -> Iterator[KernelOptions]:
    """with override(persistent_fwd=False, fwd=LaunchConfig(16, 64)): ...  The block runs with `updated(current(),
    **changes)` in force (nested blocks add to it), and the options before it come back at its end."""
    global _current
    previous = _current
    _current = updated(previous, **changes)
    try:
        yield _current
    finally:
        _current = previous
