"""`llmopt bench`: throughput (engines side by side, offline), latency (with a roofline),
serve (an online load generator for any OpenAI-compatible endpoint) and compare (results files)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Benchmarks: engines side by side, online load, latency, comparisons.", no_args_is_help=True)

from llmopt.cli import bench_serve  # noqa: E402  (the commands register after the app exists)

# `allow_extra_args`: vLLM's `--goodput ttft:500 tpot:50` passes its later words as extra arguments
app.command("serve", context_settings={"allow_extra_args": True})(bench_serve.serve)
app.command("compare")(bench_serve.compare)
