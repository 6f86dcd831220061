"""The per-layer calibration engine shared by AWQ and GPTQ (and RTN's rounding), driven layer
after layer by `streaming.py`.

Decoder layer 0 gets the embedded calibration tokens; each layer then runs forward ONCE
over all samples, and every linear is quantized at the moment its input arrives (a
forward pre-hook): the hook sees the real input (already shaped by the quantized linears
before it in the same layer, "true sequential"), quantizes the weight, swaps the
quantized weight in, and lets the forward continue. So the layer's output is the
*quantized* layer's output, which becomes the next layer's input, and only one layer's
activations are alive at a time.

FP8 (`method` "fp8") rounds each weight on its own, as RTN does; its static scheme ("FP8") also
records the largest input magnitude each linear sees in the same hook, for the per-tensor
activation scale.

AWQ's input scaling is applied inside the hook too (the hook hands the linear x / s) and
folded afterwards where a real model would apply it: into the preceding norm's weight,
or into the rows of the linear that feeds this one (their grid scales divide by s, which
is exact on the integer grid since scales are per output row). The hook scales its input
in place: every site's input is a temporary only that linear reads (`llama.py`), and at
8B a second copy of the MLP's [tokens x intermediate] input would cost ~1 GB.

`matmul` (the backend's `fp32_prefill_linear` under `--fp32-matmul-precision`, or None for
`F.linear`) runs the calibration's large float32 products: AWQ's scale-search losses,
GPTQ's Hessian, the reported output errors; the forward's linears take it through
`DenseLinear.use_prefill_kernel` (`streaming.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmopt.core.config import ModelConfig
from llmopt.core.fp8_weight import Fp8Weight, fp8_scale, quantize_fp8
from llmopt.model.attention import EqualLengthAttention
from llmopt.model.llama import STACKED_PROJECTIONS, DecoderLayer
from llmopt.quant import awq, gptq
from llmopt.quant.quantizer import QuantizedWeight, QuantScheme, quantize_rtn


@dataclass
class MethodOptions:
    method: str  # "rtn" | "awq" | "gptq" | "fp8"
    scheme: QuantScheme
    desc_act: bool = False  # GPTQ act-order
    damp_percent: float = 0.1
    n_grid: int = 20  # AWQ scale / clip grids
    keep_unrounded: bool = False  # AWQ: keep the scaled, clipped weights before rounding (for GGUF export)
    search_tokens: int = 512  # AWQ scale search: a stride sample of the tokens (AutoAWQ's clip search uses 512)
    fp8_scheme: str = "FP8_DYNAMIC"  # method fp8: llm-compressor's FP8_DYNAMIC or FP8 (static activations)
    fp32_matmul_precision: str = "ieee"  # float32 calibration products: "auto", "ieee" or "bf16" (module docstring)

    @property
    def calibrated(self) -> bool:
        """Whether the method needs calibration inputs (AWQ, GPTQ, FP8's static activation scales)."""
        return self.method in ("awq", "gptq") or (self.method == "fp8" and self.fp8_scheme == "FP8")


@dataclass
class QuantizedSite:
    """One quantized linear of our model (fused q/k/v or gate/up count as one)."""

    name: str  # our module name, e.g. "model.layers.3.self_attn.qkv_proj"
    weight: QuantizedWeight | Fp8Weight
    relative_error: float | None  # ||X W^T - X W_hat^T||^2 / ||X W^T||^2 on calibration inputs (None: RTN)
    details: dict = field(default_factory=dict)
    unrounded: torch.Tensor | None = None  # AWQ's scaled + clipped weight before rounding, when kept


def sites_of(layer_prefix: str) -> list[str]:
    return [f"{layer_prefix}.self_attn.qkv_proj", f"{layer_prefix}.self_attn.o_proj",
            f"{layer_prefix}.mlp.gate_up_proj", f"{layer_prefix}.mlp.down_proj"]


def part_rows(config: ModelConfig, site: str) -> dict[str, slice]:
    """Output-row slices of a fused site by checkpoint projection name (q_proj, k_proj, ...)."""
    if site.endswith("qkv_proj"):
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    if site.endswith("gate_up_proj"):
        i = config.intermediate_size
        return {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i)}
    return {}


def site_of(checkpoint_name: str) -> str:
    """model.layers.0.self_attn.q_proj.weight -> model.layers.0.self_attn.qkv_proj (our fused module)."""
    prefix = checkpoint_name.rsplit(".", 1)[0]
    for fused, parts in STACKED_PROJECTIONS.items():
        for part in parts:
            if prefix.endswith(f".{part}"):
                return prefix[: -len(part)] + fused
    return prefix


def part_slice(config: ModelConfig, checkpoint_name: str) -> slice:
    """The output rows of its fused site that checkpoint tensor `checkpoint_name` holds."""
    part = checkpoint_name.rsplit(".", 1)[0].rpartition(".")[2]
    return part_rows(config, site_of(checkpoint_name)).get(part, slice(None))


def checkpoint_tensors(config: ModelConfig, module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """`module`'s tensors under checkpoint names (`prefix` + local name): fused q/k/v and gate/up
    split back apart (views)."""
    state = {}
    for local, tensor in module.state_dict().items():
        name = f"{prefix}.{local}" if prefix else local
        site, _, kind = name.rpartition(".")
        rows = part_rows(config, site)
        if rows:
            parent = site.rsplit(".", 1)[0]
            for part, sl in rows.items():
                state[f"{parent}.{part}.{kind}"] = tensor[sl]
        else:
            state[name] = tensor
    return state


LAYER_SITES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@torch.inference_mode()
def quantize_decoder_layer(config: ModelConfig, layer: DecoderLayer, index: int, x: torch.Tensor | None,
                           cos: torch.Tensor | None, sin: torch.Tensor | None, attn: EqualLengthAttention | None,
                           options: MethodOptions, matmul: Callable | None = None
                           ) -> tuple[torch.Tensor | None, list[QuantizedSite]]:
    """Quantize the four linears of decoder layer `index` in place (AWQ also folds its scales
    into the layer's norms and feeding rows). `x` is the layer's calibration input (the
    previous, already quantized layer's output; None for RTN, which needs no data): returns
    the quantized layer's output on it, and the layer's sites in order. `matmul`: see the module
    docstring."""
    prefix = f"model.layers.{index}"
    if options.method == "rtn":
        return x, [_rtn_site(f"{prefix}.{local}", layer.get_submodule(local), options.scheme) for local in LAYER_SITES]
    if options.method == "fp8" and not options.calibrated:
        return x, [_fp8_site(config, f"{prefix}.{local}", layer.get_submodule(local), options)
                   for local in LAYER_SITES]
    done: dict[str, QuantizedSite] = {}
    handles = [layer.get_submodule(local).register_forward_pre_hook(
        _hook(config, layer, f"{prefix}.{local}", layer.get_submodule(local), options, done, matmul))
        for local in LAYER_SITES]
    try:
        x = layer(x, cos, sin, attn)
    finally:
        for h in handles:
            h.remove()
    return x, [done[name] for name in sites_of(prefix)]


@torch.inference_mode()
def quantize_output_layer(config: ModelConfig, norm, lm_head, x: torch.Tensor | None,
                          options: MethodOptions, matmul: Callable | None = None) -> QuantizedSite:
    """Quantize the output projection `lm_head` in place; GPTQ/AWQ see a sample of the final
    hidden states `x` (after `norm`)."""
    if options.method == "rtn":
        return _rtn_site("lm_head", lm_head, options.scheme)
    if options.method == "fp8" and not options.calibrated:
        return _fp8_site(config, "lm_head", lm_head, options)
    done: dict[str, QuantizedSite] = {}
    handle = lm_head.register_forward_pre_hook(_hook(config, None, "lm_head", lm_head, options, done, matmul))
    try:
        lm_head(norm(x)[:: max(1, x.shape[0] // 4096)])
    finally:
        handle.remove()
    return done["lm_head"]


def _hook(config: ModelConfig, layer, name: str, module, options: MethodOptions, done: dict[str, QuantizedSite],
          matmul: Callable | None):
    def pre_hook(mod, args):
        (x,) = args
        flat = x.reshape(-1, x.shape[-1]).float()
        qsite, x_used = _quantize_site(config, layer, name, module, flat, options, done, matmul or F.linear)
        done[name] = qsite
        return (x_used.reshape(x.shape).to(x.dtype),)

    return pre_hook


def _quantize_site(config: ModelConfig, layer, name, module, x, options: MethodOptions, done,
                   linear: Callable) -> tuple[QuantizedSite, torch.Tensor]:
    """Quantize `module`'s weight on its input `x` [tokens, in] (float32; AWQ scales it in place,
    see the module docstring); returns the site and the input the linear then runs on."""
    if options.method == "fp8":  # static activations: the input's absmax over every calibration token
        return _fp8_site(config, name, module, options, fp8_scale(x.abs().amax()).reshape(1)), x
    start = time.perf_counter()
    w = module.weight.detach().float().clone()  # the module's weight is overwritten below
    scheme, details, unrounded = options.scheme, {}, None
    xs = awq.token_sample(x, 1024).clone()  # the reported error's sample: a copy, as AWQ scales x in place below
    reference = linear(xs, w)
    if options.method == "awq":
        s = torch.ones(w.shape[1])
        fold = _awq_fold_target(config, layer, name, done)
        if fold is not None:
            s, ratio = awq.search_scale(x, w, scheme, options.n_grid, options.search_tokens, linear)
            details["scale_ratio"] = ratio
            fold(s)
            x.div_(s)
            xs.div_(s)
            w.mul_(s)
        rows = _clip_rows(config, name, w.shape[0])
        w_clipped = awq.search_clip(x, w, scheme, rows, options.n_grid)
        qweight = quantize_rtn(w_clipped, scheme)
        unrounded = w_clipped if options.keep_unrounded else None
        del w_clipped
    else:  # gptq
        qweight, stats = gptq.gptq_quantize(w, gptq.hessian(x, linear), scheme, options.desc_act,
                                            options.damp_percent)
        details.update(damp_percent=stats.damp_percent, damp_retries=stats.retries)
    w_hat = qweight.dequantize()
    module.weight.copy_(w_hat.to(module.weight.dtype))
    # ||X W^T - X_used W_hat^T||^2 / ||X W^T||^2, with X_used W^T = X W^T (AWQ: W was scaled by s, X by 1/s)
    output_error = linear(xs, w_hat.sub_(w))
    error = (output_error.pow(2).sum() / reference.pow(2).sum().clamp(min=1e-12)).item()
    details["seconds"] = round(time.perf_counter() - start, 3)
    return QuantizedSite(name=name, weight=qweight, relative_error=error, details=details, unrounded=unrounded), x


def _awq_fold_target(config: ModelConfig, layer, name: str, done: dict[str, QuantizedSite]):
    """Where AWQ's 1/s goes for this site's input, or None when it cannot be folded (no scaling)."""
    if layer is None:  # lm_head: its input norm is shared with nothing else, but AutoAWQ leaves it unscaled
        return None
    prefix = name.rsplit(".", 2)[0]
    if name.endswith("qkv_proj"):
        return lambda s: layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
    if name.endswith("gate_up_proj"):
        return lambda s: layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
    if name.endswith("down_proj"):
        feeder, rows = done[f"{prefix}.mlp.gate_up_proj"], part_rows(config, f"{prefix}.mlp.gate_up_proj")["up_proj"]
        return lambda s: _scale_rows(feeder, rows, s, layer.mlp.gate_up_proj)
    if name.endswith("o_proj"):
        if config.num_key_value_heads != config.num_attention_heads:
            return None  # v's rows do not map one to one onto o's inputs (GQA), as AutoAWQ requires
        feeder, rows = done[f"{prefix}.self_attn.qkv_proj"], part_rows(config, f"{prefix}.self_attn.qkv_proj")["v_proj"]
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


def _clip_rows(config: ModelConfig, name: str, out_features: int) -> torch.Tensor | None:
    """AWQ does not clip q/k: their error is amplified by the attention softmax."""
    if not name.endswith("qkv_proj"):
        return None
    rows = torch.zeros(out_features, dtype=torch.bool)
    rows[part_rows(config, name)["v_proj"]] = True
    return rows


def _fp8_site(config: ModelConfig, name: str, module, options: MethodOptions,
              input_scale: torch.Tensor | None = None) -> QuantizedSite:
    """FP8 e4m3 weights: a scale per output channel (FP8_DYNAMIC) or per checkpoint tensor
    (FP8: q, k and v of a fused projection each get their own, as llm-compressor writes them)."""
    start = time.perf_counter()
    strategy = "channel" if options.fp8_scheme == "FP8_DYNAMIC" else "tensor"
    parts = list(part_rows(config, name).values()) or None
    q = quantize_fp8(module.weight.detach(), strategy, parts)
    q.input_scale = input_scale
    module.weight.copy_(q.dequantize().to(module.weight.dtype))
    return QuantizedSite(name=name, weight=q, relative_error=None,
                         details={"seconds": round(time.perf_counter() - start, 3)})


def _rtn_site(name: str, module, scheme: QuantScheme) -> QuantizedSite:
    """Round-to-nearest needs no calibration data: each weight is rounded on its own."""
    q = quantize_rtn(module.weight.detach(), scheme)
    module.weight.copy_(q.dequantize().to(module.weight.dtype))
    return QuantizedSite(name=name, weight=q, relative_error=None)
