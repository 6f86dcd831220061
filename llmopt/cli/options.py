"""Typer parameters derived from a request's declared options (`llmopt.options`).

`@request_options(Request)` replaces a command's `request: Request` parameter by one Typer
parameter per declared option (positional arguments where they stood, options under their
help panel) and calls the command with the `Request` built from them. The command keeps its
own rendering flags (`--json`, ...) as ordinary Typer parameters.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import MISSING
from typing import Any, Callable, Optional

import typer

from llmopt.options import Declared, build, declared


def _cli_type(d: Declared) -> Any:
    # a comma list is one string on the command line; the request gets the list
    if d.flag.comma:
        return Optional[str] if d.default is None or d.default is MISSING else str
    return d.type


def _cli_default(d: Declared) -> Any:
    if d.flag.comma and isinstance(d.default, (list, tuple)):
        return ",".join(map(str, d.default))
    return ... if d.default is MISSING else d.default


def _parameter(d: Declared) -> inspect.Parameter:
    if d.flag.argument:
        info = typer.Argument(_cli_default(d), help=d.flag.help, show_default=d.default is not MISSING)
    else:
        info = typer.Option(_cli_default(d), *d.cli_names, help=d.flag.help, rich_help_panel=d.flag.panel)
    return inspect.Parameter(d.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=_cli_type(d))


def _from_cli(d: Declared, value: Any) -> Any:
    if d.flag.comma and isinstance(value, str):
        args = typing.get_args(d.type)
        inner = next((a for a in args if typing.get_origin(a) is list), d.type)
        item = (typing.get_args(inner) or (str,))[0]
        from llmopt.errors import LlmoptError

        try:
            return [item(part.strip()) for part in value.split(",") if part.strip()]
        except ValueError:
            raise LlmoptError(f"{d.cli_names[0]} takes comma-separated {item.__name__} values, "
                              f"not {value!r}") from None
    return value


def request_options(cls: type, param: str = "request",
                    exclude: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a Typer command the options of request class `cls` (all but `exclude`, which keep
    their defaults); the command receives the built request in its `param` parameter."""
    options = [d for d in declared(cls, exclude) if d.flag.cli]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command)
        if param not in signature.parameters:
            raise TypeError(f"{command.__name__} must take a {param} parameter")
        own = list(signature.parameters.values())
        at = [p.name for p in own].index(param)
        added = [_parameter(d) for d in options]
        clash = {p.name for p in own} & {p.name for p in added}
        if clash:
            raise TypeError(f"{command.__name__}: parameters named like options of {cls.__name__}: {sorted(clash)}")

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {d.name: _from_cli(d, kwargs.pop(d.name)) for d in options}
            return command(*args, **{param: build(cls, values)}, **kwargs)

        params = own[:at] + added + own[at + 1:]
        # Typer wants positional-or-keyword order to hold: arguments first as declared
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != param},
                                   **{p.name: p.annotation for p in added}}
        return wrapper

    return decorate
