"""llama.cpp's own `llama-bench`: its command line and its JSON output (`-o json`).

llama-bench times prompt processing (a `-p N` test, "ppN": N prompt tokens in one batch) and token
generation (a `-n N` test, "tgN": N tokens one at a time after `-d D` tokens of context, "tgN @ dD")
separately, each `-r` times after one untimed warm-up run, and prints one JSON object per test with
its tokens/s samples. `bench latency --engines llama.cpp` runs it beside llmopt's runtime.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError


@dataclass(frozen=True)
class LlamaBenchTest:
    """One test of a llama-bench run, as its JSON reports it."""

    n_prompt: int
    n_gen: int
    n_depth: int
    n_threads: int
    samples_ts: list[float]  # tokens/s of each repetition
    avg_ts: float
    stddev_ts: float
    build: str  # "b1234 (abcdef0)"
    cpu_info: str
    backends: str
    model_type: str  # "llama ?B Q4_1"

    @property
    def name(self) -> str:
        """llama-bench's own name of the test: "pp512", "tg128", "tg128 @ d512"."""
        base = f"pp{self.n_prompt}" if self.n_gen == 0 else f"tg{self.n_gen}" if self.n_prompt == 0 \
            else f"pp{self.n_prompt}+tg{self.n_gen}"
        return base + (f" @ d{self.n_depth}" if self.n_depth else "")

    @property
    def median_ts(self) -> float:
        return statistics.median(self.samples_ts) if self.samples_ts else self.avg_ts


def llama_bench_command(binary: Path | str, model: Path | str, *, n_prompt: int, n_gen: int, threads: int,
                        repetitions: int, depth: int = 0, warmup: bool = True) -> list[str]:
    """The command line of one llama-bench run: a ppN test where n_prompt > 0 and a tgN test where
    n_gen > 0, both after `depth` tokens of context, at batch 1 on the CPU, JSON on stdout."""
    if n_prompt < 0 or n_gen < 0 or n_prompt + n_gen == 0:
        raise LlmoptError(f"llama-bench needs prompt or generated tokens (got -p {n_prompt} -n {n_gen})")
    command = [str(binary), "-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads),
               "-r", str(repetitions), "-o", "json"]
    if depth:
        command += ["-d", str(depth)]
    if not warmup:
        command.append("--no-warmup")
    return command


def parse_llama_bench_json(text: str) -> list[LlamaBenchTest]:
    """The tests of llama-bench's `-o json` output; LlmoptError when it is not that."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LlmoptError(f"llama-bench printed no JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(items, list):
        raise LlmoptError("llama-bench's JSON is not a list of tests")
    return [_test(item) for item in items]


def _test(item: Any) -> LlamaBenchTest:
    try:
        commit, number = item.get("build_commit", "?"), item.get("build_number", "?")
        return LlamaBenchTest(
            n_prompt=int(item["n_prompt"]), n_gen=int(item["n_gen"]), n_depth=int(item.get("n_depth", 0)),
            n_threads=int(item["n_threads"]), samples_ts=[float(x) for x in item.get("samples_ts", [])],
            avg_ts=float(item["avg_ts"]), stddev_ts=float(item.get("stddev_ts", 0.0)),
            build=f"b{number} ({commit})", cpu_info=str(item.get("cpu_info", "")),
            backends=str(item.get("backends", "")), model_type=str(item.get("model_type", "")))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise LlmoptError(f"llama-bench's JSON test lacks a figure: {type(exc).__name__}: {exc}") from None


def run_llama_bench(command: list[str], timeout: float = 1800.0) -> list[LlamaBenchTest]:
    """Run llama-bench; its tests, or LlmoptError saying how it failed (a crash names its signal)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LlmoptError(f"llama-bench ran past {timeout:.0f} s: {' '.join(command)}") from None
    except OSError as exc:
        raise LlmoptError(f"llama-bench could not start: {exc}") from None
    if done.returncode != 0:
        raise LlmoptError(f"llama-bench {exit_reason(done.returncode)}: {_last_line(done.stderr)}")
    return parse_llama_bench_json(done.stdout)


def exit_reason(returncode: int) -> str:
    """"exited with code 1", "crashed (SIGSEGV)"."""
    if returncode < 0:
        try:
            return f"crashed ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"
