"""What every subcommand shares: error handling, JSON output, consoles."""

from __future__ import annotations

import functools
import json
import sys
import traceback
from typing import Any, Callable

import typer
from rich.console import Console

from llmopt.errors import LlmoptError

console = Console()
err_console = Console(stderr=True)

# set by the top-level --debug flag
DEBUG = {"enabled": False}

# 1 means only "a quality gate failed" (CI scripts branch on it); a bug in llmopt is 3, never 1
EXIT_OK, EXIT_GATE_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def handles_errors(fn: Callable) -> Callable:
    """Turn bad input (LlmoptError) into one line on stderr and exit code 2.

    With --debug the traceback is printed as well. Anything else is a bug in llmopt: it keeps
    its traceback and exits 3 (Python's own exit code for it, 1, would read as a failed gate).
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LlmoptError as exc:
            if DEBUG["enabled"]:
                traceback.print_exc()
            message = " ".join(str(exc).split())  # exactly one line
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            if hasattr(exc, "exit_code"):  # typer's (click's) usage errors, e.g. BadParameter: their own code
                raise
            traceback.print_exc()
            message = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            typer.echo(f"internal error (a bug in llmopt, please report it with the traceback above): {message}",
                       err=True)
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


def print_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    sys.stdout.flush()
