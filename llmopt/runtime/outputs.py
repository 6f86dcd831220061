"""What the engine returns, named after vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding: proposals verified for this request, tokens proposed, tokens accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def to_dict(self) -> dict[str, float | None]:
        return {
            "arrival_time": self.arrival_time,
            "first_scheduled_time": self.first_scheduled_time,
            "first_token_time": self.first_token_time,
            "finished_time": self.finished_time,
            "time_to_first_token_s": self.time_to_first_token,
            "queue_time_s": self.queue_time,
            "e2e_latency_s": self.e2e_latency,
            "spec_num_drafts": self.spec_num_drafts,
            "spec_num_draft_tokens": self.spec_num_draft_tokens,
            "spec_num_accepted_tokens": self.spec_num_accepted_tokens,
        }


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything generated so far (cut at a stop string)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id, if one ended it
    logprobs: list[dict[int, float]] | None = None
    # streaming deltas since the previous output of this request
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    # a constrained output the budget ended (finish_reason "length"): "closed" if llmopt closed it
    # along its closing path (it is valid), "unclosable" if no closing fitted (it is cut); else None
    output_closure: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs: per prompt position {token: logprob} (the prompt token, then the
    # top N), None for the first position (vLLM's layout)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # set when the request was rejected
