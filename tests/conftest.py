"""Shared fixtures: an offline environment, a session cache, tiny random-weight models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Tests never touch the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without CUDA the Triton kernels run in Triton's interpreter. `@triton.jit` reads the variable
# when a kernel module is imported, so it is set here, before any test module imports one.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


@pytest.fixture(scope="session", autouse=True)
def llmopt_cache(tmp_path_factory) -> Path:
    """One cache for the whole run (the default model is converted at most once).

    CI may point LLMOPT_CACHE somewhere persistent; otherwise a fresh temp folder.
    """
    if not os.environ.get("LLMOPT_CACHE"):
        os.environ["LLMOPT_CACHE"] = str(tmp_path_factory.mktemp("llmopt-cache"))
    return Path(os.environ["LLMOPT_CACHE"])


@pytest.fixture(scope="session", autouse=True)
def fp32_matmul_auto_is_ieee():
    """The suite compares fp32 runs with float32 references (transformers, one-at-a-time runs) on every
    machine: in-process, `--fp32-matmul-precision auto` resolves to ieee here, as on a CPU without
    native bf16. The bf16 path is tested by asking for "bf16" (tests/test_cpu_linear.py)."""
    from llmopt.kernels import cpu_linear

    native = cpu_linear.native_bf16
    cpu_linear.native_bf16 = lambda: False
    yield native  # the real one, for the tests of it
    cpu_linear.native_bf16 = native


def make_byte_tokenizer():
    """A tiny byte-level BPE tokenizer: 256 byte tokens, a few merges, chat specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    return backend


CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False),
    "llama-tied-rope-llama3": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "llama-linear-rope": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
}


def write_tiny_model(folder: Path, kind: str, seed: int = 0, vocab_size: int | None = None) -> Path:
    """Save a tiny random-weight transformers model of `kind` (see TINY_CONFIGS) with a tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmopt.core.tokenizer import Tokenizer

    backend = make_byte_tokenizer()
    extra = dict(TINY_CONFIGS[kind])
    model_type = extra.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size or backend.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=backend.token_to_id("<|im_end|>"),
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits differ meaningfully
        for p in model.parameters():
            p.normal_(0, 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    Tokenizer(backend=backend, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>").save(folder)
    return folder


def write_tiny_int4_checkpoints(root: Path, specs: dict[str, tuple[Path, dict]]) -> dict[str, Path]:
    """Quantize tiny models into `root`/NAME for each NAME: (model folder, QuantizeRequest options), on a
    short calibration text (4 x 32 tokens, group 32 unless the options say otherwise)."""
    from llmopt.quant.quantize import QuantizeRequest, quantize

    calib = root / "calib.txt"
    calib.write_text("Rivers run to the sea, and the sea does not fill; the wind goes round and round again. " * 20,
                     encoding="utf-8")
    outs = {}
    for name, (model, options) in specs.items():
        outs[name] = root / name
        quantize(QuantizeRequest(model=str(model), output=outs[name], calib=str(calib), num_samples=4, seq_len=32,
                                 seed=0, **{"group_size": 32, **options}))
    return outs


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: write_tiny_model(root / kind, kind) for kind in TINY_CONFIGS}


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def run_cli(*args: str):
    """The llmopt CLI in-process: (exit code, stderr, stdout)."""
    from typer.testing import CliRunner

    from llmopt.cli.main import app

    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stderr, result.stdout


def assert_usage_error(args, *fragments):
    """Bad input: exit code 2 and exactly one 'error: ...' line naming each fragment; no traceback."""
    code, err, out = run_cli(*args)
    assert code == 2, (code, err, out)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err + out
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture(scope="session")
def os_sandbox() -> None:
    """HumanEval's OS sandbox (bubblewrap + user namespaces): skipped with the reason where this machine cannot
    make it; failed instead where LLMOPT_REQUIRE_SANDBOX=1 (.ci/run, after scripts/setup.sh installed bwrap)."""
    from llmopt.eval.sandbox.bwrap import unavailable

    reason = unavailable()
    if reason is not None:
        if os.environ.get("LLMOPT_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"LLMOPT_REQUIRE_SANDBOX=1 but the sandbox cannot run here: {reason}")
        pytest.skip(f"the OS sandbox cannot run here: {reason}")
