"""What a checkpoint says of its own quantization (a leaf: `source`, `dummy` and the loader read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class QuantizationInfo:
    method: str  # "awq" | "gptq" | "compressed-tensors" | "gguf"
    bits: int | None = None
    group_size: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
