"""Storing new K/V rows into the paged pools, in Triton.

Same result as `paged_attention.write_kv` (the reference): row i of k/v goes to slot
slot_mapping[i] of the pool `[slots, kv_heads, head_dim]`, converted to the pool's dtype
and rounded to nearest even. An fp8 (e4m3) pool stores value / scale with a per-layer
scale (`k_scale`, `v_scale`), saturated to e4m3's +-448; readers multiply by the scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn
# Triton refuses e4m3 (fp8e4nv) below compute capability 8.9 (Ada, Hopper): on an A100 an fp8 pool
# does not compile (tests/test_triton_compile.py), so the runtime refuses it there
FP8_MIN_ARCH = 89


@triton.jit
def _round_to_bf16(x):
    """fp32 -> bf16, to nearest even, by hand on the bits: the Triton interpreter truncates
    fp32 -> bf16 (GPUs round to nearest even); this way both give torch's values."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    # add 0x7FFF plus the lowest kept bit: ties go to the even neighbour
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays NaN (the carry could reach the sign bit)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_to_e4m3(x):
    """fp32 -> float8_e4m3fn, to nearest even, saturating at +-448 (NaN stays NaN).

    Rounded by hand to a value e4m3 holds exactly, then converted (exact everywhere): the
    Triton interpreter's own conversion drops the carry when rounding up crosses a power
    of two (31.9 -> 16), flushes subnormals and turns NaN into a number.
    """
    a = tl.abs(x)
    # normal range: keep 3 of fp32's 23 mantissa bits; the carry runs into the exponent
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 is subnormal, a multiple of 2^-9: an fp32 sum near 2^14 rounds to that grid
    subnormal = (a + 16384.0) - 16384.0
    r = tl.minimum(tl.where(a < 0.015625, subnormal, normal), 448.0)
    r = tl.where(x < 0, -r, r).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    r = tl.where(x != x, 0x7F, r)  # e4m3fn's NaN, set by bits (the interpreter casts NaN to a number)
    return r.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _store_row(cache_ptr, offs, x, scale, mask):
    dtype = cache_ptr.dtype.element_ty
    if dtype == tl.float8e4nv:
        stored = _round_to_e4m3(x.to(tl.float32) / scale)
    elif dtype == tl.bfloat16:
        stored = _round_to_bf16(x)
    else:
        stored = x.to(dtype)
    tl.store(cache_ptr + offs, stored, mask=mask)


@triton.jit
def _write_kv_kernel(
    k_cache_ptr, v_cache_ptr, slots_ptr, k_ptr, v_ptr,
    k_scale, v_scale,
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
    _store_row(k_cache_ptr, dst, tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=ok), k_scale, ok)
    _store_row(v_cache_ptr, dst, tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=ok), v_scale, ok)


def write_kv_meta(head_dim: int) -> dict:
    """The constexprs of `_write_kv_kernel` (what `write_kv` passes)."""
    return dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new keys/values [num_tokens, kv_heads, head_dim] at their slots (slot_mapping
    [num_tokens]; a negative slot is skipped), converted to the cache's dtype.
    `k_scale`/`v_scale` apply to an fp8 pool only: it stores value / scale."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    _write_kv_kernel[(num_tokens, kv_heads)](
        k_cache, v_cache, slot_mapping, k, v,
        float(k_scale), float(v_scale),
        k_cache.stride(0), k_cache.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        **write_kv_meta(head_dim),
    )
