"""Speculative decoding: its configuration (vLLM's `speculative_config` keys), its counters, and the
start-up check that a draft model's tokens mean what the target's mean.

A proposer guesses the next K tokens of a decoding request (`proposers.py`); the target model
scores the last known token plus the K guesses in one forward, and `rejection_sampler.py` keeps
the longest prefix that the target's own distribution accepts, plus one token of the target's.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llmopt.errors import LlmoptError

logger = logging.getLogger("llmopt.speculative")

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """`LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 5})` or
    `{"model": SPEC, "num_speculative_tokens": 4}` (a draft model; method inferred)."""

    method: str | None = None  # "ngram" | "draft_model"; None: "draft_model" when `model` is set
    model: str | None = None  # the draft model's spec (loaded through llmopt.loader.load)
    num_speculative_tokens: int = 4
    # n-gram (prompt lookup): the longest suffix of n in [min, max] tokens that occurred before
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # no proposals while more requests than this are running (speculation spends compute a big batch needs)
    disable_by_batch_size: int | None = None
    # start a draft whose token ids mean other tokens than the target's (refused otherwise)
    allow_mismatch: bool = False
    # warn when the rolling mean of accepted draft tokens per proposal falls below this
    acceptance_warning_threshold: float = 0.5
    acceptance_window: int = 128  # proposals in that rolling mean

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model else None
        if self.method not in METHODS:
            raise LlmoptError(f"speculative method must be one of {', '.join(METHODS)} (or give a draft "
                              f"model), got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise LlmoptError("speculative method draft_model needs a draft model (--speculative-model)")
        if self.method == "ngram" and self.model:
            raise LlmoptError("speculative method ngram takes no draft model")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise LlmoptError(f"num_speculative_tokens must be between 1 and 16, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise LlmoptError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise LlmoptError(f"speculative disable_by_batch_size must be positive, got {self.disable_by_batch_size}")
        if self.acceptance_window < 1:
            raise LlmoptError("acceptance_window must be positive")

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise LlmoptError("speculative_config must be a dict or a SpeculativeConfig")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise LlmoptError(f"unknown speculative_config key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**value)


@dataclass
class SpecDecodingStats:
    """Counters under vLLM's names (`spec_decode_num_drafts`, ...), over the engine's life."""

    num_speculative_tokens: int
    acceptance_threshold: float = 0.5
    window_size: int = 128
    num_drafts: int = 0  # proposals verified
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_steps_disabled: int = 0  # steps in which the batch was too big to speculate
    disabled: bool = False  # the last step did not speculate because of the batch size
    warned: bool = False

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens
        self.window: deque[int] = deque(maxlen=self.window_size)  # accepted tokens of the latest proposals

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        self.window.append(num_accepted)
        if len(self.window) == self.window.maxlen:
            mean = self.rolling_accepted_per_draft
            if mean < self.acceptance_threshold and not self.warned:
                logger.warning(
                    "speculative decoding: the last %d proposals had %.2f accepted tokens each on average "
                    "(below %.2f): the proposer is slowing decoding down; try another draft or fewer "
                    "speculative tokens", len(self.window), mean, self.acceptance_threshold)
                self.warned = True
            elif mean >= self.acceptance_threshold:
                self.warned = False

    @property
    def rolling_accepted_per_draft(self) -> float:
        return sum(self.window) / len(self.window) if self.window else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified proposal, the target's own token included (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "rolling_accepted_per_draft": round(self.rolling_accepted_per_draft, 4),
            "num_steps_disabled": self.num_steps_disabled,
            "disabled_by_batch_size": self.disabled,
        }


def check_draft_compatible(target_tokenizer: Any, draft_tokenizer: Any, allow_mismatch: bool) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's; warn on other chat templates.

    A draft's proposals are token ids: if id 1234 is a different string to the draft, every
    proposal is nonsense to the target and is rejected (vLLM starts such a pair without a word).
    """
    target_vocab = target_tokenizer.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft_tokenizer.backend.get_vocab(with_added_tokens=True)
    target_by_id = {i: t for t, i in target_vocab.items()}
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    problem = None
    for token_id in sorted(set(target_by_id) | set(draft_by_id)):
        a, b = target_by_id.get(token_id), draft_by_id.get(token_id)
        if a != b:
            problem = (f"token id {token_id} is {a!r} to the target but {b!r} to the draft "
                       f"(vocabularies of {len(target_vocab)} and {len(draft_vocab)} tokens)")
            break
    if problem is None and target_tokenizer.eos_token_ids != draft_tokenizer.eos_token_ids:
        problem = (f"end-of-text ids differ: target {target_tokenizer.eos_token_ids}, "
                   f"draft {draft_tokenizer.eos_token_ids}")
    if problem is not None:
        if not allow_mismatch:
            raise LlmoptError(f"the draft model's tokenizer does not match the target's: {problem}; its "
                              "proposals would be other tokens to the target and be rejected "
                              "(--speculative-allow-mismatch starts it anyway)")
        logger.warning("speculative decoding with a mismatched draft: %s", problem)
    if (target_tokenizer.chat_template or None) != (draft_tokenizer.chat_template or None):
        logger.warning("the draft model's chat template differs from the target's: chat prompts are formatted "
                       "for the target, which the draft may predict poorly")
