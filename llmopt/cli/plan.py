"""`llmopt plan`: what fits where, from a model's architecture (no weights needed)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from llmopt.cli.common import console, handles_errors, print_json


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


@handles_errors
def plan(
    model: str = typer.Argument(..., help="A shipped architecture (llama-3-8b, llama-3-70b, llama-3.2-1b, "
                                          "mistral-7b), 'default', a local folder or .gguf, or a hub id"),
    context: int = typer.Option(4096, "--context", help="Tokens per sequence (prompt + output)."),
    concurrency: int = typer.Option(16, "--concurrency", help="Sequences served at once."),
    gpu: str = typer.Option("H100-SXM", "--gpu", help="The GPU of the per-format table."),
    kv_cache_dtype: str = typer.Option("bfloat16", "--kv-cache-dtype", help="bfloat16, float16, fp8 or float32."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
    requests_per_hour: float | None = typer.Option(None, "--requests-per-hour", help="Serverless vs always-on."),
    output_tokens: int = typer.Option(256, "--output-tokens", help="Output tokens per request (--requests-per-hour)."),
    prices: Path | None = typer.Option(None, "--prices", help="JSON: GPU name -> $/hour, or new GPUs."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Weights per format, K/V per token, GPUs needed, largest concurrency and the decode roofline per GPU."""
    from llmopt.errors import LlmoptError
    from llmopt.plan.hardware import gpu_table
    from llmopt.plan.planner import PlanRequest, config_of, make_plan

    kv_bytes = {"bfloat16": 2, "float16": 2, "fp8": 1, "float32": 4}.get(kv_cache_dtype)
    if kv_bytes is None:
        raise LlmoptError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose bfloat16, float16, fp8 or float32")
    request = PlanRequest(context=context, concurrency=concurrency, gpu=gpu, kv_dtype_bytes=kv_bytes,
                          gpu_memory_utilization=gpu_memory_utilization, requests_per_hour=requests_per_hour,
                          output_tokens_per_request=output_tokens)
    result = make_plan(model, config_of(model), gpu_table(prices), request)
    if json_out:
        print_json(result)
        return
    out = console if console.is_terminal else Console(width=200)
    a = result["architecture"]
    out.print(f"[bold]{model}[/]: {a['parameters'] / 1e9:.2f}B parameters, {a['layers']} layers, {a['kv_heads']} KV "
              f"heads x {a['head_dim']}; K/V {result['kv_bytes_per_token'] / 1024:.0f} KiB per token "
              f"({kv_cache_dtype}), {result['kv_gib_per_sequence']:.2f} GiB per {context}-token sequence"
              + (f" (sliding window {a['sliding_window']})" if a["sliding_window"] else ""))
    table = Table(title=f"Formats on {gpu}, {concurrency} x {context} tokens (roofline: upper bounds)",
                  title_justify="left")
    for column in ("format", "weights (GiB)", "GPUs needed", "max concurrency", "tok/s batch 1",
                   f"tok/s at {concurrency}", "$ / M tokens"):
        table.add_column(column, justify="left" if column == "format" else "right")
    for p in result["formats"]:
        table.add_row(p["format"] + ("" if p["exact"] else " (~)"), _fmt(p["weights_gib"], ".2f"),
                      str(p["gpus_needed"] or ">8"), str(p["max_concurrency"]), _fmt(p["roofline_tok_s_batch1"], ".0f"),
                      _fmt(p["roofline_tok_s"] or None, ".0f"), _fmt(p["usd_per_million_tokens"], ".3f"))
    out.print(table)
    table = Table(title="Per GPU: bf16 vs AWQ int4 g128", title_justify="left")
    for column in ("GPU", "memory (GiB)", "bandwidth (GB/s)", "$/h", "format", "GPUs needed", "max concurrency",
                   f"tok/s at {concurrency}", "$ / M tokens"):
        table.add_column(column, justify="left" if column in ("GPU", "format") else "right")
    for p in result["gpus"]:
        table.add_row(p["gpu"], f"{p['memory_gib']:g}", f"{p['bandwidth_gb_s']:g}", f"{p['usd_per_hour']:.2f}",
                      p["format"], str(p["gpus_needed"] or ">8"), str(p["max_concurrency"]),
                      _fmt(p["roofline_tok_s"] or None, ".0f"), _fmt(p["usd_per_million_tokens"], ".3f"))
    out.print(table)
    for r in result["recommendations"]:
        out.print(f"- [bold]{r['advice']}[/]: {r['reason']}")
