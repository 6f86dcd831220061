"""Turning logits into next tokens: penalties, greedy, temperature, top-k, top-p, min-p, logprobs,
and a structured output's token mask for just the rows that have one.

Each request samples with its own `torch.Generator` (seeded from `SamplingParams.seed`),
so a seeded request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        probs = _top_p(probs, params.top_p)
    return probs / probs.sum()


TOP_P_CANDIDATES = 1024  # the largest tokens looked at before sorting the whole vocabulary


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token after the smallest prefix (by falling probability) that covers `top_p`;
    the first token is always kept.

    A full sort of a 49k vocabulary costs ~4 ms on a CPU core, per sampled row and step; the
    nucleus at top_p <= 0.95 is usually a few hundred tokens, so the largest TOP_P_CANDIDATES
    come first (a tenth of the sort's time) and the sort runs only when they cover less than
    top_p. When they cover it, every token outside them has at least their mass before it and
    is dropped, so the result is the sort's."""
    sorted_probs, order = torch.topk(probs, min(TOP_P_CANDIDATES, probs.numel()))
    covered = torch.cumsum(sorted_probs, dim=-1)
    if order.numel() < probs.numel() and not float(covered[-1]) >= top_p:
        sorted_probs, order = torch.sort(probs, descending=True)
        covered = torch.cumsum(sorted_probs, dim=-1)
    # drop a token when the tokens before it already cover top_p (always keep the first)
    sorted_probs = sorted_probs.masked_fill(covered - sorted_probs >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` [vocab] by inverse CDF, from a single uniform number.

    One cumulative sum and one search: on CPU at a 49k vocabulary, torch.multinomial and the
    exponential race (vLLM's GPU sampler) each cost a large part of an int4 decode step, this
    a tenth of either (docs/benchmarks.md). The float64 running sum keeps each token's share
    of [0, total) equal to its probability to ~1e-16.
    """
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    # the draw comes from the request's (CPU) generator whatever the device of probs; scaled by
    # the total it stays below cdf[-1], so the first entry above it is a token with probability > 0
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * cdf[-1:]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=probs.numel() - 1))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """vLLM's semantics: repetition penalty over prompt + output, presence/frequency over output.

    Every tensor combined with `logits` is made on its device in its dtype (token ids are
    copied there once; the counts are summed there), so CUDA logits meet no CPU operand."""
    logits = logits.clone()
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output_ids, dtype=torch.long, device=device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones(ids.shape, dtype=logits.dtype, device=device))
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


@dataclass
class SampleRequest:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    blocked_ids: list[int]  # tokens that may not be sampled now (EOS/stop ids before min_tokens)
    # bool [vocab]: the only tokens that may be sampled (a structured output's grammar); None = all
    allowed_ids: torch.Tensor | None = None


@dataclass
class SampleResult:
    token_id: int
    # {token_id: logprob} for the chosen token and the top-N, when logprobs were asked for
    logprobs: dict[int, float] | None = None


def _prepare_row(row_logits: torch.Tensor, req: SampleRequest) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits to sample from, logits whose log-softmax is reported) for one row: penalties, blocked
    tokens, then a grammar's mask."""
    p = req.params
    raw_logits = row_logits
    if p.uses_penalties:
        row_logits = apply_penalties(row_logits, p, req.prompt_ids, req.output_ids)
    if req.blocked_ids:
        row_logits = row_logits.clone()
        row_logits[torch.tensor(req.blocked_ids, dtype=torch.long, device=row_logits.device)] = float("-inf")
    # logprobs describe the model's distribution (after penalties) before a grammar's mask, as vLLM's
    # default does; the masked one has -inf everywhere the grammar forbids
    scored_logits = row_logits
    if req.allowed_ids is not None:
        forbidden = ~req.allowed_ids.to(row_logits.device)
        masked = row_logits.masked_fill(forbidden, float("-inf"))
        if not bool(torch.isfinite(masked).any()):
            # min_tokens blocked the grammar's only way on (EOS): the grammar wins
            scored_logits = raw_logits
            masked = scored_logits.masked_fill(forbidden, float("-inf"))
        row_logits = masked
    return row_logits, scored_logits


def _logprobs(scored_logits: torch.Tensor, token: int, n: int | None) -> dict[int, float] | None:
    """{token: logprob} for the chosen token and the top n, as vLLM reports them."""
    if n is None:
        return None
    lp = torch.log_softmax(scored_logits, dim=-1)
    logprobs = {token: float(lp[token])}
    if n > 0:
        top = torch.topk(lp, n)
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            logprobs.setdefault(tid, val)
    return logprobs


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The first index of each row's maximum (a NaN counts as the maximum, as in torch.argmax). On CPU
    through NumPy's SIMD argmax: torch's took 43 us for one row of a 49,152-token vocabulary and 277 us
    for eight (2 threads), NumPy's 4 and 27 us."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample_batch(logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampleResult]:
    """logits [batch, vocab] -> one result per row."""
    logits = logits.float()
    plain = all(not r.params.uses_penalties and not r.blocked_ids and r.allowed_ids is None for r in requests)
    greedy_ids = argmax_rows(logits) if plain else None
    results: list[SampleResult] = []
    for row, req in enumerate(requests):
        p = req.params
        if plain and p.greedy:  # the batched argmax: no per-row work at all
            results.append(SampleResult(greedy_ids[row], _logprobs(logits[row], greedy_ids[row], p.logprobs)))
            continue
        results.append(verify_row(logits[row], req, None))
    return results


def verify_row(row_logits: torch.Tensor, req: SampleRequest, draft: int | None) -> SampleResult:
    """The target's token at one position, given a proposed `draft` token (None: plain sampling).

    Greedy: the target's argmax (the draft is accepted iff they agree). Sampling: the draft is
    accepted with the target's probability of it, else a token is drawn from the target's
    distribution without it, renormalised. Both proposers guess one token (a point mass q), so
    this is Leviathan et al.'s rule min(1, p/q) with q one-hot: each token comes out with exactly
    the target's probability p, proposal or not.
    """
    p = req.params
    row_logits, scored_logits = _prepare_row(row_logits.float(), req)
    if p.greedy:
        token = int(row_logits.argmax())
    else:
        probs = filtered_probs(row_logits, p)
        token = -1
        if draft is not None:
            u = float(torch.rand((), generator=req.generator, dtype=torch.float64))
            if u < float(probs[draft]):
                token = draft
            else:
                probs = probs.clone()
                probs[draft] = 0.0
                if not float(probs.sum()) > 0:  # rounding left nothing else: the draft was certain
                    token = draft
        if token < 0:
            token = draw(probs, req.generator)
    return SampleResult(token, _logprobs(scored_logits, token, p.logprobs))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Plain sampling (no penalties or blocked tokens): logits [batch, vocab] -> token ids."""
    requests = [SampleRequest(p, g, [], [], []) for p, g in zip(params, generators)]
    return [r.token_id for r in sample_batch(logits, requests)]
