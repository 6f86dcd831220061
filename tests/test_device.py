"""`--device auto` everywhere, resolved in one place (`llmopt.core.device.resolve_device`): CUDA where
torch sees a GPU, else the CPU; `cuda:N` made the current device; the dtype that suits the device;
CUDA without Triton said out loud. The CUDA cases run on any machine: torch.cuda's answers are
stubbed (nothing here touches a GPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import assert_usage_error
from llmopt.core.device import parse_device, resolve_device
from llmopt.errors import LlmoptError
from llmopt.loader import resolve_dtype

# every command that takes --device
DEVICE_COMMANDS = [["generate"], ["serve"], ["eval"], ["bench", "throughput"], ["bench", "latency"],
                   ["bench", "kernels"], ["quantize"]]


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda reporting `n` GPUs (set `fake_gpus.count`); `fake_gpus.current` records set_device."""

    class Fake:
        count = 2
        current: list[int] = []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: Fake.count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: Fake.count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: Fake.current.append(index))
    return Fake


@pytest.mark.parametrize("command", DEVICE_COMMANDS, ids=" ".join)
def test_every_command_defaults_to_device_auto(command):
    import typer

    from llmopt.cli.main import app

    click_command = typer.main.get_command(app)
    for name in command:
        click_command = click_command.commands[name]  # type: ignore[attr-defined]
    [param] = [p for p in click_command.params if "--device" in p.opts]
    assert param.default == "auto"
    assert "auto" in (param.help or "")


def test_the_python_api_defaults_to_auto_too():
    import inspect

    from llmopt.eval.tasks import RunOptions
    from llmopt.bench.engines import EngineOptions
    from llmopt.loader import load
    from llmopt.quant.quantize import QuantizeRequest
    from llmopt.runtime import LLM, AsyncLLM, LLMEngine
    from llmopt.runtime.engine_args import EngineArgs

    assert EngineArgs().device == "auto" and RunOptions().device == "auto" and EngineOptions().device == "auto"
    assert QuantizeRequest.__dataclass_fields__["device"].default == "auto"
    for fn in (load, LLM.__init__, LLMEngine.from_spec, AsyncLLM.from_spec):
        assert inspect.signature(fn).parameters["device"].default == "auto", fn


def test_auto_is_the_cpu_without_a_gpu_and_the_first_gpu_with_one(fake_gpus):
    fake_gpus.count = 0
    assert resolve_device("auto") == torch.device("cpu") and resolve_device() == torch.device("cpu")
    assert resolve_dtype("auto", resolve_device("auto")) == torch.float32  # fp32 on CPU, as before
    fake_gpus.count = 2
    assert resolve_device("auto") == torch.device("cuda", 0) and fake_gpus.current == [0]
    assert resolve_dtype("auto", resolve_device("auto")) == torch.bfloat16  # the GPU's dtype
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device("CPU") == torch.device("cpu")


def test_cuda_n_becomes_the_current_device(fake_gpus):
    fake_gpus.current = []
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert fake_gpus.current == [1]  # Triton launches on the current device: GPU 1, not GPU 0
    assert resolve_device("cuda:1", make_current=False) == torch.device("cuda", 1) and fake_gpus.current == [1]
    assert resolve_device("cuda") == torch.device("cuda", 0) and fake_gpus.current == [1, 0]
    with pytest.raises(LlmoptError, match=r"has 2 CUDA GPU\(s\)"):
        resolve_device("cuda:2")


def test_bad_devices_are_one_clear_error(fake_gpus):
    fake_gpus.count = 0
    with pytest.raises(LlmoptError, match="CUDA is not available"):
        resolve_device("cuda")
    for bad in ("tpu", "gpu", "mps", "cuda:x"):
        with pytest.raises(LlmoptError, match="unknown --device"):
            resolve_device(bad)


def test_a_plan_names_a_gpu_this_machine_lacks(monkeypatch):
    """parse_device checks the name only (a recipe for a GPU validates on a laptop); resolve_device
    refuses the absent GPU when something runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_device("cuda:1") == torch.device("cuda", 1) and parse_device("auto") == torch.device("cpu")
    with pytest.raises(LlmoptError, match="unknown --device"):
        parse_device("tpu")
    with pytest.raises(LlmoptError, match="CUDA is not available"):
        resolve_device("cuda:1")


def test_bad_device_on_the_command_line_exits_2(tiny_models):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    model = str(tiny_models["llama"])
    assert_usage_error(["generate", model, "-p", "hi", "--device", "cuda"], "CUDA is not available")
    assert_usage_error(["generate", model, "-p", "hi", "--device", "tpu"], "unknown --device 'tpu'")


def test_loading_with_the_defaults_lands_on_the_cpu_here(tiny_models):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto is the GPU")
    from llmopt.loader import load

    loaded = load(str(tiny_models["llama"]))
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32


def test_cuda_without_triton_is_said_not_silent(monkeypatch, caplog):
    from llmopt.model.backends import select

    monkeypatch.delenv("LLMOPT_KERNELS", raising=False)
    monkeypatch.setattr(select, "triton_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="llmopt"):
        backend = select.select_backend(torch.device("cuda", 0), torch.bfloat16)
    assert backend.name == "reference"
    [record] = [r for r in caplog.records if "without Triton" in r.getMessage()]
    assert record.levelno == logging.WARNING and "pip install triton" in record.getMessage()
    caplog.clear()
    monkeypatch.setenv("LLMOPT_KERNELS", "reference")  # chosen on purpose: no warning
    with caplog.at_level(logging.WARNING, logger="llmopt"):
        assert select.select_backend(torch.device("cuda", 0), torch.bfloat16).name == "reference"
    assert not caplog.records
    monkeypatch.setenv("LLMOPT_KERNELS", "triton")
    with pytest.raises(ValueError, match="Triton is not installed"):
        select.select_backend(torch.device("cuda", 0), torch.bfloat16)
