"""The OpenAI-compatible HTTP app: `build_app(engine, config)` assembles it.

Routes live in `llmopt.serve.routes` (completions, chat, responses, models + tokenize, health + metrics),
one APIRouter each; request bodies are the pydantic models of `llmopt.serve.protocol`, so
/openapi.json documents every body and the error answers. Every refusal is an OpenAI error
object with a 4xx status (a malformed body too: 400, not FastAPI's 422); a client that
disconnects, mid-stream or while waiting for a whole answer, has its requests aborted
(`llmopt.serve.disconnect`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from llmopt import __version__
from llmopt.errors import LlmoptError
from llmopt.runtime.engine_protocol import ServingEngine
from llmopt.serve.disconnect import BodyTimeout, BodyTooLarge, read_body, run_until_disconnect
from llmopt.serve.metrics import ServerMetrics
from llmopt.serve.protocol import RequestError, error_body
from llmopt.serve.request_path import ServeConfig, Serving
from llmopt.serve.response_bodies import STREAM_MODELS
from llmopt.serve.routes import chat, completions, health, models, responses

__all__ = ["ServeConfig", "build_app"]


def build_app(engine: ServingEngine, config: ServeConfig) -> FastAPI:
    """The app serving `engine` (an AsyncLLM, or the llama.cpp engine); its lifespan shuts the engine down."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn gets here after its graceful shutdown: stop the engine's thread (after its current step)
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="llmopt", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = ServerMetrics(engine, config.served_model_name)
    app.state.serving = Serving(engine, config, metrics)
    app.add_middleware(_Guard, config=config)
    app.add_exception_handler(RequestError, _on_request_error)  # type: ignore[arg-type]
    app.add_exception_handler(LlmoptError, _on_llmopt_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_server_error)
    for module in (completions, chat, responses, models, health):
        app.include_router(module.router)
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document without the 422 answers it adds to every route with a body: ours are 400s
    (`_on_validation_error`), declared with the other refusals (protocol.ERROR_RESPONSES); with
    the streamed bodies (`response_bodies.STREAM_MODELS`)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        # the streams' chunk and event bodies, which the routes' text/event-stream answers refer to
        _, defs = models_json_schema([(m, "serialization") for m in STREAM_MODELS],
                                     ref_template="#/components/schemas/{model}")
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
        app.openapi_schema = schema
    return app.openapi_schema


def _error(exc: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status, headers=headers)


async def _on_request_error(_request: Request, exc: RequestError) -> JSONResponse:
    return _error(exc)


async def _on_llmopt_error(_request: Request, exc: LlmoptError) -> JSONResponse:
    """Bad input the library refused where no route turned it into a RequestError (e.g. /tokenize's text)."""
    return _error(RequestError(str(exc)))


async def _on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that does not fit the route's model: 400 naming the first problem, as vLLM and OpenAI answer."""
    return _error(validation_refusal(exc.errors()))


def validation_refusal(errors: Any) -> RequestError:
    """FastAPI's validation errors as one refusal: the most specific error (the deepest: a union such
    as `prompt` lists one error per member type, the deepest says what was wrong), `param` naming
    the request's field."""
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    loc = [str(p) for p in first.get("loc", ())]
    where = loc[1:] if loc[:1] == ["body"] else loc
    if first.get("type") == "json_invalid":  # loc: ("body", position)
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        return RequestError(f"request body is not valid JSON: {reason} at position {where[0] if where else 0}")
    if not where:  # the body itself: missing, or not an object
        return RequestError("request body must be a JSON object")
    return RequestError(f"{'.'.join(where)}: {first.get('msg', 'invalid value')}", param=where[0])


async def _on_http_exception(_request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, wrong method, an unreadable body) as OpenAI error objects."""
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        message = "request body is not valid UTF-8"
    else:
        message = str(exc.detail)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)


async def _on_server_error(_request: Request, exc: Exception) -> JSONResponse:
    """A bug or a failed engine step: still an OpenAI error object (Starlette logs the traceback)."""
    return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", "internal_server_error"),
                        status_code=500)


class _Guard:
    """API key, body size and read time, content type, and cancellation on disconnect around every
    route. Plain ASGI:
    `@app.middleware("http")` (BaseHTTPMiddleware) would relay every SSE chunk through one more
    memory stream and task."""

    def __init__(self, app: ASGIApp, config: ServeConfig):
        self.app, self.config = app, config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(headers, scope["path"])
        if refusal is None and scope["method"] == "POST":
            scope = _as_json(scope, headers)
            body, refusal = await self._read_body(receive)
            if refusal is None:
                if body is not None:  # (None: the client went away)
                    await run_until_disconnect(self.app, scope, body, receive, send)
                return
        if refusal is not None:
            await _error(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, headers: Headers, path: str) -> RequestError | None:
        api_key, limit = self.config.api_key, self.config.max_body_bytes
        if api_key and needs_api_key(path):
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return RequestError("invalid or missing API key", 401, type_="authentication_error",
                                    code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(limit)
        return None

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, RequestError | None]:
        """The whole body (None if the client went away) or why it is refused: over the size
        limit (a chunked body is counted as it comes), or not complete within --read-timeout."""
        limit, timeout = self.config.max_body_bytes, self.config.read_timeout
        try:
            return await read_body(receive, limit, timeout), None
        except BodyTooLarge:
            return None, _too_large(limit)
        except BodyTimeout:
            return None, RequestError(f"the request body did not arrive within {timeout:g} s (--read-timeout)", 408,
                                      code="request_timeout")


# outside /v1 only what monitoring reads (/health, /version, /metrics) and the API's description
# answer without the key. vLLM leaves /tokenize and /detokenize open as well; they are closed here
# because tokenizing is work a stranger could make the server do (up to the body-size limit).
KEYED_PATHS = ("/tokenize", "/detokenize")


def needs_api_key(path: str) -> bool:
    return path.startswith("/v1") or path in KEYED_PATHS


def _too_large(limit: int) -> RequestError:
    return RequestError(f"request body over {limit} bytes", 413)


def _as_json(scope: Scope, headers: Headers) -> Scope:
    """Bodies are read as JSON whatever their declared type (`curl -d` says form-urlencoded), as
    llmopt always has; FastAPI would otherwise hand the route raw bytes."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json" or kind.endswith("+json"):
        return scope
    raw = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    return {**scope, "headers": [*raw, (b"content-type", b"application/json")]}
