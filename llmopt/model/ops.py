"""The decoder's small per-layer ops (RMSNorm, rope, silu*up) in plain PyTorch, and `DecoderOps`,
the set of them a model's modules call.

The modules hold the `DecoderOps` their kernel backend gave them at load
(`LlamaForCausalLM.use_backend`, `llmopt.model.backends`) and call them without looking at
devices or dtypes; these functions are the reference every backend's ops are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


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

    backend: str  # the name of the kernel backend that made these ops (for logs and tests)
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # whether silu_and_mul also takes bf16 rows and returns bf16: its fp32 result on the widened input, rounded
    # once (a prompt-sized gate_up product rounded to bf16 then goes to the down projection without conversions)
    silu_and_mul_takes_bf16: bool = False
    # whether add_rms_norm takes bf16 x (fp32 residual) and returns what it gives on x widened to fp32, bitwise: a
    # prompt-sized o_proj product rounded to bf16 then goes in without a conversion
    add_rms_norm_takes_bf16: bool = False


REFERENCE_OPS = DecoderOps("reference", rms_norm, add_rms_norm, rotary, silu_and_mul)
