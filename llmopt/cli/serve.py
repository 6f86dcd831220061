"""`llmopt serve`: an OpenAI-compatible endpoint on the paged runtime."""

from __future__ import annotations

import typer

from llmopt.cli.common import handles_errors
from llmopt.cli.options import request_options
from llmopt.serve.launch import ServeArgs


@handles_errors
@request_options(ServeArgs, param="args")
def serve(args: ServeArgs) -> None:
    """Serve a model over the OpenAI API (chat, completions, streaming, /metrics)."""
    from llmopt.serve.launch import run_server

    run_server(args, announce=lambda line: typer.echo(line, err=line.startswith("llmopt serve: handing")))
