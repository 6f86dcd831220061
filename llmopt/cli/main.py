"""The `llmopt` command: a Typer app with one module per subcommand."""

from __future__ import annotations

import logging
import signal
import sys

import typer

from llmopt import __version__
from llmopt.cli import bench as bench_cmd
from llmopt.cli import eval as eval_cmd
from llmopt.cli import generate as generate_cmd
from llmopt.cli import models as models_cmd
from llmopt.cli import plan as plan_cmd
from llmopt.cli import quantize as quantize_cmd
from llmopt.cli import run as run_cmd
from llmopt.cli import serve as serve_cmd
from llmopt.cli.common import DEBUG
from llmopt.core.memory import reuse_freed_memory

app = typer.Typer(
    name="llmopt",
    help="quantize -> eval -> bench -> serve for self-hosted LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (test runners swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmopt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No start-up log lines on stderr."),
) -> None:
    DEBUG["enabled"] = debug
    # start-up facts (KV cache size, ...) go to stderr, never into --json output on stdout
    logger = logging.getLogger("llmopt")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("llmopt: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else (logging.DEBUG if debug else logging.INFO))


app.command("quantize")(quantize_cmd.quantize)
app.command("eval")(eval_cmd.eval_command)
app.command("generate")(generate_cmd.generate)
app.command("serve")(serve_cmd.serve)
app.command("plan")(plan_cmd.plan)
app.command("run")(run_cmd.run)
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(models_cmd.app, name="models")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # `kill`, `timeout` and CI runners stop a job with SIGTERM: end the command as Ctrl-C does, so
    # its temporary outputs are removed on the way out (a server's own handlers replace this one)
    signal.signal(signal.SIGTERM, _interrupt)
    reuse_freed_memory()
    app()
