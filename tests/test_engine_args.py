"""The engine flags, declared once (llmopt/cli/engine_args.py), mean the same in every command, and
`LLM`, `AsyncLLM` and `LLMEngine` are built from one `EngineConfig`."""

from __future__ import annotations

import pytest

from conftest import assert_usage_error
from llmopt.runtime.engine_args import EngineArgs
from llmopt.loader import load
from llmopt.runtime import LLM, AsyncLLM, EngineConfig, LLMEngine

FLAGS = ["--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--block-size", "--enable-prefix-caching",
         "--kv-cache-memory", "--kv-cache-dtype", "--gpu-memory-utilization", "--dtype", "--device",
         "--fp32-matmul-precision"]
# bench latency sets max_num_seqs from --batch-size and runs without prefix caching or a length limit
LATENCY_FLAGS = [f for f in FLAGS if f not in ("--max-num-seqs", "--max-model-len", "--enable-prefix-caching")]
COMMANDS = [(["generate"], FLAGS), (["serve"], FLAGS), (["eval"], FLAGS), (["bench", "throughput"], FLAGS),
            (["bench", "latency"], LATENCY_FLAGS)]


@pytest.mark.parametrize("command, flags", COMMANDS, ids=[" ".join(c) for c, _ in COMMANDS])
def test_every_engine_command_has_the_flags(command, flags):
    import typer

    from llmopt.cli.main import app

    click_command = typer.main.get_command(app)
    for name in command:
        click_command = click_command.commands[name]  # type: ignore[attr-defined]
    options = {opt: param for param in click_command.params for opt in param.opts}
    assert all(flag in options for flag in flags), [f for f in flags if f not in options]
    assert all(options[flag].rich_help_panel == "Engine" for flag in flags)  # their own --help panel


@pytest.mark.parametrize("command", [["generate", "M", "-p", "hi"], ["serve", "M"], ["eval", "M"],
                                     ["bench", "throughput", "M"], ["bench", "latency", "M"]])
def test_a_bad_engine_flag_is_the_same_error_everywhere(tiny_models, command):
    args = [str(tiny_models["llama"]) if a == "M" else a for a in command]
    assert_usage_error([*args, "--kv-cache-memory", "lots"], "cannot read 'lots' as a size")
    assert_usage_error([*args, "--block-size", "0"], "block_size must be a positive integer")
    assert_usage_error([*args, "--fp32-matmul-precision", "tf32"], "unknown fp32_matmul_precision 'tf32'")


def test_engine_args_build_the_engine_config():
    config = EngineArgs(max_num_seqs=4, kv_cache_memory="64MiB", enable_prefix_caching=False).engine_config()
    assert config == EngineConfig(max_num_seqs=4, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    assert EngineArgs().engine_config() == EngineConfig()  # the flags' defaults are the runtime's


def test_llm_async_llm_and_engine_take_one_engine_config(tiny_models):
    loaded = load(str(tiny_models["llama"]), dtype="float32")
    config = EngineConfig(num_kv_blocks=12, block_size=8, max_model_len=64, max_num_seqs=3)
    llm = LLM(loaded, engine_config=config)
    assert llm.engine.config == config and llm.engine.kv.num_blocks == 12 and llm.engine.max_model_len == 64
    assert LLM(loaded, engine_config=config, max_num_seqs=5).engine.config.max_num_seqs == 5  # keywords override
    assert LLM(loaded, num_kv_blocks=12).engine.config.num_kv_blocks == 12  # keywords alone, as before
    assert LLMEngine.from_spec(str(tiny_models["llama"]), dtype="float32", engine_config=config).config == config
    engine = AsyncLLM.from_spec(loaded, engine_config=config)
    try:
        assert engine.engine.config == config
    finally:
        engine.shutdown()


def test_an_engine_option_declared_once_reaches_every_command_recipe_and_the_runtime():
    """Each `engine_option` field of EngineConfig is a flag of every engine command, a key of every recipe
    section that runs the engine, and reaches the runtime through EngineArgs: a new one needs no other edit."""
    import typing

    import typer

    from llmopt.cli.main import app
    from llmopt.options import declared
    from llmopt.recipes import schema

    options = declared(EngineConfig)
    assert {d.name for d in options} >= {"max_num_seqs", "block_size", "kv_cache_dtype", "gpu_memory_utilization"}
    for command, _ in COMMANDS:
        click_command = typer.main.get_command(app)
        for name in command:
            click_command = click_command.commands[name]  # type: ignore[attr-defined]
        flags = {opt for param in click_command.params for opt in [*param.opts, *param.secondary_opts]}
        expected = [d for d in options if command != ["bench", "latency"]
                    or d.name not in ("max_num_seqs", "max_model_len", "enable_prefix_caching")]
        assert all(set(d.cli_names[0].split("/")) <= flags for d in expected), command
    for section in (schema.EvalSection, schema.ThroughputPlan, schema.ServeSection):
        assert {d.name for d in options} <= set(section.model_fields), section.__name__
    changed = {}
    for d in options:
        kind = typing.get_args(d.type)[0] if typing.get_origin(d.type) is typing.Union else d.type
        if kind is bool:
            changed[d.name] = not d.default
        elif kind is int:
            changed[d.name] = (d.default or 16) + 1
        elif kind is float:
            changed[d.name] = d.default / 2
    config = EngineArgs(**changed).engine_config()
    assert {name: getattr(config, name) for name in changed} == changed
