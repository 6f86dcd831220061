"""`llmopt bench`: throughput (engines side by side, offline), latency (with a roofline),
serve (an online load generator for any OpenAI-compatible endpoint), kernels (micro-benchmarks
of llmopt's own kernels) and compare (results files)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from llmopt.cli.common import console, err_console, handles_errors, print_json
from llmopt.bench.latency import LatencyRequest
from llmopt.bench.throughput import ThroughputRequest
from llmopt.cli.options import request_options

app = typer.Typer(help="Benchmarks: engines side by side, online load, latency, kernels, comparisons.",
                  no_args_is_help=True)

OUTPUT_DIR = typer.Option(None, "--output", "-o", help="Write results.json, report.md and plots into this folder.")
JSON_OUT = typer.Option(False, "--json", help="Print the results document as JSON on stdout.")


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
@request_options(ThroughputRequest)
def throughput(request: ThroughputRequest, output: Path | None = OUTPUT_DIR, json_out: bool = JSON_OUT) -> None:
    """Offline throughput: one workload through several engines, side by side, in one run."""
    from llmopt.bench.offline_report import write_throughput_report
    from llmopt.bench.results import prepare_output_dir
    from llmopt.bench.throughput import TABLE_COLUMNS, run_throughput, table_rows

    bench = request.config()
    if output is not None:
        prepare_output_dir(output)
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
@request_options(LatencyRequest)
def latency(request: LatencyRequest, output: Path | None = OUTPUT_DIR, json_out: bool = JSON_OUT) -> None:
    """Prefill and decode latency at fixed batch sizes, with the memory roofline (ideal decode tokens/s)."""
    from llmopt.bench.latency import LATENCY_COLUMNS, latency_rows, run_latency
    from llmopt.bench.offline_report import write_latency_report
    from llmopt.bench.results import prepare_output_dir

    bench = request.config()
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
        f"{bench.input_len} prompt + {bench.output_len} generated tokens per sequence, median of {bench.num_iters}; "
        f"measured read bandwidth {document['config']['read_bandwidth_gb_s']:.1f} GB/s",
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
    threads: int | None = typer.Option(None, "--threads", help="CPU threads (default: torch's)."),
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
