"""Tokenizer: a Hugging Face `tokenizers` tokenizer plus the chat template and special tokens.

We wrap `tokenizers.Tokenizer` directly rather than transformers' classes: it loads in
milliseconds and is all the runtime needs. Chat templates are rendered with the same
Jinja environment transformers uses, so prompts match token for token.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from llmopt.errors import LlmoptError

# Texts (characters) and id lists longer than this go through the `tokenizers` batch calls, which
# release the GIL: a megabyte of text takes seconds to encode, and the single-text calls hold the
# GIL (and so every other Python thread, e.g. the server's event loop) all that time.
LONG_TEXT = 4096
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class Tokenizer:
    backend: HFTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    # ids that end generation: the tokenizer's eos plus the model's generation config's
    extra_eos_token_ids: list[int] = field(default_factory=list)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: Path, extra_eos_token_ids: list[int] | None = None) -> "Tokenizer":
        path = Path(path)
        config: dict[str, Any] = {}
        config_path = path / "tokenizer_config.json"
        if config_path.exists():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise LlmoptError(f"{config_path} is not valid JSON: {exc}") from None
        tokenizer_json = path / "tokenizer.json"
        if tokenizer_json.exists():
            try:
                backend = HFTokenizer.from_file(str(tokenizer_json))
            except Exception as exc:  # tokenizers raises a plain Exception on bad files
                raise LlmoptError(f"cannot read {tokenizer_json}: {exc}") from None
        else:
            backend = _convert_slow_tokenizer(path)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend=backend,
            chat_template=template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            pad_token=_token_text(config.get("pad_token")),
            unk_token=_token_text(config.get("unk_token")),
            extra_eos_token_ids=list(extra_eos_token_ids or []),
        )

    def save(self, path: Path) -> None:
        """Write tokenizer.json + tokenizer_config.json that transformers also loads."""
        path = Path(path)
        self.backend.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        special = {k: v for k, v in config.items() if k.endswith("_token") and v is not None}
        (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2), encoding="utf-8")

    # ---- ids ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @cached_property
    def eos_token_ids(self) -> list[int]:
        ids = list(self.extra_eos_token_ids)
        eos = self.token_to_id(self.eos_token)
        if eos is not None and eos not in ids:
            ids.append(eos)
        return ids

    # ---- text <-> ids ---------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            if len(text) > LONG_TEXT:  # `encode_batch` lets other threads run meanwhile, `encode` does not
                return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            # Python strings may hold lone UTF-16 surrogates (JSON's "\ud800" decodes to one); Rust's may not
            if isinstance(text, str) and any("\ud800" <= c <= "\udfff" for c in text):
                raise LlmoptError("the text holds a lone UTF-16 surrogate (e.g. \\ud800): not valid Unicode") from None
            raise

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, in one call (the tokenizers library runs them on its threads)."""
        try:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        except TypeError:
            for text in texts:  # the text at fault gets encode's error
                self.encode(text, add_special_tokens)
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > LONG_TEXT:  # as in encode: the batch call releases the GIL
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- chat -----------------------------------------------------------------------
    @property
    def is_chat(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The template's prompt; `tools` (OpenAI function tools) reach templates that describe them."""
        if not self.chat_template:
            raise LlmoptError("this model's tokenizer has no chat template; pass a plain prompt instead")
        try:
            return self._compiled_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                unk_token=self.unk_token or "",
                tools=tools,
            )
        except _TemplateError as exc:
            raise LlmoptError(f"chat template rejected the messages: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.chat_prompt(messages, add_generation_prompt)[1]

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """The chat template's text and token ids, with message content kept as text.

        The template's own special tokens (`<|im_start|>`, ...) become control tokens; the same
        text typed inside a message does not: it is encoded as ordinary text, as a tokenizer with
        `split_special_tokens` encodes it, so a message cannot open a turn of another role.
        Content without special-token text (nearly all) is rendered and encoded exactly as
        transformers' `apply_chat_template(tokenize=True)` does; content with it is rendered with
        a private placeholder at each occurrence, and the placeholders are encoded as plain text
        where they land (the template may still trim or split the content around them)."""
        marked, found = _mark_special_text(messages, self._special_text)
        text = self.apply_chat_template(marked, add_generation_prompt, tools=tools)
        # the template already writes any BOS it wants, as transformers assumes too
        if not found:
            return text, self.encode(text, add_special_tokens=False)
        nonce, originals = found
        pieces = re.split(f"\ue000{nonce}(\\d+)\ue001", text)
        if nonce in "".join(pieces[::2]):
            raise LlmoptError("the chat template altered message content that holds special-token text; "
                              "remove the special-token text from the messages")
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:  # a placeholder: the special-token text as ordinary tokens
                ids += self._split_special_backend.encode(originals[int(piece)], add_special_tokens=False).ids
            elif piece:
                ids += self.encode(piece, add_special_tokens=False)
        return "".join(originals[int(p)] if k % 2 else p for k, p in enumerate(pieces)), ids

    @cached_property
    def _special_text(self) -> re.Pattern[str] | None:
        """Matches the text of any special token (longest first); None without special tokens."""
        specials = sorted({t.content for t in self.backend.get_added_tokens_decoder().values() if t.special},
                          key=len, reverse=True)
        specials = [t for t in specials if t]
        return re.compile("|".join(map(re.escape, specials))) if specials else None

    @cached_property
    def _split_special_backend(self) -> HFTokenizer:
        """A copy of the backend that encodes special-token text as ordinary text."""
        backend = HFTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @cached_property
    def _compiled_template(self):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise _TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateError as exc:
            raise LlmoptError(f"the model's chat template does not parse: {exc}") from None


class _TemplateError(Exception):
    pass


def _mark_special_text(messages: list[dict[str, Any]], special: re.Pattern[str] | None
                       ) -> tuple[list[dict[str, Any]], tuple[str, list[str]] | None]:
    """`messages` with each special-token text in a string content replaced by a placeholder
    (U+E000, a random nonce, its index, U+E001), and (nonce, the replaced texts); the messages
    unchanged and None where no content holds any."""
    if special is None or not any(isinstance(m.get("content"), str) and special.search(m["content"])
                                  for m in messages if isinstance(m, dict)):
        return messages, None
    nonce, originals = secrets.token_hex(8), []

    def placeholder(match: re.Match[str]) -> str:
        originals.append(match.group(0))
        return f"\ue000{nonce}{len(originals) - 1}\ue001"

    marked = [{**m, "content": special.sub(placeholder, m["content"])}
              if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in messages]
    return marked, (nonce, originals)


def _convert_slow_tokenizer(path: Path) -> HFTokenizer:
    """Folders with only a SentencePiece tokenizer.model: let transformers convert it once."""
    if not any((path / name).exists() for name in ("tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise LlmoptError(f"{path} has no tokenizer (expected tokenizer.json or tokenizer.model)")
    try:
        from transformers import AutoTokenizer

        fast = AutoTokenizer.from_pretrained(str(path), use_fast=True)
        return fast.backend_tokenizer
    except Exception as exc:
        raise LlmoptError(f"cannot load the tokenizer in {path}: {exc}") from None
