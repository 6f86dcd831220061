"""Attention back ends: how a layer's new K/V are stored and how queries read them.

The decoder works on a flat batch: the new tokens of several sequences packed one after
another. An `AttentionBackend` knows, for the current step, which slice of the batch
belongs to which sequence and how many tokens each sequence already has cached. The
paged runtime supplies a back end that reads K/V through block tables; this module has
the simple contiguous one (one preallocated K/V strip per sequence) used by
`llmopt generate` and the correctness tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from llmopt.kernels import cpu_prefill_attention
from llmopt.kernels.paged_attention import PROMPT_MATH_MIN_QUERIES, attend, causal_mask, sdpa_math


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], RoPE applied
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        sliding_window: int | None,
        math_dtype: torch.dtype | None = None,  # prompt-sized fp32 chunks' SDPA dtype (kernels.paged_attention.attend)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


class ContiguousKVCache(AttentionBackend):
    """One preallocated K/V strip of `max_seq_len` tokens per sequence slot.

    Call `begin_step(slots, query_lens)` before each model forward and `end_step()` after
    it; the flat batch must hold the new tokens of `slots` in that order.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        num_slots: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_slots, max_seq_len, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self.cached_lens = [0] * num_slots
        self._slots: list[int] = []
        self._query_lens: list[int] = []

    def begin_step(self, slots: list[int], query_lens: list[int]) -> None:
        for slot, qlen in zip(slots, query_lens):
            if self.cached_lens[slot] + qlen > self.max_seq_len:
                raise ValueError(f"slot {slot} would exceed max_seq_len={self.max_seq_len}")
        self._slots, self._query_lens = list(slots), list(query_lens)

    def end_step(self) -> None:
        for slot, qlen in zip(self._slots, self._query_lens):
            self.cached_lens[slot] += qlen

    def forward(self, layer_idx, q, k, v, sliding_window, math_dtype=None):
        out = torch.empty_like(q)
        start = 0
        for slot, qlen in zip(self._slots, self._query_lens):
            end = start + qlen
            ctx = self.cached_lens[slot]
            self.k_cache[layer_idx, slot, ctx : ctx + qlen] = k[start:end]
            self.v_cache[layer_idx, slot, ctx : ctx + qlen] = v[start:end]
            keys = self.k_cache[layer_idx, slot, : ctx + qlen]
            values = self.v_cache[layer_idx, slot, : ctx + qlen]
            mask, is_causal = causal_mask(qlen, ctx, sliding_window, q.device)
            out[start:end] = attend(q[start:end], keys, values, mask, is_causal, math_dtype)
            start = end
        return out


class EqualLengthAttention(AttentionBackend):
    """Causal attention over `num_seqs` whole sequences of equal length packed flat, no cache.

    For passes over fixed windows of text (calibration, perplexity): one call, of the C++ prompt attention
    kernel for fp32 on CPU (`kernels/cpu_prefill_attention.py`), else of batched SDPA.
    """

    def __init__(self, num_seqs: int, seq_len: int):
        self.num_seqs, self.seq_len = num_seqs, seq_len
        self._segments: torch.Tensor | None = None  # the C++ kernel's, the same for every layer

    def forward(self, layer_idx, q, k, v, sliding_window, math_dtype=None):
        b, t = self.num_seqs, self.seq_len
        math = cpu_prefill_attention.kernel_math(q, math_dtype, t)
        if math is not None:  # fp32 queries on CPU: the C++ kernel (fp32 or bf16 products), all in one call
            if self._segments is None:
                self._segments = cpu_prefill_attention.equal_length_segments(b, t)
            return cpu_prefill_attention.prefill_attention_kernel()(q, k, v, self._segments, q.shape[-1] ** -0.5,
                                                                    sliding_window or 0, math == "bf16")
        shape = lambda a: a.reshape(b, t, a.shape[1], a.shape[2]).transpose(1, 2)  # noqa: E731
        mask, is_causal = causal_mask(t, 0, sliding_window, q.device)
        mq, mk, mv = sdpa_math(q, k, v, math_dtype if t >= PROMPT_MATH_MIN_QUERIES else None)
        out = F.scaled_dot_product_attention(shape(mq), shape(mk), shape(mv), attn_mask=mask, is_causal=is_causal,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[2]).to(q.dtype)
