#!/usr/bin/env python
"""The benchmark workload and the two transformers baselines our paged-KV runtime is compared against.

(a) `run_hf_sequential`: `model.generate` one request at a time.
(b) `run_hf_static_batches`: `model.generate` on static, left-padded batches in arrival order; a batch runs
    until its longest request is done, and only each request's own `max_tokens` count as output.

Every request produces exactly `max_tokens` new tokens: EOS is ignored (as vLLM's benchmark does with
`ignore_eos`), by generating with `eos_token_id=None` -- nothing is masked, so greedy tokens are the model's
true argmax even past an `<|im_end|>`. Each baseline checks the generated lengths before returning.

Importable (scripts/bench_runtime.py adds our engine next to these):

    from hf_baselines import BenchRequest, make_chat_workload, run_hf_sequential, run_hf_static_batches

Quick manual check:

    python scripts/hf_baselines.py --num-requests 8 --batch-size 4 --min-output 16 --max-output 64
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

# --------------------------------------------------------------------------------------------- workload


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # exact output length: requests run with EOS ignored, as vLLM's bench does


# Question templates; "{topic}" is filled from TOPICS.
TEMPLATES = [
    "Explain {topic} to a ten-year-old.",
    "What are the three most important facts about {topic}?",
    "Write a short poem about {topic}.",
    "Give me a step-by-step introduction to {topic}.",
    "What is a common misconception about {topic}, and why is it wrong?",
    "Summarize the history of {topic} in a few sentences.",
    "How would you teach {topic} to a complete beginner?",
    "List five questions a student might ask about {topic}.",
    "Compare {topic} with something from everyday life.",
    "Why does {topic} matter to ordinary people?",
    "Write a haiku that mentions {topic}.",
    "What are the pros and cons of {topic}?",
    "Describe {topic} in exactly three bullet points.",
    "If you had one minute to explain {topic}, what would you say?",
    "Tell me a short story in which {topic} plays a key role.",
    "What would a world without {topic} look like?",
    "Write a tweet that makes {topic} sound exciting.",
    "What is the single most surprising thing about {topic}?",
    "Create a quiz with three multiple-choice questions about {topic}.",
    "How has {topic} changed over the last hundred years?",
    "Explain the basic vocabulary someone needs to discuss {topic}.",
    "What careers involve working with {topic}?",
    "Write a friendly email inviting a colleague to a talk on {topic}.",
    "Give an analogy that helps explain {topic}.",
    "What open problems remain in {topic}?",
    "Describe a simple experiment or activity that demonstrates {topic}.",
    "What books or resources would you recommend for learning about {topic}?",
    "Argue for and against spending public money on {topic}.",
    "Explain {topic} using only words of one syllable where possible.",
    "What mistakes do beginners make when they first learn about {topic}?",
    "Write a dialogue between a teacher and a student about {topic}.",
    "How is {topic} connected to mathematics?",
    "What ethical questions does {topic} raise?",
    "Give me a one-paragraph definition of {topic}.",
    "Pretend you are a tour guide and present {topic} to visitors.",
    "What are the key numbers everyone should know about {topic}?",
    "Write a limerick about {topic}.",
    "Explain how {topic} might develop in the next twenty years.",
    "Which famous people are associated with {topic}, and why?",
    "Outline a five-minute presentation on {topic}.",
]

TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "compound interest", "volcanoes",
    "machine learning", "the water cycle", "jazz music", "the Roman Empire", "vaccines",
    "plate tectonics", "the stock market", "honey bees", "quantum computing", "climate change",
    "the printing press", "chess openings", "sourdough bread", "electric cars", "the human immune system",
    "the Moon landing", "prime numbers", "coral reefs", "the Internet", "Shakespeare's plays",
    "renewable energy", "the Silk Road", "sleep", "origami", "the theory of evolution",
    "rainbows", "public libraries", "recycling plastic", "the Olympic Games", "DNA",
    "supply and demand", "the Great Wall of China", "bird migration", "impressionist painting", "cryptography",
]


def make_chat_workload(
    tokenizer_encode_chat: Callable[[list[dict[str, Any]]], list[int]],
    num_requests: int,
    min_output: int,
    max_output: int,
    seed: int,
    shared_system_prompt: str | None = None,
) -> list[BenchRequest]:
    """`num_requests` chat prompts, each a (template, topic) pair drawn from a `random.Random(seed)`
    (40 x 40 combinations), with output lengths uniform in [min_output, max_output].

    `tokenizer_encode_chat(messages) -> ids` adds the generation prompt (e.g. our `Tokenizer.encode_chat`).
    With `shared_system_prompt`, every request starts with that system message (a common prefix).
    """
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if not 1 <= min_output <= max_output:
        raise ValueError(f"need 1 <= min_output <= max_output, got {min_output}..{max_output}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        question = rng.choice(TEMPLATES).format(topic=rng.choice(TOPICS))
        messages = [{"role": "user", "content": question}]
        if shared_system_prompt is not None:
            messages.insert(0, {"role": "system", "content": shared_system_prompt})
        ids = list(tokenizer_encode_chat(messages))
        requests.append(BenchRequest(prompt_token_ids=ids, max_tokens=rng.randint(min_output, max_output)))
    return requests


# --------------------------------------------------------------------------------------------- baselines


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
    for req, out in zip(requests, outputs):
        assert len(out) == req.max_tokens, (len(out), req.max_tokens)
    useful = sum(r.max_tokens for r in requests)
    return BaselineResult(
        name="hf-sequential",
        num_requests=len(requests),
        output_tokens=useful,
        wall_s=wall,
        output_tok_per_s=useful / wall if wall > 0 else 0.0,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        generated_tokens_computed=useful,
        prompt_pad_tokens=0,
        num_batches=len(requests),
        mean_latency_s=sum(latencies) / len(latencies) if latencies else 0.0,
        cpu_s=cpu,
        outputs=outputs,
    )


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
    for req, out in zip(requests, outputs):
        assert len(out) == req.max_tokens, (len(out), req.max_tokens)
    useful = sum(r.max_tokens for r in requests)
    return BaselineResult(
        name=f"hf-static-batch{batch_size}",
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


# --------------------------------------------------------------------------------------------- CLI


def load_hf_model(folder, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def format_table(results: Sequence[BaselineResult]) -> str:
    lines = [
        "| baseline | requests | batches | output tok | computed tok (wasted) | prompt pad | wall (s) | cpu (s) | output tok/s | mean latency (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.num_requests} | {r.num_batches} | {r.output_tokens} | "
            f"{r.generated_tokens_computed} ({r.wasted_fraction:.0%}) | {r.prompt_pad_tokens} | "
            f"{r.wall_s:.2f} | {r.cpu_s:.1f} | {r.output_tok_per_s:.1f} | {r.mean_latency_s:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="llmopt model spec (resolved to a HF folder)")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system-prompt", default=None, help="shared system prompt for every request")
    ap.add_argument("--skip-sequential", action="store_true")
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    from llmopt.core import resolve
    from llmopt.core.tokenizer import Tokenizer

    folder = resolve(args.model).path
    tokenizer = Tokenizer.from_dir(folder)
    model = load_hf_model(folder, device=args.device)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        eos = tokenizer.eos_token_ids
        pad_id = eos[0] if eos else 0
    requests = make_chat_workload(tokenizer.encode_chat, args.num_requests, args.min_output, args.max_output,
                                  args.seed, args.system_prompt)
    plens = [len(r.prompt_token_ids) for r in requests]
    print(f"model {folder}\n{len(requests)} requests, prompt tokens {min(plens)}..{max(plens)}, "
          f"output tokens {args.min_output}..{args.max_output} (total {sum(r.max_tokens for r in requests)}), "
          f"torch threads {torch.get_num_threads()}, device {args.device}\n")
    results = []
    if not args.skip_sequential:
        results.append(run_hf_sequential(model, requests, pad_token_id=pad_id))
    if not args.skip_static:
        results.append(run_hf_static_batches(model, requests, args.batch_size, pad_id))
    print(format_table(results))
    if len(results) == 2:
        same = sum(a == b for a, b in zip(results[0].outputs, results[1].outputs))
        print(f"\ngreedy outputs identical between the two baselines: {same}/{len(requests)} requests")


if __name__ == "__main__":
    main()
