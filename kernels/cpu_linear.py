"""`x @ w.T (+ bias)` for fp32 on CPU when x has few rows, in C++ (`csrc/skinny_linear.cpp`).

A decode step multiplies a handful of rows (one per running sequence) by every weight
matrix. MKL's GEMM, what `F.linear` runs, re-packs the weight on each call, and with few
rows that copy outweighs the arithmetic: on the default model a batch-4 step spent twice
as long in its linears as batch 1. The kernel reads each weight row once and dots it with
all rows of x while it is in L1 (`llmopt bench kernels --device cpu` measures both). Larger
inputs (prompt chunks, perplexity windows) keep MKL, which wins there.
"""

from __future__ import annotations

from typing import Callable

from llmopt.kernels.cpu_extension import cpu_ops

# up to this many rows the kernel beats MKL on this project's shapes (`llmopt bench kernels --device cpu`)
SKINNY_MAX_ROWS = 96


def skinny_linear_kernel() -> Callable | None:
    """`skinny_linear(x [M, K], w [N, K], bias=None) -> [M, N]` (fp32, contiguous), or None
    where the CPU kernels cannot be built or the CPU lacks AVX2/FMA (then use `F.linear`)."""
    ops = cpu_ops()
    return ops.skinny_linear if ops is not None and ops.skinny_linear_available() else None
