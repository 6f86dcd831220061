"""The K/V-tile steps the Triton decode and prefill kernels share (`triton_paged_decode.py`,
`triton_paged_prefill.py`): look a tile of key positions up through the block table, load a
K or V tile from the pool in place, and the two products of a flash-attention step."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_slots(tables_ptr, seq, stride_tb, pos, key_ok, BLOCK_SIZE: tl.constexpr):
    """Each key position's slot through sequence `seq`'s block table: blocks need not be contiguous."""
    block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=key_ok, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def load_kv(ptr, slot, kv_head, stride_s, stride_h, dims, mask, scale, like):
    """A [keys, head_dim] K or V tile of KV head `kv_head`, in `like`'s dtype; an fp8 pool's values
    are multiplied by its scale in fp32 first."""
    x = tl.load(ptr + slot[:, None] * stride_s + kv_head * stride_h + dims[None, :], mask=mask, other=0.0)
    if ptr.dtype.element_ty == tl.float8e4nv:
        x = x.to(tl.float32) * scale
    return x.to(like.dtype)


@triton.jit
def qk_scores(q, k, FP32_DOT: tl.constexpr):
    """q @ k^T in fp32; exact fp32 products for fp32 queries (no tf32)."""
    if FP32_DOT:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def pv_product(p, v, FP32_DOT: tl.constexpr):
    """p @ v, p (fp32 softmax weights) rounded to v's dtype for 16-bit pools."""
    if FP32_DOT:
        return tl.dot(p, v, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)
