"""Writing a model as a Hugging Face folder (config.json, safetensors, tokenizer).

Used to cache the embedded default model and by `llmopt models convert`. Output is
written atomically: a crash leaves no folder a later run would trust.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from llmopt import __version__
from llmopt.core.atomic import atomic_dir
from llmopt.core.gguf_file import read_gguf, read_gguf_tokenizer
from llmopt.core.tokenizer import Tokenizer
from llmopt.core.weights import INDEX_FILE, open_weights, save_safetensors
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


def convert_source(source, out: Path, dtype: str = "float32", overwrite: bool = False,
                   load_format: str = "auto", quantization: str | None = None) -> Path:
    """Write any unquantized source (default, GGUF, folder, hub) as a Hugging Face folder; with
    `load_format` "dummy", random weights of its shape (a shipped architecture works as the source),
    with `quantization` ("awq" / "gptq") its projections as random packed int4 tensors."""
    if load_format == "dummy":
        return write_dummy_folder(source, out, dtype=dtype, overwrite=overwrite, quantization=quantization)
    if quantization is not None:
        raise LlmoptError(f"--quantization {quantization}: random packed weights are written with --load-format dummy")
    if source.kind == "gguf":
        return convert_gguf(source.path, out, dtype=dtype, overwrite=overwrite)
    if source.quantization is not None and source.quantization.method in ("awq", "gptq", "compressed-tensors"):
        raise LlmoptError(f"{source.spec} is already {source.quantization.method.upper()}-quantized; converting it is not supported")
    torch_dtype = DTYPES[dtype]
    reader = open_weights(source)
    tensors = {name: reader.get(name).to(torch_dtype) for name in reader}
    config = {**source.raw_config, "torch_dtype": dtype}
    tokenizer = Tokenizer.from_dir(source.path)
    provenance = {"converted_from": source.origin or str(source.path)}
    return write_hf_folder(out, config, tensors, tokenizer, provenance, overwrite=overwrite)


# shards of at most this many bytes, so that writing a checkpoint holds one shard in memory
DUMMY_SHARD_BYTES = 2 * 1024**3


def write_dummy_folder(source, out: Path, dtype: str = "bfloat16", overwrite: bool = False,
                       quantization: str | None = None) -> Path:
    """A Hugging Face folder of random weights of `source`'s shape (`core.dummy.DummyWeights`),
    with `source`'s tokenizer, sharded with an index as transformers writes one; with
    `quantization` ("awq" / "gptq"), an int4 checkpoint of that format (its packed tensors and
    `quantization_config`; the other tensors in `dtype`)."""
    from llmopt.core.dummy import DummyWeights, dummy_quantization

    torch_dtype = DTYPES[dtype]
    raw = {k: v for k, v in source.raw_config.items() if k != "quantization_config"}
    config = {**raw, "torch_dtype": dtype}
    quant = dummy_quantization(source.config, quantization) if quantization else None
    if quant is not None:
        config["quantization_config"] = {k: v for k, v in quant.details.items() if k != "dummy"}
    weights = DummyWeights(source.config, quantization=quant)
    stored = lambda name: weights.packed_dtype(name) or torch_dtype  # noqa: E731
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
        tokenizer = read_gguf_tokenizer(source.path) if source.kind == "gguf" else Tokenizer.from_dir(source.path)
        tokenizer.save(tmp)
        shards: list[list[str]] = [[]]
        size = 0
        for name, shape in weights.shapes.items():
            nbytes = stored(name).itemsize * math.prod(shape)
            if shards[-1] and size + nbytes > DUMMY_SHARD_BYTES:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        weight_map, total = {}, 0
        for i, names in enumerate(shards, 1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = {name: weights.get(name).to(stored(name)) for name in names}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            save_safetensors(tensors, tmp / file)
            del tensors
            weight_map.update(dict.fromkeys(names, file))
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
        (tmp / "llmopt_source.json").write_text(json.dumps(
            {"converted_from": source.spec, "load_format": "dummy", "quantization": quantization,
             "llmopt_version": __version__}, indent=2),
            encoding="utf-8")
    return Path(out)
