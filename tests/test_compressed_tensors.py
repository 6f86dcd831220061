"""compressed-tensors checkpoints (FP8 float-quantized, W4A16 pack-quantized) against independent
readers and writers:

- the `compressed-tensors` package (test extra) validates our `quantization_config` and
  decompresses our tensors to exactly the weights llmopt's loader gives (FP8 bitwise; int4
  within the fp16 rounding of its scale-times-code product);
- a checkpoint compressed by the package's own compressors from its own FP8_DYNAMIC
  quantization of the same model equals ours byte for byte, and loads in llmopt;
- transformers' compressed-tensors integration loads our folders with logits close to llmopt's;
- with llm-compressor itself (LLMOPT_LLMCOMPRESSOR_PYTHON): its `oneshot` FP8_DYNAMIC gives our
  bytes, and its GPTQModifier W4A16 checkpoint loads in llmopt with transformers' greedy tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from llmopt.core.compressed_tensors import read_scheme
from llmopt.core.fp8_weight import FP8_DTYPE, quantize_fp8
from llmopt.core.weights import load_safetensors, save_safetensors
from llmopt.loader import load
from llmopt.quant.quantize import QuantizeRequest, hf_state_dict, quantize
from conftest import assert_usage_error

def _logits(model, ids: list[int]) -> torch.Tensor:
    from llmopt.model.attention import EqualLengthAttention

    tokens = torch.tensor(ids)
    with torch.inference_mode():
        return model.compute_logits(model(tokens, torch.arange(len(ids)), EqualLengthAttention(1, len(ids)))).float()


PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 32


def _calib(tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("a fox runs over the lazy dog while the river sings. " * 60, encoding="utf-8")
    return str(calib)


@pytest.fixture(scope="module")
def fp8_dynamic(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct") / "fp8-dynamic"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method="fp8"))
    return out


def test_fp8_dynamic_checkpoint_tensors_and_config(fp8_dynamic, tiny_models):
    config = json.loads((fp8_dynamic / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["dynamic"] is True
    assert read_scheme(qc, "x").name == "FP8_DYNAMIC"
    tensors = load_safetensors([fp8_dynamic / "model.safetensors"])
    source = load_safetensors([tiny_models["llama"] / "model.safetensors"])
    for layer in range(3):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            w, scale = tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale"]
            assert w.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1)
            assert f"{prefix}.input_scale" not in tensors
            # the largest weight of each row lands on e4m3's largest value, 448
            assert torch.equal(w.float().abs().amax(dim=1), torch.full((w.shape[0],), 448.0))
            err = (w.float() * scale - source[f"{prefix}.weight"]).abs() / source[f"{prefix}.weight"].abs().amax(1, True)
            assert float(err.max()) <= 2 ** -4 + 1e-6, prefix  # e4m3: 3 mantissa bits, half a step at most
    assert tensors["lm_head.weight"].dtype == torch.float16


def test_fp8_static_scheme_has_tensor_scales_and_input_scales(tiny_models, tmp_path):
    out = tmp_path / "fp8"
    report = quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method="fp8", fp8_scheme="FP8",
                                      calib=_calib(tmp_path), num_samples=4, seq_len=32))
    assert report.calibration is not None and report.parameters["scheme"] == "FP8"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert read_scheme(qc, "x").name == "FP8"
    tensors = load_safetensors([out / "model.safetensors"])
    for proj in PROJECTIONS:
        prefix = f"model.layers.1.{proj}"
        assert tensors[f"{prefix}.weight_scale"].shape == (1,) and tensors[f"{prefix}.input_scale"].shape == (1,)
        assert float(tensors[f"{prefix}.weight"].float().abs().max()) == 448.0  # each tensor has its own scale
    # q, k and v see the same input, so the same activation scale
    scales = {float(tensors[f"model.layers.0.self_attn.{p}_proj.input_scale"]) for p in "qkv"}
    assert len(scales) == 1 and scales.pop() > 0
    loaded = load(str(out), int4_kernels=False)
    assert loaded.source.quantization.details["scheme"] == "FP8"
    dense = hf_state_dict(loaded.model)  # q, k, v stacked, each with its own per-tensor scale
    for proj in PROJECTIONS:
        prefix = f"model.layers.0.{proj}"
        assert torch.equal(dense[f"{prefix}.weight"],
                           tensors[f"{prefix}.weight"].float() * tensors[f"{prefix}.weight_scale"]), prefix


def test_fp8_loads_as_its_dequantized_weights(fp8_dynamic):
    tensors = load_safetensors([fp8_dynamic / "model.safetensors"])
    ours = hf_state_dict(load(str(fp8_dynamic), int4_kernels=False).model)
    for proj in PROJECTIONS:
        prefix = f"model.layers.2.{proj}"
        expected = tensors[f"{prefix}.weight"].float() * tensors[f"{prefix}.weight_scale"]
        assert torch.equal(ours[f"{prefix}.weight"], expected), prefix
    # with the kernels: FP8 layers holding the same codes and scales (q/k/v and gate/up stacked)
    from llmopt.kernels.cpu_fp8 import fp8_linear_kernel
    from llmopt.model.fp8_linear import Fp8Linear

    model = load(str(fp8_dynamic)).model
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if fp8_linear_kernel() is not None:  # the C++ kernels built here (else dense dequantized weights)
        assert len(fp8) == 3 * 4
        qkv = model.model.layers[2].self_attn.qkv_proj
        stacked = torch.cat([tensors[f"model.layers.2.self_attn.{p}_proj.weight"].float()
                             * tensors[f"model.layers.2.self_attn.{p}_proj.weight_scale"] for p in "qkv"])
        assert torch.equal(qkv.dequantize(), stacked)
        # the decoder's hidden states (the vocabulary projection of a quantized fp32 CPU model runs on
        # the backend's compact int8 copy, `KernelBackend.compact_vocab_projection`, in both formats)
        from llmopt.model.attention import EqualLengthAttention

        ids, dense = torch.tensor([5, 9, 30, 2, 7]), load(str(fp8_dynamic), int4_kernels=False).model
        with torch.inference_mode():
            a, b = (m(ids, torch.arange(5), EqualLengthAttention(1, 5)) for m in (model, dense))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_unsupported_compressed_tensors_schemes_are_refused(fp8_dynamic, tmp_path):
    folder = tmp_path / "w8a8"
    folder.mkdir()
    for f in fp8_dynamic.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((fp8_dynamic / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(type="int", num_bits=8)  # INT8 W8A8: not something llmopt runs
    config["quantization_config"]["format"] = "int-quantized"
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "int-quantized"
    (folder / "config.json").write_text(json.dumps(config))
    assert_usage_error(["models", "info", str(folder)], "is not supported", "float-quantized FP8")


def test_act_order_pack_quantized_with_g_idx_loads(tiny_models, tmp_path):
    """Older llm-compressor checkpoints (actorder "group", before compressed-tensors 0.20) carry
    `weight_g_idx`: the same grid as our GPTQ act-order checkpoint, repacked by hand, loads the same."""
    from llmopt.core.compressed_tensors import int4_config
    from llmopt.core.quant_formats import unpack_tensors
    from llmopt.core.quant_packing import pack_columns

    gptq = tmp_path / "gptq"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=gptq, method="gptq", group_size=GROUP,
                             calib=_calib(tmp_path), num_samples=4, seq_len=32))
    tensors = load_safetensors([gptq / "model.safetensors"])
    for layer in range(3):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            q = unpack_tensors("gptq", tensors, prefix, 4, GROUP)
            for suffix in ("qweight", "qzeros", "scales", "g_idx"):
                del tensors[f"{prefix}.{suffix}"]
            tensors.update({f"{prefix}.weight_packed": pack_columns(q.codes), f"{prefix}.weight_scale": q.scales.half(),
                            f"{prefix}.weight_zero_point": pack_columns(q.zeros.t()).t().contiguous(),
                            f"{prefix}.weight_shape": torch.tensor(list(q.codes.shape)),
                            f"{prefix}.weight_g_idx": q.g_idx})
    assert not bool((q.g_idx == torch.arange(q.g_idx.numel()) // GROUP).all())  # really permuted
    out = tmp_path / "ct-actorder"
    out.mkdir()
    for f in gptq.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((gptq / "config.json").read_text())
    qc = int4_config(q.scheme.__class__(bits=4, group_size=GROUP, sym=False))
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    save_safetensors(tensors, out / "model.safetensors")
    a, b = hf_state_dict(load(str(out), int4_kernels=False).model), hf_state_dict(load(str(gptq), int4_kernels=False).model)
    for proj in PROJECTIONS:
        name = f"model.layers.1.{proj}.weight"
        assert torch.equal(a[name], b[name]), name


def test_bad_fp8_flags_are_usage_errors(tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    assert_usage_error(["quantize", model, "-o", str(tmp_path / "a"), "--method", "fp8", "--format", "awq"],
                       "compressed-tensors")
    assert_usage_error(["quantize", model, "-o", str(tmp_path / "b"), "--method", "gptq", "--format",
                        "compressed-tensors", "--desc-act"], "--desc-act")


@pytest.mark.parametrize("method,sym", [("rtn", True), ("gptq", False)])
def test_w4a16_pack_quantized_loads_as_its_grid(tiny_models, tmp_path, method, sym):
    out = tmp_path / f"{method}-{sym}"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method=method, format="compressed-tensors",
                             group_size=GROUP, sym=sym, calib=_calib(tmp_path), num_samples=4, seq_len=32))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and read_scheme(qc, "x").name == ("W4A16" if sym else "W4A16_ASYM")
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == GROUP
    tensors = load_safetensors([out / "model.safetensors"])
    assert ("model.layers.0.mlp.down_proj.weight_zero_point" in tensors) is not sym
    dense = hf_state_dict(load(str(out), int4_kernels=False).model)
    kernels = load(str(out))  # the backend's int4 layers, straight from the packed tensors
    for proj in PROJECTIONS:
        prefix = f"model.layers.0.{proj}"
        codes = tensors[f"{prefix}.weight_packed"]
        assert codes.dtype == torch.int32 and codes.shape[1] * 8 == dense[f"{prefix}.weight"].shape[1]
    # the same grid written as GPTQ v1 runs on the same int4 layers: identical logits
    gptq = tmp_path / "gptq"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=gptq, method=method, format="gptq",
                             group_size=GROUP, sym=sym, desc_act=False, calib=_calib(tmp_path), num_samples=4,
                             seq_len=32))
    ids = [5, 9, 30, 2, 7, 11]
    assert torch.equal(_logits(kernels.model, ids), _logits(load(str(gptq)).model, ids))
    same = hf_state_dict(load(str(gptq), int4_kernels=False).model)
    for proj in PROJECTIONS:
        name = f"model.layers.2.{proj}.weight"
        assert torch.equal(dense[name], same[name]), name


# ---- the compressed-tensors package itself ------------------------------------------------------

def _ct():
    return pytest.importorskip("compressed_tensors", reason="compressed-tensors is a test extra (pyproject dev)")


def test_package_decompresses_our_fp8_bitwise(fp8_dynamic):
    _ct()
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = json.loads((fp8_dynamic / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # their pydantic schema accepts our config
    scheme = parsed.config_groups["group_0"]
    tensors = load_safetensors([fp8_dynamic / "model.safetensors"])
    ours = hf_state_dict(load(str(fp8_dynamic), int4_kernels=False).model)
    for layer in range(3):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            local = {"weight": tensors[f"{prefix}.weight"], "weight_scale": tensors[f"{prefix}.weight_scale"]}
            theirs = FloatQuantizationCompressor.decompress(local, scheme)["weight"]
            assert theirs.dtype == torch.float32 and torch.equal(theirs, ours[f"{prefix}.weight"]), prefix


@pytest.mark.parametrize("sym", [True, False])
def test_package_decompresses_our_w4a16(tiny_models, tmp_path, sym):
    _ct()
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "w4a16"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method="rtn", format="compressed-tensors",
                             group_size=GROUP, sym=sym))
    scheme = QuantizationConfig.model_validate(
        json.loads((out / "config.json").read_text())["quantization_config"]).config_groups["group_0"]
    tensors = load_safetensors([out / "model.safetensors"])
    ours = hf_state_dict(load(str(out), int4_kernels=False).model)
    for proj in PROJECTIONS:
        prefix = f"model.layers.1.{proj}"
        local = {k: tensors[f"{prefix}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape",
                                                        "weight_zero_point") if f"{prefix}.{k}" in tensors}
        theirs = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert theirs.dtype == torch.float16  # code x fp16 scale, rounded to fp16
        torch.testing.assert_close(theirs.float(), ours[f"{prefix}.weight"], rtol=2 ** -10, atol=0)


def test_package_compressed_fp8_equals_ours_and_loads(tiny_models, fp8_dynamic, tmp_path):
    """The package's own FP8_DYNAMIC: min-max observer scales, its quantize and its compressor,
    on the same weights; its checkpoint is the same bytes as ours, and llmopt loads it."""
    _ct()
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams

    parsed = QuantizationConfig(config_groups={"FP8_DYNAMIC": ["Linear"]}, ignore=["lm_head"],
                                format="float-quantized", quantization_status="compressed")
    scheme = parsed.config_groups["FP8_DYNAMIC"]
    folder = tiny_models["llama"]
    tensors = load_safetensors([folder / "model.safetensors"])
    ours = load_safetensors([fp8_dynamic / "model.safetensors"])
    for layer in range(3):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            w = tensors.pop(f"{prefix}.weight")
            scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), scheme.weights)
            packed = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
            assert torch.equal(packed["weight"].view(torch.uint8), ours[f"{prefix}.weight"].view(torch.uint8)), prefix
            assert torch.equal(packed["weight_scale"], ours[f"{prefix}.weight_scale"]), prefix
            tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
    out = tmp_path / "theirs"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (folder / name).exists():
            (out / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", **parsed.model_dump()}
    (out / "config.json").write_text(json.dumps(config, default=str))
    save_safetensors(tensors, out / "model.safetensors")
    loaded = load(str(out), int4_kernels=False)
    assert loaded.source.quantization.details["scheme"] == "FP8_DYNAMIC"
    theirs = hf_state_dict(loaded.model)
    mine = hf_state_dict(load(str(fp8_dynamic), int4_kernels=False).model)
    for layer in range(3):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}.weight"
            assert torch.equal(theirs[name], mine[name]), name


@pytest.mark.parametrize("kind", ["fp8", "w4a16"])
def test_transformers_loads_our_folders(tiny_models, tmp_path, kind):
    _ct()
    from transformers import AutoModelForCausalLM

    out = tmp_path / kind
    if kind == "fp8":
        quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method="fp8"))
    else:
        # symmetric: transformers 5.24 + compressed-tensors 0.20 allocate an asymmetric checkpoint's
        # zero points unpacked ([out, groups]) and refuse the packed [out/8, groups] they write themselves
        quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method="rtn",
                                 format="compressed-tensors", group_size=GROUP, sym=True))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    # llmopt runs the dequantized weights on unquantized activations (FP8_DYNAMIC's per-token activation
    # rounding is a GPU kernel's business): switch compressed-tensors' activation fake-quantization off
    for module in model.modules():
        module.quantization_enabled = False
    ids = [5, 9, 30, 2, 7, 11, 40, 3]
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0].float()
    ours = _logits(load(str(out), int4_kernels=False).model, ids)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # decompressed on first forward
    # the same weights in float32 (int4: code x fp16 scale in fp16 there, in float32 here)
    assert float((theirs - ours).abs().max()) <= 1e-3 * float(ours.abs().max()), kind


def test_plan_counts_the_fp8_writers_bytes(fp8_dynamic, tiny_models):
    from llmopt.core import resolve
    from llmopt.plan.formats import FORMATS, weight_bytes
    from test_plan import _safetensors_data_bytes

    assert _safetensors_data_bytes(fp8_dynamic / "model.safetensors") == \
        weight_bytes(resolve(str(tiny_models["llama"])).config, FORMATS["fp8"])


def test_models_info_names_the_scheme(fp8_dynamic):
    from conftest import run_cli

    code, err, out = run_cli("models", "info", str(fp8_dynamic))
    assert code == 0, err
    assert "compressed-tensors 8-bit FP8_DYNAMIC" in out


LLMCOMPRESSOR_ONESHOT = """
import sys
import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
model.save_pretrained(sys.argv[2], save_compressed=True)
"""


def _run_llmcompressor(script: str, *args: str) -> str:
    """`script` run with `args` by a Python that has llmcompressor; its stdout. llmcompressor 0.14 pins
    transformers <= 5.17, so it is not a test extra: the tests that need it run with it installed
    here, or in another environment whose Python LLMOPT_LLMCOMPRESSOR_PYTHON names (e.g. a venv with
    `pip install llmcompressor`), in a subprocess; they skip elsewhere."""
    python = os.environ.get("LLMOPT_LLMCOMPRESSOR_PYTHON")
    if importlib.util.find_spec("llmcompressor") is not None:
        python = sys.executable
    elif not python:
        pytest.skip("llmcompressor is not installed (0.14 pins transformers <= 5.17, which would move this "
                    "environment's transformers); set LLMOPT_LLMCOMPRESSOR_PYTHON to a Python that has it")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own packages, not this checkout's
    proc = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _copy_tokenizer(folder, out) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).exists():
            (out / name).write_bytes((folder / name).read_bytes())


def test_llm_compressor_fp8_dynamic_equals_ours(tiny_models, fp8_dynamic, tmp_path):
    """llm-compressor's own `oneshot` FP8_DYNAMIC on the same model: the same bytes, and llmopt loads
    its folder."""
    folder = tiny_models["llama"]
    out = tmp_path / "llmcompressor"
    _run_llmcompressor(LLMCOMPRESSOR_ONESHOT, str(folder), str(out))
    _copy_tokenizer(folder, out)
    theirs, ours = load_safetensors(sorted(out.glob("*.safetensors"))), load_safetensors([fp8_dynamic / "model.safetensors"])
    for layer in range(3):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            assert torch.equal(theirs[f"{prefix}.weight"].view(torch.uint8), ours[f"{prefix}.weight"].view(torch.uint8))
            assert torch.equal(theirs[f"{prefix}.weight_scale"].float(), ours[f"{prefix}.weight_scale"])
    loaded = load(str(out), int4_kernels=False)
    assert loaded.source.quantization.details["scheme"] == "FP8_DYNAMIC"
    mine = hf_state_dict(load(str(fp8_dynamic), int4_kernels=False).model)
    got = hf_state_dict(loaded.model)
    assert all(torch.equal(got[f"model.layers.0.{p}.weight"], mine[f"model.layers.0.{p}.weight"]) for p in PROJECTIONS)


# GPTQModifier W4A16 (symmetric int4 groups; group 32, as the tiny model's 64-wide rows need) on
# random calibration rows; then the saved folder reloaded by transformers (compressed-tensors
# decompresses it) and decoded greedily, one full forward per token, with each step's top-2 gap and
# the log-probabilities of every position of prompt + answer.
LLMCOMPRESSOR_GPTQ_W4A16 = """
import json, sys
import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from transformers import AutoModelForCausalLM

src, out, prompt, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
g = torch.Generator().manual_seed(0)
rows = torch.randint(3, model.config.vocab_size, (16, 64), generator=g).tolist()
calib = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 64 for _ in rows]})
weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"])
oneshot(model=model, dataset=calib, recipe=recipe, num_calibration_samples=16, max_seq_length=64)
model.save_pretrained(out, save_compressed=True)
model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
ids, gaps = list(prompt), []
with torch.no_grad():
    for _ in range(steps):
        top = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1).topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
print(json.dumps({"tokens": ids[len(prompt):], "gaps": gaps, "logprobs": logprobs.tolist()}))
"""
# nats: llmopt's float path and transformers' differ by float rounding (~1e-6 in these log-probabilities
# here); greedy tokens are compared up to the reference's first top-2 gap below this
W4A16_NEAR_TIE = 1e-3
# nats: llmopt's int4 kernels round each activation row to int8, where transformers multiplies the
# dequantized weights in float32 (measured 0.021 at most on this model)
INT8_ACTIVATIONS_TOLERANCE = 0.06


def test_llm_compressor_gptq_w4a16_loads_with_its_greedy_tokens(tiny_models, tmp_path):
    """A W4A16 checkpoint from llm-compressor's GPTQModifier loads in llmopt: its weights give
    transformers' log-probabilities on the same folder (float path), llmopt's engine decodes
    transformers' greedy tokens up to the reference's first near tie, and the int4 kernels' (int8
    activations) log-probabilities stay within their rounding."""
    from llmopt.runtime.llm import LLM
    from llmopt.runtime.sampling_params import SamplingParams

    folder, out, prompt, steps = tiny_models["llama"], tmp_path / "gptq-w4a16", [5, 9, 30, 2, 7, 11, 40, 3], 24
    reference = json.loads(_run_llmcompressor(LLMCOMPRESSOR_GPTQ_W4A16, str(folder), str(out), json.dumps(prompt),
                                              str(steps)).strip().splitlines()[-1])
    _copy_tokenizer(folder, out)
    ids, theirs = prompt + reference["tokens"], torch.tensor(reference["logprobs"])
    floats = load(str(out), int4_kernels=False)
    assert floats.source.quantization.method == "compressed-tensors"
    assert floats.source.quantization.bits == 4 and floats.source.quantization.group_size == 32
    assert float((torch.log_softmax(_logits(floats.model, ids), -1) - theirs).abs().max()) < 1e-4
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    ours = LLM(floats, max_num_seqs=1).generate([prompt], params)[0].outputs[0].token_ids
    decisive = next((j for j, gap in enumerate(reference["gaps"]) if gap < W4A16_NEAR_TIE), steps)
    assert decisive >= 8, reference["gaps"]  # the comparison must cover tokens
    assert list(ours[:decisive]) == reference["tokens"][:decisive], (ours, reference["tokens"])
    kernels = torch.log_softmax(_logits(load(str(out)).model, ids), -1)
    assert float((kernels - theirs).abs().max()) < INT8_ACTIVATIONS_TOLERANCE
