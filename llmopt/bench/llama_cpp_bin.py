"""llama.cpp's own C++ binaries (`llama-bench`, `llama-server`), the peers `bench latency` and
`bench serve --launch llama-server` run.

`scripts/build_llama_cpp.sh` builds them from the llama.cpp that llama-cpp-python vendors, for the
CPU at hand (`GGML_NATIVE=ON`), into `$LLMOPT_CACHE/llama.cpp/<version>-<cpu digest>/`: one folder per
variant (`native`, and `native-noamx` where the native build's AMX path crashes), `bin` a link to the
one that ran its pp512 check, and `chosen.txt` one line saying which and why. The digest covers the
CPU model and flags, since `-march=native` code must not move to another CPU.

Where the binaries are looked for, first found wins: `$LLMOPT_LLAMA_CPP_BIN` (a folder, e.g. a
user's own llama.cpp build), that cache folder (the newest version built for this CPU), `PATH`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from llmopt.core.embedded import cache_root
from llmopt.errors import LlmoptError

BUILD_SCRIPT = "scripts/build_llama_cpp.sh"


@functools.cache
def cpu_digest() -> str:
    """12 hex digits of the CPU model and flags lines of /proc/cpuinfo (the build script calls this)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return hashlib.sha256(f"{model}|{flags}".encode()).hexdigest()[:12]


def build_folder(version: str) -> Path:
    """Where the build script puts llama.cpp `version` (llama-cpp-python's version) for this CPU."""
    return cache_root() / "llama.cpp" / f"{version}-{cpu_digest()}"


@dataclass(frozen=True)
class LlamaCppBinaries:
    folder: Path
    origin: str  # "0.3.36 native-noamx" (the cache folder's version and variant), "$LLMOPT_LLAMA_CPP_BIN", "PATH"
    note: str = ""  # the cache folder's chosen.txt: the variant and why

    def path(self, name: str) -> Path:
        """The binary `name` in this folder; LlmoptError when it is not there."""
        path = self.folder / name
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LlmoptError(f"{name} is not in {self.folder} ({self.origin}): run `bash {BUILD_SCRIPT}`")
        return path


def _version_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in name.rsplit("-", 1)[0].split("."))


def cached_binaries() -> LlamaCppBinaries | None:
    """The newest build for this CPU in the cache folder, or None."""
    root = cache_root() / "llama.cpp"
    digest = cpu_digest()
    builds = sorted((p for p in root.glob(f"*-{digest}") if (p / "bin" / "llama-bench").is_file()),
                    key=lambda p: _version_key(p.name), reverse=True) if root.is_dir() else []
    if not builds:
        return None
    folder = builds[0]
    chosen = folder / "chosen.txt"
    note = chosen.read_text().strip() if chosen.is_file() else ""
    variant = (folder / "bin").resolve().parent.name
    return LlamaCppBinaries(folder / "bin", f"{folder.name.rsplit('-', 1)[0]} {variant}", note)


def find_binaries(name: str = "llama-bench") -> LlamaCppBinaries:
    """Where llama.cpp's binaries are (see the module docstring); LlmoptError (exit 2) when nowhere."""
    override = os.environ.get("LLMOPT_LLAMA_CPP_BIN")
    if override:
        return LlamaCppBinaries(Path(override).expanduser(), "$LLMOPT_LLAMA_CPP_BIN")
    cached = cached_binaries()
    if cached is not None:
        return cached
    found = shutil.which(name)
    if found:
        return LlamaCppBinaries(Path(found).parent, "PATH")
    raise LlmoptError(f"llama.cpp's {name} is not built for this CPU: run `bash {BUILD_SCRIPT}` "
                      f"(minutes), or point LLMOPT_LLAMA_CPP_BIN at a folder holding it")
