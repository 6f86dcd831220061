"""Paged prefill / chunked-prefill attention in Triton: varlen over a flat batch of chunks.

Same semantics as `paged_attention.paged_prefill_attention` + `prefill_mask` (the reference),
for several sequences in one call: sequence n's chunk is rows cu_seqlens_q[n]:cu_seqlens_q[n+1]
of q, after context_lens[n] tokens already cached. Query i of the chunk sits at absolute
position context_len + i and sees keys 0..context_len+i (causal within the chunk, the whole
cached prefix before it), and with a sliding window only keys with position - key < window.
The chunk's own K/V must already be in the pool (`write_kv` first).

Grid: (sequence, kv_head, query tile). A program's rows are (query token, query head of
that KV head) pairs — row r is token r // GROUP, head r % GROUP — so all the query heads
sharing a KV head (grouped-query attention) read each K/V tile once, and the tile stays a
tl.dot-sized matrix even for a one-token chunk with few heads. Keys are looked up slot by
slot through the block table, read in place and widened to the query dtype (an fp8
pool's values multiplied by its scale first).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmopt.kernels.triton_attention_tiles import kv_slots, load_kv, pv_product, qk_scores

BLOCK_M = 64  # (query token, head) rows per program
BLOCK_N = 32  # keys per tile


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, cu_q_ptr, ctx_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in exp2
    k_scale, v_scale,  # an fp8 pool's dequantisation scales (stored = value / scale)
    window,  # sliding window, 0 = none
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_tb,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,  # fp32 queries: exact fp32 products, not TF32
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # query tokens per program

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    first_q = tile * TOKENS
    if first_q >= q_len:  # the grid covers the longest chunk; shorter ones end early
        return
    last_q = tl.minimum(first_q + TOKENS, q_len)  # exclusive

    rows = tl.arange(0, BLOCK_M)
    token = first_q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (token < last_q)
    q_pos = ctx + token  # absolute position of each row's query
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    io_offs = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + io_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # keys this tile can see: up to its last query; from its first query's window start
    hi = ctx + last_q
    lo = tl.where(window > 0, tl.maximum(ctx + first_q - window + 1, 0), 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    s = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        slot = kv_slots(tables_ptr, seq, stride_tb, pos, key_ok, BLOCK_SIZE)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = load_kv(k_ptr, slot, kv_head, stride_ks, stride_kh, dims, kv_mask, k_scale, q)
        scores = qk_scores(q, k, FP32_DOT)
        allowed = row_ok[:, None] & key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        allowed &= (window <= 0) | (q_pos[:, None] - pos[None, :] < window)
        scores = tl.where(allowed, scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # a row may see no key in this tile yet (causal / window): keep exp2 away from -inf - -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        v = load_kv(v_ptr, slot, kv_head, stride_vs, stride_vh, dims, kv_mask, v_scale, q)
        pv = pv_product(p, v, FP32_DOT)
        acc = acc * alpha[:, None] + pv
        s = s * alpha + tl.sum(p, 1)
        m = m_new

    out = acc / tl.where(s > 0, s, 1.0)[:, None]  # s = 0 only on padding rows, never stored
    out_offs = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_meta(group: int, head_dim: int, block_size: int, q_dtype: torch.dtype) -> dict:
    """The constexprs of `_prefill_kernel` for one launch (what the launcher passes)."""
    return dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, FP32_DOT=q_dtype == torch.float32)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_size: int, scale: float, sliding_window: int | None = None,
                            max_query_len: int | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
    """Attention for a flat batch of prompt chunks, through the block tables.

    q [total_tokens, heads, head_dim]: the chunks of all sequences back to back;
    cu_seqlens_q [num_seqs + 1] int32 chunk boundaries in q; context_lens [num_seqs] tokens
    cached before each chunk; block_tables [num_seqs, width] int32 covering context_len +
    chunk length tokens; k_cache/v_cache [slots, kv_heads, head_dim], the chunks' own K/V
    already written. Returns [total_tokens, heads, head_dim] in q's dtype.
    `max_query_len`: the longest chunk if the caller knows it (saves a device sync).
    `k_scale`/`v_scale`: an fp8 (e4m3) pool's scales, keys read as stored * k_scale (other
    pools ignore them).
    """
    total, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    assert heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert sliding_window is None or sliding_window >= 1
    group = heads // kv_heads
    assert group <= BLOCK_M, f"at most {BLOCK_M} query heads per KV head"
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if total == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    tiles = triton.cdiv(max_query_len, BLOCK_M // group)
    _prefill_kernel[(num_seqs, kv_heads, tiles)](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        scale * math.log2(math.e), float(k_scale), float(v_scale), sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        **prefill_meta(group, head_dim, block_size, q.dtype),
    )
    return out
