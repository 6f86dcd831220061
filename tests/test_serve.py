"""A real `llmopt serve` process on a free port, driven by the openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from llmopt.loader import load
from llmopt.runtime import LLM, SamplingParams

openai = pytest.importorskip("openai")
KEY = "test-key"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, *flags: str, output=subprocess.PIPE) -> tuple[subprocess.Popen, str]:
    """`llmopt serve MODEL` on a free port; returns once /health answers."""
    from llmopt.kernels.cpu_extension import cpu_ops

    cpu_ops()  # build the C++ kernels here first (once per session cache, ~90 s), not inside the startup wait
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmopt", "serve", model, "--port", str(port), *flags],
                            stdout=output, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read() if proc.stdout else proc.returncode}")
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("server did not start in 60 s")


@contextlib.contextmanager
def served(model: str, *flags: str) -> Iterator[str]:
    """A module's server: `llmopt serve MODEL FLAGS` started, its base URL, stopped afterwards."""
    proc, base = start_server(model, *flags)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def openai_client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key)


@pytest.fixture(scope="module")
def server(tiny_models):
    with served(str(tiny_models["llama"]), "--served-model-name", MODEL, "--api-key", KEY,
                "--kv-cache-memory", "64MiB", "--max-model-len", "256", "--max-num-seqs", "8") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(server + path, content=raw if raw is not None else json.dumps(body), headers=headers, timeout=30)


MESSAGES = [{"role": "user", "content": "the cat sat on"}]


def test_greedy_chat_equals_llm_generate(client, tiny_models):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    expected = LLM(load(str(tiny_models["llama"]), dtype="float32"), num_kv_blocks=64).chat(
        MESSAGES, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens > 0


def test_streaming_chat_matches_non_streaming(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_n_prompts_and_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=["the cat", "in the"], n=2, max_tokens=5, temperature=0.8,
                                     seed=3, logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    for c in resp.choices:
        assert len(c.logprobs.tokens) == 5 and len(c.logprobs.token_logprobs) == 5
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        # top alternatives are keyed by text (OpenAI's format), so two ids with one text collapse
        for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
            assert 1 <= len(top) <= 3 and max(top.values()) >= lp - 1e-6
    assert resp.usage.completion_tokens == 20
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy picks the top token


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="the", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    piece = full[4:7]
    cut = client.completions.create(model=MODEL, prompt="the", max_tokens=16, temperature=0, stop=[piece],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(piece)]


def test_async_client_streaming_completions(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY)
        streams = [await aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True}) for p in ("a b", "c d", "e f")]
        texts = []
        for s in streams:
            texts.append("".join([c.choices[0].text async for c in s]))
        return texts

    texts = asyncio.run(main())
    assert len(texts) == 3 and all(texts)


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (None, 400, "not valid JSON"),
        ({"model": MODEL}, 400, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "unknown role"),
        ({"messages": MESSAGES, "n": 99}, 400, "n"),
        ({"messages": MESSAGES, "max_tokens": 10_000}, 400, "max_model_len"),
        ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "context"),
        ({"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ({"messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
        ({"messages": MESSAGES, "max_tokens": "ten"}, 400, "max_tokens"),
        ({"messages": MESSAGES, "model": "gpt-4"}, 404, "does not exist"),
        # known fields llmopt cannot honour are refused, named, rather than dropped
        # tools are served; `auto` needs --enable-auto-tool-choice, as in vLLM
        ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
         400, "--enable-auto-tool-choice"),
        ({"messages": MESSAGES, "logit_bias": {"5": 10}}, 400, "logit_bias"),
        ({"messages": MESSAGES, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
        ({"prompt": "the", "suffix": "end"}, 400, "suffix"),
        ({"prompt": "the", "best_of": 3}, 400, "best_of"),
        ({"prompt": "the", "guided_json": {"type": "object"}}, 400, "guided_json"),
        ({"messages": MESSAGES, "response_format": {"type": "yaml"}}, 400, "response_format type"),
        ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
         400, "invalid JSON schema: Invalid type: nope"),
        ({"prompt": "the", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, 400, "schema"),
        ({"prompt": "the", "max_tokens": -1}, 400, "max_tokens"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    path = "/v1/completions" if body and "prompt" in body else "/v1/chat/completions"
    resp = post(server, path, body, raw=b"{not json" if body is None else None)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert fragment in err["message"] and set(err) == {"message", "type", "param", "code"}
    if status == 400 and body and ("response_format" in body or "tools" in body or "suffix" in body):
        assert err["param"] in body


def test_harmless_values_of_unsupported_fields_are_accepted(client):
    resp = client.completions.create(model=MODEL, prompt="the", max_tokens=2, temperature=0, best_of=1,
                                     extra_body={"logit_bias": None, "tools": [], "user": "me", "some_new_field": 1})
    assert resp.choices[0].finish_reason in ("length", "stop")


def test_echo_logprobs_token_id_prompts_n_and_streaming(client, server, tiny_models):
    """Harness-style scoring: token-id prompts, several per request, n, echo + logprobs, max_tokens 0 and 1;
    the prompt positions carry the runtime's prompt logprobs (the first null), then the generated token."""
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    reference = LLM(load(str(tiny_models["llama"]), dtype="float32"), num_kv_blocks=64).generate(
        prompts, SamplingParams(max_tokens=0, prompt_logprobs=2))
    for max_tokens in (0, 1):
        resp = client.completions.create(model=MODEL, prompt=prompts, n=2, echo=True, logprobs=2, temperature=0,
                                         max_tokens=max_tokens)
        assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
        for c in resp.choices:
            ids, ref = prompts[c.index // 2], reference[c.index // 2].prompt_logprobs
            lp = c.logprobs
            assert len(lp.tokens) == len(ids) + max_tokens and lp.text_offset[0] == 0
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            for pos in range(1, len(ids)):
                assert lp.token_logprobs[pos] == pytest.approx(ref[pos][ids[pos]], abs=1e-5)
                assert max(lp.top_logprobs[pos].values()) == pytest.approx(max(ref[pos].values()), abs=1e-5)
            assert c.text.startswith(post(server, "/detokenize", {"tokens": ids}).json()["prompt"])
    # streamed: the echoed prompt with its logprobs first, then the generated tokens
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    whole = client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=1, max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True}).choices[0]
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    # vLLM's prompt_logprobs extra parameter: token id -> {logprob, decoded_token}
    extra = post(server, "/v1/completions", {"prompt": prompts[1], "max_tokens": 1, "prompt_logprobs": 0}).json()
    scores = extra["choices"][0]["prompt_logprobs"]
    assert scores[0] is None
    assert scores[1][str(prompts[1][1])]["logprob"] == pytest.approx(reference[1].prompt_logprobs[1][prompts[1][1]],
                                                                    abs=1e-5)


def test_invalid_utf8_huge_body_and_auth(server):
    assert post(server, "/v1/completions", None, raw=b'{"prompt": "\xff\xfe"}').status_code == 400
    huge = b'{"prompt": "' + b"a" * (50 * 1024 * 1024) + b'"}'
    assert post(server, "/v1/completions", None, raw=huge).status_code == 413
    assert post(server, "/v1/completions", {"prompt": "hi"}, key="wrong").status_code == 401
    assert httpx.get(server + "/v1/models").status_code == 401
    assert httpx.get(server + "/health").status_code == 200  # still serving


def test_tokenize_detokenize_models_version_metrics(server):
    ids = post(server, "/tokenize", {"prompt": "the cat"}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "the cat"
    models = httpx.get(server + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == MODEL
    assert "version" in httpx.get(server + "/version").json()
    text = httpx.get(server + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert f"llmopt:{name}" in text


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 6:
                break  # the client goes away
    for _ in range(100):
        metrics = httpx.get(server + "/metrics").text
        if 'llmopt:num_requests_running{model_name="tiny"} 0.0' in metrics:
            break
        time.sleep(0.05)
    assert 'llmopt:num_requests_running{model_name="tiny"} 0.0' in metrics
    assert 'llmopt:kv_cache_usage_perc{model_name="tiny"} 0.0' in metrics
    assert 'finished_reason="abort"' in metrics


def _aborted(metrics: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("llmopt:request_success_total{") and 'finished_reason="abort"' in line)


def test_concurrent_disconnects_free_everything(server):
    """Several clients hang up mid-stream at once (what scripts/load_test_serve.py's disconnect phase
    checked): every one is aborted, nothing stays running or waiting, the KV cache is empty."""
    clients = 6  # the fixture's --max-num-seqs is 8: all of them run at once
    before = _aborted(httpx.get(server + "/metrics").text)

    async def hang_up(client: httpx.AsyncClient, i: int) -> bool:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 200,
                "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True}
        async with client.stream("POST", server + "/v1/chat/completions", json=body, timeout=30,
                                 headers={"Authorization": f"Bearer {KEY}"}) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def all_hang_up() -> list[bool]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(hang_up(client, i) for i in range(clients)))

    assert all(asyncio.run(all_hang_up()))
    for _ in range(200):
        metrics = httpx.get(server + "/metrics").text
        if 'llmopt:num_requests_running{model_name="tiny"} 0.0' in metrics and _aborted(metrics) >= before + clients:
            break
        time.sleep(0.05)
    assert 'llmopt:num_requests_running{model_name="tiny"} 0.0' in metrics
    assert 'llmopt:num_requests_waiting{model_name="tiny"} 0.0' in metrics
    assert 'llmopt:kv_cache_usage_perc{model_name="tiny"} 0.0' in metrics
    assert _aborted(metrics) == before + clients


def test_vllm_engine_hands_over_flags(tiny_models, tmp_path):
    """With a `vllm` on PATH, `--engine vllm` execs `vllm serve` with the flags that mean the same."""
    fake = tmp_path / "vllm"
    record = tmp_path / "argv.json"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-m", "llmopt", "serve", str(tiny_models["llama"]), "--engine", "vllm",
                          "--max-num-seqs", "12", "--max-model-len", "128", "--gpu-memory-utilization", "0.5",
                          "--tensor-parallel-size", "2", "--quantization", "awq", "--served-model-name", "m",
                          "--port", "9999"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argv = json.loads(record.read_text())
    assert argv[:2] == ["serve", str(tiny_models["llama"])]
    pairs = dict(zip(argv[2::1], argv[3::1]))
    for flag, value in {"--max-num-seqs": "12", "--max-model-len": "128", "--gpu-memory-utilization": "0.5",
                        "--tensor-parallel-size": "2", "--quantization": "awq", "--served-model-name": "m",
                        "--port": "9999"}.items():
        assert pairs[flag] == value
    # without vLLM installed: a clear message, exit 2
    bare = {**os.environ, "PATH": str(tmp_path / "nothing")}
    out = subprocess.run([sys.executable, "-m", "llmopt", "serve", str(tiny_models["llama"]), "--engine", "vllm"],
                         env=bare, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "pip install vllm" in out.stderr


def test_sigterm_shuts_down_gracefully(tiny_models):
    """SIGTERM while a stream is in flight: the stream still completes, then the server exits."""
    proc, base = start_server(str(tiny_models["llama"]), "--kv-cache-memory", "32MiB", "--max-model-len", "256",
                              output=subprocess.DEVNULL)
    body = {"prompt": "the", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 2:
                    proc.send_signal(15)
    assert lines[-1] == "data: [DONE]"
    finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines[:-1]]
    assert finish[-1] == "length"
    # uvicorn re-raises the signal after its graceful shutdown, so the exit status is -15
    assert proc.wait(timeout=20) in (0, -15)
    with pytest.raises(httpx.TransportError):
        httpx.get(base + "/health", timeout=1)


def test_queue_limit_gives_503_and_logs_hide_prompts(tiny_models):
    proc, base = start_server(str(tiny_models["llama"]), "--kv-cache-memory", "32MiB", "--max-model-len", "256",
                              "--max-num-seqs", "1", "--max-queue", "1")
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"prompt": "secret words", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(client.post(base + "/v1/completions", json=body) for _ in range(8)))

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert 200 in codes and 503 in codes, codes
        busy = next(r for r in responses if r.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "server_busy"
    finally:
        proc.terminate()
        log = proc.communicate(timeout=20)[0]
    assert "request " in log and "prompt tokens" in log  # requests are logged ...
    assert "secret words" not in log  # ... without their prompts unless --log-requests


def test_ignored_fields_are_logged_once_per_name(tiny_models, caplog):
    from starlette.testclient import TestClient

    from llmopt.runtime.async_engine import AsyncLLM
    from llmopt.serve.app import ServeConfig, build_app

    engine = AsyncLLM.from_spec(load(str(tiny_models["llama"]), dtype="float32"), num_kv_blocks=64, max_model_len=128)
    body = {"prompt": "the cat", "max_tokens": 1, "user": "me", "my_extension": {"a": 1}}
    with TestClient(build_app(engine, ServeConfig(served_model_name=MODEL))) as http, caplog.at_level("WARNING"):
        for _ in range(3):
            assert http.post("/v1/completions", json=body).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "ignoring request field" in r.getMessage()]
    assert sorted(warnings) == sorted(f"ignoring request field {name!r}: llmopt serve does not use it "
                                      "(logged once per name)" for name in ("user", "my_extension"))


def test_in_process_app_fails_requests_on_engine_errors_and_stops_the_engine_thread(tiny_models):
    """A step that raises ends the HTTP request (500) instead of leaving it waiting, the engine
    serves the next request, and the app's lifespan stops the engine thread on shutdown."""
    from starlette.testclient import TestClient

    from llmopt.runtime.async_engine import AsyncLLM
    from llmopt.serve.app import ServeConfig, build_app

    engine = AsyncLLM.from_spec(load(str(tiny_models["llama"]), dtype="float32"), num_kv_blocks=64, max_model_len=128)
    real_step = engine.engine.step
    broken = True

    def step():
        if broken:
            raise RuntimeError("boom")
        return real_step()

    engine.engine.step = step
    body = {"prompt": "the cat", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(engine, ServeConfig(served_model_name=MODEL)), raise_server_exceptions=False) as http:
        assert http.post("/v1/completions", json=body).status_code == 500
        assert engine.stats().kv_cache_usage_perc == 0.0
        broken = False
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2
        assert engine._thread.is_alive()
    assert not engine._thread.is_alive()
