"""The runtime on the Triton backend (`LLMOPT_KERNELS=triton`) against the PyTorch reference.

Without CUDA the Triton kernels run under the interpreter on CPU tensors, so the models are
the tiny random ones and the prompts few. Greedy tokens of the two paths are compared up to
the reference's first near tie (top-2 log-probability gap below NEAR_TIE): the kernels
differ from the reference in summation order only (~1e-6 on fp32 logits), so before such a
tie the tokens must be identical, and the tests require most positions to be decisive.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
pytest.importorskip("triton")

from llmopt.loader import load  # noqa: E402
from llmopt.runtime import SamplingParams  # noqa: E402
from llmopt.runtime.llm import LLM  # noqa: E402
from test_runtime_exactness import tiny_prompts  # noqa: E402

NEAR_TIE = 1e-3  # nats; tiny random models have top-2 gaps of a few thousandths at many positions
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = {
    "prefix-caching": dict(num_kv_blocks=128, block_size=16),
    "chunked-small-blocks": dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=9),
    # fp8 e4m3 pools: the Triton write_kv rounds as the reference's cast does (nearest even, saturating)
    "fp8-kv": dict(num_kv_blocks=128, block_size=16, kv_cache_dtype="fp8"),
}


PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


def greedy(loaded, prompts, **config):
    llm = LLM(loaded, **config)
    return [o.outputs[0] for o in llm.generate(prompts, PARAMS)], llm


def decisive_prefix(reference) -> int:
    gaps = [sorted(lp.values(), reverse=True) for lp in reference.logprobs]
    return next((j for j, g in enumerate(gaps) if g[0] - g[1] < NEAR_TIE), len(gaps))


def assert_same_up_to_near_ties(got, want):
    decisive = [decisive_prefix(w) for w in want]
    assert sum(decisive) >= len(want) * len(want[0].token_ids) // 2, decisive  # the comparison is not empty
    for g, w, n in zip(got, want, decisive):
        assert g.token_ids[:n] == w.token_ids[:n], (n, g.token_ids, w.token_ids)


def load_on(backend: str, folder, monkeypatch, dtype: str = "float32"):
    monkeypatch.setenv("LLMOPT_KERNELS", backend)
    loaded = load(str(folder), dtype=dtype, device=DEVICE)
    monkeypatch.delenv("LLMOPT_KERNELS")
    return loaded


# mistral: a sliding window shorter than the prompts
@pytest.mark.parametrize("kind,name", [("llama", "chunked-small-blocks"), ("mistral", "prefix-caching"),
                                       ("llama", "fp8-kv")])
def test_triton_backend_greedy_equals_reference(tiny_models, monkeypatch, kind, name):
    triton_model = load_on("triton", tiny_models[kind], monkeypatch)
    reference_model = load_on("reference", tiny_models[kind], monkeypatch)
    assert {m.ops.backend for m in triton_model.model.modules() if hasattr(m, "ops")} == {"triton"}
    prompts = tiny_prompts(4, seed=2)
    want, _ = greedy(reference_model, prompts, **CONFIGS[name])
    got, llm = greedy(triton_model, prompts, **CONFIGS[name])
    assert llm.engine.runner.attn.triton is not None
    assert_same_up_to_near_ties(got, want)
    # the same prompts again: their prefixes are cached, so prompt chunks attend cached blocks
    again = [o.outputs[0] for o in llm.generate(prompts, PARAMS)]
    assert llm.engine.stats().prefix_cache_hits > 0
    assert_same_up_to_near_ties(again, want)


def test_int4_checkpoint_on_triton_layers(tiny_models, monkeypatch, tmp_path):
    """An RTN int4 checkpoint of the tiny model: the Triton backend swaps in `TritonInt4Linear`
    and its greedy tokens are those of the dense dequantized weights (the reference backend)."""
    from llmopt.model.int4_linear import TritonInt4Linear
    from llmopt.quant.quantize import QuantizeRequest, quantize

    out = tmp_path / "rtn"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method="rtn", group_size=32))
    triton_model = load_on("triton", out, monkeypatch)
    reference_model = load_on("reference", out, monkeypatch)
    layers = len(triton_model.model.model.layers)
    assert sum(isinstance(m, TritonInt4Linear) for m in triton_model.model.modules()) == 4 * layers  # qkv, o, gate_up, down
    assert not any(isinstance(m, TritonInt4Linear) for m in reference_model.model.modules())
    prompts = tiny_prompts(3, seed=3)
    want, _ = greedy(reference_model, prompts, **CONFIGS["prefix-caching"])
    got, _ = greedy(triton_model, prompts, **CONFIGS["prefix-caching"])
    assert_same_up_to_near_ties(got, want)


def test_triton_on_cpu_needs_the_interpreter(tiny_models, monkeypatch):
    from llmopt.errors import LlmoptError

    monkeypatch.setenv("LLMOPT_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(LlmoptError, match="TRITON_INTERPRET=1"):
        load(str(tiny_models["llama"]), device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 needs CUDA: the interpreter's bf16 tl.dot is wrong")
def test_bfloat16_on_the_triton_backend(tiny_models, monkeypatch):
    """bf16, what a CUDA model computes in by default: the Triton backend against the reference, both in
    bf16. bf16 rounding moves log-probabilities by ~1e-2, more than a tiny random model's top-2 gaps, so
    the first token's log-probabilities are compared (to 0.05 nats), not whole greedy sequences."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    prompts = tiny_prompts(4, seed=4)
    outs = {}
    for backend in ("triton", "reference"):
        loaded = load_on(backend, tiny_models["llama"], monkeypatch, dtype="bfloat16")
        assert next(loaded.model.parameters()).dtype == torch.bfloat16
        outs[backend] = [o.outputs[0] for o in LLM(loaded, **CONFIGS["prefix-caching"]).generate(prompts, params)]
    for got, want in zip(outs["triton"], outs["reference"]):
        assert len(got.token_ids) == 8
        assert all(torch.isfinite(torch.tensor(list(lp.values()))).all() for lp in got.logprobs)
        first_got, first_want = got.logprobs[0], want.logprobs[0]
        shared = set(first_got) & set(first_want)
        assert len(shared) >= 3, (first_got, first_want)
        assert max(abs(first_got[t] - first_want[t]) for t in shared) < 0.05, (first_got, first_want)
