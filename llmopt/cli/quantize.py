"""`llmopt quantize`: RTN / AWQ / GPTQ int4 checkpoints and GGUF files, with a report."""

from __future__ import annotations

import logging
import time

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from llmopt.cli.common import console, err_console, handles_errors, print_json
from llmopt.cli.options import request_options
from llmopt.errors import LlmoptError
from llmopt.quant.quantize import QuantizeRequest

log = logging.getLogger("llmopt")


@handles_errors
@request_options(QuantizeRequest)
def quantize(
    request: QuantizeRequest,
    json_output: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
) -> None:
    """Quantize a model; writes the checkpoint and quantize_report.json beside it."""
    from llmopt.quant.quantize import quantize as run_quantize, validate

    validate(request)
    progress = Progress(TextColumn(f"{request.method} layers"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("ETA"), TimeRemainingColumn(), console=err_console, transient=True, disable=json_output or not err_console.is_terminal)
    task = progress.add_task("layers", total=None)
    started = time.perf_counter()
    layers_started = started  # reset when the first layer begins (model reading and calibration data come first)
    layers_cpu_started = time.process_time()

    def on_layer(done: int, total: int) -> None:
        nonlocal layers_started, layers_cpu_started
        if done == 0:
            layers_started, layers_cpu_started = time.perf_counter(), time.process_time()
            progress.reset(task, total=total)
            return
        progress.update(task, completed=done, total=total)
        if progress.disable:  # no live bar (a CI log, --json): one stderr line per layer
            now = time.perf_counter()
            per_layer = (now - layers_started) / done
            cpu_per_layer = (time.process_time() - layers_cpu_started) / done  # all threads: steadier when shared
            log.info("%s: layer %d/%d, %.0f s elapsed, %.1f s per layer (%.1f CPU s), ETA %.0f s", request.method,
                     done, total, now - started, per_layer, cpu_per_layer, per_layer * (total - done))

    try:
        with progress:
            report = run_quantize(request, on_layer=on_layer)
    except KeyboardInterrupt:
        raise LlmoptError(f"interrupted; nothing was written to {request.output}") from None
    doc = report.to_dict()
    if json_output:
        print_json(doc)
        return
    table = Table(title=f"llmopt quantize: {request.method} -> {report.format}", show_header=False)
    for key, value in (("output", report.output), ("parameters", _compact(report.parameters)),
                       ("calibration", _compact(report.calibration) if report.calibration else "none"),
                       ("wall time", f"{report.wall_seconds:.1f} s (calibration data {report.calibration_seconds:.1f} s, "
                                     f"quantization {report.quantize_seconds:.1f} s)"),
                       ("peak RSS", f"{report.peak_rss_bytes / 2**20:.0f} MiB"),
                       ("size", f"{report.size_before_bytes / 2**20:.1f} MiB -> {report.size_after_bytes / 2**20:.1f} MiB"),
                       ("mean layer error", "n/a" if report.mean_relative_error is None else f"{report.mean_relative_error:.4%}")):
        table.add_row(key, str(value))
    console.print(table)


def _compact(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items() if v is not None and v is not False)
