"""Proposers for speculative decoding: guesses of a decoding request's next tokens.

Both propose greedily (the draft's most likely token, or the continuation of an earlier match),
so a proposal is a point guess: `rejection_sampler.verify_row` accepts a guess with the target's
probability of it, which keeps the target's distribution exactly (vLLM's n-gram and draft-model
proposers do the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmopt.loader import LoadedModel
from llmopt.runtime.model_runner import ModelRunner
from llmopt.runtime.sampler import argmax_rows
from llmopt.runtime.sequence import Sequence


class NgramProposer:
    """Prompt lookup: find the longest suffix of the request's tokens (between `min_n` and `max_n`
    tokens) that occurred earlier in its prompt or output, and propose what followed its most
    recent earlier occurrence. No model: it pays off where the output quotes the input (code
    edits, summaries with citations, retrieval answers)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        drafts = {}
        for seq, k in requests:
            tokens = seq.token_ids
            draft = find_continuation(np.asarray(tokens, dtype=np.int64), self.min_n, self.max_n, k)
            if draft:
                drafts[seq.request_id] = draft
        return drafts

    def discard(self, seq: Sequence) -> None:
        pass


def find_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0..length-n-1: each has at least one token after it, and none is the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@dataclass
class _DraftView:
    """What ModelRunner.execute reads of a sequence, for the draft's own forward passes."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    needs_prompt_scores: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    """A smaller model proposes K tokens by greedy decoding, on its own paged KV pool.

    The draft's pool has as many blocks as the target's and a request uses the same block ids in
    both (one block table, one allocation: the engine sizes the pool for target + draft bytes per
    block), so prefix caching, preemption and rollback need nothing of their own. The draft's K/V
    of a request stay valid up to the target's `num_computed_tokens` (rejected positions are
    recomputed on the next proposal), and are rebuilt from the start after a preemption or for a
    new request (its cached prefix blocks may never have been filled by the draft).
    """

    def __init__(self, draft: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype):
        self.draft = draft
        self.runner = ModelRunner(draft.model, num_blocks, block_size, draft.dtype, draft.device, kv_dtype=kv_dtype)
        # (request id, preemptions) -> tokens whose draft K/V are in the draft pool
        self.num_computed: dict[tuple[str, int], int] = {}

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        views: list[tuple[Sequence, _DraftView, int]] = []
        scheduled = []
        for seq, k in requests:
            key = (seq.request_id, seq.num_preemptions)
            start = min(self.num_computed.get(key, 0), seq.num_computed_tokens)
            view = _DraftView(seq.request_id, list(seq.token_ids), start, seq.block_table)
            views.append((seq, view, k))
            scheduled.append((view, view.num_tokens - start))  # catch up to the last known token
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq, _, _ in views}
        active = views
        while scheduled:
            out = self.runner.execute(scheduled)
            next_ids = argmax_rows(out.logits)
            by_view = {id(v): t for v, t in zip(out.samplers, next_ids)}
            for view, n in scheduled:
                view.num_computed_tokens += n
            still = []
            for seq, view, k in active:
                token = by_view[id(view)]
                drafts[seq.request_id].append(token)
                if len(drafts[seq.request_id]) < k:
                    view.token_ids.append(token)
                    still.append((seq, view, k))
                self.num_computed[(seq.request_id, seq.num_preemptions)] = view.num_computed_tokens
            active = still
            scheduled = [(view, 1) for _, view, _ in active]
        return drafts

    def discard(self, seq: Sequence) -> None:
        for key in [key for key in self.num_computed if key[0] == seq.request_id]:
            del self.num_computed[key]
