"""`llmopt bench throughput`: one workload, several engines, side by side in one run.

Every engine gets the same requests (llmopt/bench/datasets.py), all submitted at once, greedy,
EOS ignored; each runs in a process of its own (llmopt/bench/engines.py). Reported per engine:
requests/s, output and total tokens/s, peak memory, load time, the ratio of output tokens/s to
the first engine's, and how many requests produced exactly the first engine's tokens (a check
that engines on the same weights compute the same thing; quantized engines differ by design).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from llmopt.bench.datasets import BenchRequest, WorkloadArgs, make_workload
from llmopt.bench.engines import ENGINES, EngineOptions, EngineResult, PeerArgs, check_options, on_this_machine, run_isolated
from llmopt.bench.environment import collect_metadata
from llmopt.bench.results import results_document
from llmopt.core import load_tokenizer
from llmopt.errors import LlmoptError
from llmopt.options import group, option
from llmopt.runtime.engine_args import EngineArgs


@dataclass
class ThroughputConfig:
    model: str = "default"
    engines: list[str] = field(default_factory=lambda: ["llmopt"])
    dataset: str = "chat"
    num_prompts: int = 32
    input_len: int = 128  # random dataset only
    output_len: int | None = 128
    range_ratio: float = 0.5
    prefix_len: int = 1000  # prefix-shared dataset only
    seed: int = 0
    options: EngineOptions = field(default_factory=EngineOptions)


@dataclass
class ThroughputRequest:
    """`llmopt bench throughput`'s options (a recipe's `bench.throughput` plan)."""

    model: str = option("default", "'default', a model folder (AWQ/GPTQ too), a .gguf file or a hub id",
                        argument=True, recipe=None)
    engines: list[str] = option(help="Comma-separated: hf, hf-batch, llmopt, llama.cpp, vllm.", comma=True,
                                default_factory=lambda: ["llmopt"])
    workload: WorkloadArgs = group(WorkloadArgs)
    hf_batch_size: int = option(16, "hf-batch: requests per static batch.", ge=1)
    hf_max_requests: int = option(8, "hf: time the first N requests (0: all).", ge=0)
    peers: PeerArgs = group(PeerArgs)
    engine: EngineArgs = group(EngineArgs)

    def config(self) -> ThroughputConfig:
        """The run's configuration; LlmoptError (exit 2) for a bad value."""
        e, w = self.engine, self.workload
        options = EngineOptions(dtype=e.dtype, device=e.device, load_format=e.load_format,
                                quantization=e.quantization, engine_config=asdict(e.engine_config()),
                                hf_batch_size=self.hf_batch_size, hf_max_requests=self.hf_max_requests or None,
                                gguf=self.peers.gguf, threads=self.peers.threads)
        return ThroughputConfig(model=self.model, engines=parse_engines(self.engines), dataset=w.dataset,
                                num_prompts=w.num_prompts, input_len=w.input_len, output_len=w.output_len or None,
                                range_ratio=w.range_ratio, prefix_len=w.prefix_len, seed=w.seed, options=options)


def parse_engines(engines: list[str] | str) -> list[str]:
    if isinstance(engines, str):
        engines = [e.strip() for e in engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise LlmoptError(f"unknown engine {unknown[0] if unknown else ','.join(engines)!r}; "
                          f"choose from {', '.join(ENGINES)}")
    if len(set(engines)) != len(engines):
        raise LlmoptError(f"an engine is listed twice in {','.join(engines)!r}")
    return list(engines)


def run_throughput(config: ThroughputConfig,
                   progress: Callable[[str, EngineResult | None], None] | None = None) -> dict[str, Any]:
    """Run every engine of `config` on one workload; the results document (llmopt/bench/results.py).

    `progress(engine, None)` is called as an engine starts and `progress(engine, result)` as it ends."""
    check_options(config.options)
    config = replace(config, options=on_this_machine(config.options))
    requests = make_workload(load_tokenizer(config.model), config.dataset, config.num_prompts, config.input_len,
                             config.output_len, config.range_ratio, config.seed, config.prefix_len)
    results: list[EngineResult] = []
    for engine in config.engines:
        if progress:
            progress(engine, None)
        result = run_isolated(engine, config.model, requests, config.options)
        results.append(result)
        if progress:
            progress(engine, result)
    return results_document("throughput", collect_metadata(), _config_dict(config, requests),
                            _runs(results, requests))


def _config_dict(config: ThroughputConfig, requests: list[BenchRequest]) -> dict[str, Any]:
    d = asdict(config)
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    output_lens = [r.max_tokens for r in requests]
    d["workload"] = {"requests": len(requests), "prompt_tokens": sum(prompt_lens), "output_tokens": sum(output_lens),
                     "prompt_len_min": min(prompt_lens), "prompt_len_max": max(prompt_lens),
                     "output_len_min": min(output_lens), "output_len_max": max(output_lens)}
    return d


def _runs(results: list[EngineResult], requests: list[BenchRequest]) -> list[dict[str, Any]]:
    ran = [r for r in results if not r.skipped]
    first = ran[0] if ran else None
    runs = []
    for r in results:
        run = r.figures()
        run["label"] = r.label or r.engine
        if first is not None and not r.skipped:
            run["output_throughput_vs_first"] = run["output_throughput"] / first.figures()["output_throughput"]
            common = min(len(r.outputs), len(first.outputs))
            run["same_tokens_as_first"] = [sum(a == b for a, b in zip(r.outputs, first.outputs)), common]
        runs.append(run)
    return runs


def table_rows(document: dict[str, Any]) -> list[list[str]]:
    """The side-by-side table: one row per engine (skipped ones with their reason)."""
    rows = []
    for run in document["runs"]:
        if run.get("skipped"):
            rows.append([run["label"], "skipped: " + run["skipped"]] + [""] * 8)
            continue
        same, common = run["same_tokens_as_first"]
        rows.append([run["label"], str(run["num_requests"]), str(run["output_tokens"]), f"{run['elapsed_time']:.1f}",
                     f"{run['request_throughput']:.2f}", f"{run['output_throughput']:.1f}",
                     f"{run['total_token_throughput']:.1f}", f"{run['peak_memory_gib']:.2f}",
                     f"{run['output_throughput_vs_first']:.2f}x", f"{same}/{common}"])
    return rows


TABLE_COLUMNS = ["engine", "requests", "output tokens", "time (s)", "requests/s", "output tok/s", "total tok/s",
                 "peak memory (GiB)", "vs first", "same tokens as first"]
