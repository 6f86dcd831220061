"""Perplexity: exp(mean negative log-likelihood) of a text's tokens, every token counted once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from llmopt.eval.windows import num_scored, plan_windows, window_logits


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per token (nats)
    num_tokens: int  # tokens scored
    token_nll: list[float] = field(repr=False, default_factory=list)  # per token, for paired bootstraps

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "nll": self.nll, "num_tokens": self.num_tokens}


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def perplexity(model, ids: torch.Tensor, context: int = 512, stride: int = 256, batch_size: int = 8) -> PerplexityResult:
    windows = plan_windows(len(ids), context, stride)
    nll = torch.cat([token_nll(logits, targets) for targets, logits in window_logits(model, ids, windows, batch_size)])
    assert len(nll) == num_scored(windows) == len(ids) - 1
    mean = nll.double().mean().item()
    return PerplexityResult(ppl=math.exp(mean), nll=mean, num_tokens=len(nll), token_nll=nll.tolist())
