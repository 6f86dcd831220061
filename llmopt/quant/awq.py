"""AWQ (Lin et al., 2023): activation-aware weight quantization.

Input channels that see large activations matter most. AWQ multiplies those weight
columns by a per-channel scale s before rounding (and divides the input by s, folded into
the preceding op: a norm's weight, or the rows of the linear that feeds this one), so
their relative rounding error shrinks:

    s = mean|x|^r / mean|w_normalised|^(1-r),  r in {0, 1/20, ..., 19/20}
    pick the r minimising || X W^T - (X / s) Q(W s)^T ||^2

then searches, per output channel and group, a clipping of the weight range
(max |w| shrunk by up to 50%) minimising the same output error restricted to the group.
r = 0 (s = 1) is always a candidate, so the search never does worse than plain rounding
on its own measure.

Both searches measure the error on the layer's real calibration inputs. The scale search
uses a stride sample of the tokens (`search_tokens`); the clip search is exact over all
tokens through each group's Gram block X_g^T X_g (the error of a group's weights e is
e X_g^T X_g e^T), which costs one small matmul per grid point instead of a pass over
the tokens.
"""

from __future__ import annotations

import torch

from llmopt.quant.quantizer import QuantScheme, fake_quantize


def token_sample(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Every k-th row of x [n, in] so at most `max_tokens` remain (deterministic)."""
    step = max(1, -(-x.shape[0] // max_tokens))
    return x[::step]


def search_scale(x: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, n_grid: int = 20,
                 search_tokens: int = 1024) -> tuple[torch.Tensor, float]:
    """Per-input-channel scales s [in] for `weight` [out, in] fed by `x` [n, in]; and the ratio r chosen."""
    w = weight.float()
    out_features, n = w.shape
    x_mean = x.abs().float().mean(dim=0)
    width = scheme.group_width(n)
    grouped = w.abs().reshape(out_features, n // width, width)
    w_mean = (grouped / (grouped.amax(dim=-1, keepdim=True) + 1e-6)).reshape(out_features, n).mean(dim=0)
    xs = token_sample(x.float(), search_tokens)
    reference = xs @ w.t()
    best = (float("inf"), torch.ones(n), 0.0)
    for step in range(n_grid):
        ratio = step / n_grid
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        w_hat = fake_quantize(w * s, scheme).div_(s)
        loss = (xs @ w_hat.t()).sub_(reference).pow_(2).mean().item()
        if loss < best[0]:
            best = (loss, s, ratio)
    return best[1], best[2]


def group_gram(x: torch.Tensor, width: int) -> torch.Tensor:
    """X_g^T X_g for each group of `width` input channels: [groups, width, width]."""
    n, in_features = x.shape
    xg = x.float().reshape(n, in_features // width, width).permute(1, 0, 2)  # [groups, n, width]
    return xg.transpose(1, 2) @ xg


def search_clip(x: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, rows: torch.Tensor | None = None,
                n_grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """`weight` [out, in] with each (row, group) clipped to the range that minimises its output error.

    `rows` (bool [out]) limits clipping to some output channels (AWQ leaves q/k alone:
    their errors are amplified through the attention softmax).
    """
    w = weight.float()
    out_features, n = w.shape
    width = scheme.group_width(n)
    gram = group_gram(x, width)  # [groups, width, width]
    grouped = w.reshape(out_features, n // width, width)
    max_abs = grouped.abs().amax(dim=-1, keepdim=True)
    best_err = torch.full((out_features, n // width, 1), float("inf"))
    best_max = max_abs.clone()
    for step in range(int(max_shrink * n_grid)):
        limit = max_abs * (1 - step / n_grid)
        clipped = torch.maximum(torch.minimum(grouped, limit), -limit)
        err = grouped - fake_quantize(clipped.reshape(out_features, n), scheme).reshape_as(grouped)
        e = err.permute(1, 0, 2)  # [groups, out, width]
        loss = ((e @ gram) * e).sum(dim=-1).t().unsqueeze(-1)  # [out, groups, 1]
        better = loss < best_err
        best_err = torch.where(better, loss, best_err)
        best_max = torch.where(better, limit, best_max)
    if rows is not None:
        best_max = torch.where(rows[:, None, None], best_max, max_abs)
    return torch.maximum(torch.minimum(grouped, best_max), -best_max).reshape(out_features, n)
