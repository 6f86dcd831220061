"""AsyncLLM: the engine behind an asyncio API, for the server.

`generate()` is an async iterator of incremental `RequestOutput`s. One dedicated engine
thread steps the engine back to back while any request is unfinished and sleeps on a
condition when none is; each step's outputs reach the requests' asyncio queues in one
`call_soon_threadsafe` per event loop, so the event loop's work (HTTP, JSON, SSE writes)
runs during the next step (wherever that step has released the GIL) rather than between
steps. add_request, abort and stats take the engine lock between steps. Cancelling or closing the iterator — a client that went away — aborts the request
and frees its KV blocks. A step that raises fails every request in flight (each waiting
consumer gets the exception, their KV blocks are freed) and the thread goes on serving new
requests. `shutdown()` stops the thread. Creating an AsyncLLM frees the creating thread's
idle OpenMP workers, which would otherwise slow the engine thread's steps (see
`_release_openmp_threads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from llmopt.loader import LoadedModel
from llmopt.errors import LlmoptError
from llmopt.runtime.config import EngineConfig
from llmopt.runtime.engine import EngineStats, LLMEngine, PromptType
from llmopt.runtime.engine_protocol import queued_outputs
from llmopt.runtime.outputs import RequestOutput
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("llmopt.runtime")

_Item = RequestOutput | BaseException
_Sink = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[_Item]"]


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # the engine is not thread-safe: steps (engine thread) and add/abort/stats (event loop) take turns
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the idle engine thread sleeps here until add_request
        # threading.Lock is not fair: the engine thread would re-take it right after a step and keep
        # add/abort/stats waiting for many steps, so it waits between steps while they are queued
        self._guests = 0
        self._guests_cv = threading.Condition()
        # added and aborted under the lock; the engine thread reads it with single dict operations
        self._sinks: dict[str, _Sink] = {}
        self._closed = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="llmopt-engine", daemon=True)
        self._thread.start()
        _release_openmp_threads()

    @classmethod
    def from_spec(cls, model: str | LoadedModel = "default", dtype: str = "auto", device: str = "auto",
                  engine_config: EngineConfig | None = None, **overrides: Any) -> "AsyncLLM":
        """`engine_config` (default: EngineConfig()) with `overrides` of its fields, e.g. num_kv_blocks=64."""
        config = replace(engine_config or EngineConfig(), **overrides)
        if isinstance(model, LoadedModel):
            return cls(LLMEngine(model, config))
        return cls(LLMEngine.from_spec(model, dtype=dtype, device=device, engine_config=config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.engine.tokenize_prompt(prompt)

    def compile_structured_outputs(self, params: StructuredOutputsParams) -> None:
        # no engine lock: the manager reads only the tokenizer, and the engine keeps stepping meanwhile
        self.engine.structured_outputs.compile(params)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request (raises LlmoptError now, before any output); call
        `stream_outputs(request_id)` next. Must run inside the event loop that will consume it."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        with self._engine_turn():
            if self._closed:
                raise LlmoptError("the engine is shut down")
            self.engine.add_request(prompt, params, request_id=request_id)
            self._sinks[request_id] = (loop, asyncio.Queue())
            self._work.notify()
        return request_id

    def stream_outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of an added request as tokens arrive; closing early aborts it."""
        # forgetting a finished request's sink takes no lock (one dict operation): no wait for a step
        return queued_outputs(self._sinks[request_id][1], abort=lambda: self.abort(request_id),
                              finish=lambda: self._sinks.pop(request_id, None))

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive; the last one has `finished=True`.

        Invalid requests raise LlmoptError before anything is yielded.
        """
        request_id = self.add_request(prompt, params, request_id)
        async for out in self.stream_outputs(request_id):
            yield out

    def abort(self, request_id: str) -> None:
        with self._engine_turn():
            self.engine.abort_request(request_id)
            self._sinks.pop(request_id, None)

    def stats(self) -> EngineStats:
        with self._engine_turn():
            return self.engine.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (after its current step); requests still in flight get an
        LlmoptError. Idempotent; add_request refuses afterwards."""
        with self._engine_turn():
            self._closed = True
            self._work.notify()
        self._thread.join(timeout)
        with self._engine_turn():
            stranded = list(self._sinks.items())
            self._sinks.clear()
            for request_id, _ in stranded:
                self.engine.abort_request(request_id)
        _post([(sink, LlmoptError("the engine was shut down")) for _, sink in stranded])

    # ---- the engine thread -------------------------------------------------------------
    @contextlib.contextmanager
    def _engine_turn(self) -> Iterator[None]:
        """Hold the engine lock, ahead of the engine thread's next step."""
        with self._guests_cv:
            self._guests += 1
        try:
            with self._lock:
                yield
        finally:
            with self._guests_cv:
                self._guests -= 1
                if not self._guests:
                    self._guests_cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._guests_cv:
                self._guests_cv.wait_for(lambda: not self._guests)
            with self._lock:
                while not self._closed and not self.engine.has_unfinished_requests():
                    self._work.wait()
                if self._closed:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    deliveries = self._fail_all(exc)
                else:
                    sinks = [(self._sinks.get(out.request_id), out) for out in outputs]
                    deliveries = [(sink, out) for sink, out in sinks if sink is not None]
            _post(deliveries)

    def _fail_all(self, exc: Exception) -> list[tuple[_Sink, _Item]]:
        """A bug in a step: abort every unfinished request and hand `exc` to those waiting, rather
        than hang them or step the same broken batch again. Called with the lock held."""
        logger.exception("engine step failed; failing %d request(s)", len(self.engine.requests))
        deliveries: list[tuple[_Sink, _Item]] = [(sink, exc) for sink in list(self._sinks.values())]
        self._sinks.clear()
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s", request_id)
        return deliveries


def _release_openmp_threads() -> None:
    """Free the calling thread's idle OpenMP worker threads (OpenMP starts them again if this
    thread runs a parallel region later).

    The thread that loaded the model (in the server, the event loop's) keeps an OpenMP team
    after its last parallel op; with the engine thread's team that is more OpenMP threads than
    CPUs, and libgomp then cuts the spinning at its barriers short, which slows every decode
    step well below the same step offline. Nothing to do where no OpenMP runtime is loaded or
    it lacks OpenMP 5's pause API."""
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:
        return
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so"):
        try:
            runtime = ctypes.CDLL(name, mode=noload | os.RTLD_LAZY)  # only if already loaded (by torch)
        except OSError:
            continue
        pause = getattr(runtime, "omp_pause_resource_all", None)
        if pause is not None:
            pause(1)  # omp_pause_soft
        return


def _post(deliveries: list[tuple[_Sink, _Item]]) -> None:
    """Put items into their queues from another thread: one wake-up per event loop, not per item."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = {}
    for (loop, queue), item in deliveries:
        by_loop.setdefault(loop, []).append((queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that loop is closed: nobody is left to read these
            pass


def _put_all(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
