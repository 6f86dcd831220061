"""FP8 (e4m3) weight matmul in Triton, for compressed-tensors float-quantized projections on CUDA.

`y = x @ (codes * scale).T (+ bias)`: codes [N, K] e4m3 (as `torch.float8_e4m3fn` or their uint8
bits, the checkpoint's layout as is), a float32 scale per output row, x [..., K] fp16 / bf16 /
fp32; fp32 accumulation, the output in x's dtype. Two kernels (`triton_fp8_kernels.py`):

- `upcast` (any GPU, sm_80 included, and the interpreter): each [BLOCK_K, BLOCK_N] tile of codes
  is widened by bit arithmetic, no fp8 type needed: the byte sign-extended to 16 bits, shifted
  left by 7, bit 14 cleared, is an fp16 worth exactly code / 256 (e4m3 subnormals land on fp16
  subnormals); cast to x's dtype (exact for fp16, bf16, fp32) and multiplied by `tl.dot` with an
  fp32 accumulator; each output column is scaled by 256 * scale at the end. Weight-only: x is
  not quantized, so this is the dequantized weight's product up to summation order.
- `native` (sm_89 / sm_90: fp8 tensor cores): x is quantized per row on the fly, as
  FP8_DYNAMIC's per-token activation scales are (scale_x = max|x_row| / 448, x / scale_x cast to
  e4m3 saturating), and `tl.dot` multiplies the two e4m3 tiles; the fp32 result is scaled by
  scale_x * scale_w. This is the W8A8 product vLLM's FP8 kernels compute; `reference_fp8_matmul`
  with `quantize_x=True` is the same arithmetic in PyTorch.

`fp8_matmul` takes `native` where the device has fp8 tensor cores (compute capability >= 8.9)
unless told otherwise. Nothing here imports llmopt outside `llmopt.kernels`; Triton is imported
on the first call.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor on a dynamic activation scale (an all-zero row)


def native_fp8_supported(device: torch.device) -> bool:
    """Whether `device` has fp8 tensor cores (Ada sm_89, Hopper sm_90 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], fp32 scales [M]): scale = max(|x_row|) / 448 (at least
    MIN_SCALE), code = e4m3(clamp(x / scale, +-448)); the native kernel's activation rounding."""
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(dim=1) / FP8_MAX, min=MIN_SCALE)
    codes = torch.clamp(xf / scale[:, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def reference_fp8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                         quantize_x: bool = False) -> torch.Tensor:
    """x @ (float(codes) * scales).T (+ bias) in fp32 PyTorch, returned in x's dtype; with
    `quantize_x`, x first rounded per row to e4m3 as the native kernel does."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    flat = x.reshape(-1, x.shape[-1])
    if quantize_x:
        q, s = quantize_rows_reference(flat)
        xf = q.float() * s[:, None]
    else:
        xf = flat.float()
    y = xf @ (codes.float() * scales.float()[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], codes.shape[0])


def fp8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
               native: bool | None = None) -> torch.Tensor:
    """x [..., K] @ (codes * scales).T (+ bias [N]) -> [..., N] in x's dtype. `native`: the fp8
    tensor-core kernel (x quantized per row), default where the device has it; else `upcast`.
    All tensors on one device (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from llmopt.kernels import triton_fp8_kernels as launch  # Triton is imported here, not at module load

    if codes.dim() != 2 or scales.numel() != codes.shape[0]:
        raise ValueError(f"codes [N, K] and scales [N]: got {tuple(codes.shape)} and {tuple(scales.shape)}")
    n, k = codes.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported activation dtype {x.dtype}")
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be float8_e4m3fn or uint8, got {codes.dtype}")
    flat = x.reshape(-1, k)
    if flat.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    use_native = native_fp8_supported(x.device) if native is None else native
    scales = scales.float().contiguous()
    if use_native:
        out = launch.native_matmul(flat.contiguous(), codes.contiguous(), scales, bias)
    else:
        out = launch.upcast_matmul(flat.contiguous(), codes.contiguous(), scales, bias)
    return out.reshape(*x.shape[:-1], n)
