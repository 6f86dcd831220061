"""`--load-format dummy --quantization awq|gptq`: random int4 weights packed as that format's
checkpoint tensors, deterministic, loaded through the same unpacking and int4 layers as a real
AWQ / GPTQ checkpoint (a folder holding exactly these tensors loads to the same logits)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from conftest import assert_usage_error, run_cli
from llmopt.core import resolve
from llmopt.core.dummy import INIT_STD, DummyWeights, dummy_quantization
from llmopt.core.quant_formats import packed_shapes, unpack_tensors
from llmopt.core.quantized_weight import QuantScheme
from llmopt.errors import LlmoptError

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_projections_are_the_formats_packed_tensors(tiny_models, method):
    config = resolve(str(tiny_models["llama"])).config
    quant = dummy_quantization(config, method)
    assert (quant.method, quant.bits, quant.group_size) == (method, 4, 64)  # 128 does not divide hidden 64
    assert quant.details["quant_method"] == method and quant.details["group_size"] == 64
    weights = DummyWeights(config, quantization=quant)
    scheme = QuantScheme(bits=4, group_size=64, sym=True)
    for i in range(config.num_hidden_layers):
        for projection in PROJECTIONS:
            prefix = f"model.layers.{i}.{projection}"
            assert f"{prefix}.weight" not in weights
            dense = DummyWeights(config).shape(f"{prefix}.weight")
            for name, (dtype, shape) in packed_shapes(method, prefix, *dense, scheme).items():
                tensor = weights[name]
                assert tensor.dtype == dtype and tuple(tensor.shape) == shape, name
    assert "model.embed_tokens.weight" in weights and weights["model.norm.weight"].eq(1).all()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_packed_weights_are_deterministic_and_unpack_to_a_sane_grid(tiny_models, method):
    config = resolve(str(tiny_models["llama"])).config
    quant = dummy_quantization(config, method)
    a, b = DummyWeights(config, quantization=quant), DummyWeights(config, quantization=quant)
    assert all(torch.equal(a[n], b[n]) for n in a.names())
    prefix = "model.layers.1.mlp.down_proj"
    q = unpack_tensors(method, {n: a[n] for n in a.names() if n.startswith(prefix + ".")}, prefix, 4, 64)
    assert q.codes.shape == (64, 128) and int(q.codes.min()) == 0 and int(q.codes.max()) == 15
    assert q.zeros.eq(8).all() and q.scales.gt(0).all()
    assert torch.equal(q.g_idx, torch.arange(128, dtype=torch.int32) // 64)
    assert 0.5 * INIT_STD < float(q.dequantize().std()) < 2 * INIT_STD  # about the dense noise's spread
    other = a["model.layers.0.mlp.down_proj.qweight"]
    assert not torch.equal(a[prefix + ".qweight"], other)  # each projection its own codes


def test_a_group_size_must_divide_the_projections():
    config = resolve("llama-3.2-1b").config
    assert dummy_quantization(config, "awq").group_size == 128
    with pytest.raises(LlmoptError, match="do not split into groups"):
        dummy_quantization(replace(config, hidden_size=2040), "gptq")
    with pytest.raises(LlmoptError, match="awq, gptq"):
        dummy_quantization(config, "fp8")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dummy_int4_loads_like_the_same_tensors_in_a_checkpoint(tiny_models, tmp_path, method):
    """The dummy model runs the int4 layers, and a real checkpoint folder holding exactly its tensors
    (and the quantization_config it reports) loads to the same logits through the normal path."""
    from safetensors.torch import save_file

    from llmopt.loader import load
    from llmopt.model.linear import DenseLinear

    folder = tiny_models["llama"]
    dummy = load(str(folder), dtype="float32", device="cpu", load_format="dummy", quantization=method)
    assert dummy.quantization.method == method and dummy.quantization.details["dummy"]
    layers = dummy.model.model.layers
    assert not any(isinstance(m, DenseLinear) for layer in layers for m in layer.modules())  # every projection int4
    weights = DummyWeights(dummy.config, quantization=dummy.quantization)
    out = tmp_path / method
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({n: weights[n].contiguous() for n in weights.names()}, str(out / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    details = {k: v for k, v in dummy.quantization.details.items() if k != "dummy"}
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": details}))
    real = load(str(out), dtype="float32", device="cpu")
    assert real.quantization.method == method
    from llmopt.model.attention import EqualLengthAttention

    ids = torch.tensor([3, 14, 15, 92, 65, 35])

    def logits(loaded):
        with torch.inference_mode():
            return loaded.model.compute_logits(loaded.model(ids, torch.arange(6), EqualLengthAttention(1, 6)))

    assert torch.equal(logits(dummy), logits(real))


def test_generate_runs_a_dummy_int4_model(tiny_models):
    code, err, out = run_cli("generate", str(tiny_models["llama"]), "-p", "hi", "--max-tokens", "4", "--load-format",
                             "dummy", "--quantization", "gptq", "--dtype", "float32", "--ignore-eos")
    assert code == 0, err
    assert "1 request(s), 4 tokens" in err


def test_quantization_must_match_a_real_checkpoint(tiny_models):
    assert_usage_error(["generate", str(tiny_models["llama"]), "-p", "hi", "--quantization", "awq"],
                       "--quantization awq", "not quantized", "--load-format dummy")


def test_serve_takes_quantization_on_llmopt_and_vllm_only(tiny_models):
    assert_usage_error(["serve", str(tiny_models["llama"]), "--engine", "llama.cpp", "--quantization", "awq"],
                       "--quantization applies to --engine llmopt and vllm")
    assert_usage_error(["serve", str(tiny_models["llama"]), "--tensor-parallel-size", "2"],
                       "--tensor-parallel-size applies to --engine vllm only")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_models_convert_writes_the_dummy_int4_checkpoint(tiny_models, tmp_path, method):
    """`models convert --load-format dummy --quantization M` writes the dummy int4 model as a
    checkpoint folder of that format, which loads to the dummy model's logits."""
    from llmopt.loader import load
    from llmopt.model.attention import EqualLengthAttention

    out = tmp_path / method
    code, err, _ = run_cli("models", "convert", str(tiny_models["llama"]), "-o", str(out), "--load-format", "dummy",
                           "--quantization", method, "--dtype", "bfloat16")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == method
    ids = torch.tensor([3, 14, 15, 92, 65, 35])

    def logits(loaded):
        with torch.inference_mode():
            return loaded.model.compute_logits(loaded.model(ids, torch.arange(6), EqualLengthAttention(1, 6)))

    dummy = load(str(tiny_models["llama"]), dtype="float32", load_format="dummy", quantization=method)
    written = load(str(out), dtype="float32")
    assert written.quantization.method == method
    assert torch.equal(logits(written), logits(dummy))


def test_models_convert_quantization_needs_dummy_weights(tiny_models, tmp_path):
    assert_usage_error(["models", "convert", str(tiny_models["llama"]), "-o", str(tmp_path / "q"),
                        "--quantization", "awq"], "--load-format dummy")
