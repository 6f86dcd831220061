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

Sequences that begin with the same tokens (MMLU's subject header before every question of a
subject: 16.7% of its tokens) run that prefix once: the sequences are sorted, the shared prefixes
chosen from the longest common prefixes of neighbours so that the tokens saved are most
(`prefix_groups`), and each sequence's rest attends to its group's prefix and then causally to
itself, as a prefix cache would give it. Groups and lone sequences are packed flat, longest first,
several per forward (`PackedAttention`: per-sequence causal attention, no KV cache, no padding), and
the last layer's MLP and the vocabulary projection are applied only to the rows that are scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmopt.errors import LlmoptError
from llmopt.kernels import cpu_prefill_attention
from llmopt.kernels.paged_attention import attend, causal_mask
from llmopt.model.attention import AttentionBackend

DEFAULT_BATCH_TOKENS = 2048  # flat tokens per forward: big enough for efficient GEMMs, small activations


class PackedAttention(AttentionBackend):
    """Causal attention within each of several sequences packed one after another; a sequence with a
    prefix (`prefix_of[i]`: the index of another packed sequence, -1 for none) attends to all of that
    one's keys first, its own positions continuing the prefix's."""

    def __init__(self, seq_lens: Sequence[int], prefix_of: Sequence[int] | None = None):
        self.seq_lens = list(seq_lens)
        self.prefix_of = list(prefix_of) if prefix_of is not None else [-1] * len(self.seq_lens)
        self.starts = [0]
        for n in self.seq_lens[:-1]:
            self.starts.append(self.starts[-1] + n)
        # (queries, context, window) -> causal_mask's answer: the same for every layer
        self._masks: dict[tuple[int, int, int | None], tuple[torch.Tensor | None, bool]] = {}
        self._segment_rows: torch.Tensor | None = None

    def forward(self, layer_idx, q, k, v, sliding_window, math_dtype=None):
        # every sequence in one call, its math chosen by the forward's size (a prompt-sized pass, as the dense layers')
        math = cpu_prefill_attention.kernel_math(q, math_dtype, q.shape[0])
        if math is not None:
            return cpu_prefill_attention.prefill_attention_kernel()(q, k, v, self._segments(), q.shape[-1] ** -0.5,
                                                                    sliding_window or 0, math == "bf16")
        out = torch.empty_like(q)
        for start, n, prefix in zip(self.starts, self.seq_lens, self.prefix_of):
            end = start + n
            keys, values, context = k[start:end], v[start:end], 0
            if prefix >= 0:
                p_start, context = self.starts[prefix], self.seq_lens[prefix]
                keys = torch.cat([k[p_start:p_start + context], keys])
                values = torch.cat([v[p_start:p_start + context], values])
            key = (n, context, sliding_window)
            if key not in self._masks:
                self._masks[key] = causal_mask(n, context, sliding_window, q.device)
            mask, is_causal = self._masks[key]
            out[start:end] = attend(q[start:end], keys, values, mask, is_causal, math_dtype)
        return out

    def _segments(self) -> torch.Tensor:
        """The kernel's [S, 5] rows: (q_start, q_len, ctx_start, ctx_len, own_start) per sequence."""
        if self._segment_rows is None:
            self._segment_rows = torch.tensor([
                [start, n, self.starts[p] if p >= 0 else 0, self.seq_lens[p] if p >= 0 else 0, start]
                for start, n, p in zip(self.starts, self.seq_lens, self.prefix_of)], dtype=torch.int64)
        return self._segment_rows


@dataclass
class _Job:
    """One sequence to run and the (pair, row, target token) triples it answers."""

    ids: list[int]
    scores: list[tuple[int, int, int]] = field(default_factory=list)  # (pair index, row in ids, target id)


def _split_spaces(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's `_encode_pair` first step: trailing spaces of the context go to the continuation's front."""
    spaces = len(context) - len(context.rstrip())
    return (context[:-spaces], context[-spaces:] + continuation) if spaces else (context, continuation)


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair`: context and continuation token ids."""
    context, continuation = _split_spaces(context, continuation)
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx):]


def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]], bos_id: int | None = None
                 ) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) of each pair, as lm-eval encodes them (`encode_pair`, every distinct text
    tokenized once, all in one batch): with `bos_id`, BOS first in every context (lm-eval's `add_bos_token`); an
    empty context is BOS, or else EOS (lm-eval's prefix token)."""
    eos = (tokenizer.eos_token_ids or [0])[0]
    split = [_split_spaces(c, cont) if c.strip() else ("", c + cont) for c, cont in pairs]
    texts = list(dict.fromkeys(t for ctx, cont in split for t in ((ctx, ctx + cont) if ctx else (ctx + cont,))))
    ids = dict(zip(texts, tokenizer.encode_batch(texts, add_special_tokens=False)))
    encoded: list[tuple[list[int], list[int]]] = []
    for (context, continuation), (ctx_text, cont_text) in zip(pairs, split):
        if ctx_text:
            ctx = ids[ctx_text]
            cont = ids[ctx_text + cont_text][len(ctx):]
        else:  # lm-eval: an empty context is the end-of-text token
            ctx, cont = [], ids[cont_text]
        if not cont:
            raise LlmoptError(f"continuation {continuation!r} encodes to no tokens after context {context[-40:]!r}")
        if bos_id is not None:
            ctx = [bos_id, *ctx]
        encoded.append((list(ctx) or [eos], list(cont)))
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


MIN_SHARED_PREFIX = 8  # tokens sequences must share for their prefix to run once (fewer: each runs whole)
MAX_RUN = 64  # sequences sharing one prefix at most (a forward holds ~20 MMLU questions: a longer run is split anyway)


@dataclass
class _Unit:
    """What one stretch of a packed forward runs: `jobs` whose first `shared` tokens are the same (0: one job run
    whole), the prefix once and then each job's rest."""

    jobs: list[_Job]
    shared: int = 0

    @property
    def num_tokens(self) -> int:
        return self.shared + sum(len(job.ids) - self.shared for job in self.jobs)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_groups(common: Sequence[int], min_shared: int = MIN_SHARED_PREFIX, max_run: int = MAX_RUN
                  ) -> list[tuple[int, int, int]]:
    """Sequences sorted by their tokens, `common[i]` the longest common prefix of the i-th and the next: a
    partition into runs `(lo, hi, shared)` whose members run their first `shared` tokens once (0: one member),
    chosen so that the tokens saved, (hi - lo - 1) * shared summed, are most among runs of <= `max_run` members.

    A run's members share the minimum of its `common` values. Dynamic programming over where the last run
    starts: O(len(common) * max_run), and a run stops growing once it shares fewer than `min_shared` tokens."""
    n = len(common) + 1
    best = [0] * (n + 1)  # best[i]: the most saved by runs covering sequences 0..i-1
    start, shared_by = list(range(-1, n)), [0] * (n + 1)  # the last run of that best: first member, prefix
    for i in range(1, n + 1):
        best[i] = best[i - 1]  # sequence i-1 alone
        shared = None
        for j in range(i - 2, max(-1, i - 1 - max_run), -1):  # sequences j..i-1 as one run
            shared = common[j] if shared is None else min(shared, common[j])
            if shared < min_shared:
                break
            if best[j] + (i - 1 - j) * shared > best[i]:
                best[i], start[i], shared_by[i] = best[j] + (i - 1 - j) * shared, j, shared
    runs, i = [], n
    while i > 0:
        runs.append((start[i], i, shared_by[i]))
        i = start[i]
    return runs[::-1]


def plan_units(jobs: Sequence[_Job], batch_tokens: int, min_shared: int | None = MIN_SHARED_PREFIX) -> list[_Unit]:
    """The jobs as units of one forward each at most: groups sharing a prefix (`prefix_groups`), split where one
    would pass `batch_tokens`, and lone jobs (all of them with `min_shared` None)."""
    if min_shared is None or len(jobs) < 2:
        return [_Unit([job]) for job in jobs]
    order = sorted(range(len(jobs)), key=lambda j: jobs[j].ids)
    common = [_common_prefix(jobs[a].ids, jobs[b].ids) for a, b in zip(order, order[1:])]
    units: list[_Unit] = []
    for lo, hi, shared in prefix_groups(common, min_shared):
        unit = _Unit([], shared)
        for job in (jobs[order[i]] for i in range(lo, hi)):
            if unit.jobs and unit.num_tokens + len(job.ids) - shared > batch_tokens:
                units.append(unit)
                unit = _Unit([], shared)
            unit.jobs.append(job)
        units.append(unit)
    for unit in units:
        if len(unit.jobs) == 1:  # a group's last piece of one job: nothing to share
            unit.shared = 0
    return units


@dataclass
class _Pack:
    """One forward's flat inputs and, per scored target, where it is answered."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    prefix_of: list[int] = field(default_factory=list)
    pairs: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)

    def add_sequence(self, ids: list[int], first_position: int, prefix: int) -> int:
        """Append a sequence (positions from `first_position`; `prefix` as in `PackedAttention`): its first row."""
        row = len(self.ids)
        self.ids += ids
        self.positions += range(first_position, first_position + len(ids))
        self.seq_lens.append(len(ids))
        self.prefix_of.append(prefix)
        return row

    def add(self, unit: _Unit) -> None:
        prefix, prefix_row = -1, 0
        if unit.shared:
            prefix, prefix_row = len(self.seq_lens), self.add_sequence(unit.jobs[0].ids[:unit.shared], 0, -1)
        for job in unit.jobs:
            rest = job.ids[unit.shared:]
            first_row = self.add_sequence(rest, unit.shared, prefix) if rest else len(self.ids)
            for pair, row, target in job.scores:
                self.pairs.append(pair)
                self.rows.append(prefix_row + row if row < unit.shared else first_row + row - unit.shared)
                self.targets.append(target)


@torch.inference_mode()
def run_jobs(model, jobs: list[_Job], num_pairs: int, batch_tokens: int = DEFAULT_BATCH_TOKENS,
             on_progress: Callable[[int], None] | None = None, min_shared_prefix: int | None = MIN_SHARED_PREFIX
             ) -> tuple[list[float], list[bool]]:
    """Per pair: the sum of its target log-probs, and whether every target was the most likely token
    (lm-eval's `is_greedy`). Jobs sharing a prefix of >= `min_shared_prefix` tokens run it once (None: never);
    the units are packed longest first into forwards of <= batch_tokens."""
    device = next(model.parameters()).device
    totals = torch.zeros(num_pairs, dtype=torch.float64)
    misses = torch.zeros(num_pairs, dtype=torch.int64)
    order = sorted(plan_units(jobs, batch_tokens, min_shared_prefix), key=lambda unit: -unit.num_tokens)
    i = 0
    while i < len(order):
        batch = [order[i]]
        used = batch[0].num_tokens
        i += 1
        while i < len(order) and used + order[i].num_tokens <= batch_tokens:
            batch.append(order[i])
            used += order[i].num_tokens
            i += 1
        pack = _Pack()
        for unit in batch:
            pack.add(unit)
        unique_rows, inverse = torch.tensor(pack.rows, device=device).unique(return_inverse=True)
        hidden = model(torch.tensor(pack.ids, device=device), torch.tensor(pack.positions, device=device),
                       PackedAttention(pack.seq_lens, pack.prefix_of), output_rows=unique_rows)
        logprobs = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
        target_ids = torch.tensor(pack.targets, device=device)
        picked = logprobs[inverse, target_ids].double().cpu()
        pair_idx = torch.tensor(pack.pairs)
        totals.index_add_(0, pair_idx, picked)
        misses.index_add_(0, pair_idx, (logprobs.argmax(dim=-1)[inverse] != target_ids).long().cpu())
        if on_progress is not None:
            on_progress(sum(len(unit.jobs) for unit in batch))
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
