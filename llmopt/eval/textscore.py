"""Perplexity and KL divergence in one pass over the text, with the baseline's side stored on disk.

The baseline pass records, per scored token, its NLL (float64, from float32 logits) and
its full-vocabulary log-softmax row rounded to float16 (`rows_out`, a memmap in the
baseline cache). The candidate pass then needs no baseline model: it computes its own NLL
and compares its rows, rounded to float16 the same way, with the stored ones
(`kld.position_stats`, which renormalises both).

Why round the candidate too: the two distributions then differ only by what the models
do, not by storage, so a model against itself gives exactly 0 and every candidate sees
the same rounding. The rounding moves log-probs by at most ~1e-3 relative (float16's
10-bit mantissa); KL divergence is second order in such perturbations once both sides
are renormalised, so it shifts the mean KLD by far less than the differences gates care
about (a 4-bit model is at ~0.1-0.4 nats). Perplexity always comes from the unrounded
float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from llmopt.eval.kld import KLDResult, position_stats, summarize
from llmopt.eval.windows import num_scored, plan_windows, window_logits

ROW_DTYPE = np.float16
CHUNK_ROWS = 256  # log-softmax rows processed at once: bounds the vocab-sized temporaries
WINDOW_BATCH = 4  # windows per forward


@dataclass
class TextScores:
    nll: np.ndarray  # float64 per scored token, in stream order
    kld: KLDResult | None = None  # candidate vs the stored baseline rows, when given

    @property
    def num_tokens(self) -> int:
        return int(self.nll.size)

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll.mean()))


def count_scored(num_tokens: int, context: int, stride: int) -> int:
    return num_scored(plan_windows(num_tokens, context, stride))


def score_text(
    model,
    ids: torch.Tensor,
    context: int,
    stride: int,
    *,
    rows_out: np.ndarray | None = None,
    base_rows: np.ndarray | None = None,
    base_nll: np.ndarray | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> TextScores:
    """Per-token NLL of `ids` under `model`; writes float16 log-prob rows to `rows_out` and/or
    computes KLD against `base_rows` (with `base_nll` for the baseline's perplexity)."""
    windows = plan_windows(len(ids), context, stride)
    total = num_scored(windows)
    for name, arr in (("rows_out", rows_out), ("base_rows", base_rows)):
        if arr is not None and arr.shape[0] != total:
            raise ValueError(f"{name} has {arr.shape[0]} rows for {total} scored tokens")
    nlls, klds, sames, deltas = [], [], [], []
    pos = 0
    device = next(model.parameters()).device
    for targets, logits in window_logits(model, ids.to(device), windows, WINDOW_BATCH):
        for s in range(0, len(targets), CHUNK_ROWS):
            lp = torch.log_softmax(logits[s:s + CHUNK_ROWS], dim=-1)
            t = targets[s:s + CHUNK_ROWS]
            n = len(t)
            nlls.append(-lp.gather(1, t[:, None]).squeeze(1).double().cpu())
            rows16 = lp.to(torch.float16)
            if rows_out is not None:
                rows_out[pos:pos + n] = rows16.cpu().numpy()
            if base_rows is not None:
                base = torch.from_numpy(np.array(base_rows[pos:pos + n])).to(device)  # a writable copy of the memmap slice
                kld, same, delta = position_stats(base.float(), rows16.float())
                klds.append(kld.cpu()), sames.append(same.cpu()), deltas.append(delta.cpu())
            pos += n
        if on_progress is not None:
            on_progress(pos, total)
    nll = torch.cat(nlls)
    result = TextScores(nll=nll.numpy())
    if base_rows is not None:
        assert base_nll is not None and len(base_nll) == total
        result.kld = summarize(torch.cat(klds), torch.cat(sames), torch.cat(deltas),
                               torch.from_numpy(np.array(base_nll, dtype=np.float64)), nll)
    return result
