"""The OpenAI-compatible HTTP app on the paged runtime.

Routes: /v1/chat/completions, /v1/completions (both with SSE streaming), /v1/models,
/health, /version, /tokenize, /detokenize, /metrics. Every refusal is an OpenAI error
object with a 4xx status; a client that disconnects mid-stream has its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from llmopt import __version__
from llmopt.errors import LlmoptError
from llmopt.runtime.async_engine import AsyncLLM
from llmopt.runtime.outputs import RequestOutput
from llmopt.serve.metrics import ServerMetrics
from llmopt.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    error_body,
)

logger = logging.getLogger("llmopt.serve")


@dataclass
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    max_queue: int = 256  # waiting requests beyond this get 503 + Retry-After
    max_body_bytes: int = 10 * 1024 * 1024
    log_requests: bool = False


@dataclass
class _Job:
    index: int  # choice index in the response
    prompt_ids: list[int]
    prompt_text: str | None
    max_tokens: int
    request_id: str = ""


def build_app(engine: AsyncLLM, config: ServeConfig) -> FastAPI:
    """`engine`: an AsyncLLM, or any back end with its surface (see llamacpp_engine.py)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn gets here after its graceful shutdown: stop the engine's thread (after its current step)
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="llmopt", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = ServerMetrics(engine, config.served_model_name)
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    app.state.engine, app.state.metrics = engine, metrics

    app.add_middleware(_Guard, config=config)

    @app.exception_handler(RequestError)
    async def _on_request_error(request: Request, exc: RequestError):
        return _error(exc)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "llmopt", "max_model_len": max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _parse(request, TokenizeRequest, config)
        if body.messages is not None:
            ids = tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        elif body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise RequestError("give 'prompt' or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _parse(request, DetokenizeRequest, config)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = _checked(await _parse(request, ChatCompletionRequest, config))
        _check_model(body.model, config)
        prompt_ids, prompt_text = _tokenize_chat(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        jobs = [_Job(i, prompt_ids, prompt_text, _max_tokens(max_tokens, len(prompt_ids))) for i in range(body.n)]
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        _start(jobs, body, logprobs)
        created, rid = int(time.time()), f"chatcmpl-{secrets.token_hex(12)}"
        if body.stream:
            return _sse(_chat_stream(jobs, body, created, rid))
        finals = await _collect(jobs)
        choices = []
        for job in jobs:
            c = finals[job.index].outputs[0]
            choices.append({"index": job.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": _chat_logprobs(c.token_ids, c.logprobs, logprobs) if body.logprobs else None,
                            "finish_reason": _finish(c.finish_reason)})
        return {"id": rid, "object": "chat.completion", "created": created, "model": config.served_model_name,
                "choices": choices, "usage": _usage(jobs, finals)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _checked(await _parse(request, CompletionRequest, config))
        _check_model(body.model, config)
        jobs: list[_Job] = []
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        for p_index, prompt in enumerate(body.prompts()):
            text, ids = _tokenize_prompt(prompt)
            for k in range(body.n):
                jobs.append(_Job(p_index * body.n + k, ids, text, _max_tokens(max_tokens, len(ids))))
        _start(jobs, body, body.logprobs, body.prompt_logprobs_wanted)
        created, rid = int(time.time()), f"cmpl-{secrets.token_hex(12)}"
        if body.stream:
            return _sse(_completion_stream(jobs, body, created, rid))
        finals = await _collect(jobs)
        choices = []
        for job in jobs:
            out = finals[job.index]
            c = out.outputs[0]
            choice = {"index": job.index, "text": (_echo_text(job) if body.echo else "") + c.text,
                      "logprobs": None, "finish_reason": _finish(c.finish_reason)}
            if body.logprobs is not None:
                prompt = (job.prompt_ids, out.prompt_logprobs) if body.echo else None
                choice["logprobs"] = _completion_logprobs(c.token_ids, c.logprobs, body.logprobs, prompt)
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(job.prompt_ids, out.prompt_logprobs,
                                                                  body.prompt_logprobs)
            choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": created, "model": config.served_model_name,
                "choices": choices, "usage": _usage(jobs, finals)}

    # ---- helpers ------------------------------------------------------------------------
    warned_fields: set[str] = set()

    def _checked(body):
        """Refuse known fields llmopt cannot honour; name each ignored field in one warning per name."""
        body.check_supported()
        for name in body.ignored_fields():
            if name not in warned_fields:
                warned_fields.add(name)
                logger.warning("ignoring request field %r: llmopt serve does not use it (logged once per name)",
                               name)
        return body

    def _tokenize_chat(body: ChatCompletionRequest) -> tuple[list[int], str]:
        try:
            text = tokenizer.apply_chat_template(body.chat_messages(), add_generation_prompt=True)
        except LlmoptError as exc:
            raise RequestError(str(exc), param="messages") from None
        return tokenizer.encode(text, add_special_tokens=False), text

    def _tokenize_prompt(prompt: str | list[int]) -> tuple[str | None, list[int]]:
        try:
            return engine.tokenize_prompt(prompt)
        except LlmoptError as exc:
            raise RequestError(str(exc), param="prompt") from None

    def _max_tokens(requested: int | None, prompt_len: int) -> int:
        if prompt_len >= max_model_len:
            raise RequestError(f"the prompt has {prompt_len} tokens; this server's context is {max_model_len}",
                               param="messages", code="context_length_exceeded")
        return requested if requested is not None else max_model_len - prompt_len

    def _start(jobs: list[_Job], body, logprobs: int | None, prompt_logprobs: int | None = None) -> None:
        if engine.stats().num_requests_waiting >= config.max_queue:
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
        if config.log_requests:
            logger.info("request %s: %d choice(s), prompt %r", jobs[0].request_id, len(jobs), jobs[0].prompt_text)
        else:
            logger.info("request %s: %d choice(s), %d prompt tokens", jobs[0].request_id, len(jobs),
                        len(jobs[0].prompt_ids))

    async def _outputs(jobs: list[_Job]) -> AsyncIterator[tuple[_Job, RequestOutput]]:
        """Outputs of all jobs interleaved as they arrive; leaving early aborts every job."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: _Job) -> None:
            last, finished = None, False
            try:
                async with contextlib.aclosing(engine.stream_outputs(job.request_id)) as stream:
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

    async def _collect(jobs: list[_Job]) -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(_outputs(jobs)) as stream:
            async for job, out in stream:
                if out.finished:
                    finals[job.index] = out
        return finals

    async def _stream(jobs: list[_Job], body, created: int, rid: str, object_name: str,
                      intro: list[dict[str, Any]], choice, opening=None) -> AsyncIterator[str]:
        """SSE chunks: `intro` choices first, `opening(job, first_output)` before a choice's first output,
        then `choice(job, completion, logprobs, finish_reason)` for each output with new text or a
        finish, an optional usage chunk, and [DONE]."""
        opened: set[int] = set()
        sent: dict[int, int] = {}  # tokens of each choice already sent

        def chunk(choices, usage=None) -> str:
            doc = {"id": rid, "object": object_name, "created": created, "model": config.served_model_name,
                   "choices": choices}
            if usage is not None:
                doc["usage"] = usage
            return f"data: {json.dumps(doc)}\n\n"

        for first in intro:
            yield chunk([first])
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(_outputs(jobs)) as stream:
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
                    yield chunk([choice(job, c, fresh, _finish(c.finish_reason) if out.finished else None)])
                if out.finished:
                    finals[job.index] = out
        if body.include_usage:
            yield chunk([], _usage(jobs, finals))
        yield "data: [DONE]\n\n"

    def _chat_stream(jobs, body: ChatCompletionRequest, created: int, rid: str) -> AsyncIterator[str]:
        intro = [{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for j in jobs]

        def choice(job, c, fresh, finish):
            lp = _chat_logprobs(*fresh, body.top_logprobs or 0) if body.logprobs and fresh else None
            return {"index": job.index, "delta": {"content": c.new_text} if c.new_text else {}, "logprobs": lp,
                    "finish_reason": finish}

        return _stream(jobs, body, created, rid, "chat.completion.chunk", intro, choice)

    def _completion_stream(jobs, body: CompletionRequest, created: int, rid: str) -> AsyncIterator[str]:
        scored = body.prompt_logprobs_wanted is not None and (body.logprobs is not None
                                                              or body.prompt_logprobs is not None)
        # the echoed prompt comes first; with its logprobs it waits for the prefill that computes them
        intro = [{"index": j.index, "text": _echo_text(j), "logprobs": None, "finish_reason": None}
                 for j in jobs] if body.echo and not scored else []

        def opening(job, out):
            first = {"index": job.index, "text": _echo_text(job) if body.echo else "", "logprobs": None,
                     "finish_reason": None}
            if body.echo and body.logprobs is not None:
                first["logprobs"] = _completion_logprobs([], [], body.logprobs, (job.prompt_ids, out.prompt_logprobs))
            if body.prompt_logprobs is not None:
                first["prompt_logprobs"] = _vllm_prompt_logprobs(job.prompt_ids, out.prompt_logprobs,
                                                                 body.prompt_logprobs)
            return first

        def choice(job, c, fresh, finish):
            lp = _completion_logprobs(*fresh, body.logprobs) if body.logprobs is not None and fresh else None
            return {"index": job.index, "text": c.new_text, "logprobs": lp, "finish_reason": finish}

        return _stream(jobs, body, created, rid, "text_completion", intro, choice, opening if scored else None)

    def _token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]] | None, top_n: int) -> dict[str, Any]:
        content = []
        for tid, lp in zip(token_ids, logprobs or []):
            text = _token_text(tid)
            # the sampler gives the chosen token plus the top N: report the N most likely
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": text, "logprob": lp[tid], "bytes": list(text.encode()),
                            "top_logprobs": [{"token": _token_text(t), "logprob": v,
                                              "bytes": list(_token_text(t).encode())} for t, v in top]})
        return {"content": content}

    def _echo_text(job: _Job) -> str:
        return job.prompt_text if job.prompt_text is not None else tokenizer.decode(job.prompt_ids)

    def _completion_logprobs(token_ids: list[int], logprobs: list[dict[int, float]] | None, top_n: int,
                             prompt: tuple[list[int], list[dict[int, float] | None] | None] | None = None,
                             ) -> dict[str, Any]:
        """OpenAI's legacy logprobs object; with `prompt` (echo): its (token ids, prompt logprobs) first,
        the first position's logprob and alternatives null, as OpenAI and vLLM give them."""
        pairs = list(zip(*prompt)) if prompt is not None else []
        pairs += list(zip(token_ids, logprobs or []))
        tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
        for tid, lp in pairs:
            text = _token_text(tid)
            tokens.append(text)
            token_lps.append(None if lp is None else lp[tid])
            # the runtime gives the token plus the top N: report the N most likely (plus the token)
            top = None if lp is None else dict(sorted(lp.items(), key=lambda kv: -kv[1])[:top_n])
            if top is not None:
                top.setdefault(tid, lp[tid])
            tops.append(None if top is None else {_token_text(t): v for t, v in top.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _vllm_prompt_logprobs(prompt_ids: list[int], scores: list[dict[int, float] | None] | None,
                              top_n: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob,
        decoded_token}} for the prompt token and the top N."""
        result: list[dict[str, dict[str, Any]] | None] = []
        for tid, lp in zip(prompt_ids, scores or []):
            if lp is None:
                result.append(None)
                continue
            top = dict(sorted(lp.items(), key=lambda kv: -kv[1])[:top_n])
            top.setdefault(tid, lp[tid])
            result.append({str(t): {"logprob": v, "decoded_token": _token_text(t)} for t, v in top.items()})
        return result

    return app


class _Guard:
    """API key and body-size checks before any route. Plain ASGI: `@app.middleware("http")`
    (BaseHTTPMiddleware) would relay every SSE chunk through one more memory stream and task."""

    def __init__(self, app: ASGIApp, config: ServeConfig):
        self.app, self.config = app, config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(Headers(scope=scope), scope["path"])
            if refusal is not None:
                await _error(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, headers: Headers, path: str) -> RequestError | None:
        api_key, limit = self.config.api_key, self.config.max_body_bytes
        if api_key and path.startswith("/v1"):
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return RequestError("invalid or missing API key", 401, type_="authentication_error",
                                    code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return RequestError(f"request body over {limit} bytes", 413)
        return None


def _check_model(name: str | None, config: ServeConfig) -> None:
    if name is not None and name != config.served_model_name:
        raise RequestError(f"the model {name!r} does not exist; this server serves {config.served_model_name!r}",
                           404, param="model", type_="not_found_error", code="model_not_found")


def _finish(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def _usage(jobs: list[_Job], finals: dict[int, RequestOutput]) -> dict[str, int]:
    # prompts shared by n samples are counted once per distinct prompt, as OpenAI does
    prompt_tokens = sum(len(ids) for ids in {tuple(j.prompt_ids): j.prompt_ids for j in jobs}.values())
    completion = sum(len(out.outputs[0].token_ids) for out in finals.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _error(exc: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status, headers=headers)


def _sse(stream: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _parse(request: Request, model: type[BaseModel], config: ServeConfig):
    raw = await request.body()
    if len(raw) > config.max_body_bytes:
        raise RequestError(f"request body over {config.max_body_bytes} bytes", 413)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise RequestError(f"{param}: {first.get('msg')}" if param else first.get("msg", "invalid request"),
                           param=param) from None
