"""Scoring a token stream the way llama.cpp's `llama-perplexity` does: the shared core of ppl and KLD.

The stream is cut into non-overlapping chunks of `ctx_size` tokens (`--ctx-size`, 512 by
default as in llama.cpp); a tail shorter than one chunk is dropped. Each chunk runs from
an empty cache; where the tokenizer adds a BOS token, the chunk's first token is replaced
by BOS for the forward (llama.cpp's `add_bos`). Only the second half of each chunk is
scored, so every scored token has at least ctx_size/2 tokens of context: positions
ctx_size/2 .. ctx_size-2 predict tokens ctx_size/2+1 .. ctx_size-1, which is
ctx_size - 1 - ctx_size/2 scored tokens per chunk (255 at 512), as in
`perplexity.cpp`'s `kl_divergence` and `perplexity` functions.

Chunks are equally long, so they run as one batch through our decoder
(`EqualLengthAttention`); only the scored rows' hidden states are kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from llmopt.errors import LlmoptError
from llmopt.model.attention import EqualLengthAttention


@dataclass(frozen=True)
class Chunks:
    ctx_size: int
    count: int

    @property
    def first(self) -> int:
        """The first scored position of a chunk (its logits predict token first + 1)."""
        return self.ctx_size // 2

    @property
    def scored_per_chunk(self) -> int:
        return self.ctx_size - 1 - self.first

    @property
    def num_scored(self) -> int:
        return self.count * self.scored_per_chunk

    @property
    def num_tokens(self) -> int:
        return self.count * self.ctx_size


def plan_chunks(num_tokens: int, ctx_size: int, max_chunks: int | None = None) -> Chunks:
    """As many whole chunks as the stream holds, at most `max_chunks`."""
    if ctx_size < 4:
        raise LlmoptError(f"--ctx-size must be at least 4 tokens, got {ctx_size}")
    count = num_tokens // ctx_size
    if max_chunks is not None:
        count = min(count, max_chunks)
    if count < 1:
        raise LlmoptError(f"the text has {num_tokens} tokens, less than one chunk of --ctx-size {ctx_size}; "
                          "give a longer --text or a smaller --ctx-size")
    return Chunks(ctx_size, count)


def chunk_prompt(ids: torch.Tensor, chunks: Chunks, index: int, bos_id: int | None = None) -> list[int]:
    """Chunk `index` as the token ids a model is given (BOS in place of the first where the tokenizer adds one);
    its scored targets are `ids` at chunk positions `chunks.first + 1` onwards."""
    tokens = ids[index * chunks.ctx_size:(index + 1) * chunks.ctx_size].tolist()
    if bos_id is not None:
        tokens[0] = bos_id
    return tokens


@torch.inference_mode()
def chunk_hidden(model, ids: torch.Tensor, chunks: Chunks, bos_id: int | None = None, batch_size: int = 4
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch of chunks: (targets [T], final hidden states [T, hidden] predicting them), in stream order;
    `model.compute_logits` turns the states into logits."""
    n, first = chunks.ctx_size, chunks.first
    for c0 in range(0, chunks.count, batch_size):
        b = min(batch_size, chunks.count - c0)
        tokens = ids[c0 * n:(c0 + b) * n].reshape(b, n).clone()
        targets = tokens[:, first + 1:].reshape(-1).clone()  # the real tokens, before BOS replaces the first
        if bos_id is not None:
            tokens[:, 0] = bos_id
        positions = torch.arange(n, device=ids.device).repeat(b)
        rows = (torch.arange(first, n - 1, device=ids.device) + n * torch.arange(b, device=ids.device)[:, None]).reshape(-1)
        yield targets, model(tokens.reshape(-1), positions, EqualLengthAttention(b, n), output_rows=rows)
