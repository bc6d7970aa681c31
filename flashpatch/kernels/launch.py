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

Replays go one step further for a caller whose whole launch follows from its site: the first launch at a site that
reuses a cached kernel records the argument list the compiled launcher is called with, tensor descriptors expanded,
and which of its entries come from the call's tensors and floats (`Record`); `replay` then re-issues it with another
call's tensors and floats put in, so that the caller builds no descriptors, grids or keys and Triton's launcher
wrapper does not run. A descriptor is re-encoded from its new base pointer (the rest of it follows from the site).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import torch
from triton import knobs
from triton.runtime import _allocation
from triton.runtime.jit import JITFunction

from flashpatch.kernels import options

try:  # the Gluon host-side descriptor (the Triton kernels build theirs on the device)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GluonDescriptor = None

try:  # the compiled launcher's argument layout, which replays build themselves (Triton 3.6's); else no replays
    import inspect

    from triton.backends.nvidia import driver as _nvidia_driver

    _TMA_DTYPES = _nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST
    _REPLAYABLE = (getattr(_nvidia_driver, "_BASE_ARGS_FORMAT_LEN", None) == 13
                   and len(inspect.signature(_nvidia_driver.make_tensordesc_arg).parameters) == 2)
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    _TMA_DTYPES, _REPLAYABLE = None, False

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


class Record(NamedTuple):
    """What a launch records for `replay`. site: a hashable value such that launches of the kernel with equal sites
    differ only in the tensors and floats below, the device included (ops.py's plan keys hold it); the launch's
    own `site` may be finer (fwd.py's tells a schedule table apart). sources: the call's tensors (None for an absent
    one, the same at every launch of the site), each tensor argument and descriptor base of the launch, in argument
    order, being one of them (the same object). floats: the launch's float arguments, in argument order. captured:
    tensors the launch passes that follow from the site and live as long as the process (a schedule table), kept
    as they are."""
    site: Any
    sources: tuple
    floats: tuple = ()
    captured: tuple = ()


class _Replay(NamedTuple):
    raw: Any  # the compiled launcher's C function
    fill: Any  # the driver's tensor-map encoder (what Triton's wrapper calls per descriptor)
    device: int
    scratch: Optional[tuple[int, int]]  # (bytes, alignment) of the global scratch a launch takes, or None
    template: list  # its arguments, the stream and the call's values to be put in
    tensors: tuple  # (position in template, index in sources, descriptor fill arguments after the pointer or None)
    floats: tuple  # (position in template, index in floats)


# (kernel, Record.site) -> the launch to re-issue, or None where it could not be recorded (never tried again)
_replays: dict[tuple, Optional[_Replay]] = {}


def replay(kernel, site: Any, sources: tuple, floats: tuple = (), stream: Optional[int] = None) -> bool:
    """Re-issue the launch of `kernel` recorded at `site` (`Record`) with these sources and floats, on `stream` (a
    raw CUDA stream handle; None: the device's current stream). False, launching nothing, where no launch was
    recorded there or a launch hook or pre-run hook is set (the caller then launches the usual way)."""
    entry = _replays.get((kernel, site))
    if entry is None or kernel.pre_run_hooks or not (_no_hook(knobs.runtime.launch_enter_hook)
                                                     and _no_hook(knobs.runtime.launch_exit_hook)):
        return False
    if entry.scratch is not None:  # as Triton's launcher takes it: from Triton's allocator, on the current stream
        allocator = _allocation._allocator.get()
        if stream is not None or isinstance(allocator, _allocation.NullAllocator):
            return False  # memory the current stream could reuse while another stream's kernel runs; or none set
    args = entry.template.copy()
    for position, index, fill in entry.tensors:
        source = sources[index]
        args[position] = source if fill is None else entry.fill(source.data_ptr(), *fill)
    for position, index in entry.floats:
        args[position] = floats[index]
    args[3] = torch._C._cuda_getCurrentRawStream(entry.device) if stream is None else stream
    if entry.scratch is not None:
        args[7] = allocator(*entry.scratch, args[3])
    entry.raw(*args)
    return True


def _raw_launcher(launcher) -> Any:
    """The C function under Triton 3.6's CudaLauncher: its `launch` itself, or the one its descriptor-expanding
    wrapper closes over. None where the launcher is laid out otherwise."""
    raw = getattr(launcher, "launch", None)
    if raw is None or type(raw).__name__ == "builtin_function_or_method":
        return raw
    for cell in getattr(raw, "__closure__", None) or ():
        content = cell.cell_contents
        if type(content).__name__ == "builtin_function_or_method" and content.__name__ == "launch":
            return content
    return None


def _record(compiled, device: int, grid: tuple, args: tuple, tail: tuple, record: Record) -> Optional[_Replay]:
    """The replay of a launch that just ran, or None where it cannot be made (the launch keeps its usual path)."""
    launcher = compiled.run
    raw = _raw_launcher(launcher) if _REPLAYABLE else None
    if raw is None or getattr(launcher, "profile_scratch_size", 1):
        return None
    grid = tuple(grid) + (1,) * (3 - len(grid))
    scratch = None
    if launcher.global_scratch_size > 0:  # CudaLauncher's allocate_scratch, for this grid
        scratch = (grid[0] * grid[1] * grid[2] * launcher.num_ctas * launcher.global_scratch_size,
                   launcher.global_scratch_align)
    metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or ())
    descriptors = sum(1 for a in args if _GluonDescriptor is not None and type(a) is _GluonDescriptor)
    if metas and len(metas) != descriptors:
        return None
    template = [*grid, None, compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                compiled.packed_metadata, None, None, None]
    tensors, floats = [], []
    next_source = next_float = 0
    captured = [id(t) for t in record.captured]

    def source_of(t) -> Optional[int]:  # the next source that is t, in order
        nonlocal next_source
        for index in range(next_source, len(record.sources)):
            if record.sources[index] is t:
                next_source = index + 1
                return index
        return None

    for arg in (*args, *tail):
        kind = type(arg)
        if isinstance(arg, torch.Tensor):
            if id(arg) in captured:
                template.append(arg)
                continue
            index = source_of(arg)
            if index is None:
                return None
            tensors.append((len(template), index, None))
            template.append(None)  # put in by each replay: the template keeps no call's tensors alive
        elif _GluonDescriptor is not None and kind is _GluonDescriptor:
            index = source_of(arg.base)
            if index is None or arg.base.data_ptr() % 16:
                return None
            meta = metas.pop(0) if metas else None
            if meta is None or meta["fp4_padded"] or arg.strides[-1] != 1:
                return None  # Triton's other expansion; not met by the Gluon kernels
            fill = (meta["swizzle"], meta["elem_size"], _TMA_DTYPES[meta["elem_type"]], meta["block_size"],
                    list(arg.shape), list(arg.strides), 1 if arg.padding == "nan" else 0)
            tensors.append((len(template), index, fill))
            template.extend((None, *arg.shape, *arg.strides))
        elif kind is float:
            if next_float >= len(record.floats) or record.floats[next_float] is not arg:
                return None
            floats.append((len(template), next_float))
            next_float += 1
            template.append(arg)
        elif kind in (int, bool, str, tuple) or arg is None:
            template.append(arg)  # fixed by the site
        else:
            return None
    if next_float != len(record.floats):
        return None
    return _Replay(raw, _tma_encoder(), device, scratch, template, tuple(tensors), tuple(floats))


def _tma_encoder():
    """The driver's tensor-map encoder: (base pointer, swizzle, element size, element type, block, shape, strides,
    padding) -> the CUtensorMap argument Triton's launcher takes for a descriptor."""
    from triton.runtime import driver

    return driver.active.utils.fill_tma_descriptor


def launch(kernel, grid: tuple, *args, cached_launch: bool = True, on_stream: Optional[int] = None,
           site: Any = None, record: Optional[Record] = None, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) on the current CUDA device's current stream, or on `on_stream` (a raw CUDA
    stream handle) if given. kwargs: the kernel's constexpr parameters by name and the launch options (num_warps,
    maxnreg, ...). cached_launch: False takes Triton's own path every time. site: None, or a hashable value that
    stands for the argument key (the module's docstring): equal sites of one kernel must mean equal keys. record:
    the first launch at record.site that reuses a cached kernel records itself for `replay` there, or that it
    cannot be replayed (not while verify_launch_sites is on, whose checks replays would skip)."""
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
    verify = site is not None and options.current().verify_launch_sites
    if verify:
        made = _signature_key(kernel, device, args, kwargs)
        if made != signature:
            raise AssertionError(f"launch site {site!r} of {getattr(kernel, '__name__', kernel)} was cached with the "
                                 f"argument key {signature!r} and now has {made!r}")
    if record is not None and site is not None and not verify and (kernel, record.site) not in _replays:
        if len(_replays) >= _MAX_ENTRIES:
            _replays.clear()
        _replays[(kernel, record.site)] = _record(compiled, device, grid, args, tail, record)
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


def on_input_device(fn):
    """fn run with the current CUDA device set to its first argument's (a tensor, or anything with a `device`), as
    flash-attn's CUDAGuard does: Triton launches on the current device (and allocates TMA descriptor scratch there),
    so without it a model spread over GPUs in one process (transformers' device_map) would launch its later layers
    on the wrong GPU."""
    @functools.wraps(fn)
    def on_device(*args, **kwargs):
        device = args[0].device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return on_device


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host integers (triton.cdiv is a constexpr function: host calls cost microseconds)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as triton.next_power_of_2 gives for host integers."""
    return 1 << (n - 1).bit_length() if n > 0 else 0

