"""The "cpu" backend: llmopt's C++ kernels (`llmopt.kernels.cpu_*`) where they build and apply,
the PyTorch reference for the rest.

fp32 models get the fused RMSNorm / rope / silu*up (with AVX2/FMA), the few-row matmul, bf16
math for prompt-sized matmuls where the CPU multiplies bf16 natively (`--fp32-matmul-precision`), the
int4 matmul, the paged decode kernel (and through it the runner's one-call decode plan);
bf16 / fp16 models get PyTorch's CPU int4 kernel for their int4 projections.
"""

from __future__ import annotations

import torch

from llmopt.core.fp8_weight import Fp8Weight
from llmopt.core.quantized_weight import PackedQuantizedWeight, QuantizedWeight
from llmopt.kernels.cpu_fused import fused_ops
from llmopt.kernels.cpu_linear import fp32_gemm, prefill_kernel, skinny_linear_kernel
from llmopt.kernels.cpu_paged_attention import KV_DTYPES as KERNEL_KV_DTYPES, decode_kernel
from llmopt.kernels.cpu_prefill_attention import HEAD_DIM_MULTIPLE as PREFILL_HEAD_DIM_MULTIPLE
from llmopt.kernels.cpu_prefill_attention import bf16_prompt_attention, prefill_attention_kernel
from llmopt.model.backends.base import KernelBackend
from llmopt.model.fp8_linear import cpu_fp8_linear
from llmopt.model.int4_linear import cpu_int4_linear, int4_linear
from llmopt.model.linear import LinearBase
from llmopt.model.ops import DecoderOps, add_rms_norm, rms_norm, rotary, silu_and_mul
from llmopt.model.paged_attention import PagedAttention

WIDE_OUTPUT = 8192  # output features above which a layer counts as "very wide" (the vocabulary projection)
# The vocabulary projection's copy on fp32 int4 models: "int8" (llama.cpp's Q8_0, what its own
# GGUF files use for this tensor) or "bf16"; the two are compared in docs/benchmarks.md.
INT4_MODEL_LM_HEAD = "int8"


class CpuBackend(KernelBackend):
    name = "cpu"

    def decoder_ops(self, dtype: torch.dtype) -> DecoderOps:
        fused = fused_ops() if dtype == torch.float32 else None
        return super().decoder_ops(dtype) if fused is None else _fused_decoder_ops(fused)

    def dense_linear_kernels(self, weight: torch.Tensor):
        """fp32 weights on CPU: the C++ few-row kernel (MKL's GEMM re-packs the weight on every
        call, which at decode's few rows costs more than the arithmetic); for very wide layers a
        oneDNN copy pre-packed once (faster than MKL at prompt-sized row counts), and where oneDNN's
        fp32 GEMM is this CPU's faster one (`fp32_gemm`), the plain weight for it (no copy)."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None, None
        skinny = skinny_linear_kernel() if weight.is_contiguous() else None
        if weight.shape[0] > WIDE_OUTPUT and torch.backends.mkldnn.is_available():
            return skinny, weight.detach().to_mkldnn()
        return skinny, weight.detach() if fp32_gemm() == "onednn" else None

    def fp32_prefill_linear(self, precision: str, rounded_result: bool = True):
        """bf16 where `precision` asks for it on this CPU (`llmopt.kernels.cpu_linear.prefill_kernel`):
        oneDNN on AMX-BF16 tiles (several times fp32's rate at prompt sizes), or on AVX512-BF16 (~1.7x,
        its result rounded to bf16, so only where `rounded_result` allows)."""
        return prefill_kernel(precision, rounded_result)

    def bf16_prompt_attention(self) -> bool:
        return bf16_prompt_attention()

    def int4_linear(self, weight: QuantizedWeight | PackedQuantizedWeight, bias: torch.Tensor | None,
                    dtype: torch.dtype, device: torch.device | None = None) -> LinearBase | None:
        return cpu_int4_linear(weight, bias) if dtype == torch.float32 else int4_linear(weight, bias, dtype)

    def fp8_linear(self, weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> LinearBase | None:
        # fp32 models: the C++ kernel reads the e4m3 bytes; bf16/fp16 ones multiply dense weights
        return cpu_fp8_linear(weight, bias) if dtype == torch.float32 else None

    def paged_attention(self, k_caches: torch.Tensor, v_caches: torch.Tensor,
                        query_dtype: torch.dtype) -> PagedAttention:
        # fp32 queries over an fp32/bf16/fp16 pool: decode through the C++ kernel (reads K/V
        # from the pool, no gather, 16-bit rows widened in registers)
        use_kernel = query_dtype == torch.float32 and k_caches.dtype in KERNEL_KV_DTYPES
        # and prompt chunks through the C++ prompt attention kernel (K/V gathered and widened to fp32)
        use_prefill_kernel = use_kernel and k_caches.shape[-1] % PREFILL_HEAD_DIM_MULTIPLE == 0
        return PagedAttention(k_caches, v_caches, cpu_decode=decode_kernel() if use_kernel else None,
                              cpu_prefill=prefill_attention_kernel() if use_prefill_kernel else None)

    def compact_vocab_projection(self, dtype: torch.dtype) -> str | None:
        # with 4-bit projections the fp32 vocabulary projection (often the tied embeddings)
        # would be the largest read of a decode step
        return INT4_MODEL_LM_HEAD if dtype == torch.float32 else None


def _fused_decoder_ops(fused) -> DecoderOps:
    """The C++ fused ops for 2-D fp32 rows (what the decoder's flat batch is); other shapes
    (a caller's [batch, seq, hidden]) take the reference."""

    def cpu_rms_norm(x, weight, eps):
        return fused.rms_norm(x.contiguous(), weight, eps) if x.dim() == 2 else rms_norm(x, weight, eps)

    def cpu_add_rms_norm(x, residual, weight, eps):
        if x.dim() != 2:
            return add_rms_norm(x, residual, weight, eps)
        return tuple(fused.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps))

    def cpu_rotary(q, k, cos, sin):
        if not (cos.is_contiguous() and sin.is_contiguous()):
            return rotary(q, k, cos, sin)
        fused.rotary_embedding_(q, k, cos, sin)  # in place: q and k are views of the fresh qkv output
        return q, k

    def cpu_silu_and_mul(gate_up):
        return fused.silu_and_mul(gate_up.contiguous()) if gate_up.dim() == 2 else silu_and_mul(gate_up)

    return DecoderOps(CpuBackend.name, cpu_rms_norm, cpu_add_rms_norm, cpu_rotary, cpu_silu_and_mul,
                      silu_and_mul_takes_bf16=True, add_rms_norm_takes_bf16=True)
