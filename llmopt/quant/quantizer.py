"""Group-wise integer quantization of a weight matrix: the grid every method shares.

A weight `W[out, in]` is split along `in` into groups of `group_size` columns (-1 = one
group per row). Each (output channel, group) gets a scale and an integer zero point:

    code = clamp(round(w / scale) + zero, 0, 2^bits - 1)        w_hat = (code - zero) * scale

Asymmetric grids span [min, max] of the group; symmetric ones span [-absmax, absmax] with
zero = 2^(bits-1) (GPTQ's convention), so both fit the AWQ and GPTQ checkpoint formats.
RTN is this grid applied directly; AWQ rescales and clips before it; GPTQ picks codes
column by column against it.
"""

from __future__ import annotations

import torch

from llmopt.core.quantized_weight import QuantizedWeight, QuantScheme

__all__ = ["QuantScheme", "QuantizedWeight", "grid_params", "quantize_codes", "quantize_rtn", "fake_quantize"]


def grid_params(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points for rows of `w` (the last dim is one group). Returns [..., 1] each."""
    w = w.float()
    if scheme.sym:
        absmax = w.abs().amax(dim=-1, keepdim=True)
        scale = (2 * absmax / scheme.max_code).clamp(min=1e-5)
        zero = torch.full_like(scale, float((scheme.max_code + 1) // 2))
    else:
        lo, hi = torch.aminmax(w, dim=-1, keepdim=True)  # one pass over the weights
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = ((hi - lo) / scheme.max_code).clamp(min=1e-5)
        zero = torch.round(-lo / scale).clamp(0, scheme.max_code)
        # a group with no negative weight would get zero point 0, which GPTQ v1 cannot store
        # (it keeps zero-1 in 4 bits): use zero 1 and stretch the step to still reach the max
        at_zero = zero == 0
        scale = torch.where(at_zero, (hi / (scheme.max_code - 1)).clamp(min=1e-5), scale)
        zero = torch.where(at_zero, torch.ones_like(zero), zero)
    # checkpoints store scales in fp16: choose codes against the scale that will be stored
    return scale.half().float(), zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, max_code: int) -> torch.Tensor:
    # one new tensor, the rest in place: AWQ's searches call this thousands of times on MB-sized weights
    return torch.div(w, scale).round_().add_(zero).clamp_(0, max_code)


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """`w` [out, in] snapped to its grid (dequantized), in float32."""
    out, n = w.shape
    width = scheme.group_width(n)
    grouped = w.float().reshape(out, n // width, width)
    scale, zero = grid_params(grouped, scheme)
    return quantize_codes(grouped, scale, zero, scheme.max_code).sub_(zero).mul_(scale).reshape(out, n)


def quantize_rtn(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest: the baseline every other method is measured against."""
    out, n = w.shape
    width = scheme.group_width(n)
    grouped = w.float().reshape(out, n // width, width)
    scale, zero = grid_params(grouped, scheme)
    codes = quantize_codes(grouped, scale, zero, scheme.max_code)
    return QuantizedWeight(
        codes=codes.reshape(out, n).to(torch.uint8),
        scales=scale.squeeze(-1),
        zeros=zero.squeeze(-1).to(torch.uint8),
        g_idx=(torch.arange(n) // width).to(torch.int32),
        scheme=scheme,
    )
