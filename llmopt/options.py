"""One declaration per option: the typed requests the library takes carry their flags.

A request is a dataclass (`QuantizeRequest`, `EngineArgs`, ...). Each field declared with
`option(...)` states once what the command line and a recipe need to know about it: its help
text, its spellings on the command line, its bounds, whether a comma-separated string stands
for a list, and its key in a recipe. From that one declaration

- the CLI derives its Typer parameters (`llmopt.cli.options.command_options`),
- the recipe schema derives its pydantic sections (`llmopt.recipes.schema.section_model`),
- `commands.sh` renders a recipe's stage back into flags (`flag_names`),

so a flag and a recipe key are the same thing by construction. A field whose type is another
request (`engine: EngineArgs = group(EngineArgs)`) adds that request's options in place, as
vLLM's `EngineArgs.add_cli_args` adds the engine's flags to every command that runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable

FLAG = "llmopt.flag"
GROUP = "llmopt.group"
GROUP_DEFAULTS = "llmopt.group_defaults"


@dataclass(frozen=True)
class Flag:
    """What the command line and a recipe need to know about one request field."""

    help: str = ""
    names: tuple[str, ...] = ()  # command-line spellings; default --field-name (booleans --x/--no-x)
    panel: str | None = None  # the --help panel it is listed under
    argument: bool = False  # a positional argument rather than an option
    cli: bool = True  # offered on the command line
    recipe: str | None = ""  # its key in a recipe section ("" = the field name, "a.b" = nested, None = not offered)
    comma: bool = False  # a list written "a,b" on the command line (and accepted so in recipes)
    choices: tuple[str, ...] | None = None  # the only values a recipe accepts (the library checks the CLI's)
    recipe_type: Any = None  # what a recipe may write where the command line takes text ("5" or 0.1 for --limit)
    recipe_required: bool = False  # a recipe section must state it (quantize.method: what the recipe is about)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None


def option(default: Any = MISSING, help: str = "", *names: str, default_factory: Any = MISSING, **kw: Any) -> Any:
    """A request field with its flag (see `Flag` for the keywords; spellings as `*names` or `names=`)."""
    flag = Flag(help=help, names=tuple(kw.pop("names", names)), **kw)
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={FLAG: flag})
    return dataclasses.field(default=default, metadata={FLAG: flag})


def group(cls: type, exclude: tuple[str, ...] = (), **defaults: Any) -> Any:
    """A field holding another request whose options (all but `exclude`) join this one's, with
    `defaults` replacing some of its defaults (bench serve measures more prompts than throughput)."""
    return dataclasses.field(default_factory=functools.partial(cls, **defaults),
                             metadata={GROUP: tuple(exclude), GROUP_DEFAULTS: defaults})


@dataclass(frozen=True)
class Declared:
    """One option as a command sees it: where it lives in the request, its type, default and flag."""

    name: str  # unique across the request (group fields keep their own names)
    path: tuple[str, ...]  # attribute path from the request, e.g. ("engine", "max_num_seqs")
    type: Any
    default: Any
    flag: Flag

    @property
    def recipe_key(self) -> str | None:
        if self.flag.recipe is None:
            return None
        return self.flag.recipe or self.name

    @property
    def cli_names(self) -> tuple[str, ...]:
        if self.flag.names:
            return self.flag.names
        dashed = "--" + self.name.replace("_", "-")
        if _is_bool(self.type):
            return (f"{dashed}/--no-{self.name.replace('_', '-')}",)
        return (dashed,)

    @property
    def required(self) -> bool:
        return self.default is MISSING


def _is_bool(tp: Any) -> bool:
    return tp is bool or (typing.get_origin(tp) is typing.Union and bool in typing.get_args(tp))


def declared(cls: type, exclude: tuple[str, ...] = ()) -> list[Declared]:
    """The options of request class `cls` in declaration order, groups expanded in place."""
    hints = typing.get_type_hints(cls)
    out: list[Declared] = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        if GROUP in f.metadata:
            inner_exclude = tuple(f.metadata[GROUP]) + tuple(exclude)
            defaults = f.metadata[GROUP_DEFAULTS]
            for d in declared(hints[f.name], inner_exclude):
                out.append(dataclasses.replace(d, path=(f.name, *d.path), default=defaults.get(d.name, d.default)))
        elif FLAG in f.metadata:
            if f.default is not MISSING:
                default = f.default
            elif f.default_factory is not MISSING:
                default = f.default_factory()
            else:
                default = MISSING
            out.append(Declared(f.name, (f.name,), hints[f.name], default, f.metadata[FLAG]))
    names = [d.name for d in out]
    if len(names) != len(set(names)):
        raise TypeError(f"{cls.__name__}: option names repeat: {sorted(n for n in names if names.count(n) > 1)}")
    return out


def build(cls: type, values: dict[str, Any]) -> Any:
    """An instance of request `cls` from option values by name (absent ones: their defaults)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if GROUP in f.metadata:
            kwargs[f.name] = build(hints[f.name], {**f.metadata[GROUP_DEFAULTS], **values})
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def flag_names(cls: type) -> dict[str, tuple[str, ...]]:
    """Option name -> its command-line spellings, for rendering a request back into a command line."""
    return {d.name: d.cli_names for d in declared(cls)}


def split_commas(value: Any, item: Callable[[str], Any] = str) -> Any:
    """'a,b' -> ['a', 'b'] (each converted by `item`); lists and None pass through."""
    if isinstance(value, str):
        return [item(part.strip()) for part in value.split(",") if part.strip()]
    return value


def from_recipe(cls: type, section: dict[str, Any]) -> dict[str, Any]:
    """Option values by name from a recipe section's keys (nested sections by their dotted keys);
    keys that are no option of `cls` and null values are left out."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            elif value is not None:
                flat[prefix + key] = value

    walk("", section)
    by_key = {d.recipe_key: d.name for d in declared(cls) if d.recipe_key}
    return {by_key[key]: value for key, value in flat.items() if key in by_key}
