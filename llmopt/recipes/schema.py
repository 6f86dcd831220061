"""The recipe schema: one YAML file drives quantize -> eval -> bench -> serve (`llmopt run`).

Every section mirrors the command it drives, its keys being that command's flag names with
`_` for `-` (`group_size` for `--group-size`). A key left out (or null) means the command's
own default, so a recipe states only what it changes and `commands.sh` repeats only those
flags. Unknown keys are errors (`extra="forbid"`); values are checked for type here and for
meaning (method names, gate syntax, ...) by the library that runs them, before any stage runs.

    name, description     free text
    extends               another recipe (a path relative to this file), deep-merged under this one
    model                 the source model: a spec string, or {spec, dtype, device} (device and dtype
                          are every stage's default)
    quantize              `llmopt quantize` options; `calibration`: source (--calib), num_samples,
                          seq_len, seed
    eval                  `llmopt eval` options: tasks, gates (today's gate syntax, eval/gates/spec.py), task
                          options, baseline (default: the source model when the recipe quantizes)
    bench                 a plan: `throughput`, `latency` and `serve` (`llmopt bench ...`), each with its
                          options; they run in that order, those present only
    serve                 `llmopt serve` flags; `llmopt run --serve` starts it, else commands.sh holds it
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeInt, PositiveInt, create_model, \
    model_validator

from llmopt.bench.latency import LatencyRequest
from llmopt.bench.serve_args import BenchServeArgs
from llmopt.bench.throughput import ThroughputRequest
from llmopt.eval.args import EvalArgs
from llmopt.options import declared
from llmopt.quant.quantize import QuantizeRequest
from llmopt.runtime.engine_args import EngineArgs
from llmopt.serve.launch import ServeArgs


def _comma_list(value: Any) -> Any:
    """'a,b' -> ['a', 'b'] (the CLI's comma-separated form); lists pass through."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return value


def _gate_list(value: Any) -> Any:
    # a bare string is one comma-separated `--gate` spec; numbers are refused below (YAML drops the sign of +0.5)
    return [value] if isinstance(value, str) else value


Names = Annotated[list[str], BeforeValidator(_comma_list)]
Ints = Annotated[list[int], BeforeValidator(_comma_list)]
Gates = Annotated[list[str], BeforeValidator(_gate_list)]
Positive = PositiveInt
Count = NonNegativeInt


class Section(BaseModel):
    """Unknown keys are errors; values are type-checked as they come (no silent coercion of numbers to text)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def given(self, *exclude: str) -> dict[str, Any]:
        """The keys the recipe set (not null), nested sections excluded by name."""
        return {k: v for k, v in self.model_dump(exclude=set(exclude)).items() if v is not None}


def _recipe_type(tp: Any, comma: bool, choices: tuple[str, ...] | None) -> Any:
    """A request field's type as a recipe states it: optional, paths as text, comma lists as lists."""
    if choices:
        return Literal[choices]  # type: ignore[valid-type]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if tp is Path:
        return str
    if typing.get_origin(tp) is list:  # a recipe may write any list as "a,b", as the command line does
        return Annotated[tp, BeforeValidator(_comma_list)]
    return tp


def section_model(name: str, *requests: type, exclude: tuple[str, ...] = (), base: type[Section] = None,
                  **extra: Any) -> type[Section]:
    """A recipe section whose keys are the recipe keys of `requests`' declared options (each optional:
    a key left out is the command's default), nested keys (`calibration.source`) as sub-sections,
    plus `extra` fields (pydantic `(type, default)` pairs) that only a recipe has."""
    fields: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for request in requests:
        for d in declared(request, exclude):
            key = d.recipe_key
            if key is None:
                continue
            bounds = {k: getattr(d.flag, k) for k in ("ge", "gt", "le", "lt") if getattr(d.flag, k) is not None}
            tp = d.flag.recipe_type or _recipe_type(d.type, d.flag.comma, d.flag.choices)
            spec = (tp, Field(..., **bounds)) if d.flag.recipe_required else (Optional[tp], Field(None, **bounds))
            section, _, sub_key = key.rpartition(".")
            (nested.setdefault(section, {}) if section else fields)[sub_key] = spec
    for section, spec in nested.items():
        model = create_model(f"{name}_{section}", __base__=Section, **spec)
        fields[section] = (model, model())
    fields.update(extra)
    return create_model(name, __base__=base or Section, **fields)


# The paged runtime's options (vLLM's names), as `llmopt generate/eval/bench/serve` take them
EngineFlags = section_model("EngineFlags", EngineArgs)
ENGINE_FLAGS = tuple(EngineFlags.model_fields)


class ModelSection(Section):
    spec: str
    dtype: str | None = None
    device: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, value: Any) -> Any:
        return {"spec": value} if isinstance(value, str) else value


class QuantizeSection(section_model("QuantizeOptions", QuantizeRequest)):
    """`llmopt quantize`'s options; `calibration`: source (--calib), num_samples, seq_len, seed."""

    output: str | None = None  # the checkpoint's name inside the run folder (default: model, or model.gguf)


# `llmopt eval`'s options; gates in the `--gate` syntax (a string, or a list of them)
EvalSection = section_model("EvalSection", EvalArgs, gates=(Optional[Gates], None))


# The keys of `eval` that are run options, not task settings (llmopt.eval.settings.EvalSettings).
EVAL_RUN_KEYS = frozenset({"baseline", "cache", *ENGINE_FLAGS})


ThroughputPlan = section_model("ThroughputPlan", ThroughputRequest)
LatencyPlan = section_model("LatencyPlan", LatencyRequest)


ServeBenchPlan = section_model("ServeBenchPlan", BenchServeArgs)


class BenchSection(Section):
    throughput: ThroughputPlan | None = None
    latency: LatencyPlan | None = None
    serve: ServeBenchPlan | None = None


ServeSection = section_model("ServeSection", ServeArgs)


class Recipe(Section):
    name: str | None = None
    description: str | None = None
    model: ModelSection | None = None
    quantize: QuantizeSection | None = None
    eval: EvalSection | None = None
    bench: BenchSection | None = None
    serve: ServeSection | None = None
