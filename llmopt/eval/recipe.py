"""What `llmopt eval` runs: tasks, gates and task options, from built-in defaults, a recipe and flags.

Precedence: a flag given on the command line > the recipe (`--recipe FILE`) > the
defaults below. A recipe is JSON (or YAML) whose eval settings are either top-level or
under an `"eval"` key (so a whole-workflow recipe can carry other sections); setting names
are the flag names with `_` for `-` (`ctx_size`, `mmlu_path`, ...). An unknown
setting is an error, not silently ignored. Write gates as strings: YAML reads `+0.5` as
the number 0.5 and drops the sign, which is the meaning.

`DEFAULTS` is the default task set and gates, and recipes/default-gates.json is the same
document written out for users to copy (a test keeps the two equal). Why these values:

- Tasks ppl, kld, mmlu: what separates a good 4-bit model from a broken one on the default
  model within the CI budget (< 10 minutes for baseline + candidate on 2 CPU cores).
  HumanEval is left out of the default set: generating 164 programs of up to 384 tokens
  costs far more than the rest together on a CPU, and a 135M model passes almost none of
  them, so it would gate on nothing. Add it with `--tasks ppl,kld,mmlu,humaneval`.
- ppl + KLD as llama.cpp's `llama-perplexity` windows them: `ctx_size` 512, 16 chunks
  (8,192 tokens through each model, 16 x 255 = 4,080 scored). For KLD the baseline keeps
  its float16 hidden states and vocabulary projection (59 MiB for the default model).
- MMLU: the whole bundled subset (1,140 questions, 20 per subject), 0-shot.

How each default bound was chosen, so that the shipped data can resolve it (a gate is
resolved when its 95% CI lies wholly on one side of the bound; the CI half-widths below
are from the reports in docs/benchmarks.md, AWQ and RTN w4 g64 vs the fp32 default model):

- `ppl:+25%`: at 4,080 scored tokens the block-bootstrap CI of the relative perplexity
  change is about ±3.4 points (RTN: [+20.5%, +27.2%]), so a candidate gets a verdict unless
  it lies within ~3.4 points of the bound. AWQ (+12%) passes, RTN with one scale per row
  (+73%) fails; plain RTN g64 (+23.8%) comes out inconclusive, which is the honest answer.
- `kld.mean:0.25`: the CI is about ±0.015 nats at 4,080 tokens: AWQ (~0.13, issue 5's windows) passes, plain
  RTN g64 (0.299, CI [0.285, 0.314]) fails significantly, one scale per row (0.66) by far.
- `mmlu.acc:-3.0` on all 1,140 bundled questions: the paired CI half-width is 0.6 (RTN)
  to 2.0 points (AWQ, more answers flipped both ways; RTN g64 measured [-0.70, +0.61]),
  below the 3-point bound, so an unharmed candidate passes. On the 285 questions of 5 per
  subject (the old default) it was ±3.2 points: the bound could not be resolved, hence
  all 1,140 (~3.5 min per model on 2 idle CPU cores; the baseline's answers are cached). On this 135M model MMLU sits at
  chance, so the gate only bites for larger models.
- `humaneval.pass@1:-6.0` (when HumanEval runs, 164 problems): the half-width is about
  1.96 sqrt(f / 164) for a fraction f of problems whose verdict flips: 4.8 points at
  f = 10%, 5.9 at 15%; the old 3-point bound could not be resolved.
- Fewer than `stats.MIN_UNITS` (30) items or token blocks: no interval, "inconclusive".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError

TASKS = ("ppl", "kld", "mmlu", "humaneval")
HUMANEVAL_MODES = ("completion", "chat")

DEFAULTS: dict[str, Any] = {
    "description": "llmopt's default quality gates (what `llmopt eval MODEL --baseline BASE` runs without "
                   "--tasks/--gate/--recipe). Gates of tasks that do not run are skipped.",
    "tasks": ["ppl", "kld", "mmlu"],
    "gates": ["ppl:+25%", "kld.mean:0.25", "mmlu.acc:-3.0", "humaneval.pass@1:-6.0"],
    "ctx_size": 512,
    "chunks": 16,
    "mmlu_limit": None,
    "humaneval_limit": None,
    "bootstrap_samples": 1000,
}


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
RECIPE_ONLY = {"limit", "description", "name"}  # `limit` sets mmlu_limit and humaneval_limit


def load_recipe(path: Path) -> dict[str, Any]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise LlmoptError(f"recipe {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmoptError(f"cannot read recipe {path}: {exc}") from None
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise LlmoptError(f"recipe {path} is not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: "
                          f"{str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise LlmoptError(f"recipe {path}: expected an object of settings, got {type(data).__name__}")
    if "eval" in data:
        data = data["eval"]
        if not isinstance(data, dict):
            raise LlmoptError(f"recipe {path}: 'eval' must be an object of settings")
    unknown = sorted(set(data) - SETTING_NAMES - RECIPE_ONLY)
    if unknown:
        raise LlmoptError(f"recipe {path}: unknown setting(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(SETTING_NAMES | {'limit'}))}")
    return {k: v for k, v in data.items() if k not in ("description", "name")}


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


def resolve_settings(flags: dict[str, Any], recipe: dict[str, Any] | None, has_baseline: bool) -> EvalSettings:
    """Merge defaults, recipe and flags (None = not given) and check every value."""
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
    if max(s.pass_k) > s.humaneval_samples and "humaneval" in s.tasks:
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
