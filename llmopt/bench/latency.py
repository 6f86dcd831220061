"""`llmopt bench latency`: prefill and decode latency at fixed batch sizes, beside the roofline.

For each batch size B, `num_iters` times (after `num_iters_warmup`): B prompts of random tokens,
`input_len` long (new ones every iteration, so nothing comes from the prefix cache), each
generating `output_len` tokens greedily with EOS ignored, all added at once. Measured per
iteration: prefill time (until every sequence has its first token), decode time per step (the
rest, over output_len - 1 steps) and the end-to-end time; reported as medians, with prompt
processing (pp) and token generation (tg) tokens/s as llama-bench names them. Engines: llmopt's
runtime (any B) and llama.cpp on a GGUF at B = 1: its own C++ `llama-bench` where built
(`scripts/build_llama_cpp.sh`, llmopt/bench/llama_cpp_bin.py), else llama-cpp-python's Python API.

llama-bench times its own loop, on llmopt's thread count and `num_iters` repetitions: its ppN
(`input_len` prompt tokens in one batch) and tgN (`output_len` tokens from an empty context), the
figures llama.cpp users quote, and tgN @ dN (`output_len` tokens after `input_len` of context: the
context llmopt's decode steps run at), each as a row of its own.

The roofline: bytes a decode step reads at the mean context (llmopt/bench/roofline.py) over the
measured read bandwidth gives the ideal tg tokens/s; achieved / ideal is the model bandwidth
utilisation (MBU). The bandwidth is probed just before and just after each row's measurement and the
row takes the higher of the two: on a shared machine the probe moved by up to 1.8x within a minute,
and one probe per command put some rows' MBU above 100%. Decode is bandwidth-bound: weights are read
once per step whatever B is, so tg tokens/s grows with B until the K/V reads or the arithmetic take over.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from llmopt.bench.datasets import make_workload
from llmopt.bench.engines import EngineOptions, on_this_machine, PeerArgs, check_options, gguf_file, isolated
from llmopt.bench.environment import collect_metadata
from llmopt.bench.results import results_document
from llmopt.errors import LlmoptError
from llmopt.options import group, option
from llmopt.runtime.engine_args import EngineArgs

LATENCY_ENGINES = ("llmopt", "llama.cpp")
# engine flags bench latency sets itself: room for the largest batch, fresh prompts, no length limit
LATENCY_FIXED_ENGINE_FLAGS = ("max_num_seqs", "max_model_len", "enable_prefix_caching")


@dataclass
class LatencyConfig:
    model: str = "default"
    engines: list[str] = field(default_factory=lambda: ["llmopt"])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    input_len: int = 128
    output_len: int = 128
    num_iters_warmup: int = 1
    num_iters: int = 3
    seed: int = 0
    options: EngineOptions = field(default_factory=EngineOptions)


@dataclass
class LatencyRequest:
    """`llmopt bench latency`'s options (a recipe's `bench.latency` plan)."""

    model: str = option("default", "'default', a model folder (AWQ/GPTQ too), a .gguf file or a hub id",
                        argument=True, recipe=None)
    engines: list[str] = option(help="llmopt and/or llama.cpp (batch 1).", comma=True,
                                default_factory=lambda: ["llmopt"])
    batch_size: list[int] = option(help="Comma-separated batch sizes, e.g. 1,8,32.", comma=True,
                                   default_factory=lambda: [1])
    input_len: int = option(128, "Prompt tokens per sequence.", ge=1)
    output_len: int = option(128, "Tokens generated per sequence (EOS ignored).", ge=1)
    num_iters_warmup: int = option(1, "Untimed iterations first.", ge=0)
    num_iters: int = option(3, "Timed iterations (the median is reported).", ge=1)
    seed: int = option(0, "Seed of the random prompts.", ge=0)
    peers: PeerArgs = group(PeerArgs)
    # the batch sizes set max_num_seqs; every sequence is input_len + output_len long, none shares a prefix
    engine: EngineArgs = group(EngineArgs, exclude=LATENCY_FIXED_ENGINE_FLAGS)

    def config(self) -> LatencyConfig:
        """The run's configuration; LlmoptError (exit 2) for a bad value."""
        e = self.engine
        engine = replace(e.engine_config(), max_num_seqs=max(self.batch_size, default=1), enable_prefix_caching=False)
        options = EngineOptions(dtype=e.dtype, device=e.device, load_format=e.load_format,
                                quantization=e.quantization, engine_config=asdict(engine),
                                gguf=self.peers.gguf, threads=self.peers.threads)
        return LatencyConfig(model=self.model, engines=list(self.engines), batch_sizes=list(self.batch_size),
                             input_len=self.input_len, output_len=self.output_len,
                             num_iters_warmup=self.num_iters_warmup, num_iters=self.num_iters, seed=self.seed,
                             options=options)


@dataclass
class Iteration:
    prefill_s: float
    decode_step_s: float
    e2e_s: float


def run_latency(config: LatencyConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every (engine, batch size) of `config`; the results document (kind "latency")."""
    from llmopt.bench.roofline import measure_read_bandwidth

    check_config(config)
    config = replace(config, options=on_this_machine(config.options))
    runs = []
    for engine in config.engines:
        sizes = config.batch_sizes if engine == "llmopt" else [1]
        binaries = _llama_bench_binaries() if engine == "llama.cpp" else None
        if progress:
            progress(f"{engine}: " + (f"llama-bench ({binaries.origin})" if binaries
                                      else f"batch sizes {', '.join(map(str, sizes))}"))
        if binaries is not None:
            runs += llama_bench_runs(config, binaries, lambda: measure_read_bandwidth(config.options.device))
        else:
            runs += isolated(_measure_engine, engine, config, sizes)
    probes = [p for run in runs for p in run.get("read_bandwidth_probes_gb_s", [])]
    config_dict = asdict(config)
    config_dict["read_bandwidth_gb_s"] = max(probes) if probes else measure_read_bandwidth(config.options.device) / 1e9
    return results_document("latency", collect_metadata(), config_dict, runs)


def bandwidth_line(document: dict[str, Any]) -> str:
    """What the rows' MBU divided by, for a table's caption."""
    probes = [p for run in document["runs"] for p in run.get("read_bandwidth_probes_gb_s", [])]
    if not probes:
        return f"measured read bandwidth {document['config']['read_bandwidth_gb_s']:.1f} GB/s"
    return (f"measured read bandwidth {min(probes):.1f}-{max(probes):.1f} GB/s (each row's MBU against the higher "
            "of the probes just before and after it)")


def check_config(config: LatencyConfig) -> None:
    """Refuse a configuration before anything runs (LlmoptError)."""
    check_options(config.options)
    unknown = [e for e in config.engines if e not in LATENCY_ENGINES]
    if unknown:
        raise LlmoptError(f"bench latency runs {' and '.join(LATENCY_ENGINES)}; not {unknown[0]!r}")
    if not config.batch_sizes or min(config.batch_sizes) < 1:
        raise LlmoptError("--batch-size needs sizes of at least 1")
    if config.input_len < 1 or config.output_len < 2:
        raise LlmoptError("--input-len must be at least 1 and --output-len at least 2 (decode needs a second token)")
    if config.num_iters < 1 or config.num_iters_warmup < 0:
        raise LlmoptError("--num-iters must be at least 1 and --num-iters-warmup at least 0")


def _measure_engine(engine: str, config: LatencyConfig, sizes: list[int]) -> list[dict[str, Any]]:
    import torch

    from llmopt.bench.roofline import measure_read_bandwidth

    if config.options.threads:
        torch.set_num_threads(config.options.threads)
    try:
        measure = _llmopt_measurer(config) if engine == "llmopt" else _llama_cpp_measurer(config)
    except ImportError as exc:
        return [{"label": engine, "engine": engine, "skipped": f"not installed ({exc.name or exc})"}]
    runs = []
    before = measure_read_bandwidth(config.options.device)
    for size in sizes:
        iterations = []
        for i in range(config.num_iters_warmup + config.num_iters):
            prompts = [r.prompt_token_ids for r in make_workload(measure.tokenizer, "random", size, config.input_len,
                                                                config.output_len, 0.0, config.seed * 1000 + i)]
            result = measure.iteration(prompts)
            if i >= config.num_iters_warmup:
                iterations.append(result)
        after = measure_read_bandwidth(config.options.device)
        runs.append(_figures(engine, measure, size, config, iterations, (before, after)))
        before = after  # the next size's probe before
    return runs


@dataclass
class _Measurer:
    label: str
    tokenizer: Any
    iteration: Callable[[list[list[int]]], Iteration]
    step_bytes: Callable[[int, int], int] | None = None  # (batch size, context) -> bytes per decode step
    # the SIMD path of llmopt's CPU kernels (avx2, avx512, amx; LLMOPT_CPU_ISA caps it): figures of one
    # path are not another's, so a run says which it took
    cpu_kernels: str | None = None


def _llmopt_measurer(config: LatencyConfig) -> _Measurer:
    from llmopt.bench.engines import describe_weights
    from llmopt.bench.roofline import decode_step_bytes
    from llmopt.kernels.cpu_extension import cpu_isa
    from llmopt.loader import load
    from llmopt.runtime import SamplingParams
    from llmopt.runtime.config import EngineConfig
    from llmopt.runtime.engine import LLMEngine

    opts = config.options
    loaded = load(config.model, dtype=opts.dtype, device=opts.device, load_format=opts.load_format,
                  quantization=opts.quantization)
    engine_config = dict(opts.engine_config, max_num_seqs=max(config.batch_sizes), enable_prefix_caching=False)
    engine = LLMEngine(loaded, EngineConfig(**engine_config))
    params = SamplingParams(max_tokens=config.output_len, temperature=0, ignore_eos=True)
    count = iter(range(1 << 62))

    def iteration(prompts: list[list[int]]) -> Iteration:
        for ids in prompts:
            engine.add_request(ids, params, request_id=f"latency-{next(count)}")
        started: set[str] = set()
        start = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                started.add(out.request_id)
            if first is None and len(started) == len(prompts):
                first = time.perf_counter()
        end = time.perf_counter()
        return Iteration(first - start, (end - first) / (config.output_len - 1), end - start)

    def step_bytes(batch: int, context: int) -> int:
        return decode_step_bytes(loaded.model, batch, context, engine.kv_cache_dtype)

    kernels = cpu_isa() if loaded.device.type == "cpu" else None
    return _Measurer(f"llmopt ({describe_weights(loaded)})", loaded.tokenizer, iteration, step_bytes, kernels)


def _llama_cpp_measurer(config: LatencyConfig) -> _Measurer:
    import llama_cpp
    import torch

    from llmopt.bench.roofline import gguf_decode_step_bytes
    from llmopt.core import load_tokenizer

    path = gguf_file(config.model, config.options)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=config.input_len + config.output_len + 8,
                          n_threads=config.options.threads or torch.get_num_threads(), n_batch=512, verbose=False)

    def iteration(prompts: list[list[int]]) -> Iteration:
        (ids,) = prompts
        llm.reset()
        start = time.perf_counter()
        first = None
        got = 0
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # greedy; EOS ignored: we stop at output_len
            got += 1
            if first is None:
                first = time.perf_counter()
            if got == config.output_len:
                break
        end = time.perf_counter()
        return Iteration(first - start, (end - first) / (config.output_len - 1), end - start)

    def step_bytes(batch: int, context: int) -> int:
        return gguf_decode_step_bytes(path, batch, context)

    return _Measurer(f"llama-cpp-python {llama_cpp.__version__}, {path.name}", load_tokenizer(config.model), iteration,
                     step_bytes)


def _figures(engine: str, measure: _Measurer, batch: int, config: LatencyConfig, iterations: list[Iteration],
             probes: tuple[float, float]) -> dict[str, Any]:
    prefill = statistics.median(i.prefill_s for i in iterations)
    step = statistics.median(i.decode_step_s for i in iterations)
    e2e = [i.e2e_s for i in iterations]
    run = {
        "label": f"{measure.label}, batch {batch}", "engine": engine, "batch_size": batch,
        "prefill_ms": prefill * 1e3, "decode_step_ms": step * 1e3,
        "avg_latency": statistics.mean(e2e), "median_latency": statistics.median(e2e),
        "pp_tok_s": batch * config.input_len / prefill, "tg_tok_s": batch / step,
        "iterations": [asdict(i) for i in iterations],
    }
    if measure.cpu_kernels is not None:
        run["cpu_kernels"] = measure.cpu_kernels
    if measure.step_bytes is not None:
        # the mean context over the decode steps
        _add_roofline(run, measure.step_bytes(batch, config.input_len + config.output_len // 2), probes)
    return run


def _add_roofline(run: dict[str, Any], step_bytes: int, probes: tuple[float, float]) -> None:
    """The roofline against the higher of the bandwidth probes (bytes/s) taken before and after the run."""
    bandwidth = max(probes)
    ideal = run["batch_size"] * bandwidth / step_bytes
    run.update(decode_step_bytes=step_bytes, ideal_tg_tok_s=ideal, mbu=run["tg_tok_s"] / ideal,
               read_bandwidth_gb_s=bandwidth / 1e9, read_bandwidth_probes_gb_s=[p / 1e9 for p in probes])


def _llama_bench_binaries():
    """llama.cpp's binaries where built for this CPU, else None (the engine is llama-cpp-python then)."""
    from llmopt.bench.llama_cpp_bin import find_binaries

    try:
        return find_binaries("llama-bench")
    except LlmoptError:
        return None


def _test(tests, kind: str):
    """The pp (prompt only) or tg (generation only) test of a llama-bench run."""
    for test in tests:
        if (test.n_gen == 0) if kind == "pp" else (test.n_prompt == 0):
            return test
    raise LlmoptError(f"llama-bench reported no {kind} test")


def llama_bench_runs(config: LatencyConfig, binaries, probe: Callable[[], float]) -> list[dict[str, Any]]:
    """llama-bench's ppN + tgN and its tgN @ dN on the model's GGUF at batch 1, as latency rows (one
    skipped row saying why where llama-bench fails, e.g. crashes). `probe()`: the read bandwidth now
    (bytes/s), taken before, between and after the two llama-bench runs."""
    import torch

    from llmopt.bench.llama_bench import llama_bench_command, run_llama_bench
    from llmopt.bench.roofline import gguf_decode_step_bytes

    path = gguf_file(config.model, config.options)
    threads = config.options.threads or torch.get_num_threads()  # what llmopt's engine process runs on
    common = dict(threads=threads, repetitions=config.num_iters, warmup=config.num_iters_warmup > 0)
    try:
        binary = binaries.path("llama-bench")
        commands = [llama_bench_command(binary, path, n_prompt=config.input_len, n_gen=config.output_len, **common),
                    llama_bench_command(binary, path, n_prompt=0, n_gen=config.output_len, depth=config.input_len,
                                        **common)]
        probes = [probe()]
        fresh = run_llama_bench(commands[0])
        probes.append(probe())
        deep = run_llama_bench(commands[1])
        probes.append(probe())
        pp, tg, tg_deep = _test(fresh, "pp"), _test(fresh, "tg"), _test(deep, "tg")
    except LlmoptError as exc:
        return [{"label": f"llama.cpp llama-bench ({binaries.origin})", "engine": "llama.cpp", "skipped": str(exc)}]
    label = f"llama.cpp llama-bench ({binaries.origin}), {path.name}, {threads} threads"
    common_run = {"engine": "llama.cpp", "batch_size": 1, "llama_bench_commands": [" ".join(c) for c in commands],
        "llama_cpp_build": pp.build, "llama_cpp_binaries": str(binaries.folder), "llama_cpp_note": binaries.note,
        "cpu_info": pp.cpu_info, "backends": pp.backends}
    runs = []
    for test, with_pp, context, around in ((tg, True, config.output_len // 2, probes[:2]),
                                           (tg_deep, False, config.input_len + config.output_len // 2, probes[1:])):
        run = {**common_run, "label": f"{label}: {pp.name + ', ' if with_pp else ''}{test.name}",
               "prefill_ms": 1e3 * pp.n_prompt / pp.median_ts if with_pp else None,
               "pp_tok_s": pp.median_ts if with_pp else None, "decode_step_ms": 1e3 / test.median_ts,
               "tg_tok_s": test.median_ts, "tests": [asdict(t) for t in ((pp, test) if with_pp else (test,))]}
        _add_roofline(run, gguf_decode_step_bytes(path, 1, context), tuple(around))
        runs.append(run)
    return runs


LATENCY_COLUMNS = ["engine, batch", "prefill (ms)", "pp tok/s", "decode step (ms)", "tg tok/s",
                   "bytes/step (MB)", "read GB/s", "roofline tg tok/s", "MBU"]


def latency_rows(document: dict[str, Any]) -> list[list[str]]:
    rows = []
    for run in document["runs"]:
        if run.get("skipped"):
            rows.append([run["label"], "skipped: " + run["skipped"]] + [""] * 7)
            continue
        roof = [f"{run['decode_step_bytes'] / 1e6:.1f}", f"{run['read_bandwidth_gb_s']:.1f}",
                f"{run['ideal_tg_tok_s']:.1f}", f"{run['mbu']:.0%}"] if "mbu" in run else ["-", "-", "-", "-"]
        pp = [f"{run['prefill_ms']:.1f}", f"{run['pp_tok_s']:.1f}"] if run.get("pp_tok_s") is not None else ["-", "-"]
        rows.append([run["label"], *pp, f"{run['decode_step_ms']:.2f}", f"{run['tg_tok_s']:.1f}", *roof])
    return rows
