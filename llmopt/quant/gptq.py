"""GPTQ (Frantar et al., 2022): quantize a weight column by column against the inverse
Hessian of the layer's inputs, folding each column's rounding error into the columns not
yet quantized.

    H = 2/n * X^T X                       (X: the calibration inputs of this linear)
    for each column j (in act order if desc_act):
        q_j = quant(w_j);  e = (w_j - q_j) / Hinv[j, j];  W[:, j+1:] -= e * Hinv[j, j+1:]

Done in blocks of columns with lazy updates of the rest (the paper's trick for speed),
using the upper Cholesky factor of H^-1. Dead inputs (H_jj = 0) are zeroed. When the
Cholesky factorisation fails, the damping is raised tenfold and retried.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmopt.errors import LlmoptError
from llmopt.core.threads import one_thread
from llmopt.quant.quantizer import QuantizedWeight, QuantScheme, grid_params, quantize_codes

log = logging.getLogger("llmopt")


@dataclass
class GPTQStats:
    damp_percent: float  # the damping that worked (after retries)
    retries: int


def hessian(x: torch.Tensor) -> torch.Tensor:
    """2/n X^T X over the token rows of x [n, in] (float32)."""
    x = x.float()
    return (2.0 / x.shape[0]) * (x.t() @ x)


def gptq_quantize(
    weight: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, desc_act: bool = False,
    damp_percent: float = 0.1, block_size: int = 128,
) -> tuple[QuantizedWeight, GPTQStats]:
    w = weight.detach().float().clone()
    out_features, n = w.shape
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0

    perm = torch.argsort(torch.diag(h), descending=True) if desc_act else torch.arange(n)
    w, h = w[:, perm], h[perm][:, perm]
    with one_thread():  # small factorisations: see threads.py
        hinv, stats = _inverse_hessian_factor(h, damp_percent)

    width = scheme.group_width(n)
    if scheme.group_size > 0:  # let groups never straddle a block: their grid is set from in-block columns
        block_size = max(width, (block_size // width) * width)
    num_groups = scheme.groups_of(n)
    scales = torch.empty(out_features, num_groups)
    zeros = torch.empty(out_features, num_groups)
    codes = torch.empty(out_features, n)
    if scheme.group_size == -1:
        scales[:, :1], zeros[:, :1] = grid_params(w, scheme)
    with one_thread():
        for start in range(0, n, block_size):
            _quantize_block(w, hinv, start, min(start + block_size, n), scheme, width, codes, scales, zeros)

    inv_perm = torch.argsort(perm)
    g_idx = (torch.arange(n) // width)[inv_perm].to(torch.int32)
    return QuantizedWeight(
        codes=codes[:, inv_perm].to(torch.uint8), scales=scales, zeros=zeros.to(torch.uint8), g_idx=g_idx, scheme=scheme
    ), stats


def _quantize_block(w, hinv, start: int, end: int, scheme: QuantScheme, width: int, codes, scales, zeros) -> None:
    """Columns start..end one by one, then the lazy update of every column after the block."""
    w_block = w[:, start:end].clone()
    err_block = torch.zeros_like(w_block)
    hinv_block = hinv[start:end, start:end]
    for i in range(end - start):
        col = start + i
        group = col // width
        if scheme.group_size > 0 and col % width == 0:
            scales[:, group:group + 1], zeros[:, group:group + 1] = grid_params(w_block[:, i:i + width], scheme)
        scale, zero = scales[:, group:group + 1], zeros[:, group:group + 1]
        column = w_block[:, i:i + 1]
        q = quantize_codes(column, scale, zero, scheme.max_code)
        codes[:, col:col + 1] = q
        err = (column - (q - zero) * scale) / hinv_block[i, i]
        w_block[:, i:] -= err @ hinv_block[i:i + 1, i:]
        err_block[:, i:i + 1] = err
    w[:, end:] -= err_block @ hinv[start:end, end:]


def _inverse_hessian_factor(h: torch.Tensor, damp_percent: float) -> tuple[torch.Tensor, GPTQStats]:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, raising damp until it exists."""
    mean_diag = torch.mean(torch.diag(h))
    damp, retries = damp_percent, 0
    eye = torch.eye(h.shape[0])
    while True:
        try:
            lower = torch.linalg.cholesky(h + damp * mean_diag * eye)
            hinv = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(hinv, upper=True), GPTQStats(damp_percent=damp, retries=retries)
        except torch.linalg.LinAlgError:
            if retries >= 6:
                raise LlmoptError(
                    f"GPTQ: the Hessian is not positive definite even with damping {damp:g}; "
                    "the calibration data may be degenerate (try more or longer samples)"
                ) from None
            retries += 1
            damp *= 10
            log.warning("GPTQ: Cholesky failed, retrying with damp_percent=%g", damp)
