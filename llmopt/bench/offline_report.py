"""report.md and plots for the offline benchmarks (`bench throughput`, `bench latency`, `bench kernels`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.bench.environment import hardware_line
from llmopt.bench.results import write_results
from llmopt.bench.tables_and_plots import markdown_table, plot_bars
from llmopt.core.atomic import atomic_file


def write_throughput_report(output_dir: Path, document: dict[str, Any]) -> None:
    from llmopt.bench.throughput import TABLE_COLUMNS, table_rows

    output_dir = Path(output_dir)
    write_results(output_dir, document)
    config, meta = document["config"], document["metadata"]
    w = config["workload"]
    ran = [r for r in document["runs"] if not r.get("skipped")]
    plot = output_dir / "throughput.png"
    if ran:
        plot_bars(plot, [_wrap(r["label"]) for r in ran], {"output tokens/s": [r["output_throughput"] for r in ran]},
                  ylabel="output tokens/s", title=f"{config['model']}: {w['requests']} requests, {hardware_line(meta)}")
    _write_markdown(output_dir, "throughput", config["model"], meta, [
        f"Workload: {w['requests']} requests of the `{config['dataset']}` dataset (seed {config['seed']}), prompts "
        f"{w['prompt_len_min']}-{w['prompt_len_max']} tokens ({w['prompt_tokens']} in all), outputs "
        f"{w['output_len_min']}-{w['output_len_max']} tokens ({w['output_tokens']}), greedy, EOS ignored, all "
        "submitted at once; each engine in a process of its own.",
        markdown_table(table_rows(document), TABLE_COLUMNS),
        "![output tokens/s per engine](throughput.png)" if ran else "",
    ])


def _wrap(label: str, width: int = 18) -> str:
    words, lines, line = label.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])


def write_latency_report(output_dir: Path, document: dict[str, Any]) -> None:
    from llmopt.bench.latency import LATENCY_COLUMNS, bandwidth_line, latency_rows

    output_dir = Path(output_dir)
    write_results(output_dir, document)
    config, meta = document["config"], document["metadata"]
    ran = [r for r in document["runs"] if not r.get("skipped")]
    if ran:
        plot_bars(output_dir / "latency.png", [_wrap(r["label"]) for r in ran],
                  {"measured": [r["tg_tok_s"] for r in ran], "roofline": [r.get("ideal_tg_tok_s") for r in ran]},
                  ylabel="decode (tg) tokens/s", title=f"{config['model']}: {hardware_line(meta)}")
    _write_markdown(output_dir, "latency", config["model"], meta, [
        f"{_sentence(bandwidth_line(document))}. "
        f"{config['input_len']} random prompt tokens + {config['output_len']} generated (greedy, EOS ignored) per "
        f"sequence; medians of {config['num_iters']} iterations after {config['num_iters_warmup']} warm-up. "
        "Roofline: bytes a decode step reads at the mean context (weights as stored + K/V) over the measured "
        "bandwidth; MBU = measured / roofline tg tokens/s.",
        markdown_table(latency_rows(document), LATENCY_COLUMNS),
        "![decode tokens/s and the roofline](latency.png)" if ran else "",
    ])


def write_kernels_report(output_dir: Path, document: dict[str, Any]) -> None:
    """results.json and report.md (one table per kernel; no plots: the tables are the result)."""
    from llmopt.bench.kernels import KERNEL_TITLES, TABLE_COLUMNS, summary, table_rows

    output_dir = Path(output_dir)
    write_results(output_dir, document)
    config, meta = document["config"], document["metadata"]
    paragraphs = [
        f"Device `{config['device']}`: copy bandwidth {config['copy_bandwidth_gb_s']:.1f} GB/s (`copy_`, bytes read + "
        f"written), dense GEMM {config['gemm_tflops']:.2f} TFLOPS. Each call timed on its own after a "
        f"{config['flush_bytes'] / 2**20:.0f} MiB cache flush; medians of {config['num_iters']} calls after "
        f"{config['num_iters_warmup']} warm-up. GB/s: the weight bytes as stored (int4 matmul) or the K/V bytes "
        "attended to (decode) over the time; speedup: the problem's first (dense / PyTorch) row's time over this one.",
    ]
    for kernel in config["kernels"]:
        rows = table_rows(document, kernel)
        if rows:
            line = summary(document, kernel)
            paragraphs += [f"## {KERNEL_TITLES[kernel]}", line and f"Speedups: {line}.",
                           markdown_table(rows, TABLE_COLUMNS)]
    _write_markdown(output_dir, "kernels", config["device"], meta, paragraphs)


def _write_markdown(output_dir: Path, kind: str, model: str, meta: dict[str, Any], paragraphs: list[str]) -> None:
    """report.md: a title, the line saying what ran where, then `paragraphs` (empty ones dropped)."""
    head = [f"# llmopt bench {kind}: {model}",
            f"{meta['date']}, llmopt {meta['llmopt_version']} ({meta['git_commit'] or 'no git'}), "
            f"{hardware_line(meta)}, torch {meta['torch']}."]
    text = "\n\n".join(p.strip() for p in head + paragraphs if p.strip()) + "\n"
    with atomic_file(output_dir / "report.md") as tmp:
        tmp.write_text(text, encoding="utf-8")


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]
