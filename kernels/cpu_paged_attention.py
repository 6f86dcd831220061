"""Paged decode attention on CPU, in C++ (`csrc/paged_decode.cpp`): fp32 queries against
an fp32, bf16 or fp16 KV pool.

The pure-PyTorch path (`paged_attention.paged_decode_attention`) gathers every sequence's
K/V blocks into a fresh tensor and then runs SDPA over it: the cache is read, written and
read again. The kernel reads each key and value row once, straight from the block pool,
for all the query heads that share it (grouped-query attention). 16-bit K/V are widened to
fp32 as they are loaded (exactly), so scores, softmax and output are fp32 whatever the pool
holds. Same inputs, same result up to float rounding. Built with the other CPU kernels by
`cpu_extension.cpu_ops()`.
"""

from __future__ import annotations

from typing import Callable

import torch

from llmopt.kernels.cpu_extension import cpu_ops

# the KV pool dtypes the kernel reads (its queries and output are always fp32)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def decode_kernel() -> Callable | None:
    """`paged_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, sliding_window)`,
    or None where the CPU kernels cannot be built (then use the PyTorch path). q is fp32;
    k_cache and v_cache share one of `KV_DTYPES`."""
    ops = cpu_ops()
    return None if ops is None else ops.paged_decode
