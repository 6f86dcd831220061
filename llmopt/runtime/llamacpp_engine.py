"""`--engine llama.cpp`: GGUF files run through llama-cpp-python behind AsyncLLM's surface
(`ServingEngine`), for `llmopt serve` and `llmopt generate` alike.

llama-cpp-python drives one llama.cpp context, so requests are served one at a time in
arrival order by a worker thread while the rest wait (llama.cpp reuses the longest common
token prefix of consecutive requests). Tokenization, validation, stop handling and outputs
are ours, so the HTTP layer behaves the same for both engines; logprobs are not offered.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from llmopt.core.gguf_file import read_gguf_config, read_gguf_tokenizer
from llmopt.core.source import resolve_gguf
from llmopt.errors import LlmoptError
from llmopt.runtime.engine import EngineFrontend, EngineStats, PromptType, check_stop, make_output
from llmopt.runtime.engine_protocol import queued_outputs
from llmopt.runtime.outputs import RequestOutput
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.sequence import Sequence
from llmopt.runtime.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("llmopt.runtime")
_NO_STRUCTURED_OUTPUTS = "structured outputs (response_format) are not supported by the llama.cpp engine"


class LlamaCppEngine(EngineFrontend):
    @classmethod
    def from_spec(cls, model: str = "default", max_model_len: int | None = None,
                  n_threads: int | None = None) -> "LlamaCppEngine":
        """`model`: 'default' (the embedded GGUF) or a .gguf file (`resolve_gguf`); LlmoptError for anything else."""
        source = resolve_gguf(model)
        if source is None:
            raise LlmoptError(f"--engine llama.cpp runs .gguf files; {model!r} is not one "
                              "(llmopt quantize --method gguf writes them)")
        return cls(source.path, max_model_len=max_model_len, n_threads=n_threads)

    def __init__(self, gguf_path: Path, max_model_len: int | None = None, n_threads: int | None = None):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise LlmoptError("--engine llama.cpp needs llama-cpp-python: `pip install llama-cpp-python`") from None
        self.gguf_path = Path(gguf_path)
        config, _ = read_gguf_config(gguf_path)
        self.tokenizer = read_gguf_tokenizer(gguf_path)
        self.tokenizer.extra_eos_token_ids = [config["eos_token_id"]] if "eos_token_id" in config else []
        self.vocab_size = int(config["vocab_size"])
        context = int(config["max_position_embeddings"])
        if max_model_len is not None and max_model_len > context:
            raise LlmoptError(f"max_model_len {max_model_len} exceeds the model's context of {context}")
        self.max_model_len = max_model_len or context
        self.llm = Llama(model_path=str(gguf_path), n_ctx=self.max_model_len, n_threads=n_threads, verbose=False)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._waiting: deque[Sequence] = deque()
        self._current: Sequence | None = None
        self._aborted: set[str] = set()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._prompt_tokens = self._generation_tokens = 0
        self._thread = threading.Thread(target=self._worker, name="llama.cpp", daemon=True)
        self._thread.start()

    # ---- AsyncLLM's surface ------------------------------------------------------------
    def compile_structured_outputs(self, params: StructuredOutputsParams) -> None:
        raise LlmoptError(_NO_STRUCTURED_OUTPUTS)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        if params is not None and (params.logprobs is not None or params.prompt_logprobs is not None):
            raise LlmoptError("logprobs are not supported by the llama.cpp engine")
        if params is not None and params.structured_outputs is not None:
            raise LlmoptError(_NO_STRUCTURED_OUTPUTS)
        with self._cv:
            seq = self.new_sequence(prompt, params, request_id)
            self.requests[seq.request_id] = seq
            self._sinks[seq.request_id] = (asyncio.get_running_loop(), asyncio.Queue())
            self._waiting.append(seq)
            self._cv.notify()
        return seq.request_id

    def stream_outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        # the worker forgets a finished request's sink itself (`_emit`)
        return queued_outputs(self._sinks[request_id][1], abort=lambda: self.abort(request_id),
                              finish=lambda: None)

    def abort(self, request_id: str) -> None:
        with self._cv:
            seq = self.requests.pop(request_id, None)
            self._sinks.pop(request_id, None)
            if seq is None:
                return
            if seq in self._waiting:
                self._waiting.remove(seq)
            else:
                self._aborted.add(request_id)  # the worker stops it before its next token

    def stats(self) -> EngineStats:
        with self._cv:
            current = self._current
            used = current.num_tokens / self.max_model_len if current is not None else 0.0
            return EngineStats(
                num_requests_running=int(current is not None), num_requests_waiting=len(self._waiting),
                kv_cache_usage_perc=used, num_kv_blocks=0, prefix_cache_queries=0, prefix_cache_hits=0,
                num_preemptions=0, prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens,
                peak_kv_blocks_used=0,
            )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker once it is between requests (the server calls this after its graceful shutdown)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    # ---- the worker --------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                seq = self._current = self._waiting.popleft()
            try:
                self._run(seq)
            except Exception:  # llama.cpp failed on this request: end it, keep serving the others
                logger.exception("llama.cpp failed on request %s", seq.request_id)
                seq.finish_reason, seq.finished_time = "abort", time.time()
                self._emit(seq, make_output(seq, []))
            finally:
                with self._cv:
                    self._current = None
                    self._aborted.discard(seq.request_id)
                    self.requests.pop(seq.request_id, None)

    def _emit(self, seq: Sequence, out: RequestOutput) -> None:
        with self._cv:
            sink = self._sinks.get(seq.request_id)
            if out.finished:
                self._sinks.pop(seq.request_id, None)
        if sink is not None:
            loop, queue = sink
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def _run(self, seq: Sequence) -> None:
        p = seq.params
        seq.first_scheduled_time = time.time()
        # llama.cpp's sampler seed is 32-bit; SamplingParams allows torch's 64-bit range
        self.llm.set_seed(p.seed % 2**32 if p.seed is not None else random.randrange(2**31))
        blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else self.tokenizer.eos_token_ids)

        def suppress_early_stops(_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
            if seq.num_output_tokens < p.min_tokens and blocked:
                scores[blocked] = -np.inf
            return scores

        tokens = self.llm.generate(
            seq.prompt_token_ids, temp=p.temperature, top_p=p.top_p, top_k=max(p.top_k, 0), min_p=p.min_p,
            repeat_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, reset=True,
            logits_processor=[suppress_early_stops] if p.min_tokens else None,
        )
        for token in tokens:
            with self._cv:
                if seq.request_id in self._aborted:
                    return
            now = time.time()
            seq.token_ids.append(int(token))
            self._generation_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
                self._prompt_tokens += seq.num_prompt_tokens
            check_stop(seq, int(token), self.tokenizer.eos_token_ids, self.max_model_len)
            if seq.finish_reason is not None:
                seq.finished_time = now
            self._emit(seq, make_output(seq, [int(token)]))
            if seq.finish_reason is not None:
                return
