"""Continuous batching with one token budget per step (vLLM v1's scheduler, small).

Prefill and decode are the same thing here: every request has `num_computed_tokens`,
and each step gives some requests some more tokens to compute, within
`max_num_batched_tokens`. A decode is a request one token behind; a prompt is a request
many tokens behind, computed in chunks when the budget is short. Running requests go
first (FCFS); when the KV pool is exhausted the newest running request is preempted:
its blocks are freed and it is recomputed later from its prompt plus the tokens it
already produced (identical results, since decoding is deterministic given the tokens).
A waiting request that asks for prompt logprobs stays waiting (later ones may go first) while
a running request computes and scores its next uncached block: the step after, that block is a
prefix hit whose stored scores answer it, instead of the same context computed twice.

With speculative decoding, a decoding request may also get lookahead slots: room for K draft
tokens after its last one, which the proposer fills before the step runs. `update_from_output`
is the one place that changes a request after a step: it records prompt scores, advances
`num_computed_tokens`, appends the sampled (or verified) tokens, rolls back rejected draft positions, registers full
blocks in the prefix cache, checks stop conditions and frees finished requests' blocks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmopt.runtime.closing import CLOSING_WINDOW
from llmopt.runtime.kv_cache_manager import KVCacheManager
from llmopt.runtime.sequence import Sequence, SequenceStatus
from llmopt.runtime.speculative import SpecDecodingStats

if TYPE_CHECKING:
    from llmopt.runtime.model_runner import RunnerOutput
    from llmopt.runtime.sampler import SampleResult


@dataclass
class SchedulerOutput:
    # (sequence, number of its tokens to compute this step), in batch order
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # decoding requests given room for this many draft tokens after their last token
    lookahead: list[tuple[Sequence, int]] = field(default_factory=list)
    # the drafts a proposer filled in (request id -> tokens); their requests compute 1 + len(drafts) tokens
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def add_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Put a proposer's drafts (at most each request's lookahead) into the step."""
        room = {seq.request_id: k for seq, k in self.lookahead}
        self.spec_token_ids = {rid: d[: room[rid]] for rid, d in drafts.items() if d and rid in room}
        self.scheduled = [(seq, n + len(self.spec_token_ids.get(seq.request_id, ()))) for seq, n in self.scheduled]


@dataclass
class StepUpdate:
    """What one step did to one request."""

    seq: Sequence
    new_token_ids: list[int]
    first_token: bool  # its first output token (or, for a max_tokens=0 request, its prompt scores) came now


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: list[int] | None = None, max_model_len: int | None = None,
                 num_speculative_tokens: int = 0, speculative_disable_by_batch_size: int | None = None,
                 spec_stats: SpecDecodingStats | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = list(eos_token_ids or [])
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_disable_by_batch_size = speculative_disable_by_batch_size
        self.spec_stats = spec_stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        speculate = self._speculation_enabled()
        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            lookahead = min(self._lookahead(seq), budget - num_new) if speculate and num_new == 1 else 0
            while not self.kv.allocate_slots(seq, num_new + lookahead):
                if lookahead:  # no room to speculate: decode plainly before preempting anyone
                    lookahead = 0
                    continue
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                if lookahead:
                    out.lookahead.append((seq, lookahead))
                scheduled_ids.add(id(seq))
                budget -= num_new + lookahead
                i += 1
                continue
            break  # seq itself was preempted; everything after it is gone too

        # 2. waiting requests, in arrival order, while nothing had to be preempted
        scoring: dict[bytes, int] | None = None  # built when a waiting request needs prompt scores
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[i]
            computed = self.kv.get_computed_blocks(seq)
            if seq.needs_prompt_scores and self.kv.enable_prefix_caching:
                scoring = self._blocks_being_scored() if scoring is None else scoring
                if self._wait_for_scores(seq, len(computed), scoring):
                    i += 1
                    continue
            num_computed = len(computed) * self.kv.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(seq, num_new, computed):
                break
            self.kv.record_prefix_lookup(seq.num_tokens, num_computed)
            self.kv.load_prompt_scores(seq, computed)
            del self.waiting[i]
            if scoring is not None:
                self._add_blocks_being_scored(seq, scoring)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_computed
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return out

    def _blocks_being_scored(self) -> dict[bytes, int]:
        """Block hash -> k, for the blocks running requests are computing that will be registered with
        their prompt scores (top k)."""
        scoring: dict[bytes, int] = {}
        for seq in self.running:
            self._add_blocks_being_scored(seq, scoring)
        return scoring

    def _add_blocks_being_scored(self, seq: Sequence, scoring: dict[bytes, int]) -> None:
        buffer = seq.score_buffer
        if buffer is None:
            return
        bs, k = self.kv.block_size, seq.params.prompt_logprobs
        for i in range(seq.num_cached_blocks, min(len(seq.block_hashes), seq.num_prompt_tokens // bs)):
            if max(1, i * bs) >= buffer.start:
                h = seq.block_hashes[i]
                scoring[h] = max(k, scoring.get(h, -1))

    def _wait_for_scores(self, seq: Sequence, num_hits: int, scoring: dict[bytes, int]) -> bool:
        """Whether a request that needs prompt scores should stay waiting: a running request is
        computing and scoring its next uncached block, which will be a hit in a later step.

        Evaluation harnesses send a question's choices at once (one prompt each, the same context);
        admitted together, each would compute and score the whole context. Waiting costs the
        later ones the steps the first spends on the shared blocks and saves computing them again.
        Requests that need no prompt scores never wait (vLLM's behaviour).
        """
        if num_hits >= self.kv.max_hit_blocks(seq):
            return False
        return scoring.get(seq.block_hashes[num_hits], -1) >= seq.params.prompt_logprobs

    def _speculation_enabled(self) -> bool:
        if not self.num_speculative_tokens:
            return False
        limit = self.speculative_disable_by_batch_size
        disabled = limit is not None and len(self.running) > limit
        self.spec_stats.disabled = disabled
        self.spec_stats.num_steps_disabled += disabled
        return not disabled

    def _lookahead(self, seq: Sequence) -> int:
        """Draft tokens a decoding request may verify this step: a step yields up to K + 1 tokens,
        which must fit max_tokens and the model's length; none for a constrained request in its
        closing window: each of its tokens there is checked against its closing path."""
        left = seq.tokens_left(self.max_model_len)
        if seq.matcher is not None and left <= CLOSING_WINDOW:
            return 0
        return max(0, min(self.num_speculative_tokens, left - 1))

    # ---- after a step ---------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, runner_out: "RunnerOutput",
                           sampled: dict[str, list["SampleResult"]]) -> list[StepUpdate]:
        """Apply one step's results; the requests that got tokens or finished, in batch order.

        `sampled` holds each sampling request's tokens: one, or for a speculating request the
        verified run (its accepted drafts, then the target's token). K/V of rejected draft
        positions are rolled back (`num_computed_tokens` ends before the last new token, whose
        K/V the next step computes) and blocks holding only rejected positions are freed, so the
        prefix cache only ever hashes accepted tokens.
        """
        now = time.time()
        # prompt scores first: registering a block keeps its scores with it
        for seq, chunk in runner_out.prompt_logprobs:
            if chunk.scores is not None:
                ids = seq.token_ids[chunk.first : chunk.first + len(chunk.scores)]
                seq.prompt_logprobs.extend(chunk.scores.to_dicts(ids, seq.params.prompt_logprobs))
            if seq.score_buffer is not None:
                seq.score_buffer.add(chunk)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            if seq.request_id not in sched.spec_token_ids:
                self.kv.cache_full_blocks(seq)
        updates: list[StepUpdate] = []
        for seq in runner_out.prompts_done:  # max_tokens=0: the scored prompt is the whole answer
            seq.finish_reason = "length"
            seq.first_token_time = seq.finished_time = now
            self.finish(seq)
            updates.append(StepUpdate(seq, [], True))
        lookahead = {seq.request_id for seq, _ in sched.lookahead}
        for seq in runner_out.samplers:
            results = sampled[seq.request_id]
            first = seq.first_token_time is None
            if first:
                seq.first_token_time = now
            new_ids = []
            for result in results:
                self._append_token(seq, result)
                new_ids.append(result.token_id)
                if seq.finish_reason is not None:
                    break
            drafts = sched.spec_token_ids.get(seq.request_id)
            if drafts is not None:
                accepted = next((i for i, (d, r) in enumerate(zip(drafts, results)) if r.token_id != d),
                                min(len(drafts), len(results)))
                self.spec_stats.observe(len(drafts), accepted)
                seq.spec_num_drafts += 1
                seq.spec_num_draft_tokens += len(drafts)
                seq.spec_num_accepted_tokens += accepted
                # K/V computed for the last known token and the accepted drafts only
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                self.kv.cache_full_blocks(seq)
            if seq.request_id in lookahead and seq.finish_reason is None:
                self.kv.trim(seq, seq.num_tokens)
            if seq.finish_reason is not None:
                seq.finished_time = now
                self.finish(seq)
            updates.append(StepUpdate(seq, new_ids, first))
        return updates

    def _append_token(self, seq: Sequence, result: "SampleResult") -> None:
        seq.token_ids.append(result.token_id)
        if result.logprobs is not None:
            seq.logprobs.append(result.logprobs)
        check_stop(seq, result.token_id, self.eos_token_ids, self.max_model_len)
        if seq.matcher is not None:
            # a constrained request's matcher takes every appended token; a finished grammar (only EOS
            # left) ends the request even under ignore_eos
            seq.matcher.consume_token(result.token_id)
            if seq.closing is not None and seq.closing.done and seq.stop_reason is None:
                seq.finish_reason = "length"  # closing mode wrote its path: the budget ended it, closed
            elif seq.finish_reason is None and seq.matcher.is_stopped():
                seq.finish_reason = "stop"

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED


def check_stop(seq: Sequence, token: int, eos_token_ids: list[int], max_model_len: int | None) -> None:
    """After `token` was appended: set seq.finish_reason if the request is done (vLLM's order)."""
    p = seq.params
    stop_string_hit = seq.detokenizer.add_token(token)
    if not p.ignore_eos and token in eos_token_ids:
        seq.finish_reason = "stop"
    elif token in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
    elif stop_string_hit:
        seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_reason
    elif seq.num_output_tokens >= p.max_tokens or (max_model_len is not None and seq.num_tokens >= max_model_len):
        seq.finish_reason = "length"
