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
than the GPU, so each sequence's key range is cut into up to `num_splits` pieces; each program
writes its piece's normalised output and log-sum-exp, and `_merge_splits` combines them.
With one split the main kernel writes the output directly and no merge runs.

The split count is a compile-time constant chosen from the batch-size bucket alone (as vLLM's
fixed 16 KV segments), never from the context lengths: a serving loop whose contexts grow
compiles one variant per bucket, not one per length. How many of its splits a sequence uses
is decided in the kernel from its own length (at least `MIN_KEYS_PER_SPLIT` keys each); the
unused ones store an empty piece. The partials live in a `DecodeWorkspace` the caller keeps,
so a step allocates nothing.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmopt.kernels.triton_attention_tiles import kv_slots, load_kv, pv_product, qk_scores

# Below this many keys per split, the merge pass and the partial-output traffic cost more
# than the extra parallelism buys (applied per sequence, in the kernel).
MIN_KEYS_PER_SPLIT = 256
# Bounds the partial-output buffer ([batch, heads, splits, head_dim] fp32) and the merge loop.
MAX_SPLITS = 32
# Every split count `choose_num_splits` can return: the NUM_SPLITS variants a GPU compiles.
SPLIT_CHOICES = tuple(2 ** i for i in range(MAX_SPLITS.bit_length()))
# Programs wanted per streaming multiprocessor: two keeps every SM busy while one program
# waits on memory (decode is bandwidth bound).
PROGRAMS_PER_SM = 2
# keys per tile: tl.dot needs every dimension >= 16 on GPUs
BLOCK_N = 32


def batch_bucket(batch: int) -> int:
    """The power of two >= batch: decode batches of one bucket share a split count."""
    return 1 << max(0, batch - 1).bit_length()


def choose_num_splits(batch: int, kv_heads: int, num_sms: int) -> int:
    """How many pieces each sequence's keys may be cut into (1 = no split-KV), a power of two.

    Enough (sequence, kv_head, split) programs for the batch's bucket to give every SM
    `PROGRAMS_PER_SM` of them, at most `MAX_SPLITS`: a large batch gets 1, batch 1 many.
    The context length plays no part (see the module docstring); the kernel keeps short
    sequences to fewer splits.
    """
    programs = batch_bucket(batch) * kv_heads
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)  # ceil: splits that fill the GPU
    return min(1 << (max(1, wanted).bit_length() - 1), MAX_SPLITS)  # rounded down to a power of two


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter (CPU tensors): parallelism does not matter, keep one split


def decode_meta(group: int, head_dim: int, block_size: int, num_splits: int, q_dtype: torch.dtype) -> dict:
    """The constexprs of `_decode_split_kernel` for one launch (what the launcher passes)."""
    return dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
                HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
                BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits,
                FP32_DOT=q_dtype == torch.float32)


def merge_meta(head_dim: int, num_splits: int) -> dict:
    """The constexprs of `_merge_splits` (launched only for num_splits > 1)."""
    return dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
                NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)))


def head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot: every dimension >= 16


class DecodeWorkspace:
    """The split-KV partials (output [batch, heads, splits, head_dim_pad] and log-sum-exp
    [batch, heads, splits], fp32), kept between calls in one buffer that grows when a call
    needs more: steady-state decode allocates nothing, and the views keep their addresses."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def reserve(self, batch: int, heads: int, num_splits: int, head_dim: int, device: torch.device) -> None:
        """Grow now to hold a call of this size (e.g. the largest bucket, before capturing graphs)."""
        need = batch * heads * num_splits * (head_dim_pad(head_dim) + 1)
        if self.buffer is None or self.buffer.numel() < need or self.buffer.device != torch.device(device):
            self.buffer = torch.empty(need, dtype=torch.float32, device=device)

    def partials(self, batch: int, heads: int, num_splits: int, head_dim: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        self.reserve(batch, heads, num_splits, head_dim, device)
        n_out = batch * heads * num_splits * head_dim_pad(head_dim)
        part_out = self.buffer[:n_out].view(batch, heads, num_splits, head_dim_pad(head_dim))
        part_lse = self.buffer[n_out:n_out + batch * heads * num_splits].view(batch, heads, num_splits)
        return part_out, part_lse


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
    min_keys,  # fewest keys per used split (1: every sequence uses all NUM_SPLITS)
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
    # this sequence's splits: NUM_SPLITS, fewer for a short one (the rest stay empty)
    used = tl.minimum(tl.maximum((length - first) // min_keys, 1), NUM_SPLITS)
    # whole tiles per split, so only the last tile of each split is partial
    per_split = tl.cdiv(tl.cdiv(length - first, used), BLOCK_N) * BLOCK_N
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

    # an empty split (past `used`, or past the end) leaves s = 0: output 0, lse -inf, weight 0 in the merge
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
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           workspace: DecodeWorkspace | None = None) -> torch.Tensor:
    """One query token per sequence, through the block tables.

    q [batch, heads, head_dim]; k_cache/v_cache [slots, kv_heads, head_dim] (any dtype that
    converts to q's); block_tables [batch, width] int32 block ids (padding entries never
    read); context_lens [batch] int32 keys per sequence (>= 1, the new token included).
    Returns [batch, heads, head_dim] in q's dtype. `num_splits`: cut every sequence into
    exactly this many pieces (tests; default: `choose_num_splits` for the batch, each
    sequence using as many as its length warrants). `k_scale`/`v_scale`: an fp8 (e4m3)
    pool's scales, keys read as stored * k_scale (other pools ignore them). `workspace`:
    where the split partials go (default: allocated for this call).
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
    min_keys = 1 if num_splits is not None else MIN_KEYS_PER_SPLIT
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, _num_sms(q.device))
    if num_splits > 1:
        part_out, part_lse = (workspace or DecodeWorkspace()).partials(batch, heads, num_splits, head_dim, q.device)
        strides_p = (*part_out.stride()[:3], *part_lse.stride()[:2])
    else:
        part_out = part_lse = out  # unused
        strides_p = (0,) * 5
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * math.log2(math.e), float(k_scale), float(v_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *strides_p,
        sliding_window or 0, min_keys,
        **decode_meta(group, head_dim, block_size, num_splits, q.dtype),
    )
    if num_splits > 1:
        _merge_splits[(batch, heads)](
            part_out, part_lse, out, *strides_p, out.stride(0), out.stride(1), **merge_meta(head_dim, num_splits))
    return out
