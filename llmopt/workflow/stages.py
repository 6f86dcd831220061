"""The stages of a recipe: what each runs (a library call), the equivalent command line, its inputs.

`plan_stages(recipe, output_dir)` turns a validated recipe into `Stage`s in run order
(quantize, eval, bench throughput, bench latency, bench serve, serve). Each stage carries:

- `invocation`: the `llmopt` command that does the same thing (command words, arguments and
  options by flag name); the CLI renders it with its own flag declarations into commands.sh;
- `config`: everything that decides its result, hashed with its input's identity into the stamp
  that lets a re-run reuse it (runner.py);
- `check()`: the library's own validation, run for every stage before any stage starts;
- `execute(observer)`: the library call (quant.quantize, eval.run_eval, bench.run_*), writing the
  stage's files under the run folder and returning its figures for results.json.

Nothing here starts a subprocess of the CLI: the bench engines run in spawned processes of their
own (bench/engines.py), and `bench serve` launches the server the recipe's serve section describes.
"""

from __future__ import annotations

import gc
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmopt.core.output_paths import inside
from llmopt.errors import LlmoptError
from llmopt.options import build, from_recipe
from llmopt.workflow.command_line import Invocation, render
from llmopt.recipes.schema import ENGINE_FLAGS, Recipe

# the eval options a stage passes as flags: how to run (engine, cache); the task settings come from the recipe
EVAL_RUN_OPTIONS = frozenset({"use_cache", *ENGINE_FLAGS})

QUANTIZE, EVAL, THROUGHPUT, LATENCY, BENCH_SERVE, SERVE = (
    "quantize", "eval", "bench throughput", "bench latency", "bench serve", "serve")
RECIPE_COPY = "recipe.yaml"  # the resolved recipe, written into the run folder (eval's --recipe reads it)


DONE, REUSED, GATE_FAILED, NOT_RUN, ERROR = "done", "reused", "gate failed", "not run", "error"


@dataclass
class StageOutcome:
    name: str
    status: str  # DONE | REUSED | GATE_FAILED | NOT_RUN | ERROR
    seconds: float = 0.0
    key: str | None = None
    figures: dict[str, Any] | None = None
    error: str | None = None


class Observer:
    """What the runner reports while it works (the CLI draws it; the default does nothing)."""

    def stage_started(self, stage: Stage) -> None: ...

    def stage_progress(self, stage: Stage, done: int, total: int | None) -> None: ...

    def stage_finished(self, stage: Stage, outcome: Any) -> None: ...


@dataclass
class Stage:
    name: str
    title: str  # one line for the progress display
    invocation: Invocation
    config: dict[str, Any]  # hashed into the stamp, with the identity of `inputs`
    inputs: list[str]  # model specs or paths this stage reads (another stage's output: its name)
    outputs: list[Path]  # what must still exist for the stage to be reused
    check: Callable[[], None]
    execute: Callable[[Observer], dict[str, Any]]
    reusable: bool = True
    gate: bool = False  # exit 1 when its figures say a gate failed


def plan_stages(recipe: Recipe, output_dir: Path) -> list[Stage]:
    """The recipe's stages in run order."""
    if recipe.model is None:
        raise LlmoptError("the recipe has no model: add `model: SPEC` ('default', a folder, a .gguf file or a hub id)")
    output_dir = Path(output_dir)
    source = recipe.model.spec
    stages: list[Stage] = []
    candidate = source
    if recipe.quantize is not None:
        stage = _quantize_stage(recipe, output_dir)
        stages.append(stage)
        candidate = str(stage.outputs[0])
    candidate_from = QUANTIZE if recipe.quantize is not None else candidate
    if recipe.eval is not None:
        stages.append(_eval_stage(recipe, output_dir, candidate, candidate_from))
    serve_stage = _serve_stage(recipe, candidate, candidate_from)
    bench = recipe.bench
    if bench is not None and bench.throughput is not None:
        stages.append(_throughput_stage(recipe, output_dir, candidate, candidate_from))
    if bench is not None and bench.latency is not None:
        stages.append(_latency_stage(recipe, output_dir, candidate, candidate_from))
    if bench is not None and bench.serve is not None:
        stages.append(_bench_serve_stage(recipe, output_dir, candidate, candidate_from, serve_stage))
    stages.append(serve_stage)
    return stages


# ---------------------------------------------------------------------------- helpers


def _defaults(recipe: Recipe, given: dict[str, Any]) -> dict[str, Any]:
    """dtype and device: the section's own, else the model section's (absent: the command's default)."""
    out = {"dtype": recipe.model.dtype, "device": recipe.model.device}
    out.update({k: given[k] for k in ("dtype", "device") if given.get(k) is not None})
    return {k: v for k, v in out.items() if v is not None}


def _files(*values: str | None) -> list[str]:
    """The local files among data options (a calibration text, an eval text, a dataset): inputs whose
    contents decide a stage's result, so their size and modification time go into its stamp."""
    return [v for v in values if v and Path(v).expanduser().is_file()]


def _free_memory() -> None:
    """Drop the previous stage's model before the next loads (stages run in one process)."""
    gc.collect()
    from llmopt.core.memory import release_freed_memory

    release_freed_memory()


# ---------------------------------------------------------------------------- quantize


def _quantize_stage(recipe: Recipe, output_dir: Path) -> Stage:
    from llmopt.quant.quantize import QuantizeRequest

    q = recipe.quantize
    values = from_recipe(QuantizeRequest, q.given("output"))
    if "device" not in values and recipe.model.device:
        values["device"] = recipe.model.device
    fmt = q.format or ("gguf" if q.method == "gguf" else None)
    # the recipe names the checkpoint inside the run folder, never a place outside it (stage forces --overwrite)
    output = inside(output_dir, q.output, "quantize.output") if q.output is not None \
        else output_dir / ("model.gguf" if fmt == "gguf" else "model")
    flags = {**values, "output": str(output), "overwrite": True}
    request = build(QuantizeRequest, {**flags, "model": recipe.model.spec, "output": output})

    def check() -> None:
        from llmopt.quant.quantize import validate

        validate(request)

    def execute(observer: Observer) -> dict[str, Any]:
        from llmopt.quant.quantize import quantize

        _free_memory()
        report = quantize(request, on_layer=lambda done, total: observer.stage_progress(stage, done, total))
        figures = report.to_dict()
        figures.pop("layers")  # per-layer errors stay in quantize_report.json beside the checkpoint
        return figures

    stage = Stage(QUANTIZE, f"quantize {recipe.model.spec} ({q.method})",
                  Invocation(("quantize",), [recipe.model.spec], flags, QuantizeRequest),
                  config={"request": {k: v for k, v in asdict(request).items() if k not in ("output", "overwrite")}},
                  inputs=[recipe.model.spec, *_files(values.get("calib"))], outputs=[output], check=check,
                  execute=execute)
    return stage


# ---------------------------------------------------------------------------- eval


def _eval_stage(recipe: Recipe, output_dir: Path, candidate: str, candidate_from: str) -> Stage:
    from llmopt.eval.args import EvalArgs
    from llmopt.recipes.loader import eval_settings

    section = recipe.eval
    given = section.given()
    baseline = section.baseline
    if baseline is None and recipe.quantize is not None:
        baseline = recipe.model.spec  # the unquantized source
    if baseline is not None and baseline.strip().lower() == "none":
        baseline = None
    settings_layer = eval_settings(section)  # task settings: the recipe's (as `eval --recipe` reads them)
    run_values = {k: v for k, v in from_recipe(EvalArgs, given).items() if k in EVAL_RUN_OPTIONS}
    run_values.update(_defaults(recipe, given))
    results_path = output_dir / "eval" / "results.json"
    flags: dict[str, Any] = {"baseline": baseline, "recipe": str(output_dir / RECIPE_COPY), **run_values,
                             "output": str(results_path)}
    args = build(EvalArgs, {**run_values, "model": candidate, "baseline": baseline})

    def check() -> None:
        from llmopt.eval.run import resolve_gates

        request = args.eval_request(settings_layer)
        resolve_gates(request.settings, baseline is not None)

    def execute(observer: Observer) -> dict[str, Any]:
        from llmopt.eval.evaluate import evaluate

        _free_memory()
        results_path.parent.mkdir(parents=True, exist_ok=True)
        return evaluate(args, settings_layer, output=results_path).document

    return Stage(EVAL, f"eval {Path(candidate).name}" + (f" vs {baseline}" if baseline else ""),
                 Invocation(("eval",), [candidate], flags, EvalArgs),
                 config={"settings": settings_layer, "run": {k: v for k, v in run_values.items()}},
                 inputs=[candidate_from, *([baseline] if baseline else []), *_files(section.text, section.mmlu_path)],
                 outputs=[results_path],
                 check=check, execute=execute, gate=True)


# ---------------------------------------------------------------------------- bench


def _throughput_stage(recipe: Recipe, output_dir: Path, candidate: str, candidate_from: str) -> Stage:
    from llmopt.bench.throughput import ThroughputRequest

    given = recipe.bench.throughput.given()
    folder = output_dir / "bench" / "throughput"
    values = {**from_recipe(ThroughputRequest, given), **_defaults(recipe, given)}
    request = build(ThroughputRequest, {**values, "model": candidate})

    def check() -> None:
        from llmopt.bench.engines import check_options

        check_options(request.config().options)

    def execute(observer: Observer) -> dict[str, Any]:
        from llmopt.bench.offline_report import write_throughput_report
        from llmopt.bench.throughput import run_throughput

        _free_memory()
        document = run_throughput(request.config())
        write_throughput_report(folder, document)
        return document

    return Stage(THROUGHPUT, f"bench throughput ({', '.join(request.engines)})",
                 Invocation(("bench", "throughput"), [candidate], {**values, "output": str(folder)}, ThroughputRequest),
                 config={"plan": given}, inputs=[candidate_from, *_files(given.get("dataset"), given.get("gguf"))],
                 outputs=[folder / "results.json"], check=check, execute=execute)


def _latency_stage(recipe: Recipe, output_dir: Path, candidate: str, candidate_from: str) -> Stage:
    from llmopt.bench.latency import LatencyRequest

    given = recipe.bench.latency.given()
    folder = output_dir / "bench" / "latency"
    values = {**from_recipe(LatencyRequest, given), **_defaults(recipe, given)}
    request = build(LatencyRequest, {**values, "model": candidate})

    def check() -> None:
        from llmopt.bench.latency import check_config

        check_config(request.config())

    def execute(observer: Observer) -> dict[str, Any]:
        from llmopt.bench.latency import run_latency
        from llmopt.bench.offline_report import write_latency_report

        _free_memory()
        document = run_latency(request.config())
        write_latency_report(folder, document)
        return document

    return Stage(LATENCY, f"bench latency (batch {', '.join(map(str, request.batch_size))})",
                 Invocation(("bench", "latency"), [candidate], {**values, "output": str(folder)}, LatencyRequest),
                 config={"plan": given}, inputs=[candidate_from], outputs=[folder / "results.json"], check=check,
                 execute=execute)


def _bench_serve_stage(recipe: Recipe, output_dir: Path, candidate: str, candidate_from: str, serve: Stage) -> Stage:
    from llmopt.bench.serve_args import BenchServeArgs

    given = recipe.bench.serve.given()
    folder = output_dir / "bench" / "serve"
    values = from_recipe(BenchServeArgs, given)
    if "url" not in values:
        values["model"] = candidate
        if "serve_args" not in values and values.get("launch", "llmopt") == "llmopt":
            # the server the recipe deploys: `llmopt serve CHECKPOINT <the serve section's flags>` (the launcher
            # picks host and port)
            serve_flags = {k: v for k, v in serve.invocation.options.items() if k not in ("host", "port")}
            serve_argv = render(Invocation(("serve",), [candidate], serve_flags, serve.invocation.request))[3:]  # after `llmopt serve CHECKPOINT`
            if serve_argv:
                values["serve_args"] = shlex.join(serve_argv)
    args = build(BenchServeArgs, values)

    def check() -> None:
        args.config()

    def execute(observer: Observer) -> dict[str, Any]:
        from llmopt.bench.online import run_serve_bench
        from llmopt.bench.online_report import build_document, write_report

        _free_memory()
        runs_done = {"n": 0}

        def on_point(point, total: int) -> None:
            runs_done["n"] = 0
            runs_done["total"] = total

        def on_result(result) -> None:
            runs_done["n"] += 1
            observer.stage_progress(stage, runs_done["n"], runs_done.get("total"))

        config = args.config()
        name, runs = run_serve_bench(config, on_point=on_point, on_result=on_result)
        document = build_document(config, name, runs, args.save_detailed)
        write_report(folder, document, runs)
        return document

    stage = Stage(BENCH_SERVE, "bench serve (" + (args.sweep or f"{args.workload.num_prompts} requests") + ")",
                  Invocation(("bench", "serve"), [], {**values, "output": str(folder)}, BenchServeArgs),
                  config={"plan": given, "serve_args": values.get("serve_args", "")},
                  inputs=[candidate_from], outputs=[folder / "results.json"], check=check, execute=execute)
    return stage


# ---------------------------------------------------------------------------- serve


def _serve_stage(recipe: Recipe, candidate: str, candidate_from: str) -> Stage:
    from llmopt.serve.launch import ServeArgs

    given = recipe.serve.given() if recipe.serve is not None else {}
    values = {**from_recipe(ServeArgs, given), **_defaults(recipe, given)}
    if values.get("engine_name") == "vllm":
        values.pop("device", None)  # vLLM picks its GPUs itself; `llmopt serve --engine vllm` ignores --device
    args = build(ServeArgs, {**values, "model": candidate})

    def execute(observer: Observer) -> dict[str, Any]:  # the CLI hands the process to the server instead
        raise LlmoptError("the serve stage runs as its own process (llmopt run --serve)")

    return Stage(SERVE, f"serve {Path(candidate).name} ({args.engine_name})",
                 Invocation(("serve",), [candidate], values, ServeArgs), config={"flags": values}, inputs=[candidate_from],
                 outputs=[], check=args.check, execute=execute, reusable=False)
