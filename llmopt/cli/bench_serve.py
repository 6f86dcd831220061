"""`llmopt bench serve` (online load on any OpenAI-compatible server) and `llmopt bench compare`
(results files side by side)."""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path

import typer
from rich.table import Table

from llmopt.cli.common import console, err_console, handles_errors, print_json
from llmopt.errors import LlmoptError


@handles_errors
def serve(
    ctx: typer.Context,
    url: str | None = typer.Option(None, "--url", help="A running OpenAI-compatible server, e.g. http://127.0.0.1:8000 "
                                   "(llmopt, vLLM, SGLang, llama.cpp, TGI)."),
    model: str | None = typer.Option(None, "--model", help="Launch a server for this spec on a free local port "
                                     "instead (see --launch), and stop it afterwards."),
    launch: str = typer.Option("llmopt", "--launch", help="With --model: llmopt (`llmopt serve SPEC`) or llama-cpp "
                               "(llama-cpp-python's own server on a .gguf file; 'default' = the embedded one)."),
    serve_args: str = typer.Option("", "--serve-args", help="Extra flags for the launched server, one string, e.g. "
                                   "'--max-num-seqs 64 --kv-cache-memory 1GiB'."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="Model name to send "
                                                 "(default: the first one /v1/models lists)."),
    api_key: str | None = typer.Option(None, "--api-key", help="Bearer key (default: $OPENAI_API_KEY, "
                                       "$LLMOPT_API_KEY)."),
    endpoint: str = typer.Option("chat", "--endpoint", help="chat (/v1/chat/completions, messages) or completions "
                                 "(/v1/completions, prompt text)."),
    dataset: str = typer.Option("chat", "--dataset", help="chat, prefix-shared, random, or a ShareGPT .json / "
                                ".jsonl file."),
    num_prompts: int = typer.Option(64, "--num-prompts", help="Measured requests per load point."),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens (random dataset)."),
    output_len: int | None = typer.Option(128, "--output-len", help="Output tokens per request (max_tokens, EOS "
                                          "ignored); 0 keeps a file's own reply lengths."),
    range_ratio: float = typer.Option(0.0, "--range-ratio", help="Lengths uniform in L x [1 - r, 1 + r]."),
    prefix_len: int = typer.Option(1000, "--prefix-len", help="Shared system prompt tokens (prefix-shared)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="Model spec whose tokenizer builds the workload "
                                         "and counts tokens when the server sends no usage (default: --model, "
                                         "else 'default')."),
    seed: int = typer.Option(0, "--seed"),
    request_rate: float = typer.Option(math.inf, "--request-rate", help="Requests/s, arrivals Poisson (or gamma, "
                                       "see --burstiness); inf: all at once."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of the arrival gaps: 1 Poisson, "
                                     "< 1 burstier, > 1 steadier."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", help="Most requests in flight at once."),
    sweep: str | None = typer.Option(None, "--sweep", help="A curve: concurrency=1,4,16,64 or rate=1,2,4,inf."),
    num_warmups: int = typer.Option(1, "--num-warmups", help="Unmeasured requests first (one-off costs)."),
    temperature: float = typer.Option(0.0, "--temperature"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Ask for exactly max_tokens (a vLLM "
                                    "extra; servers without it stop at EOS, counted as short outputs)."),
    percentiles: str = typer.Option("50,90,99", "--percentiles", help="Latency percentiles to report."),
    goodput: list[str] = typer.Option([], "--goodput", help="SLOs in ms, vLLM's syntax: --goodput ttft:500 tpot:50 "
                                      "(also e2el)."),
    cost_per_hour: float | None = typer.Option(None, "--cost-per-hour", help="$ per hour of the server: adds "
                                               "$ per million output tokens."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds without a byte from the server (connecting, "
                                  "queued, or between chunks) before a request counts as failed."),
    server_timeout: float = typer.Option(600.0, "--server-timeout", help="Seconds for a launched server to answer."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Folder for results.json, report.md and plots."),
    save_detailed: bool = typer.Option(False, "--save-detailed", help="Per-request lists in results.json."),
    json_output: bool = typer.Option(False, "--json", help="Print results.json on stdout (the table goes to stderr)."),
) -> None:
    """Online benchmark of an OpenAI-compatible server: TTFT, TPOT, ITL, latency, throughput, goodput."""
    from llmopt.bench.tables_and_plots import format_value
    from llmopt.bench.results import prepare_output_dir
    from llmopt.bench.online import ServeBenchConfig, check_config, run_serve_bench
    from llmopt.bench.online_metrics import parse_goodput, parse_percentiles
    from llmopt.bench.online_report import build_document, notes, table_rows, write_report

    # vLLM writes `--goodput ttft:500 tpot:50`: the words after the first arrive as extra arguments
    stray = [a for a in ctx.args if not (goodput and ":" in a)]
    if stray:
        raise LlmoptError(f"unexpected argument {stray[0]!r} (bench serve takes options only)")
    try:
        extra_flags = shlex.split(serve_args)
    except ValueError as exc:
        raise LlmoptError(f"--serve-args: {exc}") from None
    config = ServeBenchConfig(
        url=url, model=model, launch=launch, serve_args=extra_flags, served_model_name=served_model_name,
        api_key=api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("LLMOPT_API_KEY") or None,
        endpoint=endpoint, dataset=dataset, num_prompts=num_prompts, input_len=input_len,
        output_len=output_len or None, range_ratio=range_ratio, prefix_len=prefix_len, tokenizer=tokenizer, seed=seed,
        request_rate=request_rate, burstiness=burstiness, max_concurrency=max_concurrency, sweep=sweep,
        num_warmups=num_warmups, temperature=temperature, ignore_eos=ignore_eos,
        percentiles=parse_percentiles(percentiles), goodput=parse_goodput([*goodput, *ctx.args]),
        cost_per_hour=cost_per_hour, timeout=timeout, server_timeout=server_timeout)
    check_config(config)
    if output is not None:
        prepare_output_dir(output)
    screen = err_console if json_output else console
    name, runs = _run_with_progress(config, run_serve_bench)
    document = build_document(config, name, runs, save_detailed)
    columns, rows = table_rows(document)
    table = Table(title=f"llmopt bench serve: {name}")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=i == 0)

    for row in rows:
        table.add_row(row[0], *(format_value(v) for v in row[1:]))
    screen.print(table)
    for line in notes(document):
        screen.print(line, highlight=False, markup=False)
    if output is not None:
        written = write_report(output, document, runs)
        screen.print(f"wrote {', '.join(p.name for p in written)} to {output}", highlight=False, markup=False)
    if json_output:
        print_json(document)


def _run_with_progress(config, run):
    """The benchmark under a live progress bar per load point (on stderr, so stdout stays clean)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), console=err_console,
                        transient=False)
    state = {"task": None}

    def on_point(point, total: int) -> None:
        state["task"] = progress.add_task(point.label, total=total, failed=0)

    def on_result(result) -> None:
        task = state["task"]
        failed = progress.tasks[task].fields["failed"] + (not result.success)
        progress.update(task, advance=1, failed=failed)

    with progress:
        return run(config, on_point=on_point, on_result=on_result)


@handles_errors
def compare(
    files: list[Path] = typer.Argument(..., help="results.json files or the folders holding them (the first is the "
                                       "base of every % change)."),
    metrics: str | None = typer.Option(None, "--metrics", help="Figures to show, comma-separated names or patterns, "
                                       "e.g. 'output_throughput,*ttft*'."),
    markdown: bool = typer.Option(False, "--markdown", help="Print a Markdown table instead."),
) -> None:
    """Runs of several `llmopt bench` results side by side, with % change against the first file."""
    from llmopt.bench.compare import compare_files
    from llmopt.bench.environment import hardware_line
    from llmopt.bench.tables_and_plots import format_value, markdown_table

    patterns = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else None
    comparison = compare_files(files, patterns)
    for name, document in zip(comparison.names, comparison.documents):
        meta = document.get("metadata") or {}
        what = meta.get("served_model_name") or (document.get("config") or {}).get("model") \
            or (document.get("config") or {}).get("device") or "?"
        hardware = hardware_line(meta) if meta.get("gpu") or {"cpu", "torch_threads"} <= meta.keys() else "?"
        console.print(f"{name}: {comparison.kind}, {what}, {hardware}, {meta.get('date', '?')}",
                      highlight=False, markup=False)
    if markdown:
        typer.echo(markdown_table(comparison.rows, comparison.columns))
        return
    table = Table()
    for i, column in enumerate(comparison.columns):
        table.add_column(column, justify="left" if i < 2 else "right")
    for row in comparison.rows:
        table.add_row(*(v if isinstance(v, str) else format_value(v) for v in row))
    console.print(table)
