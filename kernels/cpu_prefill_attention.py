"""Prompt attention of packed sequences on CPU, in C++ (`csrc/prefill_attention.cpp`).

PyTorch's CPU flash attention runs a prompt of ~100 tokens at a small fraction of the FMA
units' rate (per-call work is tiny and it is called once per sequence and layer). The kernel
takes every sequence of a forward in one call: each sequence's queries against an optional run
of context keys (a shared prefix, all visible) and then its own keys causally, with the grouped
query heads of a kv head in one register tile. fp32 in and out; same result as
`paged_attention.attend` up to float rounding. Built with the other CPU kernels by
`cpu_extension.cpu_ops()`.
"""

from __future__ import annotations

from typing import Callable

import torch

from llmopt.kernels.cpu_extension import cpu_ops

HEAD_DIM_MULTIPLE = 16  # the kernel's register tiles: head_dim must be a multiple


def prefill_attention_kernel() -> Callable | None:
    """`prefill_attention(q, k, v, segments, scale, sliding_window)`, or None where the CPU kernels cannot be
    built. q [Tq, H, D], k and v [Tk, KVH, D] fp32; segments int64 [S, 5], per sequence (q_start, q_len,
    ctx_start, ctx_len, own_start); sliding_window 0 for none."""
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
