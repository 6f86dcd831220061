"""Packing int4 codes into the int32 layouts other tools load.

Codes are kept in "weight" orientation while we work: `codes[out, in]` (0..15) and one
integer zero point per (output channel, group): `zeros[out, groups]`.

- AWQ "GEMM" (AutoAWQ, vLLM `awq`): `qweight[in, out/8]` packs eight *output* channels per
  int32 in the interleaved order 0,2,4,6,1,3,5,7 (nibble i holds channel ORDER[i]);
  `qzeros[groups, out/8]` the same way; the zero point is stored as is.
- GPTQ v1 (AutoGPTQ, GPTQModel, vLLM `gptq`): `qweight[in/8, out]` packs eight *input*
  rows per int32 in natural order; `qzeros[groups, out/8]` packs output channels in
  natural order and stores zero - 1 (the historical v1 convention; v2 stores zero).
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NATURAL_ORDER = tuple(range(8))
_INT4_PER_INT32 = 8


def pack_columns(values: torch.Tensor, order: tuple[int, ...] = NATURAL_ORDER) -> torch.Tensor:
    """[rows, cols] ints in 0..15 -> [rows, cols/8] int32; nibble i of word j holds column 8j + order[i]."""
    rows, cols = values.shape
    if cols % _INT4_PER_INT32:
        raise ValueError(f"cannot pack {cols} columns into int32 words of 8")
    grouped = values.to(torch.int64).reshape(rows, cols // 8, 8)[:, :, list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (grouped << shifts).sum(dim=-1)
    return _to_int32(words)


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] = NATURAL_ORDER) -> torch.Tensor:
    """Inverse of `pack_columns`: [rows, words] int32 -> [rows, words*8] uint8 codes."""
    rows, words = packed.shape
    out = torch.empty(rows, words, 8, dtype=torch.uint8, device=packed.device)
    packed = packed.to(torch.int32)
    for nibble, column in enumerate(order):
        # arithmetic shifts of negative words still leave the right low nibble after & 0xF
        out[:, :, column] = (packed >> (4 * nibble)) & 0xF
    return out.reshape(rows, words * 8)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] ints in 0..15 -> [rows/8, cols] int32; nibble i of word r holds row 8r + i."""
    return pack_columns(values.t()).t().contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    return unpack_columns(packed.t()).t().contiguous()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    # values are in [0, 2^32); reinterpret the upper half as negative int32, bit for bit
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_pack(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [out, in], zeros [out, groups] -> (qweight [in, out/8], qzeros [groups, out/8])."""
    return pack_columns(codes.t(), AWQ_ORDER), pack_columns(zeros.t(), AWQ_ORDER)


def awq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [in, out/8], qzeros [groups, out/8]) -> codes [out, in], zeros [out, groups]."""
    return unpack_columns(qweight, AWQ_ORDER).t().contiguous(), unpack_columns(qzeros, AWQ_ORDER).t().contiguous()


def gptq_pack(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [out, in], zeros [out, groups] -> (qweight [in/8, out], qzeros [groups, out/8] holding zero-1).

    v1 stores zero - 1 in 4 bits, so a zero point of 0 cannot be stored (readers add 1 to
    the nibble: 15 reads as 16); our grids never use it.
    """
    if bool((zeros < 1).any()):
        raise ValueError("GPTQ v1 cannot store a zero point of 0")
    return pack_rows(codes.t()), pack_columns((zeros - 1).t())


def gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [in/8, out], qzeros [groups, out/8], v1) -> codes [out, in], zeros [out, groups] (1..16)."""
    codes = unpack_rows(qweight).t().contiguous()
    zeros = (unpack_columns(qzeros) + 1).t().contiguous()
    return codes, zeros
