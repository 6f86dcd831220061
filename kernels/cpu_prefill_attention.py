"""Prompt attention of packed sequences on CPU, in C++ (`csrc/prefill_attention.cpp`).

PyTorch's CPU flash attention runs a prompt of ~100 tokens at a small fraction of the FMA
units' rate (per-call work is tiny and it is called once per sequence and layer). The kernel
takes every sequence of a forward in one call: each sequence's queries against an optional run
of context keys (a shared prefix, all visible) and then its own keys causally, with the grouped
query heads of a kv head in one register tile. fp32 in and out; same result as
`paged_attention.attend` up to float rounding. Built with the other CPU kernels by
`cpu_extension.cpu_ops()`.

Its products run in fp32, or in bf16 (`bf16_products`: q, K, the softmax weights and V rounded to bfloat16,
sums in fp32; AVX512-BF16's `vdpbf16ps`, 1.6x the fp32 kernel's speed at 512 tokens on AMD Zen 4) for prompt-sized
chunks where the model's prompt math is bf16 (`kernel_math`).
"""

from __future__ import annotations

from typing import Callable

import torch

from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.kernels.cpu_linear import bf16_way
from llmopt.kernels.paged_attention import PROMPT_MATH_MIN_QUERIES

HEAD_DIM_MULTIPLE = 16  # the kernel's register tiles: head_dim must be a multiple


def prefill_attention_kernel() -> Callable | None:
    """`prefill_attention(q, k, v, segments, scale, sliding_window, bf16_products=False)`, or None where the CPU
    kernels cannot be built. q [Tq, H, D], k and v [Tk, KVH, D] fp32; segments int64 [S, 5], per sequence (q_start,
    q_len, ctx_start, ctx_len, own_start); sliding_window 0 for none; bf16_products only where `bf16_products()`."""
    ops = cpu_ops()
    return None if ops is None else ops.prefill_attention


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel takes these queries: fp32 on CPU, head_dim a multiple of `HEAD_DIM_MULTIPLE`."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[-1] % HEAD_DIM_MULTIPLE == 0


def equal_length_segments(num_seqs: int, seq_len: int) -> torch.Tensor:
    """The kernel's segments for `num_seqs` whole sequences of `seq_len` packed flat."""
    return torch.tensor([[i * seq_len, seq_len, 0, 0, i * seq_len] for i in range(num_seqs)], dtype=torch.int64)


def chunk_segments(query_len: int, context_len: int) -> torch.Tensor:
    """The kernel's segment for one prompt chunk whose keys are [context_len cached, then its own query_len]."""
    return torch.tensor([[0, query_len, 0, context_len, context_len]], dtype=torch.int64)


def bf16_products() -> bool:
    """Whether the kernel's bf16 products run here now: built and run with AVX512-BF16, the kernels' SIMD path not
    capped below AVX-512 (`LLMOPT_CPU_ISA=avx2` keeps them fp32)."""
    ops = cpu_ops()
    return ops is not None and ops.bf16_products_available()


def bf16_prompt_attention() -> bool:
    """Whether attention over prompt chunks pays in bf16 here: on AMX-BF16 tiles PyTorch's CPU flash attention runs
    2.3-3x faster on bf16 q/k/v than on fp32 (SDPA); with AVX512-BF16 alone it ran no faster than fp32 (AMD Zen 4),
    but this kernel's bf16 products do (`bf16_products`)."""
    way = bf16_way()
    return way == "amx" or (way == "avx512_bf16" and bf16_products())


def kernel_math(q: torch.Tensor, math_dtype: torch.dtype | None, queries: int) -> str | None:
    """How a prompt attention of `queries` queries per chunk (q: all of them) runs under an attention backend's
    `math_dtype`: "fp32" (the kernel's fp32 products: no math dtype, or fewer than `PROMPT_MATH_MIN_QUERIES` queries,
    as the dense layers' bf16 starts above decode-sized row counts), "bf16" (its bf16 products: math dtype bf16 where
    they run and the CPU has no AMX-BF16), or None: SDPA (`paged_attention.attend`)."""
    if not supports(q) or prefill_attention_kernel() is None:
        return None
    if math_dtype is None or queries < PROMPT_MATH_MIN_QUERIES:
        return "fp32"
    if math_dtype == torch.bfloat16 and bf16_way() == "avx512_bf16" and bf16_products():
        return "bf16"
    return None
