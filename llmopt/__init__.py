"""llmopt: quantize -> eval -> bench -> serve for self-hosted LLMs."""

__version__ = "0.1.0"
