"""Model specs -> typed sources: `resolve("default" | folder | file.gguf | org/name)`; a source's tokenizer."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.core.architectures import SHIPPED
from llmopt.core.config import ModelConfig, read_json
from llmopt.core.quantization_info import QuantizationInfo
from llmopt.core.tokenizer import Tokenizer
from llmopt.errors import LlmoptError

SUPPORTED_QUANT_METHODS = ("awq", "gptq", "compressed-tensors")
# "auto": the checkpoint's own weights; "dummy": random weights of its shape (vLLM's names)
LOAD_FORMATS = ("auto", "dummy")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class ModelSource:
    spec: str  # what the user typed
    kind: str  # "default" | "folder" | "hub" | "gguf" | "architecture" (a shipped config, no weights)
    path: Path  # a Hugging Face folder, or the .gguf file
    config: ModelConfig
    raw_config: dict[str, Any]  # the config.json content (or its GGUF equivalent)
    quantization: QuantizationInfo | None = None
    origin: str | None = None  # where the files came from when not `path` itself


def resolve(spec: str) -> ModelSource:
    """Turn a model spec into a source whose config has been read and checked."""
    spec = spec.strip()
    if not spec:
        raise LlmoptError("empty model spec; use 'default', a local folder, a .gguf file or a hub id (org/name)")
    if spec == "default":
        from llmopt.core.embedded import default_gguf_path, default_model_dir

        folder = default_model_dir()
        source = _folder_source(spec, folder, kind="default")
        source.origin = str(default_gguf_path())
        source.quantization = QuantizationInfo(method="gguf", bits=4, details={"file_type": "Q4_1", "dequantized": True})
        return source
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            return _folder_source(spec, path, kind="folder")
        if path.suffix == ".gguf":
            return _gguf_source(spec, path)
        raise LlmoptError(f"{spec} is a file but not a .gguf file; pass a model folder, a .gguf file or a hub id")
    if spec.endswith(".gguf") or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise LlmoptError(f"{spec} does not exist")
    if spec.lower() in SHIPPED:
        return _architecture_source(spec)
    if _HUB_ID.match(spec):
        return _folder_source(spec, _download(spec), kind="hub")
    raise LlmoptError(
        f"unknown model spec {spec!r}: expected 'default', an existing folder, a .gguf file, a hub id like org/name, "
        f"or a shipped architecture ({', '.join(SHIPPED)}) with --load-format dummy"
    )


def resolve_gguf(spec: str) -> ModelSource | None:
    """The GGUF file a spec names, as a source of kind "gguf" (what llama.cpp runs): "default" is
    the embedded GGUF file itself, where `resolve` gives its converted folder; None when the spec
    names no .gguf file (told from the name alone, before anything is read or downloaded)."""
    spec = spec.strip()
    if spec == "default":
        from llmopt.core.embedded import default_gguf_path

        return _gguf_source(spec, default_gguf_path())
    if Path(spec).suffix != ".gguf":
        return None
    source = resolve(spec)
    return source if source.kind == "gguf" else None


def _architecture_source(spec: str) -> ModelSource:
    """A shipped architecture (`core.architectures`) with the default model's tokenizer and its
    vocabulary, so that random weights of the architecture's shape run end to end."""
    from llmopt.core.dummy import dummy_raw_config
    from llmopt.core.embedded import default_model_dir

    folder = default_model_dir()
    tokenizer_config = read_json(folder / "config.json")
    raw = dummy_raw_config(SHIPPED[spec.lower()], vocab_size=int(tokenizer_config["vocab_size"]),
                           bos_token_id=tokenizer_config.get("bos_token_id"),
                           eos_token_id=tokenizer_config.get("eos_token_id"))
    config = ModelConfig.from_hf(raw, where=f"shipped architecture {spec}")
    return ModelSource(spec=spec, kind="architecture", path=folder, config=config, raw_config=raw,
                       origin=f"shipped architecture {spec.lower()} (weights: --load-format dummy)")


def _folder_source(spec: str, folder: Path, kind: str) -> ModelSource:
    config_path = folder / "config.json"
    if not config_path.exists():
        raise LlmoptError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    raw = read_json(config_path)
    config = ModelConfig.from_hf(raw, where=str(config_path))
    return ModelSource(spec=spec, kind=kind, path=folder, config=config, raw_config=raw,
                       quantization=_quantization_of(raw, config_path))


def _quantization_of(raw: dict[str, Any], where: Path) -> QuantizationInfo | None:
    qc = raw.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise LlmoptError(f"{where}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in SUPPORTED_QUANT_METHODS:
        raise LlmoptError(
            f"{where}: quantization method {method or 'none given'!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_QUANT_METHODS)}"
        )
    if method == "compressed-tensors":  # the scheme lives in config_groups (llm-compressor's checkpoints)
        from llmopt.core.compressed_tensors import read_scheme

        scheme = read_scheme(qc, str(where))
        return QuantizationInfo(method=method, bits=scheme.num_bits, group_size=scheme.llmopt_group_size,
                                details={**qc, "scheme": scheme.name})
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    for key, value, lowest in (("bits", bits, 1), ("group_size", group, -1)):
        bad = isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < lowest
        if value is not None and bad:
            raise LlmoptError(f"{where}: quantization_config {key} must be a positive integer"
                              f"{' (or -1: per channel)' * (lowest < 0)}, got {value!r}")
    return QuantizationInfo(method=method, bits=bits, group_size=group, details=dict(qc))


def _gguf_source(spec: str, path: Path) -> ModelSource:
    from llmopt.core.gguf_file import read_gguf_config

    raw, file_type = read_gguf_config(path)
    config = ModelConfig.from_hf(raw, where=str(path))
    return ModelSource(spec=spec, kind="gguf", path=path, config=config, raw_config=raw,
                       quantization=QuantizationInfo(method="gguf", details={"file_type": file_type}))


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model"]
        )
    except Exception as exc:  # network errors, missing repos, offline mode without a cached copy
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else f"{type(exc).__name__}: {exc}"
        raise LlmoptError(
            f"cannot get {repo_id!r} from the Hugging Face hub ({why}). Pass a local folder instead, "
            "or unset HF_HUB_OFFLINE on a machine that reaches the hub"
        ) from None
    return Path(folder)


def load_tokenizer(source: ModelSource | str) -> Tokenizer:
    """The model's tokenizer alone (from its folder, or from the GGUF file's metadata)."""
    if isinstance(source, str):
        source = resolve(source)
    if source.kind == "gguf":
        from llmopt.core.gguf_file import read_gguf_tokenizer

        return read_gguf_tokenizer(source.path)
    return Tokenizer.from_dir(source.path, extra_eos_token_ids=_generation_eos(source.path, source.config))


def _generation_eos(folder: Path, config: ModelConfig) -> list[int]:
    path = folder / "generation_config.json"
    ids = list(config.eos_token_ids)
    if path.exists():
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        for e in eos if isinstance(eos, list) else [eos]:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return ids
