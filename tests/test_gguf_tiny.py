"""GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, read back by llmopt.

The tiny transformers models of conftest are exported to GGUF with the `gguf` package
(llama.cpp's own Python writer, its tensor-name map and its SpecialVocab), including
llama.cpp's q/k row permutation for the "llama" architecture. Loading that file must give
the same model as the original folder: same config, same tokenization, same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from llmopt.core import resolve
from llmopt.loader import load
from llmopt.core.tokenizer import Tokenizer
from test_decoder_vs_transformers import hf_model, our_packed_logits

PROMPTS = [
    [5, 17, 99, 3, 42],
    [7] * 3 + list(range(20, 41)),
    [120],
    list(range(200, 213)),
    [262, 261, 100, 101, 0, 255, 258],  # special and merged-token ids too
]

TEXTS = [
    "Hello world, the theme is in the thin air.",
    "12345 and 0.5 + 678",
    "  leading spaces\tand\ttabs\nnew lines\n\n",
    "héllo wörld — naïve café, 日本語, emoji 🙂👍🏽",
    "<|im_start|>user\nthe question<|im_end|>\n",
]


# ---------------------------------------------------------------------------------------
# A GGUF writer that follows llama.cpp's convert_hf_to_gguf.py (LlamaModel / Qwen2Model)
# ---------------------------------------------------------------------------------------
def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """LlamaModel.permute from convert_hf_to_gguf.py, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _q8_0_roundtrip(w: np.ndarray) -> np.ndarray:
    import gguf

    q = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)


def _hf_state_dict(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


def write_gguf_like_llama_cpp(folder: Path, out: Path, outtype: str = "f32", pre: str = "default") -> Path:
    """Export a tiny HF folder to GGUF as `convert_hf_to_gguf.py --outtype {f32,q8_0}` would."""
    import gguf
    from tokenizers import Tokenizer as HFTokenizer

    hp = json.loads((folder / "config.json").read_text())
    arch = hp["model_type"]
    assert arch in ("llama", "qwen2")
    n_head, n_kv = hp["num_attention_heads"], hp["num_key_value_heads"]
    n_layers = hp["num_hidden_layers"]
    rope_theta = (hp.get("rope_parameters") or {}).get("rope_theta", hp.get("rope_theta", 10000.0))

    writer = gguf.GGUFWriter(str(out), arch)
    # TextModel.set_gguf_parameters
    writer.add_name(folder.name)
    writer.add_block_count(n_layers)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if outtype == "q8_0" else gguf.LlamaFileType.ALL_F32
    writer.add_file_type(file_type)
    if arch == "llama":  # LlamaModel.set_gguf_parameters adds these; Qwen2Model does not
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // n_head)

    # TextModel._set_vocab_gpt2 / get_vocab_base
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = backend.get_vocab(with_added_tokens=True)
    reverse = {i: t for t, i in vocab.items()}
    added = backend.get_added_tokens_decoder()
    tokens, toktypes = [], []
    for i in range(hp["vocab_size"]):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            toktypes.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            toktypes.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    # merges, bos/eos ids and chat template exactly as llama.cpp collects them
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    assert special.merges and special.chat_template, "SpecialVocab found no merges / chat template"
    special.add_to_gguf(writer)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # tensors: HF name -> GGUF name through gguf's own map; q/k permuted for llama only
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2, n_layers)
    for hf_name, data in sorted(_hf_state_dict(folder).items()):
        data = data.astype(np.float32)
        if arch == "llama":
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = _permute(data, n_head, n_head)
            if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = _permute(data, n_head, n_kv)
        new_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, hf_name
        if outtype == "q8_0" and data.ndim == 2:  # norms and biases stay F32, as in llama.cpp
            writer.add_tensor(new_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(new_name, np.ascontiguousarray(data))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def gguf_files(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple[str, str], Path] = {}

    def get(kind: str, outtype: str = "f32") -> Path:
        if (kind, outtype) not in cache:
            cache[kind, outtype] = write_gguf_like_llama_cpp(tiny_models[kind], root / f"{kind}-{outtype}.gguf", outtype)
        return cache[kind, outtype]

    return get


def hf_logits(model, prompts):
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------
def test_writer_applies_llama_cpp_permutation(tiny_models, gguf_files):
    """Guard the test itself: the llama file really stores permuted q/k rows, qwen2 does not."""
    from gguf import GGUFReader

    for kind, permuted in (("llama", True), ("qwen2", False)):
        ref = _hf_state_dict(tiny_models[kind])["model.layers.0.self_attn.k_proj.weight"]
        tensors = {t.name: t for t in GGUFReader(str(gguf_files(kind))).tensors}
        stored = np.asarray(tensors["blk.0.attn_k.weight"].data).reshape(ref.shape)
        assert np.array_equal(stored, ref) is not permuted, kind
        assert np.array_equal(stored, _permute(ref, 4, 2) if permuted else ref)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_f32_gguf_logits_match_transformers(tiny_models, gguf_files, kind):
    ours = load(str(gguf_files(kind)), dtype="float32")
    assert ours.quantization is not None and ours.quantization.details["file_type"] == "F32"
    expected = hf_logits(hf_model(tiny_models[kind]), PROMPTS)
    got = our_packed_logits(ours, PROMPTS)
    for prompt, g, e in zip(PROMPTS, got, expected):
        assert g.shape == e.shape
        diff = (g - e).abs().max().item()
        assert diff < 1e-4, f"{kind}: max |diff| {diff} for a prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_config_matches_folder(tiny_models, gguf_files, kind):
    from_gguf = resolve(str(gguf_files(kind)))
    from_folder = resolve(str(tiny_models[kind]))
    assert from_gguf.kind == "gguf"
    a, b = from_gguf.config.to_dict(), from_folder.config.to_dict()
    keys = ["architecture", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
            "max_position_embeddings", "tie_word_embeddings", "attention_bias", "o_proj_bias", "mlp_bias",
            "sliding_windows", "bos_token_id", "eos_token_ids"]
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert from_gguf.config.num_parameters == from_folder.config.num_parameters


def test_gguf_tokenizer_matches_folder(tiny_models, gguf_files):
    folder_tok = Tokenizer.from_dir(tiny_models["qwen2"])
    gguf_tok = load(str(gguf_files("qwen2")), dtype="float32").tokenizer
    assert gguf_tok.vocab_size == folder_tok.vocab_size
    assert gguf_tok.eos_token == folder_tok.eos_token == "<|im_end|>"
    assert gguf_tok.eos_token_ids == folder_tok.eos_token_ids
    assert gguf_tok.chat_template == folder_tok.chat_template
    for text in TEXTS:
        ids = folder_tok.encode(text)
        assert gguf_tok.encode(text) == ids, text
        assert gguf_tok.decode(ids, skip_special_tokens=False) == text
    # the merges are really used (not just byte fallback): "the" is one token after a space
    assert len(gguf_tok.encode(" the")) == 1
    assert gguf_tok.encode("<|im_start|>") == [folder_tok.token_to_id("<|im_start|>")]
    messages = [{"role": "user", "content": "hi there"}]
    assert gguf_tok.encode_chat(messages) == folder_tok.encode_chat(messages)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_q8_0_gguf_matches_transformers_on_dequantized_weights(tiny_models, gguf_files, kind):
    path = gguf_files(kind, "q8_0")
    assert resolve(str(path)).quantization.details["file_type"] == "Q8_0"
    ours = our_packed_logits(load(str(path), dtype="float32"), PROMPTS)

    # reference: transformers with every matrix replaced by its Q8_0 round trip (in HF layout:
    # Q8_0 blocks run along rows, so quantizing commutes with llama.cpp's row permutation)
    ref = hf_model(tiny_models[kind])
    original = hf_logits(ref, PROMPTS)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(_q8_0_roundtrip(p.detach().numpy())))
    quantized = hf_logits(ref, PROMPTS)

    assert max_diff(ours, quantized) < 1e-4
    # and the quantization is real but mild: not bit-identical to F32, still close, same greedy picks
    drift = max_diff(ours, original)
    assert 1e-5 < drift < 0.5, drift
    same = sum((o.argmax(-1) == e.argmax(-1)).sum().item() for o, e in zip(ours, original))
    total = sum(len(p) for p in PROMPTS)
    assert same >= 0.9 * total, f"{same}/{total} greedy tokens agree"


@pytest.mark.parametrize("kind,outtype", [("llama", "q8_0"), ("qwen2", "f32")])
def test_cli_convert_gguf_to_folder(tiny_models, gguf_files, tmp_path, kind, outtype):
    from llmopt.cli.main import app

    path = gguf_files(kind, outtype)
    out = tmp_path / "converted"
    result = CliRunner().invoke(app, ["models", "convert", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()

    # the written tensors are the original HF ones (Q8_0 round-tripped), in HF layout and names
    original = _hf_state_dict(tiny_models[kind])
    written = _hf_state_dict(out)
    assert set(written) == set(original)
    for name, w in original.items():
        want = _q8_0_roundtrip(w) if outtype == "q8_0" and w.ndim == 2 else w
        assert np.allclose(written[name], want, rtol=0, atol=1e-6), name

    from_gguf = our_packed_logits(load(str(path), dtype="float32"), PROMPTS)
    converted = load(str(out), dtype="float32")
    assert max_diff(our_packed_logits(converted, PROMPTS), from_gguf) < 1e-6
    # the folder is a real Hugging Face folder: transformers reads it and agrees
    assert max_diff(hf_logits(hf_model(out), PROMPTS), from_gguf) < 1e-4
    if outtype == "f32":  # lossless: the converted folder is the original model again
        assert max_diff(hf_logits(hf_model(tiny_models[kind]), PROMPTS), from_gguf) < 1e-4
    folder_tok = Tokenizer.from_dir(tiny_models[kind])
    for text in TEXTS:
        assert converted.tokenizer.encode(text) == folder_tok.encode(text), text
