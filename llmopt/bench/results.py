"""The results file every `llmopt bench` command writes, and reading it back.

`results.json`: {"llmopt_bench": 1, "kind": "throughput" | "latency" | "serve" | "kernels", "metadata":
environment.collect_metadata(), "config": the full configuration, "runs": [{"label": ..., figures
under vLLM's key names (output_throughput, mean_ttft_ms, p99_itl_ms, ...)}, ...]}. One run per
engine (throughput), batch size (latency), load point (serve) or (problem, back end) (kernels).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llmopt.core.atomic import atomic_file
from llmopt.errors import LlmoptError

FORMAT_VERSION = 1
KINDS = ("throughput", "latency", "serve", "kernels")


def results_document(kind: str, metadata: dict[str, Any], config: dict[str, Any],
                     runs: list[dict[str, Any]]) -> dict[str, Any]:
    if kind not in KINDS:
        raise ValueError(f"unknown results kind {kind!r}")
    return {"llmopt_bench": FORMAT_VERSION, "kind": kind, "metadata": metadata, "config": config, "runs": runs}


def prepare_output_dir(output_dir: Path) -> None:
    """Create `output_dir` now, so a folder that cannot be written is found out before a run, not after it."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LlmoptError(f"--output {output_dir}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(output_dir, os.W_OK):
        raise LlmoptError(f"--output {output_dir}: the folder is not writable")


def write_results(output_dir: Path, document: dict[str, Any]) -> Path:
    """`output_dir/results.json`, written atomically (never half a file)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "results.json"
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def load_results(path: Path) -> dict[str, Any]:
    """A results.json written by `llmopt bench` (or its folder); LlmoptError naming what is wrong otherwise."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LlmoptError(f"{path}: no such results file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LlmoptError(f"{path}: not a JSON results file ({exc})") from None
    if not isinstance(document, dict) or document.get("llmopt_bench") != FORMAT_VERSION \
            or document.get("kind") not in KINDS or not isinstance(document.get("runs"), list):
        raise LlmoptError(f"{path}: not an llmopt bench results file (written by `llmopt bench ... --output DIR`)")
    return document
