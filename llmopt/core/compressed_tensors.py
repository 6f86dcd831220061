"""The compressed-tensors checkpoint format (vLLM's `compressed-tensors` package; what
llm-compressor writes, vLLM and transformers load): writing ours, reading anyone's.

A checkpoint keeps Hugging Face module names; each quantized projection `<module>` holds

- `float-quantized` (FP8, llm-compressor's schemes FP8_DYNAMIC and FP8): `<module>.weight`
  float8_e4m3fn [out, in], `<module>.weight_scale` float32 [out, 1] ("channel") or [1]
  ("tensor"), and with static activations `<module>.input_scale` [1];
- `pack-quantized` (W4A16, W4A16_ASYM): `<module>.weight_packed` int32 [out, in/8] (input
  columns 8j..8j+7 in nibbles 0..7 of word j, each the signed value + 8, which is our unsigned
  code), `<module>.weight_scale` [out, groups], `<module>.weight_shape` int64 [2] = (out, in),
  and without symmetry `<module>.weight_zero_point` int32 [out/8, groups] (output rows packed
  the same way, the signed zero + 8); older checkpoints may carry `<module>.weight_g_idx`.

`quantization_config` names the schemes per group of targets ("Linear") and what is left out
(`ignore`: ["lm_head"]), as compressed-tensors 0.20's `ModelCompressor.update_config` writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmopt.core.fp8_weight import FP8_DTYPE, Fp8Weight
from llmopt.core.quant_packing import pack_columns, unpack_columns
from llmopt.core.quantized_weight import PackedQuantizedWeight, QuantizedWeight, QuantScheme
from llmopt.errors import LlmoptError

QUANT_METHOD = "compressed-tensors"
FORMAT_VERSION = "0.20.0"  # the compressed-tensors release whose format this follows
FP8_SCHEMES = ("FP8_DYNAMIC", "FP8")  # llm-compressor's preset names


def _args(num_bits: int, kind: str, strategy: str, symmetric: bool = True, dynamic: bool = False,
          group_size: int | None = None, observer: str | None = None) -> dict[str, Any]:
    args = {"num_bits": num_bits, "type": kind, "symmetric": symmetric, "group_size": group_size,
            "strategy": strategy, "dynamic": dynamic}
    if observer is not None:
        args["observer"] = observer
    return args


def _config(fmt: str, weights: dict[str, Any], inputs: dict[str, Any] | None, lm_head: bool) -> dict[str, Any]:
    return {"version": FORMAT_VERSION, "quant_method": QUANT_METHOD, "sparsity_config": {}, "transform_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": fmt}},
            "kv_cache_scheme": None, "format": fmt, "quantization_status": "compressed",
            "global_compression_ratio": None, "ignore": [] if lm_head else ["lm_head"], "moe_sparsity_config": None}


def fp8_config(scheme: str, lm_head: bool = False) -> dict[str, Any]:
    """`quantization_config` of an FP8 checkpoint: FP8_DYNAMIC (per-channel weights, per-token
    dynamic activations) or FP8 (per-tensor weights, static per-tensor activations)."""
    if scheme == "FP8_DYNAMIC":
        return _config("float-quantized", _args(8, "float", "channel"),
                       _args(8, "float", "token", dynamic=True), lm_head)
    if scheme == "FP8":
        return _config("float-quantized", _args(8, "float", "tensor"),
                       _args(8, "float", "tensor", observer="static_minmax"), lm_head)
    raise LlmoptError(f"unknown FP8 scheme {scheme!r}; choose one of: {', '.join(FP8_SCHEMES)}")


def int4_config(scheme: QuantScheme, lm_head: bool = False) -> dict[str, Any]:
    """`quantization_config` of a W4A16 (symmetric) or W4A16_ASYM `pack-quantized` checkpoint."""
    per_channel = scheme.group_size == -1
    weights = _args(scheme.bits, "int", "channel" if per_channel else "group", symmetric=scheme.sym,
                    group_size=None if per_channel else scheme.group_size)
    return _config("pack-quantized", weights, None, lm_head)


# ---- tensors: writing --------------------------------------------------------------------------

def fp8_tensors(prefix: str, q: Fp8Weight) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one FP8 projection (the rows of one checkpoint tensor)."""
    scale = q.scales[:1].clone() if q.strategy == "tensor" else q.scales[:, None].clone()
    out = {f"{prefix}.weight": q.codes.contiguous(), f"{prefix}.weight_scale": scale.float()}
    if q.input_scale is not None:
        out[f"{prefix}.input_scale"] = q.input_scale.reshape(1).float().clone()
    return out


def fp8_shapes(prefix: str, out_features: int, in_features: int, strategy: str,
               static_input: bool) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    shapes = {f"{prefix}.weight": (FP8_DTYPE, (out_features, in_features)),
              f"{prefix}.weight_scale": (torch.float32, (1,) if strategy == "tensor" else (out_features, 1))}
    if static_input:
        shapes[f"{prefix}.input_scale"] = (torch.float32, (1,))
    return shapes


def int4_tensors(prefix: str, q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one int4 projection in `pack-quantized`."""
    out_features, in_features = q.codes.shape
    if out_features % 8 or in_features % 8:
        raise LlmoptError(f"{prefix}: int4 packing needs both dimensions divisible by 8, got {out_features}x{in_features}")
    if not q.is_sequential():
        raise LlmoptError("compressed-tensors 0.20 cannot store act-order (permuted) groups; "
                          "use --format gptq, or quantize without --desc-act")
    tensors = {f"{prefix}.weight_packed": pack_columns(q.codes),
               f"{prefix}.weight_scale": q.scales.half().contiguous(),
               f"{prefix}.weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64)}
    if not q.scheme.sym:
        tensors[f"{prefix}.weight_zero_point"] = pack_columns(q.zeros.t()).t().contiguous()
    elif not bool((q.zeros == 8).all()):
        raise LlmoptError(f"{prefix}: a symmetric pack-quantized grid has its zero at 8")
    return tensors


def int4_shapes(prefix: str, out_features: int, in_features: int,
                scheme: QuantScheme) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    groups = scheme.groups_of(in_features)
    shapes = {f"{prefix}.weight_packed": (torch.int32, (out_features, in_features // 8)),
              f"{prefix}.weight_scale": (torch.float16, (out_features, groups)),
              f"{prefix}.weight_shape": (torch.int64, (2,))}
    if not scheme.sym:
        shapes[f"{prefix}.weight_zero_point"] = (torch.int32, (out_features // 8, groups))
    return shapes


# ---- configs and tensors: reading --------------------------------------------------------------

@dataclass(frozen=True)
class CompressedTensorsScheme:
    """What a compressed-tensors `quantization_config` says about the linear layers."""

    format: str  # "float-quantized" | "pack-quantized" | "naive-quantized" | ...
    num_bits: int
    type: str  # "float" | "int"
    strategy: str  # weights: "channel" | "tensor" | "group" | "block"
    group_size: int | None
    symmetric: bool
    input_dynamic: bool | None  # None: no activation quantization (W4A16)
    input_strategy: str | None
    ignore: tuple[str, ...]

    @property
    def name(self) -> str:
        """llm-compressor's preset name for it (FP8_DYNAMIC, FP8, W4A16, W4A16_ASYM, ...)."""
        if self.type == "float" and self.num_bits == 8:
            if self.input_dynamic:
                return "FP8_DYNAMIC" if self.strategy == "channel" else f"FP8 ({self.strategy} weights, dynamic input)"
            if self.input_dynamic is None:
                return "FP8 weight-only"
            return "FP8" if self.strategy == "tensor" else f"FP8 ({self.strategy} weights, static input)"
        if self.type == "int" and self.input_dynamic is None:
            return f"W{self.num_bits}A16" + ("" if self.symmetric else "_ASYM")
        return f"{self.type}{self.num_bits} {self.strategy}"

    @property
    def llmopt_group_size(self) -> int:
        return -1 if self.strategy == "channel" else int(self.group_size or -1)


def read_scheme(qc: dict[str, Any], where: str) -> CompressedTensorsScheme:
    """The one weight scheme of a compressed-tensors config; refuses what llmopt cannot run
    (several differing groups, block FP8, sparsity, int8 activations, bits other than 4 or 8)."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise LlmoptError(f"{where}: compressed-tensors quantization_config has no config_groups")
    schemes = set()
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise LlmoptError(f"{where}: config_groups.{name} has no weights scheme (llmopt reads weight "
                              "quantization only)")
        w, a = group["weights"], group.get("input_activations")
        try:
            schemes.add(CompressedTensorsScheme(
                format=str(group.get("format") or qc.get("format") or ""), num_bits=int(w.get("num_bits", 8)),
                type=str(w.get("type", "int")), strategy=str(w.get("strategy") or ""),
                group_size=w.get("group_size"), symmetric=bool(w.get("symmetric", True)),
                input_dynamic=None if not a else bool(a.get("dynamic")),
                input_strategy=None if not a else str(a.get("strategy") or ""),
                ignore=tuple(qc.get("ignore") or ())))
        except (TypeError, ValueError) as exc:
            raise LlmoptError(f"{where}: config_groups.{name} cannot be read: {exc}") from None
    if len(schemes) > 1:
        raise LlmoptError(f"{where}: {len(schemes)} different weight schemes in config_groups; llmopt reads one")
    (scheme,) = schemes
    if qc.get("sparsity_config"):
        raise LlmoptError(f"{where}: sparse compressed-tensors checkpoints are not supported")
    fp8 = scheme.format == "float-quantized" and scheme.type == "float" and scheme.num_bits == 8 \
        and scheme.strategy in ("channel", "tensor")
    int4 = scheme.format == "pack-quantized" and scheme.type == "int" and scheme.num_bits == 4 \
        and scheme.strategy in ("group", "channel") and scheme.input_dynamic is None
    if not (fp8 or int4):
        raise LlmoptError(f"{where}: compressed-tensors scheme {scheme.name} in format {scheme.format!r} is not "
                          "supported; llmopt reads float-quantized FP8 (channel or tensor scales) and "
                          "pack-quantized W4A16")
    return scheme


def read_fp8(tensors: dict[str, torch.Tensor], prefix: str, scheme: CompressedTensorsScheme) -> Fp8Weight:
    """One FP8 projection back from its checkpoint tensors, shapes checked."""
    try:
        codes, scale = tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale"]
    except KeyError as exc:
        raise LlmoptError(f"compressed-tensors checkpoint is missing tensor {exc.args[0]}") from None
    if codes.dtype != FP8_DTYPE or codes.dim() != 2:
        raise LlmoptError(f"{prefix}.weight is {codes.dtype} {tuple(codes.shape)}, the config says 2-D float8_e4m3fn")
    out_features = codes.shape[0]
    if scale.numel() == 1:
        scales = scale.float().reshape(1).expand(out_features).clone()
    elif tuple(scale.shape) in ((out_features, 1), (out_features,)):
        scales = scale.float().reshape(out_features).clone()
    else:
        raise LlmoptError(f"{prefix}.weight_scale has shape {tuple(scale.shape)}; expected [1] or [{out_features}, 1]")
    input_scale = tensors.get(f"{prefix}.input_scale")
    return Fp8Weight(codes=codes, scales=scales, strategy="tensor" if scale.numel() == 1 else "channel",
                     input_scale=None if input_scale is None else input_scale.float().reshape(-1)[:1].clone())


def read_int4(tensors: dict[str, torch.Tensor], prefix: str, scheme: CompressedTensorsScheme) -> QuantizedWeight:
    """One pack-quantized W4A16 projection back as codes + grid, shapes checked."""
    return read_int4_packed(tensors, prefix, scheme).unpacked()


def read_int4_packed(tensors: dict[str, torch.Tensor], prefix: str,
                     scheme: CompressedTensorsScheme) -> PackedQuantizedWeight:
    """One pack-quantized W4A16 projection's grid, shapes checked, its codes left packed (read a
    slab of output rows at a time: `PackedQuantizedWeight.code_rows`)."""
    try:
        packed, scales = tensors[f"{prefix}.weight_packed"], tensors[f"{prefix}.weight_scale"]
    except KeyError as exc:
        raise LlmoptError(f"compressed-tensors checkpoint is missing tensor {exc.args[0]}") from None
    shape = tensors.get(f"{prefix}.weight_shape")
    out_features = packed.shape[0]
    in_features = int(shape.reshape(-1)[1]) if shape is not None else packed.shape[1] * 8
    if packed.dtype != torch.int32 or packed.dim() != 2 or in_features > packed.shape[1] * 8 \
            or (shape is not None and int(shape.reshape(-1)[0]) != out_features):
        raise LlmoptError(f"{prefix}.weight_packed {packed.dtype} {tuple(packed.shape)} does not hold a "
                          f"[{out_features}, {in_features}] int4 weight")
    groups = scales.shape[1] if scales.dim() == 2 else 0
    if scales.dim() != 2 or scales.shape[0] != out_features or groups == 0 or in_features % groups:
        raise LlmoptError(f"{prefix}.weight_scale has shape {tuple(scales.shape)}, which does not fit a "
                          f"[{out_features}, {in_features}] weight")
    width = in_features // groups
    zp = tensors.get(f"{prefix}.weight_zero_point")
    if scheme.symmetric or zp is None:
        zeros = torch.full((out_features, groups), 8, dtype=torch.int16)
    else:
        if zp.dtype != torch.int32 or tuple(zp.shape) != ((out_features + 7) // 8, groups):
            raise LlmoptError(f"{prefix}.weight_zero_point {zp.dtype} {tuple(zp.shape)} does not fit "
                              f"{out_features} rows x {groups} groups")
        zeros = unpack_columns(zp.t().contiguous()).t()[:out_features].to(torch.int16).contiguous()
    g_idx = tensors.get(f"{prefix}.weight_g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_features) // width
    elif tuple(g_idx.shape) != (in_features,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise LlmoptError(f"{prefix}.weight_g_idx has shape {tuple(g_idx.shape)} or values outside 0..{groups - 1}")
    group_size = -1 if groups == 1 and scheme.strategy == "channel" else width

    def rows(start: int, stop: int) -> torch.Tensor:  # input columns 8j..8j+7 in word j of each row
        return unpack_columns(packed[start:stop])[:, :in_features].contiguous()

    return PackedQuantizedWeight(shape=(out_features, in_features), scales=scales.float().contiguous(), zeros=zeros,
                                 g_idx=g_idx.to(torch.int32), readers=[(out_features, rows)],
                                 scheme=QuantScheme(bits=4, group_size=group_size, sym=scheme.symmetric))
