"""The engines `llmopt bench throughput` runs one workload on, each in a process of its own.

- `hf`: transformers `generate`, one request at a time (the seeds' "naive serving"); by default on
  the first `hf_max_requests` requests only — its rate per token does not depend on how many.
- `hf-batch`: transformers `generate` on static padded batches of `hf_batch_size`.
- `llmopt`: llmopt's paged runtime (continuous batching), the model spec as given (fp32/fp16/bf16,
  an AWQ/GPTQ folder, a GGUF file).
- `llama.cpp`: llama-cpp-python on a GGUF file, one request at a time (its Python API has no
  batching across requests).
- `vllm`: vLLM's offline `LLM.generate`, where vLLM is installed.

Each runs in a fresh spawned process: a clean peak-memory figure per engine, no thread pools or
allocator state left behind by the engine before, and an engine that crashes (or is not
installed) is reported as skipped with its reason instead of ending the run. Every request is
greedy with EOS ignored and must produce exactly its `max_tokens`.
"""

from __future__ import annotations

import multiprocessing
import resource
from concurrent.futures import ProcessPoolExecutor
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from llmopt.bench.datasets import BenchRequest
from llmopt.options import option

T = TypeVar("T")
ENGINES = ("hf", "hf-batch", "llmopt", "llama.cpp", "vllm")


@dataclass
class PeerArgs:
    """Options of the peer engines a bench runs beside llmopt's."""

    gguf: Optional[str] = option(None, "llama.cpp: the GGUF file (default: the model's own).")
    threads: Optional[int] = option(None, "CPU threads per engine (default: torch's).", ge=1)


@dataclass
class EngineOptions:
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None  # with load_format "dummy": random packed int4 weights of this format
    engine_config: dict[str, Any] = field(default_factory=dict)  # llmopt's EngineConfig fields
    hf_batch_size: int = 16
    hf_max_requests: int | None = 8  # None: every request
    gguf: str | None = None  # llama.cpp's file; default: the spec itself if it is a .gguf, or the embedded file
    threads: int | None = None


@dataclass
class EngineResult:
    engine: str
    label: str = ""
    skipped: str | None = None  # the reason, when the engine did not run
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0
    load_s: float = 0.0
    peak_memory_gib: float = 0.0  # the process's peak RSS (CPU) or peak CUDA allocation (GPU)
    mean_ttft_ms: float | None = None  # llmopt: from each request's arrival (all at once) to its first token
    peak_kv_cache_gib: float | None = None  # llmopt: KV blocks in use at the peak
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    def figures(self) -> dict[str, Any]:
        """The JSON figures, under vLLM's bench key names where it has one."""
        d = {k: v for k, v in asdict(self).items() if k not in ("outputs", "elapsed_s")}
        if not self.skipped and self.elapsed_s > 0:
            d.update(elapsed_time=self.elapsed_s, request_throughput=self.num_requests / self.elapsed_s,
                     output_throughput=self.output_tokens / self.elapsed_s,
                     total_token_throughput=(self.prompt_tokens + self.output_tokens) / self.elapsed_s)
        return d


def device_name(name: str) -> str:
    """The device a `--device` value means here, as the name every engine's process is given ("auto" resolved
    once, in the parent, so that results say where the engines ran)."""
    from llmopt.core.device import resolve_device

    return str(resolve_device(name, make_current=False))


def on_this_machine(options: EngineOptions) -> EngineOptions:
    """`options` with the device resolved here (LlmoptError where this machine lacks it): a run's
    first step, after the checks that hold anywhere."""
    return replace(options, device=device_name(options.device))


def check_options(options: EngineOptions) -> None:
    """Refuse options every engine would fail on, before any process starts (LlmoptError)."""
    from llmopt.core.device import parse_device
    from llmopt.loader import resolve_dtype
    from llmopt.errors import LlmoptError

    # the device's name only: a recipe for a GPU is checked on any machine; running resolves it
    resolve_dtype(options.dtype, parse_device(options.device))
    if options.hf_batch_size < 1:
        raise LlmoptError(f"--hf-batch-size must be at least 1, got {options.hf_batch_size}")
    if options.hf_max_requests is not None and options.hf_max_requests < 0:
        raise LlmoptError(f"--hf-max-requests must be 0 (all) or more, got {options.hf_max_requests}")
    if options.threads is not None and options.threads < 1:
        raise LlmoptError(f"--threads must be at least 1, got {options.threads}")
    if options.gguf is not None and not (Path(options.gguf).is_file() and options.gguf.endswith(".gguf")):
        raise LlmoptError(f"--gguf {options.gguf}: not an existing .gguf file")


def isolated(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a freshly spawned process (fn and args must pickle)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def run_isolated(engine: str, spec: str, requests: list[BenchRequest], options: EngineOptions) -> EngineResult:
    """Run `engine` on `requests` in a spawned child process."""
    try:
        return isolated(run_engine, engine, spec, requests, options)
    except Exception as exc:  # the child died (a crash in native code) or its result could not come back
        return EngineResult(engine, skipped=f"the engine's process failed: {type(exc).__name__}: {exc}")


def run_engine(engine: str, spec: str, requests: list[BenchRequest], options: EngineOptions) -> EngineResult:
    """Run one engine in this process; a failure to load or run becomes a skipped result."""
    import torch

    if options.threads:
        torch.set_num_threads(options.threads)
    runner = _RUNNERS[engine]
    try:
        result = runner(spec, requests, options)
    except ImportError as exc:
        return EngineResult(engine, skipped=f"not installed ({exc.name or exc})")
    except Exception as exc:
        last = traceback.extract_tb(exc.__traceback__)[-1]
        return EngineResult(engine, skipped=f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]} "
                                            f"({Path(last.filename).name}:{last.lineno})")
    for request, output in zip(requests, result.outputs):
        if len(output) != request.max_tokens:
            return EngineResult(engine, skipped=f"produced {len(output)} tokens for a request of {request.max_tokens}")
    result.prompt_tokens = sum(len(r.prompt_token_ids) for r in requests[:result.num_requests])
    result.output_tokens = sum(len(o) for o in result.outputs)
    if options.device.startswith("cuda") and torch.cuda.is_available():
        result.peak_memory_gib = torch.cuda.max_memory_allocated() / 2**30
    else:
        result.peak_memory_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return result


def _timed(run: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    outputs = run()
    return outputs, time.perf_counter() - start


def _run_llmopt(spec: str, requests: list[BenchRequest], options: EngineOptions) -> EngineResult:
    from llmopt.loader import load
    from llmopt.runtime import SamplingParams
    from llmopt.runtime.llm import LLM

    start = time.perf_counter()
    loaded = load(spec, dtype=options.dtype, device=options.device, load_format=options.load_format,
                  quantization=options.quantization)
    llm = LLM(loaded, **options.engine_config)
    llm.generate([requests[0].prompt_token_ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.engine.kv.reset_prefix_cache()  # the warm-up request must not give the timed run a cached prefix
    load_s = time.perf_counter() - start
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    llm.engine.kv.peak_used_blocks = 0
    finished, elapsed = _timed(lambda: llm.generate([r.prompt_token_ids for r in requests], params))
    ttft = [o.metrics.time_to_first_token for o in finished]
    block_bytes = llm.engine.kv_cache_bytes / llm.engine.kv.num_blocks
    return EngineResult("llmopt", f"llmopt ({describe_weights(loaded)})", num_requests=len(requests),
                        elapsed_s=elapsed, load_s=load_s, outputs=[list(o.outputs[0].token_ids) for o in finished],
                        mean_ttft_ms=1e3 * sum(ttft) / len(ttft),
                        peak_kv_cache_gib=llm.engine.kv.peak_used_blocks * block_bytes / 2**30)


def describe_weights(loaded) -> str:
    """"awq w4 g64", "float32", "float32 from a Q4_1 GGUF"."""
    q, dtype = loaded.quantization, str(loaded.dtype).removeprefix("torch.")
    if q is None:
        return dtype
    if q.details.get("dequantized") or q.method == "gguf":
        return f"{dtype} from a {q.details.get('file_type', 'GGUF')} GGUF"
    return f"{q.method} w{q.bits} g{q.group_size if q.group_size and q.group_size > 0 else 'channel'}"


def _hf_model(spec: str, options: EngineOptions):
    from llmopt.bench.hf_baselines import load_hf_model
    from llmopt.core import resolve
    from llmopt.core.device import resolve_device
    from llmopt.loader import resolve_dtype

    folder = resolve(spec).path
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    model = load_hf_model(folder, dtype=dtype, device=str(device))
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) or 0
    return model, pad


def _run_hf(spec: str, requests: list[BenchRequest], options: EngineOptions) -> EngineResult:
    from llmopt.bench.hf_baselines import run_hf_sequential

    start = time.perf_counter()
    model, pad = _hf_model(spec, options)
    subset = requests[:options.hf_max_requests] if options.hf_max_requests else requests
    load_s = time.perf_counter() - start
    r = run_hf_sequential(model, subset, pad_token_id=pad)
    label = "transformers, one at a time" + (f" (first {len(subset)})" if len(subset) < len(requests) else "")
    return EngineResult("hf", label, num_requests=len(subset), elapsed_s=r.wall_s, load_s=load_s, outputs=r.outputs)


def _run_hf_batch(spec: str, requests: list[BenchRequest], options: EngineOptions) -> EngineResult:
    from llmopt.bench.hf_baselines import run_hf_static_batches

    start = time.perf_counter()
    model, pad = _hf_model(spec, options)
    load_s = time.perf_counter() - start
    r = run_hf_static_batches(model, requests, options.hf_batch_size, pad_token_id=pad)
    return EngineResult("hf-batch", f"transformers, static batches of {options.hf_batch_size}",
                        num_requests=len(requests), elapsed_s=r.wall_s, load_s=load_s, outputs=r.outputs)


def gguf_file(spec: str, options: EngineOptions) -> Path:
    """llama.cpp's file: --gguf, else the spec when it is a .gguf file, else the embedded model's GGUF."""
    from llmopt.core.embedded import default_gguf_path
    from llmopt.errors import LlmoptError

    if options.gguf:
        return Path(options.gguf)
    if spec.endswith(".gguf"):
        return Path(spec)
    if spec == "default":
        return default_gguf_path()
    raise LlmoptError(f"no GGUF file for {spec!r}: give --gguf FILE")


def _run_llama_cpp(spec: str, requests: list[BenchRequest], options: EngineOptions) -> EngineResult:
    import llama_cpp
    import torch

    path = gguf_file(spec, options)
    start = time.perf_counter()
    n_ctx = max(len(r.prompt_token_ids) + r.max_tokens for r in requests) + 8
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=options.threads or torch.get_num_threads(),
                          n_batch=512, verbose=False)
    load_s = time.perf_counter() - start

    def one(ids: list[int], n: int) -> list[int]:
        llm.reset()
        got: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # greedy; EOS ignored: we stop at n
            got.append(token)
            if len(got) == n:
                break
        return got

    one(requests[0].prompt_token_ids, 4)  # warm-up
    outs, elapsed = _timed(lambda: [one(r.prompt_token_ids, r.max_tokens) for r in requests])
    return EngineResult("llama.cpp", f"llama-cpp-python {llama_cpp.__version__}, {path.name}, one at a time",
                        num_requests=len(requests), elapsed_s=elapsed, load_s=load_s, outputs=outs)


def _run_vllm(spec: str, requests: list[BenchRequest], options: EngineOptions) -> EngineResult:
    import vllm

    from llmopt.core import resolve

    start = time.perf_counter()
    llm = vllm.LLM(model=str(resolve(spec).path), dtype=options.dtype, seed=0)
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [vllm.SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    outs, elapsed = _timed(lambda: [list(o.outputs[0].token_ids)
                                    for o in llm.generate(prompts, params, use_tqdm=False)])
    return EngineResult("vllm", f"vLLM {vllm.__version__}", num_requests=len(requests), elapsed_s=elapsed,
                        load_s=load_s, outputs=outs)


_RUNNERS: dict[str, Callable[[str, list[BenchRequest], EngineOptions], EngineResult]] = {
    "hf": _run_hf, "hf-batch": _run_hf_batch, "llmopt": _run_llmopt, "llama.cpp": _run_llama_cpp, "vllm": _run_vllm,
}
