"""report.md of `llmopt run`: the verdict, every stage's table, the bench plots, the commands.

The tables are the ones the commands themselves print or write: quantize's summary, eval's
table and gate lines (eval/report.py, rendered as text), and each bench command's own report.md
(bench/offline_report.py, bench/serve_report.py), its plots linked from the stage's folder.
"""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path
from typing import Any

from llmopt.bench.tables_and_plots import markdown_table
from llmopt.core.atomic import atomic_file
from llmopt.workflow.stages import BENCH_SERVE, ERROR, EVAL, GATE_FAILED, LATENCY, QUANTIZE, REUSED, SERVE, THROUGHPUT

REPORT = "report.md"
COMMANDS = "commands.sh"
BENCH_FOLDERS = {THROUGHPUT: "bench/throughput", LATENCY: "bench/latency", BENCH_SERVE: "bench/serve"}


def write_report(result) -> Path:
    """`<output>/report.md` (atomically)."""
    path = result.output_dir / REPORT
    with atomic_file(path) as tmp:
        tmp.write_text(report_markdown(result), encoding="utf-8")
    return path


def report_markdown(result) -> str:

    recipe = result.recipe
    outcomes = {o.name: o for o in result.outcomes}
    verdict = {0: "**passed**: every stage ran and no gate failed",
               1: "**FAILED**: a quality gate failed (exit code 1); later stages did not run",
               2: "**stopped by an error** (exit code 2)"}[result.exit_code]
    parts = [f"# llmopt run: {recipe.name or Path(result.recipe_file).stem}",
             f"Recipe `{result.recipe_file}` on model `{recipe.model.spec}`"
             + (f". {recipe.description.strip()}" if recipe.description else "") + "",
             f"Verdict: {verdict}. Total time {result.seconds:.1f} s.",
             "## Stages",
             markdown_table([_stage_row(s, outcomes[s.name], result.output_dir) for s in result.stages],
                            ["stage", "status", "time (s)", "output"])]
    for stage in result.stages:
        o = outcomes[stage.name]
        if o.figures is None:
            continue
        if stage.name == QUANTIZE:
            parts += ["## Quantize", _quantize_table(o.figures)]
        elif stage.name == EVAL:
            parts += ["## Eval" + (" (gate failed)" if o.status == GATE_FAILED else ""), _eval_section(o.figures)]
        elif stage.name in BENCH_FOLDERS:
            parts += [f"## {stage.name.capitalize()}", _bench_section(result.output_dir, BENCH_FOLDERS[stage.name])]
    serve = next((c for s, c in zip(result.stages, result.commands) if s.name == SERVE), None)
    if serve is not None:
        parts += ["## Serve", "Start the endpoint with (`llmopt run --serve` runs it after the other stages):",
                  "```sh\n" + shlex.join(serve) + "\n```"]
    parts += ["## Reproduce", f"Each stage as the `llmopt` command that runs it alone (`{COMMANDS}`):",
              "```sh\n" + "\n".join(shlex.join(c) for c in result.commands) + "\n```"]
    return "\n\n".join(p.strip() for p in parts if p and p.strip()) + "\n"


def _stage_row(stage, outcome, output_dir: Path) -> list[str]:

    status = outcome.status
    if status == ERROR:
        status += f": {outcome.error}"
    elif status == REUSED:
        status += f" (from an earlier run that took {outcome.seconds:.1f} s)"
    seconds = f"{outcome.seconds:.1f}" if outcome.seconds and outcome.status != REUSED else "-"
    return [stage.name, status, seconds, ", ".join(f"`{_rel(p, output_dir)}`" for p in stage.outputs) or "-"]


def _quantize_table(q: dict[str, Any]) -> str:
    def compact(d: dict | None) -> str:
        return ", ".join(f"{k}={v}" for k, v in (d or {}).items() if v is not None and v is not False) or "none"

    rows = [["output", f"`{Path(q['output']).name}` ({q['format']})"], ["method", q["method"]],
            ["parameters", compact(q["parameters"])], ["calibration", compact(q["calibration"])],
            ["time", f"{q['wall_seconds']:.1f} s (calibration data {q['calibration_seconds']:.1f} s, quantization "
                     f"{q['quantize_seconds']:.1f} s)"],
            ["peak RSS", f"{q['peak_rss_bytes'] / 2**20:.0f} MiB"],
            ["size", f"{q['size_before_bytes'] / 2**20:.1f} MiB -> {q['size_after_bytes'] / 2**20:.1f} MiB"],
            ["mean layer error", "n/a" if q.get("mean_relative_error") is None
             else f"{q['mean_relative_error']:.4%}"]]
    return markdown_table(rows, ["", ""])


def _eval_section(doc: dict[str, Any]) -> str:
    """eval's own table and lines (eval/report.py), as text: the same figures `llmopt eval` prints."""
    from rich.console import Console

    from llmopt.eval.report.table import kld_summary_lines, render_table, summary_lines

    buffer = io.StringIO()
    console = Console(file=buffer, width=140, color_system=None, force_terminal=False)
    console.print(render_table(doc))
    table = buffer.getvalue().rstrip()
    lines = summary_lines(doc)
    out = ["```text\n" + table + "\n```", "\n".join(f"- {line}" for line in lines)]
    kld = kld_summary_lines(doc)
    if kld:
        out.append("<details><summary>KL divergence summary (llama.cpp's layout)</summary>\n\n```text\n"
                   + "\n".join(kld) + "\n```\n</details>")
    return "\n\n".join(out)


def _bench_section(output_dir: Path, folder: str) -> str:
    """The bench command's own report.md, its title dropped and its plots linked from the run folder."""
    path = output_dir / folder / "report.md"
    if not path.is_file():
        return f"(no {folder}/report.md)"
    text = path.read_text(encoding="utf-8")
    body = text.split("\n", 1)[1] if text.startswith("# ") else text
    body = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", body, flags=re.M)  # its headings one level down
    return re.sub(r"\]\((?!https?:|/)([^)]+)\)", lambda m: f"]({folder}/{m.group(1)})", body)


def _rel(path: Path, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return str(path)


def write_commands(output_dir: Path, recipe_file: str, commands: list[list[str]], names: list[str]) -> Path:
    """`<output>/commands.sh`: each stage as the `llmopt` command that runs it alone."""
    lines = ["#!/bin/sh",
             f"# The commands that reproduce each stage of `llmopt run {_comment(recipe_file)}`, in order.",
             "# (The eval stage reads its tasks and gates from recipe.yaml, the resolved recipe, beside this file.)",
             "set -e"]
    for name, command in zip(names, commands):
        lines += ["", f"# {_comment(name)}", shlex.join(command)]
    path = Path(output_dir) / COMMANDS
    with atomic_file(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | 0o111)  # runnable as ./commands.sh
    return path


def _comment(text: str) -> str:
    """User text for a `#` line of a shell file: a newline (or any unprintable character) would end
    the comment and make the rest a command, so each is written as its escape (`\\n`)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
