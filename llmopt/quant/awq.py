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
uses a stride sample of the tokens (`search_tokens`; the activation statistic mean|x| is
over all of them) and multiplies the sample by each candidate's weight error W_hat - W
(computed exactly in float32), one product per candidate instead of two; `linear` runs
that product (the CPU backend's bf16 math where it is fast: the error matrix rounded to
bf16 changes the loss by ~2^-8 of itself, far below the gaps between candidates). The clip
search is exact over all tokens through each group's Gram block X_g^T X_g (the error of a
group's weights e is e X_g^T X_g e^T), which costs one small matmul per grid point instead
of a pass over the tokens. Both walk the weight in blocks of output rows (a row's losses
do not depend on other rows), so their temporaries stay a few tens of MB at any width.
Each candidate's weight error (scale, clip, round to the grid, unscale, subtract) is one C++
pass on the CPU (`weight_error`), not a dozen PyTorch ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmopt.kernels.cpu_fake_quant import fake_quant_error
from llmopt.quant.quantizer import QuantScheme, fake_quantize


ROW_BLOCK_ELEMENTS = 1 << 22  # weights per block of output rows in the searches (16 MiB in float32)


def token_sample(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Every k-th row of x [n, in] so at most `max_tokens` remain (deterministic)."""
    step = max(1, -(-x.shape[0] // max_tokens))
    return x[::step]


def row_blocks(out_features: int, in_features: int) -> list[slice]:
    rows = max(1, ROW_BLOCK_ELEMENTS // in_features)
    return [slice(r, min(r + rows, out_features)) for r in range(0, out_features, rows)]


def weight_error(w: torch.Tensor, scheme: QuantScheme, width: int, col_scale: torch.Tensor | None = None,
                 limit: torch.Tensor | None = None) -> torch.Tensor:
    """W_hat - W for rows `w` [rows, in] (float32) rounded to their grid after scaling the columns
    by `col_scale` [in] and clipping each (row, group) to +-`limit` [rows, groups(, 1)]; W_hat is
    divided by the scale again. One C++ pass on the CPU (`kernels/cpu_fake_quant.py`), else the
    same operations in PyTorch, with the same result bit for bit."""
    flat_limit = None if limit is None else limit.reshape(w.shape[0], -1)
    error = fake_quant_error(w, width, scheme.max_code, scheme.sym, col_scale, flat_limit)
    if error is not None:
        return error
    v = w if col_scale is None else w * col_scale
    if flat_limit is not None:
        grouped = v.reshape(w.shape[0], -1, width)
        bound = flat_limit.unsqueeze(-1)
        v = torch.clamp(grouped, -bound, bound).reshape(w.shape)
    w_hat = fake_quantize(v, scheme)
    return (w_hat if col_scale is None else w_hat.div_(col_scale)).sub_(w)


def search_scale(x: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, n_grid: int = 20,
                 search_tokens: int = 1024, linear: Callable = F.linear) -> tuple[torch.Tensor, float]:
    """Per-input-channel scales s [in] for `weight` [out, in] fed by `x` [n, in]; and the ratio r chosen.
    `linear(a, b)` computes a @ b.T in float32 (see the module docstring)."""
    w = weight.float().contiguous()
    out_features, n = w.shape
    x_mean = torch.linalg.vector_norm(x.float(), ord=1, dim=0) / x.shape[0]  # mean |x| without an |x| copy
    width = scheme.group_width(n)
    grouped = w.abs().reshape(out_features, n // width, width)
    w_mean = (grouped / (grouped.amax(dim=-1, keepdim=True) + 1e-6)).reshape(out_features, n).mean(dim=0)
    del grouped
    xs = token_sample(x.float(), search_tokens).contiguous()
    blocks = row_blocks(out_features, n)
    best = (float("inf"), torch.ones(n), 0.0)
    for step in range(n_grid):
        ratio = step / n_grid
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = 0.0
        for rows in blocks:
            error = weight_error(w[rows], scheme, width, col_scale=s)
            loss += linear(xs, error).pow_(2).sum().item()
        if loss < best[0]:
            best = (loss, s, ratio)
    return best[1], best[2]


def group_gram(x: torch.Tensor, width: int, groups_per_pass: int = 16) -> torch.Tensor:
    """X_g^T X_g for each group of `width` input channels: [groups, width, width] (float32; a few
    groups at a time, so no full copy of x)."""
    n, in_features = x.shape
    groups = in_features // width
    gram = torch.empty(groups, width, width)
    for g in range(0, groups, groups_per_pass):
        k = min(groups_per_pass, groups - g)
        xg = x[:, g * width:(g + k) * width].float().reshape(n, k, width).permute(1, 0, 2)  # [k, n, width]
        torch.bmm(xg.transpose(1, 2), xg, out=gram[g:g + k])
    return gram


def search_clip(x: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, rows: torch.Tensor | None = None,
                n_grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """`weight` [out, in] with each (row, group) clipped to the range that minimises its output error.

    `rows` (bool [out]) limits clipping to some output channels (AWQ leaves q/k alone:
    their errors are amplified through the attention softmax).
    """
    w = weight.float().contiguous()
    out_features, n = w.shape
    width = scheme.group_width(n)
    gram = group_gram(x, width)  # [groups, width, width]
    result = torch.empty(out_features, n)
    for block in row_blocks(out_features, n):
        grouped = w[block].reshape(-1, n // width, width)
        max_abs = grouped.abs().amax(dim=-1, keepdim=True)
        best_err = torch.full_like(max_abs, float("inf"))
        best_max = max_abs.clone()
        for step in range(int(max_shrink * n_grid)):
            limit = max_abs * (1 - step / n_grid)
            err = weight_error(w[block], scheme, width, limit=limit).reshape_as(grouped)
            e = err.transpose(0, 1)  # [groups, rows, width]
            loss = (torch.bmm(e, gram) * e).sum(dim=-1).t().unsqueeze(-1)  # [rows, groups, 1]
            better = loss < best_err
            best_err = torch.where(better, loss, best_err)
            best_max = torch.where(better, limit, best_max)
        if rows is not None:
            best_max = torch.where(rows[block, None, None], best_max, max_abs)
        result[block] = torch.clamp(grouped, -best_max, best_max).reshape(-1, n)
    return result
