"""Prompt log-probabilities as compact tensors, and what the prefix cache keeps of them per block.

A scored prompt position p holds the log-probability of its token given tokens[:p] and the top k
of that distribution; the forward pass computes it at position p - 1. The runner produces them
as `PromptScores` (float32, as log_softmax gave them), and each full block of a scored prompt
keeps its positions' scores plus the final hidden state at its last position (`BlockScores`).
A block's chained hash covers every token its scores depend on, so they are valid for any
request that hits the block; the hidden state scores the first position after a prefix hit,
whose predicting position is in the cache and not computed again. Cold and cached scores become
the runtime's {token: logprob} entries through the same `to_dicts`.

Per block this costs block_size * (4 + 8k) bytes of scores plus one hidden state (hidden_size *
the model's element size), in host memory outside the KV budget: for the default model at k = 20
and 16-token blocks, 2,624 + 2,304 bytes next to 737,280 bytes of fp32 K/V (0.7%); for an 8B
Llama in bf16, ~11 kB next to 2 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptScores:
    """Scores of consecutive prompt positions: the observed token's logprob and the top k."""

    logprobs: torch.Tensor  # [n] float32
    top_ids: torch.Tensor  # [n, k] int32, most likely first
    top_logprobs: torch.Tensor  # [n, k] float32

    @property
    def k(self) -> int:
        return self.top_ids.shape[1]

    def __len__(self) -> int:
        return self.logprobs.shape[0]

    def slice(self, start: int, end: int) -> "PromptScores":
        return PromptScores(self.logprobs[start:end], self.top_ids[start:end], self.top_logprobs[start:end])

    def clone(self) -> "PromptScores":
        """A copy that owns its memory (a slice would keep its whole source alive)."""
        return PromptScores(self.logprobs.clone(), self.top_ids.clone(), self.top_logprobs.clone())

    @staticmethod
    def cat(parts: list["PromptScores"]) -> "PromptScores":
        if len(parts) == 1:
            return parts[0]
        return PromptScores(torch.cat([p.logprobs for p in parts]), torch.cat([p.top_ids for p in parts]),
                            torch.cat([p.top_logprobs for p in parts]))

    def to_dicts(self, token_ids: list[int], top_n: int) -> list[dict[int, float]]:
        """{token: logprob} per position: its token, then the top `top_n` (<= k) not already in it."""
        assert top_n <= self.k and len(token_ids) == len(self)
        top_ids = self.top_ids[:, :top_n].tolist()
        top_values = self.top_logprobs[:, :top_n].tolist()
        entries = []
        for token, value, ids, values in zip(token_ids, self.logprobs.tolist(), top_ids, top_values):
            entry = {token: value}
            for tid, v in zip(ids, values):
                entry.setdefault(tid, v)
            entries.append(entry)
        return entries


def score_rows(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> PromptScores:
    """PromptScores (on the CPU) from logits [n, vocab] and the tokens [n] they predict."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, targets[:, None]).squeeze(1)
    if top_n:
        top = torch.topk(logprobs, top_n)
        top_values, top_ids = top.values, top.indices.to(torch.int32)
    else:
        top_values = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = torch.empty((logprobs.shape[0], 0), dtype=torch.int32, device=logprobs.device)
    return PromptScores(picked.cpu(), top_ids.cpu(), top_values.cpu())


@dataclass
class ScoredChunk:
    """What one step scored of one request's prompt: positions first..first+len(scores)-1 (scores is
    None when the step scored none), and the final hidden state at the last position of each block
    that ends inside the prompt and was computed in the step (block index -> [hidden] on the CPU)."""

    first: int
    scores: PromptScores | None
    block_hiddens: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class BlockScores:
    """A cached block's prompt scores: its positions' (block 0 from position 1, which is the first
    with a score) and the final hidden state at its last position."""

    scores: PromptScores
    last_hidden: torch.Tensor  # [hidden_size], the model's dtype, CPU

    @property
    def k(self) -> int:
        return self.scores.k


@dataclass
class ScoreBuffer:
    """A scoring request's own scores for prompt positions start.., held until the prefix cache
    registers the blocks they belong to (`KVCacheManager.cache_full_blocks`).

    `prev_hidden`: after a prefix hit, the final hidden state at position start - 1 (the hit's last
    position), which scores position start.
    """

    start: int
    prev_hidden: torch.Tensor | None = None
    scores: PromptScores | None = None
    block_hiddens: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, chunk: ScoredChunk) -> None:
        self.block_hiddens.update(chunk.block_hiddens)
        if chunk.scores is None:
            return
        end = self.start + (len(self.scores) if self.scores is not None else 0)
        assert chunk.first == end, f"scores for position {chunk.first} arrived, expected {end}"
        self.scores = chunk.scores if self.scores is None else PromptScores.cat([self.scores, chunk.scores])

    def block(self, index: int, block_size: int) -> BlockScores | None:
        """Block `index`'s scores, if this buffer holds all its positions and its last hidden state."""
        hidden = self.block_hiddens.get(index)
        lo, hi = max(1, index * block_size), (index + 1) * block_size
        if hidden is None or self.scores is None or lo < self.start or hi > self.start + len(self.scores):
            return None
        return BlockScores(self.scores.slice(lo - self.start, hi - self.start).clone(), hidden.clone())

    def drop_before_block(self, index: int, block_size: int) -> None:
        """Forget what blocks before `index` needed (they are registered)."""
        self.block_hiddens = {i: h for i, h in self.block_hiddens.items() if i >= index}
        if self.scores is None:
            return
        cut = min(index * block_size - self.start, len(self.scores))
        if cut > 0:
            self.scores = self.scores.slice(cut, len(self.scores))
            self.start += cut
