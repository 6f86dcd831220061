"""The `llmopt` command: a Typer app with one module per subcommand."""

from __future__ import annotations

import typer

from llmopt import __version__
from llmopt.cli import generate as generate_cmd
from llmopt.cli import models as models_cmd
from llmopt.cli.common import DEBUG

app = typer.Typer(
    name="llmopt",
    help="quantize -> eval -> bench -> serve for self-hosted LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmopt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
) -> None:
    DEBUG["enabled"] = debug


app.command("generate")(generate_cmd.generate)
app.add_typer(models_cmd.app, name="models")


def main() -> None:
    app()
