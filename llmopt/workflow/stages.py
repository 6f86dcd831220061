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

from llmopt.errors import LlmoptError
from llmopt.recipes.schema import ENGINE_FLAGS, Recipe

QUANTIZE, EVAL, THROUGHPUT, LATENCY, BENCH_SERVE, SERVE = (
    "quantize", "eval", "bench throughput", "bench latency", "bench serve", "serve")
RECIPE_COPY = "recipe.yaml"  # the resolved recipe, written into the run folder (eval's --recipe reads it)


@dataclass
class Invocation:
    """An `llmopt` command line before rendering: options by the recipe's key (its flag without dashes)."""

    command: tuple[str, ...]
    arguments: list[str]
    options: dict[str, Any] = field(default_factory=dict)


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


Render = Callable[[Invocation], list[str]]


def plan_stages(recipe: Recipe, output_dir: Path, render: Render) -> list[Stage]:
    """The recipe's stages in run order; `render` turns an invocation into argv (serve flags for bench serve)."""
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
        stages.append(_bench_serve_stage(recipe, output_dir, candidate, candidate_from, serve_stage, render))
    stages.append(serve_stage)
    return stages


# ---------------------------------------------------------------------------- helpers


def _defaults(recipe: Recipe, given: dict[str, Any]) -> dict[str, Any]:
    """dtype and device: the section's own, else the model section's (absent: the command's default)."""
    out = {"dtype": recipe.model.dtype, "device": recipe.model.device}
    out.update({k: given[k] for k in ("dtype", "device") if given.get(k) is not None})
    return {k: v for k, v in out.items() if v is not None}


def _engine_config(given: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig fields from the engine flags a section set (the rest: the flags' defaults)."""
    from llmopt.runtime.engine_args import EngineArgs

    fields = {k: given[k] for k in ENGINE_FLAGS if k in given and k not in ("dtype", "device")}
    return asdict(EngineArgs(**fields).engine_config())


def _files(*values: str | None) -> list[str]:
    """The local files among data options (a calibration text, an eval text, a dataset): inputs whose
    contents decide a stage's result, so their size and modification time go into its stamp."""
    return [v for v in values if v and Path(v).expanduser().is_file()]


def _free_memory() -> None:
    """Drop the previous stage's model before the next loads (stages run in one process)."""
    gc.collect()
    try:
        from llmopt.core.memory import malloc_trim

        malloc_trim()
    except ImportError:
        pass


# ---------------------------------------------------------------------------- quantize


def _quantize_stage(recipe: Recipe, output_dir: Path) -> Stage:
    from llmopt.quant.quantize import QuantizeRequest

    q = recipe.quantize
    calib = q.calibration.given()
    fmt = q.format or ("gguf" if q.method == "gguf" else None)
    output = output_dir / (q.output or ("model.gguf" if fmt == "gguf" else "model"))
    options = q.given("calibration", "output")
    device = options.pop("device", None) or recipe.model.device
    request = QuantizeRequest(model=recipe.model.spec, output=output, overwrite=True, **options,
                              **({"device": device} if device else {}),
                              **({"calib": calib["source"]} if "source" in calib else {}),
                              **{k: v for k, v in calib.items() if k != "source"})
    flags = {**options, **({"device": device} if device else {}),
             **({"calib": calib["source"]} if "source" in calib else {}),
             **{k: v for k, v in calib.items() if k != "source"}, "output": str(output), "overwrite": True}

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
                  Invocation(("quantize",), [recipe.model.spec], flags),
                  config={"request": {k: v for k, v in asdict(request).items() if k not in ("output", "overwrite")}},
                  inputs=[recipe.model.spec, *_files(calib.get("source"))], outputs=[output], check=check,
                  execute=execute)
    return stage


# ---------------------------------------------------------------------------- eval


def _eval_stage(recipe: Recipe, output_dir: Path, candidate: str, candidate_from: str) -> Stage:
    from llmopt.eval.recipe import recipe_eval_settings

    section = recipe.eval
    given = section.given()
    baseline = section.baseline
    if baseline is None and recipe.quantize is not None:
        baseline = recipe.model.spec  # the unquantized source
    if baseline is not None and baseline.strip().lower() == "none":
        baseline = None
    settings_layer = recipe_eval_settings(section)
    run_opts = _defaults(recipe, given)
    engine_given = {k: v for k, v in given.items() if k in ENGINE_FLAGS and k not in ("dtype", "device")}
    results_path = output_dir / "eval" / "results.json"
    flags: dict[str, Any] = {"baseline": baseline, "recipe": str(output_dir / RECIPE_COPY), **run_opts,
                             **engine_given, "output": str(results_path)}
    if section.cache is not None:
        flags["cache"] = section.cache

    def settings():
        from llmopt.eval.recipe import resolve_settings

        return resolve_settings({}, settings_layer, has_baseline=baseline is not None)

    def check() -> None:
        from llmopt.eval.run import resolve_gates

        resolve_gates(settings(), baseline is not None)
        _engine_config(engine_given)

    def execute(observer: Observer) -> dict[str, Any]:
        from llmopt.eval.report.document import build_document, write_json
        from llmopt.eval.run import EvalRequest, run_eval
        from llmopt.eval.tasks import RunOptions

        _free_memory()
        options = RunOptions(engine=_engine_config(engine_given), use_cache=section.cache is not False, **run_opts)
        report = run_eval(EvalRequest(model=candidate, baseline=baseline, settings=settings(), options=options))
        doc = build_document(report)
        results_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(doc, results_path)
        return doc

    return Stage(EVAL, f"eval {Path(candidate).name}" + (f" vs {baseline}" if baseline else ""),
                 Invocation(("eval",), [candidate], flags),
                 config={"settings": settings_layer, "engine": engine_given, "options": run_opts,
                         "cache": section.cache},
                 inputs=[candidate_from, *([baseline] if baseline else []), *_files(section.text, section.mmlu_path)],
                 outputs=[results_path],
                 check=check, execute=execute, gate=True)


# ---------------------------------------------------------------------------- bench


def _bench_options(recipe: Recipe, given: dict[str, Any], engine: dict[str, Any]):
    from llmopt.bench.engines import EngineOptions

    opts = {k: given[k] for k in ("hf_batch_size", "gguf", "threads") if k in given}
    if "hf_max_requests" in given:
        opts["hf_max_requests"] = given["hf_max_requests"] or None  # 0: every request, as the CLI reads it
    return EngineOptions(engine_config=engine, **_defaults(recipe, given), **opts)


def _throughput_stage(recipe: Recipe, output_dir: Path, candidate: str, candidate_from: str) -> Stage:
    given = recipe.bench.throughput.given()
    folder = output_dir / "bench" / "throughput"
    flags = {**given, **_defaults(recipe, given), "output": str(folder)}

    def config():
        from llmopt.bench.throughput import ThroughputConfig

        fields = {k: given[k] for k in ("dataset", "num_prompts", "input_len", "range_ratio", "prefix_len", "seed")
                  if k in given}
        if "output_len" in given:
            fields["output_len"] = given["output_len"] or None  # 0: a file's own lengths
        engines = ",".join(given.get("engines", ["llmopt"]))
        from llmopt.bench.throughput import parse_engines

        return ThroughputConfig(model=candidate, engines=parse_engines(engines),
                                options=_bench_options(recipe, given, _engine_config(given)), **fields)

    def check() -> None:
        from llmopt.bench.engines import check_options

        check_options(config().options)

    def execute(observer: Observer) -> dict[str, Any]:
        from llmopt.bench.offline_report import write_throughput_report
        from llmopt.bench.throughput import run_throughput

        _free_memory()
        document = run_throughput(config())
        write_throughput_report(folder, document)
        return document

    return Stage(THROUGHPUT, f"bench throughput ({', '.join(given.get('engines', ['llmopt']))})",
                 Invocation(("bench", "throughput"), [candidate], flags), config={"plan": given},
                 inputs=[candidate_from, *_files(given.get("dataset"), given.get("gguf"))], outputs=[folder / "results.json"], check=check, execute=execute)


def _latency_stage(recipe: Recipe, output_dir: Path, candidate: str, candidate_from: str) -> Stage:
    given = recipe.bench.latency.given()
    folder = output_dir / "bench" / "latency"
    flags = {**given, **_defaults(recipe, given), "output": str(folder)}

    def config():
        from llmopt.bench.latency import LatencyConfig

        sizes = given.get("batch_size", [1])
        # as `bench latency` builds it: room for the largest batch, no prefix cache (fresh prompts every iteration)
        engine = _engine_config({**{k: v for k, v in given.items() if k in ENGINE_FLAGS},
                                 "max_num_seqs": max(sizes), "enable_prefix_caching": False})
        fields = {k: given[k] for k in ("input_len", "output_len", "num_iters_warmup", "num_iters", "seed")
                  if k in given}
        return LatencyConfig(model=candidate, engines=given.get("engines", ["llmopt"]), batch_sizes=sizes,
                             options=_bench_options(recipe, given, engine), **fields)

    def check() -> None:
        from llmopt.bench.engines import check_options
        from llmopt.bench.latency import LATENCY_ENGINES

        cfg = config()
        check_options(cfg.options)
        unknown = [e for e in cfg.engines if e not in LATENCY_ENGINES]
        if unknown:
            raise LlmoptError(f"bench.latency.engines: bench latency runs {' and '.join(LATENCY_ENGINES)}; "
                              f"not {unknown[0]!r}")

    def execute(observer: Observer) -> dict[str, Any]:
        from llmopt.bench.latency import run_latency
        from llmopt.bench.offline_report import write_latency_report

        _free_memory()
        document = run_latency(config())
        write_latency_report(folder, document)
        return document

    return Stage(LATENCY, f"bench latency (batch {', '.join(map(str, given.get('batch_size', [1])))})",
                 Invocation(("bench", "latency"), [candidate], flags), config={"plan": given},
                 inputs=[candidate_from], outputs=[folder / "results.json"], check=check, execute=execute)


def _bench_serve_stage(recipe: Recipe, output_dir: Path, candidate: str, candidate_from: str, serve: Stage,
                       render: Render) -> Stage:
    plan = recipe.bench.serve
    given = plan.given()
    folder = output_dir / "bench" / "serve"
    launch = given.get("launch", "llmopt")
    if "serve_args" in given:
        serve_args = shlex.split(given["serve_args"])
    elif launch == "llmopt" and "url" not in given:
        # the server the recipe deploys: `llmopt serve CHECKPOINT <the serve section's flags>` (the launcher
        # picks host and port)
        serve_flags = {k: v for k, v in serve.invocation.options.items() if k not in ("host", "port")}
        serve_args = render(Invocation(("serve",), [candidate], serve_flags))[3:]  # after `llmopt serve CHECKPOINT`
    else:
        serve_args = []
    flags = {k: v for k, v in given.items() if k != "serve_args"}
    if "url" not in given:
        flags["model"] = candidate
    if serve_args:
        flags["serve_args"] = shlex.join(serve_args)
    flags["output"] = str(folder)
    goodput = flags.pop("goodput", None)
    if goodput:
        flags["goodput"] = goodput

    def config():
        import os

        from llmopt.bench.serve import ServeBenchConfig
        from llmopt.bench.serve_metrics import parse_goodput

        fields = {k: v for k, v in given.items() if k not in ("serve_args", "goodput", "save_detailed", "output_len")}
        if "output_len" in given:
            fields["output_len"] = given["output_len"] or None
        if "url" not in given:
            fields["model"] = candidate
        return ServeBenchConfig(serve_args=serve_args, goodput=parse_goodput(given.get("goodput", [])),
                                api_key=os.environ.get("OPENAI_API_KEY") or os.environ.get("LLMOPT_API_KEY") or None,
                                **fields)

    def check() -> None:
        from llmopt.bench.serve import check_config

        check_config(config())

    def execute(observer: Observer) -> dict[str, Any]:
        from llmopt.bench.serve import run_serve_bench
        from llmopt.bench.serve_report import build_document, write_report

        _free_memory()
        runs_done = {"n": 0}

        def on_point(point, total: int) -> None:
            runs_done["n"] = 0
            runs_done["total"] = total

        def on_result(result) -> None:
            runs_done["n"] += 1
            observer.stage_progress(stage, runs_done["n"], runs_done.get("total"))

        name, runs = run_serve_bench(config(), on_point=on_point, on_result=on_result)
        document = build_document(config(), name, runs, bool(given.get("save_detailed")))
        write_report(folder, document, runs)
        return document

    stage = Stage(BENCH_SERVE, "bench serve (" + (given.get("sweep") or f"{given.get('num_prompts', 64)} requests") + ")",
                  Invocation(("bench", "serve"), [], flags),
                  config={"plan": given, "serve_args": serve_args},
                  inputs=[candidate_from], outputs=[folder / "results.json"], check=check, execute=execute)
    return stage


# ---------------------------------------------------------------------------- serve


def _serve_stage(recipe: Recipe, candidate: str, candidate_from: str) -> Stage:
    given = recipe.serve.given() if recipe.serve is not None else {}
    flags = {**given, **_defaults(recipe, given)}
    if flags.get("engine") == "vllm":
        flags.pop("device", None)  # vLLM picks its GPUs itself; `llmopt serve --engine vllm` ignores --device

    def check() -> None:
        if flags.get("engine", "llmopt") == "llmopt":
            _engine_config(given)
        elif given.get("tensor_parallel_size", 1) != 1 and flags.get("engine") != "vllm":
            raise LlmoptError("serve.tensor_parallel_size applies to serve.engine vllm only")

    def execute(observer: Observer) -> dict[str, Any]:  # the CLI hands the process to the server instead
        raise LlmoptError("the serve stage runs as its own process (llmopt run --serve)")

    return Stage(SERVE, f"serve {Path(candidate).name} ({flags.get('engine', 'llmopt')})",
                 Invocation(("serve",), [candidate], flags), config={"flags": flags}, inputs=[candidate_from],
                 outputs=[], check=check, execute=execute, reusable=False)
