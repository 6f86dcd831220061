"""`llmopt bench serve` and `bench compare`: the load generator against a fake OpenAI server whose
every chunk goes out at a scripted time, the metrics on hand-made request results, reports and
plots, bad input, and one small run against a real `llmopt serve`.

Timing tolerance. The fake server sends chunk k of a request at arrival + TTFT + k x ITL, each
scheduled from the request's arrival (asyncio timers fire late, never early, so lateness does
not accumulate across chunks). The client timestamps each chunk when it parses it. Both ends
are event loops in one process on a shared 2-core machine (load average 7 when these were
written: one 67 ms stall of the client's loop was seen), so a measured time is the scripted
one plus a non-negative error: `late_ok` allows 1 ms early (clock reads) to LATE_MS = 40 ms
late on TTFT / latency figures. Gaps (ITL, TPOT) are differences of two such errors, mostly
cancelling: +/- GAP_MS = 5 ms. Rates: 10%. SLO limits and class gaps (50 vs 250 ms) are far
wider than that, so the counts (goodput, failures) are exact. The exact arithmetic of every
figure is checked separately on hand-made RequestResults (test_compute_metrics_exact).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmopt.bench.datasets import BenchRequest
from llmopt.bench.loadgen import Endpoint, run_load, send_offsets
from llmopt.bench.results import results_document, write_results
from llmopt.bench.online import ServeBenchConfig, parse_sweep, run_serve_bench
from llmopt.core import load_tokenizer
from llmopt.bench.online_metrics import LATE_SEND_S, RequestResult, compute_metrics, parse_goodput, parse_percentiles
from llmopt.errors import LlmoptError
from conftest import assert_usage_error, run_cli

LATE_MS, GAP_MS = 40.0, 5.0


def late_ok(measured: float, scripted: float, late: float = LATE_MS) -> bool:
    return scripted - 1.0 <= measured <= scripted + late


# ---------------------------------------------------------------- the fake server

@dataclass
class Plan:
    """What the fake server does with one request."""

    ttft: float = 0.05  # seconds from arrival to the first content chunk
    itl: float = 0.02  # between content chunks
    tokens: int = 6  # content chunks, one token each
    status: int = 200
    break_after: int | None = None  # chunks sent before the connection is cut (no end of body)
    done: bool = True  # send `data: [DONE]`
    usage: bool = True  # send the usage chunk when asked for
    text: str = " the"  # each chunk's text
    finish: str | None = None  # a last chunk with this finish_reason


class FakeOpenAIServer:
    """A streaming OpenAI server on plain asyncio in a thread: `plan(i, body)` decides request i."""

    def __init__(self, plan):
        self.plan = plan
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        arrival = time.perf_counter()
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        body = json.loads(await reader.readexactly(int(headers.get("content-length", 0)))) if method == "POST" else {}
        if method == "GET" and path == "/v1/models":
            await self._send_json(writer, 200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            return
        index = len(self.bodies)
        self.bodies.append(body)
        plan = self.plan(index, body)
        if plan.status != 200:
            await self._send_json(writer, plan.status, {"error": {"message": "scripted failure"}})
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                     b"connection: close\r\n\r\n")
        chat = path.endswith("/chat/completions")
        for k in range(plan.tokens):
            if plan.break_after is not None and k == plan.break_after:
                writer.transport.abort()  # cut mid-body: the chunked message never ends
                return
            await asyncio.sleep(max(0.0, arrival + plan.ttft + k * plan.itl - time.perf_counter()))
            choice = {"index": 0, "delta": {"content": plan.text}} if chat else {"index": 0, "text": plan.text}
            self._event(writer, {"choices": [choice]})
            await writer.drain()
        if plan.finish:
            delta = {"delta": {}} if chat else {"text": ""}
            self._event(writer, {"choices": [{"index": 0, **delta, "finish_reason": plan.finish}]})
        if plan.usage and (body.get("stream_options") or {}).get("include_usage"):
            self._event(writer, {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": plan.tokens,
                                                          "total_tokens": 10 + plan.tokens}})
        if plan.done:
            writer.write(_chunk(b"data: [DONE]\n\n"))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    @staticmethod
    def _event(writer, doc: dict) -> None:
        writer.write(_chunk(f"data: {json.dumps(doc)}\n\n".encode()))

    @staticmethod
    async def _send_json(writer, status: int, doc: dict) -> None:
        payload = json.dumps(doc).encode()
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
                     f"connection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        writer.close()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def fast_slow(index: int, body: dict) -> Plan:
    """Requests alternate: TTFT 50 ms, then 250 ms; 6 tokens 20 ms apart (e2e 150 / 350 ms, TPOT 20 ms)."""
    return Plan(ttft=0.05 if index % 2 == 0 else 0.25, itl=0.02, tokens=6)


def requests_of(n: int, max_tokens: int = 6) -> list[BenchRequest]:
    return [BenchRequest([1] * 7, max_tokens, prompt=f"prompt {i}") for i in range(n)]


# ---------------------------------------------------------------- metrics, exactly

def test_compute_metrics_exact():
    """Hand-made results: every figure equals the hand-computed value."""
    a = RequestResult(success=True, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.2], prompt_tokens=10, output_tokens=5,
                      token_source="usage", max_tokens=5)
    b = RequestResult(success=True, ttft=0.3, latency=0.6, itl=[0.3], prompt_tokens=20, output_tokens=2,
                      token_source="tokenizer", max_tokens=4, send_lag=0.05)
    c = RequestResult(success=True, ttft=0.2, latency=0.2, prompt_tokens=5, output_tokens=1, token_source="usage",
                      max_tokens=1)  # one token: no TPOT
    bad = RequestResult(error="HTTP 500: x", max_tokens=5)
    m = compute_metrics([a, b, c, bad], duration=2.0, percentiles=[50, 90, 99.9],
                        goodput={"ttft": 250, "tpot": 150}, cost_per_hour=3.6)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 35, 8)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(21.5)
    # TTFT ms [100, 300, 200]
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt((100**2 + 100**2 + 0) / 3))
    assert m["p50_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(280)  # linear: 200 + 0.8 x 100
    assert m["p99.9_ttft_ms"] == pytest.approx(299.8)
    # TPOT: a (500-100)/4 = 100, b (600-300)/1 = 300; c has none
    assert m["mean_tpot_ms"] == pytest.approx(200) and m["median_tpot_ms"] == pytest.approx(200)
    assert m["p90_tpot_ms"] == pytest.approx(280)
    # ITL ms [100, 100, 200, 300]
    assert m["mean_itl_ms"] == pytest.approx(175) and m["median_itl_ms"] == pytest.approx(150)
    assert m["p90_itl_ms"] == pytest.approx(270)  # 200 + 0.7 x 100
    # E2EL ms [500, 600, 200]
    assert m["mean_e2el_ms"] == pytest.approx(433.3333) and m["median_e2el_ms"] == pytest.approx(500)
    # goodput: a (ttft 100, tpot 100) ok; b ttft 300 too slow; c ttft 200, tpot counts as 0: ok
    assert m["good_completed"] == 2 and m["request_goodput"] == pytest.approx(1.0)
    assert m["usd_per_million_output_tokens"] == pytest.approx(3.6 / 3600 / 4.0 * 1e6)  # = 250
    assert m["late_sends"] == 1 and m["max_send_lag_ms"] == pytest.approx(50)
    assert m["short_outputs"] == 1  # b: 2 of 4
    assert m["token_counts_from"] == {"tokenizer": 1, "usage": 2}
    assert m["errors"] == {"HTTP 500: x": 1}


def test_compute_metrics_all_failed_has_no_latency():
    m = compute_metrics([RequestResult(error="stream ended without [DONE]")], 1.0, [99])
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] is None and m["p99_e2el_ms"] is None


def test_parsers():
    assert parse_percentiles("50, 90,99.9") == [50, 90, 99.9]
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500, "tpot": 50}
    assert parse_goodput(["ttft:500 e2el:2000,tpot:5"]) == {"ttft": 500, "e2el": 2000, "tpot": 5}
    assert parse_sweep("concurrency=1,4,16") == ("concurrency", [1, 4, 16])
    assert parse_sweep("rate=0.5,inf") == ("rate", [0.5, math.inf])
    for bad in ("0,50", "50,101", "x", ""):
        with pytest.raises(LlmoptError):
            parse_percentiles(bad)
    for bad in (["ttft"], ["foo:1"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(LlmoptError):
            parse_goodput(bad)
    for bad in ("concurrency=0", "concurrency=1.5", "rate=0", "rate=x", "batch=1", "concurrency="):
        with pytest.raises(LlmoptError):
            parse_sweep(bad)


def test_send_offsets_follow_the_rate():
    assert send_offsets(5, math.inf) == [0.0] * 5
    assert send_offsets(400, 10.0, seed=1) == send_offsets(400, 10.0, seed=1)  # same seed, same schedule
    for burstiness in (1.0, 0.25):
        offsets = send_offsets(4001, 10.0, burstiness, seed=3)
        gaps = [b - a for a, b in zip(offsets, offsets[1:])]
        assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
        assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.08)  # mean gap 1 / rate
        # gamma(k, theta): coefficient of variation 1 / sqrt(k): Poisson 1, burstier 2
        assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(burstiness ** -0.5, rel=0.1)


# ---------------------------------------------------------------- against the fake server

def test_metrics_against_scripted_server():
    """Concurrency 1, 8 requests alternating TTFT 50 / 250 ms, 6 tokens at 20 ms: known figures."""
    with FakeOpenAIServer(fast_slow) as server:
        endpoint = Endpoint(server.url, "chat", "fake-model")
        load = asyncio.run(run_load(endpoint, requests_of(8), max_concurrency=1))
        body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 6 and body["temperature"] == 0.0
    assert body["model"] == "fake-model" and body["messages"] == [{"role": "user", "content": "prompt 0"}]
    m = compute_metrics(load.results, load.duration, [50, 90], goodput={"ttft": 150, "e2el": 1000})
    assert (m["completed"], m["failed"], m["total_output_tokens"], m["total_input_tokens"]) == (8, 0, 48, 80)
    assert m["token_counts_from"] == {"usage": 8}
    assert load.max_concurrent_requests == 1
    ms = pytest.approx
    for key, scripted in (("mean_ttft_ms", 150), ("median_ttft_ms", 150), ("p90_ttft_ms", 250),
                          ("mean_e2el_ms", 250), ("median_e2el_ms", 250), ("p90_e2el_ms", 350)):
        assert late_ok(m[key], scripted), (key, m[key])
    assert m["std_ttft_ms"] == ms(100, abs=LATE_MS) and m["std_e2el_ms"] == ms(100, abs=LATE_MS)
    assert m["mean_tpot_ms"] == ms(20, abs=GAP_MS) and m["median_tpot_ms"] == ms(20, abs=GAP_MS)
    assert m["mean_itl_ms"] == ms(20, abs=GAP_MS) and m["median_itl_ms"] == ms(20, abs=GAP_MS)
    assert len([g for r in load.results for g in r.itl]) == 8 * 5
    # one request after another: the run lasts the sum of the latencies, 4 x 150 + 4 x 350 ms
    assert load.duration == ms(2.0, rel=0.1)
    assert m["request_throughput"] == ms(4.0, rel=0.1) and m["output_throughput"] == ms(24.0, rel=0.1)
    assert m["good_completed"] == 4  # exactly the fast half meets ttft <= 150 ms
    assert m["late_sends"] == 0 and m["errors"] == {}


def test_request_rate_counts_from_the_scheduled_time():
    """1000 req/s against a server that takes 50 ms each, one at a time: requests queue in the client;
    their TTFT counts from when they were due and the lag is reported."""
    with FakeOpenAIServer(lambda i, body: Plan(ttft=0.04, itl=0.01, tokens=2)) as server:
        endpoint = Endpoint(server.url, "completions", "fake-model")
        load = asyncio.run(run_load(endpoint, requests_of(4, 2), request_rate=1000.0, max_concurrency=1, seed=0))
        assert "prompt" in server.bodies[0] and "messages" not in server.bodies[0]
    offsets = send_offsets(4, 1000.0, seed=0)
    m = compute_metrics(load.results, load.duration, [50])
    ttfts = sorted(r.ttft * 1e3 for r in load.results)
    for k, ttft in enumerate(ttfts):  # request k waits for k earlier ones (50 ms each), minus its own offset
        assert late_ok(ttft, 50 * k + 40 - offsets[k] * 1e3, late=LATE_MS * (k + 1)), (k, ttft)
    # the 3 requests queued behind a 50 ms one go out late; the first one only by the machine's own
    # delay, which a loaded CI machine may push past the 10 ms "late" mark, so it is not counted on
    lags = sorted(r.send_lag for r in load.results)
    assert all(lag > LATE_SEND_S for lag in lags[1:]), lags
    assert m["late_sends"] == sum(lag > LATE_SEND_S for lag in lags) >= 3
    assert late_ok(m["max_send_lag_ms"], 150 - offsets[3] * 1e3, late=LATE_MS * 3)


def test_failures_are_counted_and_the_run_goes_on():
    kinds = [Plan(), Plan(status=500), Plan(break_after=2), Plan(done=False)]
    with FakeOpenAIServer(lambda i, body: kinds[i % 4]) as server:
        load = asyncio.run(run_load(Endpoint(server.url, "chat", "fake-model"), requests_of(12), max_concurrency=4))
    m = compute_metrics(load.results, load.duration, [50])
    assert m["completed"] == 3 and m["failed"] == 9
    assert m["errors"] == {"HTTP 500: {\"error\": {\"message\": \"scripted failure\"}}": 3,
                           "stream broke off (RemoteProtocolError)": 3, "stream ended without [DONE]": 3}
    assert m["total_output_tokens"] == 18 and late_ok(m["mean_ttft_ms"], 50)


def test_without_usage_tokens_are_counted_by_the_tokenizer(tiny_models):
    tokenizer = load_tokenizer(str(tiny_models["llama"]))
    assert len(tokenizer.encode(" the" * 5, add_special_tokens=False)) == 5
    with FakeOpenAIServer(lambda i, body: Plan(usage=False, tokens=5)) as server:
        endpoint = Endpoint(server.url, "chat", "fake-model")
        counted = asyncio.run(run_load(endpoint, requests_of(2), count_tokens=lambda t: len(
            tokenizer.encode(t, add_special_tokens=False))))
        chunks = asyncio.run(run_load(endpoint, requests_of(2)))
    assert [(r.output_tokens, r.token_source) for r in counted.results] == [(5, "tokenizer")] * 2
    assert [(r.output_tokens, r.token_source) for r in chunks.results] == [(5, "chunks")] * 2
    # finish_reason "length" means max_tokens were made, whatever the text re-encodes to (an emoji in
    # byte-fallback tokens arrives as fewer chunks and re-encodes to more tokens)
    with FakeOpenAIServer(lambda i, body: Plan(usage=False, tokens=3, text="🌱", finish="length")) as server:
        load = asyncio.run(run_load(Endpoint(server.url, "chat", "fake-model"), requests_of(2, max_tokens=8),
                                    count_tokens=lambda t: 99))
    assert [(r.output_tokens, r.token_source, r.finish_reason) for r in load.results] == \
        [(8, "max_tokens", "length")] * 2


def test_sweep_through_the_library(tiny_models):
    with FakeOpenAIServer(lambda i, body: Plan(ttft=0.03, itl=0.005, tokens=4)) as server:
        config = ServeBenchConfig(url=server.url + "/v1/", tokenizer=str(tiny_models["llama"]), num_prompts=6,
                                  output_len=4, sweep="concurrency=1,3", num_warmups=2)
        name, runs = run_serve_bench(config)
        assert len(server.bodies) == 2 + 6 + 6
    assert name == "fake-model"
    assert [r.figures["label"] for r in runs] == ["concurrency=1", "concurrency=3"]
    assert [r.figures["max_concurrent_requests"] for r in runs] == [1, 3]
    assert all(r.figures["completed"] == 6 and r.figures["total_output_tokens"] == 24 for r in runs)


# ---------------------------------------------------------------- the CLI, reports, compare

def _is_png(path: Path) -> bool:
    import matplotlib.image

    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(path).shape[0] > 100


def test_cli_sweep_writes_results_report_and_plots(tiny_models, tmp_path):
    plan = lambda i, body: Plan(ttft=0.03, itl=0.01, tokens=4) if i % 5 != 1 else Plan(break_after=1)  # noqa: E731
    with FakeOpenAIServer(plan) as server:
        code, err, out = run_cli("bench", "serve", "--url", server.url, "--tokenizer", str(tiny_models["llama"]),
                                 "--num-prompts", "8", "--output-len", "4", "--sweep", "concurrency=1,4",
                                 "--goodput", "ttft:500", "tpot:200", "--cost-per-hour", "2.5",
                                 "--percentiles", "50,99", "--output", str(tmp_path / "run"), "--save-detailed")
    assert code == 0, err + out
    assert "concurrency=1" in out and "goodput requests/s (ttft:500 tpot:200 ms)" in out
    assert "failed" in out and "stream broke off" in out  # the note on failures
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert doc["kind"] == "serve" and doc["config"]["goodput"] == {"ttft": 500.0, "tpot": 200.0}
    assert doc["metadata"]["served_model_name"] == "fake-model" and doc["config"]["api_key"] is None
    for run in doc["runs"]:
        assert run["completed"] + run["failed"] == 8 and run["failed"] >= 1
        assert run["request_goodput"] is not None and run["usd_per_million_output_tokens"] > 0
        assert {"p50_ttft_ms", "p99_itl_ms", "median_tpot_ms", "std_e2el_ms", "output_throughput",
                "total_token_throughput", "request_throughput", "ttfts", "itls"} <= run.keys()
    report = (tmp_path / "run" / "report.md").read_text()
    assert "| figure | concurrency=1 | concurrency=4 |" in report and "![pareto](pareto.png)" in report
    for name in ("throughput", "latency", "pareto", "ttft_distribution", "itl_distribution"):
        assert _is_png(tmp_path / "run" / f"{name}.png"), name
    assert not list((tmp_path / "run").glob(".*tmp*"))  # no temporary files left behind


def _document(throughput: float, ttft: float, kind: str = "serve") -> dict:
    runs = [{"label": "concurrency=4", "output_throughput": throughput, "mean_ttft_ms": ttft, "completed": 8,
             "errors": {}}]
    return results_document(kind, {"date": "d", "cpu": "cpu", "torch_threads": 2}, {"model": "m"}, runs)


def test_compare_two_results(tmp_path):
    write_results(tmp_path / "a", _document(100.0, 200.0))
    write_results(tmp_path / "b", _document(120.0, 150.0))
    code, err, out = run_cli("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b" / "results.json"),
                             "--markdown")
    assert code == 0, err
    assert "| run | figure | a | b | change b |" in out
    assert "| concurrency=4 | output_throughput | 100 | 120 | +20.0% |" in out
    assert "| concurrency=4 | mean_ttft_ms | 200 | 150 | -25.0% |" in out
    code, err, out = run_cli("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--metrics", "*ttft*")
    assert code == 0 and "mean_ttft_ms" in out and "output_throughput" not in out


def test_compare_bad_input(tmp_path):
    write_results(tmp_path / "a", _document(100.0, 200.0))
    write_results(tmp_path / "t", _document(100.0, 200.0, kind="throughput"))
    (tmp_path / "other.json").write_text('{"results": []}')
    (tmp_path / "broken.json").write_text("{")
    assert_usage_error(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "t")], "different kinds")
    assert_usage_error(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "other.json")],
                       "not an llmopt bench results file")
    assert_usage_error(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "broken.json")], "not a JSON")
    assert_usage_error(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "missing")], "no such results file")
    assert_usage_error(["bench", "compare", str(tmp_path / "a")], "at least two")


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_serve_bad_input(tmp_path):
    url = _closed_port_url()
    assert_usage_error(["bench", "serve", "--url", url], "cannot reach", url)
    assert_usage_error(["bench", "serve"], "--url", "--model")
    assert_usage_error(["bench", "serve", "--url", url, "--goodput", "ttft=5"], "--goodput")
    assert_usage_error(["bench", "serve", "--url", url, "--goodput", "ttft:5", "latency:3"], "--goodput")
    assert_usage_error(["bench", "serve", "--url", url, "stray"], "unexpected argument")
    assert_usage_error(["bench", "serve", "--url", url, "--sweep", "concurrency=0,4"], "--sweep")
    assert_usage_error(["bench", "serve", "--url", url, "--percentiles", "50,120"], "--percentiles")
    assert_usage_error(["bench", "serve", "--url", url, "--request-rate", "0"], "--request-rate")
    assert_usage_error(["bench", "serve", "--url", url, "--endpoint", "embeddings"], "--endpoint")
    assert_usage_error(["bench", "serve", "--url", "localhost:8000"], "http://")
    assert_usage_error(["bench", "serve", "--model", str(tmp_path / "x.txt"), "--launch", "llama-cpp"],
                       "--launch llama-cpp serves a .gguf file")
    assert_usage_error(["bench", "serve", "--model", "default", "--launch", "vllm"], "--launch")
    (tmp_path / "file").write_text("")
    assert_usage_error(["bench", "serve", "--url", url, "--output", str(tmp_path / "file" / "sub")], "--output")
    assert_usage_error(["bench", "serve", "--url", url, "--tokenizer", str(tmp_path / "nothing")], "cannot reach")


def test_a_launched_server_that_exits_is_one_line(tiny_models):
    assert_usage_error(["bench", "serve", "--model", str(tiny_models["llama"]), "--serve-args", "--no-such-flag",
                        "--num-prompts", "1"], "the server exited with code 2 before answering: No such option: --no-such-flag")


def test_failed_warmups_stop_the_run(tiny_models):
    with FakeOpenAIServer(lambda i, body: Plan(status=404)) as server:
        assert_usage_error(["bench", "serve", "--url", server.url, "--tokenizer", str(tiny_models["llama"]),
                            "--num-prompts", "2"], "every warm-up request", "HTTP 404")


def test_cli_json_output(tiny_models):
    with FakeOpenAIServer(lambda i, body: Plan(ttft=0.01, itl=0.005, tokens=3)) as server:
        code, err, out = run_cli("bench", "serve", "--url", server.url, "--tokenizer", str(tiny_models["llama"]),
                                 "--num-prompts", "3", "--output-len", "3", "--endpoint", "completions",
                                 "--request-rate", "50", "--burstiness", "0.5", "--json")
        assert all("prompt" in body for body in server.bodies)
    assert code == 0, err
    doc = json.loads(out)  # stdout holds only the document; the table went to stderr
    run = doc["runs"][0]
    assert run["label"] == "rate=50" and run["request_rate"] == 50.0 and run["burstiness"] == 0.5
    assert run["completed"] == 3 and "mean TTFT (ms)" in err


@pytest.mark.integration
def test_bench_serve_launches_llmopt_serve(tmp_path):
    """A tiny real run: `llmopt serve default` launched on a free port, 4 requests of 8 tokens."""
    from llmopt.kernels.cpu_extension import cpu_ops

    cpu_ops()  # build the C++ kernels here (once per cache), not inside the server's startup wait
    code, err, out = run_cli("bench", "serve", "--model", "default", "--num-prompts", "4", "--output-len", "8",
                             "--max-concurrency", "2", "--serve-args", "--kv-cache-memory 128MiB --max-num-seqs 4",
                             "--output", str(tmp_path / "real"))
    assert code == 0, err + out
    run = json.loads((tmp_path / "real" / "results.json").read_text())["runs"][0]
    assert run["label"] == "concurrency=2" and run["completed"] == 4 and run["failed"] == 0
    assert run["total_output_tokens"] == 32 and run["token_counts_from"] == {"usage": 4}
    assert run["short_outputs"] == 0 and 0 < run["mean_ttft_ms"] <= run["mean_e2el_ms"]
    assert run["mean_tpot_ms"] > 0 and run["output_throughput"] > 0


@pytest.mark.integration
def test_bench_serve_launches_llama_cpp_server(tmp_path):
    """llama-cpp-python's own server (a server llmopt did not write) on the embedded GGUF: it sends no
    usage (tokens counted by the tokenizer) and ignores ignore_eos; one request at a time completes."""
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server extras are not installed",
                        exc_type=ImportError)
    code, err, out = run_cli("bench", "serve", "--launch", "llama-cpp", "--model", "default", "--num-prompts", "2",
                             "--output-len", "8", "--max-concurrency", "1", "--output", str(tmp_path / "llamacpp"))
    assert code == 0, err + out
    doc = json.loads((tmp_path / "llamacpp" / "results.json").read_text())
    run = doc["runs"][0]
    assert doc["metadata"]["served_model_name"].endswith(".gguf")
    assert run["completed"] == 2 and run["mean_ttft_ms"] > 0
    # no usage from this server: max_tokens where it stopped for length, else the tokenizer's count
    sources = run["token_counts_from"]
    assert sum(sources.values()) == 2 and set(sources) <= {"max_tokens", "tokenizer"}, sources
