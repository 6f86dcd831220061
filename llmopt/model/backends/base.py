"""`KernelBackend`: what a loaded model runs on, asked once per piece at load (and by the runner).

The base class answers with the plain PyTorch code everywhere; each backend overrides the
pieces it has kernels for. Model and runner code call what the backend gave them and never
look at its `name` (kept for logs, reports and tests).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from llmopt.core.fp8_weight import Fp8Weight
from llmopt.core.quantized_weight import PackedQuantizedWeight, QuantizedWeight
from llmopt.kernels.cpu_linear import PrefillKernel
from llmopt.model.linear import LinearBase
from llmopt.model.ops import REFERENCE_OPS, DecoderOps
from llmopt.model.paged_attention import PagedAttention


class KernelBackend:
    name: str = "reference"

    def decoder_ops(self, dtype: torch.dtype) -> DecoderOps:
        """The small per-layer ops (RMSNorm, rope, silu*up) for a model of `dtype`."""
        return replace(REFERENCE_OPS, backend=self.name)

    def dense_linear_kernels(self, weight: torch.Tensor) -> tuple[Callable | None, torch.Tensor | None]:
        """(few-row kernel, the weight oneDNN's matmul takes for prompt-sized products: a pre-packed copy or
        `weight` itself) a `DenseLinear` holding `weight` runs on; (None, None): `F.linear`."""
        return None, None

    def fp32_prefill_linear(self, precision: str, rounded_result: bool = True) -> PrefillKernel | None:
        """The kernel (`llmopt.kernels.cpu_linear.PrefillKernel`) fp32 `DenseLinear`s run prompt-sized products on under the engine's
        `fp32_matmul_precision`, or None: their plain path (`F.linear`). `rounded_result=False`: only a
        kernel whose fp32 result is not rounded to a 16-bit type."""
        return None

    def bf16_prompt_attention(self) -> bool:
        """Whether attention over prompt chunks runs in bf16 where the prompt products do (where it pays)."""
        return False

    def int4_linear(self, weight: QuantizedWeight | PackedQuantizedWeight, bias: torch.Tensor | None,
                    dtype: torch.dtype, device: torch.device | None = None) -> LinearBase | None:
        """The int4 layer for an AWQ / GPTQ / compressed-tensors W4A16 projection of a model of
        `dtype`, its codes repacked straight into the kernel's layout on `device` (default: the CPU),
        or None where this backend has none for its layout (the loader keeps the dense dequantized
        weight)."""
        return None

    def fp8_linear(self, weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> LinearBase | None:
        """The FP8 layer for a compressed-tensors float-quantized projection of a model of `dtype`,
        or None (the loader keeps the dense dequantized weight)."""
        return None

    def paged_attention(self, k_caches: torch.Tensor, v_caches: torch.Tensor,
                        query_dtype: torch.dtype) -> PagedAttention:
        """The model runner's attention over its K/V pools for queries of `query_dtype`."""
        return PagedAttention(k_caches, v_caches)

    def compact_vocab_projection(self, dtype: torch.dtype) -> str | None:
        """The compact copy ("int8" | "bf16", `DenseLinear.use_compact_copy`) the vocabulary
        projection of an int4 model of `dtype` runs on, or None: its plain weight."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
