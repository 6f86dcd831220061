"""Text for perplexity and KL divergence (`--text`): where it comes from and how it becomes tokens.

Sources:
- `bundled` (the offline default): the questions and choices of the bundled MMLU subset
  (MIT-licensed, see data/MMLU_LICENSE.txt) rendered as plain text, the way
  scripts/quant_fidelity.py renders MMLU, taking subjects round-robin so that the first few
  thousand tokens already span most of the 57 subjects rather than only the first two.
  It is exam-style English, not encyclopedic prose: its perplexities are not comparable to
  published WikiText-2 figures, only to each other.
- `hf:NAME[:CONFIG][:SPLIT]` (default split: test), e.g. `hf:wikitext:wikitext-2-raw-v1`,
  through `datasets` where the hub is reachable: the `text` column joined with "\\n\\n",
  as in Hugging Face's perplexity recipe.
- a local `.txt` file (one document) or `.jsonl` / `.jsonl.gz` (a string or {"text": ...}
  per line; documents joined with "\\n\\n").

The text is tokenized as llama.cpp's `llama-perplexity` does: BOS first where the
tokenizer adds one by default (`bos_id`), no other special tokens; then cut to whole
chunks of `--ctx-size` tokens, at most `--chunks` of them (`windows.py`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.core.documents import hub_documents, read_documents
from llmopt.errors import LlmoptError

BUNDLED = "bundled"


@dataclass
class EvalText:
    source: str  # what --text said (or "bundled")
    description: str  # for the report's config
    text: str
    num_tokens: int | None = None  # the whole text's tokens, once tokenized

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def load_text(source: str | None) -> EvalText:
    source = source or BUNDLED
    if source == BUNDLED:
        return EvalText(BUNDLED, "bundled MMLU subset (questions + choices as plain text, subjects round-robin; MIT)",
                        _bundled_mmlu_text())
    if source.startswith("hf:"):
        return _hub_text(source)
    return _file_text(source)


def bos_id(tokenizer) -> int | None:
    """The BOS id when the tokenizer puts BOS before a text by default (llama.cpp's `add_bos`), else None."""
    bos = tokenizer.token_to_id(tokenizer.bos_token)
    if bos is None:
        return None
    return bos if tokenizer.encode("a", add_special_tokens=True)[:1] == [bos] else None


def context_bos_id(tokenizer, add_bos: bool | None) -> int | None:
    """The BOS id to put before every log-likelihood context, as lm-eval's `add_bos_token`: where the
    tokenizer adds one by default (None), or as `--add-bos/--no-add-bos` says."""
    if add_bos is None:
        return bos_id(tokenizer)
    if not add_bos:
        return None
    bos = tokenizer.token_to_id(tokenizer.bos_token)
    if bos is None:
        raise LlmoptError("--add-bos: the tokenizer has no BOS token")
    return bos


def tokenize(tokenizer, text: EvalText, ctx_size: int, chunks: int | None) -> torch.Tensor:
    """Token ids of whole `ctx_size` chunks of the text, at most `chunks` of them (`text.num_tokens` records all)."""
    from llmopt.eval.metrics.windows import plan_chunks

    ids = tokenizer.encode(text.text, add_special_tokens=False)
    bos = bos_id(tokenizer)
    if bos is not None:
        ids = [bos, *ids]
    text.num_tokens = len(ids)
    plan = plan_chunks(len(ids), ctx_size, chunks)
    return torch.tensor(ids[: plan.num_tokens], dtype=torch.long)


def _bundled_mmlu_text() -> str:
    from llmopt.eval.metrics.mmlu import LETTERS, load_mmlu

    by_subject: dict[str, list] = {}
    for q in load_mmlu(None):
        by_subject.setdefault(q.subject, []).append(q)
    rounds = max(len(v) for v in by_subject.values())
    parts = []
    for i in range(rounds):
        for subject in sorted(by_subject):
            if i < len(by_subject[subject]):
                q = by_subject[subject][i]
                choices = "\n".join(f"{letter}. {c}" for letter, c in zip(LETTERS, q.choices))
                parts.append(f"{q.question.strip()}\n{choices}")
    return "\n\n".join(parts)


def _hub_text(spec: str) -> EvalText:
    fallback = "offline, pass a local .txt/.jsonl file with --text, or leave --text out for the bundled text"
    description, docs = hub_documents(spec, "--text", "test", fallback)
    return EvalText(spec, description, "\n\n".join(docs))


def _file_text(spec: str) -> EvalText:
    path = Path(spec).expanduser()
    text = "\n\n".join(read_documents(path, "--text file"))
    if not text.strip():
        raise LlmoptError(f"--text file {path} is empty")
    return EvalText(str(path), f"local file {path.name}", text)
