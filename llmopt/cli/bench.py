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
from llmopt.core.device import DEVICE_HELP

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


def _run_and_render(name: str, run, write_report, output: Path | None, json_out: bool, title, columns: list[str],
                    rows) -> None:
    """`run(status_line)` under a live status line (stderr), its report written to `output`, then the
    document as JSON or as a table titled `title(document)`."""
    from llmopt.bench.results import prepare_output_dir

    if output is not None:
        prepare_output_dir(output)
    with err_console.status("") as status:
        document = run(lambda text: status.update(f"bench {name}: {text} ..."))
    if output is not None:
        write_report(output, document)
    if json_out:
        print_json(document)
        return
    _wide_console().print(_table(title(document), columns, rows(document)))
    if output is not None:
        err_console.print(f"wrote {output}/results.json, report.md and plots")


@handles_errors
@request_options(ThroughputRequest)
def throughput(request: ThroughputRequest, output: Path | None = OUTPUT_DIR, json_out: bool = JSON_OUT) -> None:
    """Offline throughput: one workload through several engines, side by side, in one run."""
    from llmopt.bench.offline_report import write_throughput_report
    from llmopt.bench.throughput import TABLE_COLUMNS, run_throughput, table_rows

    bench = request.config()

    def run(status_line):
        def progress(engine, result):
            if result is None:
                status_line(f"{engine} running")
            else:
                err_console.print(f"{engine}: " + (f"skipped ({result.skipped})" if result.skipped
                                                   else f"{result.output_tokens / result.elapsed_s:.1f} output tok/s"))
        return run_throughput(bench, progress)

    def title(document):
        w = document["config"]["workload"]
        return (f"{w['requests']} requests ({bench.dataset}), prompts {w['prompt_len_min']}-{w['prompt_len_max']} "
                f"tokens, outputs {w['output_len_min']}-{w['output_len_max']} (EOS ignored), greedy, all at once")

    _run_and_render("throughput", run, write_throughput_report, output, json_out, title, TABLE_COLUMNS, table_rows)


app.command("throughput")(throughput)


@handles_errors
@request_options(LatencyRequest)
def latency(request: LatencyRequest, output: Path | None = OUTPUT_DIR, json_out: bool = JSON_OUT) -> None:
    """Prefill and decode latency at fixed batch sizes, with the memory roofline (ideal decode tokens/s)."""
    from llmopt.bench.latency import LATENCY_COLUMNS, bandwidth_line, latency_rows, run_latency
    from llmopt.bench.offline_report import write_latency_report

    bench = request.config()
    _run_and_render(
        "latency", lambda status_line: run_latency(bench, status_line), write_latency_report, output, json_out,
        lambda document: (f"{bench.input_len} prompt + {bench.output_len} generated tokens per sequence, median of "
                          f"{bench.num_iters}; {bandwidth_line(document)}"),
        LATENCY_COLUMNS, latency_rows)


app.command("latency")(latency)

@handles_errors
def kernels(
    kernels_: str = typer.Option("int4_matmul,paged_decode", "--kernels",
                                 help="Comma-separated: int4_matmul, paged_decode."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP + "."),
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
