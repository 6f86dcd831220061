"""Reading and writing safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmopt.errors import LlmoptError

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder, in index order when sharded."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LlmoptError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise LlmoptError(f"{folder}: shard(s) named in {INDEX_FILE} are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(folder.glob("pytorch_model*.bin"))
        hint = " (only PyTorch .bin weights found; convert them to safetensors)" if bins else ""
        raise LlmoptError(f"{folder} has no .safetensors weights{hint}")
    return files


def load_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the files, memory-mapped; a corrupt or truncated file is a clear error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise LlmoptError(f"{path} is not a readable safetensors file (corrupt or truncated?): {exc}") from None
    return tensors


def check_safetensors(files: list[Path]) -> int:
    """Each file's header read and checked without reading tensor data: safetensors' own `safe_open`
    refuses a header that does not parse, offsets that overlap or leave gaps, a tensor whose byte
    range does not fit its shape and dtype, and data that does not end where the file does.
    LlmoptError naming the first bad file; returns the number of tensors."""
    from safetensors import SafetensorError, safe_open

    count = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                count += len(f.keys())
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise LlmoptError(f"{path} is not a readable safetensors file (corrupt or truncated?): {exc}") from None
    return count


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
