"""The FP8 layer: a compressed-tensors float-quantized projection (e4m3 codes, a float32 scale
per output row) kept in its bytes.

fp32 inputs of up to `SKINNY_MAX_ROWS` rows on CPU (decode steps) go through the C++ kernel
(`llmopt.kernels.cpu_fp8`), which widens the codes in registers; everything else (prompt
chunks, bf16/fp16 models, no kernels) multiplies by the weight dequantized for that call. The
activations are not quantized: FP8_DYNAMIC's per-token and FP8's static activation scales are
what an FP8 GPU kernel uses (the static one is kept as `input_scale`). On the Triton backend
`TritonFp8Linear` runs every call through `llmopt.kernels.triton_fp8`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from llmopt.core.fp8_weight import FP8_DTYPE, Fp8Weight
from llmopt.kernels.cpu_fp8 import fp8_linear_kernel
from llmopt.kernels.cpu_linear import SKINNY_MAX_ROWS
from llmopt.kernels.triton_fp8 import fp8_matmul
from llmopt.kernels.triton_int4 import triton_available
from llmopt.model.linear import LinearBase


class Fp8Linear(LinearBase):
    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None = None, kernel: Callable | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.register_buffer("codes", weight.codes.view(torch.uint8).contiguous())  # e4m3 bits
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.input_scale = weight.input_scale
        self.kernel = kernel

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.view(FP8_DTYPE).to(torch.float32) * self.scales[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.kernel is not None and x.dtype == torch.float32 and x.device.type == "cpu" and rows <= SKINNY_MAX_ROWS:
            out = self.kernel(x.reshape(rows, self.in_features).contiguous(), self.codes, self.scales, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)


class TritonFp8Linear(Fp8Linear):
    """The FP8 layer on CUDA (CPU under TRITON_INTERPRET=1): every call through the Triton
    `fp8_matmul`, which multiplies e4m3 x e4m3 on fp8 tensor cores with x rounded per row
    (FP8_DYNAMIC's dynamic activation scales) where the GPU has them (sm_89+), and widens the
    codes to x's dtype elsewhere (sm_80)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_matmul(x, self.codes, self.scales, self.bias)


def triton_fp8_linear(weight: Fp8Weight, bias: torch.Tensor | None) -> TritonFp8Linear | None:
    """The FP8 layer on the Triton kernels, or None where Triton is not installed (the loader then
    keeps the dense dequantized weight)."""
    return TritonFp8Linear(weight, bias) if triton_available() else None


def cpu_fp8_linear(weight: Fp8Weight, bias: torch.Tensor | None) -> Fp8Linear | None:
    """The FP8 layer on the C++ kernel, or None where the kernels are not built (the loader then
    keeps the dense dequantized weight, which runs faster through the dense kernels than a
    per-call dequantization)."""
    kernel = fp8_linear_kernel()
    return None if kernel is None else Fp8Linear(weight, bias, kernel)
