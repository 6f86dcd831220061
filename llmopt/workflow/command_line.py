"""A recipe stage as the `llmopt` command that does the same thing (commands.sh, --dry-run).

An `Invocation` holds the command words, its arguments and its options by name; `render` writes
each option with the spellings its request declares (`llmopt.options`), so commands.sh says
exactly what the command line would: `group_size` -> `--group-size 128`, `sym` False -> `--asym`.
Options a command takes beside its request (`--output` of eval and bench) are written
`--name-with-dashes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmopt.options import declared


@dataclass
class Invocation:
    """An `llmopt` command line before rendering: options by their request field name."""

    command: tuple[str, ...]
    arguments: list[str]
    options: dict[str, Any] = field(default_factory=dict)
    request: type | None = None  # the request class declaring the options' flags


def render(invocation: Invocation) -> list[str]:
    """`llmopt <command> ARGS --flag value ...`."""
    spellings = {d.name: d for d in declared(invocation.request)} if invocation.request else {}
    argv = ["llmopt", *invocation.command, *invocation.arguments]
    for key, value in invocation.options.items():
        if value is None:
            continue
        d = spellings.get(key)
        names = d.cli_names if d is not None else ("--" + key.replace("_", "-"),)
        flag = max(names, key=len)  # --output, not -o
        if isinstance(value, bool):
            positive, _, negative = flag.partition("/")
            if value or negative:
                argv.append(positive if value else negative)
            continue
        values = value if isinstance(value, list) else [value]
        if d is not None and d.flag.comma or not isinstance(value, list):
            argv += [flag.partition("/")[0], ",".join(_text(v) for v in values)]
        else:  # a repeatable option
            for v in values:
                argv += [flag, _text(v)]
    return argv


def _text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value)) if abs(value) < 1e15 else str(value)
    return str(value)
