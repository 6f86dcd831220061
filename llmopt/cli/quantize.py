"""`llmopt quantize`: RTN / AWQ / GPTQ int4 checkpoints and GGUF files, with a report."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmopt.cli.common import console, err_console, handles_errors, print_json
from llmopt.errors import LlmoptError


@handles_errors
def quantize(
    model: str = typer.Argument(..., help="'default', a model folder, or a hub id (unquantized)"),
    output: Path = typer.Option(..., "--output", "-o", help="Folder to write (AWQ/GPTQ) or a .gguf file."),
    method: str = typer.Option("awq", "--method", help="rtn, awq, gptq or gguf"),
    fmt: str = typer.Option(None, "--format", help="awq, gptq or gguf (default: awq for awq, gguf for gguf, else gptq)"),
    bits: int = typer.Option(4, "--bits", help="Weight bits (the AWQ/GPTQ writers pack 4)."),
    group_size: int = typer.Option(64, "--group-size", help="Input channels per scale/zero group; -1 = per channel."),
    sym: bool = typer.Option(False, "--sym/--asym", help="Symmetric grid (vLLM's Marlin GPTQ kernels want --sym; --asym measured better here)."),
    desc_act: bool = typer.Option(None, "--desc-act/--no-desc-act", help="GPTQ act-order: quantize high-activation columns first (default: on for gptq)."),
    damp_percent: float = typer.Option(0.1, "--damp-percent", help="GPTQ Hessian damping, a fraction of its mean diagonal (raised on failure)."),
    calib: str = typer.Option("self", "--calib", help="self (model-generated), a .txt/.jsonl/.parquet file, or hf:NAME[:CONFIG][:SPLIT]"),
    num_samples: int = typer.Option(64, "--num-samples", help="Calibration samples."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per calibration sample."),
    seed: int = typer.Option(0, "--seed"),
    gguf_type: str = typer.Option("Q4_K_M", "--gguf-type", help="F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K_M, Q5_K_M, Q6_K"),
    quantize_lm_head: bool = typer.Option(False, "--quantize-lm-head", help="Quantize the output projection too."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    device: str = typer.Option("cpu", "--device"),
    json_output: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
) -> None:
    """Quantize a model; writes the checkpoint and quantize_report.json beside it."""
    from llmopt.quant.quantize import QuantizeRequest, quantize as run_quantize, validate

    req = QuantizeRequest(model=model, output=output, method=method, format=fmt, bits=bits, group_size=group_size,
                          sym=sym, desc_act=desc_act, damp_percent=damp_percent, calib=calib, num_samples=num_samples,
                          seq_len=seq_len, seed=seed, gguf_type=gguf_type, quantize_lm_head=quantize_lm_head,
                          overwrite=overwrite, device=device)
    validate(req)
    progress = Progress(TextColumn(f"{method} layers"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, transient=True, disable=json_output or not err_console.is_terminal)
    task = progress.add_task("layers", total=None)
    try:
        with progress:
            report = run_quantize(req, on_layer=lambda done, total: progress.update(task, completed=done, total=total))
    except KeyboardInterrupt:
        raise LlmoptError(f"interrupted; nothing was written to {output}") from None
    doc = report.to_dict()
    if json_output:
        print_json(doc)
        return
    table = Table(title=f"llmopt quantize: {method} -> {report.format}", show_header=False)
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
