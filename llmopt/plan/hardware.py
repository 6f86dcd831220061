"""The GPUs `llmopt plan` knows: memory, memory bandwidth (the vendors' datasheets) and an hourly
price. Prices are indicative on-demand rates of GPU clouds in 2026 for one GPU; they vary by
provider and month, so `--prices FILE` (JSON: {"H100-SXM": 2.1, ...}) overrides them, and new
GPUs can be added the same way with {"name": {"memory_gib": .., "bandwidth_gb_s": .., "usd_per_hour": ..}}."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from llmopt.errors import LlmoptError


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    bandwidth_gb_s: float
    usd_per_hour: float


GPUS: dict[str, Gpu] = {g.name: g for g in [
    Gpu("H200", 141, 4800, 3.50),
    Gpu("H100-SXM", 80, 3350, 2.50),
    Gpu("H100-PCIe", 80, 2000, 2.00),
    Gpu("A100-80GB", 80, 2039, 1.60),
    Gpu("A100-40GB", 40, 1555, 1.20),
    Gpu("L40S", 48, 864, 0.90),
    Gpu("RTX-A6000", 48, 768, 0.50),
    Gpu("RTX-4090", 24, 1008, 0.40),
    Gpu("A10G", 24, 600, 0.75),
    Gpu("L4", 24, 300, 0.50),
    Gpu("T4", 16, 320, 0.35),
]}


def gpu_table(prices_file: Path | None = None) -> dict[str, Gpu]:
    """GPUS with the prices (and extra GPUs) of `prices_file` applied."""
    table = dict(GPUS)
    if prices_file is None:
        return table
    try:
        data = json.loads(Path(prices_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LlmoptError(f"cannot read prices file {prices_file}: {exc}") from None
    if not isinstance(data, dict):
        raise LlmoptError(f"prices file {prices_file}: expected a JSON object of GPU name -> price or spec")
    for name, value in data.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name in table:
            table[name] = replace(table[name], usd_per_hour=float(value))
        elif isinstance(value, dict):
            try:
                table[name] = Gpu(name, float(value["memory_gib"]), float(value["bandwidth_gb_s"]),
                                  float(value["usd_per_hour"]))
            except (KeyError, TypeError, ValueError):
                raise LlmoptError(f"prices file {prices_file}: {name!r} needs memory_gib, bandwidth_gb_s and "
                                  "usd_per_hour numbers") from None
        else:
            raise LlmoptError(f"prices file {prices_file}: unknown GPU {name!r} (known: {', '.join(table)}); "
                              "give a new one as {memory_gib, bandwidth_gb_s, usd_per_hour}")
    return table
