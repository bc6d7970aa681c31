"""Which Triton kernel variants a training recipe compiles, and at which step: a JIT cache hook records every
in-process compile (Triton's disk cache may still serve the binary) with the step it happened in and its
specialization, and for kernels compiled more than once prints what differs between the variants. GPU only.

    python tools/trace_compiles.py --config configs/llama_125m.yaml --implementations fpatch --steps 30

Every option is recipes/train.py's (it runs in this process, one implementation at a time as usual).
"""

import sys
from collections import defaultdict
from pathlib import Path

from triton import knobs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

step = [0]
compiles = []  # (step, kernel name, specialization of each parameter, options)


def record(key, repr, fn, compile, is_manual_warmup, already_compiled):
    """Triton's jit_cache_hook, called before each in-process compile: each parameter's type, constant value and
    attributes (divisibility) as Triton specialized them."""
    params = [p.name for p in fn.jit_function.params]

    def by_name(mapping):  # keys are argument paths, (index,) or (index, element)
        return {(params[path[0]], *path[1:]) if isinstance(path, tuple) else path: value
                for path, value in mapping.items()}

    constants, attrs = by_name(compile["constants"]), by_name(compile["configs"][0])
    spec = {name: (compile["signature"].get(name), constants.get((name,)), str(attrs.get((name,), "")))
            for name in params}
    compiles.append((step[0], fn.name, spec, repr.split("](")[0] + "]"))
    return False  # compile as usual


def main():
    knobs.runtime.jit_cache_hook = record
    inner = train.train_step

    def counted(*args, **kwargs):
        step[0] += 1
        return inner(*args, **kwargs)

    train.train_step = counted
    train.main(sys.argv[1:])
    by_kernel = defaultdict(list)
    print("\n| step | kernel | options |\n|---|---|---|")
    for at, name, spec, options in compiles:
        by_kernel[name].append(spec)
        print(f"| {at} | {name} | {options} |")
    for name, specs in by_kernel.items():
        for later in specs[1:]:
            changed = {p: (specs[0][p], later[p]) for p in later if later[p] != specs[0].get(p)}
            print(f"{name}: a later variant differs from the first in {changed}")


if __name__ == "__main__":
    main()
