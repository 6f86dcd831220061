"""Paged attention in plain PyTorch: the CPU path and the reference for the Triton kernel.

K/V for one layer live in a flat slot array `[num_slots, num_kv_heads, head_dim]`, where
slot = block_id * block_size + offset. A sequence's keys are gathered through its slot
indices (derived from its block table), so sequences never need contiguous memory.

The pool may be stored in a narrower dtype than the model computes in (`kv_cache_dtype`,
e.g. bf16 K/V for an fp32 model, or fp8 e4m3 with scale 1): K/V are rounded to it when
written and widened back to the query's dtype when read, so attention itself runs in the
query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new keys/values [num_tokens, kv_heads, head_dim] at their slots, converted to
    the cache's dtype (round to nearest even for bf16/fp16)."""
    # index_copy_ needs matching dtypes; .to() is a no-op when they already match
    for cache, new in ((k_cache, k), (v_cache, v)):
        new = _to_pool(new, cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:  # no fp8 index_copy_ on CPU: copy the bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.index_copy_(0, slot_mapping, new)


def select_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, index), also for fp8 pools (gathered as bytes: PyTorch has no fp8
    index_select on CPU)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8).index_select(0, index).view(cache.dtype)
    return cache.index_select(0, index)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the pool's dtype; into fp8 e4m3 saturated at +-448 (a plain cast makes NaN of larger
    values), as the Triton write_kv does."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def decode_mask(context_lens: torch.Tensor, max_len: int, sliding_window: int | None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[batch, 1, 1, max_len] additive mask (0 = attend, -inf = not) for one query per sequence
    at position len-1. Additive, not boolean: CPU SDPA runs ~1.8x faster with it."""
    key_pos = torch.arange(max_len, device=context_lens.device)[None, :]
    allowed = key_pos < context_lens[:, None]
    if sliding_window is not None:
        allowed &= key_pos > (context_lens[:, None] - 1 - sliding_window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=context_lens.device).masked_fill_(~allowed, float("-inf"))
    return mask[:, None, None, :]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query token per sequence.

    q [batch, heads, head_dim]; block_tables [batch, width] block ids (rows padded with
    any written block: padding is masked); mask [batch, 1, 1, width * block_size] from
    `decode_mask`, in q's dtype. Returns [batch, heads, head_dim] in q's dtype; the gathered
    K/V are converted to it when the cache holds another dtype.

    Whole blocks are gathered (one copy of block_size rows each, not one per token), and
    grouped-query heads are folded into the query length — q as [batch, kv_heads,
    heads_per_kv, head_dim] — so K/V are never repeated per query head.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    width = block_tables.shape[1]
    block_size = mask.shape[-1] // width
    # index_select, not advanced indexing: ~5x faster for this gather on CPU
    flat = block_tables.reshape(-1)
    keys = select_rows(k_cache.view(-1, block_size, kv_heads, head_dim), flat)  # [batch*width, bs, kvh, d]
    values = select_rows(v_cache.view(-1, block_size, kv_heads, head_dim), flat)
    # SDPA needs one dtype: convert the gathered blocks (a fresh tensor already), not the pool
    keys = keys.view(batch, width * block_size, kv_heads, head_dim).to(q.dtype).transpose(1, 2)
    values = values.view(batch, width * block_size, kv_heads, head_dim).to(q.dtype).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.view(batch, kv_heads, heads // kv_heads, head_dim), keys, values,
                                         attn_mask=mask)
    return out.reshape(batch, heads, head_dim)


def prefill_mask(query_len: int, context_len: int, sliding_window: int | None,
                 device: torch.device) -> torch.Tensor | None:
    """Boolean [query_len, context_len + query_len] mask (True = may attend), or None if all True.

    Query i sits at absolute position context_len + i and sees keys j <= that position,
    and with a sliding window only keys with position - j < window.
    """
    total = context_len + query_len
    if query_len == 1 and (sliding_window is None or total <= sliding_window):
        return None
    q_pos = torch.arange(context_len, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


def causal_mask(query_len: int, context_len: int, sliding_window: int | None,
                device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """SDPA's (attn_mask, is_causal) for a chunk of `query_len` tokens after `context_len` cached ones:
    `is_causal` where the chunk starts its sequence and no window cuts it (SDPA then skips the blocks
    above the diagonal instead of reading a mask: ~1.2x faster at 512 tokens on CPU), else `prefill_mask`."""
    if context_len == 0 and query_len > 1 and (sliding_window is None or query_len <= sliding_window):
        return None, True
    return prefill_mask(query_len, context_len, sliding_window, device), False


# Queries per chunk from which `math_dtype` applies: prompt-sized chunks, as for the dense layers'
# bf16 prompt products (kernels/cpu_linear.py SKINNY_MAX_ROWS); decode steps stay in q's dtype.
PROMPT_MATH_MIN_QUERIES = 96


def sdpa_math(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, math_dtype: torch.dtype | None):
    """q, keys, values in the dtype SDPA should compute in: `math_dtype` for a prompt-sized fp32 chunk
    on CPU (bf16: PyTorch's CPU flash attention runs its products on AMX / AVX512-BF16, ~2.7x fp32 at
    512 tokens on a Sapphire Rapids core), else unchanged."""
    if (math_dtype is None or q.dtype != torch.float32 or q.device.type != "cpu"
            or q.shape[-3] < PROMPT_MATH_MIN_QUERIES):
        return q, keys, values
    return q.to(math_dtype), keys.to(math_dtype), values.to(math_dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool = False, math_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [Lq, H, D], keys/values [Lk, KVH, D] -> [Lq, H, D] in q's dtype; grouped-query heads shared.
    `mask` and `is_causal` as `causal_mask` gives them; `math_dtype` as `sdpa_math` applies it."""
    mq, mk, mv = sdpa_math(q, keys, values, math_dtype)
    out = F.scaled_dot_product_attention(
        mq.transpose(0, 1).unsqueeze(0),
        mk.transpose(0, 1).unsqueeze(0),
        mv.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out.squeeze(0).transpose(0, 1).to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: torch.Tensor, context_len: int, sliding_window: int | None,
                            math_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A chunk of `query_len` tokens of one sequence after `context_len` cached ones.

    q [query_len, heads, head_dim]; slots [context_len + query_len] the slots of all its
    keys in order (the chunk's own K/V already written). Returns [query_len, heads, head_dim];
    K/V read from a cache of another dtype are converted to q's (`math_dtype`: see `attend`).
    """
    mask, is_causal = causal_mask(q.shape[0], context_len, sliding_window, q.device)
    keys = select_rows(k_cache, slots).to(q.dtype)
    values = select_rows(v_cache, slots).to(q.dtype)
    return attend(q, keys, values, mask, is_causal, math_dtype)
