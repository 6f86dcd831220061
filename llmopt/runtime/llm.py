"""`LLM`: the offline batch API, as in vLLM: `LLM("default").generate(prompts, params)`."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Sequence as Seq

from llmopt.loader import LoadedModel
from llmopt.errors import LlmoptError
from llmopt.runtime.config import EngineConfig
from llmopt.runtime.engine import LLMEngine, PromptType
from llmopt.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmopt.runtime.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | LoadedModel = "default", dtype: str = "auto", device: str = "auto",
                 engine_config: EngineConfig | None = None, **overrides: Any):
        """`engine_config` (default: EngineConfig()) with `overrides` of its fields, e.g. max_num_seqs=32."""
        config = replace(engine_config or EngineConfig(), **overrides)
        if isinstance(model, LoadedModel):
            self.engine = LLMEngine(model, config)
        else:
            self.engine = LLMEngine.from_spec(model, dtype=dtype, device=device, engine_config=config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion, continuously batched; outputs in input order.

        A prompt that can never run (empty, too long, ...) gets an output with `error` set
        and finish_reason "error"; the other prompts are unaffected.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise LlmoptError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = f"offline-{id(self)}-{time.monotonic_ns()}-{i}"
            order.append(request_id)
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except LlmoptError as exc:
                results[request_id] = rejected_output(request_id, prompt, str(exc))
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[r] for r in order]

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([{"messages": c} for c in conversations], sampling_params)


def rejected_output(request_id: str, prompt: Any, message: str) -> RequestOutput:
    now = time.time()
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
        finished=True,
        metrics=RequestMetrics(arrival_time=now, finished_time=now),
        error=message,
    )
