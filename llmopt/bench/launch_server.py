"""The server under test, launched as a subprocess (a running one is probed with `llmopt.openai_http.probe`).

`launched_server` starts `llmopt serve SPEC`, llama-cpp-python's own OpenAI server on a GGUF file
(`llama-cpp`), or llama.cpp's C++ `llama-server` on one (`llama-server`: `-np` slots decoded together
with continuous batching, from llmopt/bench/llama_cpp_bin.py's build) on a free local port, waits until
it answers (`/health` for llama-server, `/v1/models` for the others), and terminates it afterwards.
The bench talks to each only over HTTP.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from llmopt.errors import LlmoptError


LAUNCHERS = ("llmopt", "llama-cpp", "llama-server")
LLAMA_SERVER_SLOT_TOKENS = 2048  # llama-server's context per slot (-c is shared out over the -np slots)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(launcher: str, model: str, port: int, serve_args: list[str], parallel: int = 16,
                   threads: int | None = None) -> list[str]:
    """The command line that serves `model` on 127.0.0.1:`port`. llama-server gets `parallel` slots
    (`-np`), continuous batching (`-cb`), `threads` (default: torch's, as `llmopt serve` runs) and a
    context of LLAMA_SERVER_SLOT_TOKENS per slot; `serve_args` follow and override them."""
    if launcher == "llmopt":
        return [sys.executable, "-m", "llmopt", "serve", model, "--host", "127.0.0.1", "--port", str(port), *serve_args]
    if launcher == "llama-cpp":
        path = gguf_to_serve(launcher, model)
        # llama-cpp-python's server uses half the cores unless told; the context fits the bench's prompts
        args = serve_args or ["--n_threads", str(os.cpu_count() or 1), "--n_ctx", "2048"]
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1",
                "--port", str(port), *args]
    if launcher == "llama-server":
        from llmopt.bench.llama_cpp_bin import find_binaries

        path = gguf_to_serve(launcher, model)
        binary = find_binaries("llama-server").path("llama-server")
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        return [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel), "-cb",
                "-t", str(threads), "-c", str(parallel * LLAMA_SERVER_SLOT_TOKENS), *serve_args]
    raise LlmoptError(f"unknown --launch {launcher!r}; choose {', '.join(LAUNCHERS)}")


def gguf_to_serve(launcher: str, model: str) -> Path:
    """The .gguf file `--launch llama-cpp|llama-server` serves: 'default' is the embedded one."""
    from llmopt.core.embedded import default_gguf_path

    path = default_gguf_path() if model == "default" else Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise LlmoptError(f"--launch {launcher} serves a .gguf file; {model!r} is not one")
    return path


@contextmanager
def launched_server(launcher: str, model: str, serve_args: list[str], startup_timeout: float = 600.0,
                    parallel: int = 16) -> Iterator[str]:
    """Start the server, yield its base URL once it answers, terminate it on exit. Its output goes
    to a log file whose last line is quoted if it exits or never answers."""
    port = free_port()
    command = launch_command(launcher, model, port, serve_args, parallel)
    url = f"http://127.0.0.1:{port}"
    # llama-server answers /health with 503 while it loads the model and 200 once it serves
    ready = ("/health", True) if launcher == "llama-server" else ("/v1/models", False)
    with tempfile.NamedTemporaryFile("w+", prefix="llmopt-bench-server-", suffix=".log") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=os.environ.copy())
        try:
            _wait_ready(proc, url, log.name, startup_timeout, *ready)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, log_path: str, timeout: float, path: str, need_ok: bool) -> None:
    """Until GET `path` answers 200 (`need_ok`) or anything below 500 (LlmoptError if the process exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LlmoptError(f"the server exited with code {proc.returncode} before answering: "
                              f"{_last_line(log_path)} (command: {' '.join(proc.args)})")
        try:
            status = httpx.get(url + path, timeout=2).status_code
            if status == 200 or (status < 500 and not need_ok):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise LlmoptError(f"the server did not answer within {timeout:.0f} s (--server-timeout): {_last_line(log_path)}")


def _last_line(path: str) -> str:
    """The server's last line with words in it (rich/click error boxes end in a border line)."""
    lines = [line.strip(" \t│┃|╭╮╰╯─━") for line in Path(path).read_text(errors="replace").splitlines()]
    lines = [line for line in lines if any(ch.isalnum() for ch in line)]
    return lines[-1] if lines else "(no output)"
