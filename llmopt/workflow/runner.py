"""`run_recipe`: the stages of a recipe in order, reusing what the run folder already holds.

Before anything runs, every stage is planned and checked (`Stage.check`: the libraries' own
validation), so a bad key, gate or option costs seconds, not a quantization.

Reuse: when a stage finishes, `<output>/.llmopt-run/<stage>.json` (its stamp) records a hash of
the stage's resolved configuration, the identity of its inputs (a model spec and, for a local
model, its files' names, sizes and modification times; another stage's output: that stage's
hash) and the llmopt version, with the stage's figures. A later run whose hash matches, and
whose outputs still exist, reuses the stage instead of running it; a changed input changes every
stage downstream of it. An eval whose gate failed is stamped too (its figures are valid): after
a failed gate, changing the gates or the bench plan re-runs only what they affect, never the
quantization.

A failed gate stops the run (the later stages are `not run`); `results.json` and `report.md`
are written whatever happens, atomically.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt import __version__
from llmopt.core.atomic import atomic_file
from llmopt.core.output_paths import inside
from llmopt.errors import LlmoptError
from llmopt.recipes.schema import Recipe
from llmopt.workflow.command_line import render
from llmopt.workflow.stages import DONE, ERROR, GATE_FAILED, NOT_RUN, QUANTIZE, RECIPE_COPY, REUSED, SERVE, Observer, \
    Stage, StageOutcome, plan_stages

RUNS = "runs"  # the default parent of run folders: runs/<recipe name>
STAMPS = ".llmopt-run"
RESULTS = "results.json"
FORMAT_VERSION = 1

@dataclass
class RunResult:
    recipe: Recipe
    recipe_file: str
    output_dir: Path
    stages: list[Stage]
    outcomes: list[StageOutcome] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        if any(o.status == ERROR for o in self.outcomes):
            return 2
        return 1 if any(o.status == GATE_FAILED for o in self.outcomes) else 0


def run_folder(recipe: Recipe, recipe_file: Path, output: Path | None) -> Path:
    """The run folder: `--output` as given, else `runs/<name>`, where the recipe's name must stay inside runs/."""
    if output is not None:
        return Path(output)
    return inside(Path(RUNS), recipe.name or Path(recipe_file).stem, "name")


def prepare(recipe: Recipe, output_dir: Path) -> list[Stage]:
    """Plan and check every stage (LlmoptError on the first problem), before anything runs or is written."""
    stages = plan_stages(recipe, output_dir)
    _check_checkpoint_name(stages, Path(output_dir))
    for stage in stages:
        try:
            stage.check()
        except LlmoptError as exc:
            raise LlmoptError(f"{stage.name}: {exc}") from None
    return stages


def run_recipe(recipe: Recipe, recipe_file: str, output_dir: Path, stages: list[Stage],
               observer: Observer | None = None) -> RunResult:
    """Run `stages` (from `prepare`) in order; writes results.json and report.md whatever the outcome."""
    from llmopt.workflow.report import write_report

    observer = observer or Observer()
    output_dir = Path(output_dir)
    start = time.perf_counter()
    result = RunResult(recipe, recipe_file, output_dir, stages, commands=[render(s.invocation) for s in stages])
    keys: dict[str, str] = {}
    stopped = False
    try:
        for stage in stages:
            if stage.name == SERVE or stopped:
                result.outcomes.append(StageOutcome(stage.name, NOT_RUN))
                continue
            key = stage_key(stage, keys)
            keys[stage.name] = key
            observer.stage_started(stage)
            outcome = _reuse(stage, key, output_dir)
            if outcome is None:
                t0 = time.perf_counter()
                try:
                    figures = stage.execute(observer)
                except LlmoptError as exc:
                    outcome = StageOutcome(stage.name, ERROR, time.perf_counter() - t0, key, error=str(exc))
                    result.outcomes.append(outcome)
                    observer.stage_finished(stage, outcome)
                    raise
                status = GATE_FAILED if stage.gate and figures["llmopt"]["exit_code"] else DONE
                outcome = StageOutcome(stage.name, status, round(time.perf_counter() - t0, 2), key, figures)
                _write_stamp(output_dir, stage, outcome)
            result.outcomes.append(outcome)
            observer.stage_finished(stage, outcome)
            stopped = outcome.status == GATE_FAILED
    finally:
        done = {o.name for o in result.outcomes}
        result.outcomes += [StageOutcome(s.name, NOT_RUN) for s in stages if s.name not in done]
        result.seconds = round(time.perf_counter() - start, 2)
        write_results(result)
        write_report(result)
    return result


def _check_checkpoint_name(stages: list[Stage], output_dir: Path) -> None:
    """quantize.output must not take the name of a file or folder the run itself writes."""
    from llmopt.workflow.report import COMMANDS, REPORT

    taken = {STAMPS, RESULTS, REPORT, COMMANDS, RECIPE_COPY}
    taken |= {p.relative_to(output_dir).parts[0] for s in stages if s.name != QUANTIZE for p in s.outputs
              if p.is_relative_to(output_dir)}
    for stage in stages:
        if stage.name == QUANTIZE and stage.outputs[0].relative_to(output_dir).parts[0] in taken:
            raise LlmoptError(f"quantize.output: {stage.outputs[0].relative_to(output_dir)} is where the run writes "
                              f"its own files ({', '.join(sorted(taken))}); choose another name, e.g. 'model'")


# ---------------------------------------------------------------------------- stamps


def identity(spec: str, keys: dict[str, str]) -> Any:
    """What a stage's input is: another stage's hash, or a model spec (+ its files when it is local)."""
    if spec in keys:
        return {"stage": spec, "key": keys[spec]}
    path = Path(spec).expanduser()
    if path.is_file():
        st = path.stat()
        return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"path": str(path.resolve()),
                "files": [[str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
    return {"spec": spec}  # 'default' or a hub id


def stage_key(stage: Stage, keys: dict[str, str]) -> str:
    payload = {"stage": stage.name, "config": stage.config, "inputs": [identity(i, keys) for i in stage.inputs],
               "llmopt": __version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _stamp_path(output_dir: Path, stage: Stage) -> Path:
    return output_dir / STAMPS / (stage.name.replace(" ", "-") + ".json")


def _reuse(stage: Stage, key: str, output_dir: Path) -> StageOutcome | None:
    """The stamped outcome when the stage ran before with the same key and its outputs are still there."""
    path = _stamp_path(output_dir, stage)
    if not stage.reusable or not path.is_file() or not all(p.exists() for p in stage.outputs):
        return None
    try:
        stamp = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # unreadable: run the stage again
    if stamp.get("key") != key:
        return None
    status = GATE_FAILED if stamp.get("status") == GATE_FAILED else REUSED
    return StageOutcome(stage.name, status, stamp.get("seconds", 0.0), key, stamp.get("figures"))


def _write_stamp(output_dir: Path, stage: Stage, outcome: StageOutcome) -> None:
    path = _stamp_path(output_dir, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"stage": stage.name, "key": outcome.key, "status": outcome.status, "seconds": outcome.seconds,
             "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "llmopt": __version__, "figures": outcome.figures}
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(stamp, indent=1, default=str) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------- results.json


def results_document(result: RunResult) -> dict[str, Any]:
    from llmopt.bench.environment import collect_metadata

    by_name = {o.name: o for o in result.outcomes}
    stages = []
    for stage, command in zip(result.stages, result.commands):
        o = by_name.get(stage.name) or StageOutcome(stage.name, NOT_RUN)
        entry = {"name": stage.name, "status": o.status, "seconds": o.seconds, "key": o.key,
                 "command": command, "outputs": [_relative(p, result.output_dir) for p in stage.outputs]}
        if o.error:
            entry["error"] = o.error
        if o.figures is not None:
            entry["figures"] = o.figures
        stages.append(entry)
    return {"llmopt_run": FORMAT_VERSION, "recipe_file": result.recipe_file, "name": result.recipe.name,
            "recipe": result.recipe.model_dump(exclude_none=True), "metadata": collect_metadata(),
            "seconds": result.seconds, "exit_code": result.exit_code, "passed": result.exit_code == 0,
            "stages": stages}


def write_results(result: RunResult) -> Path:
    path = result.output_dir / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(results_document(result), indent=2, default=str) + "\n", encoding="utf-8")
    return path


def _relative(path: Path, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return str(path)
