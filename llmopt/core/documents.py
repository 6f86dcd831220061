"""Plain-text documents from a local file or a Hugging Face dataset: the one reader behind
`quantize --calib` and `eval --text`.

- `.txt`: the whole file is one document;
- `.jsonl` / `.jsonl.gz`: one document per line, a JSON string or an object with `text`;
- `.parquet`: the `text` column;
- `hf:NAME[:CONFIG][:SPLIT]`: a dataset's `text` column via `datasets`, where the hub is reachable.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from llmopt.errors import LlmoptError


def read_documents(path: Path, what: str) -> list[str]:
    """`what` names the file in messages, e.g. "calibration file" or "--text file"."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise LlmoptError(f"{what} {path} does not exist")
    name = path.name.lower()
    try:
        if name.endswith(".txt"):
            return [path.read_text(encoding="utf-8")]
        if name.endswith((".jsonl", ".jsonl.gz")):
            opener = gzip.open if name.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as f:
                return [_text_of(json.loads(line), f"{path}:{n}") for n, line in enumerate(f, 1) if line.strip()]
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if "text" not in table.column_names:
                raise LlmoptError(f"{path} has no 'text' column (columns: {', '.join(table.column_names)})")
            return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
    except (UnicodeDecodeError, json.JSONDecodeError, OSError, EOFError) as exc:
        raise LlmoptError(f"cannot read {what} {path}: {exc}") from None
    raise LlmoptError(f"{what} {path}: unsupported file type; use .txt, .jsonl, .jsonl.gz or .parquet")


def hub_documents(spec: str, what: str, default_split: str, fallback: str) -> tuple[str, list[str]]:
    """`hf:NAME[:CONFIG][:SPLIT]` -> (a description, the `text` column). `fallback` says what to do offline."""
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise LlmoptError(f"bad {what} {spec!r}; expected hf:NAME[:CONFIG][:SPLIT], e.g. hf:wikitext:wikitext-2-raw-v1")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else default_split
    try:
        from datasets import load_dataset
    except ImportError:
        raise LlmoptError(f"{what} {spec} needs the datasets package (pip install 'llmopt[eval]'); {fallback}") from None
    try:
        ds = load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown name/config/split: all explained the same way
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "")
        raise LlmoptError(f"cannot load {what} {spec} with datasets ({reason}"
                          f"{'; HF_HUB_OFFLINE is set' if offline else ''}); {fallback}") from None
    if "text" not in ds.column_names:
        raise LlmoptError(f"{spec} has no 'text' column (columns: {', '.join(ds.column_names)})")
    description = f"{name} {config or ''} {split} split".replace("  ", " ")
    return description, [t for t in ds["text"] if isinstance(t, str)]


def _text_of(record, where: str) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    raise LlmoptError(f"{where}: expected a JSON string or an object with a 'text' string")
