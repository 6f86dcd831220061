"""llmopt.kernels: Triton kernels and their pure-PyTorch references.

This folder is installed as `llmopt.kernels` only (see pyproject.toml). It must never
be importable as a top-level `kernels` module, which transformers probes for.
Here now: the pure-PyTorch paged attention (`paged_attention.py`) and the fp32 CPU
kernels in C++ (`csrc/`, built by `cpu_extension.py`): decode attention
(`cpu_paged_attention.py`), the few-row matmul of decode steps (`cpu_linear.py`) and the
fused RMSNorm / rope / silu*up (`cpu_fused.py`); the Triton int4 dequant-matmul for AWQ /
GPTQ weights (`triton_int4.py`, kernels in `triton_int4_kernels.py`). The Triton
paged-attention kernel lands with the kernels issue.
"""
