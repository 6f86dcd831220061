"""The online load generator: streaming OpenAI requests on a schedule, each one timed.

`run_load` sends a workload to `/v1/chat/completions` or `/v1/completions` with httpx on one
asyncio loop (one client, connection pool unbounded so that only our own schedule and
`max_concurrency` decide when a request goes out). Arrivals follow vLLM's bench: a gamma
process with mean rate `request_rate` and shape `burstiness` (1 = Poisson), or everything at
once when the rate is infinite. With a finite rate each request's clock starts at its
*scheduled* send time: if the client (or the concurrency cap) sends late, that delay is
latency the user would see, and it is also recorded as the request's send lag.

Output tokens: the server's `usage` (asked for with `stream_options.include_usage`); without it,
`max_tokens` when the stream finished with reason "length"; else the text re-encoded by the
tokenizer (close but not exact: a model's byte-fallback tokens may re-encode differently), or
the number of content chunks when there is no tokenizer.

Nothing here raises for a bad server: HTTP errors, streams that break off, streams that end
without `data: [DONE]`, unparsable chunks and error objects inside a stream all become a
failed `RequestResult` with the reason.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from llmopt.bench.datasets import BenchRequest
from llmopt.bench.online_metrics import RequestResult

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class Endpoint:
    """Where and how requests go."""

    base_url: str  # http://host:port (no /v1)
    kind: str  # "chat" | "completions"
    model: str  # the served model name
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout: float = 600.0  # seconds without a byte (connect, queue, between chunks) before a request fails

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.kind]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(endpoint: Endpoint, request: BenchRequest) -> dict:
    """The JSON body: streaming with usage, exactly `max_tokens` out (`ignore_eos` is a vLLM extra that
    llmopt serve honours; servers without it may stop early, which the report counts as short outputs)."""
    body = {"model": endpoint.model, "max_tokens": request.max_tokens, "temperature": endpoint.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    if endpoint.kind == "chat":
        body["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def send_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is due: gaps drawn from a gamma distribution of
    mean 1 / request_rate and shape `burstiness` (vLLM's `--burstiness`; 1 is a Poisson process,
    lower is burstier); the first request at 0; all at 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(0, num_requests - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:num_requests]


async def send_request(client: httpx.AsyncClient, endpoint: Endpoint, request: BenchRequest, start: float,
                       count_tokens: Callable[[str], int] | None = None) -> RequestResult:
    """One streaming request, timed from `start` (a perf_counter reading: its scheduled or actual send)."""
    result = RequestResult(max_tokens=request.max_tokens)
    usage: dict | None = None
    done = False
    last = start
    try:
        async with client.stream("POST", endpoint.url, json=request_body(endpoint, request),
                                 headers=endpoint.headers, timeout=endpoint.timeout) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {' '.join(body.split())[:160]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments and event names
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError("a chunk that is not a JSON object")
                if chunk.get("error"):
                    error = chunk["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    result.error = f"error in stream: {' '.join(str(message).split())[:160]}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or [{}]
                result.finish_reason = choices[0].get("finish_reason") or result.finish_reason
                text = _content(chunk, endpoint.kind)
                if text:
                    if result.chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks += 1
                    result.text += text
    except (httpx.HTTPError, httpx.StreamError) as exc:  # refused, reset, timed out, broken chunked body
        result.error = f"stream broke off ({type(exc).__name__})" if result.chunks else \
            f"request failed ({type(exc).__name__})"
        return result
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # a chunk we cannot read
        result.error = f"unreadable stream chunk ({type(exc).__name__})"
        return result
    result.latency = time.perf_counter() - start
    if not done:
        result.error = "stream ended without [DONE]"
        return result
    if result.chunks == 0:
        result.error = "no content before [DONE]"
        return result
    result.success = True
    result.prompt_tokens = len(request.prompt_token_ids)
    if usage and isinstance(usage.get("completion_tokens"), int):
        result.output_tokens, result.token_source = usage["completion_tokens"], "usage"
        if isinstance(usage.get("prompt_tokens"), int):
            result.prompt_tokens = usage["prompt_tokens"]
    elif result.finish_reason == "length":  # stopped by max_tokens: exactly that many, whatever the text
        result.output_tokens, result.token_source = request.max_tokens, "max_tokens"
    elif count_tokens is not None:  # re-encoding the text: close, not exact (byte fallbacks, merges)
        result.output_tokens, result.token_source = count_tokens(result.text), "tokenizer"
    else:
        result.output_tokens, result.token_source = result.chunks, "chunks"
    return result


def _content(chunk: dict, kind: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if kind == "chat":
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choices[0].get("text") or ""


@dataclass
class LoadResult:
    results: list[RequestResult]
    duration: float  # first scheduled send to last finish, seconds
    max_concurrent_requests: int  # most requests in flight at once
    max_loop_lag_ms: float  # the longest the client's event loop was late for a 10 ms timer


async def run_load(endpoint: Endpoint, requests: list[BenchRequest], request_rate: float = math.inf,
                   burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                   count_tokens: Callable[[str], int] | None = None,
                   on_result: Callable[[RequestResult], None] | None = None) -> LoadResult:
    """Send `requests` on the schedule and return every request's result."""
    offsets = send_offsets(len(requests), request_rate, burstiness, seed)
    open_loop = not math.isinf(request_rate)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = peak = 0
    finishes: list[float] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=endpoint.timeout) as client:
        stop = asyncio.Event()
        monitor = asyncio.create_task(_loop_lag(stop))
        t0 = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            nonlocal in_flight, peak
            due = t0 + offset
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            if slots is not None:
                await slots.acquire()
            sent = time.perf_counter()
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                result = await send_request(client, endpoint, request, due if open_loop else sent, count_tokens)
                result.send_lag = sent - due if open_loop else 0.0
            finally:
                in_flight -= 1
                if slots is not None:
                    slots.release()
            finishes.append(time.perf_counter())
            if on_result is not None:
                on_result(result)
            return result

        try:
            results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        finally:
            stop.set()
            lag = await monitor
    return LoadResult(list(results), max(finishes) - t0 if finishes else 0.0, peak, lag * 1e3)


async def _loop_lag(stop: asyncio.Event, period: float = 0.010) -> float:
    """The worst lateness of a `period` timer while the load runs: a client too busy to read its
    streams on time inflates every latency it measures, and this says by how much at most."""
    worst = 0.0
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(period)
        worst = max(worst, time.perf_counter() - before - period)
    return worst
