#!/usr/bin/env python
"""Load test for `llmopt serve`: N concurrent streaming chat clients against one server.

Starts `llmopt serve MODEL` on a free local port (or uses --url), sends --clients
streaming chat requests at once, and reports errors, streams that ended without
`data: [DONE]`, TTFT / inter-token latency percentiles and output throughput. Then
--disconnects clients start streams and hang up after a few chunks; the script polls
`/metrics` until running requests and KV usage are back at zero (or says they are not).
With --sequential N, N requests run one after another (concurrency 1) instead.
--server llama-cpp starts llama-cpp-python's own OpenAI server on a GGUF file (--model,
default: the embedded Q4_1 file) for the same load; output tok/s then counts streamed
chunks (one token each), as it does for llmopt. Traffic goes to 127.0.0.1 only. Usage:
    python scripts/load_test_serve.py [--model default] [--clients 64] [--max-tokens 64]
    python scripts/load_test_serve.py --model AWQ_DIR --sequential 8 --disconnects 0
    python scripts/load_test_serve.py --server llama-cpp --sequential 8 --disconnects 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
             "Explain rain to a child.", "Give me a tip for sleeping well.", "What is 12 times 12?",
             "Describe a cat in one sentence.", "Why do leaves change colour?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_client(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, temperature: float) -> dict:
    body = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": i, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    token_times: list[float] = []
    done = False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    token_times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}
    end = time.perf_counter()
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"error": None, "done": done, "ttft": token_times[0] - start if token_times else None,
            "itl": itl, "chunks": len(token_times), "latency": end - start}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def hang_up(client: httpx.AsyncClient, url: str, i: int) -> bool:
    """Start a long stream, read a few chunks, disconnect. True if it got that far."""
    body = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "max_tokens": 1000,
            "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                return True
    return False


def gauge(metrics: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(f"llmopt:{name}{{"))


async def disconnect_phase(url: str, n: int) -> None:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as client:
        reached = await asyncio.gather(*(hang_up(client, url, i) for i in range(n)))
        start = time.perf_counter()
        running = kv = float("nan")
        while time.perf_counter() - start < 30:
            metrics = (await client.get(url + "/metrics")).text
            running, kv = gauge(metrics, "num_requests_running"), gauge(metrics, "kv_cache_usage_perc")
            if running == 0 and kv == 0:
                break
            await asyncio.sleep(0.1)
        aborted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("llmopt:request_success_total") and 'finished_reason="abort"' in line)
    print(f"\n{n} clients hung up mid-stream ({sum(reached)} after 3 chunks): after "
          f"{time.perf_counter() - start:.1f} s /metrics shows num_requests_running={running:g}, "
          f"kv_cache_usage_perc={kv:g}, request_success{{finished_reason=\"abort\"}}={aborted:g}")


async def run(url: str, clients: int, max_tokens: int, disconnects: int, sequential: int, temperature: float) -> None:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        await one_client(client, url, 0, 4, temperature)  # warm-up (first request pays one-off costs)
        start = time.perf_counter()
        if sequential:
            results = [await one_client(client, url, i, max_tokens, temperature) for i in range(sequential)]
            clients = 1
        else:
            results = await asyncio.gather(*(one_client(client, url, i, max_tokens, temperature) for i in range(clients)))
        wall = time.perf_counter() - start
        response = await client.get(url + "/metrics")
        metrics = response.text if response.status_code == 200 else ""
    errors = [r["error"] for r in results if r["error"]]
    ok = [r for r in results if not r["error"]]
    unfinished = sum(not r["done"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    gen = sum(r["chunks"] for r in ok)  # one token per streamed chunk (both servers)
    print("| clients | requests | errors | streams without [DONE] | wall (s) | output tok/s | TTFT p50 / p99 (s) | "
          "ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {clients} | {len(results)} | {len(errors)} | {unfinished} | {wall:.1f} | {gen / wall:.1f} | "
          f"{pct(ttft, .5):.2f} / {pct(ttft, .99):.2f} | {pct(itl, .5) * 1e3:.1f} / {pct(itl, .99) * 1e3:.1f} |")
    if errors:
        print("errors:", sorted(set(errors)))
    itl_mean = statistics.mean(itl) if itl else float("nan")
    print(f"\nITL mean {itl_mean * 1e3:.2f} ms; mean chunks per stream: {statistics.mean(r['chunks'] for r in ok):.1f} (max_tokens {max_tokens})")
    if disconnects:
        await disconnect_phase(url, disconnects)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--url", default=None, help="an already running server")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--disconnects", type=int, default=32)
    ap.add_argument("--sequential", type=int, default=0, help="N requests one after another instead of --clients")
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    ap.add_argument("--server", choices=["llmopt", "llama-cpp"], default="llmopt")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-cpp server threads")
    args = ap.parse_args()
    if args.sequential < 0 or args.clients < 1 or args.max_tokens < 2:
        ap.error("--sequential must be >= 0, --clients >= 1, --max-tokens >= 2")
    if args.server == "llama-cpp" and args.disconnects:
        ap.error("--disconnects reads llmopt's /metrics; use --disconnects 0 with --server llama-cpp")
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if args.server == "llama-cpp":
            from llmopt.core.embedded import default_gguf_path

            gguf = str(default_gguf_path()) if args.model == "default" else args.model
            command = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                       "--n_threads", str(args.threads), "--n_ctx", "2048"]
        else:
            command = [sys.executable, "-m", "llmopt", "serve", args.model, "--port", str(port),
                       "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", "1GiB"]
        proc = subprocess.Popen(command, env=os.environ.copy())
        for _ in range(600):
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
    try:
        asyncio.run(run(url, args.clients, args.max_tokens, args.disconnects, args.sequential, args.temperature))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
