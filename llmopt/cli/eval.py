"""`llmopt eval`: perplexity, KL divergence, MMLU and HumanEval, with quality gates that decide CI.

Exit codes: 0 = no gate failed significantly (inconclusive ones are reported; `--strict`
makes them fail too), 1 = a gate failed (its whole 95% CI beyond the bound), 2 = bad input.
"""

from __future__ import annotations

from pathlib import Path

import typer

from llmopt.cli.common import EXIT_GATE_FAILED, console, err_console, handles_errors, print_json
from llmopt.cli.options import request_options
from llmopt.eval.args import EvalArgs


@handles_errors
@request_options(EvalArgs, param="args")
def eval_command(
    args: EvalArgs,
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the JSON report here (atomically)."),
    json_output: bool = typer.Option(False, "--json", help="Print the JSON report on stdout (the table goes to stderr)."),
    log_samples: bool = typer.Option(False, "--log-samples", help="Per-sample JSONL beside --output."),
) -> None:
    """Score MODEL (and --baseline) on ppl/kld/mmlu/humaneval and judge quality gates: exit 1 if one fails
    significantly (with --strict, also if one is inconclusive)."""
    from llmopt.eval.evaluate import evaluate, lm_eval_lines
    from llmopt.eval.report.table import kld_summary_lines, render_table, summary_lines

    recipe_layer = None
    if args.recipe is not None:
        from llmopt.recipes.loader import recipe_eval_settings

        recipe_layer = recipe_eval_settings(args.recipe)
    result = evaluate(args, recipe_layer, output, log_samples)
    doc = result.document
    screen = err_console if json_output else console
    lines = lm_eval_lines(result.lm_eval_document or {})
    if result.built_in:
        screen.print(render_table(doc))
        lines = [*kld_summary_lines(doc), *lines, *summary_lines(doc)]
    for line in lines:
        screen.print(line, highlight=False, markup=False)
    if json_output:
        print_json(doc)
    if result.exit_code:
        raise typer.Exit(EXIT_GATE_FAILED)
