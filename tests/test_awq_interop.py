"""AWQ checkpoints against AutoAWQ's own pure-PyTorch code (test-only: autoawq 0.2.9,
installed --no-deps by scripts/setup.sh for EXTRAS=dev).

- our AWQ checkpoint, dequantized by AutoAWQ's `dequantize_gemm`, gives exactly the fp16
  weights llmopt's loader gives;
- a checkpoint packed by AutoAWQ's `WQLinear_GEMM.from_linear` loads in llmopt with the
  weights AutoAWQ itself dequantizes.
"""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.loader import load
from llmopt.core.weights import load_safetensors, save_safetensors
from llmopt.quant.quantize import QuantizeRequest, hf_state_dict, quantize
from llmopt.quant.quantizer import QuantScheme, quantize_rtn

awq_packing = pytest.importorskip("awq.utils.packing_utils", reason="autoawq is a test-only extra")
dequantize_gemm = awq_packing.dequantize_gemm

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 32


def test_our_awq_checkpoint_dequantizes_identically_in_autoawq(tiny_models, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("a fox runs over the lazy dog while the river sings. " * 60, encoding="utf-8")
    out = tmp_path / "awq"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method="awq", group_size=GROUP,
                             calib=str(calib), num_samples=4, seq_len=32))
    packed = load_safetensors([out / "model.safetensors"])
    ours = hf_state_dict(load(str(out), int4_kernels=False).model)
    for layer in range(3):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            theirs = dequantize_gemm(packed[f"{prefix}.qweight"], packed[f"{prefix}.qzeros"],
                                     packed[f"{prefix}.scales"], bits=4, group_size=GROUP).t()
            assert theirs.dtype == torch.float16
            assert torch.equal(ours[f"{prefix}.weight"].half(), theirs), prefix


def test_autoawq_packed_checkpoint_loads_with_autoawq_weights(tiny_models, tmp_path):
    from awq.modules.linear.gemm import WQLinear_GEMM

    folder = tiny_models["llama"]
    tensors = load_safetensors([folder / "model.safetensors"])
    expected = {}
    for layer in range(3):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            weight = tensors.pop(f"{prefix}.weight")
            q = quantize_rtn(weight, QuantScheme(bits=4, group_size=GROUP))
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight.data = q.dequantize()  # AutoAWQ packs an already fake-quantized weight
            module = WQLinear_GEMM.from_linear(linear, w_bit=4, group_size=GROUP, init_only=False,
                                               scales=q.scales.t().contiguous(), zeros=q.zeros.t().contiguous().int())
            tensors.update({f"{prefix}.{k}": getattr(module, k) for k in ("qweight", "qzeros", "scales")})
            expected[f"{prefix}.weight"] = dequantize_gemm(module.qweight, module.qzeros, module.scales, 4, GROUP).t()
    out = tmp_path / "autoawq-packed"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (folder / name).exists():
            (out / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config))
    save_safetensors(tensors, out / "model.safetensors")

    ours = hf_state_dict(load(str(out), int4_kernels=False).model)
    for name, weight in expected.items():
        assert torch.equal(ours[name].half(), weight), name
