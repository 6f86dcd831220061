"""llmopt's CPU kernels (C++, `csrc/`), compiled once per machine on first use.

One Python module:
- `paged_decode`: fp32 decode attention straight from the paged KV pool
  (`cpu_paged_attention.py` wraps it; the runtime's decode steps use it).
- `skinny_linear`: `x @ w.T` for a few rows of x (decode batches), which MKL's GEMM handles
  poorly (`cpu_linear.py`; `DenseLinear` uses it).
- `int4_linear`: 4-bit AWQ / GPTQ weights times fp32 activations (`cpu_int4.py`;
  `CpuInt4Linear` in llmopt/model/int4_linear.py uses it).
- `fp8_linear`: FP8 e4m3 weights (a scale per output row) times fp32 activations
  (`cpu_fp8.py`; `Fp8Linear` in llmopt/model/fp8_linear.py uses it).
- `DecodePlan`: every decoder layer of a decode step in one call, through the kernels
  above (`llmopt/runtime/cpu_decode_plan.py` builds it from the model).
- `rms_norm`, `add_rms_norm`, `rotary_embedding_`, `silu_and_mul`: the small per-layer ops
  fused (`cpu_fused.py`; the decoder in `llmopt/model/llama.py` uses them).
- `fake_quant_error`: the error of group-wise integer rounding of a weight, scaled and clipped
  as AWQ's searches try it, in one pass (`cpu_fake_quant.py`; llmopt/quant/awq.py uses it).
- `cpu_isa`, `cpu_isa_supported`, `set_cpu_isa`: the SIMD path the kernels take, chosen at
  run time from what the build and the CPU have (`csrc/isa.h`), capped by `LLMOPT_CPU_ISA`.

They are built with `torch.utils.cpp_extension.load` (g++ and ninja) into
`$LLMOPT_CACHE/torch_extensions/<hash>/`, the hash covering the CPU model and flags (the
code is compiled with `-march=native` and must not move to another CPU), the torch version
and the sources. Where the build fails (no compiler), or with `LLMOPT_CPU_KERNELS=0`,
`cpu_ops()` returns None and every caller keeps its PyTorch path, which is also the
reference the tests compare the kernels against.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

log = logging.getLogger("llmopt.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("bindings.cpp", "paged_decode.cpp", "skinny_linear.cpp", "fused_ops.cpp",
                                     "int4_linear.cpp", "decode_plan.cpp", "fp8_linear.cpp", "fake_quant.cpp",
                                     "prefill_attention.cpp")]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


@functools.cache
def _digest() -> str:
    """Hash of what the compiled code depends on: CPU model and flags, torch, flags, sources."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
        model = next((line for line in info.splitlines() if line.startswith("model name")), "")
    except OSError:
        flags = model = ""
    import torch

    digest = hashlib.sha256(f"{model}|{flags}|{torch.__version__}|{CFLAGS}".encode())
    for source in sorted(p for p in CSRC.iterdir() if p.is_file()):  # .cpp files and the headers they include
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:16]


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` wheel (a dependency) sits in the venv's bin
    folder, which is not on PATH when `.venv/bin/llmopt` runs without activating the venv."""
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass  # the build then fails with a clear message and the PyTorch paths are used


def _cache_root() -> Path:
    """llmopt's cache folder (`LLMOPT_CACHE`, as `llmopt.core.embedded.cache_root` reads it):
    read from the environment here, since `kernels/` imports nothing of llmopt."""
    return Path(os.environ.get("LLMOPT_CACHE") or Path.home() / ".cache" / "llmopt")


def _sources_in(folder: Path) -> list[Path]:
    """The sources, copied into the build folder (under its flock): ninja's build file names
    source paths, so two checkouts of the same code (a venv and a clone, git worktrees) building
    from their own paths would rebuild everything in turn; the folder's digest already pins the
    content, so one copy serves them all."""
    src = folder / "src"
    if not src.is_dir():
        staging = folder / f"src.tmp{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(CSRC, staging)
        staging.rename(src)
    return [src / path.name for path in SOURCES]


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled kernels module (built or loaded once per process), or None where it cannot
    be built (then use PyTorch)."""
    if os.environ.get("LLMOPT_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        folder = _cache_root() / "torch_extensions" / _digest()
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.glob("*.so")):
            log.info("building llmopt's CPU kernels (once per machine, ~50 s) in %s", folder)
        # torch's own build lock is a plain file: a process killed while holding it (a server
        # stopped during start-up) leaves it behind and every later process waits on it forever.
        # An flock is released by the kernel when its holder dies; holding it, no live llmopt
        # process can be inside torch's lock, so a leftover one is stale and removed.
        with open(folder / "llmopt-build.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
            sources = _sources_in(folder)
            ops = load(name="llmopt_cpu_ops", sources=[str(s) for s in sources], extra_cflags=CFLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
        requested = os.environ.get("LLMOPT_CPU_ISA")
        if requested and requested not in ("scalar", "avx2", "avx512", "amx"):
            log.warning("LLMOPT_CPU_ISA=%s is not one of scalar, avx2, avx512, amx: ignored", requested)
        log.info("llmopt's CPU kernels: %s path (this CPU and build allow %s; LLMOPT_CPU_ISA caps it)",
                 ops.cpu_isa(), ops.cpu_isa_supported())
        return ops
    except Exception as exc:  # no compiler, no ninja, a build error: the PyTorch paths still work
        log.warning("llmopt's CPU kernels unavailable (%s); using the PyTorch paths",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def kernels_identity() -> str | None:
    """What the CPU kernels' numerics depend on (sources, flags, CPU, torch), or None when
    they are not in use: caches of computed scores include it in their keys."""
    ops = cpu_ops()
    return None if ops is None else f"{_digest()}-{ops.cpu_isa()}"


def cpu_isa() -> str | None:
    """The SIMD path the CPU kernels take now (`scalar`, `avx2`, `avx512`, `amx`), or None
    when they are not in use."""
    ops = cpu_ops()
    return None if ops is None else ops.cpu_isa()
