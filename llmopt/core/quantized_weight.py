"""Integer codes on a group-wise grid: what AWQ / GPTQ checkpoints hold, shared by the loader,
the int4 layers of the model, and the quantizer (which makes it and packs it).
`QuantizedWeight` holds the codes unpacked; `PackedQuantizedWeight` (what the loader reads a
checkpoint into) leaves them in the checkpoint's words and unpacks a slab of output rows on
request, so the int4 layers repack a projection without its [out, in] code matrix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def code_rows(self, start: int, stop: int) -> torch.Tensor:
        """Codes [stop - start, in] of output rows start..stop-1 (as `PackedQuantizedWeight` reads them)."""
        return self.codes[start:stop]

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


CodeRows = Callable[[int, int], torch.Tensor]


@dataclass
class PackedQuantizedWeight:
    """An int4 projection as a checkpoint packs it, its grid read and its codes not: scales and
    zero points [out, groups] and g_idx [in] (small) are unpacked, the codes are read a slab of
    output rows at a time (`code_rows`), so the kernel layers repack a projection into their
    layouts without ever holding its [out, in] codes, let alone a dense weight. Projections
    stacked along the output dimension (q/k/v, gate/up) keep one reader per checkpoint tensor."""

    shape: tuple[int, int]  # (out, in)
    scales: torch.Tensor  # [out, groups] float32
    zeros: torch.Tensor  # [out, groups] int16
    g_idx: torch.Tensor  # [in] int32
    scheme: QuantScheme
    readers: list[tuple[int, CodeRows]] = field(default_factory=list)  # (rows, reader) along the output dim

    def code_rows(self, start: int, stop: int) -> torch.Tensor:
        """uint8 codes [stop - start, in] of output rows start..stop-1."""
        slabs, base = [], 0
        for rows, reader in self.readers:
            lo, hi = max(start, base), min(stop, base + rows)
            if lo < hi:
                slabs.append(reader(lo - base, hi - base))
            base += rows
        return slabs[0] if len(slabs) == 1 else torch.cat(slabs)

    def unpacked(self) -> QuantizedWeight:
        """All codes at once ([out, in] bytes): for code that rewrites weights, not for loading."""
        return QuantizedWeight(codes=self.code_rows(0, self.shape[0]), scales=self.scales, zeros=self.zeros,
                               g_idx=self.g_idx, scheme=self.scheme)

    def dequantize(self) -> torch.Tensor:
        return self.unpacked().dequantize()

    def is_sequential(self) -> bool:
        n, groups = self.shape[1], self.scales.shape[1]
        return n % groups == 0 and torch.equal(self.g_idx.long(), torch.arange(n) // (n // groups))

    @staticmethod
    def stacked(parts: list[PackedQuantizedWeight]) -> PackedQuantizedWeight:
        """`parts` (sharing g_idx and input size) stacked along the output dimension."""
        if any(p.shape[1] != parts[0].shape[1] or p.scales.shape[1] != parts[0].scales.shape[1] for p in parts):
            raise ValueError("stacked projections need the same input size and groups")
        return PackedQuantizedWeight(
            shape=(sum(p.shape[0] for p in parts), parts[0].shape[1]),
            scales=torch.cat([p.scales for p in parts]), zeros=torch.cat([p.zeros for p in parts]),
            g_idx=parts[0].g_idx, scheme=parts[0].scheme, readers=[r for p in parts for r in p.readers])
