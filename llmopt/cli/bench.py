"""`llmopt bench`: throughput (engines side by side, offline), latency (with a roofline),
serve (an online load generator for any OpenAI-compatible endpoint), kernels (micro-benchmarks
of llmopt's own kernels) and compare (results files)."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from llmopt.cli.common import console, err_console, handles_errors, print_json
from llmopt.cli.engine_args import EngineArgs, engine_options

app = typer.Typer(help="Benchmarks: engines side by side, online load, latency, kernels, comparisons.",
                  no_args_is_help=True)

DATASET = typer.Option("chat", "--dataset", help="chat, prefix-shared, random, or a ShareGPT .json / .jsonl file.")
NUM_PROMPTS = typer.Option(32, "--num-prompts", help="Requests in the workload.")
INPUT_LEN = typer.Option(128, "--input-len", help="Prompt tokens (random dataset).")
OUTPUT_LEN = typer.Option(128, "--output-len", help="Output tokens per request (EOS ignored); 0: a file's own.")
RANGE_RATIO = typer.Option(0.5, "--range-ratio", help="Lengths uniform in L x [1 - r, 1 + r].")
PREFIX_LEN = typer.Option(1000, "--prefix-len", help="Shared system prompt tokens (prefix-shared dataset).")
SEED = typer.Option(0, "--seed", help="Workload seed: the same seed, the same requests.")
OUTPUT_DIR = typer.Option(None, "--output", "-o", help="Write results.json, report.md and plots into this folder.")
JSON_OUT = typer.Option(False, "--json", help="Print the results document as JSON on stdout.")
THREADS = typer.Option(None, "--threads", help="CPU threads per engine (default: torch's).")


def _wide_console() -> Console:
    """Tables of ten columns wrap badly at a pipe's default 80 columns; a terminal keeps its own width."""
    return console if console.is_terminal else Console(width=200)


def _table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


@handles_errors
@engine_options()
def throughput(
    model: str = typer.Argument("default", help="'default', a model folder (AWQ/GPTQ too), a .gguf file or a hub id"),
    engines: str = typer.Option("llmopt", "--engines", help="Comma-separated: hf, hf-batch, llmopt, llama.cpp, vllm."),
    dataset: str = DATASET,
    num_prompts: int = NUM_PROMPTS,
    input_len: int = INPUT_LEN,
    output_len: int = OUTPUT_LEN,
    range_ratio: float = RANGE_RATIO,
    prefix_len: int = PREFIX_LEN,
    seed: int = SEED,
    hf_batch_size: int = typer.Option(16, "--hf-batch-size", help="hf-batch: requests per static batch."),
    hf_max_requests: int = typer.Option(8, "--hf-max-requests", help="hf: time the first N requests (0: all)."),
    gguf: str | None = typer.Option(None, "--gguf", help="llama.cpp: the GGUF file (default: the model's own)."),
    threads: int | None = THREADS,
    output: Path | None = OUTPUT_DIR,
    json_out: bool = JSON_OUT,
    engine_args: EngineArgs = EngineArgs(),
) -> None:
    """Offline throughput: one workload through several engines, side by side, in one run."""
    from llmopt.bench.engines import EngineOptions
    from llmopt.bench.offline_report import write_throughput_report
    from llmopt.bench.results import prepare_output_dir
    from llmopt.bench.throughput import TABLE_COLUMNS, ThroughputConfig, parse_engines, run_throughput, table_rows

    config = engine_args.engine_config()
    options = EngineOptions(dtype=engine_args.dtype, device=engine_args.device, engine_config=asdict(config),
                            hf_batch_size=hf_batch_size,
                            hf_max_requests=hf_max_requests or None, gguf=gguf, threads=threads)
    if output is not None:
        prepare_output_dir(output)
    bench = ThroughputConfig(model=model, engines=parse_engines(engines), dataset=dataset, num_prompts=num_prompts,
                             input_len=input_len, output_len=output_len or None, range_ratio=range_ratio,
                             prefix_len=prefix_len, seed=seed, options=options)
    with err_console.status("") as status:
        def progress(engine, result):
            if result is None:
                status.update(f"bench throughput: {engine} running ...")
            else:
                err_console.print(f"{engine}: " + (f"skipped ({result.skipped})" if result.skipped
                                                   else f"{result.output_tokens / result.elapsed_s:.1f} output tok/s"))

        document = run_throughput(bench, progress)
    if output is not None:
        write_throughput_report(output, document)
    if json_out:
        print_json(document)
        return
    w = document["config"]["workload"]
    _wide_console().print(_table(
        f"{w['requests']} requests ({bench.dataset}), prompts {w['prompt_len_min']}-{w['prompt_len_max']} tokens, "
        f"outputs {w['output_len_min']}-{w['output_len_max']} (EOS ignored), greedy, all at once",
        TABLE_COLUMNS, table_rows(document)))
    if output is not None:
        err_console.print(f"wrote {output}/results.json, report.md and plots")


app.command("throughput")(throughput)


@handles_errors
# the batch sizes set max_num_seqs; every sequence is input_len + output_len long, none shares a prefix
@engine_options(exclude=("max_num_seqs", "max_model_len", "enable_prefix_caching"))
def latency(
    model: str = typer.Argument("default", help="'default', a model folder (AWQ/GPTQ too), a .gguf file or a hub id"),
    engines: str = typer.Option("llmopt", "--engines", help="llmopt and/or llama.cpp (batch 1)."),
    batch_size: str = typer.Option("1", "--batch-size", help="Comma-separated batch sizes, e.g. 1,8,32."),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens per sequence."),
    output_len: int = typer.Option(128, "--output-len", help="Tokens generated per sequence (EOS ignored)."),
    num_iters_warmup: int = typer.Option(1, "--num-iters-warmup"),
    num_iters: int = typer.Option(3, "--num-iters"),
    seed: int = SEED,
    gguf: str | None = typer.Option(None, "--gguf", help="llama.cpp: the GGUF file (default: the model's own)."),
    threads: int | None = THREADS,
    output: Path | None = OUTPUT_DIR,
    json_out: bool = JSON_OUT,
    engine_args: EngineArgs = EngineArgs(),
) -> None:
    """Prefill and decode latency at fixed batch sizes, with the memory roofline (ideal decode tokens/s)."""
    from llmopt.bench.engines import EngineOptions
    from llmopt.bench.latency import LATENCY_COLUMNS, LatencyConfig, latency_rows, run_latency
    from llmopt.bench.offline_report import write_latency_report
    from llmopt.bench.results import prepare_output_dir
    from llmopt.errors import LlmoptError

    try:
        sizes = [int(b) for b in batch_size.split(",") if b.strip()]
    except ValueError:
        raise LlmoptError(f"--batch-size takes comma-separated integers, not {batch_size!r}") from None
    config = replace(engine_args.engine_config(), max_num_seqs=max(sizes, default=1), enable_prefix_caching=False)
    options = EngineOptions(dtype=engine_args.dtype, device=engine_args.device, engine_config=asdict(config),
                            gguf=gguf, threads=threads)
    bench = LatencyConfig(model=model, engines=[e.strip() for e in engines.split(",") if e.strip()],
                          batch_sizes=sizes, input_len=input_len, output_len=output_len,
                          num_iters_warmup=num_iters_warmup, num_iters=num_iters, seed=seed, options=options)
    if output is not None:
        prepare_output_dir(output)
    with err_console.status("") as status:
        document = run_latency(bench, lambda text: status.update(f"bench latency: {text} ..."))
    if output is not None:
        write_latency_report(output, document)
    if json_out:
        print_json(document)
        return
    _wide_console().print(_table(
        f"{input_len} prompt + {output_len} generated tokens per sequence, median of {num_iters}; measured read "
        f"bandwidth {document['config']['read_bandwidth_gb_s']:.1f} GB/s",
        LATENCY_COLUMNS, latency_rows(document)))


app.command("latency")(latency)

@handles_errors
def kernels(
    kernels_: str = typer.Option("int4_matmul,paged_decode", "--kernels",
                                 help="Comma-separated: int4_matmul, paged_decode."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA if present), cpu, cuda or cuda:N."),
    rows: str | None = typer.Option(None, "--rows",
                                    help="int4 matmul: comma-separated M (CUDA 1,2,...,128; CPU 1,4,16,64)."),
    batch: str | None = typer.Option(None, "--batch", help="Decode attention: comma-separated batch sizes (8,32)."),
    context: int | None = typer.Option(None, "--context",
                                       help="Decode attention: keys per sequence (CUDA 4096, CPU 256)."),
    num_iters_warmup: int | None = typer.Option(None, "--num-iters-warmup", help="Untimed calls (CUDA 5, CPU 2)."),
    num_iters: int | None = typer.Option(None, "--num-iters", help="Timed calls per figure (CUDA 50, CPU 10)."),
    threads: int | None = THREADS,
    output: Path | None = OUTPUT_DIR,
    json_out: bool = JSON_OUT,
) -> None:
    """Kernel micro-benchmarks: int4 matmul and paged decode attention against the dense / PyTorch paths."""
    from llmopt.bench.kernels import (KERNEL_TITLES, TABLE_COLUMNS, KernelsConfig, parse_ints, parse_kernels,
                                      resolve, run_kernels, summary, table_rows)
    from llmopt.bench.offline_report import write_kernels_report
    from llmopt.bench.results import prepare_output_dir

    config = KernelsConfig(device=device, kernels=parse_kernels(kernels_),
                           rows=None if rows is None else parse_ints(rows, "--rows"),
                           batches=None if batch is None else parse_ints(batch, "--batch"), context=context,
                           num_iters=num_iters, num_iters_warmup=num_iters_warmup, threads=threads)
    resolve(config)  # bad values fail here, before any output folder exists
    if output is not None:
        prepare_output_dir(output)
    with err_console.status("") as status:
        document = run_kernels(config, lambda text: status.update(f"bench kernels: {text} ..."))
    if output is not None:
        write_kernels_report(output, document)
    if json_out:
        print_json(document)
        return
    c = document["config"]
    for kernel in c["kernels"]:
        line = summary(document, kernel)
        _wide_console().print(_table(
            f"{KERNEL_TITLES[kernel]} on {c['device']} (copy bandwidth {c['copy_bandwidth_gb_s']:.1f} GB/s), median of "
            f"{c['num_iters']} cold-cache calls" + (f"; {line}" if line else ""),
            TABLE_COLUMNS, table_rows(document, kernel)))
    if output is not None:
        err_console.print(f"wrote {output}/results.json and report.md")


app.command("kernels")(kernels)

from llmopt.cli import bench_serve  # noqa: E402  (its commands register after the app exists)

# `allow_extra_args`: vLLM's `--goodput ttft:500 tpot:50` passes its later words as extra arguments
app.command("serve", context_settings={"allow_extra_args": True})(bench_serve.serve)
app.command("compare")(bench_serve.compare)
