"""Pure-decode steps replayed from CUDA graphs, one per batch-size bucket (vLLM's CUDAGraphRunner).

At start-up the runner captures the decoder's forward once per bucket (`capture_batch_sizes`:
1, 2, 4, then multiples of 8 up to `max_num_seqs`, largest first, all in one memory pool) on
persistent device inputs: token ids, positions, slot mapping, block tables
`[max bucket, ceil(max_seq_len_to_capture / block_size)]` and context lengths. A decode step of
n sequences fills the first rows of those inputs with one non-blocking copy per dtype from
pinned memory (`step_inputs.pack_by_dtype`), pads rows n..bucket-1 with dummy decodes (token 0
at position 0, one key, written to and read from a scratch block no sequence owns), replays the
bucket's graph and hands back the first n rows of its output. The split-KV partials live in a
`DecodeWorkspace` of the graphs' own, sized for every bucket before the first capture, so no
eager step can move them; each bucket keeps the split count it was captured with.

`GraphSettings.capture=False` runs the same padded path with the forward called directly
instead of replayed (no CUDA needed: the tests' check of the padding and slicing). Steps with a
prompt chunk, more decodes than the largest bucket or a context past `max_seq_len_to_capture`
run eager.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from llmopt.model.paged_attention import PagedAttention, StepMetadata
from llmopt.runtime.step_inputs import pack_by_dtype, unpack

logger = logging.getLogger(__name__)


@dataclass
class GraphSettings:
    max_num_seqs: int
    max_seq_len_to_capture: int
    capture: bool = True  # False: no graphs, the forward runs on the padded persistent inputs (CPU tests)


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, 8, 16, 24, ... up to the first one >= max_num_seqs. Buckets above 8
    are multiples of 8, so a batch and its bucket share a power-of-two bucket of the decode kernel's
    split count (`triton_paged_decode.batch_bucket`)."""
    sizes = []
    for size in [1, 2, 4] + list(range(8, max_num_seqs + 8, 8)):
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return sizes


def graph_settings(enforce_eager: bool, max_num_seqs: int, max_seq_len_to_capture: int,
                   device: torch.device) -> GraphSettings | None:
    """What the engine asks its runner for: graphs on CUDA unless `--enforce-eager`; None on the CPU."""
    if enforce_eager or device.type != "cuda":
        return None
    return GraphSettings(max_num_seqs, max_seq_len_to_capture)


class GraphRunner:
    """The persistent inputs, the captured graphs and their outputs of one model runner.

    `scratch_block`: a KV block no sequence owns (the runner allocates one past the pool's), where
    the padding rows write and read.
    """

    def __init__(self, model, attn: PagedAttention, settings: GraphSettings, block_size: int,
                 dtype: torch.dtype, device: torch.device, scratch_block: int):
        self.model, self.attn, self.settings = model, attn, settings
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.batch_sizes = capture_batch_sizes(settings.max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = -(-settings.max_seq_len_to_capture // block_size)
        self.scratch_block = scratch_block
        table = attn.block_table_dtype
        # the inputs' full shapes: the host side of a step is built in this layout, packed by dtype
        self.layout = {"input_ids": torch.zeros(self.max_batch, dtype=torch.long),
                       "positions": torch.zeros(self.max_batch, dtype=torch.long),
                       "slot_mapping": torch.zeros(self.max_batch, dtype=torch.long),
                       "decode_lens": torch.zeros(self.max_batch, dtype=table),
                       "decode_block_tables": torch.zeros(self.max_batch, self.max_blocks, dtype=table)}
        self.buffers = {dt: b.to(device) for dt, b in pack_by_dtype(self.layout).items()}
        self.inputs = unpack(self.buffers, self.layout)  # persistent views the graphs read
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.workspace = None
        if settings.capture:
            self._capture_all()

    def bucket(self, num_decodes: int) -> int:
        return next(b for b in self.batch_sizes if b >= num_decodes)

    def can_run(self, num_decodes: int, max_context_len: int) -> bool:
        return 0 < num_decodes <= self.max_batch and max_context_len <= self.settings.max_seq_len_to_capture

    def _host_inputs(self, ids: list[int], positions: list[int], slots: list[int], lens: list[int],
                     tables: list[list[int]]) -> dict[str, torch.Tensor]:
        """The step's rows, then dummy decodes up to the largest bucket, in `layout`'s shapes."""
        pad = self.max_batch - len(ids)
        scratch_slot = self.scratch_block * self.block_size
        table = np.full((self.max_batch, self.max_blocks), self.scratch_block, dtype=np.int64)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = blocks
        table_dtype = self.attn.block_table_dtype
        return {"input_ids": torch.tensor(ids + [0] * pad, dtype=torch.long),
                "positions": torch.tensor(positions + [0] * pad, dtype=torch.long),
                "slot_mapping": torch.tensor(slots + [scratch_slot] * pad, dtype=torch.long),
                "decode_lens": torch.tensor(lens + [1] * pad, dtype=table_dtype),
                "decode_block_tables": torch.from_numpy(table).to(table_dtype)}

    def _fill(self, host: dict[str, torch.Tensor]) -> None:
        """Host inputs into the persistent buffers: one copy per dtype, non-blocking from pinned memory."""
        pin = self.device.type == "cuda"
        for dt, packed in pack_by_dtype(host).items():
            self.buffers[dt].copy_(packed.pin_memory() if pin else packed, non_blocking=pin)

    def _metadata(self, batch: int) -> StepMetadata:
        i = self.inputs
        return StepMetadata(slot_mapping=i["slot_mapping"][:batch], num_decodes=batch,
                            decode_block_tables=i["decode_block_tables"][:batch], decode_lens=i["decode_lens"][:batch],
                            block_size=self.block_size, dtype=self.dtype)

    def _forward(self, batch: int) -> torch.Tensor:
        self.attn.metadata = self._metadata(batch)
        try:
            return self.model(self.inputs["input_ids"][:batch], self.inputs["positions"][:batch], self.attn)
        finally:
            self.attn.metadata = None

    def _reserve_workspace(self) -> None:
        """The graphs' own split-KV partials, sized for every bucket before the first capture."""
        from llmopt.kernels.triton_paged_decode import DecodeWorkspace, _num_sms, choose_num_splits

        cfg = self.model.config
        splits = {b: choose_num_splits(b, cfg.num_key_value_heads, _num_sms(self.device)) for b in self.batch_sizes}
        batch = max(self.batch_sizes, key=lambda b: b * splits[b])  # the most partials of any bucket
        self.workspace = DecodeWorkspace()
        self.workspace.reserve(batch, cfg.num_attention_heads, splits[batch], cfg.head_dim, self.device)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        self._reserve_workspace()
        saved, self.attn.decode_workspace = self.attn.decode_workspace, self.workspace
        try:
            self._fill(self._host_inputs([], [], [], [], []))  # every row a dummy decode
            pool = torch.cuda.graph_pool_handle()
            for batch in reversed(self.batch_sizes):  # largest first: the smaller ones reuse its pool
                self._forward(batch)  # warm-up: compiles the kernels outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[batch] = self._forward(batch)
                self.graphs[batch] = graph
            torch.cuda.synchronize(self.device)
        finally:
            self.attn.decode_workspace = saved
        logger.info("captured %d CUDA graphs (decode batch sizes %s, contexts up to %d tokens) in %.1f s",
                    len(self.graphs), ",".join(map(str, self.batch_sizes)), self.settings.max_seq_len_to_capture,
                    time.perf_counter() - start)

    def run(self, ids: list[int], positions: list[int], slots: list[int], lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [n, hidden] of n decodes (`tables`: each one's used blocks), through the
        bucket's graph (or its forward, without capture)."""
        n = len(ids)
        batch = self.bucket(n)
        self._fill(self._host_inputs(ids, positions, slots, lens, tables))
        if not self.settings.capture:
            return self._forward(batch)[:n]
        self.graphs[batch].replay()
        return self.outputs[batch][:n]
