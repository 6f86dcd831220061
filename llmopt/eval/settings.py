"""What `llmopt eval` runs: tasks, gates and task options, from built-in defaults, a recipe and flags.

Precedence: a flag given on the command line > the recipe's `eval` section (`--recipe FILE`,
read by llmopt/recipes like every recipe and handed over as a layer of settings) > the defaults.
Setting names are the flag names with `_` for `-` (`ctx_size`, `mmlu_path`, ...).

`DEFAULTS` is the default task set and gates, read from llmopt/eval/default-gates.yaml (a
partial recipe, which llmopt/recipes also validates as one: its comments say why each task and
bound was chosen so that the shipped data can resolve it).
"""

from __future__ import annotations

import math
from importlib import resources
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from llmopt.errors import LlmoptError

TASKS = ("ppl", "kld", "mmlu", "humaneval")
HUMANEVAL_MODES = ("completion", "chat")


@dataclass
class EvalSettings:
    tasks: list[str] = field(default_factory=lambda: list(DEFAULTS["tasks"]))
    gates: list[str] | None = None  # None: the default gates when there is a baseline
    text: str | None = None  # None: the bundled text
    ctx_size: int = 512  # llama.cpp's --ctx-size: chunk length for ppl/kld
    chunks: int | None = 16  # llama.cpp's --chunks; None: all whole chunks of the text
    mmlu_path: str | None = None  # None: the bundled subset
    num_fewshot: int = 0
    mmlu_limit: int | float | None = None  # per subject; None: all
    humaneval_limit: int | float | None = None  # first N problems (a fraction: of all); None: all 164
    humaneval_mode: str = "completion"
    humaneval_samples: int = 1  # 1: greedy; n > 1: sampled at `temperature`, seeds seed..seed+n-1
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0  # HumanEval sample i uses seed + i; the bootstrap's seed
    bootstrap_samples: int = 1000
    strict: bool = False  # inconclusive gates fail too (exit 1)
    pass_k: list[int] = field(default_factory=lambda: [1])
    humaneval_max_tokens: int = 384
    timeout: float = 5.0  # sandbox seconds per program
    # where settings came from, for the report
    explicit_tasks: bool = False
    gates_source: str = "default"  # "flag" | "recipe" | "default"


SETTING_NAMES = {f.name for f in fields(EvalSettings)} - {"explicit_tasks", "gates_source"}


DEFAULT_GATES_FILE = "default-gates.yaml"  # package data of llmopt.eval


def _defaults() -> dict[str, Any]:
    text = resources.files("llmopt.eval").joinpath(DEFAULT_GATES_FILE).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    return {"description": data.get("description"),
            **{k: v for k, v in (data.get("eval") or {}).items() if v is not None}}


DEFAULTS: dict[str, Any] = _defaults()


def parse_tasks(value: str | list[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    tasks = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise LlmoptError(f"bad task list {value!r}: expected names from {', '.join(TASKS)}, comma-separated")
        name = item.strip().lower()
        if name not in TASKS:
            raise LlmoptError(f"unknown task {item.strip()!r}; known tasks: {', '.join(TASKS)}")
        if name not in tasks:
            tasks.append(name)
    return tasks


def parse_limit(value: Any, what: str = "--limit") -> int | float | None:
    """N (a count), a fraction in (0, 1), or 'all'/None."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("all", "none")):
        return None
    if isinstance(value, bool):
        raise LlmoptError(f"{what} must be a positive number or 'all', got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise LlmoptError(f"{what} must be a positive number or 'all', got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise LlmoptError(f"{what} must be positive (a count, or a fraction below 1), got {value!r}")
    if number >= 1:
        if number != int(number):
            raise LlmoptError(f"{what} must be a whole number of items or a fraction below 1, got {value!r}")
        return int(number)
    return number


def parse_pass_k(value: str | list[int]) -> list[int]:
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        ks = sorted({int(str(k).strip()) for k in items})
    except ValueError:
        raise LlmoptError(f"--pass-k must be comma-separated positive integers, got {value!r}") from None
    if not ks or ks[0] < 1:
        raise LlmoptError(f"--pass-k values must be >= 1, got {value!r}")
    return ks


def resolve_settings(flags: dict[str, Any], recipe: dict[str, Any] | None, has_baseline: bool,
                     samples_file: bool = False) -> EvalSettings:
    """Merge defaults, recipe and flags (None = not given) and check every value. `samples_file`: HumanEval
    scores given completions (`--samples`), whose count per problem is the file's, checked when it is read."""
    merged: dict[str, Any] = {}
    explicit_tasks = False
    gates_source = "default"
    builtin = {k: v for k, v in DEFAULTS.items() if k not in ("description", "tasks", "gates")}
    for layer, name in ((builtin, "default"), (recipe or {}, "recipe"), (flags, "flag")):
        for key, value in layer.items():
            if value is None and name == "flag":
                continue
            if key == "limit":
                merged["mmlu_limit"] = merged["humaneval_limit"] = value
            else:
                merged[key] = value
            if key == "tasks" and name != "default":
                explicit_tasks = True
            if key == "gates" and name != "default":
                gates_source = name
    s = EvalSettings(explicit_tasks=explicit_tasks, gates_source=gates_source)
    for key, value in merged.items():
        setattr(s, key, value)

    s.tasks = parse_tasks(s.tasks)
    if not explicit_tasks and not has_baseline:
        s.tasks = [t for t in s.tasks if t != "kld"]  # the default set, minus what needs a baseline
    if "kld" in s.tasks and not has_baseline:
        raise LlmoptError("task kld compares the model with a baseline: pass --baseline MODEL (e.g. the unquantized model)")
    if s.gates is not None and not isinstance(s.gates, (str, list)):
        raise LlmoptError(f"gates must be a string or a list of strings, got {type(s.gates).__name__}")
    s.mmlu_limit = parse_limit(s.mmlu_limit, "--limit (MMLU questions per subject)")
    s.humaneval_limit = parse_limit(s.humaneval_limit, "--limit (HumanEval problems)")
    s.pass_k = parse_pass_k(s.pass_k)
    _check_int(s, "ctx_size", 4)
    if isinstance(s.chunks, str) and s.chunks.strip().lower() == "all":
        s.chunks = None
    if s.chunks is not None:
        _check_int(s, "chunks", 1)
    _check_int(s, "bootstrap_samples", 1)
    if not isinstance(s.strict, bool):
        raise LlmoptError(f"strict must be true or false, got {s.strict!r}")
    _check_int(s, "num_fewshot", 0)
    _check_int(s, "humaneval_samples", 1)
    _check_int(s, "humaneval_max_tokens", 1)
    _check_int(s, "seed", 0)
    if s.humaneval_mode not in HUMANEVAL_MODES:
        raise LlmoptError(f"--humaneval-mode must be one of {', '.join(HUMANEVAL_MODES)}, got {s.humaneval_mode!r}")
    if max(s.pass_k) > s.humaneval_samples and "humaneval" in s.tasks and not samples_file:
        raise LlmoptError(f"pass@{max(s.pass_k)} needs at least {max(s.pass_k)} samples per problem; "
                          f"raise --humaneval-samples (now {s.humaneval_samples})")
    if not isinstance(s.temperature, (int, float)) or s.temperature < 0:
        raise LlmoptError(f"--temperature must be >= 0, got {s.temperature!r}")
    if s.humaneval_samples > 1 and s.temperature == 0:
        raise LlmoptError("--humaneval-samples > 1 needs --temperature > 0 (greedy samples would all be the same)")
    if not isinstance(s.timeout, (int, float)) or not s.timeout > 0:
        raise LlmoptError(f"--timeout must be positive, got {s.timeout!r}")
    return s


def _check_int(s: EvalSettings, name: str, minimum: int) -> None:
    value = getattr(s, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        flag = "--" + name.replace("_", "-")
        raise LlmoptError(f"{flag} must be an integer >= {minimum}, got {value!r}")
