"""Structured outputs: constrain a request's tokens to a JSON schema, any JSON object, a regex,
a choice of strings or a Lark grammar (vLLM's `StructuredOutputsParams`).

The grammar back end is llguidance (PyPI `llguidance`, one self-contained wheel; vLLM's
`guidance` back end): it compiles the constraint against the tokenizer once per request and,
each step, gives the set of tokens that keep the output inside the grammar. EOS is in that
set only where the grammar accepts, so a constrained output ends complete; near max_tokens
`llmopt.runtime.closing` closes it (finish_reason "length", output_closure "closed") or says it
could not ("unclosable"). JSON is compact-with-spaces (`{"a": 1, "b": [2, 3]}`):
flexible whitespace would let a small model emit newlines forever.

Only constrained requests pay anything: the engine builds a matcher for them at
`add_request`, the sampler masks just their rows, and the engine advances their matchers
where it appends sampled tokens.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from llmopt.errors import LlmoptError
from llmopt.runtime.closing import ClosingPaths, OutputCloser

_LLG_TOKENIZER_LOCK = threading.Lock()

# compact JSON with a space after ',' and ':' (what models write), no free whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint. `strict=False` ignores JSON-schema keywords llguidance cannot
    enforce (OpenAI's non-strict mode); `strict=True` refuses such a schema."""

    json: str | dict[str, Any] | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's), GBNF also read
    strict: bool = True
    # (the StructuredOutputManager, a fresh llguidance matcher for the constraint), set by its
    # `compile`: once for all the requests sharing these params, which each get a copy
    compiled: tuple[Any, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise LlmoptError(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                              f"got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise LlmoptError("structured_outputs.choice must be a non-empty list of strings")

    def lark_or_grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet validated)."""
        from llguidance import LLMatcher, grammar_from

        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise LlmoptError(f"the JSON schema is not valid JSON: {exc.msg}") from None
            if not isinstance(schema, dict):
                raise LlmoptError("the JSON schema must be a JSON object")
            options = dict(JSON_OPTIONS, lenient=not self.strict)
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_from("choice", json.dumps(self.choice))
        try:
            return grammar_from("grammar", self.grammar)
        except ValueError as exc:
            raise LlmoptError(f"invalid grammar: {exc}", param="structured_outputs") from None


@dataclass
class StructuredOutputManager:
    """Compiles constraints for one tokenizer and turns a matcher's state into a token mask."""

    tokenizer: Any  # llmopt.core.tokenizer.Tokenizer
    vocab_size: int  # the model's (may exceed the tokenizer's)
    _ll_tokenizer: Any = field(default=None, init=False, repr=False)
    _closer: OutputCloser | None = field(default=None, init=False, repr=False)

    def _llg_tokenizer(self) -> Any:
        with _LLG_TOKENIZER_LOCK:  # compile() runs on the server's worker threads: build it once
            return self._build_llg_tokenizer()

    def _build_llg_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            try:
                from llguidance import LLTokenizer
            except ImportError:
                raise LlmoptError("structured outputs need llguidance: pip install 'llmopt[serve]'") from None
            # ~1 s for a 49k vocabulary, so once per engine, on the first constrained request
            self._ll_tokenizer = LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                             eos_token=self.tokenizer.eos_token_ids or None)
        return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> None:
        """Build and validate the constraint's matcher against this tokenizer, once: the costly
        part of a constrained request (seconds for a choice of thousands of strings; llguidance
        drops the GIL meanwhile), which the server does on a worker thread before `add_request`.
        LlmoptError naming the problem if the constraint is invalid. Any thread."""
        if params.compiled is not None and params.compiled[0] is self:
            return
        tokenizer = self._llg_tokenizer()  # first: it explains a missing llguidance
        from llguidance import LLMatcher

        grammar = params.lark_or_grammar()
        try:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
            if is_error:
                raise LlmoptError(f"invalid {_kind(params)}: {messages[0] if messages else 'rejected by llguidance'}",
                                  param="structured_outputs")
            matcher = LLMatcher(tokenizer, grammar, log_level=0)
        except (KeyboardInterrupt, SystemExit, LlmoptError):
            raise
        except BaseException as exc:  # a Rust panic in llguidance arrives as pyo3's PanicException
            raise LlmoptError(f"the {_kind(params)} could not be compiled: {exc}", param="structured_outputs") from None
        if matcher.is_error():
            raise LlmoptError(f"invalid {_kind(params)}: {matcher.get_error()}", param="structured_outputs")
        params.compiled = (self, matcher)

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh `llguidance.LLMatcher` for one request (a copy of the compiled one); LlmoptError
        naming the problem if the constraint is invalid."""
        self.compile(params)
        return params.compiled[1].deep_copy()

    def closer(self) -> OutputCloser:
        """What keeps this engine's constrained outputs closable within max_tokens (built on first use)."""
        if self._closer is None:
            self._closer = OutputCloser(ClosingPaths(self._llg_tokenizer(), self.tokenizer.eos_token_ids))
        return self._closer

    def allowed_tokens(self, matcher: Any) -> torch.Tensor:
        """bool [vocab_size]: the tokens the matcher accepts next (EOS only where the grammar may end)."""
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        # one bit per token, token i at bit i % 32 of little-endian 32-bit word i // 32
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return torch.from_numpy(allowed)


def _kind(params: StructuredOutputsParams) -> str:
    if params.json is not None:
        return "JSON schema"
    if params.regex is not None:
        return "regex"
    if params.grammar is not None:
        return "grammar"
    return "structured output constraint"
