"""Sampler: filters on hand-made distributions, seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from llmopt.errors import LlmoptError
from llmopt.runtime import SamplingParams
from llmopt.runtime.sampler import argmax_rows, draw, filtered_probs, make_generator, sample

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625
LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]))


def test_temperature_one_keeps_distribution():
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0))
    assert torch.allclose(probs, torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]))


def test_temperature_sharpens():
    probs = filtered_probs(LOGITS, SamplingParams(temperature=0.5))
    expected = torch.tensor([0.25, 0.0625, 0.015625, 0.00390625, 0.00390625])
    assert torch.allclose(probs, expected / expected.sum())


def test_top_k():
    probs = filtered_probs(LOGITS, SamplingParams(top_k=2))
    assert torch.allclose(probs, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]))


def test_top_p_keeps_smallest_covering_set():
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed too
    probs = filtered_probs(LOGITS, SamplingParams(top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.5, 0.25, 0.125, 0, 0]) / 0.875)
    # exactly covered: 0.75 needs only two tokens
    probs = filtered_probs(LOGITS, SamplingParams(top_p=0.75))
    assert torch.allclose(probs, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]))


def _top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(before >= top_p, 0.0))


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])  # flat (nucleus past the candidates) .. peaked
def test_top_p_over_a_vocabulary_equals_the_full_sort(spread):
    """The candidates-first nucleus keeps the full sort's probabilities, bitwise (up to which of two
    equal boundary tokens is kept), whether the nucleus lies inside the first TOP_P_CANDIDATES tokens
    or not."""
    from llmopt.runtime.sampler import TOP_P_CANDIDATES, _top_p

    gen = torch.Generator().manual_seed(int(spread * 10))
    sizes = []
    for _ in range(20):
        probs = torch.softmax(torch.randn(49152, generator=gen) * spread, dim=-1)
        for top_p in (0.5, 0.9, 0.95):
            expected = _top_p_by_full_sort(probs, top_p)
            got = _top_p(probs, top_p)
            # equal probabilities (float32 softmax has some) may sit in either order in topk and sort:
            # the same values are kept, and any token kept by one only ties with the last one kept
            assert torch.equal(got.sort().values, expected.sort().values)
            moved = got != expected
            assert torch.all(probs[moved] == expected[expected > 0].min())
            sizes.append(int((expected > 0).sum()))
    if spread == 0.5:
        assert max(sizes) > TOP_P_CANDIDATES  # the fallback ran
    if spread == 12.0:
        assert max(sizes) < TOP_P_CANDIDATES  # the candidates covered it


def test_min_p():
    probs = filtered_probs(LOGITS, SamplingParams(min_p=0.3))  # drops tokens below 0.15
    assert torch.allclose(probs, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]))


def test_greedy_and_seeded_sampling():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [greedy] * 3, [None] * 3) == logits.argmax(-1).tolist()

    seeded = SamplingParams(temperature=1.0, seed=123)
    draws = [sample(logits[:1], [seeded], [make_generator(seeded)]) for _ in range(2)]
    assert draws[0] == draws[1]
    # the same seeded request in a different batch position draws the same token
    other = SamplingParams(temperature=1.0, seed=5)
    batch = sample(torch.cat([logits[1:2], logits[:1]]), [other, seeded], [make_generator(other), make_generator(seeded)])
    assert batch[1] == draws[0][0]


def test_sampling_follows_distribution():
    params = SamplingParams(temperature=1.0, seed=0)
    gen = make_generator(params)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(LOGITS[None], [params], [gen])[0]] += 1
    freq = counts / counts.sum()
    # 4000 draws: standard error of p=0.5 is ~0.008
    assert torch.allclose(freq, LOGITS.exp(), atol=0.03)


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.01), dict(max_tokens=0), dict(top_k=-2), dict(min_p=2.0)],
)
def test_invalid_params(kwargs):
    with pytest.raises(LlmoptError):
        SamplingParams(**kwargs)


def test_unseeded_generators_differ():
    p = SamplingParams(temperature=1.0)
    a, b = make_generator(p), make_generator(p)
    assert not math.isclose(torch.rand(1, generator=a).item(), torch.rand(1, generator=b).item())


def test_penalties_follow_vllm_semantics():
    from llmopt.runtime.sampler import apply_penalties

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    # repetition penalty over prompt + output: positive logits divided, negative multiplied
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    assert torch.allclose(out, torch.tensor([1.0, -2.0, 0.5, 3.0]))
    # frequency (per occurrence) and presence (once) penalties over the output only
    out = apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
                          prompt_ids=[3], output_ids=[2, 2, 0])
    assert torch.allclose(out, torch.tensor([2.0 - 0.5 - 1.0, -1.0, 0.5 - 1.0 - 1.0, 3.0]))
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0]))  # the input is left alone


def test_blocked_tokens_never_sampled():
    from llmopt.runtime.sampler import SampleRequest, sample_batch

    logits = torch.tensor([[5.0, 1.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    [res] = sample_batch(logits, [SampleRequest(greedy, None, [], [], blocked_ids=[0])])
    assert res.token_id == 1
    p = SamplingParams(temperature=1.0, seed=0)
    gen = make_generator(p)
    draws = {sample_batch(logits, [SampleRequest(p, gen, [], [], [0])])[0].token_id for _ in range(200)}
    assert 0 not in draws


def test_draw_never_picks_zero_probability_tokens_and_matches_frequencies():
    # zeros at both ends and in the middle: inverse-CDF edges (u near 0, u near the total)
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    gen = torch.Generator().manual_seed(7)
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(20000)]), minlength=6).float()
    assert counts[[0, 2, 5]].sum() == 0
    # 20000 draws: standard error of p=0.5 is ~0.0035
    assert torch.allclose(counts / counts.sum(), probs, atol=0.015)
    # unnormalised input (a sum slightly off 1 after filtering) is drawn in proportion
    assert draw(torch.tensor([0.0, 0.0, 1e-30]), gen) == 2


def test_grammar_mask_applies_to_its_row_only_and_logprobs_stay_finite():
    from llmopt.runtime.sampler import SampleRequest, sample_batch

    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 2)
    allowed = torch.tensor([False, False, True, True])
    p = SamplingParams(temperature=1.0, seed=0, logprobs=2)
    gen = make_generator(p)
    for _ in range(100):
        masked, plain = sample_batch(logits, [SampleRequest(p, gen, [], [], [], allowed_ids=allowed),
                                              SampleRequest(SamplingParams(temperature=0), None, [], [], [])])
        assert masked.token_id in (2, 3) and plain.token_id == 0
        # logprobs are the model's distribution before the mask: finite, the top-2 included
        assert all(math.isfinite(v) for v in masked.logprobs.values()) and {0, 1} <= set(masked.logprobs)
    # min_tokens blocking the grammar's only token (EOS): the grammar wins
    [res] = sample_batch(logits[:1], [SampleRequest(SamplingParams(temperature=0, logprobs=0), None, [], [], [2],
                                                    allowed_ids=torch.tensor([False, False, True, False]))])
    assert res.token_id == 2 and math.isfinite(res.logprobs[2])


class _Operands:
    """Every aten op run inside the block, with its tensor operands (a TorchDispatchMode)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                seen.append((func, [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]))
                return func(*args, **kwargs)

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tensor_the_sampler_combines_is_on_the_logits_device_and_dtype(dtype):
    """The penalties and blocked tokens on logits on torch's "meta" device, standing in for CUDA (a
    meta tensor runs every op without data, and, unlike CUDA, accepts CPU operands silently: the
    recorded operands show them). Apart from the copies that bring token ids over, no op may take
    a CPU tensor beside the logits (CUDA raises on one), nor a floating operand of another dtype."""
    from llmopt.runtime.sampler import SampleRequest, _prepare_row

    logits = torch.zeros(16, dtype=dtype, device="meta")
    params = SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    request = SampleRequest(params, None, prompt_ids=[1, 2, 3], output_ids=[3, 3, 5, 7], blocked_ids=[0, 9])
    copies = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.lift_fresh.default}
    with _Operands() as ops:
        sampled, scored = _prepare_row(logits, request)
    assert sampled.device.type == "meta" and sampled.dtype == dtype and scored.dtype == dtype
    combined = [(func, t) for func, tensors in ops.seen if func not in copies for t in tensors]
    assert len({func for func, _ in combined}) >= 5  # index, where, index_put, index_add, sub: the steps ran
    off_device = [str(func) for func, t in combined if t.device.type != "meta" and t.dim() > 0]
    assert not off_device, off_device
    other_dtype = [str(func) for func, t in combined if t.is_floating_point() and t.dtype != dtype]
    assert not other_dtype, other_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(dtype):
    """NumPy's argmax on CPU: the first index of a tied maximum and a NaN as the maximum, as torch's."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen).to(dtype)
    logits[1, 7] = logits[1, 900] = 50.0  # a tie: the first index wins
    logits[2, 3] = float("nan")
    logits[3] = 0.0  # every entry tied
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits)[1] == 7 and argmax_rows(logits)[2] == 3 and argmax_rows(logits)[3] == 0
