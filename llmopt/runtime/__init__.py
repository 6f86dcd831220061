"""The paged-KV runtime: `LLM` (offline batches), `AsyncLLM` (streaming), `LLMEngine`, `EngineConfig`,
`SamplingParams`, `StructuredOutputsParams`."""

from llmopt.runtime.config import EngineConfig
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.structured_outputs import StructuredOutputsParams
from llmopt.runtime.async_engine import AsyncLLM  # noqa: E402  (imports the engine, which needs SamplingParams)
from llmopt.runtime.engine import LLMEngine
from llmopt.runtime.llm import LLM

__all__ = ["AsyncLLM", "EngineConfig", "LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams"]
