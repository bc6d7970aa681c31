"""Warp-specialized Gluon kernels for Hopper (sm_90): forward (fwd), dK/dV (dkdv), dQ (dq), the helpers they share
(common) and the persistent causal forward's block table (schedule).

The kernel modules import Gluon at the top, so they are imported only where `AVAILABLE` holds (ops.py does so); this
package itself imports anywhere, and `enabled` says whether the kernels may run.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

try:  # Gluon is experimental: its module layout has changed between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    del gluon, hopper, TensorDescriptor  # imported by the kernel modules
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

# Gluon's API changes between Triton releases; the kernels were written and checked against this one (the GPU
# stack's). Other releases, or FLASHPATCH_GLUON=0 in the environment, keep the Triton kernels.
GLUON_TRITON = "3.6."


def enabled() -> bool:
    """Whether the Gluon kernels may run at all (read at each call, so FLASHPATCH_GLUON=0 works at any time)."""
    return AVAILABLE and triton.__version__.startswith(GLUON_TRITON) and os.environ.get("FLASHPATCH_GLUON") != "0"


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability, once per device (it is asked several times per call)."""
    return torch.cuda.get_device_capability(device)
