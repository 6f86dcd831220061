"""The decoder's small per-layer ops in Triton, one launch each (vLLM's `rms_norm`,
`fused_add_rms_norm`, `rotary_embedding`, `silu_and_mul`).

Same results as the PyTorch reference (`llmopt/model/ops.py`), which is several launches per op:
- `rms_norm(x, weight, eps)`: x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, then
  times weight (the reference's order), one program per row;
- `add_rms_norm(x, residual, weight, eps)` -> (rms_norm(residual + x), residual + x), the sum
  rounded to x's dtype before it is normalized, as the reference's;
- `rotary(q, k, cos, sin)`: "rotate half" rope on q and k [tokens, heads, head_dim] (strided
  views of the fused qkv output are read in place) with cos/sin [tokens, head_dim], one
  program per token for both; fp32 math, one rounding (the reference rounds each product too);
- `silu_and_mul(gate_up)`: silu(gate) rounded to the dtype, times up (the reference's order).
Outputs are new contiguous tensors in the reference's dtype. bf16 results are rounded to nearest
even by hand (`_round_to_bf16`): Triton's interpreter truncates where GPUs round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.kernels.triton_write_kv import _round_to_bf16

NORM_MAX_BLOCK = 8192  # widest row one program keeps in registers; wider rows take two passes
SILU_BLOCK = 1024  # columns per silu_and_mul program (several programs per row: a decode row fills the GPU)
ROTARY_TILE = 1024  # (heads x half head dim) elements per rotary tile


@triton.jit
def _to(x, dtype: tl.constexpr):
    """x (fp32) in `dtype`, rounded to nearest even on every target."""
    if dtype == tl.bfloat16:
        return _round_to_bf16(x)
    else:
        return x.to(dtype)


@triton.jit
def _row_tile(x_ptr, residual_ptr, residual_out_ptr, row, cols, mask, stride_x, stride_r, stride_ro,
              HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr):
    """A tile of x's row in fp32; with a residual, residual + x rounded to x's dtype (stored where
    STORE_SUM)."""
    x_dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = _to(x, x_dtype)
        if STORE_SUM:
            tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    return x


@triton.jit
def _store_normed(x, rstd, weight_ptr, out_ptr, row, cols, mask, stride_o, x_dtype: tl.constexpr):
    """x * rstd rounded to x's dtype, times the weight, stored (the reference's order)."""
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = _to(x * rstd, x_dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _to(normed * w, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    n_cols, stride_x, stride_r, stride_o, stride_ro,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_dtype = x_ptr.dtype.element_ty
    if ONE_PASS:  # the whole row in one tile, kept in registers
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = _row_tile(x_ptr, residual_ptr, residual_out_ptr, row, cols, mask, stride_x, stride_r, stride_ro,
                      HAS_RESIDUAL, True)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        _store_normed(x, rstd, weight_ptr, out_ptr, row, cols, mask, stride_o, x_dtype)
    else:  # pass 1: sum of squares (storing residual + x); pass 2: normalize
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = _row_tile(x_ptr, residual_ptr, residual_out_ptr, row, cols, mask, stride_x, stride_r, stride_ro,
                          HAS_RESIDUAL, True)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            # the inputs again, not what pass 1 stored: reading that back would need a barrier
            x = _row_tile(x_ptr, residual_ptr, residual_out_ptr, row, cols, mask, stride_x, stride_r, stride_ro,
                          HAS_RESIDUAL, False)
            _store_normed(x, rstd, weight_ptr, out_ptr, row, cols, mask, stride_o, x_dtype)


def norm_meta(n_cols: int, has_residual: bool) -> dict:
    """The constexprs of `_rms_norm_kernel` for rows of `n_cols`."""
    block = min(triton.next_power_of_2(n_cols), NORM_MAX_BLOCK)
    return dict(HAS_RESIDUAL=has_residual, BLOCK=block, ONE_PASS=n_cols <= block)


def norm_warps(block: int) -> int:
    """8 elements per thread, 1 to 16 warps."""
    return min(max(block // 256, 1), 16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D rows with unit column stride (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    out_dtype = torch.promote_types(x.dtype, weight.dtype)  # the reference's `weight * x`
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_cols = x.shape[-1]
    xr = _rows(x)
    if xr.shape[0] == 0:
        return out, summed
    rr = xr if residual is None else _rows(residual)
    out2, sum2 = out.view(-1, n_cols), (out if summed is None else summed).view(-1, n_cols)
    meta = norm_meta(n_cols, residual is not None)
    _rms_norm_kernel[(xr.shape[0],)](
        xr, rr, weight.contiguous(), out2, sum2,
        n_cols, xr.stride(0), rr.stride(0), out2.stride(0), sum2.stride(0),
        float(eps),
        **meta, num_warps=norm_warps(meta["BLOCK"]),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dim (any leading shape); the output in promote(x, weight)'s dtype."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one launch; x and residual of one dtype and shape."""
    if x.dtype != residual.dtype or x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {x.dtype} {tuple(x.shape)} and residual {residual.dtype} "
                         f"{tuple(residual.shape)} differ")
    return _norm(x, residual, weight, eps)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, num_heads, stride_xt, stride_xh, stride_ot, stride_oh,
                  c1, c2, s1, s2, cols, col_mask,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """out = x * cos + rotate_half(x) * sin for the heads of one token, BLOCK_H heads at a time."""
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < num_heads) & col_mask[None, :]
        src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + cols[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + cols[None, :]
        dtype = out_ptr.dtype.element_ty
        tl.store(dst, _to(x1 * c1[None, :] - x2 * s1[None, :], dtype), mask=mask)
        tl.store(dst + HALF, _to(x2 * c2[None, :] + x1 * s2[None, :], dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    col_mask = cols < HALF
    # both halves of cos / sin (the reference multiplies by the whole rows; rope's halves are equal)
    c1 = tl.load(cos_ptr + token * stride_ct + cols, mask=col_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + token * stride_ct + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + token * stride_st + cols, mask=col_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + token * stride_st + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, num_q_heads, stride_qt, stride_qh, stride_qot, stride_qoh,
                  c1, c2, s1, s2, cols, col_mask, HALF, BLOCK_H)
    _rotate_heads(k_ptr, k_out_ptr, token, num_kv_heads, stride_kt, stride_kh, stride_kot, stride_koh,
                  c1, c2, s1, s2, cols, col_mask, HALF, BLOCK_H)


def rotary_max_block_h(head_dim: int) -> int:
    """The most heads one rotary tile holds (`ROTARY_TILE` elements of half a head each)."""
    return max(1, ROTARY_TILE // triton.next_power_of_2(head_dim // 2))


def rotary_meta(head_dim: int, num_q_heads: int, num_kv_heads: int) -> dict:
    """The constexprs of `_rotary_kernel`."""
    half = head_dim // 2
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)), rotary_max_block_h(head_dim))
    return dict(HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_H=block_h)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rope of q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] (any
    token / head strides) by cos / sin [tokens, head_dim], in one launch; new contiguous outputs."""
    tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2 or k.shape[0] != tokens or k.shape[2] != head_dim or cos.shape != (tokens, head_dim) \
            or sin.shape != cos.shape:
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)} do not fit [tokens, heads, even head_dim] / [tokens, head_dim]")
    q, k, cos, sin = _unit_last(q), _unit_last(k), _unit_last(cos), _unit_last(sin)
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype), device=k.device)
    if tokens == 0:
        return q_out, k_out
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, q_out, k_out,
        num_q_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        **rotary_meta(head_dim, num_q_heads, k.shape[1]),
    )
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, n_cols, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = _to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, _to(silu * up, dtype), mask=mask)


def silu_block(n_cols: int) -> int:
    """The constexpr BLOCK of `_silu_and_mul_kernel` for `n_cols` output columns."""
    return min(triton.next_power_of_2(n_cols), SILU_BLOCK)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2 * n] (gate first), in one launch."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {gate_up.shape[-1]} is odd")
    n_cols = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    rows = _rows(gate_up)
    if rows.shape[0] == 0 or n_cols == 0:
        return out
    out2 = out.view(-1, n_cols)
    block = silu_block(n_cols)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n_cols, block))](
        rows, out2, n_cols, rows.stride(0), out2.stride(0), BLOCK=block,
    )
    return out
