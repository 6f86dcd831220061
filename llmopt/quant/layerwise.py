"""The layer-by-layer calibration engine shared by AWQ and GPTQ.

Decoder layer 0 gets the embedded calibration tokens; each layer then runs forward ONCE
over all samples, and every linear is quantized at the moment its input arrives (a
forward pre-hook): the hook sees the real input (already shaped by the quantized linears
before it in the same layer, "true sequential"), quantizes the weight, swaps the
quantized weight in, and lets the forward continue. So the layer's output is the
*quantized* layer's output, which becomes the next layer's input, and only one layer's
activations are alive at a time.

AWQ's input scaling is applied inside the hook too (the hook hands the linear x / s) and
folded afterwards where a real model would apply it: into the preceding norm's weight,
or into the rows of the linear that feeds this one (their grid scales divide by s, which
is exact on the integer grid since scales are per output row).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from llmopt.core.memory import release_freed_memory
from llmopt.model.attention import EqualLengthAttention
from llmopt.model.llama import LlamaForCausalLM
from llmopt.quant import awq, gptq
from llmopt.quant.quantizer import QuantizedWeight, QuantScheme, quantize_rtn


@dataclass
class MethodOptions:
    method: str  # "rtn" | "awq" | "gptq"
    scheme: QuantScheme
    desc_act: bool = False  # GPTQ act-order
    damp_percent: float = 0.1
    n_grid: int = 20  # AWQ scale / clip grids
    keep_unrounded: bool = False  # AWQ: keep the scaled, clipped weights before rounding (for GGUF export)
    search_tokens: int = 512  # AWQ scale search: a stride sample of the tokens (AutoAWQ's clip search uses 512)


@dataclass
class QuantizedSite:
    """One quantized linear of our model (fused q/k/v or gate/up count as one)."""

    name: str  # our module name, e.g. "model.layers.3.self_attn.qkv_proj"
    weight: QuantizedWeight
    relative_error: float | None  # ||X W^T - X W_hat^T||^2 / ||X W^T||^2 on calibration inputs (None: RTN)
    details: dict = field(default_factory=dict)
    unrounded: torch.Tensor | None = None  # AWQ's scaled + clipped weight before rounding, when kept


def sites_of(layer_prefix: str) -> list[str]:
    return [f"{layer_prefix}.self_attn.qkv_proj", f"{layer_prefix}.self_attn.o_proj",
            f"{layer_prefix}.mlp.gate_up_proj", f"{layer_prefix}.mlp.down_proj"]


def part_rows(model: LlamaForCausalLM, site: str) -> dict[str, slice]:
    """Output-row slices of a fused site by checkpoint projection name (q_proj, k_proj, ...)."""
    cfg = model.config
    if site.endswith("qkv_proj"):
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    if site.endswith("gate_up_proj"):
        i = cfg.intermediate_size
        return {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i)}
    return {}


@torch.inference_mode()
def quantize_layers(model: LlamaForCausalLM, input_ids: torch.Tensor, options: MethodOptions,
                    quantize_lm_head: bool = False,
                    on_layer: Callable[[int, int], None] | None = None) -> list[QuantizedSite]:
    """Quantize every decoder linear of `model` in place; returns the quantized weights in order."""
    if quantize_lm_head and model.config.tie_word_embeddings:  # the embeddings stay unquantized
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    if options.method == "rtn":
        return _rtn_all(model, options.scheme, quantize_lm_head, on_layer)
    num_seqs, seq_len = input_ids.shape
    inner = model.model
    x = inner.embed_tokens(input_ids.reshape(-1))
    positions = torch.arange(seq_len).repeat(num_seqs)
    cos, sin = inner.rotary_emb(positions, x.dtype)
    attn = EqualLengthAttention(num_seqs, seq_len)
    sites: list[QuantizedSite] = []
    for i, layer in enumerate(inner.layers):
        prefix = f"model.layers.{i}"
        done: dict[str, QuantizedSite] = {}
        handles = [
            module.register_forward_pre_hook(_hook(model, layer, f"{prefix}.{local}", module, options, done))
            for local, module in (("self_attn.qkv_proj", layer.self_attn.qkv_proj), ("self_attn.o_proj", layer.self_attn.o_proj),
                                  ("mlp.gate_up_proj", layer.mlp.gate_up_proj), ("mlp.down_proj", layer.mlp.down_proj))
        ]
        try:
            x = layer(x, cos, sin, attn)
        finally:
            for h in handles:
                h.remove()
        sites.extend(done[name] for name in sites_of(prefix))
        release_freed_memory()
        if on_layer:
            on_layer(i + 1, len(inner.layers))
    if quantize_lm_head:
        done = {}
        handle = model.lm_head.register_forward_pre_hook(_hook(model, None, "lm_head", model.lm_head, options, done))
        try:
            model.lm_head(inner.norm(x)[:: max(1, x.shape[0] // 4096)])  # GPTQ/AWQ see a sample of final states
        finally:
            handle.remove()
        sites.append(done["lm_head"])
    return sites


def _hook(model, layer, name: str, module, options: MethodOptions, done: dict[str, QuantizedSite]):
    def pre_hook(mod, args):
        (x,) = args
        flat = x.reshape(-1, x.shape[-1]).float()
        qsite, x_used = _quantize_site(model, layer, name, module, flat, options, done)
        done[name] = qsite
        return (x_used.reshape(x.shape).to(x.dtype),)

    return pre_hook


def _quantize_site(model, layer, name, module, x, options: MethodOptions, done) -> tuple[QuantizedSite, torch.Tensor]:
    start = time.perf_counter()
    w = module.weight.detach().float().clone()  # the module's weight is overwritten below
    scheme, details, unrounded = options.scheme, {}, None
    x_used = x
    if options.method == "awq":
        s = torch.ones(w.shape[1])
        fold = _awq_fold_target(model, layer, name, done)
        if fold is not None:
            s, ratio = awq.search_scale(x, w, scheme, options.n_grid, options.search_tokens)
            details["scale_ratio"] = ratio
            fold(s)
            x_used = x / s
        w_scaled = w * s
        rows = _clip_rows(model, name, w.shape[0])
        w_clipped = awq.search_clip(x_used, w_scaled, scheme, rows, options.n_grid)
        qweight = quantize_rtn(w_clipped, scheme)
        unrounded = w_clipped if options.keep_unrounded else None
    else:  # gptq
        qweight, stats = gptq.gptq_quantize(w, gptq.hessian(x), scheme, options.desc_act, options.damp_percent)
        details.update(damp_percent=stats.damp_percent, damp_retries=stats.retries)
    w_hat = qweight.dequantize()
    module.weight.copy_(w_hat.to(module.weight.dtype))
    xs = awq.token_sample(x, 1024)
    reference = xs @ w.t()
    xs_used = awq.token_sample(x_used, 1024)
    error = ((xs_used @ w_hat.t() - reference).pow(2).sum() / reference.pow(2).sum().clamp(min=1e-12)).item()
    details["seconds"] = round(time.perf_counter() - start, 3)
    return QuantizedSite(name=name, weight=qweight, relative_error=error, details=details, unrounded=unrounded), x_used


def _awq_fold_target(model, layer, name: str, done: dict[str, QuantizedSite]):
    """Where AWQ's 1/s goes for this site's input, or None when it cannot be folded (no scaling)."""
    if layer is None:  # lm_head: its input norm is shared with nothing else, but AutoAWQ leaves it unscaled
        return None
    prefix = name.rsplit(".", 2)[0]
    if name.endswith("qkv_proj"):
        return lambda s: layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
    if name.endswith("gate_up_proj"):
        return lambda s: layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
    if name.endswith("down_proj"):
        feeder, rows = done[f"{prefix}.mlp.gate_up_proj"], part_rows(model, f"{prefix}.mlp.gate_up_proj")["up_proj"]
        return lambda s: _scale_rows(feeder, rows, s, layer.mlp.gate_up_proj)
    if name.endswith("o_proj"):
        cfg = model.config
        if cfg.num_key_value_heads != cfg.num_attention_heads:
            return None  # v's rows do not map one to one onto o's inputs (GQA), as AutoAWQ requires
        feeder, rows = done[f"{prefix}.self_attn.qkv_proj"], part_rows(model, f"{prefix}.self_attn.qkv_proj")["v_proj"]
        return lambda s: _scale_rows(feeder, rows, s, layer.self_attn.qkv_proj)
    return None


def _scale_rows(site: QuantizedSite, rows: slice, s: torch.Tensor, module) -> None:
    """Divide output rows `rows` of an already-quantized linear by s (exact: per-row grid scales)."""
    q = site.weight
    q.scales[rows] = (q.scales[rows] / s[:, None]).half().float()
    if site.unrounded is not None:
        site.unrounded[rows] /= s[:, None]
    module.weight[rows] = q.dequantize()[rows].to(module.weight.dtype)
    if getattr(module, "bias", None) is not None:
        module.bias[rows] = module.bias[rows] / s.to(module.bias.dtype)


def _clip_rows(model, name: str, out_features: int) -> torch.Tensor | None:
    """AWQ does not clip q/k: their error is amplified by the attention softmax."""
    if not name.endswith("qkv_proj"):
        return None
    rows = torch.zeros(out_features, dtype=torch.bool)
    rows[part_rows(model, name)["v_proj"]] = True
    return rows


def _rtn_all(model, scheme: QuantScheme, quantize_lm_head: bool, on_layer) -> list[QuantizedSite]:
    """Round-to-nearest needs no calibration data: each weight is rounded on its own."""
    sites = []
    layers = model.model.layers
    names = [[*sites_of(f"model.layers.{i}")] for i in range(len(layers))]
    if quantize_lm_head:
        names[-1].append("lm_head")
    for i, layer_names in enumerate(names):
        for name in layer_names:
            module = model.get_submodule(name)
            q = quantize_rtn(module.weight.detach(), scheme)
            module.weight.copy_(q.dequantize().to(module.weight.dtype))
            sites.append(QuantizedSite(name=name, weight=q, relative_error=None))
        if on_layer:
            on_layer(i + 1, len(layers))
    return sites
