"""CPU runs go through the Triton interpreter; it must be switched on before flashpatch defines its kernels."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run tools/gpu_suite.sh on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def fresh_call_plans():
    """ops.py makes each call signature's decisions once (ops._planned), reading config.py's module constants, which
    tests monkeypatch: every test starts without plans, so that its patches reach its calls."""
    from flashpatch import ops

    ops._plans.clear()
    yield
    ops._plans.clear()
