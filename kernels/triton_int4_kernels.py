"""The Triton kernels behind `llmopt.kernels.triton_int4.int4_matmul`, and their launches.

Three kernels share one tile dequantizer (`_dequant_tile`, [BLOCK_K, BLOCK_N] in fp32):
- `_gemv_kernel`: one row of x per program along grid axis 2, x_row * w reduced over K
  in fp32 without tensor cores (a 1-row `tl.dot` would pad to 16 rows);
- `_gemm_kernel`: [BLOCK_M, BLOCK_N] output tiles by `tl.dot` (w cast to x's dtype, fp32
  accumulator), used with 16-row tiles and split-K for few rows and 64-row tiles otherwise;
- `_dequant_kernel`: writes the dense W^T [K, N] in x's dtype for torch's matmul.
With split-K each program takes every SPLIT_K-th K tile and writes an fp32 partial sum to
its own slice of a [SPLIT_K, M, N] buffer, which torch sums in a fixed order.

Block sizes are first guesses, not tuned (no GPU was available when written): GEMV tiles
of 128 x 64 and 16/64-row dot tiles of 64 columns follow the sizes GemLite and vLLM's AWQ
Triton kernels start from. When the group width is a multiple of BLOCK_K (or there is one
group) a tile needs one row of scales and zero points; otherwise they are gathered per k.
Under TRITON_INTERPRET=1 these run on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.kernels.triton_int4 import PACK, PackedInt4

GEMV_BLOCK = (128, 64)  # (BLOCK_K, BLOCK_N)
SPLITK_BLOCK = (16, 64, 64)  # (BLOCK_M, BLOCK_N, BLOCK_K)
GEMM_BLOCK = (64, 64, 32)
DEQUANT_BLOCK = (64, 64)  # (BLOCK_K, BLOCK_N)
INTERPRETER_SMS = 4  # stand-in SM count on CPU: small, so the tests still see split-K > 1


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, group_size,
                  ONE_GROUP: tl.constexpr):
    """w = (code - zero) * scale for input columns offs_k x output channels offs_n, fp32."""
    mask = k_mask[:, None] & n_mask[None, :]
    q = tl.load(qw_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask, other=0)
    codes = (q >> ((offs_k[:, None] % 8) * 4)) & 0xF  # the sign bits an arithmetic shift drags in are masked off
    if ONE_GROUP:  # the whole tile is in group k0 // group_size: one row of scales and zeros
        g = k0 // group_size
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
    else:
        g = offs_k // group_size
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    return (codes.to(tl.float32) - z) * s


@triton.jit
def _input_columns(perm_ptr, offs_k, k_mask, HAS_PERM: tl.constexpr):
    """The columns of x that packed rows offs_k multiply: act-order weights read x through `perm`."""
    if HAS_PERM:
        return tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    return offs_k


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, N, K, group_size,
                 stride_xm, stride_xk, stride_os, stride_om,
                 HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_GROUP: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, group_size, ONE_GROUP)
        cols = _input_columns(perm_ptr, offs_k, k_mask, HAS_PERM)
        xk = tl.load(x_ptr + m * stride_xm + cols * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum(xk[:, None] * w, axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_k * stride_os + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, M, N, K, group_size,
                 stride_xm, stride_xk, stride_os, stride_om,
                 HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_GROUP: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n  # consecutive programs share a row block of x and sweep N
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, group_size, ONE_GROUP)
        cols = _input_columns(perm_ptr, offs_k, k_mask, HAS_PERM)
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=INPUT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, N, K, group_size,
                    HAS_PERM: tl.constexpr, ONE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    n_mask = offs_n < N
    w = _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, group_size, ONE_GROUP)
    rows = _input_columns(perm_ptr, offs_k, k_mask, HAS_PERM)  # sorted column k is x's column perm[k]: W^T's row
    tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=k_mask[:, None] & n_mask[None, :])


def _block_k(packed: PackedInt4, preferred: int) -> tuple[int, bool]:
    """(BLOCK_K, whether every tile lies in one group): the largest power of two <= preferred
    (and >= 16, `tl.dot`'s minimum) dividing the group width, else `preferred` with per-k scales."""
    if packed.groups == 1:
        return preferred, True
    block = preferred
    while block > 16 and packed.group_size % block:
        block //= 2
    if packed.group_size % block == 0:
        return block, True
    return preferred, False


def _split_k(device: torch.device, programs: int, k_tiles: int) -> int:
    """Power-of-two split of K so that about two programs run per SM, each with >= 1 K tile."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else INTERPRETER_SMS
    split, target = 1, 2 * sms
    while programs * split * 2 <= target and split * 2 <= k_tiles:
        split *= 2
    return split


def fused_matmul(x: torch.Tensor, packed: PackedInt4, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype by the "gemv", "splitk" or "gemm" kernel."""
    m, k = x.shape
    n = packed.out_features
    if path == "gemv":
        block_k, one_group = _block_k(packed, GEMV_BLOCK[0])
        block_m, block_n = 1, GEMV_BLOCK[1]
    elif path in ("splitk", "gemm"):
        block_m, block_n, preferred_k = SPLITK_BLOCK if path == "splitk" else GEMM_BLOCK
        block_k, one_group = _block_k(packed, preferred_k)
    else:
        raise ValueError(f"unknown path {path!r}")
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1 if path == "gemm" else _split_k(x.device, tiles, triton.cdiv(k, block_k))
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    in_kernel_bias = bias is not None and split == 1
    bias_arg = bias.contiguous() if in_kernel_bias else packed.scales  # a dummy pointer when unused
    perm = packed.perm if packed.perm is not None else packed.qweight
    common = dict(HAS_PERM=packed.perm is not None, HAS_BIAS=in_kernel_bias, ONE_GROUP=one_group,
                  BLOCK_K=block_k, BLOCK_N=block_n, SPLIT_K=split)
    args = (x, packed.qweight, packed.scales, packed.zeros, perm, bias_arg, out)
    strides = (x.stride(0), x.stride(1), out.stride(0), out.stride(1))
    if path == "gemv":
        _gemv_kernel[(triton.cdiv(n, block_n), split, m)](*args, n, k, packed.group_size, *strides, **common)
    else:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 x: no tf32 rounding; others ignore it
        _gemm_kernel[(tiles, split)](*args, m, n, k, packed.group_size, *strides, INPUT_PRECISION=precision,
                                     BLOCK_M=block_m, **common)
    if split == 1:
        return out[0]
    y = out.sum(dim=0)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def dequantize_t(packed: PackedInt4, dtype: torch.dtype) -> torch.Tensor:
    """The dense W^T [K, N] in `dtype`, rows in x's column order (act-order undone here)."""
    k, n = packed.in_features, packed.out_features
    block_k, one_group = _block_k(packed, DEQUANT_BLOCK[0])
    block_n = DEQUANT_BLOCK[1]
    out = torch.empty((k, n), dtype=dtype, device=packed.qweight.device)
    perm = packed.perm if packed.perm is not None else packed.qweight
    _dequant_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        packed.qweight, packed.scales, packed.zeros, perm, out, n, k, packed.group_size,
        HAS_PERM=packed.perm is not None, ONE_GROUP=one_group, BLOCK_K=block_k, BLOCK_N=block_n)
    return out


assert PACK == 8  # the kernels unpack with // 8 and % 8
