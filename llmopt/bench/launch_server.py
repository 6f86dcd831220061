"""The server under test, launched as a subprocess (a running one is probed with `llmopt.openai_http.probe`).

`launched_server` starts `llmopt serve SPEC` (or llama-cpp-python's own
OpenAI server on a GGUF file) on a free local port, waits until `/v1/models` answers, and
terminates it afterwards. The bench talks to either only over HTTP.
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


LAUNCHERS = ("llmopt", "llama-cpp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(launcher: str, model: str, port: int, serve_args: list[str]) -> list[str]:
    """The command line that serves `model` on 127.0.0.1:`port`."""
    if launcher == "llmopt":
        return [sys.executable, "-m", "llmopt", "serve", model, "--host", "127.0.0.1", "--port", str(port), *serve_args]
    if launcher == "llama-cpp":
        from llmopt.core.embedded import default_gguf_path

        path = default_gguf_path() if model == "default" else Path(model).expanduser()
        if path.suffix != ".gguf" or not path.is_file():
            raise LlmoptError(f"--launch llama-cpp serves a .gguf file; {model!r} is not one")
        # llama-cpp-python's server uses half the cores unless told; the context fits the bench's prompts
        args = serve_args or ["--n_threads", str(os.cpu_count() or 1), "--n_ctx", "2048"]
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1",
                "--port", str(port), *args]
    raise LlmoptError(f"unknown --launch {launcher!r}; choose {', '.join(LAUNCHERS)}")


@contextmanager
def launched_server(launcher: str, model: str, serve_args: list[str], startup_timeout: float = 600.0
                    ) -> Iterator[str]:
    """Start the server, yield its base URL once `/v1/models` answers, terminate it on exit.
    Its output goes to a log file whose last line is quoted if it exits or never answers."""
    port = free_port()
    command = launch_command(launcher, model, port, serve_args)
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="llmopt-bench-server-", suffix=".log") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=os.environ.copy())
        try:
            _wait_ready(proc, url, log.name, startup_timeout)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, log_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LlmoptError(f"the server exited with code {proc.returncode} before answering: "
                              f"{_last_line(log_path)} (command: {' '.join(proc.args)})")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code < 500:
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
