"""Attention over the model runner's paged K/V pools: one step's layout (`StepMetadata`) and the
implementations a kernel backend hands the runner (`KernelBackend.paged_attention`).

The pools are one `[num_blocks * block_size, kv_heads, head_dim]` slot array per layer for K
and one for V, possibly narrower than the queries (write_kv rounds K/V into them, reads widen
them back). Decodes (single-token sequences) come first in the flat batch, prompt chunks after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from llmopt.kernels import cpu_prefill_attention
from llmopt.kernels.paged_attention import (decode_mask, paged_decode_attention, paged_prefill_attention, select_rows,
                                          write_kv)
from llmopt.model.attention import AttentionBackend


@dataclass
class StepMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V go
    num_decodes: int  # the first num_decodes tokens are single-token sequences
    decode_block_tables: torch.Tensor | None  # [num_decodes, width] padded block tables
    decode_lens: torch.Tensor | None  # [num_decodes] keys per decode (incl. the new token), tables' dtype
    block_size: int = 16
    dtype: torch.dtype = torch.float32  # the model's (queries', masks') dtype, not necessarily the cache's
    # per prompt chunk: (start, end) in the batch, its key slots (None where the backend reads the
    # prefill tables below instead: `needs_prefill_tables`), tokens already cached
    prefills: list[tuple[int, int, torch.Tensor | None, int]] = field(default_factory=list)
    # the prompt chunks as the Triton prefill kernel takes them (after the decodes in the batch):
    # [chunks, width] int32 block tables, [chunks + 1] int32 boundaries, [chunks] cached tokens
    prefill_block_tables: torch.Tensor | None = None
    prefill_cu_seqlens: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    max_prefill_len: int = 0  # the longest prompt chunk
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window not in self._masks:
            width = self.decode_block_tables.shape[1] * self.block_size
            self._masks[sliding_window] = decode_mask(self.decode_lens, width, sliding_window, self.dtype)
        return self._masks[sliding_window]


class PagedAttention(AttentionBackend):
    """The PyTorch path (`llmopt.kernels.paged_attention`): K/V written into the pools, decodes in
    one batched call, prompt chunks one sequence at a time.

    `cpu_decode`: the C++ decode kernel (`llmopt.kernels.cpu_paged_attention`, handed in by the
    CPU backend for fp32 queries) that reads K/V from the pools without a gather; None: the
    PyTorch decode. `cpu_prefill`: the C++ prompt attention kernel (`llmopt.kernels.cpu_prefill_attention`,
    also for fp32 queries) for prompt chunks in the math it has (`cpu_prefill_attention.kernel_math`); None: SDPA.
    """

    block_table_dtype = torch.int64  # of block tables and context lengths: what the C++ decode kernel reads
    needs_prefill_tables = False  # whether the step's prompt chunks come as `StepMetadata.prefill_*` tables
    # whether a decode step's launches depend on nothing but its tensors (CUDA graphs may replay them)
    supports_cuda_graphs = False

    def __init__(self, k_caches: torch.Tensor, v_caches: torch.Tensor, cpu_decode: Callable | None = None,
                 cpu_prefill: Callable | None = None):
        self.k_caches = k_caches  # [layers, slots, kv_heads, head_dim]
        self.v_caches = v_caches
        self.metadata: StepMetadata | None = None
        self.cpu_decode = cpu_decode
        self.cpu_prefill = cpu_prefill

    def _decode(self, q, k_cache, v_cache, md: StepMetadata, sliding_window: int | None) -> torch.Tensor:
        if self.cpu_decode is not None:
            return self.cpu_decode(q.contiguous(), k_cache, v_cache, md.decode_block_tables, md.decode_lens,
                                   md.block_size, q.shape[-1] ** -0.5, -1 if sliding_window is None else sliding_window)
        return paged_decode_attention(q, k_cache, v_cache, md.decode_block_tables, md.decode_mask(sliding_window))

    def forward(self, layer_idx, q, k, v, sliding_window, math_dtype=None):
        md = self.metadata
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        write_kv(k_cache, v_cache, md.slot_mapping, k, v)
        if not md.prefills:
            return self._decode(q, k_cache, v_cache, md, sliding_window)
        out = torch.empty_like(q)
        n = md.num_decodes
        if n:
            out[:n] = self._decode(q[:n], k_cache, v_cache, md, sliding_window)
        for start, end, slots, context_len in md.prefills:
            math = cpu_prefill_attention.kernel_math(q, math_dtype, end - start) if self.cpu_prefill is not None else None
            if math is not None:
                keys, values = select_rows(k_cache, slots).float(), select_rows(v_cache, slots).float()
                segment = cpu_prefill_attention.chunk_segments(end - start, context_len)
                out[start:end] = self.cpu_prefill(q[start:end], keys, values, segment, q.shape[-1] ** -0.5,
                                                  sliding_window or 0, math == "bf16")
            else:
                out[start:end] = paged_prefill_attention(q[start:end], k_cache, v_cache, slots, context_len,
                                                         sliding_window, math_dtype)
        return out


class TritonPagedAttention(PagedAttention):
    """The Triton kernels (`llmopt.kernels.triton_paged_attention`): they read K/V through the
    block tables, and take all prompt chunks of a step in one call."""

    block_table_dtype = torch.int32
    needs_prefill_tables = True
    supports_cuda_graphs = True

    def __init__(self, k_caches: torch.Tensor, v_caches: torch.Tensor):
        super().__init__(k_caches, v_caches)
        from llmopt.kernels import triton_paged_attention  # imports Triton: only once this backend is chosen

        self.triton = triton_paged_attention
        self.decode_workspace = triton_paged_attention.DecodeWorkspace()  # split-KV partials, reused every step

    def forward(self, layer_idx, q, k, v, sliding_window, math_dtype=None):
        md = self.metadata
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        t, n, scale = self.triton, md.num_decodes, q.shape[-1] ** -0.5
        t.write_kv(k_cache, v_cache, md.slot_mapping, k, v)
        decode = (t.paged_decode_attention(q[:n], k_cache, v_cache, md.decode_block_tables, md.decode_lens,
                                           md.block_size, scale, sliding_window, workspace=self.decode_workspace)
                  if n else None)
        if not md.prefills:
            return decode
        prefill = t.paged_prefill_attention(q[n:], k_cache, v_cache, md.prefill_block_tables, md.prefill_cu_seqlens,
                                            md.prefill_context_lens, md.block_size, scale, sliding_window,
                                            max_query_len=md.max_prefill_len)
        return prefill if decode is None else torch.cat([decode, prefill])
