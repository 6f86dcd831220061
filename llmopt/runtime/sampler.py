"""Turning logits into next tokens: greedy, temperature, top-k, top-p, min-p.

Each request samples with its own `torch.Generator` (seeded from `SamplingParams.seed`),
so a seeded request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from llmopt.runtime.sampling_params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [vocab] after temperature, top-k, top-p and min-p (for one request)."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # drop a token when the tokens before it already cover top_p (always keep the first)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum()


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [batch, vocab] -> one next token id per row."""
    greedy_ids = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(greedy_ids[row])
        else:
            probs = filtered_probs(logits[row], p)
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
