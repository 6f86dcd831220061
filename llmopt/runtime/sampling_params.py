"""Sampling parameters, named after vLLM's so users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.errors import LlmoptError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much probability
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise LlmoptError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise LlmoptError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise LlmoptError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise LlmoptError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise LlmoptError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
