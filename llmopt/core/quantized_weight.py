"""Integer codes on a group-wise grid: what AWQ / GPTQ checkpoints hold, shared by the loader
(which unpacks checkpoints into it), the int4 layers of the model, and the quantizer (which
makes it and packs it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantScheme:
    bits: int = 4
    group_size: int = 64  # -1: one group spanning the whole input dimension
    sym: bool = False

    @property
    def max_code(self) -> int:
        return 2**self.bits - 1

    def groups_of(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass
class QuantizedWeight:
    """Integer codes plus the grid they live on; what checkpoint writers pack."""

    codes: torch.Tensor  # [out, in] int, 0..2^bits-1
    scales: torch.Tensor  # [out, groups] float32
    zeros: torch.Tensor  # [out, groups] int
    g_idx: torch.Tensor  # [in] int32: the group of each input column
    scheme: QuantScheme

    def dequantize(self) -> torch.Tensor:
        out, n = self.codes.shape
        groups = self.scales.shape[1]
        if self.is_sequential():  # contiguous groups: broadcast instead of gathering per column
            w = self.codes.to(torch.float32).reshape(out, groups, n // groups)
            return w.sub_(self.zeros.float()[..., None]).mul_(self.scales[..., None]).reshape(out, n)
        g = self.g_idx.long()
        return (self.codes.float() - self.zeros.float()[:, g]) * self.scales[:, g]

    def is_sequential(self) -> bool:
        n, groups = self.codes.shape[1], self.scales.shape[1]
        return n % groups == 0 and torch.equal(self.g_idx.long(), torch.arange(n) // (n // groups))
