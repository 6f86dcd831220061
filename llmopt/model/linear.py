"""Linear layers behind one small interface.

Every projection in the decoder is built by `make_linear`, so quantized layers (int4
AWQ / GPTQ) can slot in without touching the model code: a linear layer is any module
mapping [..., in_features] to [..., out_features] that can load its own tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearBase(nn.Module):
    in_features: int
    out_features: int


class DenseLinear(LinearBase):
    """A plain (fp32 / fp16 / bf16) linear layer with Hugging Face tensor names."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def make_linear(in_features: int, out_features: int, bias: bool = False) -> LinearBase:
    return DenseLinear(in_features, out_features, bias)
