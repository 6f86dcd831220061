"""The "triton" backend (CUDA; CPU only under TRITON_INTERPRET=1): paged attention and the int4
and FP8 matmuls in Triton (`llmopt.kernels.triton_*`), the small elementwise ops in PyTorch."""

from __future__ import annotations

import torch

from llmopt.core.fp8_weight import Fp8Weight
from llmopt.core.quantized_weight import QuantizedWeight
from llmopt.model.backends.base import KernelBackend
from llmopt.model.fp8_linear import triton_fp8_linear
from llmopt.model.int4_linear import triton_int4_linear
from llmopt.model.linear import LinearBase
from llmopt.model.paged_attention import PagedAttention, TritonPagedAttention


class TritonBackend(KernelBackend):
    name = "triton"

    def int4_linear(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> LinearBase | None:
        return triton_int4_linear(weight, None if bias is None else bias.to(dtype))

    def fp8_linear(self, weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> LinearBase | None:
        return triton_fp8_linear(weight, None if bias is None else bias.to(dtype))

    def paged_attention(self, k_caches: torch.Tensor, v_caches: torch.Tensor,
                        query_dtype: torch.dtype) -> PagedAttention:
        return TritonPagedAttention(k_caches, v_caches)
