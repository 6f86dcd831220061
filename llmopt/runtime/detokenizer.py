"""Incremental detokenization with stop strings, the way vLLM does it.

Decoding the whole output after every generated token costs O(n) per token. Instead we
keep a small window of token ids: the *prefix* tokens (already turned into text, kept only
as decoding context) followed by the *pending* tokens (not yet turned into text). Each
step decodes the prefix alone and prefix + pending, and the new text is whatever the second
decode adds after the first. Context matters because decoders are not compositional at
token boundaries: SentencePiece-style decoders drop the leading space of the first token,
and byte-level BPE tokens may hold only part of a multi-byte UTF-8 character, which decodes
to the replacement character U+FFFD. So:

* the window starts with the last few prompt tokens (never emitted), so the first
  generated token is decoded in context;
* when the decoded window ends in U+FFFD (an incomplete character) or adds no text, nothing
  is emitted and the tokens stay pending until a later token completes the character;
* once text is emitted, the pending tokens become the new prefix, so the window stays a few
  tokens long.

Stop strings are searched only in the newly decoded text plus the (longest stop - 1)
characters before it. For streaming, `new_text()` holds back the last (longest stop - 1)
characters, which could be the start of a stop string, until more text disambiguates them.
"""

from __future__ import annotations

from llmopt.core.tokenizer import Tokenizer
from llmopt.errors import LlmoptError

REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens seed the decoding window (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so more pending tokens than this without a complete
# character means the model produced invalid bytes (or a long run of tokens without text):
# emit what there is and restart the window, so the window stays bounded.
MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time, and watches for stop strings.

    Usage in a decode loop::

        detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["\\n\\n"])
        for token in tokens:
            stopped = detok.add_token(token)
            stream(detok.new_text())
            if stopped:
                break
        stream(detok.new_text(finished=True))
        detok.output_text, detok.stop_reason

    Concatenating every `new_text()` delta, ending with a `new_text(finished=True)` call,
    gives `output_text`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | str | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        stop = list(dict.fromkeys(stop or []))  # de-duplicated, order kept
        if not all(isinstance(s, str) and s for s in stop):
            raise LlmoptError("stop strings must be non-empty strings")
        self.tokenizer = tokenizer
        self.stop: list[str] = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.stop_reason: str | None = None
        self.token_ids: list[int] = []  # every generated token passed to add_token
        self._max_stop_len = max((len(s) for s in stop), default=0)
        # Characters new_text() keeps back while unfinished. With include_stop_str_in_output a
        # matched stop string stays in the output, so streamed text is never retracted and
        # nothing needs holding back (as in vLLM).
        self._holdback = 0 if include_stop_str_in_output else max(self._max_stop_len - 1, 0)

        # decoding window: _window[:_n_prefix] is context already decoded, the rest is pending
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        # a prompt that ends inside a character cannot serve as context (the generated tokens
        # would complete a character that began in the prompt): drop the unfinished tokens
        while context and context_text.endswith(REPLACEMENT_CHAR):
            context.pop()
            context_text = self._decode(context)
        self._window: list[int] = context
        self._n_prefix = len(context)
        self._prefix_text: str | None = context_text

        # output text: chunks joined on demand, so appending a token costs O(its text), not O(n)
        self._chunks: list[str] = []
        self._length = 0
        self._joined: str | None = ""
        self._unsent: list[str] = []  # chunks of output_text[_sent:], not yet returned by new_text()
        self._sent = 0
        self._finished = False

    # ---- public API -------------------------------------------------------------------
    @property
    def output_text(self) -> str:
        """All text decoded so far for the generated tokens (cut at the stop string once one matched)."""
        if self._joined is None:
            self._joined = "".join(self._chunks)
            self._chunks = [self._joined] if self._joined else []
        return self._joined

    @property
    def finished(self) -> bool:
        """True once a stop string matched or finish() / new_text(finished=True) was called."""
        return self._finished or self.stop_reason is not None

    def add_token(self, token_id: int) -> bool:
        """Append one generated token; update output_text; return True if a stop string now matched.

        output_text is then cut just before the stop string (just after it with
        include_stop_str_in_output). Tokens added after a stop string matched are ignored.
        """
        if self.stop_reason is not None:
            return True
        if self._finished:
            raise LlmoptError("add_token() called after the detokenizer was finished")
        self.token_ids.append(token_id)
        self._window.append(token_id)
        text = self._decode_window(force=False)
        return bool(text) and self._append(text)

    def finish(self) -> bool:
        """No more tokens will come: flush pending tokens (an incomplete character decodes to
        U+FFFD, as tokenizer.decode would). Returns True if a stop string matched. Idempotent."""
        if not self.finished:
            if len(self._window) > self._n_prefix:
                text = self._decode_window(force=True)
                if text:
                    self._append(text)
            self._finished = True
        return self.stop_reason is not None

    def new_text(self, finished: bool = False) -> str:
        """The text delta since the previous call, for streaming.

        While not finished, the last (len(longest stop string) - 1) characters are held back,
        since they could begin a stop string. When finished (or once a stop string matched),
        everything left is flushed.
        """
        if finished:
            self.finish()
        unsent = "".join(self._unsent)
        if self.finished:
            out, rest = unsent, ""
        else:
            cut = len(unsent) - self._holdback
            if cut <= 0:
                self._unsent = [unsent] if unsent else []
                return ""
            out, rest = unsent[:cut], unsent[cut:]
        self._unsent = [rest] if rest else []
        self._sent += len(out)
        return out

    # ---- internals --------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, force: bool) -> str:
        """The text the pending tokens add after the prefix, or "" while they must wait."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._n_prefix])
        prefix_text = self._prefix_text
        full = self._decode(self._window)
        complete = len(full) > len(prefix_text) and not full.endswith(REPLACEMENT_CHAR)
        if not complete:
            if not force and len(self._window) - self._n_prefix < MAX_PENDING_TOKENS:
                return ""  # wait for the character to complete
            # give up waiting: emit what there is and restart the window without context, so a
            # later continuation byte cannot retroactively change text already emitted
            self._window, self._n_prefix, self._prefix_text = [], 0, ""
            return full[len(prefix_text):]
        # the pending tokens become the next prefix (vLLM: prefix_offset = read_offset)
        del self._window[: self._n_prefix]
        self._n_prefix = len(self._window)
        self._prefix_text = None  # decoded lazily on the next token
        return full[len(prefix_text):]

    def _append(self, text: str) -> bool:
        """Add decoded text to the output; look for a stop string ending in it."""
        before = self._length
        self._chunks.append(text)
        self._length += len(text)
        self._joined = None
        self._unsent.append(text)
        if not self.stop:
            return False
        # a match must end inside the new text, so it starts at most (longest stop - 1) chars before
        start = max(0, before - (self._max_stop_len - 1))
        region = self._tail(self._length - start)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = region.find(s)
            if i != -1 and (best is None or (i, len(s)) < best[:2]):
                best = (i, len(s), s)
        if best is None:
            return False
        index, length, stop_str = best
        index += start
        self._truncate(index + length if self.include_stop_str_in_output else index)
        self.stop_reason = stop_str
        # nothing is pending any more: later tokens are ignored
        self._window, self._n_prefix, self._prefix_text = [], 0, ""
        return True

    def _tail(self, n: int) -> str:
        """The last n characters of output_text, without joining everything."""
        if n <= 0:
            return ""
        parts: list[str] = []
        got = 0
        for chunk in reversed(self._chunks):
            parts.append(chunk)
            got += len(chunk)
            if got >= n:
                break
        text = "".join(reversed(parts))
        return text[len(text) - n:]

    def _truncate(self, length: int) -> None:
        # stop matches start after everything new_text() returned (that is what the hold-back
        # guarantees), so only unsent text is ever cut
        assert length >= self._sent, (length, self._sent)
        text = self.output_text[:length]
        self._chunks = [text] if text else []
        self._joined = text
        self._length = length
        self._unsent = [text[self._sent:]] if length > self._sent else []
