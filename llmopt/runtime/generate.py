"""A single-sequence generation loop over a contiguous KV cache.

This is the simple path `llmopt generate` uses until the paged runtime lands: prefill
the prompt in one forward, then decode one token per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmopt.core.loader import LoadedModel
from llmopt.errors import LlmoptError
from llmopt.model.attention import ContiguousKVCache
from llmopt.runtime.sampler import make_generator, sample
from llmopt.runtime.sampling_params import SamplingParams


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    time_to_first_token_s: float
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


def generate(loaded: LoadedModel, prompt_token_ids: list[int], params: SamplingParams) -> GenerationResult:
    if not prompt_token_ids:
        raise LlmoptError("the prompt is empty")
    max_len = loaded.config.max_position_embeddings
    if len(prompt_token_ids) >= max_len:
        raise LlmoptError(f"the prompt has {len(prompt_token_ids)} tokens; the model's context is {max_len}")
    max_tokens = min(params.max_tokens, max_len - len(prompt_token_ids))
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(loaded.tokenizer.eos_token_ids))
    cfg, device = loaded.config, loaded.device
    cache = ContiguousKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                              len(prompt_token_ids) + max_tokens, dtype=loaded.dtype, device=device)
    generator = make_generator(params)
    start = time.perf_counter()
    first_token_at = start
    output: list[int] = []
    finish_reason = "length"
    input_ids = torch.tensor(prompt_token_ids, device=device)
    positions = torch.arange(len(prompt_token_ids), device=device)
    while len(output) < max_tokens:
        cache.begin_step([0], [len(input_ids)])
        hidden = loaded.model(input_ids, positions, cache)
        cache.end_step()
        logits = loaded.model.compute_logits(hidden[-1:])
        token = sample(logits, [params], [generator])[0]
        if not output:
            first_token_at = time.perf_counter()
        output.append(token)
        if token in stop_ids:
            finish_reason = "stop"
            break
        input_ids = torch.tensor([token], device=device)
        positions = torch.tensor([cache.cached_lens[0]], device=device)
    elapsed = time.perf_counter() - start
    return GenerationResult(
        prompt_token_ids=list(prompt_token_ids),
        token_ids=output,
        text=loaded.tokenizer.decode(output),
        finish_reason=finish_reason,
        time_to_first_token_s=first_token_at - start,
        elapsed_s=elapsed,
    )
