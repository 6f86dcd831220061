"""A request inside the engine: its tokens, progress, KV blocks and timing."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from llmopt.runtime.prompt_scores import ScoreBuffer
from llmopt.runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    # all tokens, prompt then output; the scheduler only ever looks at counts
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # tokens whose K/V are in the cache (or about to be, for the step being run)
    num_computed_tokens: int = 0
    # prompt tokens found in the prefix cache when the request was first scheduled
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # chained hashes of the full blocks of token_ids, computed incrementally
    block_hashes: list[bytes] = field(default_factory=list)
    # how many leading blocks of block_table are registered in the prefix cache
    num_cached_blocks: int = 0
    generator: torch.Generator | None = None
    detokenizer: Any = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # with params.prompt_logprobs: one entry per prompt position scored so far (the first is None)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # with prompt_logprobs and prefix caching, while running: the scores it computes, until the blocks
    # they belong to are registered in the prefix cache (which keeps them with the blocks)
    score_buffer: ScoreBuffer | None = None
    # with params.structured_outputs: the llguidance matcher, advanced by every appended token
    matcher: Any = None
    # a constrained request in its budget's last tokens: its closing path (llmopt.runtime.closing)
    closing: Any = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    num_preemptions: int = 0
    # speculative decoding: proposals verified, tokens proposed, tokens accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_scores(self) -> bool:
        """Some prompt position still lacks its logprob (such a prefill skips the prefix cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def tokens_left(self, max_model_len: int | None) -> int:
        """Output tokens this request may still get: what max_tokens and the model's length leave."""
        left = self.params.max_tokens - self.num_output_tokens
        if max_model_len is not None:
            left = min(left, max_model_len - self.num_tokens)
        return left

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
