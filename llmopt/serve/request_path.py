"""The one path every generating request takes, chat and completions alike.

`Serving.check(body)` turns a request body into a `CheckedRequest` (prompts as token ids, one
`SamplingParams` per choice) or refuses it; `Serving.respond(request, renderer)` runs its choices
on the engine and answers one JSON document or server-sent events. What differs between the
endpoints (their prompt fields, their choice and chunk objects) is the body's class
(`llmopt.serve.protocol`) and the route's `Renderer`. The context limit is the engine's check
(`EngineFrontend.new_sequence`): its `LlmoptError` names the field at fault, turned here into
the OpenAI 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from llmopt.errors import LlmoptError
from llmopt.runtime.engine_protocol import ServingEngine
from llmopt.runtime.outputs import CompletionOutput, RequestOutput
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.serve.limits import FieldWarnings, Preparer, check_queue_room, check_request_size
from llmopt.serve.metrics import ServerMetrics
from llmopt.serve.protocol import RequestError, SamplingRequest

logger = logging.getLogger("llmopt.serve")

# the new tokens of a streamed choice since its last chunk and their logprobs, or None (no logprobs)
FreshTokens = tuple[list[int], list[dict[int, float]]] | None


@dataclass
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    max_queue: int = 256  # waiting sequences (prompts x n) beyond this get 503 + Retry-After
    max_prompts_per_request: int = 64
    max_body_bytes: int = 10 * 1024 * 1024
    read_timeout: float = 30.0  # seconds for a request's body to arrive (its headers: launch.py)
    prepare_timeout: float = 10.0  # seconds to tokenize a request and compile its output constraint
    log_requests: bool = False
    tool_call_parser: str | None = None  # a llmopt.serve.tools.FORMATS name; None: from the chat template
    enable_auto_tool_choice: bool = False  # vLLM's flag: tool_choice "auto" needs it


@dataclass
class Choice:
    """One choice of a response: one engine request."""

    index: int  # choice index in the response
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    request_id: str = ""


@dataclass
class CheckedRequest:
    """A request that passed every check before the engine's: what `respond` runs."""

    body: SamplingRequest
    choices: list[Choice]


@dataclass
class Renderer:
    """How one endpoint writes its answer to `body`: `choice` for a whole response, `delta` (and
    optionally `intro` and `opening`) for server-sent chunks."""

    serving: Serving
    body: SamplingRequest
    object_name: ClassVar[str]  # the response's "object"
    chunk_object_name: ClassVar[str]  # a streamed chunk's "object"
    id_prefix: ClassVar[str]

    def choice(self, choice: Choice, out: RequestOutput) -> dict[str, Any]:
        """The finished choice in the whole response."""
        raise NotImplementedError

    def delta(self, choice: Choice, c: CompletionOutput, fresh: FreshTokens, finish: str | None) -> dict[str, Any]:
        """A chunk's choice: the output's new text, `fresh` tokens and the finish reason (or None)."""
        raise NotImplementedError

    def intro(self, choice: Choice) -> dict[str, Any] | None:
        """A chunk's choice sent before any output, or None."""
        return None

    def opening(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        """A chunk's choice sent with the choice's first output (the prompt's scores are there), or None."""
        return None


@dataclass
class Serving:
    """What every route shares: the engine, the server's settings and metrics."""

    engine: ServingEngine
    config: ServeConfig
    metrics: ServerMetrics
    field_warnings: FieldWarnings = field(default_factory=FieldWarnings)
    preparer: Preparer = field(init=False)

    def __post_init__(self) -> None:
        self.preparer = Preparer(self.config.prepare_timeout)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- checking a request --------------------------------------------------------------
    async def prepare(self, body: SamplingRequest) -> CheckedRequest:
        """`check` on a worker thread, bounded by --prepare-timeout: rendering, tokenizing and
        compiling a constraint never hold up the event loop (other clients, /health)."""
        return await self.preparer.run(functools.partial(self.check, body), "preparing the request")

    def check(self, body: SamplingRequest) -> CheckedRequest:
        """Refuse known fields llmopt cannot honour, another model's name and more prompts than
        allowed (naming each ignored field in one warning per name), tokenize the prompts, compile
        the output constraint and build every choice's parameters. Any thread."""
        body.check_supported()
        name = self.config.served_model_name
        if body.model is not None and body.model != name:
            raise RequestError(f"the model {body.model!r} does not exist; this server serves {name!r}",
                               404, param="model", type_="not_found_error", code="model_not_found")
        self.field_warnings.note(body.ignored_fields())
        check_request_size(body.num_prompts, body.n, self.config.max_prompts_per_request, self.config.max_queue)
        try:
            prompts = body.tokenized_prompts(self.engine)
        except LlmoptError as exc:
            raise RequestError(str(exc), param=body.prompt_field) from None
        structured = body.structured()
        if structured is not None:  # compiled once here for all choices, so add_request only copies it
            try:
                self.engine.compile_structured_outputs(structured)
            except LlmoptError as exc:
                raise RequestError(str(exc), param=body.param(exc.param or "structured_outputs")) from None
        choices = []
        for p, (text, ids) in enumerate(prompts):
            # without max_tokens, what the context leaves (at least 1: a prompt that fills the
            # context is the engine's to refuse)
            max_tokens = body.max_tokens_wanted
            if max_tokens is None:
                max_tokens = max(self.max_model_len - len(ids), 1)
            for k in range(body.n):
                index = p * body.n + k
                choices.append(Choice(index, ids, text, body.sampling_params(max_tokens, index, structured)))
        return CheckedRequest(body, choices)

    # ---- running it ----------------------------------------------------------------------
    async def respond(self, request: CheckedRequest, renderer: Renderer) -> dict[str, Any] | StreamingResponse:
        """Run every choice: the whole response, or server-sent chunks if the body asked to stream."""
        self.start(request)
        created, rid = int(time.time()), f"{renderer.id_prefix}{secrets.token_hex(12)}"
        choices = request.choices
        if request.body.stream:
            stream = self.stream(choices, request.body.include_usage, created, rid, renderer)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finals = await self.collect(choices)
        return {"id": rid, "object": renderer.object_name, "created": created,
                "model": self.config.served_model_name,
                "choices": [renderer.choice(choice, finals[choice.index]) for choice in choices],
                "usage": usage(choices, finals)}

    def start(self, request: CheckedRequest) -> None:
        """Add every choice to the engine, or none of them (RequestError)."""
        engine, choices = self.engine, request.choices
        check_queue_room(len(choices), engine.stats().num_requests_waiting, self.config.max_queue)
        try:
            for choice in choices:
                choice.request_id = engine.add_request(
                    {"prompt_token_ids": choice.prompt_ids, "prompt": choice.prompt_text}, choice.params)
        except LlmoptError as exc:
            for started in choices:
                if started.request_id:
                    engine.abort(started.request_id)
            raise RequestError(str(exc), param=request.body.param(exc.param), code=exc.code) from None
        first = choices[0]
        if self.config.log_requests:
            logger.info("request %s: %d choice(s), prompt %r", first.request_id, len(choices), first.prompt_text)
        else:
            logger.info("request %s: %d choice(s), %d prompt tokens", first.request_id, len(choices),
                        len(first.prompt_ids))

    async def outputs(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Outputs of all choices interleaved as they arrive; leaving early aborts every choice."""
        queue: asyncio.Queue[tuple[Choice, RequestOutput | Exception]] = asyncio.Queue()
        metrics = self.metrics

        async def pump(choice: Choice) -> None:
            last, finished = None, False
            try:
                async with contextlib.aclosing(self.engine.stream_outputs(choice.request_id)) as stream:
                    async for out in stream:
                        now = time.time()
                        if last is not None and out.outputs[0].new_token_ids:
                            metrics.observe_token_gap(now - last)
                        last, finished = now, out.finished
                        if out.finished:
                            metrics.observe_finished(out)
                        queue.put_nowait((choice, out))
            except Exception as exc:  # the engine failed this request: end the response, don't leave it waiting
                queue.put_nowait((choice, exc))
            finally:
                if not finished:  # the client went away (or the engine failed): the request was aborted
                    metrics.observe_aborted()

        tasks = [asyncio.create_task(pump(choice)) for choice in choices]
        try:
            remaining = len(choices)
            while remaining:
                choice, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                remaining -= out.finished
                yield choice, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, choices: list[Choice]) -> dict[int, RequestOutput]:
        """The final output of every choice, by choice index."""
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self.outputs(choices)) as stream:
            async for choice, out in stream:
                if out.finished:
                    finals[choice.index] = out
        return finals

    async def stream(self, choices: list[Choice], include_usage: bool, created: int, rid: str,
                     renderer: Renderer) -> AsyncIterator[str]:
        """SSE chunks: the renderer's `intro` choices first, its `opening` with a choice's first
        output, then its `delta` for each output with new text or a finish, a usage chunk if asked
        for, and [DONE]."""
        opened: set[int] = set()
        sent: dict[int, int] = {}  # tokens of each choice already sent

        def chunk(chunk_choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            doc: dict[str, Any] = {"id": rid, "object": renderer.chunk_object_name, "created": created,
                                   "model": self.config.served_model_name, "choices": chunk_choices}
            if usage is not None:
                doc["usage"] = usage
            return f"data: {json.dumps(doc)}\n\n"

        for choice in choices:
            first = renderer.intro(choice)
            if first is not None:
                yield chunk([first])
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self.outputs(choices)) as stream:
            async for choice, out in stream:
                if choice.index not in opened:  # the first output of this choice
                    opened.add(choice.index)
                    first = renderer.opening(choice, out)
                    if first is not None:
                        yield chunk([first])
                c = out.outputs[0]
                if c.new_text or out.finished:
                    # every token since the last chunk: one whose text was held back (part of a UTF-8
                    # character) has its logprob sent with the chunk that carries its text
                    done = sent.get(choice.index, 0)
                    sent[choice.index] = len(c.token_ids)
                    fresh = (c.token_ids[done:], c.logprobs[done:]) if c.logprobs else None
                    yield chunk([renderer.delta(choice, c, fresh,
                                                finish_reason(c.finish_reason) if out.finished else None)])
                if out.finished:
                    finals[choice.index] = out
        if include_usage:
            yield chunk([], usage(choices, finals))
        yield "data: [DONE]\n\n"

    # ---- output pieces -------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def echo_text(self, choice: Choice) -> str:
        return choice.prompt_text if choice.prompt_text is not None else self.tokenizer.decode(choice.prompt_ids)


def get_serving(request: Request) -> Serving:
    return request.app.state.serving


# a route's parameter for the shared state
ServingDep = Annotated[Serving, Depends(get_serving)]


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def closure(chunk_choice: dict[str, Any], c: CompletionOutput) -> dict[str, Any]:
    """A streamed choice, with the output's `output_closure` on the chunk that finishes it (if set)."""
    if c.output_closure is not None and chunk_choice.get("finish_reason") is not None:
        chunk_choice["output_closure"] = c.output_closure
    return chunk_choice


def usage(choices: list[Choice], finals: dict[int, RequestOutput]) -> dict[str, int]:
    # prompts shared by n samples are counted once per distinct prompt, as OpenAI does
    prompt_tokens = sum(len(ids) for ids in {tuple(c.prompt_ids): c.prompt_ids for c in choices}.values())
    completion = sum(len(out.outputs[0].token_ids) for out in finals.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
