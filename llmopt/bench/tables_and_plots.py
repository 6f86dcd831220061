"""Report building blocks every `llmopt bench` command shares: number formatting, Markdown
tables, and PNG plots (matplotlib, Agg back end) from plain lists and dicts.

Each plot function takes data only, writes one PNG atomically and returns its path; a series
value of None (a figure that could not be measured) leaves a gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmopt.core.atomic import atomic_file
from llmopt.errors import LlmoptError


def format_value(value: Any) -> str:
    """A figure for a table: '-' for None, integers as they are, floats to 4 significant digits
    (never scientific notation for ordinary magnitudes)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        magnitude = abs(value)
        if magnitude >= 1000 or value.is_integer():
            return f"{value:,.0f}" if magnitude >= 1000 else f"{value:.0f}"
        if magnitude >= 1:
            return f"{value:.4g}"
        return f"{value:.3g}" if magnitude >= 1e-4 else f"{value:.2e}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) or "-"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]] | Sequence[Sequence[Any]], columns: Sequence[str]) -> str:
    """A GitHub Markdown table. `rows`: dicts (looked up by column name) or sequences (in column order);
    values go through `format_value`; '|' inside a cell is escaped."""
    def cell(value: Any) -> str:
        return (value if isinstance(value, str) else format_value(value)).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        values = [row.get(c) for c in columns] if isinstance(row, dict) else list(row)
        lines.append("| " + " | ".join(cell(v) for v in values) + " |")
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise LlmoptError("plots need matplotlib: pip install 'llmopt[bench]'") from None
    matplotlib.use("Agg")  # files only: never a window, works without a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def _numbers(values: Sequence[float | None]) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


def plot_lines(path: Path, x: Sequence[float], panels: dict[str, dict[str, Sequence[float | None]]], *,
               xlabel: str, title: str, logx: bool = False, xticklabels: Sequence[str] | None = None,
               ncols: int = 2) -> Path:
    """Line charts sharing one x axis, `ncols` to a row: `panels` maps each panel's y-axis label to its
    series (legend label -> one y per x). `xticklabels` names the x positions (e.g. 'inf')."""
    plt = _pyplot()
    ncols = max(1, min(ncols, len(panels)))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (ylabel, series) in zip(axes.flat, panels.items()):
        for name, ys in series.items():
            ax.plot(list(x), _numbers(ys), marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log")
        if xticklabels is not None:
            ax.set_xticks(list(x), list(xticklabels))
            ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    return _save(fig, path)


def plot_bars(path: Path, categories: Sequence[str], series: dict[str, Sequence[float | None]], *,
              ylabel: str, title: str) -> Path:
    """Grouped bars: one group per category, one bar per series (e.g. engines side by side)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(categories) * max(1, len(series)) ** 0.5 + 2), 4.0))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        positions = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        bars = ax.bar(positions, _numbers(values), width, label=name)
        ax.bar_label(bars, labels=[format_value(v) for v in values], fontsize="x-small", padding=2)
    ax.set_xticks(range(len(categories)), list(categories))
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize="small")
    ax.set_title(title)
    return _save(fig, path)


def plot_scatter(path: Path, points: Sequence[tuple[float | None, float | None, str]], *, xlabel: str,
                 ylabel: str, title: str, frontier: str | None = None) -> Path:
    """Labelled points (x, y, label). `frontier` = "min-x-max-y" joins the Pareto-optimal points (no
    other point is both further left and higher): e.g. latency on x, throughput on y."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.5))
    shown = [(float(x), float(y), label) for x, y, label in points if x is not None and y is not None]
    ax.scatter([p[0] for p in shown], [p[1] for p in shown], zorder=3)
    for x, y, label in shown:
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize="small")
    if frontier == "min-x-max-y" and shown:
        best, top = [], float("-inf")
        for x, y, _ in sorted(shown, key=lambda p: (p[0], -p[1])):
            if y > top:
                best.append((x, y))
                top = y
        ax.plot([p[0] for p in best], [p[1] for p in best], linestyle="--", label="Pareto frontier")
        ax.legend(fontsize="small")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    return _save(fig, path)


def plot_cdf(path: Path, samples: dict[str, Sequence[float]], *, xlabel: str, title: str,
             logx: bool = False) -> Path:
    """Empirical distribution functions, one step line per sample set (legend label -> values): the
    fraction of values at or below x, so any percentile reads off the y axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.5))
    for name, values in samples.items():
        xs = sorted(values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{name} (n={len(xs)})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of values <= x")
    if logx:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title)
    return _save(fig, path)
