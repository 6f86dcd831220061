"""AWQ "GEMM", GPTQ v1 and compressed-tensors pack-quantized checkpoint tensors and configs:
writing ours, reading anyone's (compressed-tensors in `compressed_tensors.py`).

Both formats keep Hugging Face module names, one packed triple (or quadruple) per
projection: `<module>.qweight`, `<module>.qzeros`, `<module>.scales` (fp16,
[groups, out]) and for GPTQ `<module>.g_idx` ([in] int32, the group of each input
column: act-order checkpoints have it permuted). Layouts are in `packing.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from llmopt.errors import LlmoptError
from llmopt.core import compressed_tensors
from llmopt.core.quant_packing import AWQ_ORDER, awq_pack, gptq_pack, unpack_columns, unpack_rows
from llmopt.core.quantized_weight import CodeRows, PackedQuantizedWeight, QuantizedWeight, QuantScheme

CHECKPOINT_FORMATS = ("awq", "gptq", "compressed-tensors")


def quantization_config(fmt: str, scheme: QuantScheme, desc_act: bool = False, lm_head: bool = False,
                        damp_percent: float = 0.1) -> dict[str, Any]:
    """The `quantization_config` block transformers, vLLM and GPTQModel/AutoAWQ read."""
    if fmt == "compressed-tensors":
        return compressed_tensors.int4_config(scheme, lm_head)
    if fmt == "awq":
        # AWQ's GEMM format always carries zero points: a symmetric grid is stored as zero = 8
        return {"quant_method": "awq", "bits": scheme.bits, "group_size": scheme.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None if lm_head else ["lm_head"]}
    return {"quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size, "desc_act": desc_act,
            "sym": scheme.sym, "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True,
            "lm_head": lm_head, "damp_percent": damp_percent}


def pack_tensors(fmt: str, prefix: str, q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one projection `prefix` (e.g. model.layers.0.self_attn.q_proj)."""
    if fmt == "compressed-tensors":
        return compressed_tensors.int4_tensors(prefix, q)
    out_features, in_features = q.codes.shape
    if out_features % 8 or in_features % 8:
        raise LlmoptError(f"{prefix}: int4 packing needs both dimensions divisible by 8, got {out_features}x{in_features}")
    scales = q.scales.t().contiguous().half()
    if fmt == "awq":
        if not torch.equal(q.g_idx.long(), torch.arange(in_features) // q.scheme.group_width(in_features)):
            raise LlmoptError("the AWQ format cannot store act-order (permuted) groups; use --format gptq")
        qweight, qzeros = awq_pack(q.codes, q.zeros)
        return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}
    qweight, qzeros = gptq_pack(q.codes, q.zeros)
    return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales,
            f"{prefix}.g_idx": q.g_idx.to(torch.int32).clone()}


def packed_shapes(fmt: str, prefix: str, out_features: int, in_features: int,
                  scheme: QuantScheme) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The (dtype, shape) of each tensor `pack_tensors` writes for an out x in projection, known
    before it is quantized (a checkpoint writer plans its files from them)."""
    if fmt == "compressed-tensors":
        return compressed_tensors.int4_shapes(prefix, out_features, in_features, scheme)
    groups = scheme.groups_of(in_features)
    shapes = {f"{prefix}.qweight": (torch.int32, (in_features, out_features // 8) if fmt == "awq"
                                    else (in_features // 8, out_features)),
              f"{prefix}.qzeros": (torch.int32, (groups, out_features // 8)),
              f"{prefix}.scales": (torch.float16, (groups, out_features))}
    if fmt != "awq":
        shapes[f"{prefix}.g_idx"] = (torch.int32, (in_features,))
    return shapes


def unpack_tensors(fmt: str, tensors: dict[str, torch.Tensor], prefix: str, bits: int, group_size: int,
                   gptq_v2: bool = False) -> QuantizedWeight:
    """Read one projection back as codes + grid, checking shapes agree with each other."""
    return read_packed(fmt, tensors, prefix, bits, group_size, gptq_v2).unpacked()


def read_packed(fmt: str, tensors: dict[str, torch.Tensor], prefix: str, bits: int, group_size: int,
                gptq_v2: bool = False) -> PackedQuantizedWeight:
    """One projection's grid (scales, zero points, g_idx), shapes checked, with its codes left
    packed: read a slab of output rows at a time (`PackedQuantizedWeight.code_rows`)."""
    if bits != 4:
        raise LlmoptError(f"{prefix}: only 4-bit {fmt.upper()} checkpoints are supported (this one is {bits}-bit)")
    try:
        qweight, qzeros, scales = (tensors[f"{prefix}.{k}"] for k in ("qweight", "qzeros", "scales"))
    except KeyError as exc:
        raise LlmoptError(f"{fmt.upper()} checkpoint is missing tensor {exc.args[0]}") from None
    if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2 \
            or qweight.dtype.is_floating_point or qzeros.dtype.is_floating_point:
        raise LlmoptError(f"{prefix}: packed tensors do not fit together: qweight {qweight.dtype} "
                          f"{tuple(qweight.shape)}, qzeros {qzeros.dtype} {tuple(qzeros.shape)}, scales "
                          f"{tuple(scales.shape)} (2-D tensors of 32-bit words expected)")
    if fmt == "awq":
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
        zeros = unpack_columns(qzeros, AWQ_ORDER).t().contiguous()
    else:
        in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
        zeros = (unpack_columns(qzeros) + 1).t().contiguous()
        if gptq_v2:
            zeros = zeros - 1  # v2 stores the zero point itself
    width = in_features if group_size == -1 else group_size
    if in_features % width:
        raise LlmoptError(f"{prefix}: group size {group_size} does not divide the input size {in_features}")
    groups = in_features // width
    if tuple(scales.shape) != (groups, out_features) or tuple(zeros.shape) != (out_features, groups):
        raise LlmoptError(
            f"{prefix}: scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not match "
            f"qweight {tuple(qweight.shape)} with group size {group_size}"
        )
    g_idx = tensors.get(f"{prefix}.g_idx")
    if g_idx is None or fmt == "awq":
        g_idx = torch.arange(in_features) // width
    elif g_idx.shape != (in_features,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise LlmoptError(f"{prefix}.g_idx has shape {tuple(g_idx.shape)} or values outside 0..{groups - 1}")
    reader = _awq_rows(qweight) if fmt == "awq" else _gptq_rows(qweight)
    return PackedQuantizedWeight(shape=(out_features, in_features), scales=scales.float().t().contiguous(),
                                 zeros=zeros.to(torch.int16), g_idx=g_idx.to(torch.int32),
                                 scheme=QuantScheme(bits=bits, group_size=group_size),
                                 readers=[(out_features, reader)])


def _awq_rows(qweight: torch.Tensor) -> CodeRows:
    """Output rows of AWQ's qweight [in, out/8] (eight output channels per word, interleaved)."""
    def rows(start: int, stop: int) -> torch.Tensor:
        first, last = start // 8, -(-stop // 8)
        codes = unpack_columns(qweight[:, first:last], AWQ_ORDER).t()
        return codes[start - 8 * first: stop - 8 * first].contiguous()
    return rows


def _gptq_rows(qweight: torch.Tensor) -> CodeRows:
    """Output rows of GPTQ's qweight [in/8, out] (eight input columns per word)."""
    def rows(start: int, stop: int) -> torch.Tensor:
        return unpack_rows(qweight[:, start:stop]).t().contiguous()
    return rows
