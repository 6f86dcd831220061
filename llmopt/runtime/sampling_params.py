"""Sampling parameters, named after vLLM's so users feel at home."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmopt.errors import LlmoptError
from llmopt.runtime.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # the most alternatives logprobs / prompt_logprobs may ask for (OpenAI's limit)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much probability
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI semantics: subtract once for every token already generated
    frequency_penalty: float = 0.0  # ... and once per occurrence
    repetition_penalty: float = 1.0  # HF/CTRL semantics over prompt and output tokens; 1 = off
    stop: list[str] | str | None = None  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many are generated
    logprobs: int | None = None  # None = off; N = the chosen token's logprob plus the top N
    # None = off; N = every prompt token's logprob given the tokens before it, plus the top N
    # (the first position has none); with max_tokens=0 the request only scores its prompt
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # constrain the output to a JSON schema, any JSON object, a regex, a choice or a grammar
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # vLLM accepts max_tokens=0 together with prompt_logprobs: the request only scores its prompt
        least = 0 if self.prompt_logprobs is not None else 1
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise LlmoptError(f"max_tokens must be a positive integer (0 only with prompt_logprobs), "
                              f"got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise LlmoptError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")  # torch's range
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            # NaN passes every comparison below; infinity and 1e308 turn the logits into garbage
            if not _finite(value):
                raise LlmoptError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise LlmoptError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise LlmoptError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise LlmoptError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise LlmoptError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise LlmoptError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise LlmoptError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise LlmoptError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise LlmoptError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise LlmoptError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise LlmoptError("structured_outputs must be a StructuredOutputsParams")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                raise LlmoptError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
            if any(s == "" for s in self.stop):
                raise LlmoptError("stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list) or not all(isinstance(t, int) for t in self.stop_token_ids):
            raise LlmoptError("stop_token_ids must be a list of integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _finite(value: object) -> bool:
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except TypeError:
        return False
