"""The eval report as the terminal shows it: the rich table, the gate lines, llama.cpp's KLD summary.

All of it is read off the JSON document (`document.build_document`), so a saved report renders the same.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from llmopt.eval.gates.format import format_quantity, format_value
from llmopt.eval.gates.metric_info import metric_info
from llmopt.eval.gates.verdict import FAIL, INCONCLUSIVE, PASS


def render_table(doc: dict[str, Any]) -> Table:
    doc = doc["llmopt"]
    title = f"llmopt eval: {doc['model']['spec']}" + (f" vs baseline {doc['baseline']['spec']}" if doc["baseline"] else "")
    table = Table(title=title)
    for col in ("metric", "baseline", "candidate", "Δ", "95% CI", "gate", "verdict"):
        table.add_column(col, justify="right" if col in ("baseline", "candidate", "Δ") else "left", no_wrap=col == "metric")
    for row in doc["metrics"]:
        metric, kind = row["metric"], row["delta_kind"]
        info = metric_info(metric)
        if row.get("no_interval"):
            ci = f"none (n={row['n']} < min)" if row["block"] == 1 else f"none ({row['n']} tokens)"
        elif row["ci_low"] is None:
            ci = "-"
        elif row["ci_of"] == "value":
            ci = f"[{format_value(info, row['ci_low'])}, {format_value(info, row['ci_high'])}]"
        else:
            ci = f"[{format_quantity(info, kind, row['ci_low'])}, {format_quantity(info, kind, row['ci_high'])}]"
        verdict = row["verdict"] or ""
        style = {None: "", PASS: "green", INCONCLUSIVE: "yellow", FAIL: "bold red"}[row["worst"]]
        gate = ", ".join(b.partition(":")[2] for b in (row["gate"] or "").split(", ") if b)
        table.add_row(metric.replace(".ppl", "").replace(".acc", ""), format_value(info, row["baseline"]),
                      format_value(info, row["candidate"]), format_quantity(info, kind, row["delta"]), ci, gate,
                      f"[{style}]{verdict}[/{style}]" if style else verdict)
    return table


def summary_lines(doc: dict[str, Any]) -> list[str]:
    doc = doc["llmopt"]
    lines = [f"gate {g['bound']}: {g['note']}" for g in doc["gates"]]
    for text in doc["skipped_gates"]:
        lines.append(f"gate {text}: skipped (task not run)")
    hits = [t for t, v in doc["cache"]["baseline"].items() if v == "hit"]
    timing = doc["timing"]
    parts = [f"total {timing['total_s']:.1f} s"]
    for role in ("baseline", "candidate"):
        if role in timing and timing[role]:
            parts.append(f"{role} " + ", ".join(f"{k} {v:.1f} s" for k, v in timing[role].items()))
    lines.append("time: " + "; ".join(parts) + (f" (baseline cache hits: {', '.join(hits)})" if hits else ""))
    if doc["gates"]:
        failed = [g["bound"] for g in doc["gates"] if g["verdict"] == FAIL]
        unsure = [g["bound"] for g in doc["gates"] if g["verdict"] == INCONCLUSIVE]
        b = doc["bootstrap"]
        lines.append(f"intervals: {b['samples']} bootstrap samples, seed {b['seed']}; none below {b['min_units']} "
                     "items (or token blocks), and such a gate is inconclusive")
        if failed:
            lines.append(f"FAILED (significant: the whole 95% CI beyond the bound): {', '.join(failed)} -> exit 1")
        if unsure:
            consequence = "-> exit 1 (--strict)" if doc["strict"] else "(exit 0 without --strict; --strict fails on them)"
            lines.append(f"INCONCLUSIVE (the CI straddles the bound, or too few items): {', '.join(unsure)} {consequence}")
        if not failed and not unsure:
            lines.append("all gates passed (every 95% CI within its bound)")
    return lines


KLD_ROWS = (("max", "Maximum"), ("p99.9", "99.9%"), ("p99", "99.0%"), ("p95", "95.0%"), ("p90", "90.0%"),
            ("p75", "75.0%"), ("median", "Median"), ("p25", "25.0%"), ("p10", "10.0%"), ("p5", " 5.0%"),
            ("p1", " 1.0%"), ("p0.1", " 0.1%"), ("min", "Minimum"))


def kld_summary_lines(doc: dict[str, Any]) -> list[str]:
    """llama.cpp's `--kl-divergence` summary, same rows, labels and units, from the JSON's results.kld."""
    k = doc["llmopt"]["results"].get("kld")
    if k is None:
        return []
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {k['ppl_cand']:10.6f} ± {k['ppl_cand_stderr']:10.6f}",
             f"Mean PPL(base)                : {k['ppl_base']:10.6f} ± {k['ppl_base_stderr']:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * k['ppl_correlation']:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {k['ln_ppl_ratio']:10.6f} ± {k['ln_ppl_ratio_stderr']:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {k['ppl_ratio']:10.6f} ± {k['ppl_ratio_stderr']:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {k['ppl_diff']:10.6f} ± {k['ppl_diff_stderr']:10.6f}",
             "", "====== KL divergence statistics ======",
             f"Mean    KLD: {k['mean']:10.6f} ± {k['mean_stderr']:10.6f}"]
    lines += [f"{label + ' ' * (7 - len(label))} KLD: {k[key]:10.6f}" for key, label in KLD_ROWS if key in k]
    dp = k["delta_p"]
    lines += ["", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * dp['mean']:6.3f} ± {100 * dp['mean_stderr']:5.3f} %"]
    lines += [f"{label + ' ' * (7 - len(label))} Δp: {100 * dp[key]:6.3f}%" for key, label in KLD_ROWS if key in dp]
    lines += [f"RMS Δp    : {100 * k['rms_delta_p']:6.3f} ± {100 * k['rms_delta_p_stderr']:5.3f} %",
              f"Same top p: {100 * k['same_top_p']:6.3f} ± {100 * k['same_top_p_stderr']:5.3f} %",
              f"({k['num_tokens']} scored tokens, full vocabulary; ± as llama.cpp computes them, tokens taken as "
              "independent: the gates' block-bootstrap intervals are wider)"]
    return lines
