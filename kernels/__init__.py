"""llmopt.kernels: Triton kernels and their pure-PyTorch references.

This folder is installed as `llmopt.kernels` only (see pyproject.toml). It must never
be importable as a top-level `kernels` module, which transformers probes for.
The paged-attention and int4 dequant-matmul kernels land with the kernels issue.
"""
