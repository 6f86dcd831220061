"""KL divergence of a candidate's next-token distributions from a baseline's, as llama.cpp's
`perplexity --kl-divergence` reports it: per scored position KL(P_base || P_cand), its mean
and percentiles, how often both models agree on the top token ("same top p"), the mean
change in probability of the baseline's top token (Δp), and both perplexities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from llmopt.errors import LlmoptError
from llmopt.eval.perplexity import token_nll
from llmopt.eval.windows import plan_windows, window_logits

PERCENTILES = (50, 90, 95, 99, 99.9)


@dataclass
class KLDResult:
    mean: float
    percentiles: dict[str, float]  # "p50", "p99", ...
    max: float
    same_top_p: float  # fraction of positions where both models' most likely token agree
    mean_delta_p: float  # mean of P_cand(top_base) - P_base(top_base)
    ppl_base: float
    ppl_cand: float
    num_tokens: int
    per_position: list[float] = field(repr=False, default_factory=list)
    same_top: list[int] = field(repr=False, default_factory=list)
    nll_base: list[float] = field(repr=False, default_factory=list)
    nll_cand: list[float] = field(repr=False, default_factory=list)

    def to_dict(self) -> dict:
        return {"mean": self.mean, **self.percentiles, "max": self.max, "same_top_p": self.same_top_p,
                "mean_delta_p": self.mean_delta_p, "ppl_base": self.ppl_base, "ppl_cand": self.ppl_cand,
                "delta_ppl": self.ppl_cand - self.ppl_base, "num_tokens": self.num_tokens}


def position_stats(base_logits: torch.Tensor, cand_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: KL(P_base || P_cand), top-1 agreement (0/1), P_cand(top_base) - P_base(top_base)."""
    logp = torch.log_softmax(base_logits.float(), dim=-1)
    logq = torch.log_softmax(cand_logits.float(), dim=-1)
    kld = (logp.exp() * (logp - logq)).sum(dim=-1).clamp(min=0)  # rounding can dip a hair below 0
    top = logp.argmax(dim=-1, keepdim=True)
    same = (logq.argmax(dim=-1, keepdim=True) == top).squeeze(1).to(torch.int32)
    delta_p = (logq.gather(1, top).exp() - logp.gather(1, top).exp()).squeeze(1)
    return kld, same, delta_p


def kl_divergence(base_model, cand_model, ids: torch.Tensor, context: int = 512, stride: int = 256,
                  batch_size: int = 8) -> KLDResult:
    if base_model.config.vocab_size != cand_model.config.vocab_size:
        raise LlmoptError(
            f"cannot compare token distributions: the baseline has a vocabulary of {base_model.config.vocab_size} "
            f"tokens, the candidate {cand_model.config.vocab_size}; KL divergence needs the same tokenizer"
        )
    windows = plan_windows(len(ids), context, stride)
    klds, sames, deltas, nll_b, nll_c = [], [], [], [], []
    for (targets, base), (_, cand) in zip(window_logits(base_model, ids, windows, batch_size),
                                          window_logits(cand_model, ids, windows, batch_size)):
        kld, same, delta = position_stats(base, cand)
        klds.append(kld), sames.append(same), deltas.append(delta)
        nll_b.append(token_nll(base, targets)), nll_c.append(token_nll(cand, targets))
    return summarize(torch.cat(klds), torch.cat(sames), torch.cat(deltas), torch.cat(nll_b), torch.cat(nll_c))


def summarize(kld: torch.Tensor, same: torch.Tensor, delta_p: torch.Tensor, nll_base: torch.Tensor,
              nll_cand: torch.Tensor) -> KLDResult:
    k = kld.double()
    return KLDResult(
        mean=k.mean().item(),
        percentiles={f"p{p:g}": torch.quantile(k, p / 100).item() for p in PERCENTILES},
        max=k.max().item(),
        same_top_p=same.double().mean().item(),
        mean_delta_p=delta_p.double().mean().item(),
        ppl_base=math.exp(nll_base.double().mean().item()),
        ppl_cand=math.exp(nll_cand.double().mean().item()),
        num_tokens=len(k),
        per_position=kld.tolist(), same_top=same.tolist(), nll_base=nll_base.tolist(), nll_cand=nll_cand.tolist(),
    )
