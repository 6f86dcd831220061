"""The decoder's small per-layer ops fused in C++ for fp32 on CPU (`csrc/fused_ops.cpp`).

RMSNorm (optionally with the residual add before it), rotary embedding in place on q and
k, and silu(gate) * up: between a layer's matmuls these are ~25 PyTorch ops whose dispatch
costs more than their arithmetic on a decode step. The PyTorch versions in
`llmopt/model/ops.py` stay the reference (tests/test_cpu_fused_ops.py) and the path for
other dtypes and devices; that module chooses between them once, at load.
"""

from __future__ import annotations

import functools
from types import ModuleType

from llmopt.kernels.cpu_extension import cpu_ops

@functools.cache
def fused_ops() -> ModuleType | None:
    """The module with `rms_norm`, `add_rms_norm`, `rotary_embedding_`, `silu_and_mul`, or None
    where the CPU kernels cannot be built or the CPU lacks AVX2/FMA."""
    ops = cpu_ops()
    return ops if ops is not None and ops.fused_ops_available() else None

