"""Recipes: the ready ones validate and plan into commands that exist; bad keys, bad types and
`extends` cycles are one clear line and exit 2; `extends` and `--set` merge as documented; the
GitHub Actions example is a valid workflow that calls only llmopt commands that exist."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest
import yaml
from conftest import assert_usage_error, run_cli

from llmopt.errors import LlmoptError
from llmopt.recipes import builtin_defaults, load_recipe

ROOT = Path(__file__).parents[1]
READY = sorted((ROOT / "recipes").glob("*.yaml"))


def _click(words):
    import typer

    from llmopt.cli.main import app

    command = typer.main.get_command(app)
    for word in words:
        command = command.commands[word]
    return command


def _parses(argv: list[str]) -> None:
    """argv (`llmopt CMD ... flags`) parses with the command's own declarations (unknown flags raise)."""
    assert argv[0] == "llmopt"
    words, rest = [], argv[1:]
    command = _click([])
    while rest and hasattr(command, "commands") and rest[0] in command.commands:
        words.append(rest[0])
        command = command.commands[rest[0]]
        rest = rest[1:]
    assert words, argv
    command.make_context(" ".join(["llmopt", *words]), list(rest), resilient_parsing=False)


def test_ready_recipes_exist():
    assert {p.name for p in READY} >= {"default.yaml", "llama-3-8b-awq-h100.yaml",
                                       "llama-3-70b-awq-2xa6000-vllm.yaml", "gguf-q4km-laptop.yaml"}


@pytest.mark.parametrize("path", READY, ids=lambda p: p.name)
def test_every_ready_recipe_validates_and_its_commands_parse(path, tmp_path):
    from llmopt.workflow.command_line import render
    from llmopt.workflow.runner import prepare

    recipe = load_recipe(path)
    assert recipe.model is not None and recipe.name == path.stem
    stages = prepare(recipe, tmp_path / "run")  # every stage's library checks
    assert stages[-1].name == "serve"
    for stage in stages:
        _parses(render(stage.invocation))
    assert not (tmp_path / "run").exists()  # checking writes nothing


def test_dry_run_prints_the_default_recipes_commands(tmp_path):
    code, err, out = run_cli("run", str(ROOT / "recipes" / "default.yaml"), "--output", str(tmp_path / "r"),
                             "--dry-run", "--set", "quantize.group_size=128")
    assert code == 0, err
    lines = [shlex.split(line) for line in out.splitlines() if line.startswith("llmopt ")]
    assert [line[1] for line in lines] == ["quantize", "eval", "bench", "bench", "serve"]
    quantize = lines[0]
    assert quantize[quantize.index("--group-size") + 1] == "128" and quantize[2] == "default"
    assert quantize[quantize.index("--output") + 1] == str(tmp_path / "r" / "model")
    assert lines[1][2] == str(tmp_path / "r" / "model") and "--baseline" in lines[1]
    assert not (tmp_path / "r").exists()


def test_builtin_defaults_are_evals_defaults():
    from llmopt.eval.settings import DEFAULTS

    defaults = builtin_defaults().eval
    assert DEFAULTS["gates"] == defaults.gates == ["ppl:+25%", "kld.mean:0.25", "mmlu.acc:-3.0", "humaneval.pass@1:-6.0"]
    assert DEFAULTS["tasks"] == ["ppl", "kld", "mmlu"] and DEFAULTS["ctx_size"] == 512 and DEFAULTS["chunks"] == 16


def test_eval_section_takes_every_eval_setting():
    from llmopt.eval.settings import SETTING_NAMES
    from llmopt.recipes.schema import EvalSection

    assert SETTING_NAMES <= set(EvalSection.model_fields), SETTING_NAMES - set(EvalSection.model_fields)


def test_quantize_choices_match_the_quantizer():
    from typing import get_args

    from llmopt.quant.quantize import FORMATS, METHODS
    from llmopt.recipes.schema import QuantizeSection

    assert get_args(QuantizeSection.model_fields["method"].annotation) == METHODS
    assert set(get_args(get_args(QuantizeSection.model_fields["format"].annotation)[0])) == set(FORMATS)


def test_schema_keys_are_flags_of_their_commands():
    """Each section's keys are its command's flags (both derived from one request declaration): a key
    with no flag, or a flag the command lost, fails here, not in a user's run."""
    import typer
    from pydantic import BaseModel

    from llmopt.bench.latency import LatencyRequest
    from llmopt.bench.serve_args import BenchServeArgs
    from llmopt.bench.throughput import ThroughputRequest
    from llmopt.cli.main import app
    from llmopt.eval.args import EvalArgs
    from llmopt.options import declared
    from llmopt.quant.quantize import QuantizeRequest
    from llmopt.recipes import schema
    from llmopt.serve.launch import ServeArgs

    sections = {("quantize",): (schema.QuantizeSection, QuantizeRequest), ("eval",): (schema.EvalSection, EvalArgs),
                ("bench", "throughput"): (schema.ThroughputPlan, ThroughputRequest),
                ("bench", "latency"): (schema.LatencyPlan, LatencyRequest),
                ("bench", "serve"): (schema.ServeBenchPlan, BenchServeArgs), ("serve",): (schema.ServeSection, ServeArgs)}
    for words, (section, request) in sections.items():
        command = typer.main.get_command(app)
        for word in words:
            command = command.commands[word]
        flags = {opt for param in command.params for opt in [*param.opts, *param.secondary_opts]}
        by_key = {d.recipe_key: d for d in declared(request) if d.recipe_key}
        keys = []
        for key, info in section.model_fields.items():
            inner = info.annotation
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                keys += [f"{key}.{k}" for k in inner.model_fields]
            elif not (words == ("quantize",) and key == "output"):  # the checkpoint's name in the run folder
                keys.append(key)
        for key in keys:
            assert key in by_key, (words, key)
            d = by_key[key]
            if d.flag.cli:
                assert set(d.cli_names[0].split("/")) <= flags, (words, key, d.cli_names)


# ---------------------------------------------------------------------------- bad recipes


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,fragments", [
    ("model: default\nquantize: {method: awq, gruop_size: 64}\n", ["unknown key 'quantize.gruop_size'",
                                                                  "did you mean 'group_size'"]),
    ("model: default\nbench: {latency: {batch_sizes: [1]}}\n", ["'bench.latency.batch_sizes'", "'batch_size'"]),
    ("modle: default\n", ["unknown key 'modle'", "'model'"]),
    ("model: default\nquantize: {method: awq, group_size: abc}\n", ["quantize.group_size", "valid integer", "'abc'"]),
    ("model: default\nquantize: {method: fp3}\n", ["quantize.method", "'awq'", "'fp3'"]),
    ("model: default\nquantize: {group_size: 64}\n", ["quantize.method", "required"]),
    ("model: default\neval: {gates: [\"ppl:+5%\", +0.5]}\n", ["eval.gates[1]", "quoted string"]),
    ("model: default\neval: {chunks: lots}\n", ["eval.chunks", "'lots'"]),
    ("model: default\nserve: {port: 70000}\n", ["serve.port", "70000"]),
    ("- just\n- a list\n", ["expected a mapping"]),
    ("model: [unclosed\n", ["not valid YAML", "line"]),
    ("quantize: {method: awq}\n", ["no model"]),
    ("model: default\neval: {gates: ['ppl:5']}\n", ["eval", "ambiguous"]),  # the gate's own syntax, checked up front
    ("model: default\nquantize: {method: awq, group_size: 100}\n", ["quantize", "--group-size"]),
])
def test_bad_recipe_is_one_line_and_exit_2(tmp_path, text, fragments):
    recipe = _write(tmp_path / "bad.yaml", text)
    line = assert_usage_error(["run", str(recipe), "--output", str(tmp_path / "out")], *fragments)
    assert str(recipe) in line or "no model" in line or fragments[0] in ("eval", "quantize")
    assert not (tmp_path / "out").exists()  # nothing written for a bad recipe


def test_extends_deep_merges_and_overrides(tmp_path):
    (tmp_path / "base").mkdir()
    _write(tmp_path / "base" / "parent.yaml", "name: parent\nmodel: {spec: default, device: cpu}\n"
           "quantize: {method: awq, group_size: 64, calibration: {num_samples: 16, seq_len: 128}}\n"
           "bench: {latency: {batch_size: [1, 4]}, throughput: {num_prompts: 8}}\n")
    child = _write(tmp_path / "child.yaml", "extends: base/parent.yaml\nname: child\nmodel: other\n"
                   "quantize: {calibration: {num_samples: 4}}\nbench: {throughput: null}\n")
    recipe = load_recipe(child)
    assert recipe.name == "child"
    assert recipe.model.spec == "other" and recipe.model.device == "cpu"  # a spec string merges into {spec, device}
    assert recipe.quantize.method == "awq" and recipe.quantize.group_size == 64
    assert recipe.quantize.calibration.num_samples == 4 and recipe.quantize.calibration.seq_len == 128
    assert recipe.bench.throughput is None and recipe.bench.latency.batch_size == [1, 4]


def test_extends_cycle_and_missing_parent_are_clear(tmp_path):
    a = _write(tmp_path / "a.yaml", "extends: b.yaml\nmodel: default\n")
    _write(tmp_path / "b.yaml", "extends: a.yaml\n")
    line = assert_usage_error(["run", str(a)], "extends cycle", "a.yaml -> b.yaml -> a.yaml")
    assert line.count("\n") == 0
    _write(tmp_path / "c.yaml", "extends: c.yaml\n")
    assert_usage_error(["run", str(tmp_path / "c.yaml")], "extends cycle c.yaml -> c.yaml")
    _write(tmp_path / "d.yaml", "extends: nowhere.yaml\nmodel: default\n")
    assert_usage_error(["run", str(tmp_path / "d.yaml")], "extends 'nowhere.yaml'", "does not exist")
    assert_usage_error(["run", str(tmp_path / "missing.yaml")], "does not exist")


def test_set_overrides_are_validated_like_the_file(tmp_path):
    recipe = _write(tmp_path / "r.yaml", "model: default\nquantize: {method: awq}\n")
    loaded = load_recipe(recipe, ["quantize.group_size=128", "quantize.calibration.num_samples=8",
                                  "eval.tasks=ppl,kld", "model.device=cpu", "bench.latency.batch_size=[1, 8]"])
    assert loaded.quantize.group_size == 128 and loaded.quantize.calibration.num_samples == 8
    assert loaded.eval.tasks == ["ppl", "kld"] and loaded.model.spec == "default" and loaded.model.device == "cpu"
    assert loaded.bench.latency.batch_size == [1, 8]
    assert_usage_error(["run", str(recipe), "--set", "quantize.gruop_size=128"], "unknown key 'quantize.gruop_size'",
                       "'group_size'")
    assert_usage_error(["run", str(recipe), "--set", "quantize.group_size=big"], "quantize.group_size", "'big'")
    assert_usage_error(["run", str(recipe), "--set", "quantize"], "--set", "KEY=VALUE")
    assert_usage_error(["run", str(recipe), "--set", "quantize.method.x=1"], "quantize.method is a str")


def test_recipe_types_are_not_coerced_silently():
    with pytest.raises(LlmoptError, match="eval.strict"):
        from llmopt.recipes.loader import validate

        validate({"model": "default", "eval": {"strict": "maybe"}}, "x")


# ---------------------------------------------------------------------------- the CI example


def test_github_actions_example_is_a_valid_workflow_calling_commands_that_exist():
    path = ROOT / "recipes" / "ci" / "github-actions.yml"
    doc = yaml.safe_load(path.read_text())
    on = doc.get("on", doc.get(True))  # YAML 1.1 reads the bare key `on` as true; GitHub reads it as "on"
    assert on and {"push", "pull_request"} <= set(on)
    assert doc["jobs"]
    llmopt_lines = []
    for job_id, job in doc["jobs"].items():
        assert isinstance(job.get("runs-on"), str), job_id
        steps = job["steps"]
        assert isinstance(steps, list) and steps
        for step in steps:
            assert ("uses" in step) != ("run" in step), step  # each step either uses an action or runs a script
            if "run" in step:
                llmopt_lines += [line.strip() for line in step["run"].splitlines()
                                 if line.strip().startswith("llmopt ")]
    uses = [s["uses"] for job in doc["jobs"].values() for s in job["steps"] if "uses" in s]
    assert "actions/upload-artifact@v4" in uses
    upload = next(s for job in doc["jobs"].values() for s in job["steps"] if s.get("uses", "").startswith(
        "actions/upload-artifact"))
    assert upload["with"]["path"].rstrip("/") == "results" and upload["if"] == "always()"
    assert "llmopt run recipes/default.yaml --output results" in llmopt_lines
    for line in llmopt_lines:
        argv = shlex.split(line)
        words = [w for w in argv[1:] if not w.startswith("-")][:2]
        command = _click([])
        path_words = []
        for word in words:
            if hasattr(command, "commands") and word in command.commands:
                command = command.commands[word]
                path_words.append(word)
        code, err, out = run_cli(*path_words, "--help") if path_words else run_cli(*argv[1:])
        assert code == 0, (line, err)
        if path_words == ["run"]:
            _parses(argv)
            assert (ROOT / argv[2]).is_file()


def test_run_is_in_the_readme_commands_table():
    readme = (ROOT / "README.md").read_text()
    assert "| `llmopt run RECIPE" in readme and "recipes/default.yaml" in readme


def test_stage_config_is_plain_data():
    """The stamp hashes each stage's config as JSON: it must hold plain data only."""
    import json

    from llmopt.workflow.stages import plan_stages

    for path in READY:
        for stage in plan_stages(load_recipe(path), Path("/tmp/x")):
            json.dumps(stage.config)
            assert not any(dataclasses.is_dataclass(v) for v in stage.config.values())


def test_wheel_ships_the_recipe_packages_and_default_gates(tmp_path):
    """`llmopt eval` reads its default gates from package data: a wheel without the YAML could not start."""
    import subprocess
    import sys
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    names = zipfile.ZipFile(next(tmp_path.glob("llmopt-*.whl"))).namelist()
    assert {"llmopt/eval/default-gates.yaml", "llmopt/recipes/schema.py", "llmopt/workflow/runner.py",
            "llmopt/cli/run.py"} <= set(names)
    metadata = next(n for n in names if n.endswith("METADATA"))
    requires = zipfile.ZipFile(next(tmp_path.glob("llmopt-*.whl"))).read(metadata).decode()
    assert "Requires-Dist: pyyaml" in requires and "Requires-Dist: pydantic" in requires


def test_recipe_engine_keys_are_the_engine_flags():
    """A recipe's engine keys are exactly the commands' engine flags (one EngineArgs builds both)."""
    from llmopt.options import declared
    from llmopt.recipes.schema import ENGINE_FLAGS
    from llmopt.runtime.engine_args import EngineArgs

    assert sorted(ENGINE_FLAGS) == sorted(d.name for d in declared(EngineArgs))
