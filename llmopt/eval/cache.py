"""The baseline cache: a baseline's scores, computed once, reused by every candidate gated against it.

Entries live under `$LLMOPT_CACHE/eval/` and are keyed by the sha256 of everything the
scores depend on: the model's files (path, config.json, and every file's name, size and
mtime, so a checkpoint rewritten in place misses), dtype and device, the CPU kernels in use
(their sources and build: they round differently from PyTorch's ops), the data (a hash of the
text or questions) and the task's settings, plus `CACHE_VERSION` (bumped when what we
compute changes). A key never says *which* inputs changed; a miss simply recomputes.

Two kinds of entry, both written atomically (a reader sees a whole entry or none):
- `<key>.json`: per-item results (MMLU log-likelihoods, HumanEval samples and verdicts).
- `<key>/`: a folder of .npy arrays plus meta.json (perplexity/KLD: per-token NLL, and for
  KLD the baseline's float16 final hidden states, hidden_size x 2 bytes per scored token,
  and its dense float16 vocabulary projection: 59 MiB for the default model at 4,080
  tokens; see kld.py).

Nothing evicts entries; delete the folder to reclaim the space (`--no-cache` skips it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from llmopt.core.atomic import atomic_dir, atomic_file
from llmopt.core.embedded import cache_root
from llmopt.core.source import ModelSource
from llmopt.kernels.cpu_extension import kernels_identity
from llmopt.kernels.cpu_linear import uses_bf16

CACHE_VERSION = 3  # 2: the C++ CPU kernels changed fp32 rounding; 3: llama.cpp windowing, hidden-state KLD store


def cache_dir() -> Path:
    return cache_root() / "eval"


def model_identity(source: ModelSource, dtype: str, device: str, fp32_matmul_precision: str = "auto") -> dict[str, Any]:
    """What a model's scores depend on, without reading its weights (`fp32_matmul_precision`: the engine flag,
    stored as what it resolves to on this CPU)."""
    path = Path(source.path).resolve()
    entries = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    files = []
    for p in entries:
        st = p.stat()
        files.append([p.name, st.st_size, st.st_mtime_ns])
    on_cpu = str(device).startswith("cpu")
    kernels = kernels_identity() if on_cpu else None
    matmul = "bf16" if on_cpu and uses_bf16(fp32_matmul_precision) else "ieee"
    return {"path": str(path), "config": source.raw_config, "files": files, "dtype": dtype, "device": device,
            "cpu_kernels": kernels, "fp32_matmul": matmul}


def make_key(*parts: Any) -> str:
    blob = json.dumps([CACHE_VERSION, *parts], sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:40]


def read_json(key: str) -> dict[str, Any] | None:
    path = cache_dir() / f"{key}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def write_json(key: str, data: dict[str, Any]) -> Path:
    path = cache_dir() / f"{key}.json"
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data), encoding="utf-8")
    return path


def array_dir(key: str) -> Path:
    return cache_dir() / key


def read_arrays(key: str, names: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """meta.json and the named arrays (memory-mapped) of a folder entry, or None if any is missing."""
    folder = array_dir(key)
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        return meta, {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in names}
    except (OSError, ValueError, json.JSONDecodeError):
        return None


@contextmanager
def new_entry(key: str) -> Iterator[Path]:
    """A folder to fill with .npy arrays and meta.json; it becomes the entry only if the block succeeds."""
    # markers=None: every folder under the cache is llmopt's own (a broken entry is replaced too)
    with atomic_dir(array_dir(key), overwrite=True, markers=None) as tmp:
        yield tmp
