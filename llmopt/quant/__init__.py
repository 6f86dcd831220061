"""`llmopt quantize`: RTN, AWQ and GPTQ (int4, layer by layer) and GGUF export."""
