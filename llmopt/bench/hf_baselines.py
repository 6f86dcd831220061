"""The two transformers baselines llmopt's runtime is compared against (`llmopt bench throughput`'s
`hf` and `hf-batch` engines).

(a) `run_hf_sequential`: `model.generate` one request at a time (the seeds' "naive serving").
(b) `run_hf_static_batches`: `model.generate` on static, left-padded batches in arrival order; a batch runs
    until its longest request is done, and only each request's own `max_tokens` count as output.

Every request produces exactly `max_tokens` new tokens: EOS is ignored (as vLLM's benchmark does with
`ignore_eos`), by generating with `eos_token_id=None` -- nothing is masked, so greedy tokens are the model's
true argmax even past an `<|im_end|>`. Each baseline checks the generated lengths before returning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from llmopt.bench.datasets import BenchRequest

@dataclass
class BaselineResult:
    name: str
    num_requests: int
    output_tokens: int  # useful tokens: sum of each request's max_tokens
    wall_s: float
    output_tok_per_s: float
    prompt_tokens: int = 0
    # Token positions the model actually ran through (static batching: padded rows included).
    generated_tokens_computed: int = 0  # decode rows x steps (= output_tokens when nothing is wasted)
    prompt_pad_tokens: int = 0  # left-pad positions in prefill
    num_batches: int = 0
    mean_latency_s: float = 0.0  # all requests arrive at t=0; latency = when its output is returned
    cpu_s: float = 0.0  # process CPU time over the timed region (all threads); ~threads x wall_s when uncontended
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # generated ids per request, in order

    @property
    def wasted_fraction(self) -> float:
        """Share of generated rows x steps that produced nothing a user asked for."""
        if not self.generated_tokens_computed:
            return 0.0
        return 1.0 - self.output_tokens / self.generated_tokens_computed


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
              pad_token_id: int | None) -> torch.Tensor:
    """Greedy, exactly `max_new_tokens` new tokens per row (EOS not a stop); returns only the new tokens."""
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        eos_token_id=None,  # ignore EOS: no stopping criterion, nothing masked
        pad_token_id=pad_token_id,
        # do not inherit sampling knobs from the model's generation_config (greedy ignores them anyway)
        temperature=None, top_p=None, top_k=None,
    )
    new = out[:, input_ids.shape[1]:]
    if new.shape[1] != max_new_tokens:
        raise RuntimeError(f"generate returned {new.shape[1]} new tokens, expected {max_new_tokens}")
    return new


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warmup(model, requests: Sequence[BenchRequest], pad_token_id: int | None) -> None:
    device = _device(model)
    ids = torch.tensor([requests[0].prompt_token_ids], device=device)
    _generate(model, ids, torch.ones_like(ids), 2, pad_token_id)
    _sync(device)


def run_hf_sequential(model, requests: list[BenchRequest], warmup: bool = True,
                      pad_token_id: int | None = None) -> BaselineResult:
    """`model.generate` one request at a time, greedy, exactly `max_tokens` new tokens each (EOS ignored),
    with an explicit all-ones attention_mask. `warmup` runs one untimed 2-token generate first."""
    device = _device(model)
    if pad_token_id is None:
        pad_token_id = getattr(model.generation_config, "pad_token_id", None)
    outputs, latencies = [], []
    with torch.inference_mode():
        if warmup and requests:
            _warmup(model, requests, pad_token_id)
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for req in requests:
            ids = torch.tensor([req.prompt_token_ids], dtype=torch.long, device=device)
            new = _generate(model, ids, torch.ones_like(ids), req.max_tokens, pad_token_id)
            outputs.append(new[0].tolist())
            _sync(device)
            latencies.append(time.perf_counter() - t0)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return _result("hf-sequential", requests, outputs, latencies, wall, cpu,
                   computed=sum(r.max_tokens for r in requests), pad_positions=0, num_batches=len(requests))


def run_hf_static_batches(model, requests: list[BenchRequest], batch_size: int, pad_token_id: int,
                          warmup: bool = True) -> BaselineResult:
    """Static padded batches of `batch_size` in arrival order: prompts left-padded with `pad_token_id`
    (attention_mask 0 there), each batch generated with max_new_tokens = the batch's largest max_tokens.
    Output counts only each request's own max_tokens; the extra rows x steps are `generated_tokens_computed`."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    device = _device(model)
    outputs, latencies = [], []
    computed = pad_positions = num_batches = 0
    with torch.inference_mode():
        if warmup and requests:
            _warmup(model, requests, pad_token_id)
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for start in range(0, len(requests), batch_size):
            batch = requests[start:start + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, req in enumerate(batch):
                n = len(req.prompt_token_ids)
                ids[row, width - n:] = torch.tensor(req.prompt_token_ids, dtype=torch.long)
                mask[row, width - n:] = 1
            steps = max(r.max_tokens for r in batch)
            new = _generate(model, ids.to(device), mask.to(device), steps, pad_token_id).tolist()
            _sync(device)
            done = time.perf_counter() - t0
            for req, row in zip(batch, new):
                outputs.append(row[:req.max_tokens])
                latencies.append(done)
            computed += len(batch) * steps
            pad_positions += int((mask == 0).sum())
            num_batches += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return _result(f"hf-static-batch{batch_size}", requests, outputs, latencies, wall, cpu, computed=computed,
                   pad_positions=pad_positions, num_batches=num_batches)


def _result(name: str, requests: list[BenchRequest], outputs: list[list[int]], latencies: list[float], wall: float,
            cpu: float, computed: int, pad_positions: int, num_batches: int) -> BaselineResult:
    """The run's figures; output counts only each request's own max_tokens (every output checked to have it)."""
    for req, out in zip(requests, outputs):
        assert len(out) == req.max_tokens, (len(out), req.max_tokens)
    useful = sum(r.max_tokens for r in requests)
    return BaselineResult(
        name=name,
        num_requests=len(requests),
        output_tokens=useful,
        wall_s=wall,
        output_tok_per_s=useful / wall if wall > 0 else 0.0,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        generated_tokens_computed=computed,
        prompt_pad_tokens=pad_positions,
        num_batches=num_batches,
        mean_latency_s=sum(latencies) / len(latencies) if latencies else 0.0,
        cpu_s=cpu,
        outputs=outputs,
    )


def load_hf_model(folder, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
