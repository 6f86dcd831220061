"""Paged attention in Triton for CUDA: K/V writes, decode and (chunked) prefill.

The entry points the runtime's attention backend needs, with the reference semantics of
`paged_attention.py` (the pure-PyTorch path, kept as the CPU fallback):
  `write_kv`                 store new K/V rows at their slots (`triton_write_kv.py`)
  `paged_decode_attention`   one query per sequence, split-KV (`triton_paged_decode.py`),
                             its partials in a caller-kept `DecodeWorkspace`
  `paged_prefill_attention`  varlen prompt chunks over a cached prefix (`triton_paged_prefill.py`)
Pools are per layer `[num_blocks * block_size, kv_heads, head_dim]`, slot = block_id *
block_size + offset, in the model's dtype or a narrower one (rounded on write, widened on
read), or float8_e4m3fn with a per-layer scale for K and for V (stored = value / scale).
Importing this module imports triton: on CPU tensors the kernels run only under the
Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported).
"""

from __future__ import annotations

from llmopt.kernels.triton_paged_decode import DecodeWorkspace, choose_num_splits, paged_decode_attention
from llmopt.kernels.triton_paged_prefill import paged_prefill_attention
from llmopt.kernels.triton_write_kv import FP8_DTYPE, FP8_MAX, write_kv

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "choose_num_splits",
           "DecodeWorkspace", "FP8_DTYPE", "FP8_MAX"]
