"""What the routes share: the engine, the server's settings and metrics (`Serving`), and running
one HTTP request's choices on the engine (`Job`s), all at once or as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from llmopt.errors import LlmoptError
from llmopt.runtime.outputs import CompletionOutput, RequestOutput
from llmopt.runtime.serving_engine import ServingEngine
from llmopt.serve.metrics import ServerMetrics
from llmopt.serve.protocol import ChatCompletionRequest, RequestError, SamplingRequest

logger = logging.getLogger("llmopt.serve")


@dataclass
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    max_queue: int = 256  # waiting requests beyond this get 503 + Retry-After
    max_body_bytes: int = 10 * 1024 * 1024
    log_requests: bool = False


@dataclass
class Job:
    """One choice of a response: one engine request."""

    index: int  # choice index in the response
    prompt_ids: list[int]
    prompt_text: str | None
    max_tokens: int
    request_id: str = ""


# what a streamed choice is built from: (job, completion so far, (new token ids, their logprobs) or None,
# finish reason or None)
ChoiceChunk = Callable[[Job, CompletionOutput, "tuple[list[int], list[dict[int, float]]] | None", "str | None"],
                       dict[str, Any]]


@dataclass
class Serving:
    engine: ServingEngine
    config: ServeConfig
    metrics: ServerMetrics
    warned_fields: set[str] = field(default_factory=set)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- checking a request --------------------------------------------------------------
    def check(self, body: SamplingRequest) -> None:
        """Refuse known fields llmopt cannot honour and another model's name; name each ignored
        field in one warning per name."""
        body.check_supported()
        name = self.config.served_model_name
        if body.model is not None and body.model != name:
            raise RequestError(f"the model {body.model!r} does not exist; this server serves {name!r}",
                               404, param="model", type_="not_found_error", code="model_not_found")
        for field_name in body.ignored_fields():
            if field_name not in self.warned_fields:
                self.warned_fields.add(field_name)
                logger.warning("ignoring request field %r: llmopt serve does not use it (logged once per name)",
                               field_name)

    def tokenize_chat(self, body: ChatCompletionRequest) -> tuple[list[int], str]:
        try:
            text = self.tokenizer.apply_chat_template(body.chat_messages(), add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False), text
        except LlmoptError as exc:
            raise RequestError(str(exc), param="messages") from None

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        try:
            return self.engine.tokenize_prompt(prompt)
        except LlmoptError as exc:
            raise RequestError(str(exc), param="prompt") from None

    def max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """`requested`, or what the context leaves after the prompt; `param` names the prompt's field."""
        if prompt_len >= self.max_model_len:
            raise RequestError(f"the prompt has {prompt_len} tokens; this server's context is {self.max_model_len}",
                               param=param, code="context_length_exceeded")
        return requested if requested is not None else self.max_model_len - prompt_len

    # ---- running the jobs ----------------------------------------------------------------
    def start(self, jobs: list[Job], body: SamplingRequest, logprobs: int | None,
              prompt_logprobs: int | None = None) -> None:
        """Add every job to the engine, or none of them (RequestError)."""
        engine = self.engine
        if engine.stats().num_requests_waiting >= self.config.max_queue:
            raise RequestError("the server is at capacity; retry shortly", 503, type_="server_busy")
        started: list[str] = []
        params = None
        try:
            for job in jobs:
                params = body.sampling_params(job.max_tokens, logprobs, job.index, prompt_logprobs)
                job.request_id = engine.add_request({"prompt_token_ids": job.prompt_ids, "prompt": job.prompt_text},
                                                    params)
                started.append(job.request_id)
        except LlmoptError as exc:
            for request_id in started:
                engine.abort(request_id)
            if params is not None and params.structured_outputs is not None and str(exc).startswith("invalid "):
                param = "structured_outputs" if body.structured_outputs is not None else "response_format"
            else:
                param = "max_tokens" if "max_tokens" in str(exc) else None
            raise RequestError(str(exc), param=param) from None
        except RequestError:
            for request_id in started:
                engine.abort(request_id)
            raise
        if self.config.log_requests:
            logger.info("request %s: %d choice(s), prompt %r", jobs[0].request_id, len(jobs), jobs[0].prompt_text)
        else:
            logger.info("request %s: %d choice(s), %d prompt tokens", jobs[0].request_id, len(jobs),
                        len(jobs[0].prompt_ids))

    async def outputs(self, jobs: list[Job]) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """Outputs of all jobs interleaved as they arrive; leaving early aborts every job."""
        queue: asyncio.Queue[tuple[Job, RequestOutput | Exception]] = asyncio.Queue()
        metrics = self.metrics

        async def pump(job: Job) -> None:
            last, finished = None, False
            try:
                async with contextlib.aclosing(self.engine.stream_outputs(job.request_id)) as stream:
                    async for out in stream:
                        now = time.time()
                        if last is not None and out.outputs[0].new_token_ids:
                            metrics.observe_token_gap(now - last)
                        last, finished = now, out.finished
                        if out.finished:
                            metrics.observe_finished(out)
                        queue.put_nowait((job, out))
            except Exception as exc:  # the engine failed this request: end the response, don't leave it waiting
                queue.put_nowait((job, exc))
            finally:
                if not finished:  # the client went away (or the engine failed): the request was aborted
                    metrics.observe_aborted()

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            remaining = len(jobs)
            while remaining:
                job, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                remaining -= out.finished
                yield job, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, jobs: list[Job]) -> dict[int, RequestOutput]:
        """The final output of every job, by choice index."""
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self.outputs(jobs)) as stream:
            async for job, out in stream:
                if out.finished:
                    finals[job.index] = out
        return finals

    async def stream(self, jobs: list[Job], include_usage: bool, created: int, rid: str, object_name: str,
                     intro: list[dict[str, Any]], choice: ChoiceChunk,
                     opening: Callable[[Job, RequestOutput], dict[str, Any]] | None = None) -> AsyncIterator[str]:
        """SSE chunks: `intro` choices first, `opening(job, first_output)` before a choice's first output,
        then `choice(job, completion, fresh, finish_reason)` for each output with new text or a
        finish, a usage chunk if asked for, and [DONE]."""
        opened: set[int] = set()
        sent: dict[int, int] = {}  # tokens of each choice already sent

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            doc: dict[str, Any] = {"id": rid, "object": object_name, "created": created,
                                   "model": self.config.served_model_name, "choices": choices}
            if usage is not None:
                doc["usage"] = usage
            return f"data: {json.dumps(doc)}\n\n"

        for first in intro:
            yield chunk([first])
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self.outputs(jobs)) as stream:
            async for job, out in stream:
                if job.index not in opened and opening is not None:  # the first output of this choice
                    opened.add(job.index)
                    yield chunk([opening(job, out)])
                c = out.outputs[0]
                if c.new_text or out.finished:
                    # every token since the last chunk: one whose text was held back (part of a UTF-8
                    # character) has its logprob sent with the chunk that carries its text
                    done = sent.get(job.index, 0)
                    sent[job.index] = len(c.token_ids)
                    fresh = (c.token_ids[done:], c.logprobs[done:]) if c.logprobs else None
                    yield chunk([choice(job, c, fresh, finish_reason(c.finish_reason) if out.finished else None)])
                if out.finished:
                    finals[job.index] = out
        if include_usage:
            yield chunk([], usage(jobs, finals))
        yield "data: [DONE]\n\n"

    # ---- output pieces -------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def echo_text(self, job: Job) -> str:
        return job.prompt_text if job.prompt_text is not None else self.tokenizer.decode(job.prompt_ids)


def get_serving(request: Request) -> Serving:
    return request.app.state.serving


# a route's parameter for the shared state
ServingDep = Annotated[Serving, Depends(get_serving)]


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def usage(jobs: list[Job], finals: dict[int, RequestOutput]) -> dict[str, int]:
    # prompts shared by n samples are counted once per distinct prompt, as OpenAI does
    prompt_tokens = sum(len(ids) for ids in {tuple(j.prompt_ids): j.prompt_ids for j in jobs}.values())
    completion = sum(len(out.outputs[0].token_ids) for out in finals.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def sse(stream: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
