"""llmopt.kernels: Triton kernels and their pure-PyTorch references.

This folder is installed as `llmopt.kernels` only (see pyproject.toml). It must never
be importable as a top-level `kernels` module, which transformers probes for.
Here now: the pure-PyTorch paged attention (`paged_attention.py`) and the fp32 CPU
kernels in C++ (`csrc/`, built by `cpu_extension.py`): decode attention
(`cpu_paged_attention.py`), the few-row matmul of decode steps (`cpu_linear.py`) and the
fused RMSNorm / rope / silu*up (`cpu_fused.py`). Triton paged attention for CUDA
(`triton_paged_attention.py`: write_kv in `triton_write_kv.py`, split-KV decode in
`triton_paged_decode.py`, varlen chunked prefill in `triton_paged_prefill.py`; fp16/bf16
or fp8-e4m3-with-scale pools); importing it imports triton, so
nothing here imports it implicitly. The int4 dequant-matmul kernel lands with the kernels issue.
"""
