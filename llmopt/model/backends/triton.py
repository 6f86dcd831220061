"""The "triton" backend (CUDA; CPU only under TRITON_INTERPRET=1): paged attention, the int4
and FP8 matmuls and the decoder's small per-layer ops (RMSNorm, rope, silu*up: one launch each)
in Triton (`llmopt.kernels.triton_*`)."""

from __future__ import annotations

import torch

from llmopt.core.fp8_weight import Fp8Weight
from llmopt.core.quantized_weight import PackedQuantizedWeight, QuantizedWeight
from llmopt.errors import LlmoptError
from llmopt.model.backends.base import KernelBackend
from llmopt.model.fp8_linear import triton_fp8_linear
from llmopt.model.int4_linear import triton_int4_linear
from llmopt.model.linear import LinearBase
from llmopt.model.ops import DecoderOps
from llmopt.model.paged_attention import PagedAttention, TritonPagedAttention


class TritonBackend(KernelBackend):
    name = "triton"

    def decoder_ops(self, dtype: torch.dtype) -> DecoderOps:
        from llmopt.kernels import triton_decoder_ops as k  # imports Triton: only once this backend runs

        return DecoderOps(self.name, k.rms_norm, k.add_rms_norm, k.rotary, k.silu_and_mul)

    def int4_linear(self, weight: QuantizedWeight | PackedQuantizedWeight, bias: torch.Tensor | None,
                    dtype: torch.dtype, device: torch.device | None = None) -> LinearBase | None:
        return triton_int4_linear(weight, None if bias is None else bias.to(dtype), device)

    def fp8_linear(self, weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> LinearBase | None:
        return triton_fp8_linear(weight, None if bias is None else bias.to(dtype))

    def paged_attention(self, k_caches: torch.Tensor, v_caches: torch.Tensor,
                        query_dtype: torch.dtype) -> PagedAttention:
        if k_caches.dtype == torch.float8_e4m3fn and k_caches.device.type == "cuda":
            from llmopt.kernels.triton_write_kv import FP8_MIN_ARCH

            major, minor = torch.cuda.get_device_capability(k_caches.device)
            if 10 * major + minor < FP8_MIN_ARCH:
                raise LlmoptError(f"--kv-cache-dtype fp8 needs compute capability {FP8_MIN_ARCH // 10}.{FP8_MIN_ARCH % 10}"
                                  f" or newer on CUDA (this GPU: {major}.{minor}; Triton has no e4m3 below it); "
                                  "use --kv-cache-dtype bfloat16 or float16")
        return TritonPagedAttention(k_caches, v_caches)
