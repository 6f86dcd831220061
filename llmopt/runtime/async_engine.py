"""AsyncLLM: the engine behind an asyncio API, for the server.

`generate()` is an async iterator of incremental `RequestOutput`s. A background task
steps the engine (in a worker thread, so the event loop stays responsive) while any
request is unfinished, and stops when none is. Cancelling or closing the iterator — a
client that went away — aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from typing import Any

from llmopt.core.loader import LoadedModel
from llmopt.runtime.config import EngineConfig
from llmopt.runtime.engine import EngineStats, LLMEngine, PromptType
from llmopt.runtime.outputs import RequestOutput
from llmopt.runtime.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # the engine is not thread-safe: steps (worker thread) and add/abort (event loop) take turns
        self._lock = threading.Lock()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()

    @classmethod
    def from_spec(cls, model: str | LoadedModel = "default", dtype: str = "auto", device: str = "cpu",
                  **engine_config: Any) -> "AsyncLLM":
        if isinstance(model, LoadedModel):
            return cls(LLMEngine(model, EngineConfig(**engine_config)))
        return cls(LLMEngine.from_spec(model, dtype=dtype, device=device, **engine_config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.engine.tokenize_prompt(prompt)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request (raises LlmoptError now, before any output); call
        `stream_outputs(request_id)` next. Must run inside the event loop."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        with self._lock:
            self.engine.add_request(prompt, params, request_id=request_id)
            self._queues[request_id] = asyncio.Queue()
        self._ensure_loop()
        return request_id

    async def stream_outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of an added request as tokens arrive; closing early aborts it."""
        queue = self._queues[request_id]
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive; the last one has `finished=True`.

        Invalid requests raise LlmoptError before anything is yielded.
        """
        request_id = self.add_request(prompt, params, request_id)
        async for out in self.stream_outputs(request_id):
            yield out

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)
        self._queues.pop(request_id, None)

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _step(self) -> tuple[list[RequestOutput], bool]:
        with self._lock:
            outputs = self.engine.step()
            return outputs, self.engine.has_unfinished_requests()

    async def _run(self) -> None:
        while True:
            try:
                outputs, more = await asyncio.to_thread(self._step)
            except Exception as exc:  # a bug in a step: fail every waiting request, don't hang them
                self._loop_task = None
                for queue in list(self._queues.values()):
                    queue.put_nowait(exc)
                raise
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            # checked on the event loop thread, where requests are added: none can slip in between
            if not more and not self.engine.has_unfinished_requests():
                self._loop_task = None
                return
