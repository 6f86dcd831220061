"""FP8 (e4m3) weights with a float32 scale per output channel or per tensor: what the
compressed-tensors `float-quantized` checkpoints hold (llm-compressor's FP8 / FP8_DYNAMIC),
shared by the quantizer (which makes them), the checkpoint format (which stores them) and the
loader (which reads them).

    scale = absmax / 448                   (over the row, or over the whole tensor)
    code  = float8_e4m3fn(clamp(w / scale, -448, 448))        w_hat = float(code) * scale

as compressed-tensors computes it (a min-max observer, division by the scale, a saturating
cast), so the same weights give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_STRATEGIES = ("channel", "tensor")


@dataclass
class Fp8Weight:
    """e4m3 codes, one float32 scale per output row (a per-tensor scale repeated over the rows
    of the tensor it covers), and the static activation scale where the scheme has one."""

    codes: torch.Tensor  # [out, in] float8_e4m3fn
    scales: torch.Tensor  # [out] float32
    strategy: str = "channel"  # "channel" | "tensor"
    input_scale: torch.Tensor | None = None  # [1] float32: static per-tensor activation scale (scheme FP8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.to(torch.float32) * self.scales[:, None]).to(dtype)

    def rows(self, rows: slice) -> "Fp8Weight":
        return Fp8Weight(self.codes[rows], self.scales[rows], self.strategy, self.input_scale)


def fp8_scale(absmax: torch.Tensor) -> torch.Tensor:
    """absmax / 448 in float32, an all-zero range given float32's eps (as compressed-tensors does)."""
    scale = absmax.float() / FP8_MAX
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(torch.float32).eps), scale)


def quantize_fp8(w: torch.Tensor, strategy: str = "channel", parts: list[slice] | None = None) -> Fp8Weight:
    """`w` [out, in] to e4m3 with a scale per row ("channel") or per tensor ("tensor"; `parts`:
    the row ranges of the checkpoint tensors a fused projection stacks, one scale each)."""
    if strategy not in FP8_STRATEGIES:
        raise ValueError(f"unknown FP8 weight strategy {strategy!r}; choose one of {FP8_STRATEGIES}")
    w = w.float()
    if strategy == "channel":
        scales = fp8_scale(w.abs().amax(dim=1))
    else:
        scales = torch.empty(w.shape[0])
        for rows in parts or [slice(None)]:
            scales[rows] = fp8_scale(w[rows].abs().amax())
    codes = torch.clamp(w / scales[:, None], -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(codes=codes, scales=scales, strategy=strategy)
