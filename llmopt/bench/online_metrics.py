"""Figures of one online load point, under vLLM's key names (`vllm bench serve`).

Per request: TTFT (first content chunk), ITL (the gaps between content chunks), end-to-end
latency, and TPOT = (latency - TTFT) / (output_tokens - 1), the decode time per token after the
first (vLLM's definition; requests with one output token have none). Every time counts from the
request's *start*: its scheduled send time under a request rate, so a client that falls behind
its schedule shows up as latency instead of hiding it (the send lag is reported as well).

Statistics are over successful requests; failed ones are counted (`failed`, `errors`) and
otherwise left out. Percentiles interpolate linearly (numpy's default, as vLLM).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from llmopt.errors import LlmoptError

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# A send later than this behind its schedule counts as the load generator falling behind: well above
# asyncio's timer resolution (~1 ms) and small against any TTFT worth measuring.
LATE_SEND_S = 0.010


@dataclass
class RequestResult:
    """What one request measured; times in seconds from the request's start (see the module docstring)."""

    success: bool = False
    error: str = ""  # why it failed: "HTTP 500: ...", "stream broke off (RemoteProtocolError)", ...
    ttft: float = 0.0
    latency: float = 0.0  # end to end
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    token_source: str = ""  # "usage" (the server's count), "max_tokens" (finish_reason "length"), "tokenizer", "chunks"
    finish_reason: str | None = None
    max_tokens: int = 0  # what was asked for
    send_lag: float = 0.0  # actual send - scheduled send (only meaningful under a request rate)
    chunks: int = 0  # content chunks received
    text: str = ""  # generated text (counted by the tokenizer when the server gives no usage)


def parse_percentiles(text: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0]; each in (0, 100]."""
    try:
        values = [float(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise LlmoptError(f"--percentiles takes comma-separated numbers like 50,90,99; got {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise LlmoptError(f"--percentiles must be numbers in (0, 100], e.g. 50,90,99; got {text!r}")
    return values


def parse_goodput(items: list[str]) -> dict[str, float]:
    """vLLM's `--goodput ttft:500 tpot:50` (milliseconds) -> {"ttft": 500.0, "tpot": 50.0}.

    Items may also be joined by spaces or commas in one argument."""
    slos: dict[str, float] = {}
    for item in (part for text in items for part in re.split(r"[\s,]+", text) if part):
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise LlmoptError(f"--goodput takes METRIC:MS pairs with METRIC one of {', '.join(SLO_METRICS)} "
                              f"(e.g. ttft:500 tpot:50); got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise LlmoptError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0 or math.isinf(ms):
            raise LlmoptError(f"--goodput {item!r}: the limit must be a finite number of milliseconds >= 0")
        slos[name] = ms
    return slos


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def tpot_of(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                    goodput: dict[str, float] | None = None, cost_per_hour: float | None = None
                    ) -> dict[str, object]:
    """The figures of one load point: counts, throughputs over `duration` (seconds from the first
    scheduled send to the last finish), latency statistics in ms, goodput, send lag, errors."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    figures: dict[str, object] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
    }
    if goodput:
        good = sum(_meets(r, goodput) for r in ok)
        figures["good_completed"] = good
        figures["request_goodput"] = per_s(good)
    samples_ms = {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [t * 1e3 for r in ok if (t := tpot_of(r)) is not None],
        "itl": [gap * 1e3 for r in ok for gap in r.itl],
        "e2el": [r.latency * 1e3 for r in ok],
    }
    for name in LATENCY_METRICS:
        figures.update(_stats(name, samples_ms[name], percentiles))
    # did the load generator keep to its schedule? (how often, how far)
    lags = [r.send_lag for r in results]
    figures["late_sends"] = sum(lag > LATE_SEND_S for lag in lags)
    figures["mean_send_lag_ms"] = float(np.mean(lags)) * 1e3 if lags else None
    figures["max_send_lag_ms"] = max(lags) * 1e3 if lags else None
    figures["short_outputs"] = sum(r.output_tokens < r.max_tokens for r in ok)  # servers that ignore ignore_eos
    figures["token_counts_from"] = dict(sorted(Counter(r.token_source for r in ok).items()))
    figures["errors"] = dict(Counter(r.error for r in failed).most_common())
    if cost_per_hour is not None:
        out = figures["output_throughput"]
        figures["usd_per_million_output_tokens"] = cost_per_hour / 3600 / out * 1e6 if out else None
    return figures


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    """vLLM's goodput test: every given SLO met (a request without a TPOT counts as TPOT 0)."""
    values = {"ttft": r.ttft * 1e3, "tpot": (tpot_of(r) or 0.0) * 1e3, "e2el": r.latency * 1e3}
    return all(values[name] <= limit for name, limit in slos.items())


def _stats(name: str, values_ms: list[float], percentiles: list[float]) -> dict[str, float | None]:
    if not values_ms:  # nothing measured (every request failed, or one-token outputs for TPOT)
        stats = {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None}
        return stats | {f"{percentile_key(p)}_{name}_ms": None for p in percentiles}
    a = np.asarray(values_ms, dtype=np.float64)
    stats = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
             f"std_{name}_ms": float(a.std())}
    return stats | {f"{percentile_key(p)}_{name}_ms": float(np.percentile(a, p)) for p in percentiles}
