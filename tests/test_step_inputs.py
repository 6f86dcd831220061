"""What the model runner hands the attention each step: inputs built on the CPU and moved in one
copy per dtype (`runtime.step_inputs`), block tables and context lengths in the dtype the backend's
kernels index with (int32 for Triton's), and no O(context) slot list where the kernels read block
tables. torch's "meta" device stands in for a GPU where a copy's count is what matters."""

from __future__ import annotations

import os

import pytest
import torch

from llmopt.runtime.step_inputs import pack_by_dtype, to_device, unpack

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported (as test_triton_runtime)

HOST = {"ids": torch.tensor([5, 6, 7]), "tables": torch.tensor([[1, 2], [3, 3]], dtype=torch.int32),
        "slots": torch.tensor([40, 41]), "lens": torch.tensor([17, 9], dtype=torch.int32),
        "rows": torch.tensor([0, 2])}


def test_inputs_pack_into_one_buffer_per_dtype_and_come_back_unchanged():
    buffers = pack_by_dtype(HOST)
    assert {d: b.numel() for d, b in buffers.items()} == {torch.int64: 7, torch.int32: 6}
    back = unpack(buffers, HOST)
    assert list(back) == list(HOST)
    for name, t in HOST.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_on_the_cpu_the_inputs_are_used_where_they_are():
    moved = to_device(HOST, torch.device("cpu"))
    assert all(moved[name] is t for name, t in HOST.items())


def test_off_the_cpu_one_copy_per_dtype_moves_a_step():
    from torch.utils._python_dispatch import TorchDispatchMode

    copies = []

    class CountCopies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                copies.append(func)
            return func(*args, **(kwargs or {}))

    with CountCopies():
        moved = to_device(HOST, torch.device("meta"))
    assert len(copies) == 2  # int64 and int32, not one per input
    for name, t in HOST.items():
        assert moved[name].device.type == "meta" and moved[name].shape == t.shape and moved[name].dtype == t.dtype


def _step_metadata(loaded, prompts: list[list[int]], max_tokens: int = 3):
    """The StepMetadata of every step a short generation runs (captured where the attention reads it)."""
    from llmopt.runtime import SamplingParams
    from llmopt.runtime.llm import LLM

    llm = LLM(loaded, num_kv_blocks=32, block_size=4)
    attn, seen = llm.engine.runner.attn, []
    forward = attn.forward

    def spy(layer_idx, *args, **kwargs):
        if layer_idx == 0:
            seen.append(attn.metadata)
        return forward(layer_idx, *args, **kwargs)

    attn.forward = spy
    if llm.engine.runner.decode_plan is not None:  # the C++ whole-step decode bypasses attn.forward
        llm.engine.runner.decode_plan = None
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return attn, seen


def test_the_runner_gives_tables_and_lengths_the_kernels_dtype(tiny_models, monkeypatch):
    from llmopt.loader import load

    monkeypatch.setenv("LLMOPT_KERNELS", "reference")
    attn, seen = _step_metadata(load(str(tiny_models["llama"]), dtype="float32", device="cpu"), [[1, 2, 3, 4, 5, 6]])
    decodes = [md for md in seen if md.num_decodes]
    prefills = [md for md in seen if md.prefills]
    assert decodes and prefills
    for md in decodes:
        assert md.decode_lens.dtype == md.decode_block_tables.dtype == attn.block_table_dtype
    for md in prefills:  # the PyTorch prefill gathers keys through each chunk's slot list
        assert all(slots is not None and slots.numel() == ctx + end - start for start, end, slots, ctx in md.prefills)


def test_on_triton_lengths_are_int32_and_no_slot_list_is_built(tiny_models, monkeypatch):
    """Triton's kernels read int32 tables and lengths (the specialisation its tests compile), and the
    prompt chunks' block tables, never a per-token slot list of the whole context."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and TRITON_INTERPRET is set to something other than 1")
    pytest.importorskip("triton")
    from llmopt.loader import load

    monkeypatch.setenv("LLMOPT_KERNELS", "triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load(str(tiny_models["llama"]), dtype="float32", device=device)
    attn, seen = _step_metadata(loaded, [[1, 2, 3, 4, 5, 6], [7, 8, 9]], max_tokens=2)
    assert attn.block_table_dtype == torch.int32
    decodes = [md for md in seen if md.num_decodes]
    prefills = [md for md in seen if md.prefills]
    assert decodes and prefills
    for md in decodes:
        assert md.decode_lens.dtype == md.decode_block_tables.dtype == torch.int32
    for md in prefills:
        assert all(slots is None for _, _, slots, _ in md.prefills)
        assert md.prefill_block_tables.dtype == md.prefill_cu_seqlens.dtype == md.prefill_context_lens.dtype == torch.int32
        assert md.max_prefill_len == max(end - start for start, end, _, _ in md.prefills)
