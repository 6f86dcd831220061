"""Batched log P(continuation | context) through our decoder, as lm-evaluation-harness computes it.

Encoding follows lm-eval's `_encode_pair`: trailing spaces of the context move to the
front of the continuation, `whole = encode(context + continuation)`, `ctx = encode(context)`
and the continuation's tokens are `whole[len(ctx):]` (so a merge across the boundary is
scored the way lm-eval scores it). BOS goes before every context where the caller passes
one: lm-eval 0.4's `add_bos_token`, which by default follows the tokenizer (`text.context_bos_id`;
`--add-bos/--no-add-bos`); no other special tokens. An empty context becomes BOS, else EOS.
Inputs longer than the model's context are cut from the left, keeping the continuation.

Fast path: when every continuation of a context is one token (MMLU's " A".." D" on BPE
tokenizers), one forward over the context answers them all from its last position.
Otherwise each pair runs as `(ctx + cont)[:-1]`.

Sequences are sorted by length and packed flat, several per forward (`PackedAttention`:
per-sequence causal attention, no KV cache, no padding), and the vocabulary projection is
applied only to the rows that are scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmopt.errors import LlmoptError
from llmopt.kernels.paged_attention import attend, causal_mask
from llmopt.model.attention import AttentionBackend

DEFAULT_BATCH_TOKENS = 2048  # flat tokens per forward: big enough for efficient GEMMs, small activations


class PackedAttention(AttentionBackend):
    """Causal attention within each of several whole sequences packed one after another."""

    def __init__(self, seq_lens: Sequence[int]):
        self.seq_lens = list(seq_lens)

    def forward(self, layer_idx, q, k, v, sliding_window, math_dtype=None):
        out = torch.empty_like(q)
        start = 0
        for n in self.seq_lens:
            end = start + n
            mask, is_causal = causal_mask(n, 0, sliding_window, q.device)
            out[start:end] = attend(q[start:end], k[start:end], v[start:end], mask, is_causal, math_dtype)
            start = end
        return out


@dataclass
class _Job:
    """One sequence to run and the (pair, row, target token) triples it answers."""

    ids: list[int]
    scores: list[tuple[int, int, int]] = field(default_factory=list)  # (pair index, row in ids, target id)


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str,
                encode_context: Callable[[str], list[int]] | None = None) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair`: context and continuation token ids (`encode_context` may cache)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(context + continuation)
    ctx = (encode_context or encode)(context)
    return ctx, whole[len(ctx):]


def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]], bos_id: int | None = None
                 ) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) of each pair, as lm-eval encodes them: with `bos_id`, BOS first in every
    context (lm-eval's `add_bos_token`); an empty context is BOS, or else EOS (lm-eval's prefix token)."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = (tokenizer.eos_token_ids or [0])[0]
    ctx_cache: dict[str, list[int]] = {}  # every MMLU question's context is asked for four times

    def encode_context(text: str) -> list[int]:
        if text not in ctx_cache:
            ctx_cache[text] = encode(text)
        return ctx_cache[text]

    encoded: list[tuple[list[int], list[int]]] = []
    for context, continuation in pairs:
        if context.strip():
            ctx, cont = encode_pair(encode, context, continuation, encode_context)
        else:  # lm-eval: an empty context is the end-of-text token
            ctx, cont = [], encode(context + continuation)
        if not cont:
            raise LlmoptError(f"continuation {continuation!r} encodes to no tokens after context {context[-40:]!r}")
        if bos_id is not None:
            ctx = [bos_id, *ctx]
        encoded.append((ctx or [eos], cont))
    return encoded


def plan_jobs(tokenizer, pairs: Sequence[tuple[str, str]], max_length: int, bos_id: int | None = None
              ) -> tuple[list[_Job], bool]:
    """The sequences to run for `pairs` (`bos_id`: see `encode_pairs`), and whether every context took the
    one-forward fast path."""
    encoded = encode_pairs(tokenizer, pairs, bos_id)
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(encoded):
        by_context.setdefault(tuple(ctx), []).append(i)
    jobs, all_fast = [], True
    for ctx, members in by_context.items():
        if all(len(encoded[i][1]) == 1 for i in members):
            ids = list(ctx)[-max_length:]
            jobs.append(_Job(ids, [(i, len(ids) - 1, encoded[i][1][0]) for i in members]))
            continue
        all_fast = False
        jobs += [_token_job(i, list(ctx), encoded[i][1], max_length) for i in members]
    return jobs, all_fast


def _token_job(pair: int, ctx: list[int], cont: list[int], max_length: int) -> _Job:
    """`(ctx + cont)[:-1]`, left-truncated like lm-eval, scoring every continuation token."""
    ids = (ctx + cont)[-(max_length + 1):][:-1]
    first = len(ids) - len(cont)
    return _Job(ids, [(pair, first + j, t) for j, t in enumerate(cont)])


def token_jobs(pairs: Sequence[tuple[list[int], list[int]]], max_length: int) -> list[_Job]:
    """Jobs for pairs already tokenized (lm-eval's rolling windows): (context ids, continuation ids)."""
    return [_token_job(i, list(ctx), list(cont), max_length) for i, (ctx, cont) in enumerate(pairs)]


@torch.inference_mode()
def run_jobs(model, jobs: list[_Job], num_pairs: int, batch_tokens: int = DEFAULT_BATCH_TOKENS,
             on_progress: Callable[[int], None] | None = None) -> tuple[list[float], list[bool]]:
    """Per pair: the sum of its target log-probs, and whether every target was the most likely token
    (lm-eval's `is_greedy`). Jobs are packed longest first into forwards of <= batch_tokens."""
    device = next(model.parameters()).device
    totals = torch.zeros(num_pairs, dtype=torch.float64)
    misses = torch.zeros(num_pairs, dtype=torch.int64)
    order = sorted(range(len(jobs)), key=lambda j: -len(jobs[j].ids))
    i = 0
    while i < len(order):
        batch = [jobs[order[i]]]
        used = len(batch[0].ids)
        i += 1
        while i < len(order) and used + len(jobs[order[i]].ids) <= batch_tokens:
            batch.append(jobs[order[i]])
            used += len(batch[-1].ids)
            i += 1
        ids = torch.tensor([t for job in batch for t in job.ids], device=device)
        positions = torch.cat([torch.arange(len(job.ids), device=device) for job in batch])
        hidden = model(ids, positions, PackedAttention([len(job.ids) for job in batch]))
        offsets, pair_idx, rows, targets = 0, [], [], []
        for job in batch:
            for pair, row, target in job.scores:
                pair_idx.append(pair), rows.append(offsets + row), targets.append(target)
            offsets += len(job.ids)
        unique_rows, inverse = torch.tensor(rows, device=device).unique(return_inverse=True)
        logprobs = torch.log_softmax(model.compute_logits(hidden[unique_rows]).float(), dim=-1)
        target_ids = torch.tensor(targets, device=device)
        picked = logprobs[inverse, target_ids].double().cpu()
        totals.index_add_(0, torch.tensor(pair_idx), picked)
        misses.index_add_(0, torch.tensor(pair_idx), (logprobs.argmax(dim=-1)[inverse] != target_ids).long().cpu())
        if on_progress is not None:
            on_progress(len(batch))
    return totals.tolist(), (misses == 0).tolist()


def loglikelihoods(loaded, pairs: Sequence[tuple[str, str]], batch_tokens: int = DEFAULT_BATCH_TOKENS,
                   on_progress: Callable[[int, int], None] | None = None, bos_id: int | None = None) -> list[float]:
    """log P(continuation | context) for each (context, continuation) pair of a LoadedModel, in order
    (`bos_id`: BOS before every context, see `encode_pairs`)."""
    if not pairs:
        return []
    jobs, _ = plan_jobs(loaded.tokenizer, pairs, loaded.config.max_position_embeddings, bos_id)
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        if on_progress is not None:
            on_progress(done[0], len(jobs))

    return run_jobs(loaded.model, jobs, len(pairs), batch_tokens, progress)[0]
