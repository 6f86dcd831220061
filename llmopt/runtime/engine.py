"""LLMEngine: requests in, one scheduled step at a time, outputs out.

`add_request` validates and queues a request; `step` schedules, runs the model, samples,
detokenizes, checks stop conditions and frees finished requests' blocks. `LLM` (offline
batches) and `AsyncLLM` (the server) both drive this class.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Iterator
from typing import Any, Union

import torch

from llmopt.core.loader import LoadedModel
from llmopt.errors import LlmoptError
from llmopt.runtime.config import EngineConfig, available_memory_bytes, resolve_kv_cache_dtype
from llmopt.runtime.detokenizer import IncrementalDetokenizer
from llmopt.runtime.kv_cache_manager import KVCacheManager
from llmopt.runtime.model_runner import ModelRunner, kv_bytes_per_block
from llmopt.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmopt.runtime.sampler import SampleRequest, make_generator, sample_batch
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.scheduler import Scheduler
from llmopt.runtime.sequence import Sequence
from llmopt.runtime.structured_outputs import StructuredOutputManager

logger = logging.getLogger("llmopt.engine")

# a prompt: text, token ids, chat messages, or vLLM-style {"prompt_token_ids": [...]} / {"prompt": "..."}
PromptType = Union[str, list[int], list[dict[str, Any]], dict[str, Any]]


@dataclass
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # fraction of KV blocks in use, 0..1
    num_kv_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # ... and found there
    num_preemptions: int
    prompt_tokens: int  # prompt tokens of requests that produced their first token
    generation_tokens: int
    peak_kv_blocks_used: int


class EngineFrontend:
    """Turning prompts into validated `Sequence`s: shared by every engine behind our APIs."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    requests: dict[str, Sequence]
    _ids: Iterator[int]

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise LlmoptError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.tokenize_prompt(list(prompt["prompt_token_ids"]))[1]
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            if "messages" in prompt:
                return self.tokenize_prompt(list(prompt["messages"]))
            raise LlmoptError("a prompt dict needs 'prompt', 'prompt_token_ids' or 'messages'")
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise LlmoptError("the prompt is empty")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise LlmoptError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
            return None, list(prompt)
        raise LlmoptError(f"unsupported prompt type {type(prompt).__name__}: pass text, token ids or chat messages")

    def new_sequence(self, prompt: PromptType, params: SamplingParams | None, request_id: str | None,
                     arrival_time: float | None = None) -> Sequence:
        """A validated request (not yet queued); raises LlmoptError if it can never run."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise LlmoptError("params must be a SamplingParams")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise LlmoptError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        n = len(ids)
        if n >= self.max_model_len:
            raise LlmoptError(f"the prompt has {n} tokens; max_model_len is {self.max_model_len}")
        if n + params.max_tokens > self.max_model_len:
            raise LlmoptError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds max_model_len {self.max_model_len}; lower max_tokens to at most {self.max_model_len - n}"
            )
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params,
                       arrival_time=arrival_time if arrival_time is not None else time.time(), prompt=text)
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, ids, stop=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        return seq


class LLMEngine(EngineFrontend):
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = config = config or EngineConfig()
        model_len = loaded.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise LlmoptError(f"max_model_len {config.max_model_len} exceeds the model's context of {model_len}")
        self.max_model_len = config.max_model_len or model_len
        # a 16-bit pool for an fp32 model holds twice the blocks in the same budget
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, loaded.dtype)
        block_bytes = kv_bytes_per_block(loaded.model, config.block_size, self.kv_cache_dtype)
        num_blocks = config.num_kv_blocks or self._num_blocks_for_memory(block_bytes)
        if num_blocks < 1:
            raise LlmoptError("the KV cache budget is smaller than one block; raise --kv-cache-memory")
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(loaded.model, num_blocks, config.block_size, loaded.dtype, loaded.device,
                                  kv_dtype=self.kv_cache_dtype)
        self.kv_cache_bytes = num_blocks * block_bytes
        self.vocab_size = loaded.config.vocab_size
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.vocab_size)
        # unfinished requests using prompt_logprobs / structured_outputs: while both are 0 a step
        # does no work for either feature
        self.num_scoring = 0
        self.num_constrained = 0
        tokens = num_blocks * config.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s); maximum concurrency at %d tokens per "
            "request: %.2fx",
            num_blocks, config.block_size, tokens, self.kv_cache_bytes / 2**30,
            str(self.kv_cache_dtype).removeprefix("torch."), self.max_model_len,
            tokens / self.max_model_len,
        )

    @classmethod
    def from_spec(cls, model: str = "default", dtype: str = "auto", device: str = "cpu",
                  engine_config: EngineConfig | None = None, **overrides: Any) -> "LLMEngine":
        """`engine_config` (default: EngineConfig()) with `overrides` of its fields, e.g. num_kv_blocks=64."""
        from llmopt.core import load

        return cls(load(model, dtype=dtype, device=device), replace(engine_config or EngineConfig(), **overrides))

    def _num_blocks_for_memory(self, block_bytes: int) -> int:
        cfg, device = self.config, self.loaded.device
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif device.type == "cuda":
            budget = self._profile_gpu_budget()
        else:
            budget = available_memory_bytes() // 10
        return budget // block_bytes

    def _profile_gpu_budget(self) -> int:
        """GPU: after weights and one forward of a full token budget, what the utilisation target leaves."""
        from llmopt.model.attention import ContiguousKVCache

        device, cfg = self.loaded.device, self.loaded.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        cache = ContiguousKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, n,
                                  dtype=self.loaded.dtype, device=device)
        cache.begin_step([0], [n])
        ids = torch.zeros(n, dtype=torch.long, device=device)
        hidden = self.loaded.model(ids, torch.arange(n, device=device), cache)
        self.loaded.model.compute_logits(hidden[-self.config.max_num_seqs:])
        peak = torch.cuda.max_memory_allocated(device)
        del cache, hidden
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - torch.cuda.memory_reserved(device)
        return int(total * self.config.gpu_memory_utilization) - peak - max(used_by_others, 0)

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate and queue a request; raises LlmoptError (for this request only) if it can never run."""
        seq = self.new_sequence(prompt, params, request_id, arrival_time)
        needed = self.kv.blocks_needed(seq.num_prompt_tokens + seq.params.max_tokens)
        if needed > self.kv.num_blocks:
            raise LlmoptError(f"the request needs {needed} KV blocks but the pool has {self.kv.num_blocks}; "
                              "raise --kv-cache-memory or lower max_tokens")
        if seq.params.structured_outputs is not None:
            seq.matcher = self.structured_outputs.matcher(seq.params.structured_outputs)
            self.num_constrained += 1
        self.num_scoring += seq.prompt_logprobs is not None
        seq.generator = make_generator(seq.params)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        seq.finished_time = time.time()
        self._retire(seq)
        return make_output(seq, [])

    def _retire(self, seq: Sequence) -> None:
        """A finished or aborted request (already out of self.requests) leaves the scheduler."""
        self.scheduler.finish(seq)
        self.num_scoring -= seq.prompt_logprobs is not None
        self.num_constrained -= seq.matcher is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; outputs for every request that got a token or finished."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        now = time.time()
        for seq, _ in sched.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        step = self.runner.execute(sched.scheduled, score_prompts=self.num_scoring > 0)
        samplers = step.samplers
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)
        outputs: list[RequestOutput] = []
        if self.num_scoring:
            for seq, scores in step.prompt_logprobs:
                seq.prompt_logprobs.extend(scores)
            outputs += [self._finish_scored(seq) for seq in step.prompts_done]
        if not samplers:
            return outputs
        requests = [self._sample_request(s) for s in samplers]
        if self.num_constrained:
            for seq, request in zip(samplers, requests):
                if seq.matcher is not None:
                    request.allowed_ids = self.structured_outputs.allowed_tokens(seq.matcher)
        results = sample_batch(step.logits, requests)
        now = time.time()
        for seq, result in zip(samplers, results):
            new_ids = [result.token_id]
            seq.token_ids.append(result.token_id)
            self.generation_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.prompt_tokens += seq.num_prompt_tokens
            if result.logprobs is not None:
                seq.logprobs.append(result.logprobs)
            check_stop(seq, result.token_id, self.tokenizer.eos_token_ids, self.max_model_len)
            if seq.matcher is not None:
                # the one place a constrained request's state moves on: its matcher takes the token;
                # a finished grammar (only EOS left) ends the request even under ignore_eos
                seq.matcher.consume_token(result.token_id)
                if seq.finish_reason is None and seq.matcher.is_stopped():
                    seq.finish_reason = "stop"
            if seq.finish_reason is not None:
                seq.finished_time = now
                del self.requests[seq.request_id]
                self._retire(seq)
            outputs.append(make_output(seq, new_ids))
        return outputs

    def _finish_scored(self, seq: Sequence) -> RequestOutput:
        """A max_tokens=0 request whose prompt is now scored: done, with no output tokens."""
        seq.finish_reason = "length"
        seq.first_token_time = seq.finished_time = time.time()
        self.prompt_tokens += seq.num_prompt_tokens
        del self.requests[seq.request_id]
        self._retire(seq)
        return make_output(seq, [])

    def _sample_request(self, seq: Sequence) -> SampleRequest:
        p = seq.params
        blocked: list[int] = []
        if seq.num_output_tokens < p.min_tokens:
            blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else self.tokenizer.eos_token_ids)
        return SampleRequest(p, seq.generator, seq.prompt_token_ids, seq.output_token_ids, blocked)

    # ---- statistics -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage_perc=self.kv.usage,
            num_kv_blocks=self.kv.num_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            peak_kv_blocks_used=self.kv.peak_used_blocks,
        )


def check_stop(seq: Sequence, token: int, eos_token_ids: list[int], max_model_len: int) -> None:
    """After `token` was appended: set seq.finish_reason if the request is done (vLLM's order)."""
    p = seq.params
    stop_string_hit = seq.detokenizer.add_token(token)
    if not p.ignore_eos and token in eos_token_ids:
        seq.finish_reason = "stop"
    elif token in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
    elif stop_string_hit:
        seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_reason
    elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"


def make_output(seq: Sequence, new_ids: list[int]) -> RequestOutput:
    finished = seq.finish_reason is not None
    completion = CompletionOutput(
        index=0,
        text=seq.detokenizer.output_text,
        token_ids=seq.output_token_ids,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        new_text=seq.detokenizer.new_text(finished=finished),
        new_token_ids=new_ids,
    )
    metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finished_time)
    return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], finished, metrics,
                         num_cached_tokens=seq.num_cached_tokens, prompt_logprobs=seq.prompt_logprobs)
