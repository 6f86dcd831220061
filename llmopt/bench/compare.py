"""`llmopt bench compare`: runs of several results files side by side, with the % change of each
numeric figure against the first file. Runs are matched by label ("concurrency=4", an engine,
a batch size); a label missing from a file shows as '-'."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.bench.results import load_results
from llmopt.errors import LlmoptError

# per-run keys that describe the run rather than measure it
_SETTINGS = {"label", "request_rate", "burstiness", "max_concurrency"}


@dataclass
class Comparison:
    kind: str
    names: list[str]  # one column name per file
    documents: list[dict[str, Any]]
    rows: list[list[Any]]  # [label, figure, value 1, value 2, % change 2, value 3, % change 3, ...]

    @property
    def columns(self) -> list[str]:
        cols = ["run", "figure", self.names[0]]
        for name in self.names[1:]:
            cols += [name, f"change {name}"]
        return cols


def compare_files(paths: list[Path], metrics: list[str] | None = None) -> Comparison:
    """Load every file (a results.json or its folder), check they are of one kind, and line up their
    numeric figures. `metrics`: figure names or shell patterns (e.g. '*ttft*') to keep."""
    if len(paths) < 2:
        raise LlmoptError("bench compare needs at least two results files (or folders)")
    documents = [load_results(Path(p)) for p in paths]
    kinds = {d["kind"] for d in documents}
    if len(kinds) > 1:
        listing = ", ".join(f"{p} is {d['kind']}" for p, d in zip(paths, documents))
        raise LlmoptError(f"cannot compare results of different kinds: {listing}")
    labels: list[str] = []
    keys: list[str] = []
    for document in documents:
        for run in document["runs"]:
            label = str(run.get("label"))
            if label not in labels:
                labels.append(label)
            for key, value in run.items():
                if key not in keys and key not in _SETTINGS and _is_number(value):
                    keys.append(key)
    if metrics:
        keys = [k for k in keys if any(fnmatch.fnmatchcase(k, pattern) for pattern in metrics)]
        if not keys:
            raise LlmoptError(f"--metrics {','.join(metrics)} matches no figure in these files")
    by_label = [{str(run.get("label")): run for run in d["runs"]} for d in documents]
    rows = []
    for label in labels:
        for key in keys:
            values = [runs.get(label, {}).get(key) for runs in by_label]
            values = [v if _is_number(v) else None for v in values]
            if all(v is None for v in values):
                continue
            row: list[Any] = [label, key, values[0]]
            for value in values[1:]:
                row += [value, percent_change(values[0], value)]
            rows.append(row)
    return Comparison(kinds.pop(), column_names(paths), documents, rows)


def percent_change(base: float | None, value: float | None) -> str:
    """'+12.3%' of value against base; '-' when either is missing, 'n/a' from a zero base."""
    if base is None or value is None:
        return "-"
    if base == 0:
        return "0.0%" if value == 0 else "n/a"
    return f"{(value - base) / abs(base) * 100:+.1f}%"


def column_names(paths: list[Path]) -> list[str]:
    """A short distinct name per file: the folder for .../NAME/results.json, else the file name."""
    names = []
    for p in paths:
        p = Path(p)
        names.append(p.parent.name if p.name == "results.json" and p.parent.name else p.name)
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    return names


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
