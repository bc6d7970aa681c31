"""Whether the Gluon kernels compile to the same PTX instructions at two revisions: a check, without a GPU, that a
change leaves the kernels it was not meant to touch as they were (the GPU tests ran on the older revision).

    PYTHONPATH=/tmp/t36 python tools/compare_gluon_ptx.py BASE_REV [--variants "fwd --causal,dq --causal --dropout"]
        [--cache DIR]

Each variant is compiled by the dump_gluon.py of each side (tools/dump_gluon.py, or scripts/dump_gluon.py before the
move to tools/), in its own process: in a `git worktree` of BASE_REV, and in this checkout, so each imports its own
flashpatch layout. PYTHONPATH points at a `pip install --target` of Triton 3.6, the GPU's compiler. Instructions are
compared with their operands; parameter numbers, debug lines and data directives are left out (a new kernel argument
renumbers the parameters). Prints one line per variant and exits 1 if any differs. --cache keeps BASE_REV's PTX in
DIR/<commit>/ and reuses it. Each side's dump_gluon.py sets the constexprs it is not given as its launcher does: name
them (--set) where the launchers differ.
"""

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the forms the launchers run (FOLD=1: config's fold_scale), and the kernels' other constexpr branches
VARIANTS = ("fwd --set FOLD=1,fwd --causal --set FOLD=1,fwd --causal --alibi,fwd --headdim 64 --set FOLD=1,"
            "fwd --causal --headdim 64 --set FOLD=1,fwd --persistent --set FOLD=1,"
            "fwd --persistent --causal --set FOLD=1,fwd --persistent --causal --alibi,fwd --dropout --set FOLD=1,"
            "fwd --dropout --causal --set FOLD=1,fwd,fwd --causal,"
            "dq,dq --causal,dq --causal --alibi,dq --causal --dropout,dq --causal --headdim 64,dq --persistent,"
            "dq --persistent --causal --dropout,"
            "dkdv,dkdv --causal,dkdv --causal --alibi,dkdv --causal --headdim 64,dkdv --headdim 64,"
            "dkdv --dropout,dkdv --causal --dropout,dkdv --causal --set FUSED_DQ=1,"
            "dkdv --causal --dropout --set FUSED_DQ=1")
SKIPPED = ("//", ".loc", ".file", ".section", ".b8", ".b16", ".b32", ".b64", "$L__", ".param")


def instructions(ptx: Path) -> list[str]:
    lines = (line.strip() for line in ptx.read_text().splitlines())
    return [re.sub(r"_param_\d+", "_param_N", line) for line in lines if line and not line.startswith(SKIPPED)]


def dump_script(tree: Path) -> str:
    for path in ("tools/dump_gluon.py", "scripts/dump_gluon.py"):
        if (tree / path).exists():
            return path
    raise FileNotFoundError(f"{tree}: no tools/dump_gluon.py or scripts/dump_gluon.py")


def compile_variant(tree: Path, variant: str, out: Path) -> Path:
    """The PTX file the tree's dump_gluon.py writes for `variant`."""
    run = subprocess.run([sys.executable, dump_script(tree), *variant.split(), "--out", str(out)], cwd=tree,
                         capture_output=True, text=True)
    found = re.search(r": (\S+\.ptx);", run.stdout)
    if run.returncode or not found:
        raise RuntimeError(f"{tree}: dump_gluon.py {variant} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return Path(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the revision to compare with (e.g. the last one the GPU tests ran on)")
    parser.add_argument("--variants", default=VARIANTS, help="comma-separated dump_gluon.py arguments")
    parser.add_argument("--cache", type=Path, help="keep and reuse BASE_REV's PTX under this folder")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", args.base], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        old_dir = args.cache / commit if args.cache else Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), commit], cwd=REPO, check=True)
        try:
            for variant in args.variants.split(","):
                cached = old_dir / f"{re.sub(r'[^A-Za-z0-9]+', '_', variant)}.ptx"
                if not cached.exists():
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    cached.write_text(compile_variant(base_tree, variant, Path(tmp) / "old").read_text())
                old = instructions(cached)
                new = instructions(compile_variant(REPO, variant, Path(tmp) / "new"))
                changed = [op for op in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
                           if op[0] != "equal"]
                same &= not changed
                print(f"{variant:44s} {len(old)} -> {len(new)} instructions, "
                      f"{'same' if not changed else f'{len(changed)} changed blocks'}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, check=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
