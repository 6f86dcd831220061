"""Rotary position embeddings (RoPE) in the Hugging Face "rotate half" layout.

Supports the scaling variants Llama-family configs use: none ("default"), "linear"
(position interpolation) and "llama3" (Llama-3.1's frequency-dependent scaling), and
"freq_factors": a divisor per frequency, the form a GGUF file's rope_freqs tensor gives llama3's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # the core imports the model; the model needs the config only for hints
    from llmopt.core.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = config.rope_type
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are divided by factor, short ones kept, the middle band blended
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # on the CPU even where the model is built on the meta device: ops on meta tensors run PyTorch's Python
        # references, whose first use imports torch._dynamo (a second or so of every load)
        with torch.device("cpu"):
            self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [num_tokens, head_dim] for the given absolute positions."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

