"""Writing a model as a Hugging Face folder (config.json, safetensors, tokenizer).

Used to cache the embedded default model and by `llmopt models convert`. Output is
written atomically: a crash leaves no folder a later run would trust.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmopt import __version__
from llmopt.core.atomic import atomic_dir
from llmopt.core.gguf_file import read_gguf
from llmopt.core.tokenizer import Tokenizer
from llmopt.core.weights import load_safetensors, safetensors_files, save_safetensors
from llmopt.errors import LlmoptError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_hf_folder(
    out: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    provenance: dict[str, Any],
    overwrite: bool = False,
) -> Path:
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        write_hf_files(tmp, config, tokenizer, provenance)
        save_safetensors(tensors, tmp / "model.safetensors")
    return Path(out)


def write_hf_files(folder: Path, config: dict[str, Any], tokenizer: Tokenizer, provenance: dict[str, Any]) -> None:
    """Everything of a Hugging Face folder but the weights: config, generation config, tokenizer,
    and llmopt_source.json (where the weights came from)."""
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    tokenizer.save(folder)
    (folder / "llmopt_source.json").write_text(
        json.dumps({**provenance, "llmopt_version": __version__}, indent=2), encoding="utf-8"
    )


def convert_gguf(gguf_path: Path, out: Path, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Dequantize a GGUF file into a Hugging Face folder."""
    model = read_gguf(gguf_path)
    torch_dtype = DTYPES[dtype]
    tensors = {k: v.to(torch_dtype) for k, v in model.tensors.items()}
    config = {**model.config, "torch_dtype": dtype}
    provenance = {"converted_from": str(gguf_path), "gguf_file_type": model.file_type}
    return write_hf_folder(out, config, tensors, model.tokenizer, provenance, overwrite=overwrite)


def convert_source(source, out: Path, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write any unquantized source (default, GGUF, folder, hub) as a Hugging Face folder."""
    if source.kind == "gguf":
        return convert_gguf(source.path, out, dtype=dtype, overwrite=overwrite)
    if source.quantization is not None and source.quantization.method in ("awq", "gptq"):
        raise LlmoptError(f"{source.spec} is already {source.quantization.method.upper()}-quantized; converting it is not supported")
    torch_dtype = DTYPES[dtype]
    tensors = {k: v.to(torch_dtype) for k, v in load_safetensors(safetensors_files(source.path)).items()}
    config = {**source.raw_config, "torch_dtype": dtype}
    tokenizer = Tokenizer.from_dir(source.path)
    provenance = {"converted_from": source.origin or str(source.path)}
    return write_hf_folder(out, config, tensors, tokenizer, provenance, overwrite=overwrite)
