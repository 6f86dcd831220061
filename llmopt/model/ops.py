"""The one place each decoder op's implementation is chosen: once, at load, by device and dtype.

`select_backend(device, dtype)` names the kernel family a loaded model runs on:
- "cpu": on CPU, llmopt's C++ kernels where they build and apply (`llmopt.kernels.cpu_*`):
  for fp32 models fused RMSNorm / rope / silu*up (with AVX2/FMA), the few-row matmul, paged
  decode attention, the int4 matmul and the decode plan; for bf16 / fp16 int4 models
  PyTorch's CPU int4 kernel; the PyTorch reference for the rest;
- "triton": CUDA where Triton imports (`llmopt.kernels.triton_*`): paged attention and int4
  matmul in Triton, the small elementwise ops in PyTorch;
- "reference": everything else, and wherever `LLMOPT_KERNELS=reference` is set: the plain
  PyTorch code of this module and of `llmopt.kernels.paged_attention`, int4 weights
  dequantized to dense ones.
`LLMOPT_KERNELS=triton` asks for the Triton kernels wherever Triton imports, on CPU through
its interpreter (`TRITON_INTERPRET=1`): how the tests run them without a GPU.

The model's modules hold the `DecoderOps` they were given (`LlamaForCausalLM.use_ops`) and
call them without looking at devices or dtypes; the loader, the model runner and the
linear-layer factory read the backend name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from llmopt.kernels.triton_int4 import triton_available

BACKENDS = ("cpu", "triton", "reference")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalise in fp32 like the reference implementation, then cast back
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x): vLLM's fused add-RMSNorm."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, head_dim] ("rotate half")."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class DecoderOps:
    """The decoder's small per-layer ops (between its matmuls and attention)."""

    backend: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


REFERENCE_OPS = DecoderOps("reference", rms_norm, add_rms_norm, rotary, silu_and_mul)


def _cpu_ops(fused) -> DecoderOps:
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

    return DecoderOps("cpu", cpu_rms_norm, cpu_add_rms_norm, cpu_rotary, cpu_silu_and_mul)


def requested_backend() -> str:
    """`LLMOPT_KERNELS`: "auto" (default), "reference" or "triton"."""
    value = os.environ.get("LLMOPT_KERNELS", "auto").strip().lower() or "auto"
    if value not in ("auto", "reference", "triton"):
        raise ValueError(f"LLMOPT_KERNELS={value!r}: choose auto, reference or triton")
    return value


def select_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel family for a model of `dtype` on `device` (see the module docstring)."""
    requested = requested_backend()
    if requested == "reference":
        return "reference"
    if requested == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("LLMOPT_KERNELS=triton on CPU runs Triton's interpreter: set TRITON_INTERPRET=1 too")
        return "triton" if triton_available() else "reference"
    if device.type == "cuda" and triton_available():
        return "triton"
    return "cpu" if device.type == "cpu" else "reference"


def decoder_ops(backend: str, dtype: torch.dtype = torch.float32) -> DecoderOps:
    """The small ops of `backend` for a model of `dtype`: the C++ fused ones for "cpu" fp32
    where the kernels build and the CPU has AVX2/FMA, else the reference functions (named
    with `backend`, which the model runner and the layers read)."""
    if backend == "cpu" and dtype == torch.float32:
        from llmopt.kernels.cpu_fused import fused_ops

        fused = fused_ops()
        if fused is not None:
            return _cpu_ops(fused)
    return REFERENCE_OPS if backend == "reference" else replace(REFERENCE_OPS, backend=backend)
