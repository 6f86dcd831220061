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

The text is tokenized without special tokens and cut to the first `max_tokens + 1` tokens
(the first token is context only, so that is `max_tokens` scored predictions).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

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


def tokenize(tokenizer, text: EvalText, max_tokens: int | None) -> torch.Tensor:
    """Token ids of the text, at most `max_tokens` + 1 of them (`text.num_tokens` records them all)."""
    ids = tokenizer.encode(text.text, add_special_tokens=False)
    text.num_tokens = len(ids)
    if max_tokens is not None:
        ids = ids[: max_tokens + 1]
    if len(ids) < 2:
        raise LlmoptError(f"text {text.source!r} has {len(ids)} token(s); perplexity needs at least 2")
    return torch.tensor(ids, dtype=torch.long)


def _bundled_mmlu_text() -> str:
    from llmopt.eval.mmlu import LETTERS, load_mmlu

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
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise LlmoptError(f"bad --text {spec!r}; expected hf:NAME[:CONFIG][:SPLIT], e.g. hf:wikitext:wikitext-2-raw-v1")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "test"
    fallback = "offline, pass a local .txt/.jsonl file with --text, or leave --text out for the bundled text"
    try:
        from datasets import load_dataset
    except ImportError:
        raise LlmoptError(f"--text {spec} needs the datasets package (pip install 'llmopt[eval]'); {fallback}") from None
    try:
        ds = load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown name/config/split: all explained the same way
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "")
        raise LlmoptError(f"cannot load {spec} with datasets ({reason}{'; HF_HUB_OFFLINE is set' if offline else ''}); "
                          f"{fallback}") from None
    if "text" not in ds.column_names:
        raise LlmoptError(f"{spec} has no 'text' column (columns: {', '.join(ds.column_names)})")
    return EvalText(spec, f"{name} {config or ''} {split} split".replace("  ", " "),
                    "\n\n".join(t for t in ds["text"] if isinstance(t, str)))


def _file_text(spec: str) -> EvalText:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise LlmoptError(f"--text file {path} does not exist; give a .txt or .jsonl file, hf:NAME[:CONFIG][:SPLIT], "
                          "or leave --text out for the bundled text")
    name = path.name.lower()
    try:
        if name.endswith(".txt"):
            text = path.read_text(encoding="utf-8")
        elif name.endswith((".jsonl", ".jsonl.gz")):
            opener = gzip.open if name.endswith(".gz") else open
            docs = []
            with opener(path, "rt", encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        docs.append(_text_of(json.loads(line), f"{path}:{n}"))
            text = "\n\n".join(docs)
        else:
            raise LlmoptError(f"--text {path}: unsupported file type; use .txt, .jsonl or .jsonl.gz")
    except (UnicodeDecodeError, json.JSONDecodeError, OSError, EOFError) as exc:
        raise LlmoptError(f"cannot read --text file {path}: {exc}") from None
    if not text.strip():
        raise LlmoptError(f"--text file {path} is empty")
    return EvalText(str(path), f"local file {path.name}", text)


def _text_of(record, where: str) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    raise LlmoptError(f"{where}: expected a JSON string or an object with a 'text' string")
