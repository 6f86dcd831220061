"""GPTQ (Frantar et al., 2022): quantize a weight column by column against the inverse
Hessian of the layer's inputs, folding each column's rounding error into the columns not
yet quantized.

    H = 2/n * X^T X                       (X: the calibration inputs of this linear)
    for each column j (in act order if desc_act):
        q_j = quant(w_j);  e = (w_j - q_j) / Hinv[j, j];  W[:, j+1:] -= e * Hinv[j, j+1:]

Done in blocks of columns with lazy updates of the rest (the paper's trick for speed),
using the upper Cholesky factor of H^-1. Dead inputs (H_jj = 0) are zeroed. When the
Cholesky factorisation fails, the damping is raised tenfold and retried.

H is [in, in] float32: 822 MB for an 8B model's down_proj (in = 14336). `gptq_quantize`
takes it over (damps its diagonal in place, drops it once factored) and keeps at most two
such matrices alive at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmopt.errors import LlmoptError
from llmopt.core.threads import one_thread
from llmopt.quant.quantizer import QuantizedWeight, QuantScheme, grid_params, quantize_codes

log = logging.getLogger("llmopt")


@dataclass
class GPTQStats:
    damp_percent: float  # the damping that worked (after retries)
    retries: int


HESSIAN_TOKENS = 2048  # token rows per product when `hessian` is given a kernel


def hessian(x: torch.Tensor, linear: Callable | None = None) -> torch.Tensor:
    """2/n X^T X over the token rows of x [n, in] (float32). `linear(a, b)` = a @ b.T (a kernel
    such as the CPU backend's bf16 math) runs it over blocks of token rows, summed in float32;
    None: one float32 product."""
    n = x.shape[0]
    if linear is None or linear is F.linear:
        return (x.float().t() @ x.float()).mul_(2.0 / n)
    h = None
    for start in range(0, n, HESSIAN_TOKENS):
        xt = x[start:start + HESSIAN_TOKENS].float().t()
        part = linear(xt, xt)
        h = part if h is None else h.add_(part)
    return h.mul_(2.0 / n)


def gptq_quantize(
    weight: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, desc_act: bool = False,
    damp_percent: float = 0.1, block_size: int = 128,
) -> tuple[QuantizedWeight, GPTQStats]:
    """`h` (from `hessian`) is used up: its diagonal is changed in place (pass a copy to keep it)."""
    w = weight.detach().float().clone()
    out_features, n = w.shape
    diag = h.diagonal()
    dead = diag == 0
    diag[dead] = 1
    w[:, dead] = 0

    if desc_act:
        perm = torch.argsort(diag, descending=True)
        w, h = w[:, perm], h[perm[:, None], perm[None, :]]  # one gather, no [perm] then [:, perm] copy
    else:
        perm = torch.arange(n)
    del diag
    # one thread: small factorisations gain nothing from a second (threads.py), and a threaded LAPACK
    # factorisation rounds differently with the thread count, which would make the checkpoint's bytes
    # depend on the machine's cores
    with one_thread():
        hinv, stats = _inverse_hessian_factor(h, damp_percent)
    del h

    width = scheme.group_width(n)
    if scheme.group_size > 0:  # let groups never straddle a block: their grid is set from in-block columns
        block_size = max(width, (block_size // width) * width)
    num_groups = scheme.groups_of(n)
    scales = torch.empty(out_features, num_groups)
    zeros = torch.empty(out_features, num_groups)
    codes = torch.empty(out_features, n)
    if scheme.group_size == -1:
        scales[:, :1], zeros[:, :1] = grid_params(w, scheme)
    for start in range(0, n, block_size):
        end = min(start + block_size, n)
        with one_thread():  # the column loop: small ops (threads.py)
            err_block = _quantize_block(w, hinv, start, end, scheme, width, codes, scales, zeros)
        # the lazy update of every later column: the solve's one large product ([out, block] x [block, rest]),
        # threaded and written into w in place (a temporary of w's size per block was most of GPTQ's page faults)
        w[:, end:].addmm_(err_block, hinv[start:end, end:], alpha=-1)

    inv_perm = torch.argsort(perm)
    g_idx = (torch.arange(n) // width)[inv_perm].to(torch.int32)
    return QuantizedWeight(
        codes=codes[:, inv_perm].to(torch.uint8), scales=scales, zeros=zeros.to(torch.uint8), g_idx=g_idx, scheme=scheme
    ), stats


def _quantize_block(w, hinv, start: int, end: int, scheme: QuantScheme, width: int, codes, scales,
                    zeros) -> torch.Tensor:
    """Columns start..end one by one; returns their scaled errors [out, end - start] for the caller's
    update of the columns after the block."""
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
    return err_block


def _inverse_hessian_factor(h: torch.Tensor, damp_percent: float) -> tuple[torch.Tensor, GPTQStats]:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, raising damp until it exists.
    Computed in `h`'s own storage (returned): the damping goes onto its diagonal, and once the
    first factorisation succeeds the rest overwrite it in place."""
    diag = h.diagonal()
    mean_diag = torch.mean(diag)
    damp, retries = damp_percent, 0
    while True:
        added = damp * mean_diag
        diag.add_(added)
        try:
            lower = torch.linalg.cholesky(h)  # a new matrix: h stays intact for a retry
        except torch.linalg.LinAlgError:
            diag.sub_(added)
            if retries >= 6:
                raise LlmoptError(
                    f"GPTQ: the Hessian is not positive definite even with damping {damp:g}; "
                    "the calibration data may be degenerate (try more or longer samples)"
                ) from None
            retries += 1
            damp *= 10
            log.warning("GPTQ: Cholesky failed, retrying with damp_percent=%g", damp)
            continue
        h.copy_(lower)
        del lower
        torch.cholesky_inverse(h, out=h)
        torch.linalg.cholesky(h, upper=True, out=h)
        return h, GPTQStats(damp_percent=damp, retries=retries)
