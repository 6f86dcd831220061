"""Scoring a token stream with sliding windows: the shared core of perplexity and KLD.

A stream of N tokens is covered by windows of `context` tokens that start every
`stride` tokens (Hugging Face's perplexity recipe): each window scores only the targets
the previous windows have not scored, so every token from the second on is predicted
exactly once, with up to `context - stride` tokens of history. Windows of equal length
run as one batch through our decoder (`EqualLengthAttention`), with the vocabulary
projection applied only to the rows that are scored.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from llmopt.errors import LlmoptError
from llmopt.model.attention import EqualLengthAttention


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window
    end: int  # one past the last token
    first_target: int  # first token whose prediction this window scores (targets first_target..end-1)


def plan_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    if context < 2:
        raise LlmoptError(f"context must be at least 2 tokens, got {context}")
    if not 0 < stride <= context:
        raise LlmoptError(f"stride must be in 1..context ({context}), got {stride}")
    if num_tokens < 2:
        raise LlmoptError(f"need at least 2 tokens of text to score, got {num_tokens}")
    windows, scored_until = [], 1  # token 0 has no prediction
    start = 0
    while scored_until < num_tokens:
        end = min(start + context, num_tokens)
        windows.append(Window(start=start, end=end, first_target=max(scored_until, start + 1)))
        scored_until = end
        start += stride
    return windows


def num_scored(windows: list[Window]) -> int:
    return sum(w.end - w.first_target for w in windows)


@torch.inference_mode()
def window_logits(model, ids: torch.Tensor, windows: list[Window], batch_size: int = 8
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For each batch of windows: (targets [T], float32 logits [T, vocab] predicting them), in stream order."""
    i = 0
    while i < len(windows):
        length = windows[i].end - windows[i].start
        batch = [windows[i]]
        while (i + len(batch) < len(windows) and len(batch) < batch_size
               and windows[i + len(batch)].end - windows[i + len(batch)].start == length):
            batch.append(windows[i + len(batch)])
        i += len(batch)
        tokens = torch.stack([ids[w.start:w.end] for w in batch])
        positions = torch.arange(length, device=ids.device).repeat(len(batch))
        hidden = model(tokens.reshape(-1), positions, EqualLengthAttention(len(batch), length))
        rows = torch.cat([torch.arange(w.first_target - 1 - w.start, length - 1, device=ids.device) + b * length
                          for b, w in enumerate(batch)])
        targets = torch.cat([ids[w.first_target:w.end] for w in batch])
        yield targets, model.compute_logits(hidden[rows]).float()
