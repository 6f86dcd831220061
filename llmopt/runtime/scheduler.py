"""Continuous batching with one token budget per step (vLLM v1's scheduler, small).

Prefill and decode are the same thing here: every request has `num_computed_tokens`,
and each step gives some requests some more tokens to compute, within
`max_num_batched_tokens`. A decode is a request one token behind; a prompt is a request
many tokens behind, computed in chunks when the budget is short. Running requests go
first (FCFS); when the KV pool is exhausted the newest running request is preempted:
its blocks are freed and it is recomputed later from its prompt plus the tokens it
already produced (identical results, since decoding is deterministic given the tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmopt.runtime.kv_cache_manager import KVCacheManager
from llmopt.runtime.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    # (sequence, number of its tokens to compute this step), in batch order
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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

        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                scheduled_ids.add(id(seq))
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted; everything after it is gone too

        # 2. waiting requests, in arrival order, while nothing had to be preempted
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            computed = self.kv.get_computed_blocks(seq)
            num_computed = len(computed) * self.kv.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(seq, num_new, computed):
                break
            self.kv.record_prefix_lookup(seq.num_tokens, num_computed)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return out

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
