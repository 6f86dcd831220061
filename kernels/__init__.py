"""llmopt.kernels: Triton kernels and their pure-PyTorch references.

This folder is installed as `llmopt.kernels` only (see pyproject.toml). It must never
be importable as a top-level `kernels` module, which transformers probes for.
Here now: the pure-PyTorch paged attention (`paged_attention.py`) and the fp32 CPU
kernels in C++ (`csrc/`, built by `cpu_extension.py`): decode attention
(`cpu_paged_attention.py`), the few-row matmul of decode steps (`cpu_linear.py`) and the
fused RMSNorm / rope / silu*up (`cpu_fused.py`); for CUDA, in Triton: the int4
dequant-matmul for AWQ / GPTQ weights (`triton_int4.py`, kernels in `triton_int4_kernels.py`)
and paged attention (`triton_paged_attention.py`: write_kv in `triton_write_kv.py`, split-KV
decode in `triton_paged_decode.py`, varlen chunked prefill in `triton_paged_prefill.py`, the
K/V-tile steps both share in `triton_attention_tiles.py`;
fp16/bf16 or fp8-e4m3-with-scale pools). Importing a Triton kernel file imports triton, so
nothing here imports one implicitly.
"""
