"""Closing a constrained output before max_tokens cuts it.

A grammar keeps every token valid, but not the output as a whole: a small model at temperature
1 can loop inside a JSON array until `max_tokens` and leave invalid JSON behind. So in the last
`CLOSING_WINDOW` tokens of a constrained request the engine keeps, for the row's matcher state,
a *closing path*: the tokens that take the grammar to an accepting state (arrays, strings and
objects closed, required properties filled with minimal values, a tool call's closing tag
written). Each sampled token is checked against it: a token after which the closing path no
longer fits in what is left of the budget is replaced by the first token of the current path,
and the row switches to *closing mode*: it writes the rest of the path and ends with
`finish_reason` "length" and `output_closure` "closed". Where no path fits (the budget was
already too small when the row entered the window, or no path was found), the output ends
cut and says so: `output_closure` "unclosable".

The path comes from a deterministic greedy walk over the matcher (llguidance): at each step the
grammar's forced tokens if it has any, else the first allowed single-byte token in an order
that prefers what closes (`"` `]` `}`), then minimal values (`0`, `true`, `null`), then the
rest (`_choose` tells a `"` that closes a string from one that would open another). llguidance's mask only allows tokens from which the grammar can still be completed, so
the walk never dead-ends; it is bounded by `MAX_PATH_TOKENS` matcher steps, a few milliseconds
(a walk that has not closed by then counts as no path). It is not always the shortest path
(`10` for an integer of minimum 3), but a short one found at a known cost, once per token of
the window for each constrained row only, on the engine's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# the last tokens of a constrained request's budget in which its closing path is kept
CLOSING_WINDOW = 64
# matcher steps one walk may take: a path longer than this is not looked for
MAX_PATH_TOKENS = 4 * CLOSING_WINDOW

# the walk's preference among single bytes the grammar allows: what closes first, then minimal
# values and the letters keys and enums start with, separators, and what opens last
_PRINTABLE = bytes(range(32, 127))
_FIRST = b'"]}0123456789tnf' + bytes(sorted(set(b"abcdefghijklmnopqrstuvwxyz") - set(b"tnf"))) + b", :"
_LAST = b"[{"
BYTE_ORDER = (_FIRST + b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"
              + bytes(b for b in _PRINTABLE if b not in _FIRST and b not in _LAST and not chr(b).isalnum())
              + _LAST + b"\n\t" + bytes(b for b in range(256) if b not in _PRINTABLE and b not in b"\n\t"))
QUOTE, CLOSERS = ord('"'), (ord("]"), ord("}"))
# letters that only a string's content allows next to `]` or `}` (not a number's exponent, not
# the start of true, false or null)
_TEXT_LETTERS = frozenset(b"abcdghijklmopqrsuvwxyz")
_ALNUM = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


class ClosingPaths:
    """Finds closing paths for one tokenizer (an `llguidance.LLTokenizer`)."""

    def __init__(self, ll_tokenizer: Any, eos_token_ids: list[int]):
        self.ll_tokenizer = ll_tokenizer
        self.eos_token_ids = set(eos_token_ids)
        # what ends an output that is complete already
        self.eos: int | None = eos_token_ids[0] if eos_token_ids else None
        # the single-byte tokens: byte -> token id
        self.token_of = {b: ids[0] for b in range(256) if len(ids := ll_tokenizer.tokenize_bytes(bytes([b]))) == 1}
        self.candidate_bytes = list(self.token_of)
        self.candidates = np.array([self.token_of[b] for b in self.candidate_bytes], dtype=np.int64)

    def find(self, matcher: Any, limit: int = MAX_PATH_TOKENS) -> list[int] | None:
        """The tokens from `matcher`'s state to an accepting one ([] if it accepts already), or
        None if the walk finds none within `limit` steps. The matcher ends where it began."""
        walked = self._walk(matcher, limit)
        if walked is None or len(walked) < 2:
            return walked
        # the tokenizer's own spelling of the same bytes is often shorter (`"]}` in one token)
        spelled = self.ll_tokenizer.tokenize_bytes(self.ll_tokenizer.decode_bytes(walked))
        if len(spelled) >= len(walked):
            return walked
        taken = matcher.try_consume_tokens(spelled)
        accepted = taken == len(spelled) and matcher.is_accepting()
        if taken:
            matcher.rollback(taken)
        return spelled if accepted else walked

    def _walk(self, matcher: Any, limit: int) -> list[int] | None:
        if matcher.is_error():
            return None
        walked: list[int] = []
        try:
            while not matcher.is_accepting():
                if len(walked) >= limit:
                    return None
                step = matcher.compute_ff_tokens() or self._choose(matcher)
                if not step:
                    return None
                taken = matcher.try_consume_tokens(step)
                walked += step[:taken]
                if taken < len(step):
                    return None
            return walked
        finally:
            if walked:
                matcher.rollback(len(walked))

    def _choose(self, matcher: Any) -> list[int]:
        """The next token of the walk (see the module docstring); [] if the grammar allows none.

        Where `"` and `]` or `}` are all allowed, `"` may close a string or open one (an empty
        array's `]` is shorter than a first item): it closes one if no letter or digit may follow it.
        Where `"` is not allowed but letters and `]` are, the output is inside a string that must
        grow (a minLength), and a letter reads better than `]`."""
        allowed = self._allowed_bytes(matcher)
        if not allowed:
            ids = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                                               bitorder="little"))
            return next(([int(t)] for t in ids if int(t) not in self.eos_token_ids), [])
        closers = [b for b in CLOSERS if b in allowed]
        if QUOTE in allowed and closers:
            return [self.token_of[QUOTE if self._quote_closes(matcher) else closers[0]]]
        if QUOTE not in allowed and closers and allowed & _TEXT_LETTERS:
            allowed &= _TEXT_LETTERS
        return [self.token_of[next(b for b in BYTE_ORDER if b in allowed)]]

    def _allowed_bytes(self, matcher: Any) -> set[int]:
        """The bytes whose single-byte tokens the grammar allows next."""
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        c = self.candidates
        allowed = (mask[c >> 3] >> (c & 7)) & 1
        return {self.candidate_bytes[i] for i in np.flatnonzero(allowed)}

    def _quote_closes(self, matcher: Any) -> bool:
        if matcher.try_consume_tokens([self.token_of[QUOTE]]) != 1:
            return True
        try:
            return not (self._allowed_bytes(matcher) & (_ALNUM | {QUOTE}))
        finally:
            matcher.rollback(1)


@dataclass
class Closing:
    """A constrained row inside the window: the closing path from its matcher's state (None: no
    path found), and whether the row is in closing mode (it writes `path` to its end)."""

    path: list[int] | None
    forcing: bool = False

    @property
    def done(self) -> bool:
        """Closing mode has written the whole path."""
        return self.forcing and not self.path


class OutputCloser:
    """The engine's per-step decisions for its constrained rows (see the module docstring)."""

    def __init__(self, paths: ClosingPaths):
        self.paths = paths

    def forced_token(self, seq: Any) -> int | None:
        """The token a row in closing mode must write next, or None (the row samples)."""
        closing = seq.closing
        return closing.path[0] if closing is not None and closing.forcing and closing.path else None

    def check(self, seq: Any, token: int, left: int) -> int | None:
        """After `token` was sampled for `seq` with `left` tokens of budget (this one included):
        None to keep it, or the token to write instead (the row enters closing mode). Records the
        closing path from the state after the token written."""
        closing = seq.closing
        if closing is None:  # entering the window: the path from the current state
            closing = seq.closing = Closing(self.paths.find(seq.matcher))
        if closing.forcing:  # the forced token was sampled (its mask allowed nothing else)
            closing.path = closing.path[1:]
            return None
        if token in self.paths.eos_token_ids:
            return None  # the grammar allowed the end here: the output is complete
        path = closing.path
        if path and path[0] == token:
            after: list[int] | None = path[1:]
        else:
            if seq.matcher.try_consume_tokens([token]) != 1:
                return None  # (the mask allowed it; nothing to decide if the matcher disagrees)
            after = self.paths.find(seq.matcher)
            seq.matcher.rollback(1)
        if after is not None and len(after) <= left - 1:
            closing.path = after
            return None
        if path is not None and len(path) <= left and (path or self.paths.eos is not None):
            # closing mode; from an accepting state (no path) the output ends here
            closing.forcing, closing.path = True, path[1:]
            return path[0] if path else self.paths.eos
        closing.path = after  # no path fits: the output may end cut ("unclosable")
        return None


def output_closure(seq: Any) -> str | None:
    """A finished row's `output_closure`: "closed" if closing mode ended it, "unclosable" if the
    budget cut its constrained output where the grammar does not accept, else None."""
    if seq.matcher is None or seq.finish_reason != "length":
        return None
    if seq.closing is not None and seq.closing.forcing:
        return "closed"
    return None if seq.matcher.is_accepting() else "unclosable"
