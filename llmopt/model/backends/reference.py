"""The "reference" backend: plain PyTorch everywhere (`llmopt.model.ops`,
`llmopt.kernels.paged_attention`), int4 weights dequantized to dense ones."""

from __future__ import annotations

import torch

from llmopt.model.backends.base import KernelBackend
from llmopt.model.ops import REFERENCE_OPS, DecoderOps


class ReferenceBackend(KernelBackend):
    name = "reference"

    def decoder_ops(self, dtype: torch.dtype) -> DecoderOps:
        return REFERENCE_OPS
