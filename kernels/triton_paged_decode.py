"""Paged decode attention in Triton: one query token per sequence, K/V read in place.

Same semantics as `paged_attention.paged_decode_attention` + `decode_mask` (the reference):
the query of a sequence with `len` keys sits at position len-1 and sees keys 0..len-1, and
with a sliding window only keys with position > len-1-window. K/V live in per-layer pools
`[num_blocks * block_size, kv_heads, head_dim]` (slot = block_id * block_size + offset),
possibly narrower than the queries (widened to the query dtype as they are loaded), or
float8_e4m3fn with a per-layer scale (read as stored * k_scale / v_scale, in fp32).

Grid of the main kernel: (sequence, kv_head, split). One program holds all query heads of
one KV head (grouped-query attention), so each K/V row is loaded once per KV head, and
looks every key's slot up through the block table (no gather into a fresh tensor).
Split-KV (flash-decoding): with few sequences the (sequence, kv_head) grid is far smaller
than the GPU, so each sequence's key range is cut into `num_splits` pieces; each program
writes its piece's normalised output and log-sum-exp, and `_merge_splits` combines them.
With one split the main kernel writes the output directly and no merge runs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmopt.kernels.triton_attention_tiles import kv_slots, load_kv, pv_product, qk_scores

# Below this many keys per split, the merge pass and the partial-output traffic cost more
# than the extra parallelism buys.
MIN_KEYS_PER_SPLIT = 256
# Bounds the partial-output buffer ([batch, heads, splits, head_dim] fp32) and the merge loop.
MAX_SPLITS = 32
# Programs wanted per streaming multiprocessor: two keeps every SM busy while one program
# waits on memory (decode is bandwidth bound).
PROGRAMS_PER_SM = 2
# keys per tile: tl.dot needs every dimension >= 16 on GPUs
BLOCK_N = 32


def choose_num_splits(batch: int, kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many pieces to cut each sequence's keys into (1 = no split-KV).

    Enough (sequence, kv_head, split) programs to give every SM `PROGRAMS_PER_SM` of them,
    but never fewer than `MIN_KEYS_PER_SPLIT` keys per split nor more than `MAX_SPLITS`:
    a large batch or a short context gets 1, a long context at batch 1 gets many.
    """
    programs = batch * kv_heads
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)  # ceil: splits that fill the GPU
    by_length = max(1, max_context_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter (CPU tensors): parallelism does not matter, keep one split


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in exp2
    k_scale, v_scale,  # an fp8 pool's dequantisation scales (stored = value / scale)
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,  # partial output [batch, heads, splits, head_dim]
    stride_lb, stride_lh,  # partial lse [batch, heads, splits]
    window,  # sliding window, 0 = none
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16, a power of two (tl.dot's smallest tile)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr,  # fp32 queries: exact fp32 products, not TF32
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    length = tl.load(lens_ptr + seq)
    # the window keeps keys with position > length-1-window, i.e. >= length-window
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    # whole tiles per split, so only the last tile of each split is partial
    per_split = tl.cdiv(tl.cdiv(length - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, length)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 domain)
    s = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        key_ok = pos < end
        slot = kv_slots(tables_ptr, seq, stride_tb, pos, key_ok, BLOCK_SIZE)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = load_kv(k_ptr, slot, kv_head, stride_ks, stride_kh, dims, kv_mask, k_scale, q)
        scores = qk_scores(q, k, FP32_DOT)
        scores = tl.where(key_ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)  # m = -inf on the first tile: alpha = 0, acc is 0 anyway
        v = load_kv(v_ptr, slot, kv_head, stride_vs, stride_vh, dims, kv_mask, v_scale, q)
        pv = pv_product(p, v, FP32_DOT)
        acc = acc * alpha[:, None] + pv
        s = s * alpha + tl.sum(p, 1)
        m = m_new

    # an empty split (its range lies past the sequence's end) leaves s = 0: output 0, lse -inf
    safe_s = tl.where(s > 0, s, 1.0)
    out = acc / safe_s[:, None]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        base = seq * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + base[:, None] + dims[None, :], out, mask=out_mask)
        lse = tl.where(s > 0, m + tl.log2(safe_s), float("-inf"))
        tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """out = sum_i w_i * out_i with w_i = 2^(lse_i - lse_max) / sum_j 2^(lse_j - lse_max)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < NUM_SPLITS
    base = seq * stride_pb + head * stride_ph
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_ok, other=float("-inf"))
    # the first split always holds keys (every sequence has >= 1): lse_max is finite
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + base + splits[:, None] * stride_ps + dims[None, :],
                    mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, sliding_window: int | None = None, num_splits: int | None = None,
                           max_context_len: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence, through the block tables.

    q [batch, heads, head_dim]; k_cache/v_cache [slots, kv_heads, head_dim] (any dtype that
    converts to q's); block_tables [batch, width] int32 block ids (padding entries never
    read); context_lens [batch] keys per sequence (>= 1, the new token included).
    Returns [batch, heads, head_dim] in q's dtype. `num_splits`: force split-KV (default:
    `choose_num_splits`); `max_context_len`: max(context_lens) if the caller knows it
    (saves a device sync; only the split heuristic uses it). `k_scale`/`v_scale`: an fp8
    (e4m3) pool's scales, keys read as stored * k_scale (other pools ignore them).
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    assert heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert sliding_window is None or sliding_window >= 1
    group = heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        num_splits = choose_num_splits(batch, kv_heads, max_context_len, _num_sms(q.device))
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot: every dimension >= 16
    if num_splits > 1:
        part_out = torch.empty(batch, heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    strides_p = (*part_out.stride()[:3], *part_lse.stride()[:2]) if num_splits > 1 else (0,) * 5
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * math.log2(math.e), float(k_scale), float(v_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *strides_p,
        sliding_window or 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits,
        FP32_DOT=q.dtype == torch.float32,
    )
    if num_splits > 1:
        _merge_splits[(batch, heads)](
            part_out, part_lse, out, *strides_p, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        )
    return out
