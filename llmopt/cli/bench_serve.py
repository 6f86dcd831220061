"""`llmopt bench serve` (online load on any OpenAI-compatible server) and `llmopt bench compare`
(results files side by side)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from llmopt.cli.common import console, err_console, handles_errors, print_json
from llmopt.bench.serve_args import BenchServeArgs
from llmopt.cli.options import request_options
from llmopt.errors import LlmoptError


@handles_errors
@request_options(BenchServeArgs, param="args")
def serve(
    ctx: typer.Context,
    args: BenchServeArgs,
    output: Path | None = typer.Option(None, "--output", "-o", help="Folder for results.json, report.md and plots."),
    json_output: bool = typer.Option(False, "--json", help="Print results.json on stdout (the table goes to stderr)."),
) -> None:
    """Online benchmark of an OpenAI-compatible server: TTFT, TPOT, ITL, latency, throughput, goodput."""
    from llmopt.bench.tables_and_plots import format_value
    from llmopt.bench.results import prepare_output_dir
    from llmopt.bench.online import run_serve_bench
    from llmopt.bench.online_report import build_document, notes, table_rows, write_report

    # vLLM writes `--goodput ttft:500 tpot:50`: the words after the first arrive as extra arguments
    stray = [a for a in ctx.args if not (args.goodput and ":" in a)]
    if stray:
        raise LlmoptError(f"unexpected argument {stray[0]!r} (bench serve takes options only)")
    args.goodput = [*args.goodput, *ctx.args]
    config = args.config()
    save_detailed = args.save_detailed
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
