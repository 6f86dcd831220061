"""What `llmopt bench serve` writes and prints: the results document, the figures table, notes on
failures and on the load generator's own timing, report.md and the plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.bench.environment import collect_metadata, hardware_line
from llmopt.bench.online import ServeBenchConfig, ServeRun, detailed
from llmopt.bench.online_metrics import LATE_SEND_S, LATENCY_METRICS, percentile_key
from llmopt.bench.results import results_document, write_results
from llmopt.bench.tables_and_plots import markdown_table, plot_cdf, plot_lines, plot_scatter
from llmopt.core.atomic import atomic_file

# A busy shared machine delays a 10 ms timer by several ms now and then; beyond this it is worth a word.
LOOP_LAG_NOTE_MS = 20.0
NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def build_document(config: ServeBenchConfig, served_model_name: str, runs: list[ServeRun],
                   save_detailed: bool = False) -> dict[str, Any]:
    """results.json: kind "serve", one run per load point (figures under vLLM's names)."""
    metadata = collect_metadata() | {"served_model_name": served_model_name, "engine": config.launch
                                     if config.model else None}
    out = []
    for run in runs:
        figures = dict(run.figures)
        if save_detailed:
            figures |= detailed(run)
        out.append(figures)
    return results_document("serve", metadata, config.to_json(), out)


def figure_rows(document: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, row title) of the figures worth a table row, in reading order."""
    config, runs = document["config"], document["runs"]
    rows = [("completed", "completed requests"), ("failed", "failed requests"), ("duration", "duration (s)"),
            ("request_throughput", "requests/s"), ("output_throughput", "output tokens/s"),
            ("total_token_throughput", "total tokens/s")]
    if config.get("goodput"):
        slos = " ".join(f"{k}:{v:g}" for k, v in config["goodput"].items())
        rows.append(("request_goodput", f"goodput requests/s ({slos} ms)"))
    if config.get("cost_per_hour") is not None:
        rows.append(("usd_per_million_output_tokens", f"$ per 1M output tokens (at ${config['cost_per_hour']:g}/h)"))
    percentiles = config.get("percentiles") or []
    for name in LATENCY_METRICS:
        rows += [(f"mean_{name}_ms", f"mean {NAMES[name]} (ms)"), (f"median_{name}_ms", f"median {NAMES[name]} (ms)"),
                 (f"std_{name}_ms", f"std {NAMES[name]} (ms)")]
        # p50 is the median, already a row (results.json keeps both, as vLLM's does)
        rows += [(f"{percentile_key(p)}_{name}_ms", f"{percentile_key(p)} {NAMES[name]} (ms)") for p in percentiles
                 if p != 50]
    rows += [("late_sends", f"sends > {LATE_SEND_S * 1e3:g} ms behind schedule"),
             ("max_send_lag_ms", "max send lag (ms)"), ("max_loop_lag_ms", "max client loop lag (ms)"),
             ("max_concurrent_requests", "max requests in flight"), ("short_outputs", "outputs short of max_tokens")]
    return [(key, title) for key, title in rows if any(key in run for run in runs)]


def table_rows(document: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Columns (figure, then one per run) and rows for the figures table."""
    runs = document["runs"]
    columns = ["figure", *(run["label"] for run in runs)]
    return columns, [[title, *(run.get(key) for run in runs)] for key, title in figure_rows(document)]


def notes(document: dict[str, Any]) -> list[str]:
    """Plain sentences on what the figures alone hide: failures, a client behind its schedule,
    outputs shorter than asked, token counts not from the server."""
    lines = []
    for run in document["runs"]:
        label, total = run["label"], run["completed"] + run["failed"]
        if run["failed"]:
            reasons = "; ".join(f"{why} x{n}" for why, n in run["errors"].items())
            lines.append(f"{label}: {run['failed']} of {total} requests failed ({reasons}); their figures are "
                         "left out of the latency statistics.")
        if run.get("late_sends"):
            lines.append(f"{label}: the load generator fell behind its schedule: {run['late_sends']} of {total} "
                         f"requests went out more than {LATE_SEND_S * 1e3:g} ms late (max "
                         f"{run['max_send_lag_ms']:.0f} ms, mean {run['mean_send_lag_ms']:.1f} ms); their latencies "
                         "count from the scheduled time and include that delay.")
        if run.get("max_loop_lag_ms", 0) > LOOP_LAG_NOTE_MS:
            lines.append(f"{label}: the client's event loop was up to {run['max_loop_lag_ms']:.0f} ms late: "
                         "times it took then may be inflated by as much.")
        if run.get("short_outputs"):
            lines.append(f"{label}: {run['short_outputs']} of {run['completed']} completed requests returned fewer "
                         "tokens than max_tokens (a server that ignores ignore_eos stops at EOS).")
        sources = {k: v for k, v in (run.get("token_counts_from") or {}).items() if k != "usage"}
        if sources:
            how = {"max_tokens": "taken as max_tokens (finish_reason length)", "tokenizer": "re-encoded by the "
                   "tokenizer (close, not exact)", "chunks": "counted as content chunks"}
            detail = "; ".join(f"{n} {how.get(k, k)}" for k, n in sources.items())
            lines.append(f"{label}: the server sent no usage for {sum(sources.values())} requests; their output "
                         f"tokens: {detail}.")
    return lines


def write_report(output_dir: Path, document: dict[str, Any], runs: list[ServeRun]) -> list[Path]:
    """results.json, the plots and report.md into `output_dir` (each file written atomically)."""
    output_dir = Path(output_dir)
    written = [write_results(output_dir, document)]
    plots = write_plots(output_dir, document, runs)
    written += plots
    path = output_dir / "report.md"
    with atomic_file(path) as tmp:
        tmp.write_text(report_markdown(document, [p.name for p in plots]), encoding="utf-8")
    return [*written, path]


def report_markdown(document: dict[str, Any], plot_names: list[str]) -> str:
    meta, config = document["metadata"], document["config"]
    target = config.get("url") or f"launched by bench serve (`--launch {config.get('launch')} --model " \
        f"{config.get('model')}`)"
    lengths = {"random": f"input length {config['input_len']}, ",
               "prefix-shared": f"shared prefix {config['prefix_len']} tokens, "}.get(config["dataset"], "")
    rate = config.get("request_rate")
    load = f"sweep {config['sweep']}" if config.get("sweep") else (
        f"request rate {rate}" + (f", max concurrency {config['max_concurrency']}" if config.get("max_concurrency")
                                  else ""))
    lines = [
        f"# llmopt bench serve: {meta.get('served_model_name')}",
        "",
        f"Server: {target}. Client: {hardware_line(meta)}; llmopt {meta.get('llmopt_version')} "
        f"(commit {str(meta.get('git_commit') or 'unknown')[:10]}), {meta.get('date')}.",
        "",
        f"Workload: {config['num_prompts']} `{config['dataset']}` requests to the {config['endpoint']} endpoint "
        f"({lengths}output length {config['output_len'] or 'from the file'}, range ratio "
        f"{config['range_ratio']}, seed {config['seed']}), streaming, temperature {config['temperature']}, "
        f"ignore_eos {config['ignore_eos']}, {config['num_warmups']} warm-up request(s); load: {load}, "
        f"burstiness {config['burstiness']}.",
        "",
        "Times in ms from each request's start (its scheduled send time under a request rate); TPOT = "
        "(latency - TTFT) / (output tokens - 1); ITL = gaps between streamed content chunks.",
        "",
    ]
    columns, rows = table_rows(document)
    lines += ["## Figures", "", markdown_table(rows, columns)]
    remarks = notes(document)
    lines += ["## Notes", ""] + ([f"- {r}" for r in remarks] if remarks else
                                ["- Every request completed; the load generator kept to its schedule."]) + [""]
    if plot_names:
        lines += ["## Plots", ""] + [f"![{Path(name).stem}]({name})" for name in plot_names] + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_plots(output_dir: Path, document: dict[str, Any], runs: list[ServeRun]) -> list[Path]:
    """TTFT and ITL distributions always; with two or more load points also throughput and latency
    percentiles against the swept variable and the throughput-latency (Pareto) curve."""
    model = document["metadata"].get("served_model_name")
    paths = [
        plot_cdf(output_dir / "ttft_distribution.png",
                 {r.point.label: [x.ttft * 1e3 for x in r.results if x.success] for r in runs},
                 xlabel="TTFT (ms)", title=f"Time to first token: {model}"),
        plot_cdf(output_dir / "itl_distribution.png",
                 {r.point.label: [g * 1e3 for x in r.results if x.success for g in x.itl] for r in runs},
                 xlabel="inter-token latency (ms)", title=f"Inter-token latency: {model}"),
    ]
    figures = document["runs"]
    if len(figures) < 2:
        return paths
    config = document["config"]
    variable = "concurrency" if (config.get("sweep") or "").startswith("concurrency") else "request rate (req/s)"
    ticks = [run["label"].split("=", 1)[-1] for run in figures]
    x = list(range(len(figures)))  # evenly spaced (sweeps are usually geometric; a rate may be 'inf')

    def series(key: str) -> list[Any]:
        return [run.get(key) for run in figures]

    throughput = {"output tokens/s": {"output": series("output_throughput"), "total": series("total_token_throughput")},
                  "requests/s": {"completed": series("request_throughput")}}
    if config.get("goodput"):
        throughput["requests/s"]["goodput"] = series("request_goodput")
    paths.append(plot_lines(output_dir / "throughput.png", x, throughput, xlabel=variable, xticklabels=ticks,
                            title=f"Throughput vs {variable}: {model}"))
    percentiles = config.get("percentiles") or []
    latency = {f"{NAMES[name]} (ms)": {percentile_key(p): series(f"{percentile_key(p)}_{name}_ms") for p in percentiles}
               | {"mean": series(f"mean_{name}_ms")} for name in LATENCY_METRICS}
    paths.append(plot_lines(output_dir / "latency.png", x, latency, xlabel=variable, xticklabels=ticks,
                            title=f"Latency percentiles vs {variable}: {model}"))
    paths.append(plot_scatter(output_dir / "pareto.png",
                              [(run.get("median_tpot_ms"), run.get("output_throughput"), run["label"])
                               for run in figures],
                              xlabel="median TPOT (ms per output token, per request)",
                              ylabel="output tokens/s (server)", frontier="min-x-max-y",
                              title=f"Throughput vs latency: {model}"))
    return paths
