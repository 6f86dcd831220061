"""What a benchmark ran on: written into every results.json so runs compare honestly."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from llmopt import __version__


def collect_metadata() -> dict[str, Any]:
    """llmopt version and git commit, date, host CPU (model, cores, threads torch uses), RAM,
    GPU name and memory where CUDA is present, Python / torch / CUDA versions."""
    meta: dict[str, Any] = {
        "llmopt_version": __version__,
        "git_commit": _git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(_total_memory_bytes() / 2**30, 1),
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                       "count": torch.cuda.device_count()}
    return meta


def hardware_line(meta: dict[str, Any]) -> str:
    """One line for table captions: the GPU if any, else the CPU and its threads."""
    if meta.get("gpu"):
        return f"{meta['gpu']['name']} ({meta['gpu']['memory_gib']} GiB)"
    return f"{meta['cpu']} ({meta['torch_threads']} threads)"


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
