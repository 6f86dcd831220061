"""`llmopt bench`: throughput (engines side by side, offline), latency (with a roofline),
serve (an online load generator for any OpenAI-compatible endpoint) and compare (results files)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Benchmarks: engines side by side, online load, latency, comparisons.", no_args_is_help=True)
