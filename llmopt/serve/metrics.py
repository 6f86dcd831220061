"""Prometheus metrics with vLLM's names under the `llmopt:` prefix.

Engine-wide figures (running, waiting, KV usage, prefix cache, preemptions, token
counts) are read from the engine at scrape time; per-request latencies are observed by
the server as requests finish.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmopt.runtime.engine_protocol import ServingEngine
from llmopt.runtime.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
disable_created_metrics()  # no `*_created` series: vLLM's dashboards do not expect them

ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector:
    def __init__(self, engine: ServingEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def _one(self, family: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str,
             value: float) -> GaugeMetricFamily | CounterMetricFamily:
        """`llmopt:{name}`: one series, labelled with the model's name."""
        metric = family(f"llmopt:{name}", doc, labels=["model_name"])
        metric.add_metric([self.model_name], value)
        return metric

    def collect(self):
        s = self.engine.stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for family, name, doc, value in (
            (gauge, "num_requests_running", "Requests being computed.", s.num_requests_running),
            (gauge, "num_requests_waiting", "Requests waiting to be scheduled.", s.num_requests_waiting),
            (gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_cache_usage_perc),
            (counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            (counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            (counter, "num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions),
            (counter, "prompt_tokens", "Prompt tokens processed.", s.prompt_tokens),
            (counter, "generation_tokens", "Tokens generated.", s.generation_tokens),
        ):
            yield self._one(family, name, doc, value)
        spec = getattr(s, "spec_decode", None)
        if spec:
            yield from self._spec_decode(spec)

    def _spec_decode(self, spec: dict):
        """vLLM's spec_decode counters, plus gauges for the warnings vLLM does not give."""
        for name, doc in (
            ("num_drafts", "Draft proposals verified."),
            ("num_draft_tokens", "Draft tokens proposed."),
            ("num_accepted_tokens", "Draft tokens accepted."),
            ("num_steps_disabled", "Engine steps without proposals (running batch above "
                                   "--speculative-disable-by-batch-size)."),
        ):
            yield self._one(CounterMetricFamily, f"spec_decode_{name}", doc, spec[name])
        per_pos = CounterMetricFamily("llmopt:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each proposal position.",
                                      labels=["model_name", "position"])
        for position, count in enumerate(spec["num_accepted_tokens_per_pos"]):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos
        for name, doc, value in (
            ("rolling_accepted_tokens_per_draft", "Mean accepted draft tokens per proposal over the latest "
             "proposals; below the warning threshold (0.5) the proposer slows decoding down.",
             spec["rolling_accepted_per_draft"]),
            ("disabled_by_batch_size", "1 while the running batch is too big to speculate.",
             float(spec["disabled_by_batch_size"])),
        ):
            yield self._one(GaugeMetricFamily, f"spec_decode_{name}", doc, value)


class ServerMetrics:
    def __init__(self, engine: ServingEngine, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]
        self.request_success = Counter("llmopt:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("llmopt:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("llmopt:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("llmopt:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("llmopt:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self._itl = self.itl.labels(model_name)  # observed per token: `labels()` is a locked lookup each call

    def observe_token_gap(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_aborted(self) -> None:
        self.request_success.labels(self.model_name, "abort").inc()

    def observe_finished(self, out: RequestOutput) -> None:
        m, name = out.metrics, self.model_name
        reason = out.outputs[0].finish_reason or "abort"
        self.request_success.labels(name, reason).inc()
        if m.time_to_first_token is not None:
            self.ttft.labels(name).observe(m.time_to_first_token)
        if m.queue_time is not None:
            self.queue.labels(name).observe(m.queue_time)
        if m.e2e_latency is not None:
            self.e2e.labels(name).observe(m.e2e_latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
