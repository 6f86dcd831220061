"""`llmopt run RECIPE`: quantize -> eval -> bench (-> serve) from one recipe file, into one folder.

Exit codes: 0 = every stage ran and no gate failed, 1 = a quality gate failed (report.md and
results.json are written all the same), 2 = a bad recipe or bad input.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from llmopt.cli.common import EXIT_GATE_FAILED, err_console, handles_errors
from llmopt.errors import LlmoptError


@handles_errors
def run(
    recipe: Path = typer.Argument(..., help="A recipe file (recipes/*.yaml)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="The run folder: checkpoint, results.json, "
                                       "report.md, plots, commands.sh (default: runs/<recipe name>). Stages whose "
                                       "inputs have not changed since a run into the same folder are reused."),
    overrides: list[str] = typer.Option([], "--set", help="Override a recipe key, e.g. --set quantize.group_size=128 "
                                        "(repeatable; the value is read as YAML)."),
    serve: bool = typer.Option(False, "--serve", help="After the other stages pass, start the recipe's server "
                               "(otherwise its command line is in commands.sh and report.md)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the recipe and print the stages' commands; run "
                                 "nothing."),
) -> None:
    """Run a recipe's stages in order (quantize, eval gates, bench; serve with --serve) into one folder."""
    from llmopt.bench.results import prepare_output_dir
    from llmopt.recipes import load_recipe
    from llmopt.workflow.report import write_commands
    from llmopt.workflow.command_line import render
    from llmopt.workflow.runner import prepare, run_folder, run_recipe
    from llmopt.workflow.stages import RECIPE_COPY, SERVE

    loaded = load_recipe(recipe, overrides)
    output = run_folder(loaded, recipe, output)
    stages = prepare(loaded, output)
    commands = [render(s.invocation) for s in stages]
    if dry_run:
        for stage, command in zip(stages, commands):
            typer.echo(f"# {stage.name}\n{shlex.join(command)}")
        return
    prepare_output_dir(output)
    _write_recipe(output / RECIPE_COPY, loaded)
    write_commands(output, str(recipe), commands, [s.name for s in stages])

    observer = _ProgressObserver()
    with observer.progress:  # an error in a stage: one line (exit 2); results.json and report.md are written
        result = run_recipe(loaded, str(recipe), output, stages, observer)
    err_console.print(f"wrote {output}/: report.md, results.json, commands.sh ({result.seconds:.0f} s)",
                      highlight=False)
    if result.exit_code:
        err_console.print("a quality gate failed: see the eval section of report.md", style="bold red")
        raise typer.Exit(EXIT_GATE_FAILED)
    if serve:
        argv = [sys.executable, "-m", "llmopt", *commands[[s.name for s in stages].index(SERVE)][1:]]
        err_console.print("llmopt run: serving with " + shlex.join(["llmopt", *argv[3:]]), highlight=False)
        os.execv(argv[0], argv)  # the server owns the process from here (signals, exit code)


def _write_recipe(path: Path, recipe) -> None:
    """The resolved recipe (extends and --set applied) beside the results: what this run ran."""
    from llmopt.core.atomic import atomic_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text("# resolved by llmopt run: extends and --set applied\n"
                       + yaml.safe_dump(recipe.model_dump(exclude_none=True), sort_keys=False), encoding="utf-8")


class _ProgressObserver:
    """One progress row per stage on stderr, and a plain line as each finishes (readable in CI logs)."""

    def __init__(self) -> None:
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=err_console, transient=True)
        self.tasks: dict[str, Any] = {}

    def stage_started(self, stage) -> None:
        self.tasks[stage.name] = self.progress.add_task(stage.title, total=None)
        if not self.progress.console.is_terminal:  # no live display (CI logs): say what runs now
            self.progress.console.print(f"{stage.title} ...", highlight=False, markup=False)

    def stage_progress(self, stage, done: int, total: int | None) -> None:
        self.progress.update(self.tasks[stage.name], completed=done, total=total)

    def stage_finished(self, stage, outcome) -> None:
        self.progress.remove_task(self.tasks.pop(stage.name))
        style = {"done": "green", "reused": "cyan", "gate failed": "bold red", "error": "bold red"}.get(outcome.status, "")
        took = f" in {outcome.seconds:.1f} s" if outcome.status == "done" else ""
        self.progress.console.print(f"[{style}]{stage.name}: {outcome.status}{took}[/{style}]", highlight=False)
