"""Whether the Gluon kernels compile to the same PTX instructions at two revisions: a check, without a GPU, that a
change leaves the kernels it was not meant to touch as they were (the GPU tests ran on the older revision).

    PYTHONPATH=/tmp/t36 python scripts/compare_gluon_ptx.py BASE_REV [--variants "fwd --causal,dq --causal --dropout"]

Each variant is compiled by scripts/dump_gluon.py in a `git worktree` of BASE_REV and in this checkout (with
PYTHONPATH on a `pip install --target` of Triton 3.6, the GPU's compiler). Instructions are compared with their
operands; parameter numbers, debug lines and data directives are left out (a new kernel argument renumbers the
parameters). Prints one line per variant and exits 1 if any differs. Each side compiles with its own dump_gluon.py,
whose unset dK/dV constexprs follow the launcher since 67b4ab0 (0 before): against an older BASE_REV, name them
(e.g. "dkdv --causal --headdim 64 --set REG_KV=1"), or the d64 dK/dV variants differ by REG_KV alone.
"""

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("fwd,fwd --causal,fwd --causal --alibi,fwd --causal --headdim 64,dq,dq --causal,dq --causal --alibi,"
            "dq --causal --dropout,dq --causal --headdim 64,dkdv,dkdv --causal,dkdv --causal --alibi,"
            "dkdv --causal --headdim 64")
SKIPPED = ("//", ".loc", ".file", ".section", ".b8", ".b16", ".b32", ".b64", "$L__", ".param")


def instructions(ptx: Path) -> list[str]:
    lines = (line.strip() for line in ptx.read_text().splitlines())
    return [re.sub(r"_param_\d+", "_param_N", line) for line in lines if line and not line.startswith(SKIPPED)]


def compile_variant(tree: Path, variant: str, out: Path) -> Path:
    """The PTX file dump_gluon.py writes for `variant` in `tree`."""
    run = subprocess.run([sys.executable, "scripts/dump_gluon.py", *variant.split(), "--out", str(out)], cwd=tree,
                         capture_output=True, text=True)
    found = re.search(r": (\S+\.ptx);", run.stdout)
    if run.returncode or not found:
        raise RuntimeError(f"{tree}: dump_gluon.py {variant} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return Path(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the revision to compare with (e.g. the last one the GPU tests ran on)")
    parser.add_argument("--variants", default=VARIANTS, help="comma-separated dump_gluon.py arguments")
    args = parser.parse_args()
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), args.base], cwd=REPO, check=True)
        try:
            for variant in args.variants.split(","):
                old = instructions(compile_variant(base_tree, variant, Path(tmp) / "old"))
                new = instructions(compile_variant(REPO, variant, Path(tmp) / "new"))
                changed = [op for op in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
                           if op[0] != "equal"]
                same &= not changed
                print(f"{variant:32s} {len(old)} -> {len(new)} instructions, "
                      f"{'same' if not changed else f'{len(changed)} changed blocks'}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, check=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
