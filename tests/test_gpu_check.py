"""scripts/gpu_check.sh's dry run (DRY_RUN=1): it lists every step with its command and runs none,
and each command's flags parse — llmopt's by its click command (`make_context`, no run), the sweep's
by its argparse parser, pytest's by a collect-only pass — so the one run a lent GPU gets does not
die on a renamed flag."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from llmopt.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["pytest", "bf16", "kernels", "latency-fp16", "latency-eager", "latency-awq", "sweep"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp / "out"), "SRC": str(tmp / "src"), "WORK": str(tmp / "work"),
           "SITE": str(tmp / "site"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp / "out").iterdir()) == ["log.txt", "steps.json"]  # nothing ran
    return json.loads((tmp / "out" / "steps.json").read_text())


def _llmopt_context(args: list[str]):
    """Parse `llmopt ARGS` down to the leaf command without running it (click, as Typer vendors it,
    raises a usage error on an unknown flag or a bad value)."""
    command = typer.main.get_command(app)
    path = ["llmopt"]
    while hasattr(command, "commands"):  # a group
        name = args.pop(0)
        command = command.commands.get(name)
        assert command is not None, f"no command {' '.join(path + [name])}"
        path.append(name)
    return command.make_context(" ".join(path), args)


def _module_args(command: list[str], module: str) -> list[str]:
    assert command[1:3] == ["-m", module], command
    return command[3:]


def test_every_step_is_listed_and_none_runs(dry_run):
    assert [s["step"] for s in dry_run] == STEPS
    for s in dry_run:
        assert s["status"] == "dry run" or s["status"].startswith("skipped: "), s
        assert s["exit"] is None


def test_a_bad_flag_does_not_parse():
    with pytest.raises(Exception, match="No such option"):
        _llmopt_context(["bench", "latency", "llama-3-8b", "--no-such-flag"])


def test_llmopt_commands_parse(dry_run):
    commands = {s["step"]: s["command"] for s in dry_run if s["command"]}
    latency_flags = {o for p in _llmopt_context(["bench", "latency"]).command.params for o in p.opts}
    for step in ("kernels", "latency-fp16", "latency-eager", "latency-awq"):
        if step == "latency-awq" and "--quantization" not in latency_flags:
            status = next(s["status"] for s in dry_run if s["step"] == step)
            assert "--quantization" in status  # skipped, saying why
            continue
        ctx = _llmopt_context(_module_args(commands[step], "llmopt"))
        assert ctx.params["device"] == "cuda"
    fp16 = _llmopt_context(_module_args(commands["latency-fp16"], "llmopt")).params
    assert fp16["model"] == "llama-3-8b" and fp16["load_format"] == "dummy" and fp16["dtype"] == "float16"
    # eager vs CUDA graphs: the same run but for --enforce-eager
    eager = _llmopt_context(_module_args(commands["latency-eager"], "llmopt")).params
    assert not fp16["enforce_eager"] and eager["enforce_eager"]
    assert {k: v for k, v in eager.items() if k not in ("enforce_eager", "output")} == \
        {k: v for k, v in fp16.items() if k not in ("enforce_eager", "output")}


def test_sweep_arguments_parse(dry_run):
    command = next(s["command"] for s in dry_run if s["step"] == "sweep")
    spec = importlib.util.spec_from_file_location("int4_sweep", command[1])
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    args = sweep.build_parser().parse_args(command[2:])
    assert args.rows == list(range(1, 17)) and args.output.name == "sweep.json"


def test_pytest_steps_collect(dry_run, tmp_path):
    """Each pytest step's arguments collect tests (bf16: exactly its one test); -n needs pytest-xdist."""
    for step, at_least in (("pytest", 50), ("bf16", 1)):
        args = _module_args(next(s["command"] for s in dry_run if s["step"] == step), "pytest")
        if "-n" in args:
            assert importlib.util.find_spec("xdist") is not None
            at = args.index("-n")
            del args[at: at + 2]
        args = [a if not a.endswith(".xml") else str(tmp_path / "junit.xml") for a in args]
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", *args], capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        collected = [line for line in done.stdout.splitlines() if "::" in line]
        assert len(collected) >= at_least, done.stdout[-2000:]
        if step == "bf16":
            assert collected == [line for line in collected if "test_bfloat16_on_the_triton_backend" in line]
