"""Perplexity and KL divergence in one pass over the text (llama.cpp's windowing, `windows.py`).

The baseline pass records, per scored token, its NLL (float64, from float32 logits) and,
for KLD, its final hidden state plus once its dense vocabulary projection, both float16
(`kld.BaselineStore`, kept in the baseline cache), and measures what that rounding costs:
the mean KLD of its own rows from the rebuilt ones, measured the way a candidate's is (`store.error`, ~1e-6 nats on the
default model; reported). The candidate pass then needs no baseline model: it rebuilds the
baseline's full log-softmax rows from the store (`kld.kld_logprobs`) and compares them
with its own float32 rows, the ones its NLL comes from (`kld.position_stats`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from llmopt.errors import LlmoptError
from llmopt.eval.metrics.kld import (STORE_DTYPE, BaselineStore, KLDResult, RowBuffers, dense_lm_head, kld_logprobs,
                                     position_stats, summarize)
from llmopt.eval.metrics.windows import chunk_hidden, plan_chunks

CHUNK_ROWS = 128  # log-softmax rows processed at once: bounds the vocab-sized temporaries
BATCH_CHUNKS = 4  # chunks per forward


@dataclass
class TextScores:
    nll: np.ndarray  # float64 per scored token, in stream order
    store: BaselineStore | None = None  # the baseline's record for KLD, when asked
    kld: KLDResult | None = None  # candidate vs the given baseline

    @property
    def num_tokens(self) -> int:
        return int(self.nll.size)

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll.mean()))


def score_text(
    model,
    ids: torch.Tensor,
    ctx_size: int,
    *,
    bos_id: int | None = None,
    store: bool = False,
    base: TextScores | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> TextScores:
    """Per-token NLL of `ids` (whole chunks of `ctx_size`) under `model`; with `store`, also the
    record a later candidate's KLD needs; with `base` (a baseline's TextScores with `store`), the KLD."""
    chunks = plan_chunks(len(ids), ctx_size)
    total = chunks.num_scored
    if base is not None and (base.store is None or base.num_tokens != total):
        raise LlmoptError("the baseline's stored scores do not match this text and --ctx-size; rerun with --no-cache")
    device = next(model.parameters()).device
    own_head = dense_lm_head(model) if store else None
    vocab = model.config.vocab_size
    if base is not None and base.store.vocab_size != vocab:
        raise LlmoptError(f"cannot compare token distributions: the baseline's vocabulary has {base.store.vocab_size} "
                          f"tokens, the candidate's {vocab}")
    base_head = torch.from_numpy(np.array(base.store.lm_head)).to(device).float() if base is not None else None
    own_head_wide = own_head.float() if store else None  # widened once, not per block of rows
    nlls, hiddens, errors, klds, sames, deltas = [], [], [], [], [], []
    pos = 0
    own_rows = torch.empty(CHUNK_ROWS, vocab, dtype=torch.float32, device=device)  # this model's log-softmax rows
    buffers = RowBuffers.allocate(CHUNK_ROWS, vocab, device) if store or base is not None else None
    for targets, hidden in chunk_hidden(model, ids.to(device), chunks, bos_id, BATCH_CHUNKS):
        for s in range(0, len(targets), CHUNK_ROWS):
            h, t = hidden[s:s + CHUNK_ROWS], targets[s:s + CHUNK_ROWS]
            n = len(t)
            with torch.inference_mode():
                lp = torch.log_softmax(model.compute_logits(h).float(), dim=-1, out=own_rows[:n])
            nll = -lp.gather(1, t[:, None]).squeeze(1).double()
            nlls.append(nll.cpu())
            if store:
                hiddens.append(h.to(STORE_DTYPE).cpu())
                rows, work = buffers.take(n)
                rebuilt = kld_logprobs(h, own_head_wide, out=rows, work=work[0])
                error, _, _ = position_stats(rebuilt, lp, nll, nll, work)  # as a candidate will compare
                errors.append(error.cpu())
            if base is not None:
                b_hidden = torch.from_numpy(np.array(base.store.hidden[pos:pos + n])).to(device)
                b_nll = torch.from_numpy(np.array(base.nll[pos:pos + n])).to(device)
                rows, work = buffers.take(n)
                rebuilt = kld_logprobs(b_hidden, base_head, out=rows, work=work[0])
                kld, same, delta = position_stats(rebuilt, lp, b_nll, nll, work)
                klds.append(kld.cpu()), sames.append(same.cpu()), deltas.append(delta.cpu())
            pos += n
        if on_progress is not None:
            on_progress(pos, total)
    result = TextScores(nll=torch.cat(nlls).numpy())
    if store:
        result.store = BaselineStore(torch.cat(hiddens).numpy(), own_head.cpu().numpy(),
                                     float(torch.cat(errors).double().mean()))
    if base is not None:
        result.kld = summarize(torch.cat(klds).numpy(), torch.cat(sames).numpy(), torch.cat(deltas).numpy(),
                               np.asarray(base.nll, np.float64), result.nll)
    return result


def kl_divergence(base_model, cand_model, ids: torch.Tensor, ctx_size: int = 512, *,
                  bos_id: int | None = None) -> KLDResult:
    """KLD of two loaded models on a token stream, through the same path as `llmopt eval` (scripts, tests)."""
    if base_model.config.vocab_size != cand_model.config.vocab_size:
        raise LlmoptError(
            f"cannot compare token distributions: the baseline has a vocabulary of {base_model.config.vocab_size} "
            f"tokens, the candidate {cand_model.config.vocab_size}; KL divergence needs the same tokenizer"
        )
    base = score_text(base_model, ids, ctx_size, bos_id=bos_id, store=True)
    return score_text(cand_model, ids, ctx_size, bos_id=bos_id, base=base).kld
