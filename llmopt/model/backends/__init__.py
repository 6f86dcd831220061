"""Kernel backends: one object per kernel family, chosen once at load (`select_backend`), that
hands out the decoder's ops, linear layers and paged attention."""

from llmopt.model.backends.base import KernelBackend
from llmopt.model.backends.cpu import CpuBackend
from llmopt.model.backends.reference import ReferenceBackend
from llmopt.model.backends.select import requested_backend, select_backend
from llmopt.model.backends.triton import TritonBackend

__all__ = ["CpuBackend", "KernelBackend", "ReferenceBackend", "TritonBackend", "requested_backend", "select_backend"]
