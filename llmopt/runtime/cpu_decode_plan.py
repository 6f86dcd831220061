"""Decode steps on CPU with every decoder layer in one C++ call (`DecodePlan`, kernels/csrc).

Once weights are 4-bit, a batch-1 decode step of a small model is a few milliseconds of
arithmetic, and the Python around it (module calls, ~35 ops per layer at a few
microseconds of dispatch each) cost more than that. Like replaying a captured CUDA graph,
the plan records each layer's tensors once (norm weights; fp32, bf16, int4 or FP8 projections)
and runs a whole decode step's layers through the same kernels the modules call, in the
same order: the hidden states are bitwise those of `LlamaModel.forward` (tested in
tests/test_cpu_decode_plan.py). Only steps made entirely of decodes, with at most
`SKINNY_MAX_ROWS` sequences, take it; everything else runs the modules.
"""

from __future__ import annotations

from typing import Any

import torch

from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.kernels.cpu_fused import fused_ops
from llmopt.kernels.cpu_linear import SKINNY_MAX_ROWS, skinny_linear_kernel
from llmopt.model.fp8_linear import Fp8Linear
from llmopt.model.int4_linear import CpuInt4Linear
from llmopt.model.linear import DenseLinear
from llmopt.model.llama import LlamaForCausalLM, RMSNorm


def _linear_spec(ops: Any, layer: torch.nn.Module) -> Any | None:
    """The projection as the plan runs it, or None where the module path would not use the
    skinny / int4 / FP8 kernels for a decode batch (then no plan)."""
    if isinstance(layer, CpuInt4Linear):
        return ops.int4_linear_spec(layer.codes, layer.scales, layer.zeros, layer.out_features,
                                    layer.group_size, layer.perm, layer.bias)
    if isinstance(layer, Fp8Linear):
        if layer.kernel is None or layer.codes.device.type != "cpu":
            return None
        return ops.fp8_linear_spec(layer.codes, layer.scales, layer.bias)
    if isinstance(layer, DenseLinear) and layer.skinny is not None and layer.int8_weight is None:
        if layer.bf16_weight is not None:
            return ops.dense_linear_spec(layer.bf16_weight, layer.bias)
        w = layer.weight
        if w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous():
            return ops.dense_linear_spec(w, layer.bias)
    return None


def _fp32_norm(norm: torch.nn.Module) -> bool:
    return isinstance(norm, RMSNorm) and norm.weight.dtype == torch.float32 and norm.weight.device.type == "cpu"


def build_decode_plan(model: LlamaForCausalLM, kv_dtype: torch.dtype, ops: Any | None = None) -> Any | None:
    """A `DecodePlan` over `model`'s layers, or None where some piece would not run on the CPU
    kernels (another dtype or device, no AVX2, a layer kind the plan does not know). `ops`: the
    compiled kernels module to build it from (default: llmopt's; scripts/bench_decode_plan.py passes
    other builds)."""
    ops = ops or cpu_ops()
    if ops is None or fused_ops() is None or skinny_linear_kernel() is None:
        return None
    if kv_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    plan = ops.DecodePlan()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        specs = [_linear_spec(ops, m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(s is None for s in specs) or not all(_fp32_norm(n) for n in norms) or norms[0].eps != norms[1].eps:
            return None
        plan.add_layer(norms[0].weight, norms[1].weight, norms[0].eps, *specs, attn.num_heads, attn.num_kv_heads,
                       attn.head_dim, -1 if attn.sliding_window is None else attn.sliding_window,
                       attn.head_dim ** -0.5)  # the scale exactly as PagedAttention computes it
    return plan


def run_decode_plan(plan: Any, model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                    k_caches: torch.Tensor, v_caches: torch.Tensor, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """Final hidden states [n, hidden] of a decode step (what `model(...)` returns), or None
    when this step is not one the plan takes (then run the modules)."""
    if input_ids.shape[0] > SKINNY_MAX_ROWS:
        return None
    with torch.inference_mode():
        x = model.model.embed(input_ids)
        cos, sin = model.model.rotary_emb(positions, x.dtype)
        if not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        x = plan.run(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, context_lens, block_size)
        return model.model.norm(x)
