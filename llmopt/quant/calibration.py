"""Calibration data: `--calib` -> token windows [num_samples, seq_len], deterministic per seed.

Sources:
- `self` (the offline default): data-free self-calibration. The model writes its own
  samples, starting from its chat template and a handful of seed topics, sampled at
  temperature 1 (LLM-QAT's observation: a model's own generations cover its activation
  ranges about as well as generic web text, and they need no download).
- a local `.txt` (one document), `.jsonl` (a `text` field per line) or `.parquet` (a
  `text` column) file;
- `hf:NAME[:CONFIG][:SPLIT]`: a Hugging Face dataset with a `text` column, where the hub
  is reachable.

Documents are tokenized, joined with the EOS token into one stream, cut into windows of
`seq_len` tokens, and `num_samples` windows are drawn at random with `seed`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.core.config import ModelConfig
from llmopt.core.documents import hub_documents, read_documents
from llmopt.core.tokenizer import Tokenizer
from llmopt.errors import LlmoptError

SELF_CALIBRATION_TOPICS = (
    "Explain how photosynthesis works.", "Write a short story about a lighthouse keeper.",
    "Summarise the causes of the French Revolution.", "Write a Python function that merges two sorted lists.",
    "What are the health benefits of regular exercise?", "Describe the water cycle to a child.",
    "Compare TCP and UDP.", "Give a recipe for a vegetable soup.", "How does a bill become law?",
    "Write a poem about autumn.", "Explain Newton's laws of motion.", "What is a neural network?",
    "Describe the history of the printing press.", "How do vaccines work?",
    "Solve: a train travels 120 km in 1.5 hours. What is its speed?", "List tips for a job interview.",
)


@dataclass
class CalibrationData:
    input_ids: torch.Tensor  # [num_samples, seq_len] int64
    source: str  # what --calib said, for the report
    num_documents: int
    num_tokens_available: int


@dataclass
class TextModel:
    """What calibration from text needs of a model: its config (context length) and tokenizer."""

    config: ModelConfig
    tokenizer: Tokenizer


def load_calibration(spec: str, model, num_samples: int, seq_len: int, seed: int) -> CalibrationData:
    """`model` is a LoadedModel (its tokenizer, and its decoder for self-calibration) or, for
    calibration from text, a TextModel."""
    if num_samples <= 0 or seq_len <= 0:
        raise LlmoptError(f"--num-samples and --seq-len must be positive (got {num_samples} and {seq_len})")
    if seq_len > model.config.max_position_embeddings:
        raise LlmoptError(f"--seq-len {seq_len} exceeds the model's context ({model.config.max_position_embeddings})")
    if spec == "self":
        docs = _self_generated(model, num_samples, seq_len, seed)
    elif spec.startswith("hf:"):
        fallback = "without the hub, pass a local .txt/.jsonl/.parquet file or use --calib self"
        docs = [d for d in hub_documents(spec, "calibration dataset", "train", fallback)[1] if d.strip()]
    else:
        docs = read_documents(Path(spec), "calibration file")
    if not any(d.strip() for d in docs):
        raise LlmoptError(f"calibration data {spec!r} is empty")
    tok = model.tokenizer
    eos = (tok.eos_token_ids or [0])[0]
    stream: list[int] = []
    for doc in docs:
        stream.extend(tok.encode(doc, add_special_tokens=False))
        stream.append(eos)
    windows = len(stream) // seq_len
    if windows < num_samples:
        raise LlmoptError(
            f"calibration data {spec!r} is too short: {len(stream)} tokens make {windows} windows of {seq_len}, "
            f"need {num_samples} (lower --num-samples or --seq-len, or give more text)"
        )
    picks = sorted(random.Random(seed).sample(range(windows), num_samples))
    ids = torch.tensor([stream[i * seq_len:(i + 1) * seq_len] for i in picks], dtype=torch.long)
    return CalibrationData(input_ids=ids, source=spec, num_documents=len(docs), num_tokens_available=len(stream))


def _self_generated(model, num_samples: int, seq_len: int, seed: int) -> list[str]:
    """The model writes `num_samples` documents of at least `seq_len` tokens each."""
    from llmopt.runtime import LLM, SamplingParams

    tok = model.tokenizer
    prompts = []
    for i in range(num_samples):
        topic = SELF_CALIBRATION_TOPICS[i % len(SELF_CALIBRATION_TOPICS)]
        prompts.append(tok.apply_chat_template([{"role": "user", "content": topic}]) if tok.is_chat else topic)
    llm = LLM(model, max_num_seqs=min(num_samples, 64), max_model_len=min(model.config.max_position_embeddings, 4 * seq_len + 256))
    params = [SamplingParams(max_tokens=seq_len + 8, min_tokens=seq_len + 8, temperature=1.0, top_p=0.95,
                             seed=seed * 100_003 + i, ignore_eos=True) for i in range(num_samples)]
    outputs = llm.generate(prompts, params)
    return [p + o.outputs[0].text for p, o in zip(prompts, outputs)]
