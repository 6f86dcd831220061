"""Runs our decoder on a scheduled step: packs the flat batch, owns the paged KV memory.

The KV cache is one `[num_blocks * block_size, kv_heads, head_dim]` slot array per layer
for K and one for V, in the model's dtype or a narrower `kv_dtype` (`--kv-cache-dtype`).
Each step the runner turns the scheduler's (sequence, tokens) list into input ids,
positions, slot mappings and gather indices, built on the CPU and moved to the device in one
copy per dtype (`step_inputs.to_device`), and runs one forward. Block tables and context
lengths take the dtype the attention's kernels index with (`block_table_dtype`: int32 for
Triton's, int64 for the C++ CPU kernel's).
Sequences with a single new token (decodes) go first in the batch and share one batched
attention call; prompt chunks follow. Attention is the paged attention the model's kernel
backend hands out (`KernelBackend.paged_attention`, `llmopt.model.paged_attention`): the
Triton kernels read K/V through the block tables and take all prompt chunks of a step in one
call; the C++ CPU decode kernel and the PyTorch reference attend prompt chunks one sequence
at a time.
Pure-decode steps replay a CUDA graph per batch-size bucket where the runner was given
`GraphSettings` and its attention allows it (`cuda_graphs.py`); the pool then holds one scratch
block past `num_blocks` for the graphs' padding rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmopt.core.huge_pages import HUGE_PAGE, advised_region, huge_pages_enabled, move_into_huge_pages
from llmopt.model.linear import LinearBase
from llmopt.model.llama import LlamaForCausalLM
from llmopt.model.paged_attention import StepMetadata
from llmopt.runtime.cpu_decode_plan import build_decode_plan, run_decode_plan
from llmopt.runtime.cuda_graphs import GraphRunner, GraphSettings
from llmopt.runtime.prompt_scores import PromptScores, ScoredChunk, score_rows
from llmopt.runtime.sequence import Sequence
from llmopt.runtime.step_inputs import to_device


SCORE_ROWS = 256  # prompt positions per vocabulary projection when scoring a prompt ([256, vocab] fp32 logits)


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [sum(num_rows), vocab]
    samplers: list[Sequence]  # the sequences that sample a token this step, in logits' row order
    # logits rows per sampler: 1, or 1 + its draft tokens for a speculating request (one row per
    # position it verifies)
    num_rows: list[int] = field(default_factory=list)
    # (sequence, what this step scored of its prompt) for prompt_logprobs requests computing prompt positions
    prompt_logprobs: list[tuple[Sequence, ScoredChunk]] = field(default_factory=list)
    prompts_done: list[Sequence] = field(default_factory=list)  # max_tokens=0 requests whose prompt is scored


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. Attention reads (masked) slots nobody wrote yet: they must hold
    finite numbers, as 0 * NaN = NaN. On CPU the zeros are anonymous memory the OS zero-fills
    lazily, so a large pool costs nothing until its pages are used, and a pool of at least a huge
    page is advised into transparent huge pages (`llmopt.core.huge_pages`): decode attention reads
    rows scattered over the whole pool, and with 4 KiB pages nearly every block read missed the TLB
    (docs/benchmarks.md, "KV pool in huge pages"); first writes also fault 512 times less often."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if nbytes >= HUGE_PAGE and huge_pages_enabled():
        return torch.frombuffer(advised_region(nbytes), dtype=torch.uint8).view(dtype).view(shape)  # keeps it alive
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def move_streamed_weights(model: LlamaForCausalLM) -> int:
    """Put the weights a CPU decode step streams (each linear layer's `streamed_tensors`) into memory
    advised into huge pages (`llmopt.core.huge_pages`); returns the bytes moved. Before a decode plan is
    built: the plan keeps the weights' addresses for its prefetches."""
    streamed = [t for m in model.modules() if isinstance(m, LinearBase) for t in m.streamed_tensors() if t is not None]
    # aliases of those bytes held elsewhere (DenseLinear.onednn_weight can be the weight itself, detached)
    held = [t for m in model.modules() for t in (*vars(m).values(), *m._parameters.values(), *m._buffers.values())
            if isinstance(t, torch.Tensor)]
    return move_into_huge_pages(streamed, followers=held)


class ModelRunner:
    """`dtype`: the model's; `kv_dtype`: the KV pool's (default: the model's); `graphs`: capture
    decode steps into CUDA graphs (None: every step eager)."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None,
                 graphs: GraphSettings | None = None):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        kv_dtype = kv_dtype or dtype
        pool_blocks = num_blocks + (graphs is not None)  # the graphs' scratch block: block id num_blocks
        shape = (cfg.num_hidden_layers, pool_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.attn = model.backend.paged_attention(zeroed(shape, kv_dtype, device), zeroed(shape, kv_dtype, device),
                                                  query_dtype=dtype)
        self.table_dtype = self.attn.block_table_dtype  # of block tables and context lengths alike
        # decode steps on the CPU kernels: all layers in one C++ call (cpu_decode_plan.py), over weights in huge pages
        self.decode_plan = None
        if device.type == "cpu":
            move_streamed_weights(model)
        if self.attn.cpu_decode is not None:
            self.decode_plan = build_decode_plan(model, kv_dtype)
        self.graph_runner: GraphRunner | None = None
        if graphs is not None and (not graphs.capture or (device.type == "cuda" and self.attn.supports_cuda_graphs)):
            self.graph_runner = GraphRunner(model, self.attn, graphs, block_size, dtype, device,
                                            scratch_block=num_blocks)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _padded_block_tables(self, block_tables: list[list[int]], lens: torch.Tensor) -> torch.Tensor:
        """[batch, width] the blocks holding each sequence's first `len` tokens (on the CPU).

        Rows are padded with their own first block: padded keys are masked, but must still
        be finite numbers (0 * NaN = NaN), and that block is always written.
        """
        width = -(-int(lens.max()) // self.block_size)
        rows = []
        for table, n in zip(block_tables, lens.tolist()):
            used = table[: -(-n // self.block_size)]
            rows.append(used + [used[0]] * (width - len(used)))
        return torch.tensor(rows, dtype=self.table_dtype)

    def _prefill_tables(self, prefills: list[tuple[Sequence, int]]) -> dict[str, torch.Tensor]:
        """The step's prompt chunks as one varlen batch (on the CPU): block tables (padded with their
        first block), int32 chunk boundaries and cached lengths, under `StepMetadata`'s names."""
        ends = torch.tensor([s.num_computed_tokens + n for s, n in prefills])
        lens = [n for _, n in prefills]
        return {"prefill_block_tables": self._padded_block_tables([s.block_table for s, _ in prefills], ends),
                "prefill_cu_seqlens": torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                "prefill_context_lens": torch.tensor([s.num_computed_tokens for s, _ in prefills], dtype=torch.int32)}

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], score_prompts: bool = False,
                spec_token_ids: dict[str, list[int]] | None = None) -> RunnerOutput:
        """Run one step; return logits [n, vocab] for the sequences that now sample, and those sequences.

        A sequence samples when this step computes its last known token (a decode, or the
        final chunk of its prompt); earlier prompt chunks only fill the cache.
        `score_prompts` (some request in the step may want prompt logprobs): also score the
        prompt positions this step computes for such requests, and leave requests with
        max_tokens=0 out of sampling (their prompt is all they asked for).
        `spec_token_ids`: draft tokens per request id; such a request's n scheduled tokens are its
        last known token and n - 1 drafts, and all n rows are returned (each verifies the next).
        """
        spec_token_ids = spec_token_ids or {}
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n > 1]
        if (self.graph_runner is not None and decodes and not prefills
                and self.graph_runner.can_run(len(decodes), max(s.num_computed_tokens + 1 for s, _ in decodes))):
            return self._execute_graph(decodes, score_prompts)
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[list[int]] = []
        samplers: list[Sequence] = []

        for seq, _ in decodes:
            pos = seq.num_computed_tokens
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slot_mapping.extend(self._slots(seq, pos, pos + 1))
        host: dict[str, torch.Tensor] = {}  # this step's inputs, built on the CPU
        decode_lens = None
        if decodes:
            decode_lens = torch.tensor([s.num_computed_tokens + 1 for s, _ in decodes], dtype=self.table_dtype)
            host["decode_lens"] = decode_lens
            host["decode_block_tables"] = self._padded_block_tables([s.block_table for s, _ in decodes], decode_lens)
            for row, (seq, _) in enumerate(decodes):
                if seq.num_computed_tokens + 1 == seq.num_tokens:
                    sample_rows.append([row])
                    samplers.append(seq)

        starts = []
        for i, (seq, n) in enumerate(prefills):
            start, ctx = len(ids), seq.num_computed_tokens
            starts.append(start)
            drafts = spec_token_ids.get(seq.request_id)
            ids.extend((seq.token_ids[ctx:] + drafts)[:n] if drafts else seq.token_ids[ctx : ctx + n])
            positions.extend(range(ctx, ctx + n))
            slot_mapping.extend(self._slots(seq, ctx, ctx + n))
            if not self.attn.needs_prefill_tables:  # the key slots of the whole context, O(context): the
                # PyTorch path gathers through them; the Triton kernels read the block tables instead
                host[f"prefill_slots.{i}"] = torch.tensor(self._slots(seq, 0, ctx + n), dtype=torch.long)
            if drafts:
                sample_rows.append(list(range(start, start + n)))
                samplers.append(seq)
            elif ctx + n == seq.num_tokens:
                sample_rows.append([start + n - 1])
                samplers.append(seq)
        prompts_done: list[Sequence] = []
        if score_prompts:  # requests with max_tokens=0 leave sampling: their prompt is all they asked for
            prompts_done = [seq for seq in samplers if seq.params.max_tokens == 0]
            keep = [i for i, seq in enumerate(samplers) if seq.params.max_tokens > 0]
            sample_rows, samplers = [sample_rows[i] for i in keep], [samplers[i] for i in keep]
        flat_rows = [r for rows in sample_rows for r in rows]

        host["slot_mapping"] = torch.tensor(slot_mapping, dtype=torch.long)
        host["input_ids"] = torch.tensor(ids, dtype=torch.long)
        host["positions"] = torch.tensor(positions, dtype=torch.long)
        if flat_rows:
            host["sample_rows"] = torch.tensor(flat_rows, dtype=torch.long)
        if prefills and self.attn.needs_prefill_tables:
            host.update(self._prefill_tables(prefills))
        dev = to_device(host, self.device)
        prefill_meta = [(start, start + n, dev.get(f"prefill_slots.{i}"), seq.num_computed_tokens)
                        for i, ((seq, n), start) in enumerate(zip(prefills, starts))]
        self.attn.metadata = StepMetadata(
            slot_mapping=dev["slot_mapping"],
            num_decodes=len(decodes),
            decode_block_tables=dev.get("decode_block_tables"),
            decode_lens=dev.get("decode_lens"),
            block_size=self.block_size,
            dtype=self.dtype,
            prefills=prefill_meta,
            prefill_block_tables=dev.get("prefill_block_tables"),
            prefill_cu_seqlens=dev.get("prefill_cu_seqlens"),
            prefill_context_lens=dev.get("prefill_context_lens"),
            max_prefill_len=max((n for _, n in prefills), default=0),
        )
        input_ids, positions_t = dev["input_ids"], dev["positions"]
        hidden = None
        if self.decode_plan is not None and not prefills:
            md = self.attn.metadata
            hidden = run_decode_plan(self.decode_plan, self.model, input_ids, positions_t, self.attn.k_caches,
                                     self.attn.v_caches, md.slot_mapping, md.decode_block_tables, md.decode_lens,
                                     self.block_size)
        selected = False  # whether `hidden` holds the sampled rows only
        if hidden is None:
            # a step whose other rows score nothing (no prompt logprobs) runs the last MLP on the sampled rows only
            selected = bool(flat_rows) and not score_prompts and len(flat_rows) < len(input_ids)
            hidden = self.model(input_ids, positions_t, self.attn, output_rows=dev["sample_rows"] if selected else None)
        self.attn.metadata = None
        prompt_scores: list[tuple[Sequence, ScoredChunk]] = []
        if score_prompts:
            for (seq, n), start in zip(decodes + prefills, list(range(len(decodes))) + starts):
                if seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                    prompt_scores.append((seq, self._score_prompt(hidden, seq, start, n)))
        if flat_rows:
            logits = self.model.compute_logits(hidden if selected else hidden[dev["sample_rows"]])
        else:
            logits = torch.empty(0, self.model.config.vocab_size)
        return RunnerOutput(logits, samplers, [len(rows) for rows in sample_rows], prompt_scores, prompts_done)

    def _execute_graph(self, decodes: list[tuple[Sequence, int]], score_prompts: bool) -> RunnerOutput:
        """A pure-decode step through the graph runner's bucket (the same outputs as `execute`'s)."""
        bs = self.block_size
        positions = [s.num_computed_tokens for s, _ in decodes]
        hidden = self.graph_runner.run(
            ids=[s.token_ids[p] for (s, _), p in zip(decodes, positions)], positions=positions,
            slots=[self._slots(s, p, p + 1)[0] for (s, _), p in zip(decodes, positions)],
            lens=[p + 1 for p in positions],
            tables=[s.block_table[: p // bs + 1] for (s, _), p in zip(decodes, positions)])
        samplers = [s for (s, _), p in zip(decodes, positions) if p + 1 == s.num_tokens]
        rows = [i for i, ((s, _), p) in enumerate(zip(decodes, positions)) if p + 1 == s.num_tokens]
        prompts_done: list[Sequence] = []
        prompt_scores: list[tuple[Sequence, ScoredChunk]] = []
        if score_prompts:
            prompts_done = [s for s in samplers if s.params.max_tokens == 0]
            rows = [r for r, s in zip(rows, samplers) if s.params.max_tokens > 0]
            samplers = [s for s in samplers if s.params.max_tokens > 0]
            for i, (seq, n) in enumerate(decodes):
                if seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                    prompt_scores.append((seq, self._score_prompt(hidden, seq, i, n)))
        if len(rows) == len(decodes):  # every row samples (the usual decode step): no index to send
            logits = self.model.compute_logits(hidden)
        elif rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        else:
            logits = torch.empty(0, self.model.config.vocab_size)
        return RunnerOutput(logits, samplers, [1] * len(samplers), prompt_scores, prompts_done)

    def _score_prompt(self, hidden: torch.Tensor, seq: Sequence, start: int, n: int) -> ScoredChunk:
        """The prompt positions this step's rows start..start+n-1 predict and `seq` has not scored yet,
        and the final hidden state at each block end inside the prompt that these rows hold.

        Row start+i holds position ctx+i and predicts position ctx+i+1. After a prefix hit the first
        position to score (ctx) is predicted by a cached position: its row is the hit block's stored
        hidden state. The vocabulary projection runs in slices of SCORE_ROWS rows so a long chunk
        never holds [chunk, vocab] logits at once.
        """
        ctx, bs = seq.num_computed_tokens, self.block_size
        end = min(ctx + n, seq.num_prompt_tokens)  # the prompt positions computed now: ctx..end-1
        ends = list(range(ctx + bs - 1 - ctx % bs, end, bs))  # last positions of blocks, for the prefix cache
        end_rows = hidden[[start + p - ctx for p in ends]].to("cpu") if ends else None  # one copy off a GPU
        block_hiddens = {p // bs: end_rows[i] for i, p in enumerate(ends)}
        first = len(seq.prompt_logprobs)
        last = min(ctx + n, seq.num_prompt_tokens - 1)  # the position after the prompt is sampled, not scored
        if first > last:
            return ScoredChunk(first, None, block_hiddens)
        assert first >= ctx, f"position {first} of {seq.request_id} was skipped"
        rows = hidden[start + max(first - 1 - ctx, 0) : start + last - ctx]
        if first == ctx:  # ctx > 0 here: position 0 is never scored
            prev = seq.score_buffer.prev_hidden if seq.score_buffer is not None else None
            assert prev is not None, f"{seq.request_id}: a prefix hit without the hidden state that scores past it"
            rows = torch.cat([prev.to(device=rows.device, dtype=rows.dtype)[None], rows])
        targets = torch.tensor(seq.token_ids[first : last + 1], device=self.device)
        top_n = seq.params.prompt_logprobs
        parts = [score_rows(self.model.compute_logits(rows[i : i + SCORE_ROWS]), targets[i : i + SCORE_ROWS], top_n)
                 for i in range(0, rows.shape[0], SCORE_ROWS)]
        return ScoredChunk(first, PromptScores.cat(parts), block_hiddens)
