"""Paged decode attention for fp32 on CPU, in C++ (`csrc/paged_decode.cpp`).

The pure-PyTorch path (`paged_attention.paged_decode_attention`) gathers every sequence's
K/V blocks into a fresh tensor and then runs SDPA over it: the cache is read, written and
read again. The kernel reads each key and value row once, straight from the block pool,
for all the query heads that share it (grouped-query attention). Same inputs, same result
up to float rounding. Built with the other CPU kernels by `cpu_extension.cpu_ops()`.
"""

from __future__ import annotations

from typing import Callable

from llmopt.kernels.cpu_extension import cpu_ops


def decode_kernel() -> Callable | None:
    """`paged_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, sliding_window)`,
    or None where the CPU kernels cannot be built (then use the PyTorch path)."""
    ops = cpu_ops()
    return None if ops is None else ops.paged_decode
