"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, block tables, prefix cache.

The cache memory itself lives in the model runner as `[num_blocks * block_size]` slots per
layer; this module decides which block holds which tokens. A sequence's block table maps
its i-th `block_size` tokens to a block. With prefix caching, every full block is named
by a chained hash of (parent hash, its token ids) — sha256, so a hit never depends on
luck — and blocks are reference-counted so sequences with a common prefix share them.
Freed blocks keep their hash and stay reusable, in LRU order, until they are needed for
new tokens (vLLM's design).

A block computed for a request that asked for prompt logprobs also keeps its positions' scores
(`prompt_scores.BlockScores`: the token's logprob and the top k, and the hidden state at its last
position), so a later scoring request can take it as a hit and still answer every position. A
scoring request hits only blocks that hold scores with at least its k; one asking for more
computes them, and the larger k replaces the stored one. The scores go with the block's hash
when it is evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from llmopt.runtime.prompt_scores import BlockScores, ScoreBuffer
from llmopt.runtime.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # the prompt scores of its positions, when a scoring request computed them (prefix caching only)
    scores: BlockScores | None = None

    def has_scores(self, top_n: int) -> bool:
        return self.scores is not None and self.scores.k >= top_n


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.sha256(parent or b"root")
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks: those that cache nothing first (freed ones at the front, their memory warm), then
        # cached blocks least recently freed first; popping from the front evicts LRU
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        # prefix-cache statistics, in tokens (as vLLM counts them)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.peak_used_blocks = 0

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------
    def _hash_full_blocks(self, seq: Sequence) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Leading blocks of `seq` whose K/V are already cached (a new or preempted request); for a
        request that still needs prompt logprobs, only blocks that also hold its positions' scores."""
        if not self.enable_prefix_caching:
            return []
        self._hash_full_blocks(seq)
        top_n = seq.params.prompt_logprobs if seq.needs_prompt_scores else None
        hits: list[int] = []
        for block_hash in seq.block_hashes[: self.max_hit_blocks(seq)]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None or (top_n is not None and not self.blocks[block_id].has_scores(top_n)):
                break
            hits.append(block_id)
        return hits

    def max_hit_blocks(self, seq: Sequence) -> int:
        # the last token is always recomputed: its logits are needed to sample
        return (seq.num_tokens - 1) // self.block_size

    def load_prompt_scores(self, seq: Sequence, computed_blocks: list[int]) -> None:
        """A request that needs prompt logprobs, admitted with `computed_blocks` hits: their stored
        scores answer its cached positions, and it starts keeping the scores it computes."""
        if not self.enable_prefix_caching or not seq.needs_prompt_scores:
            return
        bs, top_n = self.block_size, seq.params.prompt_logprobs
        for i, block_id in enumerate(computed_blocks):
            stored = self.blocks[block_id].scores
            first = max(1, i * bs)  # the position of stored.scores' first row
            lo = max(first, len(seq.prompt_logprobs))  # positions a preempted request scored already stay
            if lo < (i + 1) * bs:
                rows = stored.scores.slice(lo - first, (i + 1) * bs - first)
                seq.prompt_logprobs.extend(rows.to_dicts(seq.token_ids[lo : (i + 1) * bs], top_n))
        prev = self.blocks[computed_blocks[-1]].scores.last_hidden if computed_blocks else None
        seq.score_buffer = ScoreBuffer(start=len(seq.prompt_logprobs), prev_hidden=prev)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup whose request was admitted (a refused one is looked up again later)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # ---- allocation -------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones; False if the pool is short.

        `computed_blocks` (from get_computed_blocks) are prefix-cache hits to put at the
        start of a sequence that holds no blocks yet.
        """
        computed_blocks = computed_blocks or []
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(computed_blocks)
        # a cached hit sitting in the free queue is taken out of it, so it is not free for new tokens
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        if num_required > self.num_free_blocks - num_revived:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1
            seq.block_table.append(block_id)
        if computed_blocks:  # hits are registered already; later blocks once they fill
            seq.num_cached_blocks = len(seq.block_table)
        for _ in range(max(num_required, 0)):
            seq.block_table.append(self._pop_free_block())
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return True

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.scores = None
        block.ref_cnt = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_cached_blocks:
            return
        self._hash_full_blocks(seq)
        buffer = seq.score_buffer
        for i in range(seq.num_cached_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            # the same content computed twice (two requests in one step): keep the first copy
            if block.block_hash is None and block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block.block_id
            if buffer is not None:
                # the registered copy (this block or the first) takes the scores, unless it holds as many
                cached = self.blocks[self.cached_blocks[block_hash]]
                if cached.scores is None or cached.scores.k < seq.params.prompt_logprobs:
                    cached.scores = buffer.block(i, self.block_size) or cached.scores
        seq.num_cached_blocks = num_full
        if buffer is not None:
            buffer.drop_before_block(num_full, self.block_size)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks of `seq` past those that hold its first `num_tokens` tokens (slots reserved
        for draft tokens that were not proposed or not accepted). They hold no registered block, so
        they go to the front of the free queue: nothing is lost by reusing them first."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                self.free_queue.move_to_end(block_id, last=False)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (finished, aborted or preempted)."""
        # tail blocks first, so they are evicted before the shared prefix blocks
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    # nothing cached to keep: reused first, before blocks whose memory was never written
                    # (each new page of a CPU pool is a page fault and a zero-fill on first touch)
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.score_buffer = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                block.block_hash = None
                block.scores = None
        self.cached_blocks = {h: b for h, b in self.cached_blocks.items() if self.blocks[b].ref_cnt > 0}
