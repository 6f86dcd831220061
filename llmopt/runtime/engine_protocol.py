"""`ServingEngine`: the surface the HTTP server (and `llmopt generate --engine llama.cpp`) drives.

`AsyncLLM` (the paged runtime) and `LlamaCppEngine` (llama-cpp-python) both have it; the
server depends on this protocol, not on either class. Both hand a request's outputs to its
consumer through an asyncio queue, read by `queued_outputs`. A leaf module: the engine types
are imported for annotations only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from llmopt.runtime.engine import EngineStats, PromptType
    from llmopt.runtime.outputs import RequestOutput
    from llmopt.runtime.sampling_params import SamplingParams
    from llmopt.runtime.structured_outputs import StructuredOutputsParams


@runtime_checkable
class ServingEngine(Protocol):
    # read-only here: an attribute (LlamaCppEngine) or a property (AsyncLLM) satisfies them
    @property
    def tokenizer(self) -> Any:
        """The model's llmopt.core.tokenizer.Tokenizer (encode, decode, apply_chat_template, vocab_size)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt; LlmoptError if it is empty or out of the vocabulary."""
        ...

    def compile_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Validate and compile an output constraint ahead of `add_request`, from any thread (the
        server's worker threads), so that adding the request is quick; LlmoptError if it is
        invalid or the engine has no structured outputs."""
        ...

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request from inside the event loop that will consume it; LlmoptError
        (before any output) if it can never run. Returns its id for `stream_outputs`."""
        ...

    def stream_outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of an added request as tokens arrive, the last with `finished`; closing early aborts it."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine's thread; the server calls this after its graceful shutdown."""
        ...


async def queued_outputs(queue: asyncio.Queue, abort: Callable[[], None],
                         finish: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """`stream_outputs` for an engine that puts a request's outputs into `queue` (an exception put
    there is raised): items until the finished output, then `finish()`; closing early calls `abort()`."""
    finished = False
    try:
        while not finished:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if finished:
            finish()
        else:
            abort()
