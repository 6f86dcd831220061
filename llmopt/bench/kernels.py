"""`llmopt bench kernels`: micro-benchmarks of llmopt's own kernels against the dense / PyTorch
paths they replace, on CUDA or CPU.

Kernels (`--kernels`): `int4_matmul` (`kernels_int4.py`) and `paged_decode`
(`kernels_decode.py`). Every call is timed on its own after a cache flush
(`kernel_timing.py`); figures are medians of `num_iters` calls after `num_iters_warmup`.
The run also measures the device's copy bandwidth (`dst.copy_(src)`, read + written bytes),
so each row's GB/s reads as a fraction of what memory can deliver.

Defaults depend on the device: CUDA runs the shapes that matter on a GPU (Llama-3-8B) at
M = 1..128, batches 8 and 32 at 4096 tokens, 50 timed calls; CPU the default model's
shapes at M = 1, 4, 16, 64, batches 8 and 32 at 256 tokens, 10 calls (under a minute on
two cores).

The results document: kind "kernels", one run per (problem, back end) (`KernelRun.as_dict`),
config with the device, the copy bandwidth and the dense GEMM rate (`gemm_tflops`).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from llmopt.bench.environment import collect_metadata
from llmopt.bench.kernel_run import KernelRun
from llmopt.bench.kernel_timing import CallTimer, copy_bandwidth, synchronize
from llmopt.bench.results import results_document
from llmopt.core.device import resolve_device
from llmopt.errors import LlmoptError

KERNELS = ("int4_matmul", "paged_decode")
CUDA_DEFAULTS = dict(rows=[1, 2, 4, 8, 16, 32, 64, 128], batches=[8, 32], context=4096, num_iters=50,
                     num_iters_warmup=5)
CPU_DEFAULTS = dict(rows=[1, 4, 16, 64], batches=[8, 32], context=256, num_iters=10, num_iters_warmup=2)
COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}


@dataclass
class KernelsConfig:
    """None: the device's default (CUDA_DEFAULTS / CPU_DEFAULTS)."""

    device: str = "auto"
    kernels: list[str] = field(default_factory=lambda: list(KERNELS))
    rows: list[int] | None = None
    batches: list[int] | None = None
    context: int | None = None
    num_iters: int | None = None
    num_iters_warmup: int | None = None
    threads: int | None = None


def parse_ints(text: str, option: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; LlmoptError naming `option` for anything but positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise LlmoptError(f"{option} takes comma-separated positive integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise LlmoptError(f"{option} takes comma-separated positive integers, not {text!r}")
    return values


def parse_kernels(text: str) -> list[str]:
    names = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in names if k not in KERNELS]
    if unknown or not names:
        raise LlmoptError(f"--kernels takes {', '.join(KERNELS)}; not {(unknown or [text])[0]!r}")
    return names


def resolve(config: KernelsConfig) -> tuple[torch.device, KernelsConfig]:
    """The device and the config with every default filled in; LlmoptError for bad values."""
    device = resolve_device(config.device)
    defaults = CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    filled = KernelsConfig(**{k: (defaults[k] if v is None and k in defaults else v)
                              for k, v in asdict(config).items()})
    filled.device = str(device)
    for option, values in (("--rows", filled.rows), ("--batch", filled.batches)):
        if not values or min(values) < 1:
            raise LlmoptError(f"{option} needs values of at least 1")
    if filled.context < 1 or filled.num_iters < 1 or filled.num_iters_warmup < 0:
        raise LlmoptError("--context and --num-iters must be at least 1, --num-iters-warmup at least 0")
    if filled.threads is not None and filled.threads < 1:
        raise LlmoptError("--threads must be at least 1")
    unknown = [k for k in filled.kernels if k not in KERNELS]
    if unknown:
        raise LlmoptError(f"--kernels takes {', '.join(KERNELS)}; not {unknown[0]!r}")
    return device, filled


def gemm_tflops(device: torch.device, iters: int = 5) -> float:
    """The dense matmul rate the device reaches on a large square problem (fp16 on CUDA, fp32 on CPU)."""
    n, dtype = (8192, torch.float16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = CallTimer(device, warmup=1, iters=iters, flush=False).median_call_s(lambda: a @ b)
    return 2 * n ** 3 / seconds / 1e12


def run_kernels(config: KernelsConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every kernel of `config`; the results document (kind "kernels")."""
    from llmopt.bench.kernels_decode import bench_decode_cpu, bench_decode_cuda
    from llmopt.bench.kernels_int4 import bench_int4_cpu, bench_int4_cuda

    device, config = resolve(config)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    say = progress or (lambda text: None)
    say("measuring copy bandwidth")
    copy_gb_s = copy_bandwidth(device, COPY_BYTES[device.type]) / 1e9
    say("measuring the dense GEMM rate")
    tflops = gemm_tflops(device)
    timer = CallTimer(device, config.num_iters_warmup, config.num_iters)
    cuda = device.type == "cuda"
    runs: list[KernelRun] = []
    with torch.inference_mode():
        if "int4_matmul" in config.kernels:
            say(f"int4 matmul at M = {', '.join(map(str, config.rows))}")
            runs += (bench_int4_cuda if cuda else bench_int4_cpu)(timer, config.rows, copy_gb_s)
        if "paged_decode" in config.kernels:
            say(f"paged decode attention, batch {', '.join(map(str, config.batches))} x {config.context} tokens")
            runs += (bench_decode_cuda if cuda else bench_decode_cpu)(timer, config.batches, config.context, copy_gb_s)
    synchronize(device)
    config_dict = asdict(config)
    config_dict.update(copy_bandwidth_gb_s=copy_gb_s, gemm_tflops=tflops, torch_threads=torch.get_num_threads(),
                       flush_bytes=0 if timer.flush_buffer is None else timer.flush_buffer.numel())
    return results_document("kernels", collect_metadata(), config_dict, [r.as_dict() for r in runs])


TABLE_COLUMNS = ["problem", "back end", "time us", "GB/s", "of copy BW", "speedup", "max abs diff", "rel diff"]
KERNEL_TITLES = {"int4_matmul": "int4 matmul", "paged_decode": "paged decode attention (one layer)"}


def table_rows(document: dict[str, Any], kernel: str) -> list[list[str]]:
    """Formatted rows of one kernel's runs (skipped back ends show why)."""
    rows = []
    for run in document["runs"]:
        if run["kernel"] != kernel:
            continue
        if run.get("skipped"):
            rows.append([run["problem"], run["backend"], f"skipped: {run['skipped']}", "", "", "", "", ""])
            continue
        rows.append([run["problem"], run["backend"], _num(run["time_us"], 1), _num(run["gb_s"], 1),
                     _percent(run["fraction_of_copy_bw"]), _times(run["speedup"]), _sci(run["max_abs_diff"]),
                     _sci(run["rel_diff"])])
    return rows


def summary(document: dict[str, Any], kernel: str) -> str:
    """One line on a kernel's runs: median speedup of each back end over the baseline."""
    by_backend: dict[str, list[float]] = {}
    for run in document["runs"]:
        if run["kernel"] == kernel and run.get("speedup") is not None and not run["baseline"]:
            by_backend.setdefault(run["backend"].split(" (")[0], []).append(run["speedup"])
    return ", ".join(f"{name}: median {statistics.median(v):.2f}x" for name, v in by_backend.items())


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"
