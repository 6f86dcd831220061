"""The server under test: probe a URL before any load, or launch one as a subprocess.

`probe` fails fast (LlmoptError, one line) when nothing answers, and reads the served model's
name from `/v1/models`. `launched_server` starts `llmopt serve SPEC` (or llama-cpp-python's own
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


def base_url(url: str) -> str:
    """'http://h:p/v1/' -> 'http://h:p': the endpoints are added to this."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise LlmoptError(f"--url must start with http:// or https://, got {url!r}")
    return url.removesuffix("/v1")


def probe(url: str, api_key: str | None = None, served_model_name: str | None = None, timeout: float = 10.0) -> str:
    """The model name to send: `served_model_name`, else the first id `/v1/models` lists.
    Raises LlmoptError when the server cannot be reached or refuses us."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise LlmoptError(f"cannot reach {url}/v1/models: {type(exc).__name__}: {exc or 'no answer'}") from None
    if response.status_code in (401, 403):
        raise LlmoptError(f"{url}/v1/models answered HTTP {response.status_code}: pass the server's key with --api-key")
    if served_model_name:
        return served_model_name
    try:
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise LlmoptError(f"{url}/v1/models (HTTP {response.status_code}) lists no model: "
                          "give --served-model-name") from None


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
