"""Reading recipes: YAML (or JSON) -> `extends` resolved -> `--set` overrides -> a validated `Recipe`.

Every problem is one `LlmoptError` line naming the file and the key: an unknown key with the
nearest valid one (difflib), a value of the wrong type, an `extends` cycle, YAML that does not
parse. The CLI turns it into exit code 2.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from llmopt.errors import LlmoptError
from llmopt.recipes.schema import EVAL_RUN_KEYS, EvalSection, Recipe

BUILTIN_DEFAULTS = "default-gates.yaml"  # package data: the eval defaults, a partial recipe
MAX_DEPTH = 32  # a recipe is sections of keys, some with a list: a handful of levels
MAX_NODES = 100_000


def read_yaml(path: Path) -> dict[str, Any]:
    """One recipe file as a dict (no `extends` resolution)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LlmoptError(f"recipe {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmoptError(f"cannot read recipe {path}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise LlmoptError(f"recipe {path} is not valid YAML{where}: {problem}") from None
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise LlmoptError(f"recipe {path} nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # an integer beyond Python's digit limit (int_max_str_digits)
        raise LlmoptError(f"recipe {path} holds a value that cannot be read: {str(exc).split(';')[0]}") from None
    check_shape(data, f"recipe {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LlmoptError(f"recipe {path}: expected a mapping of sections (model, quantize, eval, bench, serve), "
                          f"got {type(data).__name__}")
    return _normalise(data)


def check_shape(data: Any, what: str) -> None:
    """No recipe nests deeper than MAX_DEPTH or holds more than MAX_NODES values (aliases counted each
    time they are used): the merge and validation below recurse and copy, so a crafted file (a
    billion-laughs alias chain) would otherwise cost a traceback or all the memory."""
    stack, nodes = [(data, 1)], 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if depth > MAX_DEPTH:
            raise LlmoptError(f"{what} nests deeper than {MAX_DEPTH} levels")
        if nodes > MAX_NODES:
            raise LlmoptError(f"{what} holds more than {MAX_NODES:,} values (YAML aliases count each time used)")
        if isinstance(value, dict):
            stack += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            stack += [(v, depth + 1) for v in value]


def _normalise(data: dict[str, Any]) -> dict[str, Any]:
    """`model: SPEC` -> `model: {spec: SPEC}`, so a child's spec merges over a parent's {spec, device}."""
    if isinstance(data.get("model"), str):
        data = dict(data, model={"spec": data["model"]})
    return data


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`: mappings merge key by key, anything else (lists, scalars, null) replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve_extends(path: Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The file's data merged over what it `extends` (recursively), with `extends` removed."""
    path = Path(path).expanduser()
    real = path.resolve()
    if real in _chain:
        cycle = " -> ".join(p.name for p in (*_chain[_chain.index(real):], real))
        raise LlmoptError(f"recipe {path}: extends cycle {cycle}")
    data = read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent.strip():
        raise LlmoptError(f"recipe {path}: extends must be a path to another recipe (relative to this file), "
                          f"got {parent!r}")
    parent_path = (real.parent / parent).expanduser()
    if not parent_path.is_file():
        raise LlmoptError(f"recipe {path}: extends {parent!r}, but {parent_path} does not exist")
    return deep_merge(resolve_extends(parent_path, (*_chain, real)), data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'quantize.group_size=128' -> (['quantize', 'group_size'], 128); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise LlmoptError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. quantize.group_size=128")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. an unbalanced bracket in a text): take it as text
    except (RecursionError, ValueError) as exc:
        raise LlmoptError(f"--set {key.strip()}: the value cannot be read ({type(exc).__name__})") from None
    check_shape(value, f"--set {key.strip()}")
    return [p.strip() for p in parts], value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE ...` into the merged recipe data (checked with the rest by `validate`)."""
    data = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif isinstance(child, str) and parts[:i + 1] == ["model"]:
                child = node[part] = {"spec": child}
            elif not isinstance(child, dict):
                raise LlmoptError(f"--set {text!r}: {'.'.join(parts[:i + 1])} is a {type(child).__name__}, "
                                  "not a section of keys")
            node = child
        node[parts[-1]] = value
    return _normalise(data)


def validate(data: dict[str, Any], source: str) -> Recipe:
    """The merged data as a `Recipe`; the first problem as one line naming `source` and the key."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        raise LlmoptError(f"recipe {source}: {_describe(errors[0])}"
                          + (f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})"
                             if len(errors) > 1 else "")) from None


def load_recipe(path: Path | str, overrides: list[str] | None = None) -> Recipe:
    """Read, resolve `extends`, apply `--set` overrides and validate one recipe."""
    data = resolve_extends(Path(path))
    if overrides:
        data = apply_overrides(data, overrides)
    return validate(data, str(path))


@cache
def builtin_defaults() -> Recipe:
    """llmopt's default eval settings and gates (`llmopt/eval/default-gates.yaml`), as a recipe."""
    ref = resources.files("llmopt.eval").joinpath(BUILTIN_DEFAULTS)
    with resources.as_file(ref) as path:
        return load_recipe(path)


def eval_settings(section: EvalSection | None) -> dict[str, Any]:
    """A recipe's `eval` section as a layer of eval settings (`llmopt.eval.settings.resolve_settings`):
    the task settings it states, without the run options (baseline, cache, engine)."""
    if section is None:
        return {}
    settings = section.given(*EVAL_RUN_KEYS)
    if settings.get("gates") in (["none"], ["None"]):
        settings["gates"] = []  # `gates: none`, as --gate none
    return settings


def recipe_eval_settings(path: Path | str) -> dict[str, Any]:
    """`llmopt eval --recipe FILE`: the eval settings of a recipe file (model, baseline and engine come from flags)."""
    return eval_settings(load_recipe(path).eval)


# ---------------------------------------------------------------------------- error lines


def _describe(error: dict[str, Any]) -> str:
    loc, kind = tuple(error["loc"]), error["type"]
    fields, model = _walk(loc[:-1] if kind == "extra_forbidden" else loc)
    if kind == "extra_forbidden":
        key = str(loc[-1])
        where = ".".join(fields + [key])
        valid = sorted(model.model_fields) if model is not None else []
        near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(valid)}"
        return f"unknown key {where!r} ({hint})"
    where = ".".join(fields) or "(top level)"
    value = error.get("input")
    message = error["msg"]
    if kind == "string_type" and isinstance(value, (int, float)) and "gates" in loc:
        message += "; write each gate as a quoted string (YAML reads +0.5 as the number 0.5 and drops its sign)"
    if kind == "missing":
        return f"{where}: required key missing"
    return f"{where}: {message} (got {value!r})"


def _walk(loc: tuple[Any, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """The readable path of a pydantic error location (union-member tags dropped) and the model at its end."""
    model: type[BaseModel] | None = Recipe
    names: list[str] = []
    for part in loc:
        if isinstance(part, int):
            names[-1:] = [f"{names[-1]}[{part}]"] if names else [f"[{part}]"]
            continue
        if model is not None and part in model.model_fields:
            names.append(part)
            model = _model_in(model.model_fields[part].annotation)
        # anything else is a union member's tag ('int', "literal['all']"): not a key
    return names, model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
