"""LLMEngine: requests in, one scheduled step at a time, outputs out.

`add_request` validates and queues a request; `step` schedules, lets a proposer fill in draft
tokens (speculative decoding), runs the model, samples (or verifies drafts) and hands the results
to `Scheduler.update_from_output`, the one place that changes requests after a step. `LLM`
(offline batches) and `AsyncLLM` (the server) both drive this class.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Iterator
from typing import Any, Union

import torch

from llmopt.loader import LoadedModel
from llmopt.errors import LlmoptError
from llmopt.runtime.closing import CLOSING_WINDOW, output_closure
from llmopt.runtime import cuda_graphs
from llmopt.runtime.config import EngineConfig, available_memory_bytes, resolve_kv_cache_dtype
from llmopt.runtime.detokenizer import IncrementalDetokenizer
from llmopt.runtime.kv_cache_manager import KVCacheManager
from llmopt.runtime.model_runner import ModelRunner, kv_bytes_per_block
from llmopt.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmopt.runtime.proposers import DraftModelProposer, NgramProposer
from llmopt.runtime.sampler import SampleRequest, SampleResult, make_generator, sample_batch, verify_row
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.scheduler import Scheduler, check_stop
from llmopt.runtime.sequence import Sequence
from llmopt.runtime.speculative import SpecDecodingStats, check_draft_compatible
from llmopt.runtime.structured_outputs import StructuredOutputManager

__all__ = ["LLMEngine", "EngineFrontend", "EngineStats", "PromptType", "check_stop", "make_output"]

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
    # speculative decoding counters (SpecDecodingStats.to_dict()); None without speculation
    spec_decode: dict[str, Any] | None = None


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
            return self.tokenizer.chat_prompt(prompt, add_generation_prompt=True)
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
        # the one check of the context limit: offline callers and the server (which answers it as
        # an OpenAI 400 naming `param`) both get it here
        if n >= self.max_model_len:
            raise LlmoptError(f"the prompt has {n} tokens; the context (max_model_len) is {self.max_model_len}",
                              param="prompt", code="context_length_exceeded")
        if n + params.max_tokens > self.max_model_len:
            raise LlmoptError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds max_model_len {self.max_model_len}; lower max_tokens to at most {self.max_model_len - n}",
                param="max_tokens")
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
        loaded.model.use_fp32_matmul_precision(config.fp32_matmul_precision)
        # a 16-bit pool for an fp32 model holds twice the blocks in the same budget
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, loaded.dtype)
        block_bytes = kv_bytes_per_block(loaded.model, config.block_size, self.kv_cache_dtype)
        spec = config.speculative_config
        draft = self._load_draft(spec) if spec is not None and spec.method == "draft_model" else None
        if draft is not None:  # the draft's pool has the target's block ids: one block costs both
            draft_kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, draft.dtype)
            block_bytes += kv_bytes_per_block(draft.model, config.block_size, draft_kv_dtype)
        num_blocks = config.num_kv_blocks or self._num_blocks_for_memory(block_bytes)
        if num_blocks < 1:
            raise LlmoptError("the KV cache budget is smaller than one block; raise --kv-cache-memory")
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.spec_stats = None
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if spec is not None:
            self.spec_stats = SpecDecodingStats(spec.num_speculative_tokens, spec.acceptance_warning_threshold,
                                                spec.acceptance_window)
            self.proposer = (DraftModelProposer(draft, num_blocks, config.block_size, draft_kv_dtype) if draft
                             else NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.tokenizer.eos_token_ids,
            self.max_model_len, num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            speculative_disable_by_batch_size=spec.disable_by_batch_size if spec else None,
            spec_stats=self.spec_stats)
        graphs = cuda_graphs.graph_settings(config.enforce_eager, config.max_num_seqs,
                                            config.max_seq_len_to_capture, loaded.device)
        self.runner = ModelRunner(loaded.model, num_blocks, config.block_size, loaded.dtype, loaded.device,
                                  kv_dtype=self.kv_cache_dtype, graphs=graphs)
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
        gain = loaded.dtype.itemsize / self.kv_cache_dtype.itemsize
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s%s); maximum concurrency at %d tokens per "
            "request: %.2fx",
            num_blocks, config.block_size, tokens, self.kv_cache_bytes / 2**30,
            str(self.kv_cache_dtype).removeprefix("torch."),
            f": {gain:g}x the tokens of a {str(loaded.dtype).removeprefix('torch.')} cache" if gain > 1 else "",
            self.max_model_len, tokens / self.max_model_len,
        )

    def _load_draft(self, spec) -> LoadedModel:
        """The draft model, on the target's device and dtype, checked against the target."""
        from llmopt.loader import load

        draft = load(spec.model, dtype=str(self.loaded.dtype).removeprefix("torch."),
                     device=str(self.loaded.device))
        check_draft_compatible(self.tokenizer, draft.tokenizer, spec.allow_mismatch)
        draft.model.use_fp32_matmul_precision(self.config.fp32_matmul_precision)
        if draft.config.max_position_embeddings < self.max_model_len:
            raise LlmoptError(f"the draft model's context ({draft.config.max_position_embeddings} tokens) is "
                              f"shorter than max_model_len {self.max_model_len}; lower --max-model-len")
        if draft.config.vocab_size > self.loaded.config.vocab_size and not spec.allow_mismatch:
            raise LlmoptError(f"the draft's vocabulary ({draft.config.vocab_size}) is larger than the target's "
                              f"({self.loaded.config.vocab_size})")
        return draft

    @classmethod
    def from_spec(cls, model: str = "default", dtype: str = "auto", device: str = "auto",
                  engine_config: EngineConfig | None = None, load_format: str = "auto",
                  quantization: str | None = None, **overrides: Any) -> "LLMEngine":
        """`engine_config` (default: EngineConfig()) with `overrides` of its fields, e.g. num_kv_blocks=64."""
        from llmopt.loader import load

        loaded = load(model, dtype=dtype, device=device, load_format=load_format, quantization=quantization)
        return cls(loaded, replace(engine_config or EngineConfig(), **overrides))

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
                              "raise --kv-cache-memory or lower max_tokens", param="max_tokens")
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
        self.scheduler.finish(seq)
        self._forget(seq)
        return make_output(seq, [])

    def _forget(self, seq: Sequence) -> None:
        """A finished or aborted request (already out of self.requests and the scheduler)."""
        self.num_scoring -= seq.prompt_logprobs is not None
        self.num_constrained -= seq.matcher is not None
        if self.proposer is not None:
            self.proposer.discard(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; outputs for every request that got a token or finished."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        if sched.lookahead:
            sched.add_drafts(self.proposer.propose(sched.lookahead))
        step = self.runner.execute(sched.scheduled, score_prompts=self.num_scoring > 0,
                                   spec_token_ids=sched.spec_token_ids)
        sampled = self._sample(step, sched.spec_token_ids)
        outputs: list[RequestOutput] = []
        for update in self.scheduler.update_from_output(sched, step, sampled):
            seq = update.seq
            self.generation_tokens += len(update.new_token_ids)
            if update.first_token:
                self.prompt_tokens += seq.num_prompt_tokens
            if seq.finish_reason is not None:
                del self.requests[seq.request_id]
                self._forget(seq)
            outputs.append(make_output(seq, update.new_token_ids))
        return outputs

    def _sample(self, step, spec_token_ids: dict[str, list[int]]) -> dict[str, list[SampleResult]]:
        """Each sampling request's tokens: one sampled token, or a speculating request's verified run."""
        sampled: dict[str, list[SampleResult]] = {}
        plain: list[tuple[Sequence, int]] = []  # (sequence, its logits row)
        row = 0
        for seq, n in zip(step.samplers, step.num_rows):
            drafts = spec_token_ids.get(seq.request_id)
            if drafts:
                sampled[seq.request_id] = self._verify(seq, step.logits[row : row + n], drafts)
            else:
                plain.append((seq, row))
            row += n
        if plain:
            requests = [self._sample_request(seq) for seq, _ in plain]
            if self.num_constrained:
                for (seq, _), request in zip(plain, requests):
                    if seq.matcher is not None:
                        request.allowed_ids = self._allowed(seq)
            logits = step.logits if len(plain) == row else step.logits[[r for _, r in plain]]
            results = sample_batch(logits, requests)
            if self.num_constrained:
                self._keep_closable(plain, requests, results, logits)
            for seq, result in zip((s for s, _ in plain), results):
                sampled[seq.request_id] = [result]
        return sampled

    def _allowed(self, seq: Sequence) -> torch.Tensor:
        """A constrained row's mask: its grammar's, or the one token closing mode writes next."""
        forced = self.structured_outputs.closer().forced_token(seq) if seq.closing is not None else None
        if forced is None:
            return self.structured_outputs.allowed_tokens(seq.matcher)
        return self._only(forced)

    def _only(self, token_id: int) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[token_id] = True
        return mask

    def _keep_closable(self, plain: list[tuple[Sequence, int]], requests: list[SampleRequest],
                       results: list[SampleResult], logits: torch.Tensor) -> None:
        """In the last CLOSING_WINDOW tokens of a constrained row: a sampled token after which its
        output can no longer be closed within max_tokens is replaced by the closing path's
        (llmopt.runtime.closing), sampled from the same logits so its logprobs are the model's."""
        closer = None
        for i, (seq, _) in enumerate(plain):
            if seq.matcher is None:
                continue
            left = seq.tokens_left(self.max_model_len)
            if left > CLOSING_WINDOW:
                continue
            closer = closer or self.structured_outputs.closer()
            instead = closer.check(seq, results[i].token_id, left)
            if instead is not None:
                requests[i].allowed_ids = self._only(instead)
                results[i] = verify_row(logits[i], requests[i], None)

    def _verify(self, seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> list[SampleResult]:
        """Row i of `logits` follows the last known token and drafts[:i]: keep drafts while the target
        accepts them, then the target's own token (a correction, or a bonus token after all K).

        Each row is sampled as it would be without speculation, given the tokens before it:
        penalties and min_tokens count the accepted drafts, and a grammar's mask is computed after
        the matcher took them (then rolled back: update_from_output consumes the tokens for good).
        """
        results: list[SampleResult] = []
        consumed = 0
        try:
            for i in range(len(drafts) + 1):
                request = self._sample_request(seq, [r.token_id for r in results])
                if seq.matcher is not None:
                    request.allowed_ids = self.structured_outputs.allowed_tokens(seq.matcher)
                draft = drafts[i] if i < len(drafts) else None
                result = verify_row(logits[i], request, draft)
                results.append(result)
                if result.token_id != draft:
                    break
                if seq.matcher is not None:
                    seq.matcher.consume_token(draft)
                    consumed += 1
                    if seq.matcher.is_stopped():
                        break
        finally:
            if consumed:
                seq.matcher.rollback(consumed)
        return results

    def _sample_request(self, seq: Sequence, accepted: list[int] | None = None) -> SampleRequest:
        """What the sampler needs for `seq`'s next token, after `accepted` draft tokens (if any)."""
        p = seq.params
        output_ids = seq.output_token_ids + accepted if accepted else seq.output_token_ids
        blocked: list[int] = []
        if len(output_ids) < p.min_tokens:
            blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else self.tokenizer.eos_token_ids)
        return SampleRequest(p, seq.generator, seq.prompt_token_ids, output_ids, blocked)

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
            spec_decode=self.spec_stats.to_dict() if self.spec_stats is not None else None,
        )


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
        output_closure=output_closure(seq) if finished else None,
    )
    metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finished_time,
                             seq.spec_num_drafts, seq.spec_num_draft_tokens, seq.spec_num_accepted_tokens)
    return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], finished, metrics,
                         num_cached_tokens=seq.num_cached_tokens, prompt_logprobs=seq.prompt_logprobs)
