"""`llmopt models`: inspect a model spec, convert it to a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from llmopt.cli.common import console, handles_errors, print_json
from llmopt.core import ModelSource, resolve
from llmopt.core.source import LOAD_FORMATS
from llmopt.errors import LlmoptError

app = typer.Typer(help="Inspect and convert models.", no_args_is_help=True)


def describe(source: ModelSource) -> dict[str, Any]:
    cfg = source.config
    windows = {w for w in cfg.sliding_windows if w is not None}
    quant = source.quantization
    return {
        "spec": source.spec,
        "kind": source.kind,
        "path": str(source.path),
        "origin": source.origin,
        "architecture": {
            "architecture": cfg.architecture,
            "model_type": cfg.model_type,
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling,
            "sliding_window": max(windows) if windows else None,
            "num_parameters": cfg.num_parameters,
        },
        "quantization": None if quant is None else {
            "method": quant.method, "bits": quant.bits, "group_size": quant.group_size, "details": quant.details,
        },
    }


@app.command("info")
@handles_errors
def info(
    spec: str = typer.Argument(..., help="'default', a model folder, a .gguf file or a hub id"),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Show a model's architecture and quantization (its weight files' headers checked)."""
    from llmopt.core.weights import check_safetensors, safetensors_files

    source = resolve(spec)
    if source.kind != "gguf":  # a GGUF file's tensors are checked against its size when it is read
        check_safetensors(safetensors_files(source.path))
    doc = describe(source)
    if json_output:
        print_json(doc)
        return
    table = Table(title=f"model {spec}", show_header=False)
    for key in ("kind", "path", "origin"):
        if doc[key]:
            table.add_row(key, str(doc[key]))
    for key, value in doc["architecture"].items():
        table.add_row(key, f"{value:,}" if key == "num_parameters" else str(value))
    q = doc["quantization"]
    table.add_row("quantization", "none" if q is None else f"{q['method']} {q['bits'] or ''}-bit "
                  f"{q['details'].get('file_type') or q['details'].get('scheme') or ''}".strip())
    console.print(table)


@app.command("convert")
@handles_errors
def convert(
    spec: str = typer.Argument(..., help="'default', a model folder, a .gguf file or a hub id"),
    output: Path = typer.Option(..., "--output", "-o", help="Folder to write (Hugging Face layout)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16"),
    force: bool = typer.Option(False, "--force", help="Replace OUTPUT if it exists."),
    load_format: str = typer.Option(
        "auto", "--load-format", help="auto: the model's weights; dummy: random weights of its shape (SPEC may be a "
        "shipped architecture such as llama-3-8b; sharded, with the default model's tokenizer)."),
    quantization: Optional[str] = typer.Option(
        None, "--quantization", help="With --load-format dummy: awq or gptq, an int4 checkpoint of that format "
        "(random packed codes, as generate --load-format dummy --quantization loads)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Write a model as a Hugging Face folder (config.json + safetensors + tokenizer)."""
    from llmopt.core.convert import DTYPES, convert_source
    from llmopt.core.output_paths import check_output

    if dtype not in DTYPES:
        raise LlmoptError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    if load_format not in LOAD_FORMATS:
        raise LlmoptError(f"unknown load format {load_format!r}; choose one of: {', '.join(LOAD_FORMATS)}")
    check_output(output, force, flag="--force")
    source = resolve(spec)
    folder = convert_source(source, output, dtype=dtype, overwrite=force, load_format=load_format,
                            quantization=quantization)
    doc = {"spec": spec, "output": str(folder), "dtype": dtype, "load_format": load_format,
           "quantization": quantization}
    if json_output:
        print_json(doc)
    else:
        console.print(f"wrote {folder} ({dtype})")
