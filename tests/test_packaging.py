"""Packaging: the library imports and runs without the recipes' extras, the declared dependencies cover what the
tests and recipes import, and the version, license and README's install lines agree with pyproject.toml."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashpatch

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
RECIPE_ONLY = ("accelerate", "datasets", "matplotlib", "pyarrow", "tqdm", "yaml")  # the `recipes` extra's modules
# module name -> distribution, where they differ
DISTRIBUTION = {"yaml": "pyyaml"}
# what the declared dependencies bring themselves (transformers requires numpy and tokenizers)
INDIRECT = {"numpy", "tokenizers"}


def _requirement_names(requirements) -> set[str]:
    names = set()
    for req in requirements:
        name = req.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            name = name.split(sep)[0]
        names.add(name.strip().lower())
    return names


def _top_level_imports(path: Path, module_level_only: bool) -> set[str]:
    """Top-level package names imported by path: all its imports, or only those run when the module is imported
    (not inside a function)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import) and not (module_level_only and in_function):
                names.update(alias.name.split(".")[0] for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and not (module_level_only and in_function):
                names.add(child.module.split(".")[0])
            visit(child, inner)

    visit(tree, False)
    return names


def test_flashpatch_imports_nothing_from_the_recipes_extra_at_import_time():
    offenders = {}
    for path in sorted((REPO / "flashpatch").rglob("*.py")):
        used = _top_level_imports(path, module_level_only=True) & set(RECIPE_ONLY)
        if used:
            offenders[str(path.relative_to(REPO))] = sorted(used)
    assert not offenders, f"module-level imports of the recipes' dependencies: {offenders}"


def test_library_runs_with_the_recipes_extra_blocked():
    """`import flashpatch`, a kernel call and a patched transformers model, with accelerate, datasets, matplotlib
    and pyarrow made unimportable (sys.modules[name] = None), as in an install without the extras."""
    code = f"""
import sys
for name in {RECIPE_ONLY[:4]!r}:
    sys.modules[name] = None
import torch
import flashpatch
from transformers import AutoModelForCausalLM, LlamaConfig

q = torch.randn(1, 16, 2, 16)
out = flashpatch.flash_attn_func(q, q, q, causal=True)
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=64)
model = AutoModelForCausalLM.from_config(config, attn_implementation="fpatch")
loss = model(input_ids=torch.randint(0, 64, (1, 16)), labels=torch.randint(0, 64, (1, 16)), use_cache=False).loss
loss.backward()
print("ok", tuple(out.shape), bool(torch.isfinite(loss)))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok (1, 16, 2, 16) True"


def test_dependencies_core_and_extras():
    project = PYPROJECT["project"]
    assert _requirement_names(project["dependencies"]) == {"torch", "triton", "transformers"}
    extras = project["optional-dependencies"]
    assert _requirement_names(extras["recipes"]) == {"accelerate", "datasets", "matplotlib", "pyyaml", "tqdm"}
    assert set(extras["test"]) >= {"flashpatch[recipes]"} and "pytest" in _requirement_names(extras["test"])


def test_test_extra_covers_what_the_tests_and_recipes_import():
    project = PYPROJECT["project"]
    declared = _requirement_names(project["dependencies"]) | _requirement_names(
        project["optional-dependencies"]["recipes"]) | _requirement_names(project["optional-dependencies"]["test"])
    local = {"flashpatch", "tests", "conftest", "helpers", "_patch_models"}
    local |= {p.stem for folder in ("recipes", "benchmarks", "tools") for p in (REPO / folder).glob("*.py")}
    files = [*(REPO / "tests").glob("*.py"), *(REPO / "recipes").glob("*.py"), REPO / "benchmarks" / "bench_attention.py"]
    missing = {}
    for path in files:
        for name in _top_level_imports(path, module_level_only=False):
            if name in sys.stdlib_module_names or name in local or name in INDIRECT:
                continue
            if DISTRIBUTION.get(name, name).lower() not in declared:
                missing.setdefault(name, []).append(path.name)
    # profile_train_step (tests/test_profile_tools.py) is a maintainers' script, outside the package's extras
    missing.pop("profile_train_step", None)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_version_license_and_install_lines():
    project = PYPROJECT["project"]
    assert flashpatch.__version__ == project["version"]
    assert project["license"] == "BSD-3-Clause"
    assert (REPO / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert f"## {project['version']}" in (REPO / "CHANGELOG.md").read_text()
    readme = (REPO / "README.md").read_text()
    # CI (.ci/run) runs the README's test line as written
    assert 'pip install "torch==2.13.0" -e ".[test]" && python -m pytest -q tests' in readme
    pins = dict(line.split("==") for line in (REPO / "constraints" / "tested.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert {"torch", "triton", "transformers", "accelerate"} <= set(pins)
    assert "constraints/tested.txt" in readme
