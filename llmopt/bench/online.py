"""`llmopt bench serve`: an online benchmark of any OpenAI-compatible server, one load point or a sweep.

`run_serve_bench(config)` probes (or launches) the server, builds the workload with
`datasets.make_workload`, sends `num_warmups` unmeasured requests, then runs every load point
(`--sweep concurrency=1,4,16` or `rate=1,2,4`, else the one point the flags give) with
`loadgen.run_load` and turns each into figures with `online_metrics.compute_metrics`. The same
workload (same seed) runs at every point.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

from llmopt.bench.datasets import BenchRequest, make_workload
from llmopt.bench.launch_server import LAUNCHERS, gguf_to_serve, launched_server
from llmopt.bench.llama_cpp_bin import find_binaries
from llmopt.bench.loadgen import ENDPOINTS, Endpoint, run_load
from llmopt.bench.online_metrics import RequestResult, compute_metrics
from llmopt.openai_http import base_url, probe
from llmopt.core import load_tokenizer
from llmopt.errors import LlmoptError

SWEEP_VARIABLES = ("concurrency", "rate")


@dataclass
class ServeBenchConfig:
    """Everything one `bench serve` invocation does (written into results.json as `config`)."""

    url: str | None = None  # an already running server...
    model: str | None = None  # ...or a spec to launch (`launch`: llmopt serve, or llama-cpp-python's server)
    launch: str = "llmopt"
    serve_args: list[str] = field(default_factory=list)  # extra flags for the launched server
    served_model_name: str | None = None
    api_key: str | None = None
    endpoint: str = "chat"
    dataset: str = "chat"
    num_prompts: int = 64
    input_len: int = 128
    output_len: int | None = 128
    range_ratio: float = 0.0
    prefix_len: int = 1000
    tokenizer: str | None = None  # default: `model`, else "default"
    seed: int = 0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    sweep: str | None = None  # "concurrency=1,4,16" or "rate=1,2,inf"
    num_warmups: int = 1
    temperature: float = 0.0
    ignore_eos: bool = True
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: ttft, tpot, e2el
    cost_per_hour: float | None = None
    timeout: float = 600.0  # seconds of silence from the server (httpx's connect/read timeouts) before a request fails
    server_timeout: float = 600.0  # for a launched server to answer

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["api_key"] = "***" if self.api_key else None  # never write a secret into a results file
        doc["request_rate"] = _rate_json(self.request_rate)
        return doc


@dataclass
class LoadPoint:
    label: str  # "concurrency=4", "rate=2", "rate=inf"
    request_rate: float
    max_concurrency: int | None


@dataclass
class ServeRun:
    """One load point measured: its figures (results.json's run) and the raw requests (plots, details)."""

    point: LoadPoint
    figures: dict[str, Any]
    results: list[RequestResult]


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """'concurrency=1,4,16' -> ("concurrency", [1, 4, 16]); 'rate=1,2,inf' -> ("rate", [1, 2, inf])."""
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in SWEEP_VARIABLES:
        raise LlmoptError(f"--sweep takes concurrency=N,N,... or rate=R,R,... (e.g. concurrency=1,4,16,64); "
                          f"got {text!r}")
    try:
        numbers = [float(v) for v in values.replace(" ", "").split(",") if v]
    except ValueError:
        raise LlmoptError(f"--sweep {text!r}: the values must be numbers") from None
    if not numbers:
        raise LlmoptError(f"--sweep {text!r} gives no values")
    if name == "concurrency" and any(not v.is_integer() or v < 1 for v in numbers):
        raise LlmoptError(f"--sweep {text!r}: concurrencies must be whole numbers >= 1")
    if name == "rate" and any(not v > 0 for v in numbers):
        raise LlmoptError(f"--sweep {text!r}: rates must be > 0 requests/s (inf: all at once)")
    return name, numbers


def load_points(config: ServeBenchConfig) -> list[LoadPoint]:
    if config.sweep:
        name, values = parse_sweep(config.sweep)
        if name == "concurrency":
            return [LoadPoint(f"concurrency={int(v)}", config.request_rate, int(v)) for v in values]
        return [LoadPoint(f"rate={_rate_label(v)}", v, config.max_concurrency) for v in values]
    if config.max_concurrency is not None and math.isinf(config.request_rate):
        return [LoadPoint(f"concurrency={config.max_concurrency}", config.request_rate, config.max_concurrency)]
    return [LoadPoint(f"rate={_rate_label(config.request_rate)}", config.request_rate, config.max_concurrency)]


def server_slots(points: list[LoadPoint]) -> int:
    """The requests a launched llama-server decodes together (`-np`): the most any load point keeps
    in flight, 16 where none is bounded."""
    bounded = [p.max_concurrency for p in points if p.max_concurrency is not None]
    return max(bounded) if bounded else 16


def check_config(config: ServeBenchConfig) -> None:
    """Bad flags, before anything starts."""
    if (config.url is None) == (config.model is None):
        raise LlmoptError("give either --url (a running server) or --model SPEC (launch `llmopt serve SPEC`)")
    if config.launch not in LAUNCHERS:
        raise LlmoptError(f"unknown --launch {config.launch!r}; choose {', '.join(LAUNCHERS)}")
    if config.model is not None and config.launch in ("llama-cpp", "llama-server") and config.model != "default":
        gguf_to_serve(config.launch, config.model)
    if config.model is not None and config.launch == "llama-server":
        find_binaries("llama-server").path("llama-server")  # not built: say how, before any work
    if config.endpoint not in ENDPOINTS:
        raise LlmoptError(f"unknown --endpoint {config.endpoint!r}; choose {', '.join(ENDPOINTS)}")
    if not config.request_rate > 0:
        raise LlmoptError(f"--request-rate must be > 0 requests/s (inf: all at once), got {config.request_rate}")
    if not (config.burstiness > 0 and math.isfinite(config.burstiness)):
        raise LlmoptError(f"--burstiness must be a positive number (1: Poisson), got {config.burstiness}")
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise LlmoptError(f"--max-concurrency must be at least 1, got {config.max_concurrency}")
    if config.num_warmups < 0:
        raise LlmoptError(f"--num-warmups must be >= 0, got {config.num_warmups}")
    if config.temperature < 0:
        raise LlmoptError(f"--temperature must be >= 0, got {config.temperature}")
    if config.cost_per_hour is not None and not config.cost_per_hour >= 0:
        raise LlmoptError(f"--cost-per-hour must be >= 0, got {config.cost_per_hour}")
    if not config.timeout > 0 or not config.server_timeout > 0:
        raise LlmoptError("--timeout and --server-timeout must be > 0 seconds")
    load_points(config)  # the sweep's syntax


def build_workload(config: ServeBenchConfig, tokenizer) -> list[BenchRequest]:
    return make_workload(tokenizer, dataset=config.dataset, num_prompts=config.num_prompts + config.num_warmups,
                         input_len=config.input_len, output_len=config.output_len, range_ratio=config.range_ratio,
                         seed=config.seed, prefix_len=config.prefix_len)


def run_serve_bench(config: ServeBenchConfig, tokenizer=None,
                    on_point: Callable[[LoadPoint, int], None] | None = None,
                    on_result: Callable[[RequestResult], None] | None = None) -> tuple[str, list[ServeRun]]:
    """Run every load point; returns (served model name, runs). `tokenizer` overrides `config.tokenizer`.
    `on_point(point, num_requests)` is called as a point starts, `on_result` after each request."""
    check_config(config)
    points = load_points(config)
    if config.url is not None:  # an unreachable server fails before the tokenizer and workload are built
        url = base_url(config.url)
        name = probe(url, config.api_key, config.served_model_name)
    if tokenizer is None:
        tokenizer = load_tokenizer(config.tokenizer or config.model or "default")
    workload = build_workload(config, tokenizer)
    warmups, requests = workload[:config.num_warmups], workload[config.num_warmups:]
    if len(requests) < config.num_prompts:
        raise LlmoptError(f"dataset {config.dataset} has {len(requests)} usable prompts after "
                          f"{config.num_warmups} warm-ups; lower --num-prompts or --num-warmups")

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    with ExitStack() as stack:
        if config.url is None:  # launched only once the workload is known to be good
            url = stack.enter_context(launched_server(config.launch, config.model, config.serve_args,
                                                      config.server_timeout, server_slots(points)))
            name = probe(url, config.api_key, config.served_model_name)
        endpoint = Endpoint(url, config.endpoint, name, config.api_key, config.temperature, config.ignore_eos,
                            config.timeout)
        if warmups:
            warm = asyncio.run(run_load(endpoint, warmups, count_tokens=count_tokens))
            if not any(r.success for r in warm.results):  # misconfigured (wrong model name, endpoint): stop here
                raise LlmoptError(f"every warm-up request to {endpoint.url} failed: {warm.results[0].error}")
        runs = []
        for point in points:
            if on_point is not None:
                on_point(point, len(requests))
            load = asyncio.run(run_load(endpoint, requests, point.request_rate, config.burstiness,
                                        point.max_concurrency, config.seed, count_tokens, on_result))
            figures = {"label": point.label, "request_rate": _rate_json(point.request_rate),
                       "burstiness": config.burstiness, "max_concurrency": point.max_concurrency,
                       **compute_metrics(load.results, load.duration, config.percentiles, config.goodput,
                                         config.cost_per_hour),
                       "max_concurrent_requests": load.max_concurrent_requests,
                       "max_loop_lag_ms": load.max_loop_lag_ms}
            runs.append(ServeRun(point, figures, load.results))
    return name, runs


def detailed(run: ServeRun) -> dict[str, list]:
    """Per-request lists in vLLM's `--save-detailed` names (ms for times)."""
    ok = [r for r in run.results if r.success]
    return {"input_lens": [r.prompt_tokens for r in ok], "output_lens": [r.output_tokens for r in ok],
            "ttfts": [round(r.ttft * 1e3, 3) for r in ok], "e2els": [round(r.latency * 1e3, 3) for r in ok],
            "itls": [[round(g * 1e3, 3) for g in r.itl] for r in ok],
            "send_lags": [round(r.send_lag * 1e3, 3) for r in run.results],
            "request_errors": [r.error for r in run.results if not r.success]}


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity
