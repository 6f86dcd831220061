"""The Triton kernels behind `llmopt.kernels.triton_fp8.fp8_matmul`, and their launches.

- `_upcast_kernel`: [BLOCK_M, BLOCK_N] output tiles by `tl.dot` in x's dtype; each [BLOCK_K,
  BLOCK_N] tile of the codes, read from the [N, K] checkpoint layout (contiguous along K), is
  widened by `_widen_codes` (integer ops and a bitcast: no fp8 type, so it compiles for sm_80).
- `_quantize_rows_kernel` + `_native_kernel`: x rounded per row to e4m3 (one program per row:
  its max |x|, then x / scale cast to e4m3 saturating), then e4m3 x e4m3 `tl.dot` with an fp32
  accumulator (fp8 tensor cores, sm_89+), scaled per row and column at the end. Compiled for
  sm_89 it is mma.sync e4m3 at every tile height; for sm_90, wgmma e4m3 on 64-row tiles, while
  16-row (decode) tiles are converted to fp16 in registers (cvt e4m3x2) for fp16 mma.
Block sizes are first guesses (no GPU was at hand when written): 16-row tiles for decode
batches (`tl.dot`'s minimum), 64 otherwise, 64 output columns, 64 (upcast) or 128 (e4m3)
input columns per step. Under TRITON_INTERPRET=1 these run on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.kernels.triton_fp8 import FP8_MAX, MIN_SCALE

BLOCK_N = 64
UPCAST_BLOCK_K = 64
NATIVE_BLOCK_K = 128
QUANT_BLOCK_K = 256


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else 64


@triton.jit
def _widen_codes(b):
    """e4m3 bytes (uint8) -> fp16 worth code / 256: sign to bit 15, exponent and mantissa to bits 13..7."""
    v = b.to(tl.int32)
    h = ((v & 0x80) << 8) | ((v & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _upcast_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                   HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n  # consecutive programs share a row block of x and sweep N
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                     other=0.0)
        codes = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        acc = tl.dot(xt, _widen_codes(codes).to(xt.dtype), acc, input_precision=INPUT_PRECISION)
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0) * 256.0
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _round_to_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: the
    spacing there is 2^(max(exponent, -6) - 3); v / spacing (exact, a power of two) is rounded
    by adding and subtracting 1.5 * 2^23. The cast to e4m3 that follows is then exact (Triton's
    interpreter does not carry a rounded-up mantissa into the exponent: 124.3 became 64). A
    negative value that rounds to zero gives +0 (PyTorch's cast: -0): the same value."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    spacing_exp = tl.maximum(e, -6) - 3
    spacing = ((spacing_exp + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - spacing_exp) << 23).to(tl.float32, bitcast=True)
    return ((v * inverse + 12582912.0) - 12582912.0) * spacing


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(xv))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_, MIN_SCALE_)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(xv, scale), -FP8_MAX_, FP8_MAX_))
        tl.store(q_ptr + m * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    tl.store(s_ptr + m, scale)


@triton.jit
def _native_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.load(xq_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(xt, wt, acc)
    xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def upcast_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (contiguous) @ (codes * scales).T (+ bias), codes uint8 [N, K] contiguous."""
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = _block_m(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK_N),)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 x: no tf32 rounding; others ignore it
    _upcast_kernel[grid](x, codes, scales, scales if bias is None else bias.contiguous(), out, m, n, k,
                         x.stride(0), out.stride(0), HAS_BIAS=bias is not None, INPUT_PRECISION=precision,
                         BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=UPCAST_BLOCK_K)
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] contiguous -> (e4m3 [M, K], fp32 scales [M]), as `quantize_rows_reference`."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE,
                                BLOCK_K=QUANT_BLOCK_K)
    return q, s


def native_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x rounded per row to e4m3, then e4m3 x e4m3 on fp8 tensor cores (sm_89+)."""
    m, k = x.shape
    n = codes.shape[0]
    xq, xs = quantize_rows(x)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = _block_m(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK_N),)
    _native_kernel[grid](xq, xs, codes.view(torch.float8_e4m3fn), scales, scales if bias is None else bias.contiguous(),
                         out, m, n, k, out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                         BLOCK_K=NATIVE_BLOCK_K)
    return out
