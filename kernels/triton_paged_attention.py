"""Paged attention in Triton for CUDA: K/V writes, decode and (chunked) prefill.

The entry points the runtime's attention backend needs, with the reference semantics of
`paged_attention.py` (the pure-PyTorch path, kept as the CPU fallback):
  `write_kv`                 store new K/V rows at their slots (this file)
  `paged_decode_attention`   one query per sequence, split-KV (`triton_paged_decode.py`)
  `paged_prefill_attention`  varlen prompt chunks over a cached prefix (`triton_paged_prefill.py`)
Pools are per layer `[num_blocks * block_size, kv_heads, head_dim]`, slot = block_id *
block_size + offset, in the model's dtype or a narrower one (rounded on write, widened on read).
Importing this module imports triton: on CPU tensors the kernels run only under the
Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.kernels.triton_paged_decode import choose_num_splits, paged_decode_attention
from llmopt.kernels.triton_paged_prefill import paged_prefill_attention

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "choose_num_splits"]


@triton.jit
def _to_pool_dtype(x, dtype: tl.constexpr):
    """x converted to `dtype`, rounding to nearest even like torch's .to().

    For bf16 the rounding is done by hand on the fp32 bits: the Triton interpreter
    truncates fp32 -> bf16 (GPUs round to nearest even), and this way both give torch's bits.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        # add 0x7FFF plus the lowest kept bit: ties go to the even neighbour
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = x != x  # keep NaN a NaN (the addition could carry it into the sign bit)
        rounded = tl.where(nan, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _write_kv_kernel(
    k_cache_ptr, v_cache_ptr, slots_ptr, k_ptr, v_ptr,
    stride_cs, stride_ch,  # k_cache and v_cache share one layout
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token (vLLM's convention): nothing to store
        return
    dims = tl.arange(0, HEAD_DIM_PAD)
    ok = dims < HEAD_DIM
    dst = slot * stride_cs + head * stride_ch + dims
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=ok)
    tl.store(k_cache_ptr + dst, _to_pool_dtype(k, k_cache_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=ok)
    tl.store(v_cache_ptr + dst, _to_pool_dtype(v, v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new keys/values [num_tokens, kv_heads, head_dim] at their slots (slot_mapping
    [num_tokens]; a negative slot is skipped), converted to the cache's dtype."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    _write_kv_kernel[(num_tokens, kv_heads)](
        k_cache, v_cache, slot_mapping, k, v,
        k_cache.stride(0), k_cache.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
