"""Benchmark workloads: the same requests for every engine and every endpoint.

A workload is a list of `BenchRequest`s, each with its prompt as token ids (what in-process
engines get), as text and, for chat datasets, as messages (what an HTTP endpoint gets), and an
exact output length (requests run with EOS ignored, as vLLM's benchmarks do). Datasets:

- `chat` (default): single-turn chat questions, a template x topic pair each (40 x 40).
- `prefix-shared`: the chat questions behind one shared system prompt of about `prefix_len`
  tokens (the prefix cache's workload).
- `random`: prompts of uniformly random token ids, `input_len` long (vLLM's random dataset).
- a `.json` file in ShareGPT's layout (`[{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}]}]`: the first human turn is the prompt, the reply's token
  count its output length unless `output_len` is given), or a `.jsonl` file with one
  `{"prompt": ...}` or `{"messages": [...]}` object per line (optional `"output_len"`).

Lengths are drawn uniformly from [L x (1 - range_ratio), L x (1 + range_ratio)] with a
`random.Random(seed)`: the same arguments give the same workload.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError
from llmopt.options import option

DATASETS = ("chat", "prefix-shared", "random")


@dataclass
class WorkloadArgs:
    """The workload options `bench throughput` and `bench serve` share (`make_workload`'s arguments)."""

    dataset: str = option("chat", "chat, prefix-shared, random, or a ShareGPT .json / .jsonl file.")
    num_prompts: int = option(32, "Requests in the workload.", ge=1)
    input_len: int = option(128, "Prompt tokens (random dataset).", ge=1)
    output_len: int = option(128, "Output tokens per request (EOS ignored); 0: a file's own.", ge=0)
    range_ratio: float = option(0.5, "Lengths uniform in L x [1 - r, 1 + r].", ge=0, lt=1)
    prefix_len: int = option(1000, "Shared system prompt tokens (prefix-shared dataset).", ge=0)
    seed: int = option(0, "Workload seed: the same seed, the same requests.", ge=0)


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # exact output length: EOS is ignored
    prompt: str = ""  # the prompt as text (chat datasets: with the chat template applied)
    messages: list[dict[str, Any]] | None = None  # chat datasets: what a chat endpoint is sent


# chat questions: a template with "{topic}" filled from TOPICS
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


SYSTEM_PARAGRAPH = (
    "You are the support assistant of a company that rents out bicycles, scooters and small electric cars in "
    "twelve European cities. Answer politely and briefly, never promise refunds yourself, and always point "
    "customers to the self-service page for invoices, damage reports and lost items. Opening hours are eight "
    "in the morning to eight in the evening on weekdays and ten to six at weekends. "
)


def draw_length(rng: random.Random, length: int, range_ratio: float) -> int:
    """One length uniform in [length x (1 - range_ratio), length x (1 + range_ratio)], at least 1."""
    low, high = max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))
    return rng.randint(low, high)


def make_workload(tokenizer, dataset: str = "chat", num_prompts: int = 64, input_len: int = 128,
                  output_len: int | None = 128, range_ratio: float = 0.0, seed: int = 0,
                  prefix_len: int = 1000) -> list[BenchRequest]:
    """`num_prompts` requests of `dataset` (a name in DATASETS or a .json/.jsonl path).

    `tokenizer`: llmopt's `Tokenizer` (encode, encode_chat, apply_chat_template, decode, vocab_size).
    `output_len` None keeps a file's own output lengths (ShareGPT replies); the named datasets
    need it. Raises LlmoptError for an unknown dataset, an unreadable file or impossible lengths.
    """
    if num_prompts < 1:
        raise LlmoptError(f"--num-prompts must be at least 1, got {num_prompts}")
    if not 0 <= range_ratio < 1:
        raise LlmoptError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or (output_len is not None and output_len < 1):
        raise LlmoptError(f"input and output lengths must be at least 1 (got {input_len} and {output_len})")
    rng = random.Random(seed)
    if dataset in ("chat", "prefix-shared"):
        system = None
        if dataset == "prefix-shared":
            system = _system_prompt(tokenizer, prefix_len)
        return [_chat_request(tokenizer, _question(rng), draw_length(rng, output_len or 128, range_ratio), system)
                for _ in range(num_prompts)]
    if dataset == "random":
        requests = []
        for _ in range(num_prompts):
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(draw_length(rng, input_len, range_ratio))]
            requests.append(BenchRequest(ids, draw_length(rng, output_len or 128, range_ratio),
                                         prompt=tokenizer.decode(ids)))
        return requests
    path = Path(dataset)
    if path.suffix not in (".json", ".jsonl") or not path.is_file():
        raise LlmoptError(f"unknown dataset {dataset!r}: give {', '.join(DATASETS)} or an existing .json "
                          "(ShareGPT) or .jsonl file")
    return _file_requests(tokenizer, path, num_prompts, output_len, range_ratio, rng)


def _question(rng: random.Random) -> str:
    return rng.choice(TEMPLATES).format(topic=rng.choice(TOPICS))


def _system_prompt(tokenizer, prefix_len: int) -> str:
    """SYSTEM_PARAGRAPH repeated to about `prefix_len` tokens."""
    per_copy = len(tokenizer.encode(SYSTEM_PARAGRAPH, add_special_tokens=False))
    return SYSTEM_PARAGRAPH * max(1, round(prefix_len / per_copy))


def _chat_request(tokenizer, question: str, max_tokens: int, system: str | None = None) -> BenchRequest:
    messages = [{"role": "user", "content": question}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return BenchRequest(tokenizer.encode(text, add_special_tokens=False), max_tokens, prompt=text, messages=messages)


def _file_requests(tokenizer, path: Path, num_prompts: int, output_len: int | None, range_ratio: float,
                   rng: random.Random) -> list[BenchRequest]:
    try:
        text = path.read_text(encoding="utf-8")
        rows = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines()
                                                                if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LlmoptError(f"cannot read dataset {path}: {exc}") from None
    if not isinstance(rows, list):
        raise LlmoptError(f"dataset {path}: expected a JSON list (ShareGPT) or one JSON object per line")
    requests = []
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise LlmoptError(f"dataset {path}, entry {number}: expected a JSON object")
        own_len = row.get("output_len")
        if "conversations" in row:  # ShareGPT: the first human turn; the reply's token count as output length
            turns = row["conversations"]
            if len(turns) < 2 or not turns[0].get("value"):
                continue
            messages, prompt = [{"role": "user", "content": turns[0]["value"]}], None
            own_len = own_len or len(tokenizer.encode(turns[1].get("value", ""), add_special_tokens=False))
        elif "messages" in row:
            messages, prompt = list(row["messages"]), None
        elif "prompt" in row:
            messages, prompt = None, str(row["prompt"])
        else:
            raise LlmoptError(f"dataset {path}, entry {number}: needs 'conversations', 'messages' or 'prompt'")
        n = draw_length(rng, output_len, range_ratio) if output_len is not None else own_len
        if n is None:
            raise LlmoptError(f"dataset {path}, entry {number} gives no output length: add --output-len")
        if not isinstance(n, int) or n < 1:
            continue  # an empty reply: nothing to time
        if messages is None:
            requests.append(BenchRequest(tokenizer.encode(prompt), n, prompt=prompt))
        else:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            requests.append(BenchRequest(tokenizer.encode(text, add_special_tokens=False), n, prompt=text,
                                         messages=messages))
        if len(requests) == num_prompts:
            break
    if not requests:
        raise LlmoptError(f"dataset {path} has no usable prompts")
    return requests
