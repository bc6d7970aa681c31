"""Kernel launches with Triton's per-launch binding done once per argument signature.

`kernel[grid](*args, **kwargs)` runs Triton's JIT front end at every call: it binds and specializes each argument,
hashes the result into a cache key, checks the kernel's globals, then calls the compiled kernel's launcher. For a
small attention call that front end costs more host time than the launcher and the GPU work together
(docs/tuning.md, "Host time"). `launch` does the same launch with the front end run only when it meets a new
signature: it keys the compiled kernel by the device and by what the binder specializes on, computed from the
arguments in plain Python (tensors: dtype and 16-byte alignment; integers and tuples of them: their values; tensor
descriptors: dtype, shapes, strides, block and layout; the keyword arguments: their values), and calls the launcher
directly.

Building that key costs host time of its own (a few microseconds per argument), so a caller that knows its launches'
arguments follow from fewer values can name them instead: `site`, a hashable value such that two launches of a
kernel with equal sites have equal keys (ops.py passes its per-call plan's key, made of its inputs' shapes,
strides, dtypes and alignment, the scalar arguments and the options). options.KernelOptions.verify_launch_sites
checks that promise at every such launch.

The slow path (Triton's own) runs where a launch hook is set (a profiler), where a kernel has pre-run hooks, where an
argument has a type the key does not know, and under the Triton interpreter. options.KernelOptions.cached_launch
turns the cache off.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from flashpatch.kernels import options

try:  # the Gluon host-side descriptor (the Triton kernels build theirs on the device)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GluonDescriptor = None

_MAX_ENTRIES = 4096  # signatures kept; a long-lived process meeting more starts over
# key (or (kernel, device, site)) -> (compiled kernel, arguments after *args, scratch, the argument key it was made at)
_compiled: dict[tuple, tuple[Any, tuple, bool, Optional[tuple]]] = {}


def _arg_key(arg) -> Any:
    """What Triton's binder specializes on, or a superset of it: equal keys mean the same compiled kernel. Exact
    types first (the common cases, cheapest to tell); a bool is keyed apart from the int it equals."""
    kind = type(arg)
    if kind is int or arg is None or kind is str:
        return arg
    if kind is bool:
        return (bool, arg)
    if kind is float:
        return float  # floats are never specialized
    if kind is tuple:  # specialized element by element
        return ("tuple", *map(_arg_key, arg))
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if _GluonDescriptor is not None and kind is _GluonDescriptor:
        return ("desc", arg.base.dtype, arg.base.data_ptr() % 16 == 0, *arg.shape, *arg.strides, *arg.block_shape,
                _layout_key(arg.layout), arg.padding)
    raise TypeError  # anything else (int and float subclasses included): the slow path


_layouts: dict[int, Any] = {}  # id -> layout, kept alive so that an id always names the same layout


def _layout_key(layout) -> int:
    """A shared-memory layout as a key: Gluon's layout dataclasses hold lists (no hash), and the launchers build each
    layout once (lru_cache), so the object's identity is the key; the object is kept so that its id is never
    reused."""
    key = id(layout)
    if key not in _layouts:
        if len(_layouts) >= _MAX_ENTRIES:
            raise TypeError  # layouts made per call: the slow path rather than an unbounded table
        _layouts[key] = layout
    return key


def _signature_key(kernel, device: int, args: tuple, kwargs: dict) -> Optional[tuple]:
    """The cache key of a launch on CUDA device `device` (Triton compiles and loads a kernel per device), or None
    where the arguments cannot make one."""
    try:
        key = (kernel, device, *map(_arg_key, args), tuple(kwargs.items()))
        hash(key)
        return key
    except TypeError:  # an argument the key does not know, or an unhashable keyword value
        return None


def _tail(kernel, args: tuple, kwargs: dict) -> Optional[tuple]:
    """The launcher's arguments after the positional ones: each later parameter's keyword value or default, in the
    kernel's parameter order (the key holds the keyword values, so they are fixed per entry). None where that cannot
    be made (a keyword naming a positional parameter, a parameter given no value): every launch then binds."""
    params = list(kernel.signature.parameters.values())
    if len(args) > len(params) or any(p.name in kwargs for p in params[:len(args)]):
        return None
    tail = []
    for p in params[len(args):]:
        if p.name in kwargs:
            tail.append(kwargs[p.name])
        elif p.default is not p.empty:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


def _no_hook(hook) -> bool:
    """Whether a launch hook knob holds nothing to call: None, or an empty chain (Triton 3.5 on keeps a HookChain
    there, which its own path calls at every launch)."""
    return hook is None or getattr(hook, "calls", None) == []


def _tritons_launch(kernel, grid: tuple, args: tuple, kwargs: dict, stream: Optional[int]):
    """Triton's own launch path, on `stream` made current if given; returns what it returns (the compiled kernel)."""
    if stream is None:
        return kernel[grid](*args, **kwargs)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        return kernel[grid](*args, **kwargs)


def launch(kernel, grid: tuple, *args, cached_launch: bool = True, on_stream: Optional[int] = None,
           site: Any = None, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) on the current CUDA device's current stream, or on `on_stream` (a raw CUDA
    stream handle) if given. kwargs: the kernel's constexpr parameters by name and the launch options (num_warps,
    maxnreg, ...). cached_launch: False takes Triton's own path every time. site: None, or a hashable value that
    stands for the argument key (the module's docstring): equal sites of one kernel must mean equal keys."""
    key = None
    if (cached_launch and isinstance(kernel, JITFunction) and not kernel.pre_run_hooks
            and _no_hook(knobs.runtime.launch_enter_hook) and _no_hook(knobs.runtime.launch_exit_hook)):
        device = torch.cuda.current_device()
        key = _signature_key(kernel, device, args, kwargs) if site is None else (kernel, device, site)
    entry = _compiled.get(key) if key is not None else None
    if entry is None:
        compiled = _tritons_launch(kernel, grid, args, kwargs, on_stream)
        if key is not None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            tail = _tail(kernel, args, kwargs)
            signature = key if site is None else _signature_key(kernel, device, args, kwargs)
            if tail is not None and signature is not None:
                if len(_compiled) >= _MAX_ENTRIES:
                    _compiled.clear()
                meta = compiled.metadata
                scratch = getattr(meta, "global_scratch_size", 0) > 0 or getattr(meta, "profile_scratch_size", 0) > 0
                _compiled[key] = (compiled, tail, scratch, signature)
        return
    compiled, tail, scratch, signature = entry
    if site is not None and options.current().verify_launch_sites:
        made = _signature_key(kernel, device, args, kwargs)
        if made != signature:
            raise AssertionError(f"launch site {site!r} of {getattr(kernel, '__name__', kernel)} was cached with the "
                                 f"argument key {signature!r} and now has {made!r}")
    if scratch and on_stream is not None:
        # the launcher allocates the scratch on the current stream, which is not the one the kernel runs on: the
        # slow path makes `on_stream` current for the launch, so the allocator orders the memory's reuse after it
        _tritons_launch(kernel, grid, args, kwargs, on_stream)
        return
    stream = torch._C._cuda_getCurrentRawStream(device) if on_stream is None else on_stream
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host integers (triton.cdiv is a constexpr function: host calls cost microseconds)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as triton.next_power_of_2 gives for host integers."""
    return 1 << (n - 1).bit_length() if n > 0 else 0

