"""AWQ's searches and GPTQ's Hessian as real-size models need them: row blocks that bound the
temporaries, one product per scale candidate on the exact weight error, the Hessian over token
blocks through a given kernel, the factorisation in the Hessian's own storage, and
`--fp32-matmul-precision` for the calibration's float32 products (random tensors, tiny models:
seconds)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_usage_error, run_cli
from llmopt.quant import awq, gptq
from llmopt.quant.quantizer import QuantScheme, fake_quantize, grid_params, quantize_codes
from llmopt.quant.quantize import QuantizeRequest, quantize

SCHEME = QuantScheme(bits=4, group_size=32, sym=False)


def activations(n: int, width: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g) * (torch.rand(width, generator=g) * 4 + 0.1)  # uneven channels


def weights(out: int, width: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(out, width, generator=torch.Generator().manual_seed(seed)) * 0.05


def scale_loss(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> float:
    """The scale search's measure, from its definition, in float64: ||X W^T - (X / s) Q(W s)^T||^2."""
    x64 = x.double()
    return ((x64 / s.double()) @ fake_quantize(w * s, SCHEME).double().t() - x64 @ w.double().t()).pow(2).sum().item()


def candidate_scales(x: torch.Tensor, w: torch.Tensor, n_grid: int) -> list[torch.Tensor]:
    x_mean = x.abs().mean(dim=0)
    grouped = w.abs().reshape(w.shape[0], -1, SCHEME.group_size)
    w_mean = (grouped / (grouped.amax(dim=-1, keepdim=True) + 1e-6)).reshape(w.shape).mean(dim=0)
    out = []
    for step in range(n_grid):
        r = step / n_grid
        s = (x_mean.pow(r) / (w_mean.pow(1 - r) + 1e-4)).clamp(min=1e-4)
        out.append(s / (s.max() * s.min()).sqrt())
    return out


@pytest.mark.parametrize("block_elements", [1 << 22, 64 * 5])  # one block; blocks of 5 rows (and a ragged last)
def test_scale_search_picks_the_candidate_with_least_output_error(block_elements, monkeypatch):
    monkeypatch.setattr(awq, "ROW_BLOCK_ELEMENTS", block_elements)
    x, w = activations(256, 64), weights(48, 64)
    s, ratio = awq.search_scale(x, w, SCHEME, n_grid=10, search_tokens=256)
    losses = [scale_loss(x, w, c) for c in candidate_scales(x, w, 10)]
    assert scale_loss(x, w, s) <= min(losses) * (1 + 1e-5)  # the best one, up to float32 near ties
    assert ratio == pytest.approx(round(ratio * 10) / 10)
    assert losses[0] > min(losses)  # this data rewards scaling, so the check above is not the trivial s = 1


def test_scale_search_measures_on_a_stride_sample_of_tokens():
    x, w = activations(1000, 64), weights(16, 64)
    assert awq.token_sample(x, 100).shape[0] == 100 and torch.equal(awq.token_sample(x, 100)[1], x[10])
    s_sample, _ = awq.search_scale(x, w, SCHEME, n_grid=10, search_tokens=100)
    losses = [scale_loss(x[::10], w, c) for c in candidate_scales(x, w, 10)]
    assert scale_loss(x[::10], w, s_sample) <= min(losses) * (1 + 1e-5)


def test_clip_search_in_row_blocks_equals_one_block(monkeypatch):
    x, w = activations(300, 96, seed=2), weights(40, 96, seed=3)
    rows = torch.arange(40) % 3 == 0
    whole = awq.search_clip(x, w, SCHEME, rows)
    monkeypatch.setattr(awq, "ROW_BLOCK_ELEMENTS", 96 * 7)
    blocked = awq.search_clip(x, w, SCHEME, rows)
    torch.testing.assert_close(blocked, whole, rtol=0, atol=0)
    assert torch.equal(blocked[~rows], w[~rows])  # rows left alone are not clipped
    assert not torch.equal(blocked[rows], w[rows])


def test_group_gram_is_each_groups_gram():
    x = activations(50, 32 * 20, seed=4)
    gram = awq.group_gram(x, 32, groups_per_pass=3)
    for g in (0, 7, 19):
        xg = x[:, g * 32:(g + 1) * 32].double()
        torch.testing.assert_close(gram[g].double(), xg.t() @ xg, rtol=1e-5, atol=1e-3)


def test_hessian_over_token_blocks_through_a_kernel_equals_one_product(monkeypatch):
    x = activations(1000, 48, seed=5)
    calls = []

    def kernel(a, b):
        calls.append(a.shape)
        return F.linear(a, b)

    monkeypatch.setattr(gptq, "HESSIAN_TOKENS", 300)
    blocked = gptq.hessian(x, kernel)
    assert calls == [(48, 300)] * 3 + [(48, 100)]
    torch.testing.assert_close(blocked, gptq.hessian(x), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(blocked.double(), (2 / 1000) * x.double().t() @ x.double(), rtol=1e-5, atol=1e-4)


def reference_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    damped = h.double() + damp * h.diagonal().double().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)


def test_inverse_hessian_factor_in_place_and_after_retries():
    x = activations(200, 40, seed=6)
    h = gptq.hessian(x)
    factor, stats = gptq._inverse_hessian_factor(h.clone(), 0.1)
    assert stats.retries == 0
    torch.testing.assert_close(factor.double(), reference_factor(h, 0.1), rtol=1e-4, atol=1e-5)
    # indefinite: a strongly negative direction needs damping raised until it is outweighed
    v = torch.randn(40, 1, generator=torch.Generator().manual_seed(7))
    bad = h - 3 * h.diagonal().mean() * (v @ v.t()) / (v.t() @ v)
    stored = bad.clone()
    factor, stats = gptq._inverse_hessian_factor(stored, 0.01)
    assert factor.data_ptr() == stored.data_ptr() and stats.retries >= 1  # its own storage, retried
    assert stats.damp_percent == pytest.approx(0.01 * 10 ** stats.retries)
    torch.testing.assert_close(factor.double(), reference_factor(bad, stats.damp_percent), rtol=1e-3, atol=1e-4)


def test_gptq_uses_up_the_hessian_and_matches_a_kept_one():
    x, w = activations(400, 64, seed=8), weights(24, 64, seed=9)
    h = gptq.hessian(x)
    for desc_act in (False, True):
        kept = h.clone()
        q1, _ = gptq.gptq_quantize(w, h.clone(), SCHEME, desc_act)
        q2, _ = gptq.gptq_quantize(w, kept, SCHEME, desc_act)
        assert torch.equal(q1.codes, q2.codes) and torch.equal(q1.scales, q2.scales)
        assert torch.equal(q1.g_idx.sort().values, torch.arange(64) // 32)


def textbook_gptq(w: torch.Tensor, h: torch.Tensor, damp: float) -> torch.Tensor:
    """GPTQ as the paper states it, in float64: after each column, every later column takes its error
    at once (no blocks, no lazy update); returns the codes."""
    w, hinv = w.double().clone(), reference_factor(h, damp)
    codes = torch.empty_like(w)
    for col in range(w.shape[1]):
        if col % SCHEME.group_size == 0:
            scale, zero = grid_params(w[:, col:col + SCHEME.group_size], SCHEME)
        codes[:, col:col + 1] = quantize_codes(w[:, col:col + 1], scale, zero, SCHEME.max_code)
        err = (w[:, col:col + 1] - (codes[:, col:col + 1] - zero) * scale) / hinv[col, col]
        w[:, col:] -= err @ hinv[col:col + 1, col:]
    return codes


def test_gptq_blocks_and_lazy_updates_give_the_textbook_codes():
    # 4 blocks of 32 columns: the later blocks see the earlier ones only through the lazy update
    x, w = activations(600, 128, seed=10), weights(48, 128, seed=11)
    h = gptq.hessian(x)
    expected = textbook_gptq(w, h, 0.1)
    q, _ = gptq.gptq_quantize(w, h.clone(), SCHEME, block_size=32)
    agree = (q.codes.double() == expected).double().mean().item()
    assert agree > 0.995, agree  # float32 vs float64: a code may flip at a rounding tie, not more
    # the error feedback moves many codes off round-to-nearest: the agreement above is not by chance
    rtn = torch.cat([quantize_codes(w[:, g:g + 32], *grid_params(w[:, g:g + 32], SCHEME), SCHEME.max_code)
                     for g in range(0, 128, 32)], dim=1)
    assert (rtn.double() == expected).double().mean().item() < 0.9


# ---- --fp32-matmul-precision on a tiny model ------------------------------------------------
TEXT = ("Rivers run to the sea, and the sea does not fill; the wind goes round and round again. "
        "The quick brown fox jumps over the lazy dog, and numbers became the language of secrets. ") * 12


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def run(model, out, calib, method, precision):
    return quantize(QuantizeRequest(model=str(model), output=out, method=method, group_size=32, calib=str(calib),
                                    num_samples=8, seq_len=32, fp32_matmul_precision=precision))


def bf16_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_bf16_products_are_reported_and_stay_close_to_float32(tiny_models, calib_file, tmp_path, method):
    ieee = run(tiny_models["llama"], tmp_path / "ieee", calib_file, method, "ieee")
    auto = run(tiny_models["llama"], tmp_path / "auto", calib_file, method, "auto")
    assert ieee.parameters["fp32_matmul"] == "ieee"
    assert auto.parameters["fp32_matmul"] == "ieee"  # the suite pins auto to ieee (conftest)
    assert json.loads((tmp_path / "ieee" / "quantize_report.json").read_text())["parameters"]["fp32_matmul"] == "ieee"
    if not bf16_available():
        pytest.skip("oneDNN has no bf16 path on this CPU (bf16 products untestable here)")
    bf16 = run(tiny_models["llama"], tmp_path / "bf16", calib_file, method, "bf16")
    assert bf16.parameters["fp32_matmul"] == "bf16"
    # the same sites, each with an output error close to float32's (bf16 inputs move it by ~1%)
    for a, b in zip(ieee.layers, bf16.layers):
        assert a["name"] == b["name"]
        assert b["relative_error"] == pytest.approx(a["relative_error"], rel=0.25, abs=1e-4)


def test_rtn_reports_no_matmul_precision(tiny_models, calib_file, tmp_path):
    assert run(tiny_models["llama"], tmp_path / "rtn", calib_file, "rtn", "bf16").parameters["fp32_matmul"] is None


def test_bad_fp32_matmul_precision_exits_2(tiny_models, calib_file, tmp_path):
    assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", str(tmp_path / "out"), "--calib", str(calib_file),
                        "--fp32-matmul-precision", "fast"], "fast")
    assert not (tmp_path / "out").exists()


def test_progress_lines_give_wall_and_cpu_time_per_layer(tiny_models, tmp_path):
    code, err, _ = run_cli("quantize", str(tiny_models["llama"]), "-o", str(tmp_path / "o"), "--method", "rtn",
                           "--group-size", "32", "--json")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "rtn: layer" in line]
    assert len(lines) == 3 and "layer 3/3" in lines[-1], err
    assert all(" s per layer (" in line and " CPU s), ETA " in line for line in lines), lines


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("num_samples", [4, 40])  # 128 tokens (the error sample is all of them) and 1,280 (a stride)
def test_layer_output_is_the_quantized_layers_output(tiny_models, calib_file, method, num_samples):
    """What quantize_decoder_layer hands the next layer is what the quantized layer computes: its
    int4 weights and, for AWQ, the scales folded into its norms and feeding rows (the hook scales
    its input in place, which must not reach anything but the linear it feeds)."""
    from llmopt.loader import load
    from llmopt.model.attention import EqualLengthAttention
    from llmopt.quant.calibration import load_calibration
    from llmopt.quant.layerwise import MethodOptions, quantize_decoder_layer

    loaded = load(str(tiny_models["llama"]), dtype="float32", int4_kernels=False)
    model, config = loaded.model, loaded.config
    ids = load_calibration(str(calib_file), loaded, num_samples, 32, 0).input_ids
    x = model.model.embed_tokens(ids.reshape(-1))
    cos, sin = model.model.rotary_emb(torch.arange(32).repeat(num_samples), x.dtype)
    attn = EqualLengthAttention(num_samples, 32)
    layer = model.model.layers[0]
    out, sites = quantize_decoder_layer(config, layer, 0, x.clone(), cos, sin, attn,
                                        MethodOptions(method=method, scheme=SCHEME))
    if method == "awq":
        assert any(site.details.get("scale_ratio", 0) > 0 for site in sites)  # some input was scaled
    with torch.inference_mode():
        plain = layer(x.clone(), cos, sin, attn)
    torch.testing.assert_close(out, plain, rtol=1e-3, atol=1e-3)  # folding moves float rounding only
