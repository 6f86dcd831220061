"""Weights moved into memory advised into transparent huge pages (llmopt.core.huge_pages): the same values,
ties kept, every holder of a tensor reading the copy, and (where Linux offers them) huge pages."""

from __future__ import annotations

import pytest
import torch

from llmopt.core import huge_pages
from llmopt.core.huge_pages import HUGE_PAGE, move_into_huge_pages
from llmopt.runtime.llm import LLM
from llmopt.runtime.model_runner import move_streamed_weights

from test_kv_pool_pages import _anon_huge_kib, _thp_mode

needs_thp = pytest.mark.skipif(not huge_pages.huge_pages_enabled(), reason="no transparent huge pages on this machine")


@needs_thp
def test_moved_tensors_keep_values_ties_and_holders():
    torch.manual_seed(0)
    a = torch.randn(1000, 33)
    b = torch.randint(0, 255, (77,), dtype=torch.uint8)
    with torch.inference_mode():  # copies made under inference mode (the int8 head's) move too
        c = torch.randn(5, 7).to(torch.bfloat16)
    param = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
    alias = param.detach()  # another tensor object over the same data (a tied weight)
    strided = torch.randn(8, 8).t()
    expected = [t.clone() for t in (a, b, c, param, strided)]
    holder = {"w": a}  # a module or dataclass holding the tensor object
    old = [t.data_ptr() for t in (a, b, c, param, strided)]
    moved = move_into_huge_pages([a, b, c, param, alias, a, strided, torch.empty(0), None])
    assert moved == sum(-(-n // 64) * 64 for n in (1000 * 33 * 4, 77, 5 * 7 * 2, 64 * 64 * 4))
    for t, e in zip((a, b, c, param, strided), expected):
        assert torch.equal(t, e) and t.dtype == e.dtype and t.shape == e.shape
    assert [t.data_ptr() != p for t, p in zip((a, b, c, param, strided), old)] == [True] * 4 + [False]
    assert holder["w"].data_ptr() == a.data_ptr()
    assert alias.data_ptr() == param.data_ptr() and isinstance(param, torch.nn.Parameter)
    for t in (a, b, c, param):  # a storage of its own each, as before, and each on a cache line
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.data_ptr() % 64 == 0


@needs_thp
def test_followers_holding_the_same_bytes_move_with_them():
    weight = torch.randn(256, 64)
    alias = weight.detach()  # another object over the same bytes (DenseLinear's onednn_weight can be one)
    as_bytes = weight.view(torch.uint8).view(-1)  # the same bytes under another dtype and shape
    other = torch.randn(8)  # a follower holding bytes nobody moves
    ptr = other.data_ptr()
    expected = weight.clone()
    move_into_huge_pages([weight], followers=[alias, as_bytes, other, torch.empty(0)])
    assert alias.data_ptr() == weight.data_ptr() == as_bytes.data_ptr() and other.data_ptr() == ptr
    assert torch.equal(alias, expected) and as_bytes.dtype == torch.uint8 and as_bytes.shape == (256 * 64 * 4,)


def test_nothing_moves_without_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_pages_enabled", lambda: False)
    a = torch.randn(10)
    ptr = a.data_ptr()
    assert move_into_huge_pages([a]) == 0 and a.data_ptr() == ptr


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always")
                    or _thp_mode("defrag") not in ("always", "madvise", "defer+madvise"),
                    reason=f"transparent huge pages are {_thp_mode() or 'absent'} (defrag "
                           f"{_thp_mode('defrag') or 'absent'}) on this machine")
def test_moved_weights_are_in_huge_pages():
    weights = [torch.randn(1024, 1024) for _ in range(16)]  # 64 MiB in 4 MiB tensors
    move_into_huge_pages(weights)
    # some, not all: the region's tail may stay in 4 KiB pages, and the kernel may fall back to them
    assert _anon_huge_kib(weights[0].data_ptr()) >= 2048


@needs_thp
def test_engine_decodes_the_same_over_moved_weights(tiny_models, monkeypatch):
    # the runner moves the streamed weights before building its decode plan; a model whose weights stay
    # where they were loaded (moving nothing) decodes the same tokens and log-probabilities
    from llmopt.runtime import SamplingParams
    import llmopt.runtime.model_runner as model_runner

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    moved = LLM(str(tiny_models["llama"]), max_num_seqs=2).generate(["hello there", "a b c"], params)
    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "move_streamed_weights", lambda model: 0)
        kept = LLM(str(tiny_models["llama"]), max_num_seqs=2).generate(["hello there", "a b c"], params)
    for x, y in zip(moved, kept):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids and x.outputs[0].logprobs == y.outputs[0].logprobs
    assert move_streamed_weights(LLM(str(tiny_models["llama"]), max_num_seqs=1).engine.runner.model) > 0
